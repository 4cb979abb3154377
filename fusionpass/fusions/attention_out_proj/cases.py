"""Conformance cases of attention_out_proj: the attention kernel's output written token-major
where the heads are merged for the output projection. The layers and what every case shares (two
layers per case, so every count is per layer times two): `fusionpass.conformance.attention_layers`.
"""
from __future__ import annotations

from fusionpass.conformance.attention_layers import (
    G513, GPT2, M1000, M513, M77, MP1000, Bloom, Llama, Mpt, Shape, kernel_counts, layer_cases,
)
from fusionpass.conformance.builders import BF16, FP16, FP32


# the kernel writes its output token-major where the heads are merged for the output projection
CASES = [
    *layer_cases("attention_out_proj", "merge_heads", "bloom-eager", Bloom, kernel_counts(), [
        (BF16, M1000, False, None), (FP16, Shape(2, 12, 12, 77, 80), True, None), (BF16, M513, False, None),
        (FP32, M513, False, None),
    ]),
    *layer_cases("attention_out_proj", "transpose_reshape", "gpt2-eager", GPT2,
                 kernel_counts(), [
        (BF16, M77, True, None), (FP32, M77, True, None),
    ]),
    *layer_cases("attention_out_proj", "transpose_reshape", "llama-eager", Llama,
                 kernel_counts("rope"), [
        (BF16, G513, True, None),
    ], impl="eager"),
    *layer_cases("attention_out_proj", "transpose_reshape", "mpt-eager", Mpt, kernel_counts(), [
        (FP16, MP1000, False, None),
    ]),
]
