"""fusionpass::rms_norm_residual and fusionpass::rms_norm: custom ops with fake impls and autograd.

Both ops compute, per row of the last dimension,
    h = x + residual                           (rounded to the input dtype, as the model does)
    n = float32(h) * rsqrt(mean(float32(h)^2) + eps)
    y = cast(cast(n) * weight)                  if weight_after_cast (HF Llama/Mistral/Qwen)
      = cast(n * (float32(weight) + offset))    otherwise (Gemma's 1 + w, plain fp32 RMSNorm)
and return y (input dtype), h (rms_norm_residual only) and rstd (fp32, for the backward). One
backward op serves both: dx is the gradient of x *and* of residual.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor


def _use_triton(t: Tensor) -> bool:
    # CUDA tensors run the Triton kernel; CPU tensors only under the interpreter (the tests),
    # otherwise the torch reference (so `fusionpass explain` works on a machine without a GPU).
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _reference_forward(x, residual, weight, eps, weight_offset, weight_after_cast):
    h = x if residual is None else x + residual
    hf = h.float()
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    n = hf * rstd
    if weight is None:
        y = n.to(x.dtype)
    elif weight_after_cast:
        y = (n.to(x.dtype) * weight).to(x.dtype)
    else:
        y = (n * (weight.float() + weight_offset)).to(x.dtype)
    return y, h, rstd.squeeze(-1)


def _reference_backward(dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight):
    hf = h.float()
    rstd = rstd.unsqueeze(-1)
    n = hf * rstd
    g = dy.float() if weight is None else dy.float() * (weight.float() + weight_offset)
    dhf = rstd * (g - n * (g * n).mean(-1, keepdim=True))
    if dh is not None:
        dhf = dhf + dh.float()
    dweight = None
    if need_dweight:
        normed = n.to(h.dtype).float() if weight_after_cast else n
        dweight = (_rows(dy.float()) * _rows(normed)).sum(0).to(weight.dtype)
    return dhf.to(h.dtype), dweight


def _forward(x, residual, weight, eps, weight_offset, weight_after_cast):
    if _use_triton(x):
        from fusionpass.kernels.rms_norm import rms_norm_fwd

        shape = x.shape
        y, h, rstd = rms_norm_fwd(
            _rows(x),
            None if residual is None else _rows(residual),
            weight,
            eps,
            weight_offset=weight_offset,
            weight_after_cast=weight_after_cast,
        )
        return y.view(shape), h.view(shape), rstd.view(shape[:-1])
    return _reference_forward(x, residual, weight, eps, weight_offset, weight_after_cast)


@torch.library.custom_op("fusionpass::rms_norm_residual", mutates_args=())
def rms_norm_residual(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    eps: float,
    weight_offset: float,
    weight_after_cast: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    y, h, rstd = _forward(x, residual, weight, eps, weight_offset, weight_after_cast)
    return y.contiguous(), h.contiguous(), rstd.contiguous()


@torch.library.custom_op("fusionpass::rms_norm", mutates_args=())
def rms_norm(
    x: Tensor, weight: Tensor | None, eps: float, weight_offset: float, weight_after_cast: bool
) -> tuple[Tensor, Tensor]:
    y, _, rstd = _forward(x, None, weight, eps, weight_offset, weight_after_cast)
    return y.contiguous(), rstd.contiguous()


@torch.library.custom_op("fusionpass::rms_norm_backward", mutates_args=())
def rms_norm_backward(
    dy: Tensor,
    dh: Tensor | None,
    h: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    weight_offset: float,
    weight_after_cast: bool,
    need_dweight: bool,
) -> tuple[Tensor, Tensor]:
    if _use_triton(dy):
        from fusionpass.kernels.rms_norm import rms_norm_bwd

        dx, dweight = rms_norm_bwd(
            _rows(dy.contiguous()),
            None if dh is None else _rows(dh.contiguous()),
            _rows(h.contiguous()),
            rstd.reshape(-1),
            weight,
            weight_offset=weight_offset,
            weight_after_cast=weight_after_cast,
            need_dweight=need_dweight,
        )
        dx = dx.view(h.shape)
    else:
        dx, dweight = _reference_backward(
            dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight
        )
    if dweight is None:
        dweight = dy.new_empty(0)
    return dx.contiguous(), dweight


@rms_norm_residual.register_fake
def _(x, residual, weight, eps, weight_offset, weight_after_cast):
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        x, memory_format=torch.contiguous_format
    ), rstd


@rms_norm.register_fake
def _(x, weight, eps, weight_offset, weight_after_cast):
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), rstd


@rms_norm_backward.register_fake
def _(dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight):
    dx = torch.empty_like(h, memory_format=torch.contiguous_format)
    dweight = weight.new_empty(weight.shape) if need_dweight else dy.new_empty(0)
    return dx, dweight


def _backward(ctx, dy, dh, h, weight):
    rstd = ctx.saved_tensors[-1]
    need_dweight = weight is not None and ctx.weight_needs_grad
    dx, dweight = torch.ops.fusionpass.rms_norm_backward(
        dy, dh, h, rstd, weight, ctx.weight_offset, ctx.weight_after_cast, need_dweight
    )
    return dx, (dweight if need_dweight else None)


def _save(ctx, h, weight, rstd, weight_index, eps_and_flags):
    _, weight_offset, weight_after_cast = eps_and_flags
    ctx.save_for_backward(h, weight, rstd)
    ctx.weight_offset = weight_offset
    ctx.weight_after_cast = weight_after_cast
    ctx.weight_needs_grad = weight is not None and ctx.needs_input_grad[weight_index]
    # Outputs nobody differentiates (h when the residual stream ends, rstd) arrive as None
    # instead of zero tensors: the kernel then skips that term.
    ctx.set_materialize_grads(False)


def _setup_residual(ctx, inputs, output):
    x, residual, weight, *flags = inputs
    _save(ctx, output[1], weight, output[2], 2, flags)


def _backward_residual(ctx, dy, dh, _drstd):
    h, weight, _ = ctx.saved_tensors
    dx, dweight = _backward(ctx, dy, dh, h, weight)
    return dx, dx, dweight, None, None, None


def _setup_plain(ctx, inputs, output):
    x, weight, *flags = inputs
    _save(ctx, x, weight, output[1], 1, flags)


def _backward_plain(ctx, dy, _drstd):
    h, weight, _ = ctx.saved_tensors
    dx, dweight = _backward(ctx, dy, None, h, weight)
    return dx, dweight, None, None, None


rms_norm_residual.register_autograd(_backward_residual, setup_context=_setup_residual)
rms_norm.register_autograd(_backward_plain, setup_context=_setup_plain)
