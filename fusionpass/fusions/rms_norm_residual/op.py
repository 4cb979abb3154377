"""fusionpass::rms_norm_residual and fusionpass::rms_norm: triton_ops (CUDA), host custom ops (CPU), autograd.

Both ops compute, per row of the last dimension,
    h = x + residual                           (rounded to x's dtype, as the model does; a float32 x
                                                may take a 16-bit residual: autocast over fp32 weights)
    n = float32(h) * rsqrt(mean(float32(h)^2) + eps)
    y = cast(cast(n) * weight)                  if weight_after_cast (HF Llama/Mistral/Qwen)
      = cast(n * (float32(weight) + offset))    otherwise (Gemma's 1 + w, plain fp32 RMSNorm)
and return y (input dtype), h (rms_norm_residual only) and rstd (fp32, for the backward). One
backward op serves both: dx is the gradient of x *and* of residual.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusionpass.ops import host


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


def _kernel_forward(x, residual, weight, eps, weight_offset, weight_after_cast):
    from fusionpass.fusions.rms_norm_residual.kernels import rms_norm_fwd

    shape = x.shape
    y, h, rstd = rms_norm_fwd(
        _rows(x),
        None if residual is None else _rows(residual),
        weight,
        eps,
        weight_offset=weight_offset,
        weight_after_cast=weight_after_cast,
        store_h=residual is not None,
    )
    return y.view(shape), (x if h is None else h.view(shape)), rstd.view(shape[:-1])


def _kernel_backward(dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight):
    from fusionpass.fusions.rms_norm_residual.kernels import rms_norm_bwd

    dx, dweight = rms_norm_bwd(
        _rows(dy),
        None if dh is None else _rows(dh),
        _rows(h),
        rstd.reshape(-1),
        weight,
        weight_offset=weight_offset,
        weight_after_cast=weight_after_cast,
        need_dweight=need_dweight,
    )
    return dx.view(h.shape), dweight


# The public ops are triton_ops: on CUDA torch.compile traces into them and Inductor launches the
# kernels from its own generated code. As opaque custom_ops their Python dispatch cost as much host
# time per call as the kernel itself (benchmarks/results/latest/rms_norm_residual.md).


@torch.library.triton_op("fusionpass::rms_norm_residual", mutates_args=())
def rms_norm_residual(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    eps: float,
    weight_offset: float,
    weight_after_cast: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    if x.device.type != "cuda":
        return _forward_host(x, residual, weight, eps, weight_offset, weight_after_cast)
    return _kernel_forward(x, residual, weight, eps, weight_offset, weight_after_cast)


@torch.library.triton_op("fusionpass::rms_norm", mutates_args=())
def rms_norm(
    x: Tensor, weight: Tensor | None, eps: float, weight_offset: float, weight_after_cast: bool
) -> tuple[Tensor, Tensor]:
    impl = _kernel_forward if x.device.type == "cuda" else _forward_host
    y, _, rstd = impl(x, None, weight, eps, weight_offset, weight_after_cast)
    return y, rstd


@torch.library.triton_op("fusionpass::rms_norm_backward", mutates_args=())
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
    args = (dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight)
    if dy.device.type != "cuda":
        return _backward_host(*args)
    dx, dweight = _kernel_backward(*args)
    return dx, dy.new_empty(0) if dweight is None else dweight


# CPU tensors go through opaque custom ops: Inductor cannot trace a Triton kernel that runs under
# the interpreter; without the interpreter the torch reference keeps CPU graphs correct (so
# `fusionpass explain` runs on a machine without a GPU).


@torch.library.custom_op("fusionpass::rms_norm_forward_host", mutates_args=())
def _forward_host(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    eps: float,
    weight_offset: float,
    weight_after_cast: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    impl = _kernel_forward if host.interpreting() else _reference_forward
    y, h, rstd = impl(x, residual, weight, eps, weight_offset, weight_after_cast)
    # outputs must not alias inputs (h is x itself without a residual)
    h = h.clone() if residual is None else h.contiguous()
    return y.contiguous(), h, rstd.contiguous()


@_forward_host.register_fake
def _(x, residual, weight, eps, weight_offset, weight_after_cast):
    return host.empty_like(x), host.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fusionpass::rms_norm_backward_host", mutates_args=(),
                         schema=host.schema_of(rms_norm_backward))
def _backward_host(dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight):
    impl = _kernel_backward if host.interpreting() else _reference_backward
    dx, dweight = impl(dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight)
    return dx.contiguous(), dy.new_empty(0) if dweight is None else dweight


@_backward_host.register_fake
def _(dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight):
    return host.empty_like(h), weight.new_empty(weight.shape) if need_dweight else dy.new_empty(0)


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
    ctx.residual_dtype = residual.dtype


def _backward_residual(ctx, dy, dh, _drstd):
    h, weight, _ = ctx.saved_tensors
    dx, dweight = _backward(ctx, dy, dh, h, weight)
    # a 16-bit residual added to an fp32 x (autocast) gets its gradient in its own dtype, as the
    # add's own backward would give it
    return dx, dx.to(ctx.residual_dtype), dweight, None, None, None


def _setup_plain(ctx, inputs, output):
    x, weight, *flags = inputs
    _save(ctx, x, weight, output[1], 1, flags)


def _backward_plain(ctx, dy, _drstd):
    h, weight, _ = ctx.saved_tensors
    dx, dweight = _backward(ctx, dy, None, h, weight)
    return dx, dweight, None, None, None


rms_norm_residual.register_autograd(_backward_residual, setup_context=_setup_residual)
rms_norm.register_autograd(_backward_plain, setup_context=_setup_plain)


# ---------------------------------------------------------------------------------------------
# DTensor sharding rules (sequence parallelism: torchtitan's norms see Shard(1) activations).
# A row's norm reads only that row, so x, the residual, y, the sum and rstd may be sharded alike
# on any dimension but the last, with the weight replicated; the weight's gradient is then a sum
# of per-shard parts (Partial). Anything else, DTensor redistributes to one of these first.


def _row_shardings(ndim: int, tensors_in: int, weight: bool, outputs, backward: bool):
    """[(output placements, input placements)] for each row dimension and for all-replicated:
    the inputs are `tensors_in` row tensors (None where absent) then the weight, then flags."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = [([Replicate()] * len(outputs), [Replicate() if t else None for t in (*tensors_in, weight)])]
    for d in range(ndim - 1):
        shard = Shard(d)
        outs = [shard] * len(outputs)
        if backward:  # (dx, dweight)
            outs = [shard, Partial() if outputs[1] else Replicate()]
        out.append((outs, [shard if t else None for t in tensors_in] + [Replicate() if weight else None]))
    return out


def _register_sharding() -> None:
    try:
        from torch.distributed.tensor.experimental import register_sharding
    except ImportError:  # torch built without distributed
        return

    flags = [None, None, None]

    @register_sharding(torch.ops.fusionpass.rms_norm_residual.default)
    def _(x, residual, weight, eps, weight_offset, weight_after_cast):
        return [(o, i + flags) for o, i in
                _row_shardings(x.ndim, (True, True), weight is not None, (1, 1, 1), False)]

    @register_sharding(torch.ops.fusionpass.rms_norm.default)
    def _(x, weight, eps, weight_offset, weight_after_cast):
        return [(o, i + flags) for o, i in
                _row_shardings(x.ndim, (True,), weight is not None, (1, 1), False)]

    @register_sharding(torch.ops.fusionpass.rms_norm_backward.default)
    def _(dy, dh, h, rstd, weight, weight_offset, weight_after_cast, need_dweight):
        return [(o, i + flags) for o, i in
                _row_shardings(dy.ndim, (True, dh is not None, True, True), weight is not None,
                               (1, need_dweight), True)]


_register_sharding()
