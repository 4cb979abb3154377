"""The ops' two CPU paths agree: the Triton kernel under the interpreter (what the tests and CUDA
run) and the torch reference (what CPU graphs run without the interpreter)."""
import pytest
import torch

import fusionpass  # noqa: F401  (registers the ops)


def _run(monkeypatch, interpret: bool, x, r, w, offset, after_cast):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    xs = [None if t is None else t.detach().clone().requires_grad_() for t in (x, r, w)]
    if r is None:
        y, rstd = torch.ops.fusionpass.rms_norm(xs[0], xs[2], 1e-5, offset, after_cast)
        outs = (y,)
    else:
        y, h, rstd = torch.ops.fusionpass.rms_norm_residual(xs[0], xs[1], xs[2], 1e-5, offset, after_cast)
        outs = (y, h)
    grads = [torch.randn_like(o, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs)]
    torch.autograd.backward(outs, grads)
    return [*outs, rstd, xs[0].grad, xs[2].grad] + ([xs[1].grad] if r is not None else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("offset,after_cast", [(0.0, True), (1.0, False)], ids=["llama", "gemma"])
def test_reference_matches_kernel(monkeypatch, dtype, residual, offset, after_cast):
    x = torch.randn(3, 5, 67).to(dtype)
    r = torch.randn(3, 5, 67).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(67)).to(dtype)
    kernel = _run(monkeypatch, True, x, r, w, offset, after_cast)
    reference = _run(monkeypatch, False, x, r, w, offset, after_cast)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(kernel, reference):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16])
def test_autocast_residual_stream(monkeypatch, narrow):
    """Autocast over fp32 weights: the fp32 stream x plus a 16-bit sublayer output r. Both paths
    compute the model's fp32 sum and norm (float64 below), and r gets its gradient in its dtype."""
    x = torch.randn(3, 5, 67)
    r = torch.randn(3, 5, 67).to(narrow)
    w = 1 + 0.1 * torch.randn(67)
    kernel = _run(monkeypatch, True, x, r, w, 0.0, True)
    reference = _run(monkeypatch, False, x, r, w, 0.0, True)
    h64 = x.double() + r.double()
    y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    for got in (kernel, reference):
        y, h, _, dx, _, dr = got
        assert (y.dtype, h.dtype, dx.dtype, dr.dtype) == (torch.float32, torch.float32, torch.float32, narrow)
        torch.testing.assert_close(h.double(), h64, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dr.float(), dx.to(narrow).float(), rtol=0, atol=0)
    for a, b in zip(kernel, reference):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)


def test_16bit_x_with_fp32_residual_is_refused(monkeypatch):
    """The sum is rounded to x's dtype, so an fp32 residual on a 16-bit x would lose it: refused."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fusionpass.fusions.rms_norm_residual.kernels import rms_norm_fwd

    with pytest.raises(ValueError, match="residual must match x"):
        rms_norm_fwd(torch.randn(4, 67).bfloat16(), torch.randn(4, 67), None, 1e-5)
