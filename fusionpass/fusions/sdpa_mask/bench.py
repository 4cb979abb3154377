"""sdpa_mask's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says how topics are
found and ordered)."""
from __future__ import annotations

from fusionpass.bench_cases import Case, attention_layers
from fusionpass.conformance.attention_layers import Bert, Llama, Shape

ORDER = 60


def sdpa_mask_cases(smoke):

    fusion = ("sdpa_mask",)
    llama, bert = (Shape(1, 4, 2, 64, 64), Shape(2, 4, 4, 64, 64)) if smoke else (
        Shape(4, 16, 4, 2048, 128), Shape(32, 12, 12, 512, 64))
    return [
        Case(f"Llama sdpa, create_causal_mask {llama}", attention_layers(Llama, llama, impl="sdpa"), True, fusion, True),
        Case(f"BERT sdpa, create_bidirectional_mask {bert}", attention_layers(Bert, bert), True, fusion, True),
    ]


TOPICS = {"sdpa_mask": sdpa_mask_cases}
