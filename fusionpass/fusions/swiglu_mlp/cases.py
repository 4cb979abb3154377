"""Conformance cases of swiglu_mlp: a matrix of forms x dtypes x shapes x training and inference
(`fusionpass.conformance.builders`), every form at the default cost rule and both sides of its
64-row decode limit, and training with the down projection in the op.

The modules are written the way transformers 5.x writes gated MLPs, holding their activation module.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from fusionpass.conformance.builders import ALL_DTYPES, BF16, FP16, FP32, case, maker, rotating


class GatedMLP(nn.Module):
    """HF Llama/Mistral/Qwen2 (SiLU; Llama's mlp_bias for biases) and Gemma (GELU-tanh):
    down_proj(act_fn(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden, inter, act, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GateUpMLP(nn.Module):
    """HF Phi-3: one gate_up_proj, chunked, `up_states * act(gate)`."""

    def __init__(self, hidden, inter, act, bias=False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.activation_fn = act

    def forward(self, hidden_states):
        up_states = self.gate_up_proj(hidden_states)
        gate, up_states = up_states.chunk(2, dim=-1)
        up_states = up_states * self.activation_fn(gate)
        return self.down_proj(up_states)


def _silu():
    return nn.SiLU()


def _gelu_tanh():  # Gemma's gelu_pytorch_tanh
    return nn.GELU(approximate="tanh")


# form -> (module class, activation, bias, the variant it matches)
SWIGLU_FORMS = {
    "llama": (GatedMLP, _silu, False, "silu"),
    "gemma": (GatedMLP, _gelu_tanh, False, "gelu_tanh"),
    "phi3_gate_up": (GateUpMLP, _silu, False, "silu_gate_up"),
    # Phi-3's fused projection with Gemma's activation and biases: the gelu_tanh_gate_up route
    "gate_up_gelu_bias": (GateUpMLP, _gelu_tanh, True, "gelu_tanh_gate_up"),
    "llama_mlp_bias": (GatedMLP, _silu, True, "silu"),
}
# (batch, seq, hidden, intermediate): a decode step of 3 sequences (the decode kernel, selected
# by default), and prefills of 134 and 389 rows (library GEMMs + the act*mul kernel; selected
# with swiglu_mlp_kernel=True), odd widths throughout.
SWIGLU_SHAPES = ((3, 1, 203, 517), (2, 67, 384, 1031), (1, 389, 515, 1377))
DECODE_MAX_ROWS = 64  # fusionpass.fusions.swiglu_mlp.kernels.DECODE_MAX_M: the default cost rule's limit


def _swiglu_build(form, shape):
    cls, act, bias, _ = SWIGLU_FORMS[form]
    b, s, hidden, inter = shape
    return cls(hidden, inter, act(), bias), (torch.randn(b, s, hidden),)


def _swiglu_case(form, dtype, shape, train):
    variant = SWIGLU_FORMS[form][3]
    b, s, hidden, inter = shape
    # the default cost rule selects decode-sized inference only; the rest is opened
    decode = not train and b * s <= DECODE_MAX_ROWS
    # training without the down projection in the op (the default recomputes h: the cases below)
    config = None if decode else {"swiglu_mlp_kernel": True, "swiglu_mlp_recompute_product": False}
    return case("swiglu_mlp", variant, form, dtype, f"b{b}-s{s}-k{hidden}-n{inter}", train,
                maker(_swiglu_build, form, shape), {"swiglu_mlp": 1}, config)


def _swiglu_cases():
    cases = rotating(SWIGLU_FORMS, SWIGLU_SHAPES, _swiglu_case)
    # every form at the default cost rule at least once, and both sides of the 64-row limit:
    # one row (a single sequence decoding), exactly 64 rows, and 65 rows (the prefill regime)
    cases += [
        _swiglu_case("phi3_gate_up", FP32, (1, 1, 203, 517), False),
        _swiglu_case("llama_mlp_bias", BF16, (4, 16, 384, 1031), False),
        _swiglu_case("gemma", FP16, (5, 13, 384, 1031), False),
    ]
    # training at the default: the down projection in the op (swiglu_mlp_recompute_product),
    # every form, the dtypes in turn, at both prefill shapes
    dtypes = itertools.cycle(ALL_DTYPES)
    cases += [_swiglu_recompute_case(form, next(dtypes), shape)
              for form in SWIGLU_FORMS for shape in SWIGLU_SHAPES[1:]]
    # training on one row: the act·mul kernels get rows == 1, which Triton specializes into a plain
    # int (their CUDA build once failed there while the interpreter ran it)
    cases += [_swiglu_case("phi3_gate_up", FP32, (1, 1, 203, 517), True),
              _swiglu_recompute_case("llama", BF16, (1, 1, 203, 517))]
    # batch and sequence dynamic (serving, varying lengths): symbolic rows may be decode-sized, so inference is
    # selected by default on either side of the limit (the op picks its kernels at run time)
    cases += [dataclasses.replace(case("swiglu_mlp", SWIGLU_FORMS[form][3], f"{form}_dynamic", dtype,
                                       "b{}-s{}-k{}-n{}".format(*shape), False, maker(_swiglu_build, form, shape),
                                       {"swiglu_mlp": 1}), dynamic_dims=(0, 1))
              for form, dtype, shape in (("llama", BF16, (3, 5, 203, 517)), ("phi3_gate_up", FP16, (2, 67, 384, 1031)))]
    return cases


def _swiglu_recompute_case(form, dtype, shape):
    variant = SWIGLU_FORMS[form][3]
    b, s, hidden, inter = shape
    return case("swiglu_mlp", variant, f"{form}+recompute_product", dtype,
                f"b{b}-s{s}-k{hidden}-n{inter}", True, maker(_swiglu_build, form, shape),
                {"swiglu_mlp": 1}, None)


CASES = _swiglu_cases()
