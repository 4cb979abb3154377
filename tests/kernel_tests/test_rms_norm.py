"""Numerics of the rms_norm_residual kernels (run under the Triton interpreter on CPU).

The reference is float64 autograd over the model's formula, with every rounding the model does
(h = residual + x in the input dtype, n.to(input_dtype), the final cast) applied as a
straight-through rounding: the forward value is rounded, the gradient passes unchanged.
"""
import pytest
import torch

from fusionpass.fusions.rms_norm_residual.kernels import rms_norm_bwd, rms_norm_fwd

# The interpreter turns program ids into Python ints for range() through a deprecated numpy path.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Relative tolerance per output dtype: a little above one ulp.
TOL = {F32: 1e-5, F16: 1e-3, BF16: 1e-2}

# weight mode -> (has weight, weight_after_cast, weight_offset)
MODES = {
    "llama": (True, True, 0.0),    # weight * n.to(input_dtype)
    "gemma": (True, False, 1.0),   # (n * (1 + w.float())).to(input_dtype)
    "plain": (True, False, 0.0),   # (n * w.float()).to(input_dtype)
    "none": (False, True, 0.0),    # n.to(input_dtype), no affine
    "none_nc": (False, False, 0.0),
}


def _st(t, dtype):
    """Round t to dtype in the forward, identity in the backward."""
    return t + (t.to(dtype).double() - t).detach()


def reference(x, r, w, dy, dh, eps, mode, out_dtype=None):
    has_w, after_cast, offset = MODES[mode]
    dt = x.dtype
    out_dtype = dt if out_dtype is None else out_dtype
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_() if has_w else None
    if r is not None:
        r64 = r.double().requires_grad_()
        h_model = r + x  # the model adds in the input dtype
        s = x64 + r64
        h64 = s + (h_model.double() - s).detach()
    else:
        h_model, h64 = x, x64
    rstd = torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    n = h64 * rstd
    if not has_w:
        y = _st(n, dt)
    elif after_cast:
        y = _st(_st(n, dt) * (w64 + offset), out_dtype)
    else:
        y = _st(n * (w64 + offset), out_dtype)
    # dx = rstd * (g - n * mean(g * n)) can cancel to ~0 (always at N=1): compare it at the scale of
    # its terms, not its own.
    g = dy.double() * ((w64.detach() + offset) if has_w else 1.0)
    dx_scale = (rstd.detach() * g).abs().max().item() + (dh.abs().max().item() if dh is not None and dh.numel() else 0)
    loss = (y * dy.double()).sum()
    if dh is not None:
        loss = loss + (h64 * dh.double()).sum()
    loss.backward()
    if r is not None:
        assert torch.equal(r64.grad, x64.grad)
    return dict(y=y.detach(), h=h_model, rstd=rstd.detach().reshape(-1), dx=x64.grad, dx_scale=dx_scale,
                dw=w64.grad if has_w else None)


def assert_close(out, ref, dtype, what, scale=None):
    assert out.dtype == dtype, what
    assert out.shape == ref.shape, what
    tol = TOL[dtype]
    ref = ref.double()
    if scale is None:
        scale = ref.abs().max().item() if ref.numel() else 0.0
    # atol covers elements near zero, relative to the tensor's scale
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * scale + 1e-30, msg=lambda m: f"{what}: {m}")


def make(shape, dtype, *, residual=True, mode="llama", dh=False, wdtype=None, scale=1.0):
    n = shape[-1]
    # uniform(0.5, 1.5) with random signs: random and never zero
    def rnd(s, dt):
        v = torch.rand(s, dtype=torch.float64) + 0.5
        v = v * torch.where(torch.rand(s) < 0.5, -1.0, 1.0).double()
        return v.to(dt)
    x = (rnd(shape, torch.float64) * scale).to(dtype)
    r = (rnd(shape, torch.float64) * scale).to(dtype) if residual else None
    w = rnd((n,), wdtype or dtype) if MODES[mode][0] else None
    dy = rnd(shape, dtype)
    dhv = rnd(shape, dtype) if dh else None
    return x, r, w, dy, dhv


def run_and_check(x, r, w, dy, dh, *, mode, eps=1e-6, need_dw=True, out_dtype=None, max_fused=None,
                  num_programs=None):
    _, after_cast, offset = MODES[mode]
    dt = x.dtype
    y, h, rstd = rms_norm_fwd(x, r, w, eps, weight_offset=offset, weight_after_cast=after_cast,
                              out_dtype=out_dtype, max_chunk=max_fused)
    dx, dw = rms_norm_bwd(dy, dh, h, rstd, w, weight_offset=offset, weight_after_cast=after_cast,
                          need_dweight=need_dw, max_fused=max_fused, num_programs=num_programs)
    ref = reference(x, r, w, dy, dh, eps, mode, out_dtype)

    if r is None:
        assert h is x
    else:
        assert h.dtype == dt and torch.equal(h, ref["h"]), "h must be residual + x rounded like torch"
    assert rstd.dtype == F32 and rstd.shape == (x.numel() // x.shape[-1],)
    torch.testing.assert_close(rstd.double(), ref["rstd"], rtol=1e-5, atol=0)
    assert_close(y, ref["y"], out_dtype or dt, "y")
    assert_close(dx, ref["dx"], dt, "dx", scale=ref["dx_scale"])
    if w is None or not need_dw:
        assert dw is None
    else:
        assert_close(dw, ref["dw"], w.dtype, "dweight")
    return y, h, rstd, dx, dw


# (M, N) x dtype, each paired with two flag combinations chosen so that every mode, residual,
# dh and need_dweight setting meets every dtype and both small (tiled rows) and wide rows.
SHAPES = [(1, 1), (7, 3), (33, 67), (7, 129), (5, 1000)]
MODE_NAMES = list(MODES)


def _cases():
    cases = []
    i = 0
    for shape in SHAPES:
        for dtype in (F32, F16, BF16):
            for k in range(2):
                j = 2 * i + k
                mode = MODE_NAMES[j % len(MODE_NAMES)]
                residual = (i + k) % 2 == 0
                dh = (i // 2 + k) % 2 == 1
                need_dw = (j % 7) != 3
                cases.append(pytest.param(shape, dtype, mode, residual, dh, need_dw,
                                          id=f"{shape[0]}x{shape[1]}-{str(dtype)[6:]}-{mode}"
                                             f"-{'res' if residual else 'nores'}-{'dh' if dh else 'nodh'}"
                                             f"{'' if need_dw else '-nodw'}"))
            i += 1
    return cases


@pytest.mark.parametrize("shape,dtype,mode,residual,dh,need_dw", _cases())
def test_register_path(shape, dtype, mode, residual, dh, need_dw):
    x, r, w, dy, dhv = make(shape, dtype, residual=residual, mode=mode, dh=dh)
    run_and_check(x, r, w, dy, dhv, mode=mode, need_dw=need_dw)


# Long rows: `max_fused` forces the chunked loops at small N (chunk = max_fused, last one partial).
CHUNKED = [
    ((7, 1000), F32, "llama", True, True, 256),
    ((7, 1000), F16, "gemma", True, False, 256),
    ((7, 1000), BF16, "plain", False, True, 256),
    ((5, 67), F32, "none", False, False, 16),
    ((5, 67), F16, "none_nc", True, True, 16),
    ((5, 67), BF16, "llama", True, True, 16),
    ((3, 5000), BF16, "gemma", True, True, 1024),
    ((3, 5000), F16, "llama", False, True, None),   # default: registers (BLOCK_N 8192) both ways
    ((2, 9000), BF16, "llama", True, True, None),   # default: registers forward, chunked backward
    ((2, 17000), F32, "gemma", True, False, None),  # default: chunked both ways
]


@pytest.mark.parametrize("shape,dtype,mode,residual,dh,max_fused", CHUNKED,
                         ids=[f"{c[0][0]}x{c[0][1]}-{str(c[1])[6:]}-{c[2]}-mf{c[5]}" for c in CHUNKED])
def test_chunked_path(shape, dtype, mode, residual, dh, max_fused):
    x, r, w, dy, dhv = make(shape, dtype, residual=residual, mode=mode, dh=dh)
    run_and_check(x, r, w, dy, dhv, mode=mode, max_fused=max_fused)


@pytest.mark.parametrize("max_fused", [None, 64], ids=["registers", "chunked"])
def test_persistent_grid_sizes(max_fused):
    # Every grid size must give the same dx, and dweight up to summation order.
    m = 33 if max_fused is None else 9  # 3 row tiles of 16 / 9 single rows
    x, r, w, dy, dh = make((m, 100), BF16, mode="llama", dh=True)
    base = run_and_check(x, r, w, dy, dh, mode="llama", max_fused=max_fused)
    for g in (1, 2, 5, 40):
        out = run_and_check(x, r, w, dy, dh, mode="llama", max_fused=max_fused, num_programs=g)
        assert torch.equal(out[0], base[0]) and torch.equal(out[3], base[3])
        torch.testing.assert_close(out[4], base[4], rtol=1e-2, atol=0)


@pytest.mark.parametrize("max_fused", [None, 32], ids=["registers", "chunked"])
def test_store_h_false(max_fused):
    x, r, w, _, _ = make((7, 67), BF16, mode="gemma")
    y, h, rstd = rms_norm_fwd(x, r, w, 1e-6, weight_offset=1.0, weight_after_cast=False, max_chunk=max_fused)
    y2, h2, rstd2 = rms_norm_fwd(x, r, w, 1e-6, weight_offset=1.0, weight_after_cast=False, store_h=False,
                                 max_chunk=max_fused)
    assert h2 is None and torch.equal(h, r + x)
    assert torch.equal(y, y2) and torch.equal(rstd, rstd2)
    _, h3, _ = rms_norm_fwd(x, None, w, 1e-6, store_h=False, max_chunk=max_fused)
    assert h3 is None


@pytest.mark.parametrize("dtype,max_fused", [(F32, None), (BF16, None), (BF16, 32)])
def test_eps_is_used(dtype, max_fused):
    # mean(h^2) ~ 1e-8, so eps dominates rstd; with a runtime eps, each value must show.
    x, r, w, dy, dh = make((5, 67), dtype, mode="llama", scale=1e-4)
    for eps in (1e-6, 1e-5):
        run_and_check(x, r, w, dy, dh, mode="llama", eps=eps, max_fused=max_fused)


@pytest.mark.parametrize("max_fused", [None, 32], ids=["registers", "chunked"])
def test_mixed_weight_dtype(max_fused):
    # An fp32 dweight checks at fp32 tolerance what bf16 outputs would hide (e.g. the rounding of
    # n in the Llama dweight).
    # Gemma keeps the output in the input dtype; dweight comes back in the weight's dtype.
    x, r, w, dy, dh = make((7, 67), BF16, mode="gemma", wdtype=F32)
    run_and_check(x, r, w, dy, dh, mode="gemma", max_fused=max_fused)
    # Llama with an fp32 weight on bf16 activations: the product (and y) is fp32.
    x, r, w, dy, dh = make((7, 67), BF16, mode="llama", wdtype=F32, dh=True)
    run_and_check(x, r, w, dy.float(), dh, mode="llama", out_dtype=F32, max_fused=max_fused)
    x, r, w, dy, dh = make((7, 67), F16, mode="llama", wdtype=BF16)
    run_and_check(x, r, w, dy.float(), dh, mode="llama", out_dtype=F32, max_fused=max_fused)


def test_dweight_reduce_many_programs():
    # More partial rows than one block of the reduction kernel (64) takes at once.
    x, r, w, dy, dh = make((70, 5), F32, mode="plain")
    run_and_check(x, r, w, dy, dh, mode="plain", max_fused=4, num_programs=70)


def test_batched_and_strided_inputs():
    # 3-D inputs, and rows that are slices of a wider buffer (last dim contiguous).
    x, r, w, dy, dh = make((2, 3, 67), F16, mode="llama", dh=True)
    run_and_check(x, r, w, dy, dh, mode="llama")
    wide = torch.randn(9, 80, dtype=F16)
    x = wide[:, 5:72]
    assert not x.is_contiguous()
    _, r, w, dy, dh = make((9, 67), F16, mode="plain", dh=True)
    out = run_and_check(x, r, w, dy, dh, mode="plain")
    ref = run_and_check(x.contiguous(), r, w, dy, dh, mode="plain")
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("residual", [True, False])
def test_empty_rows(residual):
    for shape in ((0, 64), (2, 0, 64)):
        x = torch.randn(shape, dtype=BF16)
        r = torch.randn(shape, dtype=BF16) if residual else None
        w = torch.randn(64, dtype=BF16)
        y, h, rstd = rms_norm_fwd(x, r, w, 1e-6)
        assert y.shape == shape and y.dtype == BF16 and rstd.shape == (0,) and rstd.dtype == F32
        assert h.shape == shape
        dx, dw = rms_norm_bwd(torch.randn(shape, dtype=BF16), None, h, rstd, w)
        assert dx.shape == shape and dx.dtype == BF16
        assert dw.shape == (64,) and dw.dtype == BF16 and not dw.any()
        _, dw = rms_norm_bwd(torch.randn(shape, dtype=BF16), None, h, rstd, w, need_dweight=False)
        assert dw is None
