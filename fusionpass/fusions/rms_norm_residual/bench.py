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
    return [Case(f"Llama add+RMSNorm {rows}x{width}", rows_module(LlamaAddRMSNorm, rows, width), train,
                 ("rms_norm_residual",), _selected(width, train), OPENED)
            for width, train in ((4096, True), (4096, False), (1024, True))]


# The shape classes the cost rule is measured on: the hidden sizes of checkpoints users train
# (Qwen2.5-0.5B 896, SmolLM2-360M 960, Qwen3-0.6B 1024, Gemma-3-1B 1152, Qwen2.5-1.5B 1536,
# Llama-3.2-1B 2048, Gemma-2-2B 2304, Phi-2 and Qwen3-4B 2560, gpt-oss-20b 2880, Llama-3.2-3B and
# Phi-3-mini 3072, Qwen2.5-7B and Gemma-2-9B 3584, Llama-3-8B 4096, Qwen3-14B and Mistral-Nemo 5120,
# DeepSeek-V3 7168, Llama-3-70B 8192), over one B4 S2048 batch of tokens, and the per-head q/k norms
# of Qwen3 and OLMo-2 (width 128, one row per token and head).
WIDTHS = (896, 960, 1024, 1152, 1536, 2048, 2304, 2560, 2880, 3072, 3584, 4096, 5120, 7168, 8192)
QK_NORM_WIDTH, QK_NORM_HEADS = 128, 16
OPENED = {"rms_norm_min_width": 1, "rms_norm_max_width": 1 << 20, "rms_norm_train_max_width": 1 << 20,
          "rms_norm_min_speedup": 0.0}


def _kernel_excludes(width: int, train: bool) -> bool:
    from fusionpass.cost import mode
    from fusionpass.fusions.rms_norm_residual.pattern import PARTIAL_CHUNK

    return PARTIAL_CHUNK.check(width, mode(train)) is not None


def _selected(width: int, train: bool) -> bool:
    from fusionpass.cost import mode
    from fusionpass.fusions.rms_norm_residual.pattern import width_rule

    return width_rule(width, mode(train)) is None


def rms_norm_widths_cases(smoke):
    """Every width at the rule's bounds opened: the table the rule's bounds are read from. Widths the
    forward's partial second chunk excludes in inference (PARTIAL_CHUNK, no setting) stay out there."""
    tokens = 8 if smoke else 8192
    shapes = [(tokens, w) for w in ((1024, 2048) if smoke else WIDTHS)]
    shapes.append((tokens * (1 if smoke else QK_NORM_HEADS), QK_NORM_WIDTH))
    return [Case(f"Llama add+RMSNorm {rows}x{width}", rows_module(LlamaAddRMSNorm, rows, width), train,
                 ("rms_norm_residual",), _selected(width, train), OPENED, shape_class=width)
            for rows, width in shapes for train in (True, False) if not _kernel_excludes(width, train)]


TOPICS = {"rms_norm_residual": rms_norm_residual_cases, "rms_norm_widths": rms_norm_widths_cases}
# the topic whose rows `benchmarks/suite.py --cost-tables` writes into this folder's cost_table.py
COST_TABLE_TOPIC = "rms_norm_widths"
