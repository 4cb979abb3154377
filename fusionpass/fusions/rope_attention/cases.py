"""Conformance cases of rope_attention: q's rotation moved into the attention kernel, after the rope
fusion (rope_kernel) or from the graph (graph_rotation). The layers and what every case shares (two
layers per case, so every count is per layer times two): `fusionpass.conformance.attention_layers`.
"""
from __future__ import annotations

from fusionpass.conformance.attention_layers import (
    G1000_128, G333_256, G513, G77, GPTJ, KERNEL, M513, M77, NO_ROPE, Llama, Shape, kernel_counts,
    layer_cases,
)
from fusionpass.conformance.builders import BF16, FP16, FP32


# q's rotation moved into the kernel that reads it: inference by default (training opted in).
# rope_kernel: rope fused q and k into one fusionpass::rope call first (sequences of >= 64 tokens),
# rope_attention takes q's output and leaves a k-only rope call; graph_rotation: rope off, q's
# rotation is still the graph's (rotate_half; GPT-J's interleaved partial form, fp32, stays out)
CASES = [
    *layer_cases("rope_attention", "rope_kernel", "llama-eager", Llama, kernel_counts("rope"), [
        (BF16, G77, False, None), (FP16, G513, False, None), (BF16, G1000_128, False, None),
        (FP32, G1000_128, False, None),
    ], impl="eager"),
    *layer_cases("rope_attention", "rope_kernel", "llama-eager", Llama,
                 kernel_counts("rope", True), [
        (BF16, G333_256, True, None),
    ], {"rope_attention_training": True}, impl="eager"),
    *layer_cases("rope_attention", "rope_kernel", "llama-sdpa", Llama, kernel_counts("rope"), [
        (BF16, Shape(3, 16, 4, 333, 128), False, "right"),
    ], KERNEL, impl="sdpa"),
    # GPT-J is fp32 only (its _attn upcasts q and k), so on CUDA these check that it stays out
    *layer_cases("rope_attention", "rope_kernel", "gptj-eager", GPTJ, kernel_counts("rope"), [
        (FP32, M77, False, None),
    ], {"rope_attention_interleaved": True}),
    *layer_cases("rope_attention", "graph_rotation", "llama-eager", Llama,
                 kernel_counts("graph", True), [
        (BF16, G77, False, None), (FP16, G1000_128, False, None), (BF16, G513, False, None), (FP32, G513, False, None),
    ], NO_ROPE, impl="eager"),
    *layer_cases("rope_attention", "graph_rotation", "llama-eager", Llama,
                 kernel_counts("graph", True), [
        (BF16, G77, True, None), (FP32, G77, True, None),
    ], {**NO_ROPE, "rope_attention_training": True}, impl="eager"),
    *layer_cases("rope_attention", "graph_rotation", "gptj-eager", GPTJ,
                 kernel_counts("graph", True), [
        (FP32, M513, False, None),
    ], {**NO_ROPE, "rope_attention_interleaved": True}),
]
