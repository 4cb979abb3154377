"""swiglu_mlp's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says how topics are
found and ordered)."""
from __future__ import annotations

import torch
from torch import nn

from fusionpass.bench_cases import Case, on_device
from fusionpass.fusions.swiglu_mlp.cases import GatedMLP

ORDER = 100


def llama_mlp(rows, hidden, inter):

    def build(device, dtype):
        module = on_device(device, lambda: GatedMLP(hidden, inter, nn.SiLU())).to(dtype)
        return module, (torch.randn(rows, hidden, device=device, dtype=dtype),)

    return build


def swiglu_mlp_cases(smoke):
    fusion = ("swiglu_mlp",)
    k, n = (64, 128) if smoke else (4096, 14336)
    prefill = 16 if smoke else 8192
    return [
        Case(f"Llama SwiGLU MLP M1 K{k} N{n}", llama_mlp(1, k, n), False, fusion, True),
        Case(f"Llama SwiGLU MLP M16 K{k} N{n}", llama_mlp(16, k, n), False, fusion, True),
        # training: the op takes the down projection and recomputes act*mul in the backward
        # (swiglu_mlp_recompute_product, the default), which keeps one ffn-wide tensor fewer
        Case(f"Llama SwiGLU MLP M{prefill} K{k} N{n}", llama_mlp(prefill, k, n), True, fusion, True),
        # prefill inference: cuBLAS GEMMs + Inductor's act*mul are as fast
        Case(f"Llama SwiGLU MLP M{prefill} K{k} N{n}", llama_mlp(prefill, k, n), False, fusion, False,
             {"swiglu_mlp_kernel": True}),
    ]


TOPICS = {"swiglu_mlp": swiglu_mlp_cases}
