"""rms_norm_residual's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says how
topics are found and ordered)."""
from __future__ import annotations

import torch
from torch import nn

from fusionpass.bench_cases import Case, rows_module

ORDER = 10


class LlamaAddRMSNorm(nn.Module):
    """HF Llama's decoder-layer residual add followed by LlamaRMSNorm: returns (y, h)."""

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.eps = eps

    def forward(self, x, residual):
        h = residual + x
        hf = h.to(torch.float32)
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hf.to(x.dtype), h


def rms_norm_residual_cases(smoke):
    rows = 8 if smoke else 16384
    cases = [
        Case(f"Llama add+RMSNorm {rows}x4096", rows_module(LlamaAddRMSNorm, rows, 4096), True,
             ("rms_norm_residual",), True),
        Case(f"Llama add+RMSNorm {rows}x4096", rows_module(LlamaAddRMSNorm, rows, 4096), False,
             ("rms_norm_residual",), True),
        # below rms_norm_min_width: Inductor's own fused reduction wins at narrow rows
        Case(f"Llama add+RMSNorm {rows}x1024", rows_module(LlamaAddRMSNorm, rows, 1024), True,
             ("rms_norm_residual",), False, {"rms_norm_min_width": 1}),
    ]
    return cases


TOPICS = {"rms_norm_residual": rms_norm_residual_cases}
