"""decode_attention's benchmark topic (benchmarks/suite.py; fusionpass.bench_cases says how topics
are found and ordered). Its opt-in head dims are in flash_attention's attention_head_dims topic."""
from __future__ import annotations

from fusionpass.bench_cases import decode_step_case
from fusionpass.conformance.attention_layers import Shape

ORDER = 50


def decode_attention_cases(smoke):
    shapes = [Shape(1, 4, 2, 128, 64, q=1)] if smoke else [Shape(1, 32, 8, 32768, 128, q=1),
                                                          Shape(8, 32, 8, 8192, 128, q=1)]
    return [decode_step_case(s) for s in shapes]


TOPICS = {"decode_attention": decode_attention_cases}
