"""Conformance cases of rms_norm_residual.

Each case is one RMSNorm written the way a model family writes it, inside the block around it that
decides the variant (a pre-norm layer whose sum is the next residual, the first layer's norm with
no add in front, a decoder layer with the model's final norm); every variant also has a case at
the default cost rule. Shapes: `fusionpass.conformance.builders.NormShape`.
"""
from __future__ import annotations

import torch
from torch import nn

from fusionpass.conformance import Case, dtype_name
from fusionpass.conformance.builders import BF16, FP16, FP32, NormShape, randn_hidden

RMS = "rms_norm_residual"


def _param(width, mean, std=0.1):
    return nn.Parameter(mean + std * torch.randn(width))


# =============================================================================================
# the norms, as the families write them


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
# the blocks around the norm


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
        return module, tuple(randn_hidden(shape, dtype, device) for _ in range(n_inputs))

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
        expect={RMS: matches}, config={**dict(shape.config), **({} if train else INFERENCE_OPENED)},
    )


# Default rule: 512..8192 in both modes where the measured table says faster (in training every
# width; in inference none, so its cases open that rule: the kernels must be correct wherever a
# setting can select them), in inference without a partial second forward chunk (not 2049..4095).
# 3001 (training only) takes the two-pass forward with a partial chunk, 4100 the one-pass
# 8192-column tile, 1000 packs rows of a 1024-column tile.
INFERENCE_OPENED = {"rms_norm_min_speedup": 0.0}
R2048 = NormShape(8, 125, 2048)
R3001 = NormShape(27, 19, 3001)
R4096 = NormShape(27, 19, 4096)
R4100 = NormShape(27, 19, 4100)
R1000 = NormShape(17, 241, 1000)

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
    ("hf-llama", "first", BF16, R4100),
    ("olmo2", "first", FP16, R2048),
    ("t5", "prenorm", FP16, R1000),
    ("no-weight", "prenorm", FP16, R4100),
    ("gemma", "stack", FP16, R4096),
    ("plain", "prenorm", FP32, R2048),
    ("gemma", "first", FP32, R4096),
    ("hf-llama", "final", FP32, R1000),
    ("torch", "prenorm", BF16, R4096),
    ("torch", "first", FP32, R2048),
]

CASES = [
    *(rms_case(*row, train=True) for row in RMS_TABLE),
    *(rms_case(*row, train=False) for row in RMS_INFER_TABLE),
]
