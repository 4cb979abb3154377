"""Conformance cases of flash_attention: every route to fusionpass::flash_attention (attention
written in torch ops, ALiBi, SDPA's float and boolean masks with and without padding, sliding
windows, MLA, packed sequences) and the cuDNN route (fusionpass::padded_attention). fp32 rows of a
kernel route check that fp32 stays out of the kernel on CUDA (FP32_KEPT_OUT). The layers and what
every case shares (two layers per case, so every count is per layer times two):
`fusionpass.conformance.attention_layers`.
"""
from __future__ import annotations

import dataclasses

import torch

from fusionpass.conformance import Case
from fusionpass.conformance.attention_layers import (
    F77, G1000, G1000_128, G333_256, G513, GP2049, G77, GP1000, GP513, GP77, GPD256, GPT2, KERNEL, LAYERS, M1000,
    M513, M77, MP1000, MP513, MP77, Bert, Bloom, DeepseekMLA, Falcon, Gemma2, GptOss, Llama, Mpt, PackedLlama,
    Shape, always, kernel_counts, layer_cases,
)
from fusionpass.conformance.builders import BF16, FP16, FP32


# fusionpass::padded_attention at the cases' short lengths (on by default from a longer one)
CUDNN_PADDING = {"attention_cudnn_padding": True, "attention_cudnn_padding_min_length": 1}
SOFTCAP_TRAINING = {"attention_softcap_training": True}  # soft-capped attention in training (opt-in)


def _cudnn_route(train: bool, shape: Shape, dtype) -> dict:
    """Every layer's attention through fusionpass::padded_attention: rope matches, flash_attention
    counts the match, attention_out_proj makes the op write token-major; the op is not one
    rope_attention edits."""
    return {"rope": LAYERS} if dtype == FP32 else {"rope": LAYERS, "flash_attention": LAYERS,
                                                    "attention_out_proj": LAYERS}


_cudnn_route.kernel_route = True


def _cudnn_cases(rows, settings=CUDNN_PADDING, name="llama-sdpa-cudnn") -> list[Case]:
    """The cuDNN route's cases: on CUDA they fail without cudnn-frontend (the `cudnn` extra), so that
    a run without it can never pass them through our kernel alone."""
    cases = layer_cases("flash_attention", "causal_kernel_padded", name, Llama, _cudnn_route, rows,
                        settings, impl="sdpa")

    def needs_cudnn(make):
        def checked(dtype, device):
            from fusionpass.kernels import cudnn_attention

            if torch.device(device).type == "cuda" and not cudnn_attention.available():
                raise RuntimeError("cudnn-frontend is not installed: the cuDNN route's cases need the cudnn extra")
            return make(dtype, device)

        return checked

    return [dataclasses.replace(c, make=needs_cudnn(c.make)) for c in cases]


CASES = [
    # attention written in torch ops -> fusionpass::flash_attention (on by default)
    *layer_cases("flash_attention", "eager_kernel", "gpt2-eager", GPT2, kernel_counts(), [
        (BF16, M77, True, None), (FP16, M513, True, None), (FP32, M1000, False, None), (BF16, M1000, False, None),
    ]),
    # Gemma-2's soft-capped scores (caps of 50, its default, and 5, which most scores reach), a
    # sliding-window layer and a full one, GQA, with the rope fusion in front
    # (in training with attention_softcap_training: leaner than plain compile, but slower)
    *layer_cases("flash_attention", "eager_softcap_kernel", "gemma2-eager", Gemma2, kernel_counts("rope"), [
        (BF16, GPD256, True, None), (FP16, G77, True, None), (BF16, G513, False, None),
        (FP32, GPD256, True, None),
    ], SOFTCAP_TRAINING),
    *layer_cases("flash_attention", "eager_softcap_kernel", "gemma2-eager-cap5", Gemma2, kernel_counts("rope"), [
        (BF16, G1000, True, None), (FP16, G333_256, False, None),
    ], SOFTCAP_TRAINING, softcap=5.0),
    # ... under a collator's attention_mask in inference (rows that see no key average every value,
    # which the replacement writes after the kernel; right padding shorter than the window here, as
    # the float64 reference cannot have such rows:
    # Gemma-2 takes its softmax in fp32, where float64's fill is -inf, so they are NaN there, and
    # tests/models/test_hf_eager_attention.py checks them against plain compile)
    *layer_cases("flash_attention", "eager_softcap_kernel", "gemma2-eager-padded", Gemma2,
                 kernel_counts("rope", out_proj=False), [
        (BF16, GPD256, False, "right"), (BF16, GPD256, False, "ones"), (FP32, GPD256, False, "right"),
    ]),
    # ... not with fp16's fill, which does not absorb the scores
    *[dataclasses.replace(c, near_miss="does not absorb the scores")
      for c in layer_cases("flash_attention", "eager_softcap_kernel", "gemma2-eager-padded", Gemma2,
                           always(rope=LAYERS), [(FP16, GPD256, False, "right")])],
    # ... and in training a near miss: such a row differentiates a uniform softmax (at GPD256,
    # as at G77 the window leaves rows empty and the float64 reference NaN)
    *[dataclasses.replace(c, near_miss="differentiates a uniform softmax")
      for c in layer_cases("flash_attention", "eager_softcap_kernel", "gemma2-eager-padded", Gemma2,
                           always(rope=LAYERS), [(BF16, GPD256, True, "right")], SOFTCAP_TRAINING)],
    # ... by default inference only: in training the near miss names the setting
    *layer_cases("flash_attention", "eager_softcap_kernel", "gemma2-eager-default", Gemma2, kernel_counts("rope"), [
        (BF16, G513, False, None),
    ]),
    *[dataclasses.replace(c, near_miss="attention_softcap_training=True")
      for c in layer_cases("flash_attention", "eager_softcap_kernel", "gemma2-eager-default", Gemma2,
                           always(rope=LAYERS), [(BF16, GPD256, True, None)])],
    # ... with the route switched off, the near miss names the setting
    *[dataclasses.replace(c, near_miss="attention_softcap=False")
      for c in layer_cases("flash_attention", "eager_softcap_kernel", "gemma2-eager-off", Gemma2,
                           always(rope=LAYERS), [(BF16, GPD256, False, None)], {"attention_softcap": False})],
    # gpt-oss's attention sinks (its head dim 64; GQA; a sliding-window layer and a full one), the
    # sinks' gradient checked with every parameter's; its rotation of halves taken by the rope
    # fusion, q's then moved into the kernel in inference
    *layer_cases("flash_attention", "eager_sinks_kernel", "gpt-oss-eager", GptOss, kernel_counts("rope"), [
        (BF16, G77, True, None), (FP16, Shape(2, 8, 2, 513, 64), True, None), (BF16, G1000, False, None),
        (BF16, Shape(1, 8, 1, 333, 128), True, None), (FP32, G77, True, None), (BF16, G77, False, None),
    ]),
    # ... under a collator's attention_mask (run-time key padding), rows that see no key included:
    # each attends to its sink alone, under the additive mask as in the kernel
    *layer_cases("flash_attention", "eager_sinks_kernel", "gpt-oss-eager-padded", GptOss, kernel_counts("rope"), [
        (BF16, G77, True, "ones"), (BF16, Shape(2, 8, 2, 513, 64), True, "right"), (FP16, G77, True, "left_empty"),
        (BF16, G1000, False, "left"),
    ]),
    *[dataclasses.replace(c, near_miss="attention_sinks=False")
      for c in layer_cases("flash_attention", "eager_sinks_kernel", "gpt-oss-eager-off", GptOss,
                           always(rope=LAYERS), [(BF16, G77, True, None)], {"attention_sinks": False})],
    *layer_cases("flash_attention", "eager_alibi_kernel", "bloom-eager", Bloom, kernel_counts(), [
        (BF16, M77, True, None), (FP16, M513, False, None), (BF16, Shape(2, 12, 12, 1000, 80), True, None),
        (FP32, Shape(2, 12, 12, 1000, 80), True, None),
    ]),
    *layer_cases("flash_attention", "eager_alibi_kernel", "mpt-eager", Mpt, kernel_counts(), [
        (BF16, Shape(2, 8, 8, 333, 96), False, None), (FP16, M77, True, None), (BF16, M513, True, None),
        (FP32, M513, True, None),
    ]),
    # Falcon: power-of-two head counts (its ALiBi rounds slope * position to bf16 even in an fp32
    # model, which Inductor's code does not: with other head counts plain torch.compile is 1e-3 off)
    # fp32 only, so never selected on CUDA (FP32_KEPT_OUT): in bf16/fp16 Falcon upcasts its scores
    # after viewing them, which the eager route does not follow (a near miss). (Its _merge_heads
    # after a flatten is no head merge attention_out_proj knows, a near miss too.)
    *layer_cases("flash_attention", "eager_alibi_mask_kernel", "falcon-eager", Falcon,
                 kernel_counts(out_proj=False), [
        (FP32, M513, True, None), (FP32, F77, False, None),
    ], impl="eager"),
    # SDPA whose float mask carries Falcon's ALiBi -> the kernel with a per-key bias (on by default)
    *layer_cases("flash_attention", "alibi_mask_kernel", "falcon-sdpa", Falcon, kernel_counts(), [
        (BF16, F77, False, None), (FP16, M513, True, None), (FP32, M1000, False, None),
        (BF16, Shape(2, 16, 1, 513, 64), True, None),  # multi-query
    ], impl="sdpa"),
    # the same with left padding, inference only: the rows that see no key get SDPA's average of
    # the values (written after the kernel, so no token-major output for the projection). Not
    # fp16, whose fill (-65504) does not absorb the scores (a near miss by design)
    *layer_cases("flash_attention", "alibi_mask_kernel_padded", "falcon-sdpa", Falcon,
                 kernel_counts(out_proj=False), [
        (BF16, Shape(3, 16, 1, 513, 64), False, "left"), (BF16, Shape(3, 16, 16, 77, 64), False, "left"),
        (FP32, Shape(3, 16, 16, 77, 64), False, "left"),
    ], impl="sdpa"),
    # the opt-in kernel route for SDPA: sliding windows, causal / all-true masks AND padding
    *layer_cases("flash_attention", "sliding_window_kernel", "mistral-sdpa", Llama, kernel_counts("rope"), [
        (BF16, G77, True, None), (FP16, G513, False, None), (BF16, G1000, True, None), (FP32, G1000, True, None),
    ], KERNEL, impl="sdpa", window=True),
    *layer_cases("flash_attention", "sliding_window_kernel_padded", "mistral-sdpa", Llama,
                 kernel_counts("rope"), [
        (BF16, GP513, False, "left"), (FP16, GP77, True, "right"), (BF16, GP1000, False, "right"),
        (FP32, GP1000, False, "right"),
    ], KERNEL, impl="sdpa", window=True),
    *layer_cases("flash_attention", "causal_kernel_padded", "llama-sdpa", Llama, kernel_counts("rope"), [
        (BF16, GP77, True, "right"), (FP16, GP513, False, "left"), (BF16, GP1000, True, "left"),
        (FP32, GP1000, True, "left"),
    ], KERNEL, impl="sdpa"),
    # causal AND padding at the default config (attention_causal_padding), without attention_kernel
    *layer_cases("flash_attention", "causal_kernel_padded", "llama-sdpa-default", Llama, kernel_counts("rope"), [
        (BF16, GP77, True, "ones"), (FP16, GP513, True, "left"), (BF16, GP1000, False, "right"),
        (FP16, GP1000, True, "right"), (FP32, GP77, True, "left"), (BF16, GP77, True, "left_empty"),
        (FP16, GP513, False, "left_empty"),
    ], impl="sdpa"),
    # ... but not at head dim 256, where our kernel lost to plain compile's masked SDPA
    # (CAUSAL_PADDING_HEAD_DIM): plain compile's route stays, with the rule as its near miss
    *[dataclasses.replace(c, near_miss="head dim of a causal mask with key padding 256 > 128")
      for c in layer_cases("flash_attention", "causal_kernel_padded", "llama-sdpa-default-d256", Llama,
                           always(rope=LAYERS), [(BF16, GPD256, True, "right"), (FP16, GPD256, False, "ones")],
                           impl="sdpa")],
    # the cuDNN route (attention_cudnn_padding): each head dim it takes, all ones, right and left
    # padding, a row with no token, training and inference
    *_cudnn_cases([
        (BF16, GP77, True, "ones"), (BF16, GP77, True, "right"), (FP16, GP77, True, "left"),
        (BF16, GP77, False, "left_empty"), (BF16, GP513, True, "right"), (FP16, GP513, True, "left_empty"),
        (BF16, GPD256, True, "right"), (BF16, GPD256, False, "ones"), (FP32, GP77, True, "right"),
    ]),
    # ... and at the default settings, past its shortest query length
    *_cudnn_cases([(BF16, GP2049, True, "right"), (FP16, GP2049, False, "left_empty")], {}, "llama-sdpa-cudnn-default"),
    # sliding windows at the default config (attention_sliding_window), without attention_kernel:
    # windows of 1, 64 and 333 keys, with and without padding (left padding: rows that see no key)
    *layer_cases("flash_attention", "sliding_window_kernel", "mistral-sdpa-default-w1", Llama,
                 kernel_counts("rope"), [
        (BF16, G77, True, None), (FP16, G77, False, None),
    ], impl="sdpa", window=1),
    *layer_cases("flash_attention", "sliding_window_kernel", "mistral-sdpa-default-w64", Llama,
                 kernel_counts("rope"), [
        (BF16, G513, True, None), (FP16, G513, False, None), (FP32, G513, True, None),
    ], impl="sdpa", window=64),
    *layer_cases("flash_attention", "sliding_window_kernel_padded", "mistral-sdpa-default-w64", Llama,
                 kernel_counts("rope"), [
        (BF16, GP513, True, "left"), (FP16, GP77, True, "right"), (BF16, GP77, False, "ones"),
        (BF16, GP513, True, "left_empty"),
    ], impl="sdpa", window=64),
    *layer_cases("flash_attention", "sliding_window_kernel", "mistral-sdpa-default-w333", Llama,
                 kernel_counts("rope"), [
        (BF16, G1000, True, None), (FP16, G1000_128, False, None),
    ], impl="sdpa", window=333),
    *layer_cases("flash_attention", "sliding_window_kernel_padded", "mistral-sdpa-default-w333", Llama,
                 kernel_counts("rope"), [
        (BF16, GP1000, True, "right"), (FP16, GP1000, False, "left"),
    ], impl="sdpa", window=333),
    # MLA (q/k head dim 192, v 128: v padded to 192 for the kernel, the output cut back) with the
    # collator's attention_mask (opt-in: attention_mla); the cut output is no head merge for
    # attention_out_proj
    *layer_cases("flash_attention", "causal_kernel_padded", "deepseek-v3-mla-sdpa", DeepseekMLA,
                 kernel_counts(out_proj=False), [
        (BF16, Shape(2, 8, 8, 333, 192), True, "ones"), (BF16, Shape(3, 4, 4, 513, 192), True, "left_empty"),
        (FP16, Shape(2, 8, 8, 77, 192), False, "right"), (FP32, Shape(2, 4, 4, 77, 192), True, "left"),
    ], {"attention_mla": True}),
    # packed sequences (DataCollatorWithFlattening: one row, position ids restarting, sequences of
    # one token among them) at the default config (attention_packed)
    *layer_cases("flash_attention", "causal_kernel_packed", "llama-sdpa-packed", PackedLlama, kernel_counts("rope"), [
        (BF16, Shape(1, 16, 4, 333, 64), True, None), (FP16, Shape(1, 8, 8, 513, 128), False, None),
        (BF16, Shape(1, 12, 2, 1000, 80), True, None), (FP32, Shape(1, 16, 4, 77, 64), True, None),
    ], impl="sdpa"),
    *layer_cases("flash_attention", "none_kernel_padded", "bert-sdpa", Bert, kernel_counts(), [
        (BF16, MP513, False, "left"), (FP16, MP77, True, "right"), (FP16, MP1000, False, "ones"),
        (FP32, MP1000, False, "ones"),
    ], KERNEL),
    # an encoder's padding collator at the default config (attention_padding), without
    # attention_kernel: right and left padding, no row padded, a batch row padded whole; head dim
    # 64, where its cost rules select it
    *layer_cases("flash_attention", "none_kernel_padded", "bert-sdpa-default", Bert, kernel_counts(), [
        (BF16, Shape(2, 8, 8, 513, 64), True, "right"), (FP16, MP77, True, "left"),
        (BF16, Shape(3, 12, 12, 333, 64), True, "ones"), (BF16, MP77, True, "left_empty"),
        (FP16, Shape(2, 4, 4, 1000, 64), False, "right"), (FP32, MP77, True, "right"),
    ]),
]
