"""rope_attention's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says how topics
are found and ordered)."""
from __future__ import annotations

from fusionpass.bench_cases import Case, attention_layers
from fusionpass.conformance.attention_layers import Llama, Shape

ORDER = 80


def rope_attention_cases(smoke):

    shape = Shape(1, 4, 2, 64, 64) if smoke else Shape(4, 16, 4, 2048, 128)
    fusions = ("rope", "flash_attention", "rope_attention")
    build = attention_layers(Llama, shape, impl="eager")
    return [
        Case(f"Llama eager attention, rotate_half q {shape}", build, False, fusions, True, without="rope_attention"),
        Case(f"Llama eager attention, rotate_half q {shape}", build, True, fusions, False,
             {"rope_attention_training": True}, without="rope_attention"),
    ]


TOPICS = {"rope_attention": rope_attention_cases}
