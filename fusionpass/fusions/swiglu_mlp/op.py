"""fusionpass::swiglu and fusionpass::swiglu_backward: the gated MLP without its down projection.

    g = x @ w_gate^T + b_gate,  u = x @ w_up^T + b_up     (model dtype, as the model's linears)
    h = act(g) * u                                        act: "silu" or "gelu_tanh"

`swiglu` returns (h, g, u): the backward needs only x, the weights and the pre-activations g and u
(not act(g), not the product). Regimes: up to DECODE_MAX_M rows one kernel reads W_gate and W_up
once and writes h, g, u; above, the library GEMMs compute g and u and one elementwise kernel h.
`swiglu_backward` computes dg = dh * u * act'(g) and du = dh * act(g) in one elementwise pass; the
autograd formula then uses matmuls for dx, dW_gate, dW_up and sums for the biases.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fusionpass.fusions.swiglu_mlp.kernels import ACTIVATIONS, DECODE_MAX_M
from fusionpass.ops import host


def _act(g: Tensor, activation: str) -> Tensor:
    return F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")


def _check(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")


def _reference_forward(x, w_gate, b_gate, w_up, b_up, activation):
    g = F.linear(x, w_gate, b_gate)
    u = F.linear(x, w_up, b_up)
    h = (_act(g.float(), activation) * u.float()).to(x.dtype)
    return h, g, u


def _reference_backward(dh, g, u, activation):
    # torch.func.vjp, not torch.autograd.grad: this runs inside a custom op's implementation, below
    # the autograd dispatch key, where enable_grad() records nothing
    a, vjp = torch.func.vjp(lambda t: _act(t, activation), g.float())
    (da,) = vjp(torch.ones_like(a))
    dhf = dh.float()
    return (dhf * u.float() * da).to(g.dtype), (dhf * a.detach()).to(u.dtype)


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _kernel_forward(x, w_gate, b_gate, w_up, b_up, activation):
    from fusionpass.fusions.swiglu_mlp import kernels as k

    if _rows(x) <= DECODE_MAX_M:
        return k.swiglu_decode_fwd(x, w_gate, b_gate, w_up, b_up, activation)
    # prefill/training: keep the library GEMMs, fuse act*mul
    g = F.linear(x, w_gate, b_gate)
    u = F.linear(x, w_up, b_up)
    return k.act_mul_fwd(g, u, activation), g, u


def _kernel_backward(dh, g, u, activation):
    from fusionpass.fusions.swiglu_mlp.kernels import act_mul_bwd

    return act_mul_bwd(dh, g, u, activation)


@torch.library.triton_op("fusionpass::swiglu", mutates_args=())
def swiglu(
    x: Tensor,
    w_gate: Tensor,
    b_gate: Tensor | None,
    w_up: Tensor,
    b_up: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor]:
    if x.device.type != "cuda":
        return _forward_host(x, w_gate, b_gate, w_up, b_up, activation)
    _check(activation)
    return _kernel_forward(x, w_gate, b_gate, w_up, b_up, activation)


@torch.library.triton_op("fusionpass::swiglu_backward", mutates_args=())
def swiglu_backward(dh: Tensor, g: Tensor, u: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    if dh.device.type != "cuda":
        return _backward_host(dh, g, u, activation)
    _check(activation)
    return _kernel_backward(dh, g, u, activation)


# CPU tensors go through opaque custom ops (see fusions/rms_norm_residual/op.py): the interpreted kernel under
# TRITON_INTERPRET=1, else the torch reference.


@torch.library.custom_op("fusionpass::swiglu_forward_host", mutates_args=(), schema=host.schema_of(swiglu))
def _forward_host(x, w_gate, b_gate, w_up, b_up, activation):
    _check(activation)
    impl = _kernel_forward if host.interpreting() else _reference_forward
    h, g, u = impl(x, w_gate, b_gate, w_up, b_up, activation)
    return h.contiguous(), g.contiguous(), u.contiguous()


def _fake_forward(x, w_gate, b_gate, w_up, b_up, activation):
    shape = (*x.shape[:-1], w_gate.shape[0])
    return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape)


_forward_host.register_fake(_fake_forward)


@torch.library.custom_op("fusionpass::swiglu_backward_host", mutates_args=(),
                         schema=host.schema_of(swiglu_backward))
def _backward_host(dh, g, u, activation):
    _check(activation)
    impl = _kernel_backward if host.interpreting() else _reference_backward
    dg, du = impl(dh, g, u, activation)
    return dg.contiguous(), du.contiguous()


@_backward_host.register_fake
def _(dh, g, u, activation):
    return torch.empty_like(g, memory_format=torch.contiguous_format), torch.empty_like(
        u, memory_format=torch.contiguous_format
    )


def _setup_context(ctx, inputs, output):
    x, w_gate, b_gate, w_up, b_up, activation = inputs
    _, g, u = output
    ctx.save_for_backward(x, w_gate, w_up, g, u)
    ctx.activation = activation
    ctx.has_bias = (b_gate is not None, b_up is not None)
    # g and u are outputs only for the backward: nobody else differentiates them (None, not zeros)
    ctx.set_materialize_grads(False)


def _backward(ctx, dh, dg_out, du_out):
    x, w_gate, w_up, g, u = ctx.saved_tensors
    if dh is None:
        dg = du = None
    else:
        dg, du = torch.ops.fusionpass.swiglu_backward(dh, g, u, ctx.activation)
    return _gate_up_grads(ctx, x, w_gate, w_up, g, u, dg, du, dg_out, du_out)


def _gate_up_grads(ctx, x, w_gate, w_up, g, u, dg, du, dg_out, du_out):
    """(dx, dW_gate, db_gate, dW_up, db_up) from the pre-activations' gradients (matmuls, sums)."""
    if dg_out is not None:
        dg = dg_out if dg is None else dg + dg_out
    if du_out is not None:
        du = du_out if du is None else du + du_out
    if dg is None:
        dg = torch.zeros_like(g)
    if du is None:
        du = torch.zeros_like(u)
    k, n = x.shape[-1], g.shape[-1]
    x2, dg2, du2 = x.reshape(-1, k), dg.reshape(-1, n), du.reshape(-1, n)
    need = ctx.needs_input_grad
    dx = (dg2 @ w_gate + du2 @ w_up).view(x.shape) if need[0] else None
    dw_gate = dg2.t() @ x2 if need[1] else None
    db_gate = dg2.sum(0) if ctx.has_bias[0] and need[2] else None
    dw_up = du2.t() @ x2 if need[3] else None
    db_up = du2.sum(0) if ctx.has_bias[1] and need[4] else None
    return dx, dw_gate, db_gate, dw_up, db_up, None


swiglu.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# fusionpass::swiglu_down: the same MLP with its down projection, for training,
#     y = h @ w_down^T + b_down,  h = act(g) * u
# returning (y, g, u). h is the op's intermediate, not an output: the backward recomputes it from
# g and u (one elementwise pass) instead of keeping it. With h an output that a down-projection
# GEMM reads, Inductor's partitioner keeps h for that GEMM's weight gradient, a third ffn-wide
# tensor per token next to g and u (benchmarks/results/memory/saved_tensors.md).


def _reference_act_mul(g, u, activation):
    return (_act(g.float(), activation) * u.float()).to(g.dtype)


@torch.library.custom_op("fusionpass::swiglu_act_mul_host", mutates_args=())
def _act_mul_host(g: Tensor, u: Tensor, activation: str) -> Tensor:
    _check(activation)
    if host.interpreting():
        from fusionpass.fusions.swiglu_mlp.kernels import act_mul_fwd

        return act_mul_fwd(g, u, activation).contiguous()
    return _reference_act_mul(g, u, activation).contiguous()


@_act_mul_host.register_fake
def _(g, u, activation):
    return torch.empty_like(g, memory_format=torch.contiguous_format)


def _act_mul(g: Tensor, u: Tensor, activation: str) -> Tensor:
    if g.device.type != "cuda":
        return _act_mul_host(g, u, activation)
    from fusionpass.fusions.swiglu_mlp.kernels import act_mul_fwd

    return act_mul_fwd(g, u, activation)


@torch.library.triton_op("fusionpass::swiglu_down", mutates_args=())
def swiglu_down(
    x: Tensor,
    w_gate: Tensor,
    b_gate: Tensor | None,
    w_up: Tensor,
    b_up: Tensor | None,
    w_down: Tensor,
    b_down: Tensor | None,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor]:
    if x.device.type != "cuda":
        h, g, u = _forward_host(x, w_gate, b_gate, w_up, b_up, activation)
    else:
        _check(activation)
        h, g, u = _kernel_forward(x, w_gate, b_gate, w_up, b_up, activation)
    return F.linear(h, w_down, b_down), g, u


@torch.library.triton_op("fusionpass::swiglu_down_backward", mutates_args=())
def swiglu_down_backward(
    dy: Tensor, w_down: Tensor, g: Tensor, u: Tensor, activation: str
) -> tuple[Tensor, Tensor, Tensor]:
    """(dg, du, dW_down) for y's gradient dy, with h = act(g) * u recomputed here."""
    _check(activation)
    n = g.shape[-1]
    h2 = _act_mul(g, u, activation).reshape(-1, n)
    dy2 = dy.reshape(-1, dy.shape[-1])
    dw_down = dy2.t() @ h2
    dh = (dy2 @ w_down).view(g.shape)
    if dh.device.type != "cuda":
        dg, du = _backward_host(dh, g, u, activation)
    else:
        dg, du = _kernel_backward(dh, g, u, activation)
    return dg, du, dw_down


def _setup_context_down(ctx, inputs, output):
    x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation = inputs
    _, g, u = output
    ctx.save_for_backward(x, w_gate, w_up, w_down, g, u)
    ctx.activation = activation
    ctx.has_bias = (b_gate is not None, b_up is not None)
    ctx.has_down_bias = b_down is not None
    ctx.set_materialize_grads(False)


def _backward_down(ctx, dy, dg_out, du_out):
    x, w_gate, w_up, w_down, g, u = ctx.saved_tensors
    need = ctx.needs_input_grad
    dw_down = db_down = dg = du = None
    if dy is not None:
        dg, du, dw_down = torch.ops.fusionpass.swiglu_down_backward(dy, w_down, g, u, ctx.activation)
        if ctx.has_down_bias and need[6]:
            db_down = dy.reshape(-1, dy.shape[-1]).sum(0)
    grads = _gate_up_grads(ctx, x, w_gate, w_up, g, u, dg, du, dg_out, du_out)
    return (*grads[:5], dw_down if need[5] else None, db_down, None)


swiglu_down.register_autograd(_backward_down, setup_context=_setup_context_down)

