"""Conformance cases for the norm fusions: rms_norm_residual and layer_norm_dropout_residual.

Each case is one norm written the way a model family writes it, inside the block around it that
decides the variant (a pre-norm layer whose sum is the next residual, the first layer's norm with
no add in front, BERT's post-LN, GPT-2's dropped embeddings). Row counts are odd on purpose
(8x125 = 1000, 17x241 = 4097, 27x19 = 513 rows: no multiple of any row tile), and widths are odd
too where the cost rule can be opened for them through `config` (the kernels must be correct
everywhere they may be selected); every variant also has a case at the default rule.

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

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from fusionpass.conformance import Case, dtype_name

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
RMS, LN = "rms_norm_residual", "layer_norm_dropout_residual"


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    width: int
    config: tuple = ()  # cost-rule overrides needed to select this width, as (name, value) pairs

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.seq}x{self.width}"


def _randn(shape: Shape, dtype, device, away_from_zero=False):
    t = torch.randn(shape.batch, shape.seq, shape.width, device=device)
    if away_from_zero:  # see the module docstring: makes the dropout mask readable from outputs
        t = torch.where(t >= 0, t + 0.25, t - 0.25)
    return t.to(dtype)


def _param(width, mean, std=0.1):
    return nn.Parameter(mean + std * torch.randn(width))


# =============================================================================================
# rms_norm_residual: the norms, as the families write them


class _Norm(nn.Module):
    """The state every norm below keeps: eps, and a weight around `weight_mean` (none: no weight).
    Each subclass's forward is its family's code as written (the casts are what differ)."""

    weight_mean: float | None = 1.0

    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.eps = eps
        if self.weight_mean is not None:
            self.weight = _param(width, self.weight_mean)

    def _normalized(self, h):
        """h / rms(h), in h's dtype: `h * rsqrt(mean(h ** 2) + eps)`, as every family writes it."""
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)


class LlamaRMSNorm(_Norm):
    """HF Llama/Mistral/Qwen2/Qwen3/Phi-3: normalize in fp32, downcast, then `weight * x`."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        return self.weight * self._normalized(hidden_states.to(torch.float32)).to(input_dtype)


class GemmaRMSNorm(_Norm):
    """HF Gemma 1/2/3: `1 + weight` (weights around 0) applied in fp32, before the downcast."""

    weight_mean = 0.0

    def forward(self, x):
        output = self._normalized(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class T5LayerNorm(_Norm):
    """HF T5: h is not upcast (half h times fp32 rstd); downcast only for a half weight. Half
    models are the llama form, fp32 ones weight_in_fp32."""

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class Olmo2RMSNorm(_Norm):
    """HF OLMo-2: the weight multiplies the fp32 n (type promotion), then one downcast."""

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        return (self.weight * self._normalized(hidden_states.to(torch.float32))).to(input_dtype)


class PlainRMSNorm(_Norm):
    """An fp32 model's RMSNorm without any cast (fp32 only: in half it would mix dtypes)."""

    def forward(self, x):
        return self._normalized(x) * self.weight


class NoWeightRMSNorm(_Norm):
    """An RMSNorm without an affine weight."""

    weight_mean = None

    def forward(self, x):
        return self._normalized(x.to(torch.float32)).to(x.dtype)


def TorchRMSNorm(width, eps=1e-6):
    """`torch.nn.RMSNorm` (torchtitan's norm): one torch.rms_norm call in the Dynamo graph."""
    norm = nn.RMSNorm(width, eps=eps)
    norm.weight = _param(width, 1.0)
    return norm


# norm -> (class, variant for half dtypes, variant for fp32)
RMS_NORMS = {
    "hf-llama": (LlamaRMSNorm, "llama", "llama"),
    "gemma": (GemmaRMSNorm, "gemma", "gemma"),
    "t5": (T5LayerNorm, "llama", "weight_in_fp32"),
    "olmo2": (Olmo2RMSNorm, "weight_in_fp32", "weight_in_fp32"),
    "plain": (PlainRMSNorm, None, "weight_in_fp32"),
    "no-weight": (NoWeightRMSNorm, "no_weight", "no_weight"),
    "torch": (TorchRMSNorm, "torch_rms_norm", "torch_rms_norm"),
}

# ---------------------------------------------------------------------------------------------
# rms_norm_residual: the blocks around the norm


class FirstNorm(nn.Module):
    """The first layer's input norm: nothing added in front of it (the *_no_residual variants)."""

    def __init__(self, make_norm, width):
        super().__init__()
        self.input_layernorm = make_norm()

    def forward(self, hidden_states):
        return self.input_layernorm(hidden_states)


class PreNorm(nn.Module):
    """A decoder layer's `hidden_states = residual + hidden_states`, then the next norm; the sum
    is returned as the next residual (`returns_sum`) or, for the model's final norm, not."""

    def __init__(self, make_norm, width, returns_sum=True):
        super().__init__()
        self.norm = make_norm()
        self.returns_sum = returns_sum

    def forward(self, hidden_states, residual):
        hidden_states = residual + hidden_states
        out = self.norm(hidden_states)
        return (out, hidden_states) if self.returns_sum else out


class DecoderStack(nn.Module):
    """One pre-norm layer (linear sublayers) and the final norm: three norms, one with no add in
    front, one whose sum is the next residual, one whose sum nothing else reads; both operand
    orders of the residual add."""

    def __init__(self, make_norm, width):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm, self.norm = (make_norm() for _ in range(3))
        self.attn = nn.Linear(width, width, bias=False)
        self.mlp = nn.Linear(width, width, bias=False)

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = residual + self.attn(self.input_layernorm(hidden_states))
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states)) + residual
        return self.norm(hidden_states)


# block -> (class, kwargs, graph inputs, matches, has a residual add)
RMS_BLOCKS = {
    "first": (FirstNorm, {}, 1, 1, False),
    "prenorm": (PreNorm, {}, 2, 1, True),
    "final": (PreNorm, {"returns_sum": False}, 2, 1, True),
    "stack": (DecoderStack, {}, 1, 3, True),
}


def _rms_make(norm, block, shape):
    def make(dtype, device):
        cls, kwargs, n_inputs, _, _ = RMS_BLOCKS[block]
        module = cls(lambda: RMS_NORMS[norm][0](shape.width), shape.width, **kwargs).to(device, dtype)
        return module, tuple(_randn(shape, dtype, device) for _ in range(n_inputs))

    return make


def rms_case(norm, block, dtype, shape, train) -> Case:
    _, half_variant, fp32_variant = RMS_NORMS[norm]
    variant = fp32_variant if dtype == FP32 else half_variant
    _, _, _, matches, residual = RMS_BLOCKS[block]
    variant = variant if residual else f"{variant}_no_residual"
    mode = "train" if train else "infer"
    return Case(
        name=f"{RMS}/{variant}/{norm}-{block}/{dtype_name(dtype)}/{shape.label}/{mode}",
        fusion=RMS, variant=variant, make=_rms_make(norm, block, shape), dtype=dtype, train=train,
        expect={RMS: matches}, config=dict(shape.config),
    )


# Default rule: 2048..8192 in training; in inference 2048..4096 without a partial second forward
# chunk (so 2048 or 4096). 3001 (training only) takes the two-pass forward with a partial chunk,
# 4100 the one-pass 8192-column tile, 1000 packs rows of a 1024-column tile.
R2048 = Shape(8, 125, 2048)
R3001 = Shape(27, 19, 3001)
R4096 = Shape(27, 19, 4096)
R4100 = Shape(27, 19, 4100)
R1000 = Shape(17, 241, 1000, (("rms_norm_min_width", 512),))
R4100_INFER = Shape(27, 19, 4100, (("rms_norm_max_width", 8192),))

RMS_TABLE = [
    # (norm, block, dtype, shape): training; every dtype at 4 shapes, every variant
    ("hf-llama", "prenorm", BF16, R2048),
    ("olmo2", "prenorm", BF16, R3001),
    ("gemma", "first", BF16, R1000),
    ("hf-llama", "first", BF16, R4100),
    ("no-weight", "prenorm", FP16, R2048),
    ("t5", "first", FP16, R3001),
    ("olmo2", "first", FP16, R1000),
    ("gemma", "prenorm", FP16, R4100),
    ("plain", "first", FP32, R2048),
    ("t5", "prenorm", FP32, R3001),
    ("no-weight", "first", FP32, R1000),
    ("hf-llama", "prenorm", FP32, R4100),
    ("hf-llama", "stack", BF16, R1000),
    ("torch", "first", BF16, R2048),
    ("torch", "prenorm", FP16, R3001),
    ("torch", "stack", BF16, R4096),
]
RMS_INFER_TABLE = [
    # inference
    ("gemma", "prenorm", BF16, R2048),
    ("no-weight", "first", BF16, R4096),
    ("olmo2", "prenorm", BF16, R1000),
    ("hf-llama", "first", BF16, R4100_INFER),
    ("olmo2", "first", FP16, R2048),
    ("t5", "prenorm", FP16, R1000),
    ("no-weight", "prenorm", FP16, R4100_INFER),
    ("gemma", "stack", FP16, R4096),
    ("plain", "prenorm", FP32, R2048),
    ("gemma", "first", FP32, R4096),
    ("hf-llama", "final", FP32, R1000),
    ("torch", "prenorm", BF16, R4096),
    ("torch", "first", FP32, R2048),
]

# =============================================================================================
# layer_norm_dropout_residual: the norms


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
# layer_norm_dropout_residual: the blocks


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
        inputs = tuple(_randn(shape, dtype, device, away_from_zero=p > 0) for _ in range(n_inputs))
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
L768 = Shape(8, 125, 768)
L1000 = Shape(17, 241, 1000)
L4100 = Shape(27, 19, 4100)
L200 = Shape(17, 241, 200, (("layer_norm_min_width", 64),))
L2048 = Shape(8, 125, 2048)
L3001 = Shape(27, 19, 3001)
L1000_INFER = Shape(17, 241, 1000, (("layer_norm_inference_min_width", 768),))
L4100_INFER = Shape(27, 19, 4100, (("layer_norm_inference_max_width", 8192),))

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
    *(rms_case(*row, train=True) for row in RMS_TABLE),
    *(rms_case(*row, train=False) for row in RMS_INFER_TABLE),
    *(ln_case(*row, train=True) for row in LN_TABLE),
    *(ln_case(*row, train=False) for row in LN_INFER_TABLE),
]
