"""attention_out_proj's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says how
topics are found and ordered)."""
from __future__ import annotations

from fusionpass.bench_cases import Case, attention_layers
from fusionpass.conformance.attention_layers import Bloom, GPT2, Shape

ORDER = 90


def attention_out_proj_cases(smoke):

    gpt2, bloom = (Shape(1, 2, 2, 64, 64),) * 2 if smoke else (Shape(16, 12, 12, 1024, 64), Shape(8, 16, 16, 2048, 64))
    fusions = ("flash_attention", "attention_out_proj")
    return [
        Case(f"GPT-2 eager attention + head merge + c_proj {gpt2}", attention_layers(GPT2, gpt2), True, fusions, True,
             without="attention_out_proj"),
        Case(f"BLOOM attention + _merge_heads + dense {bloom}", attention_layers(Bloom, bloom), True, fusions, True,
             without="attention_out_proj"),
    ]


TOPICS = {"attention_out_proj": attention_out_proj_cases}
