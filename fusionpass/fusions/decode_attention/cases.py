"""Conformance cases of decode_attention: decode and verification steps of Llama layers over a
static cache, SDPA and eager, with and without padding, and generate()'s prebuilt mask. The layers
and what every case shares (two layers per case, so every count is per layer times two):
`fusionpass.conformance.attention_layers`.
"""
from __future__ import annotations

from fusionpass.conformance.attention_layers import LAYERS, Shape, StaticCacheDecode, layer_cases
from fusionpass.conformance.builders import BF16, FP16, FP32


def _decode(train: bool, shape: Shape, dtype) -> dict:
    return {} if dtype == FP32 else {"decode_attention": LAYERS}


_decode.kernel_route = True


# decode steps over a static cache (inference only: the kernel is forward-only); the prompt fills
# part of the cache, the step's tokens go after it
CASES = [
    *layer_cases("decode_attention", "static_cache", "llama-sdpa", StaticCacheDecode, _decode, [
        (BF16, Shape(2, 16, 4, 1000, 128, q=1), False, None), (FP16, Shape(3, 8, 8, 513, 64, q=4), False, "left"),
        (BF16, Shape(1, 12, 2, 333, 256, q=16), False, None), (FP32, Shape(1, 12, 2, 333, 256, q=16), False, None),
    ], impl="sdpa", prompt=301),
    # head dims that are not powers of two (padded in registers; opt-in: decode_attention_padded_head_dims)
    *layer_cases("decode_attention", "static_cache", "llama-sdpa", StaticCacheDecode, _decode, [
        (BF16, Shape(2, 16, 4, 1000, 80, q=1), False, "left"), (FP16, Shape(3, 8, 8, 333, 96, q=4), False, None),
    ], {"decode_attention_padded_head_dims": True}, impl="sdpa", prompt=301),
    *layer_cases("decode_attention", "static_cache", "llama-eager", StaticCacheDecode, _decode, [
        (BF16, Shape(3, 8, 2, 513, 64, q=4), False, "left"), (FP16, Shape(1, 16, 4, 1000, 256, q=1), False, None),
        (FP16, Shape(2, 12, 12, 77, 128, q=16), False, "right"), (FP32, Shape(2, 12, 12, 77, 128, q=16), False, "right"),
    ], impl="eager", prompt=45),
    # generate()'s compiled decode step: a [B, 1, 1, L] mask built outside the graph
    *layer_cases("decode_attention", "one_query_any_mask", "llama-sdpa-prebuilt", StaticCacheDecode,
                 _decode, [
        (BF16, Shape(2, 16, 4, 513, 128, q=1), False, "left"),
    ], impl="sdpa", prompt=301, prebuilt=True),
]
