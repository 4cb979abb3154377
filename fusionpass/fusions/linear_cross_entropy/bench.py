"""linear_cross_entropy's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says how
topics are found and ordered)."""
from __future__ import annotations

import torch
from torch import nn

from fusionpass.bench_cases import Case, on_device
from fusionpass.fusions.linear_cross_entropy.cases import CausalLMHead, causal_labels

ORDER = 30


def lm_head_loss(tokens, width, vocab):

    def build(device, dtype):
        head = on_device(device, lambda: CausalLMHead(width, vocab)).to(dtype)
        nn.init.normal_(head.lm_head.weight, std=2.0 * width ** -0.5)  # a trained LM's logit spread
        labels = causal_labels(1, tokens, vocab).to(device)
        return head, (torch.randn(1, tokens, width, device=device, dtype=dtype), labels)

    return build


def linear_cross_entropy_cases(smoke):
    n = 16 if smoke else 8192
    fusion = ("linear_cross_entropy",)
    big, small = (1000, 500) if smoke else (128256, 50257)
    return [
        Case(f"lm_head+CE (HF ForCausalLMLoss) N{n} D4096 V{big}", lm_head_loss(n, 64 if smoke else 4096, big),
             True, fusion, True, {"linear_cross_entropy_min_vocab": 1} if smoke else {}),
        # GPT-2's vocabulary, below linear_cross_entropy_min_vocab
        Case(f"lm_head+CE (HF ForCausalLMLoss) N{n} D768 V{small}", lm_head_loss(n, 64 if smoke else 768, small),
             True, fusion, False, {"linear_cross_entropy_min_vocab": 1}),
    ]


TOPICS = {"linear_cross_entropy": linear_cross_entropy_cases}
