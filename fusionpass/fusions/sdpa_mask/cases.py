"""Conformance cases of sdpa_mask: SDPA called with transformers' boolean masks that the pass
proves causal or all-true keeps the call, without the mask. The layers and what every case shares
(two layers per case, so every count is per layer times two): `fusionpass.conformance.attention_layers`.
"""
from __future__ import annotations

from fusionpass.conformance.attention_layers import (
    G1000, G513, G77, LAYERS, M1000, M513, M77, Bert, Llama, always, layer_cases,
)
from fusionpass.conformance.builders import BF16, FP16, FP32


CASES = [
    # SDPA with transformers' boolean masks, proven causal / all-true: SDPA keeps the call, without
    # the mask (GQA through enable_gqa); rope fuses the Llama rotation alongside
    *layer_cases("sdpa_mask", "causal_mask", "llama-sdpa", Llama, always(rope=LAYERS, sdpa_mask=LAYERS), [
        (BF16, G77, True, None), (FP16, G513, False, None), (FP32, G1000, True, None),
    ], impl="sdpa"),
    *layer_cases("sdpa_mask", "none_mask", "bert-sdpa", Bert, always(sdpa_mask=LAYERS), [
        (BF16, M513, True, None), (FP16, M77, False, None), (FP32, M1000, False, None),
    ]),
    # (the same AND the attention_mask's padding through torch.cond, causal/none_mask_if_unpadded,
    # is CPU only: Inductor's CUDA lowering of the cond failed in every case, fusions/sdpa_runtime_check/pattern.py)
]
