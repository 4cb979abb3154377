"""swiglu kernels under the Triton interpreter against a float64 reference: the decode forward
(h, g, u), the fused act*mul forward and the fused elementwise backward (dg, du); SiLU and
GELU-tanh, odd sizes (not multiples of the blocks), fp32 and bf16, with and without bias; and the
fusionpass::swiglu op's autograd."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_tensors_close

import fusionpass.ops  # noqa: F401  (registers fusionpass::swiglu)
from fusionpass.fusions.swiglu_mlp.kernels import act_mul_bwd, act_mul_fwd, swiglu_decode_fwd

ACTS = ["silu", "gelu_tanh"]
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _act(g, activation):
    return F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")


def _inputs(m, k, n, dtype, bias):
    x = torch.randn(m, k, dtype=dtype)
    wg = (torch.randn(n, k) / k**0.5).to(dtype)
    wu = (torch.randn(n, k) / k**0.5).to(dtype)
    bg = torch.randn(n, dtype=dtype) if bias else None
    bu = torch.randn(n, dtype=dtype) if bias else None
    return x, wg, bg, wu, bu


def _reference(x, wg, bg, wu, bu, activation):
    d = torch.float64
    g = F.linear(x.to(d), wg.to(d), None if bg is None else bg.to(d))
    u = F.linear(x.to(d), wu.to(d), None if bu is None else bu.to(d))
    return _act(g, activation) * u, g, u


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("m,k,n", [(1, 37, 21), (5, 77, 45)])
def test_decode_forward(m, k, n, activation, dtype, bias):
    args = _inputs(m, k, n, dtype, bias)
    h, g, u = swiglu_decode_fwd(*args, activation, block_n=16, block_k=32)
    hr, gr, ur = _reference(*args, activation)
    for name, got, ref in (("h", h, hr), ("g", g, gr), ("u", u, ur)):
        assert_tensors_close(got, ref.to(dtype), RTOL[dtype], name)


def test_decode_forward_default_blocks_3d():
    x, wg, bg, wu, bu = _inputs(6, 40, 70, torch.float32, True)
    x = x.view(2, 3, 40)
    h, _g, _u = swiglu_decode_fwd(x, wg, bg, wu, bu, "silu")
    hr, _, _ = _reference(x, wg, bg, wu, bu, "silu")
    assert h.shape == (2, 3, 70)
    assert_tensors_close(h, hr.float(), 1e-5, "h")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ACTS)
def test_elementwise_forward_and_backward(activation, dtype):
    shape = (7, 33)
    g, u, dh = (torch.randn(shape, dtype=dtype) for _ in range(3))
    gd = g.double().requires_grad_(True)
    ud = u.double().requires_grad_(True)
    h_ref = _act(gd, activation) * ud
    h_ref.backward(dh.double())
    h = act_mul_fwd(g, u, activation, block=64)
    dg, du = act_mul_bwd(dh, g, u, activation, block=64)
    assert_tensors_close(h, h_ref.detach().to(dtype), RTOL[dtype], "h")
    assert_tensors_close(dg, gd.grad.to(dtype), RTOL[dtype], "dg")
    assert_tensors_close(du, ud.grad.to(dtype), RTOL[dtype], "du")


@pytest.mark.parametrize("m", [3, 70], ids=["decode", "library_gemms"])
@pytest.mark.parametrize("activation", ACTS)
def test_op_autograd(activation, m):
    args = [t.requires_grad_(True) if t is not None else None
            for t in _inputs(m, 24, 20, torch.float32, True)]
    h, _g, _u = torch.ops.fusionpass.swiglu(*args, activation)
    dh = torch.randn_like(h)
    grads = torch.autograd.grad(h, [a for a in args], dh)
    ref_args = [a.detach().double().requires_grad_(True) for a in args]
    hr, _, _ = _reference(*ref_args, activation)
    ref_grads = torch.autograd.grad(hr, ref_args, dh.double())
    assert_tensors_close(h.detach(), hr.detach().float(), 1e-5, "h")
    for name, got, ref in zip(("x", "w_gate", "b_gate", "w_up", "b_up"), grads, ref_grads):
        assert_tensors_close(got, ref.float(), 1e-5, f"d{name}")


def test_unknown_activation():
    x, wg, _, wu, _ = _inputs(2, 8, 8, torch.float32, False)
    with pytest.raises(ValueError, match="activation"):
        swiglu_decode_fwd(x, wg, None, wu, None, "relu")
