"""fusionpass::layer_norm_dropout_residual and its backward: triton_ops (CUDA), host custom ops (CPU), autograd.

The forward computes, per row of the last dimension (see fusionpass.fusions.layer_norm_dropout_residual.kernels),
    d = dropout(x, p)                          keep ? round(x * s) : 0      (d = x when p == 0)
    h = round(d + residual)                    (h = d without a residual)
    y = round((h - mean) * rstd * weight + bias)
`round` is to x's dtype, except that h and y are fp32 where x and residual are one fp32 and one
16-bit (the sum's promotion, as under autocast, whose LayerNorm then computes in fp32); the backward
returns each input's gradient in that input's dtype.
and returns (y, h, mean, rstd); h is an empty tensor when `store_h` is False (inference with h
used nowhere else). With p > 0 the keep mask is a function of the one-element int64 `seed` tensor:
the backward regenerates it from the same tensor, so no mask is ever stored. The caller draws a
fresh seed per call (the pattern inserts `torch.randint` into the graph, once per LayerNorm).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusionpass.kernels.rng import dropout_constants, philox_keep
from fusionpass.ops import host


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


# ---------------------------------------------------------------------------------------------
# torch reference. CPU graphs without the Triton interpreter (`fusionpass explain` on a machine
# without a GPU) run this. Its keep mask is the kernels' (fusionpass.kernels.rng, `philox_keep`).


def _keep_mask(x: Tensor, p: float, seed: Tensor) -> Tensor:
    rows = x.numel() // x.shape[-1]
    return philox_keep(rows, x.shape[-1], p, int(seed.reshape(-1)[0])).reshape(x.shape).to(x.device)


def _reference_forward(x, residual, weight, bias, seed, eps, p, store_h):
    h = x
    if p > 0:
        _, scale = dropout_constants(p)
        scaled = (x.float() * torch.tensor(scale, dtype=torch.float32)).to(x.dtype)
        h = torch.where(_keep_mask(x, p, seed), scaled, torch.zeros((), dtype=x.dtype))
    if residual is not None:
        h = h + residual
    hf = h.float()
    mean = hf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((hf - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = (hf - mean) * rstd
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(h.dtype), (h if store_h else None), mean.squeeze(-1), rstd.squeeze(-1)


def _reference_backward(dy, dh, h, mean, rstd, weight, bias, seed, p, need_dweight, need_dbias, need_dresidual,
                        x_dtype, residual_dtype):
    xhat = (h.float() - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
    g = dy.float() if weight is None else dy.float() * weight.float()
    total = rstd.unsqueeze(-1) * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if dh is not None:
        total = total + dh.float()
    dresidual = total.to(residual_dtype)
    dx = total.to(x_dtype)
    if p > 0:
        _, scale = dropout_constants(p)
        scaled = (dx.float() * torch.tensor(scale, dtype=torch.float32)).to(x_dtype)
        dx = torch.where(_keep_mask(h, p, seed), scaled, torch.zeros((), dtype=x_dtype))
    dweight = (_rows(dy.float()) * _rows(xhat)).sum(0).to(weight.dtype) if need_dweight else None
    dbias = _rows(dy.float()).sum(0).to(bias.dtype) if need_dbias else None
    return dx, (dresidual if need_dresidual else None), dweight, dbias


# ---------------------------------------------------------------------------------------------
# the kernels


def _kernel_forward(x, residual, weight, bias, seed, eps, p, store_h):
    from fusionpass.fusions.layer_norm_dropout_residual.kernels import layer_norm_fwd

    return layer_norm_fwd(x, residual, weight, bias, eps, p=p, seed=seed, store_h=store_h)


def _kernel_backward(dy, dh, h, mean, rstd, weight, bias, seed, p, need_dweight, need_dbias, need_dresidual,
                     x_dtype, residual_dtype):
    from fusionpass.fusions.layer_norm_dropout_residual.kernels import layer_norm_bwd

    return layer_norm_bwd(
        dy, dh, h, mean, rstd, weight, bias, p=p, seed=seed, need_dweight=need_dweight,
        need_dbias=need_dbias, need_dresidual=need_dresidual, x_dtype=x_dtype, residual_dtype=residual_dtype,
    )


def _sum_like(x: Tensor, residual: Tensor | None) -> Tensor:
    """A contiguous output of x's shape in the dtype of x + residual."""
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    return x.new_empty(x.shape, dtype=dtype)


def _forward_outputs(x, y, h, mean, rstd):
    """Fix the output contract: contiguous y, a fresh h (the kernel hands back x itself when there
    is nothing to add or drop: an output must not alias an input), stats shaped like x's rows."""
    if h is None:
        h = host.none(x)
    elif h is x:
        h = x.clone(memory_format=torch.contiguous_format)
    rows = x.shape[:-1]
    return y.contiguous(), h.contiguous(), mean.reshape(rows), rstd.reshape(rows)


def _backward_outputs(h, dx, dresidual, dweight, dbias):
    # with p == 0 and one dtype the kernel returns dx itself as dresidual; autograd reuses dx
    # (need_dresidual is only asked for where they differ), so this never returns two views of one
    # tensor
    if dresidual is dx:
        dresidual = dx.clone()
    return (
        dx.view(h.shape),
        host.none(h) if dresidual is None else dresidual.view(h.shape),
        host.none(h) if dweight is None else dweight,
        host.none(h) if dbias is None else dbias,
    )


# ---------------------------------------------------------------------------------------------
# public ops: triton_ops, so that on CUDA torch.compile traces into them and Inductor launches the
# kernels from its generated code (as opaque custom ops, their Python dispatch costs as much host
# time as the kernel itself, see fusions/rms_norm_residual/op.py).


def _check_dropout(p: float, seed: Tensor | None) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if p > 0 and seed is None:
        raise ValueError("dropout with p > 0 needs a seed tensor")


@torch.library.triton_op("fusionpass::layer_norm_dropout_residual", mutates_args=())
def layer_norm_dropout_residual(
    x: Tensor,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    seed: Tensor | None,
    eps: float,
    p: float,
    store_h: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_dropout(p, seed)
    if x.device.type != "cuda":
        return _forward_host(x, residual, weight, bias, seed, eps, p, store_h)
    return _forward_outputs(x, *_kernel_forward(x, residual, weight, bias, seed, eps, p, store_h))


@torch.library.triton_op("fusionpass::layer_norm_dropout_residual_backward", mutates_args=())
def layer_norm_dropout_residual_backward(
    dy: Tensor,
    dh: Tensor | None,
    h: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    seed: Tensor | None,
    p: float,
    need_dweight: bool,
    need_dbias: bool,
    need_dresidual: bool,
    x_dtype: torch.dtype,
    residual_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    need_dweight = need_dweight and weight is not None
    need_dbias = need_dbias and bias is not None
    need_dresidual = need_dresidual and _gradients_apart(p, x_dtype, residual_dtype)
    args = (dy, dh, h, mean, rstd, weight, bias, seed, p, need_dweight, need_dbias, need_dresidual, x_dtype,
            residual_dtype)
    if dy.device.type != "cuda":
        return _backward_host(*args)
    return _backward_outputs(h, *_kernel_backward(*args))


def _gradients_apart(p: float, x_dtype: torch.dtype, residual_dtype: torch.dtype) -> bool:
    """Whether the gradients of x and of the residual are two tensors: dropout scales x's, and
    operands of two dtypes each get theirs in their own."""
    return p > 0 or x_dtype != residual_dtype


# ---------------------------------------------------------------------------------------------
# host ops: CPU tensors go through opaque custom ops, because Inductor cannot trace a Triton
# kernel that runs under the interpreter.


@torch.library.custom_op("fusionpass::layer_norm_forward_host", mutates_args=(),
                         schema=host.schema_of(layer_norm_dropout_residual))
def _forward_host(x, residual, weight, bias, seed, eps, p, store_h):
    impl = _kernel_forward if host.interpreting() else _reference_forward
    y, h, mean, rstd = impl(x, residual, weight, bias, seed, eps, p, store_h)
    return _forward_outputs(x, y, h, mean, rstd)


@_forward_host.register_fake
def _(x, residual, weight, bias, seed, eps, p, store_h):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    h = _sum_like(x, residual) if store_h else host.none(x)
    return _sum_like(x, residual), h, stats, torch.empty_like(stats)


@torch.library.custom_op("fusionpass::layer_norm_backward_host", mutates_args=(),
                         schema=host.schema_of(layer_norm_dropout_residual_backward))
def _backward_host(dy, dh, h, mean, rstd, weight, bias, seed, p, need_dweight, need_dbias, need_dresidual, x_dtype,
                   residual_dtype):
    impl = _kernel_backward if host.interpreting() else _reference_backward
    args = (dy, dh, h, mean, rstd, weight, bias, seed, p, need_dweight, need_dbias, need_dresidual, x_dtype,
            residual_dtype)
    return _backward_outputs(h, *impl(*args))


@_backward_host.register_fake
def _(dy, dh, h, mean, rstd, weight, bias, seed, p, need_dweight, need_dbias, need_dresidual, x_dtype,
      residual_dtype):
    return (
        h.new_empty(h.shape, dtype=x_dtype),
        h.new_empty(h.shape, dtype=residual_dtype) if need_dresidual else host.none(h),
        torch.empty_like(weight) if need_dweight else host.none(h),
        torch.empty_like(bias) if need_dbias else host.none(h),
    )


def _setup(ctx, inputs, output):
    x, residual, weight, bias, seed, _, p, store_h = inputs
    _, h, mean, rstd = output
    if not store_h:
        # the pattern stores h whenever the LayerNorm's output requires grad
        raise RuntimeError("layer_norm_dropout_residual: differentiated with store_h=False")
    ctx.save_for_backward(h, mean, rstd, weight, bias, seed)
    ctx.p = p
    ctx.has_residual = residual is not None
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = x.dtype if residual is None else residual.dtype
    # Outputs nobody differentiates (h where the residual stream ends, mean, rstd) arrive as None
    # instead of zero tensors: the kernel then skips that term.
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, dh, _dmean, _drstd):
    h, mean, rstd, weight, bias, seed = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if dy is None and dh is None:
        return (None,) * 8
    if dy is None:
        dy = torch.zeros_like(h)
    need_dweight = weight is not None and needs[2]
    need_dbias = bias is not None and needs[3]
    apart = _gradients_apart(ctx.p, ctx.x_dtype, ctx.residual_dtype)
    need_dresidual = ctx.has_residual and needs[1] and apart
    dx, dresidual, dweight, dbias = torch.ops.fusionpass.layer_norm_dropout_residual_backward(
        dy, dh, h, mean, rstd, weight, bias, seed, ctx.p, need_dweight, need_dbias, need_dresidual,
        ctx.x_dtype, ctx.residual_dtype,
    )
    if ctx.has_residual and needs[1]:
        # without dropout, in one dtype, the two gradients are one tensor (the add's backward)
        dres = dresidual if apart else dx
    else:
        dres = None
    return (
        dx if needs[0] else None,
        dres,
        dweight if need_dweight else None,
        dbias if need_dbias else None,
        None,
        None,
        None,
        None,
    )


layer_norm_dropout_residual.register_autograd(_backward, setup_context=_setup)
