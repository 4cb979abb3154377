"""fusionpass::rope: q and k rotated in one launch (triton_op on CUDA, host custom op on CPU), with
autograd for q and k (cos/sin are treated as constants: the pattern only matches where they do not
require grad, and the backward refuses to run if they do).

    rope(q, k, cos, sin, *, form, rotary_dim, q_out_dtype=None, k_out_dtype=None) -> (q_out, k_out)
(the options keyword-only: the rewrites that read a call, rope_attention, read them by name)
form: "rotate_half" (HF `x * cos + cat(-x2, x1) * sin`) or "interleaved" (GPT-J `rotate_every_two`);
rotary_dim: the leading channels rotated (head_dim unless partial rotary), the rest copied.
q_out_dtype / k_out_dtype: the outputs' dtypes, q's and k's unless given (bf16 q times fp32 cos is
fp32 in eager, as under autocast); the gradients come back in q's and k's dtypes.
k may be None (one tensor rotated): k_out is then an empty tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusionpass.ops import host


def _rot(t: Tensor, form: str, rotary_dim: int) -> Tensor:
    if form == "interleaved":
        return torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)
    half = rotary_dim // 2
    return torch.cat((-t[..., half:], t[..., :half]), -1)


def reference(x: Tensor, cos: Tensor, sin: Tensor, form: str, rotary_dim: int, backward: bool,
              out_dtype: torch.dtype | None = None):
    """The rotation in fp32 with torch ops (CPU without the interpreter, and tests)."""
    xf = x.float()
    xr, xp = xf[..., :rotary_dim], xf[..., rotary_dim:]
    c, s = cos.float(), sin.float()
    if backward:  # transpose of x -> x * cos + rot(x) * sin
        y = xr * c - _rot(xr * s, form, rotary_dim)
    else:
        y = xr * c + _rot(xr, form, rotary_dim) * s
    out = torch.cat((y, xp), -1).to(out_dtype or x.dtype)
    return _empty(x, out_dtype).copy_(out)


def _kernel(q, k, cos, sin, form, rotary_dim, backward, q_out_dtype, k_out_dtype):
    from fusionpass.kernels.rope import rope

    q_out, k_out = rope(q, k, cos, sin, form, rotary_dim, backward=backward, q_out_dtype=q_out_dtype,
                        k_out_dtype=k_out_dtype)
    return q_out, (q.new_empty(0) if k_out is None else k_out)


def _host_impl(q, k, cos, sin, form, rotary_dim, backward, q_out_dtype, k_out_dtype):
    if host.interpreting():
        return _kernel(q, k, cos, sin, form, rotary_dim, backward, q_out_dtype, k_out_dtype)
    q_out = reference(q, cos, sin, form, rotary_dim, backward, q_out_dtype)
    k_out = q.new_empty(0) if k is None else reference(k, cos, sin, form, rotary_dim, backward, k_out_dtype)
    return q_out, k_out


@torch.library.custom_op("fusionpass::rope_host", mutates_args=())
def _rope_host(
    q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, form: str, rotary_dim: int,
    backward: bool, q_out_dtype: torch.dtype | None, k_out_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    return _host_impl(q, k, cos, sin, form, rotary_dim, backward, q_out_dtype, k_out_dtype)


@_rope_host.register_fake
def _(q, k, cos, sin, form, rotary_dim, backward, q_out_dtype, k_out_dtype):
    return _empty(q, q_out_dtype), (q.new_empty(0) if k is None else _empty(k, k_out_dtype))


def _empty(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    from fusionpass.kernels.rope import empty_out

    return empty_out(t, dtype)


def _dispatch(q, k, cos, sin, form, rotary_dim, backward, q_out_dtype, k_out_dtype):
    if q.device.type != "cuda":
        return _rope_host(q, k, cos, sin, form, rotary_dim, backward, q_out_dtype, k_out_dtype)
    return _kernel(q, k, cos, sin, form, rotary_dim, backward, q_out_dtype, k_out_dtype)


@torch.library.triton_op("fusionpass::rope", mutates_args=())
def rope(
    q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, *, form: str, rotary_dim: int,
    q_out_dtype: torch.dtype | None = None, k_out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    return _dispatch(q, k, cos, sin, form, rotary_dim, False, q_out_dtype, k_out_dtype)


@torch.library.triton_op("fusionpass::rope_backward", mutates_args=())
def rope_backward(
    dq: Tensor, dk: Tensor | None, cos: Tensor, sin: Tensor, *, form: str, rotary_dim: int,
    q_out_dtype: torch.dtype | None = None, k_out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    return _dispatch(dq, dk, cos, sin, form, rotary_dim, True, q_out_dtype, k_out_dtype)


def _setup(ctx, inputs, keyword_only_inputs, output):
    q, k, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.form, ctx.rotary_dim = keyword_only_inputs["form"], keyword_only_inputs["rotary_dim"]
    ctx.has_k = k is not None
    # the gradients in the inputs' dtypes (the outputs' may be wider)
    ctx.q_dtype, ctx.k_dtype = q.dtype, (k.dtype if k is not None else None)


def _backward(ctx, dq_out, dk_out):
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise RuntimeError("fusionpass::rope does not differentiate cos/sin")
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.fusionpass.rope_backward(
        dq_out, dk_out if ctx.has_k else None, cos, sin, form=ctx.form, rotary_dim=ctx.rotary_dim,
        q_out_dtype=None if dq_out.dtype == ctx.q_dtype else ctx.q_dtype,
        k_out_dtype=None if not ctx.has_k or dk_out.dtype == ctx.k_dtype else ctx.k_dtype,
    )
    return dq, (dk if ctx.has_k else None), None, None


rope.register_autograd(_backward, setup_context=_setup)
