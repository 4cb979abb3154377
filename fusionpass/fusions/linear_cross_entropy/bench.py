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


# The shape classes the cost rule is measured on: (hidden, vocabulary) of checkpoints users train,
# Llama-2-7B (4096, 32000), Phi-3-mini (3072, 32064), T5-base (768, 32128), Mistral-7B-v0.3
# (4096, 32768), SmolLM2-360M (960, 49152), GPT-2 (768, 50257), OLMo-2-7B (4096, 100352),
# Llama-3.2-1B (2048, 128256), Llama-3-8B (4096, 128256), DeepSeek-V3 (7168, 129280), Qwen2.5-0.5B
# (896, 151936), Qwen2.5-7B (3584, 152064), gpt-oss-20b (2880, 201088), Gemma-2-2B (2304, 256000),
# over one B4 S2048 batch of tokens.
HEADS = ((4096, 32000), (3072, 32064), (768, 32128), (4096, 32768), (960, 49152), (768, 50257), (4096, 100352),
         (2048, 128256), (4096, 128256), (7168, 129280), (896, 151936), (3584, 152064), (2880, 201088),
         (2304, 256000))


def linear_cross_entropy_vocabs_cases(smoke):
    """Every (hidden, vocabulary) with the rule's bounds opened, the loss alone (a graph that
    returns logits requiring grad is a near miss): the table the rule is read from."""
    from fusionpass.fusions.linear_cross_entropy.pattern import VOCAB

    n = 16 if smoke else 8192
    heads = ((64, 500), (64, 1000)) if smoke else HEADS
    opened = {"linear_cross_entropy_min_vocab": 1, "linear_cross_entropy_min_speedup": 0.0}
    return [Case(f"lm_head+CE (HF ForCausalLMLoss) N{n} D{d} V{v}", lm_head_loss(n, d, v), True,
                 ("linear_cross_entropy",), VOCAB.check(v, "training") is None, opened, shape_class=v)
            for d, v in heads]


TOPICS = {"linear_cross_entropy": linear_cross_entropy_cases,
          "linear_cross_entropy_vocabs": linear_cross_entropy_vocabs_cases}
# the topic whose rows `benchmarks/suite.py --cost-tables` writes into this folder's cost_table.py
COST_TABLE_TOPIC = "linear_cross_entropy_vocabs"
