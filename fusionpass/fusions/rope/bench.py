"""rope's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says how topics are found
and ordered)."""
from __future__ import annotations

import torch

from fusionpass.bench_cases import Case, on_device
from fusionpass.fusions.rope.cases import GptOssRope, LlamaRope

ORDER = 40


def llama_rope(b, s, hq, hkv, d, module_class=LlamaRope):

    def build(device, dtype):
        module = on_device(device, lambda: module_class(d)).to(dtype)
        q = torch.randn(b, s, hq * d, device=device, dtype=dtype)
        k = torch.randn(b, s, hkv * d, device=device, dtype=dtype)
        return module, (q, k, torch.arange(s, device=device).repeat(b, 1))

    return build


def rope_cases(smoke):
    fusion = ("rope",)
    if smoke:
        return [Case("HF rotate_half q/k B1 H4/2 S64 D64", llama_rope(1, 64, 4, 2, 64), True, fusion, True)]
    return [
        # the Llama 8L benchmark's q and k (40 MiB together)
        Case("HF rotate_half q/k B4 H16/4 S2048 D128", llama_rope(4, 2048, 16, 4, 128), True, fusion, True),
        # above rope_max_bytes (160 MiB of q and k)
        Case("HF rotate_half q/k B4 H32/8 S4096 D128", llama_rope(4, 4096, 32, 8, 128), True, fusion, False,
             {"rope_kernel": True}),
        # gpt-oss-20b's q and k (64/8 heads of 64) in its rotation of halves, one B4 S2048 batch
        Case("gpt-oss halves q/k B4 H64/8 S2048 D64", llama_rope(4, 2048, 64, 8, 64, GptOssRope), True, fusion,
             True),
    ]


TOPICS = {"rope": rope_cases}
