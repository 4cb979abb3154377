"""fusionpass::layer_norm_dropout_residual as an op: its two CPU paths agree (the Triton kernels
under the interpreter, what the tests and CUDA run, and the torch reference, what CPU graphs run
without the interpreter), both drop exactly the elements `dropout_mask` names for the seed, the
autograd formula regenerates that mask in the backward, and outputs never alias inputs."""
import pytest
import torch

import fusionpass  # noqa: F401  (registers the ops)
from fusionpass.fusions.layer_norm_dropout_residual.kernels import dropout_mask
from fusionpass.kernels.rng import philox_keep

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

OP = torch.ops.fusionpass.layer_norm_dropout_residual
F32, BF16 = torch.float32, torch.bfloat16
EPS = 1e-5


@pytest.mark.parametrize("seed", [0, 1234567, 2**62 - 3])
@pytest.mark.parametrize("shape, p", [((7, 67), 0.1), ((3, 5, 130), 0.5), ((2, 3), 0.9)])
def test_torch_philox_is_the_kernels_mask(shape, p, seed):
    want = dropout_mask(shape, p, torch.tensor([seed]))
    rows = want.numel() // shape[-1]
    assert torch.equal(philox_keep(rows, shape[-1], p, seed).reshape(shape), want)


def _inputs(dtype, residual=True, shape=(3, 5, 67)):
    n = shape[-1]
    x = torch.randn(shape).to(dtype)
    r = torch.randn(shape).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(n)).to(dtype)
    b = (0.1 * torch.randn(n)).to(dtype)
    return x, r, w, b


def _run(monkeypatch, interpret: bool, x, r, w, b, seed, p, dh=True):
    """Forward and backward through the op; returns outputs and gradients."""
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    y, h, mean, rstd = OP(*leaves, seed, EPS, p, True)
    gen = torch.Generator().manual_seed(7)
    outs = [y, h] if dh else [y]
    grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return {"y": y, "h": h, "mean": mean, "rstd": rstd, "dx": leaves[0].grad, "dw": leaves[2].grad,
            "db": leaves[3].grad, "dr": None if r is None else leaves[1].grad}


@pytest.mark.parametrize("dtype", [F32, BF16])
# (p == 0 without a residual is a plain LayerNorm: the pattern never builds it)
@pytest.mark.parametrize("p, residual", [(0.0, True), (0.3, True), (0.3, False)])
def test_reference_matches_kernel(monkeypatch, dtype, p, residual):
    x, r, w, b = _inputs(dtype, residual)
    seed = torch.tensor([987654321]) if p else None
    kernel = _run(monkeypatch, True, x, r, w, b, seed, p)
    reference = _run(monkeypatch, False, x, r, w, b, seed, p)
    tol = 1e-5 if dtype == F32 else 2e-2
    for name, a in kernel.items():
        e = reference[name]
        assert (a is None) == (e is None), name
        if a is None:
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, name
        torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol, msg=name)
    if p:
        # the same elements dropped on both paths: h - r is zero exactly there
        keep = dropout_mask(x.shape, p, seed)
        for out in (kernel, reference):
            dropped = out["h"] if r is None else out["h"] - r
            assert not dropped[~keep].any()
            if dtype == F32:  # (in bf16 a small kept value can vanish in the sum's rounding)
                assert dropped[keep].all()


@pytest.mark.parametrize("interpret", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("x_dtype, r_dtype", [(BF16, F32), (F32, BF16)], ids=["bf16-x", "bf16-residual"])
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_a_16_bit_operand_and_an_fp32_one_sum_in_fp32(monkeypatch, interpret, x_dtype, r_dtype, p):
    """Autocast's residual stream: x (a block's output) in bf16 and the residual in fp32, or the
    other way round. h and y come out fp32, and each input's gradient in its own dtype, as autograd
    of `dropout(x) + residual` then an fp32 LayerNorm gives them (float64 reference, the dropped x
    rounded to its dtype first as the model rounds it)."""
    x, _, w, b = _inputs(x_dtype)
    r = torch.randn(x.shape).to(r_dtype)
    seed = torch.tensor([42]) if p else None
    got = _run(monkeypatch, interpret, x, r, w.float(), b.float(), seed, p)
    assert got["y"].dtype == got["h"].dtype == F32
    assert got["dx"].dtype == x_dtype and got["dr"].dtype == r_dtype and got["dw"].dtype == F32
    keep = dropout_mask(x.shape, p, seed) if p else torch.ones(x.shape, dtype=torch.bool)
    leaves = [t.double().requires_grad_() for t in (x, r, w.float(), b.float())]
    xd, rd, wd, bd = leaves
    dropped = torch.where(keep, (xd / (1 - p)).to(x_dtype).double(), 0) if p else xd
    h = dropped + rd
    y = torch.nn.functional.layer_norm(h, (x.shape[-1],), wd, bd, EPS)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(t.shape, generator=gen).float().double() for t in (y, h)]
    torch.autograd.backward([y, h], grads)
    torch.testing.assert_close(got["h"].double(), h.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["y"].double(), y.detach(), rtol=1e-4, atol=1e-4)
    for name, leaf in zip(("dx", "dr", "dw", "db"), leaves):
        # each gradient rounded to its tensor's dtype once: bf16's half ulp of the largest value
        tol = 1e-4 if got[name].dtype == F32 else 2 ** -8 * leaf.grad.abs().max().item()
        torch.testing.assert_close(got[name].double(), leaf.grad, rtol=0, atol=tol, msg=name)


def test_two_16_bit_dtypes_are_refused():
    x, r, w, b = _inputs(BF16)
    with pytest.raises(ValueError, match="one must be float32 or both equal"):
        from fusionpass.fusions.layer_norm_dropout_residual.kernels import layer_norm_fwd

        layer_norm_fwd(x, r.half(), w, b, EPS)


@pytest.mark.parametrize("interpret", [True, False], ids=["kernel", "reference"])
def test_backward_regenerates_the_mask(monkeypatch, interpret):
    """Gradients against float64 autograd of the model's formula with the seed's mask."""
    p = 0.25
    x, r, w, b = _inputs(F32)
    seed = torch.tensor([42])
    got = _run(monkeypatch, interpret, x, r, w, b, seed, p)
    keep = dropout_mask(x.shape, p, seed)
    leaves = [t.double().requires_grad_() for t in (x, r, w, b)]
    xd, rd, wd, bd = leaves
    h = torch.where(keep, xd / (1 - p), 0) + rd
    y = torch.nn.functional.layer_norm(h, (x.shape[-1],), wd, bd, EPS)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(t.shape, generator=gen).double() for t in (y, h)]
    torch.autograd.backward([y, h], grads)
    torch.testing.assert_close(got["h"].double(), h.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["y"].double(), y.detach(), rtol=1e-4, atol=1e-4)
    for name, leaf in zip(("dx", "dr", "dw", "db"), leaves):
        torch.testing.assert_close(got[name].double(), leaf.grad, rtol=1e-4, atol=1e-4, msg=name)
    assert not got["dx"][~keep].any()


@pytest.mark.parametrize("interpret", [True, False], ids=["kernel", "reference"])
def test_unused_h_gradient_and_no_aliasing(monkeypatch, interpret):
    """Only y differentiated: h's gradient arrives as None (no zero tensor is made); the outputs
    are fresh tensors even where the kernel would hand back x itself (p == 0, no residual)."""
    x, r, w, b = _inputs(F32)
    got = _run(monkeypatch, interpret, x, r, w, b, None, 0.0, dh=False)
    assert got["dx"] is not None and torch.equal(got["dx"], got["dr"])
    monkeypatch.setenv("TRITON_INTERPRET", "1" if interpret else "0")
    _, h, _, _ = OP(x, None, w, b, None, EPS, 0.0, True)
    assert torch.equal(h, x) and h.data_ptr() != x.data_ptr()
    y2, h2, _, _ = OP(x, r, None, None, None, EPS, 0.0, False)
    assert h2.numel() == 0 and y2.shape == x.shape
    torch.testing.assert_close(y2, torch.nn.functional.layer_norm(x + r, (x.shape[-1],), eps=EPS))


def test_opcheck():
    """Schema, fake implementation, autograd registration and AOT dispatch of both ops."""
    x, r, w, b = _inputs(F32, shape=(2, 3, 16))
    seed = torch.tensor([5])
    grad = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
    for args in [
        (*grad, seed, EPS, 0.5, True),
        (grad[0], r, grad[2], None, None, EPS, 0.0, True),
        (x, None, None, b, seed, EPS, 0.1, False),  # inference: h not returned
    ]:
        torch.library.opcheck(OP, args)
    y, h, mean, rstd = OP(x, r, w, b, seed, EPS, 0.5, True)
    backward = torch.ops.fusionpass.layer_norm_dropout_residual_backward
    dy = torch.randn_like(y)
    for args in [
        (dy, torch.randn_like(h), h, mean, rstd, w, b, seed, 0.5, True, True, True, F32, F32),
        (dy, None, h, mean, rstd, None, None, None, 0.0, False, False, False, F32, F32),
    ]:
        torch.library.opcheck(backward, args)
    # autocast's residual stream: a bf16 x, an fp32 residual, fp32 sum and parameters
    xb = x.to(BF16).requires_grad_()
    torch.library.opcheck(OP, (xb, r.detach().requires_grad_(), w.detach().requires_grad_(), None, None, EPS,
                               0.0, True))
    y, h, mean, rstd = (t.detach() for t in OP(xb, r, w, None, None, EPS, 0.0, True))
    torch.library.opcheck(backward, (torch.randn_like(y), None, h, mean, rstd, w.detach(), None, None, 0.0, True,
                                     False, True, BF16, F32))
