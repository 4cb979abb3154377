"""layer_norm_dropout_residual's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says
how topics are found and ordered)."""
from __future__ import annotations

from torch import nn

from fusionpass.bench_cases import Case, rows_module

ORDER = 20


class BertOutput(nn.Module):
    """BERT's output block after its dense layer: LayerNorm(dropout(x) + input_tensor)."""

    def __init__(self, width, p=0.1):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(width, eps=1e-12)
        self.dropout = nn.Dropout(p)

    def forward(self, x, residual):
        return self.LayerNorm(self.dropout(x) + residual)


class PreLNResidual(nn.Module):
    """GPT-2/NeoX/OPT pre-LN: h = residual + dropout(out); the next block's LayerNorm(h); h goes on."""

    def __init__(self, width, p=0.1):
        super().__init__()
        self.ln = nn.LayerNorm(width, eps=1e-5)
        self.dropout = nn.Dropout(p)

    def forward(self, x, residual):
        h = residual + self.dropout(x)
        return self.ln(h), h


def layer_norm_dropout_residual_cases(smoke):
    rows = 8 if smoke else 16384
    fusion = ("layer_norm_dropout_residual",)
    return [
        Case(f"BERT LN(dropout(x)+r) p=0.1 {rows}x768", rows_module(BertOutput, rows, 768), True, fusion, True),
        Case(f"GPT-2 pre-LN h=r+dropout(x); LN(h) p=0.1 {rows}x4096", rows_module(PreLNResidual, rows, 4096), True,
             fusion, True),
        # inference below layer_norm_inference_min_width
        Case(f"BERT LN(x+r) {rows}x1024", rows_module(BertOutput, rows, 1024), False, fusion, False,
             {"layer_norm_inference_min_width": 1}),
    ]


TOPICS = {"layer_norm_dropout_residual": layer_norm_dropout_residual_cases}
