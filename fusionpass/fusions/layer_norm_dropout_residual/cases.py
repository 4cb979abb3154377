"""Conformance cases of layer_norm_dropout_residual.

Each case is one LayerNorm written the way a model family writes it, inside the block around it
that decides the variant (BERT's post-LN, GPT-2's and nanoGPT's pre-LN residual, GPT-2's dropped
embeddings); every variant also has a case at the default cost rule. Shapes:
`fusionpass.conformance.builders.NormShape`.

Dropout (p > 0). The fused kernel draws its own mask, so the float64 reference is given the mask
of the run it judges: each dropout module takes `keep=None` (None: the model's own dropout, what
gets compiled; a bool tensor: `where(keep, x / (1 - p), 0)`), and each such case returns a tensor
the mask can be read off -- the sum h = dropout(x) + r (kept iff h != r) or the dropped tensor
(kept iff != 0). Reading it is exact only if a kept element can never round to the dropped value:
x + r == r would need |x / (1 - p)| below half an ulp of r, and a kept x rounds to 0 only if it
underflows. So dropout inputs are kept away from zero (|x| >= 0.25, r ~ N(0, 1): half an ulp of
|r| < 8 is at most 2**-6 in bf16). The reference scales by 1 / (1 - p) in float64, the kernel by
fp32(1 / fp32(1 - p)); they differ by about one fp32 ulp, far below every dtype's floor.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusionpass.conformance import Case, dtype_name
from fusionpass.conformance.builders import BF16, FP16, FP32, NormShape, randn_hidden

LN = "layer_norm_dropout_residual"


# =============================================================================================
# the norms


def _layer_norm(width, kind):
    """nn.LayerNorm with/without bias or affine parameters, or a functional spelling; parameters
    drawn away from the 1/0 init (never zeros)."""
    if kind == "F-weight-only":
        ln = FunctionalLayerNorm(width, bias=False)
    elif kind == "F-bias-only":
        ln = FunctionalLayerNorm(width, weight=False)
    else:
        ln = nn.LayerNorm(width, bias=kind != "ln-nobias", elementwise_affine=kind != "ln-noaffine")
    with torch.no_grad():
        if ln.weight is not None:
            ln.weight.normal_(1.0, 0.2)
        if ln.bias is not None:
            ln.bias.normal_(0.0, 0.2)
    return ln


class FunctionalLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: `F.layer_norm(x, shape, weight, None, 1e-5)` with bias=False. The
    weight-less spelling (bias only) is no model's; it is here for the one-parameter backward."""

    def __init__(self, width, weight=True, bias=True):
        super().__init__()
        self.width = width
        self.weight = nn.Parameter(torch.ones(width)) if weight else None
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, (self.width,), self.weight, self.bias, 1e-5)


def _dropout(x, drop: nn.Dropout, keep):
    """The model's dropout (keep None), or the reference's with a given mask and the same scale."""
    if keep is None:
        return drop(x)
    return torch.where(keep, x / (1 - drop.p), 0)


# ---------------------------------------------------------------------------------------------
# the blocks


class GPT2Residual(nn.Module):
    """GPT-2/GPT-NeoX/OPT pre-LN: `hidden_states = attn_output + residual` (GPT-2's order) or
    nanoGPT's `x = x + dropout(y)`, then the next LayerNorm; the sum is the next residual."""

    def __init__(self, ln, p, residual_first=False):
        super().__init__()
        self.resid_dropout = nn.Dropout(p)
        self.ln_2 = ln
        self.residual_first = residual_first

    def forward(self, attn_output, residual, keep=None):
        dropped = _dropout(attn_output, self.resid_dropout, keep)
        hidden_states = residual + dropped if self.residual_first else dropped + residual
        return self.ln_2(hidden_states), hidden_states


class BertOutput(nn.Module):
    """BERT/RoBERTa post-LN `LayerNorm(dropout(hidden_states) + input_tensor)` (dense left out so
    the dropout input is the case's, kept away from 0). The sum is private; with an active dropout
    `h.detach()` is also returned so the mask can be read -- no gradient flows in through it, so
    the backward stays BERT's (no dh)."""

    def __init__(self, ln, p):
        super().__init__()
        self.dropout = nn.Dropout(p)
        self.LayerNorm = ln

    def forward(self, hidden_states, input_tensor, keep=None):
        h = _dropout(hidden_states, self.dropout, keep) + input_tensor
        out = self.LayerNorm(h)
        return (out, h.detach()) if self.training and self.dropout.p > 0 else out


class DroppedEmbeddings(nn.Module):
    """GPT-2/GPT-NeoX: the dropped embeddings, read by layer 0's ln_1 and kept as its residual."""

    def __init__(self, ln, p):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.ln_1 = ln

    def forward(self, inputs_embeds, keep=None):
        hidden_states = _dropout(inputs_embeds, self.drop, keep)
        return self.ln_1(hidden_states), hidden_states


def _keep_from_sum(outputs, inputs):
    return {"keep": outputs[1] != inputs[1]}  # h = dropout(x) + r, r: the second input


def _keep_from_dropped(outputs, inputs):
    return {"keep": outputs[1] != 0}


# block -> (class, kwargs, graph inputs, variant with an active dropout, mask reader)
LN_BLOCKS = {
    "gpt2": (GPT2Residual, {}, 2, "dropout_residual", _keep_from_sum),
    "nanogpt": (GPT2Residual, {"residual_first": True}, 2, "dropout_residual", _keep_from_sum),
    "bert": (BertOutput, {}, 2, "dropout_residual", _keep_from_sum),
    "embed": (DroppedEmbeddings, {}, 1, "dropout", _keep_from_dropped),
}


def _ln_make(block, kind, p, shape):
    def make(dtype, device):
        cls, kwargs, n_inputs, _, _ = LN_BLOCKS[block]
        fp32_params = kind == "ln-fp32"  # half activations, fp32 LayerNorm (the kernel takes both)
        ln = _layer_norm(shape.width, "ln" if fp32_params else kind)
        module = cls(ln, p, **kwargs).to(device, dtype)
        if fp32_params:
            ln.float()
        inputs = tuple(randn_hidden(shape, dtype, device, away_from_zero=p > 0) for _ in range(n_inputs))
        return module, inputs

    return make


def ln_case(block, kind, p, dtype, shape, train) -> Case:
    _, _, _, dropout_variant, keep = LN_BLOCKS[block]
    active = train and p > 0
    variant = dropout_variant if active else "residual"
    mode = "train" if train else "infer"
    return Case(
        name=f"{LN}/{variant}/{block}-{kind}-p{p}/{dtype_name(dtype)}/{shape.label}/{mode}",
        fusion=LN, variant=variant, make=_ln_make(block, kind, p, shape), dtype=dtype, train=train,
        expect={LN: 1}, config=dict(shape.config), reference_kwargs=keep if active else None,
    )


# Default rule: 768..8192 in training, 2048..4096 in inference. 4100 takes the forward's two
# passes over 2048-column chunks with h stored (training, pre-LN in inference) and the one-pass
# 8192 tile without it (BERT in inference); 200 and 1000 pack several rows per program.
L768 = NormShape(8, 125, 768)
L1000 = NormShape(17, 241, 1000)
L4100 = NormShape(27, 19, 4100)
L200 = NormShape(17, 241, 200, (("layer_norm_min_width", 64),))
L2048 = NormShape(8, 125, 2048)
L3001 = NormShape(27, 19, 3001)
L1000_INFER = NormShape(17, 241, 1000, (("layer_norm_inference_min_width", 768),))
L4100_INFER = NormShape(27, 19, 4100, (("layer_norm_inference_max_width", 8192),))

LN_TABLE = [
    # (block, LayerNorm, p, dtype, shape): training. A LayerNorm without bias (its weight gradient
    # was once garbage on the GPU) in both forms: LN(r + x) returning h, LN(dropout(x) + r).
    ("bert", "ln-nobias", 0.1, BF16, L768),
    ("nanogpt", "ln-nobias", 0.0, BF16, L1000),
    ("embed", "ln", 0.1, BF16, L4100),
    ("gpt2", "F-weight-only", 0.1, BF16, L200),
    ("gpt2", "ln-fp32", 0.1, BF16, L768),
    ("bert", "ln", 0.0, FP16, L768),
    ("gpt2", "ln", 0.1, FP16, L1000),
    ("bert", "ln-nobias", 0.3, FP16, L4100),
    ("embed", "ln-nobias", 0.1, FP16, L200),
    ("nanogpt", "ln-noaffine", 0.0, FP16, L1000),
    ("embed", "ln-noaffine", 0.1, FP32, L768),
    ("nanogpt", "ln-nobias", 0.1, FP32, L768),
    ("bert", "ln", 0.1, FP32, L1000),
    ("nanogpt", "ln-nobias", 0.0, FP32, L4100),
    ("nanogpt", "F-bias-only", 0.0, FP32, L200),
]
LN_INFER_TABLE = [
    # inference (model.eval(): dropouts are identities, read through)
    ("bert", "ln", 0.1, BF16, L2048),
    ("nanogpt", "ln-nobias", 0.1, BF16, L3001),
    ("gpt2", "F-weight-only", 0.1, BF16, L1000_INFER),
    ("bert", "ln-fp32", 0.1, BF16, L3001),
    ("gpt2", "ln", 0.1, FP16, L2048),
    ("bert", "ln-noaffine", 0.1, FP16, L3001),
    ("bert", "ln-nobias", 0.1, FP16, L4100_INFER),
    ("nanogpt", "F-bias-only", 0.0, FP16, L1000_INFER),
    ("bert", "ln-nobias", 0.1, FP32, L2048),
    ("gpt2", "ln", 0.0, FP32, L3001),
    ("nanogpt", "ln-noaffine", 0.1, FP32, L1000_INFER),
    ("gpt2", "ln", 0.1, FP32, L4100_INFER),
]

CASES = [
    *(ln_case(*row, train=True) for row in LN_TABLE),
    *(ln_case(*row, train=False) for row in LN_INFER_TABLE),
]
