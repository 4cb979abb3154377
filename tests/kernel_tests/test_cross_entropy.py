"""Numerics of the linear_cross_entropy kernel and op (Triton interpreter on CPU).

The reference is float64 autograd over the model's formula, F.cross_entropy(cap(h @ W^T + b), y),
with the roundings the model does applied straight-through: the logits come out of the GEMM in the
model dtype, and Gemma-2 caps them in the model dtype too. Loss, logits and the gradients of h, W
and b are compared, for odd vocabulary sizes (several vocabulary blocks and a masked tail), token
chunks that do not divide the token count, ignored labels and whole ignored sequences, label
smoothing, soft-capping, both reductions, fp32 and bf16 (and one fp16 case).
"""
import pytest
import torch
import torch.nn.functional as F

from fusionpass.fusions.linear_cross_entropy.kernels import (
    CPU_TILING,
    ce_chunk,
    chunk_rows_for,
    linear_cross_entropy_fwd,
)
from fusionpass.fusions.linear_cross_entropy.op import _reference_step

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# relative to the largest reference value: a little above one ulp (bf16: dW adds one rounding per
# token chunk)
TOL = {F32: 2e-5, F16: 2e-3, BF16: 2e-2}
N, D = 12, 32
IGNORE = -100


def _st(t, dtype):
    """Round t to dtype in the forward, identity in the backward."""
    return t + (t.to(dtype).double() - t).detach()


def reference(h, w, b, y, *, reduction="mean", smoothing=0.0, softcap=0.0, rounded=True,
              ignore_index=IGNORE):
    h64 = h.double().requires_grad_()
    w64 = w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    z = _st(F.linear(h64, w64, b64), h.dtype)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
        if rounded:
            z = _st(z, h.dtype)
    loss = F.cross_entropy(z, y, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=smoothing)
    loss.backward()
    return {"loss": loss.detach(), "logits": z.detach(), "dh": h64.grad, "dw": w64.grad,
            "db": None if b is None else b64.grad}


def make(vocab, dtype, *, bias=False, ignored=(1, 5), seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, D, generator=gen).to(dtype)
    w = (torch.randn(vocab, D, generator=gen) * D**-0.5 * 2).to(dtype)
    b = (torch.randn(vocab, generator=gen) * 0.5).to(dtype) if bias else None
    y = torch.randint(0, vocab, (N,), generator=gen)
    y[list(ignored)] = IGNORE
    return h, w, b, y


def assert_close(out, ref, dtype, what):
    assert out is not None, what
    assert out.shape == ref.shape, what
    tol = TOL[dtype]
    ref = ref.double()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * scale + 1e-30,
                               msg=lambda m: f"{what}: {m}")


def check(out, ref, dtype, *, logits=True):
    loss, lg, dh, dw, db = out
    assert loss.dtype == F32 and loss.dim() == 0
    # the loss: an fp32 sum of per-token losses of rounded logits
    torch.testing.assert_close(loss.double(), ref["loss"], rtol=TOL[dtype] / 4, atol=1e-6)
    if logits:
        assert lg.dtype == dtype
        assert_close(lg, ref["logits"], dtype, "logits")
    for name, t in (("dh", dh), ("dw", dw), ("db", db)):
        if ref[name] is not None:
            assert t.dtype == dtype, name
            assert_close(t, ref[name], dtype, name)


CASES = [
    # vocab, reduction, label smoothing, soft-cap, bias
    (257, "mean", 0.0, 0.0, False),
    (257, "sum", 0.1, 0.0, True),
    (1000, "mean", 0.1, 5.0, False),
    (1000, "sum", 0.0, 30.0, True),
]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab,reduction,smoothing,softcap,bias", CASES)
def test_forward_and_gradients(vocab, reduction, smoothing, softcap, bias, dtype):
    h, w, b, y = make(vocab, dtype, bias=bias)
    out = linear_cross_entropy_fwd(
        h, w, b, y, reduction=reduction, label_smoothing=smoothing, softcap=softcap,
        return_logits=True, chunk_rows=5, block_v=256 if vocab > 512 else 64,
    )
    ref = reference(h, w, b, y, reduction=reduction, smoothing=smoothing, softcap=softcap)
    check(out, ref, dtype)


def test_fp16_without_logits():
    h, w, b, y = make(300, F16, bias=True)
    out = linear_cross_entropy_fwd(h, w, b, y, label_smoothing=0.2, chunk_rows=8, block_v=128)
    assert out[1] is None  # logits are not returned: one [chunk, V] block is all there is
    check(out, reference(h, w, b, y, smoothing=0.2), F16, logits=False)


def test_softcap_in_fp32_is_not_rounded():
    """A cap applied after the upcast (not Gemma-2's order) leaves the capped logits unrounded."""
    h, w, b, y = make(257, BF16)
    out = linear_cross_entropy_fwd(h, w, b, y, softcap=3.0, softcap_rounded=False, block_v=64)
    ref = reference(h, w, b, y, softcap=3.0, rounded=False)
    check(out, ref, BF16, logits=False)


def test_ignored_sequences_and_partial_grads():
    """Whole sequences of ignored labels (rows 0-3): their rows get exact zero gradients; the mean
    runs over the other tokens. Only the gradient of the weight is asked for."""
    h, w, b, y = make(257, F32, ignored=(0, 1, 2, 3, 9))
    loss, logits, dh, dw, db = linear_cross_entropy_fwd(
        h, w, b, y, need_dh=False, chunk_rows=4, block_v=64
    )
    assert logits is None and dh is None and db is None
    ref = reference(h, w, b, y)
    torch.testing.assert_close(loss.double(), ref["loss"], rtol=1e-6, atol=1e-6)
    assert_close(dw, ref["dw"], F32, "dw")
    _, _, dh, _, _ = linear_cross_entropy_fwd(h, w, b, y, chunk_rows=4, block_v=64)
    assert torch.equal(dh[:4], torch.zeros_like(dh[:4]))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_token_ignored(reduction):
    """As F.cross_entropy: mean over no tokens is nan, sum is 0; the gradients are zeros."""
    h, w, b, y = make(257, F32, bias=True, ignored=range(N))
    loss, _, dh, dw, db = linear_cross_entropy_fwd(
        h, w, b, y, reduction=reduction, label_smoothing=0.1, block_v=128
    )
    ref = reference(h, w, b, y, reduction=reduction, smoothing=0.1)
    assert torch.isnan(ref["loss"]) == torch.isnan(loss)
    if reduction == "sum":
        assert loss.item() == 0.0
    for t in (dh, dw, db):
        assert torch.equal(t, torch.zeros_like(t))


def test_no_grad_forward_only():
    h, w, b, y = make(1000, BF16)
    loss, logits, dh, dw, db = linear_cross_entropy_fwd(
        h, w, b, y, need_dh=False, need_dw=False, need_db=False, block_v=512
    )
    assert logits is None and dh is None and dw is None and db is None
    torch.testing.assert_close(loss.double(), reference(h, w, b, y)["loss"], rtol=5e-3, atol=0)


@pytest.mark.parametrize("label", [-1, 1000, 5000])
def test_label_out_of_range_is_an_error(label):
    """As F.cross_entropy: a label outside [0, V) that is not ignore_index raises (never a loss
    computed from another column)."""
    h, w, b, y = make(1000, BF16)
    y[3] = label
    with pytest.raises(RuntimeError, match="outside"):
        linear_cross_entropy_fwd(h, w, b, y, block_v=512)


@pytest.mark.parametrize("softcap", [0.0, 4.0])
def test_kernel_step_matches_torch_step(softcap):
    """The Triton row step and the torch one (CPU without the interpreter) agree, in place."""
    gen = torch.Generator().manual_seed(3)
    z = (torch.randn(6, 1000, generator=gen) * 4).to(BF16)
    y = torch.randint(0, 1000, (6,), generator=gen)
    y[2] = IGNORE
    scale = torch.tensor([0.25])
    outs = []
    for step in (ce_chunk, _reference_step):
        zz, losses, capped = z.clone(), torch.empty(6), torch.empty_like(z)
        step(zz, y, losses, scale, grad_out=zz, capped_out=capped, label_smoothing=0.05,
             softcap=softcap, block_v=256)
        outs.append((losses, zz, capped))
    for a, e in zip(*outs):
        assert_close(a, e.float(), BF16, "step")
    assert torch.equal(outs[0][1][2], torch.zeros(1000, dtype=BF16))


def test_chunk_rows_default():
    # 256 MiB of bf16 logits at V=128256 is 1046 rows: 1024, a power of two
    assert chunk_rows_for(8192, 128256, BF16, 256 << 20) == 1024
    assert chunk_rows_for(10, 128256, BF16, 256 << 20) == 10
    assert chunk_rows_for(8192, 10**9, F32, 1) == 1
    assert CPU_TILING.block_v & (CPU_TILING.block_v - 1) == 0


# ---------------------------------------------------------------------------------------------
# the op: autograd, shapes, dtypes, the torch path


def _op(h, w, b, y, *, upcast=True, return_logits=True, needs=(True, True, True), softcap=0.0,
        reduction="mean"):
    return torch.ops.fusionpass.linear_cross_entropy(
        h, w, b, y, IGNORE, 0.0, softcap, True, reduction, upcast, return_logits, *needs
    )


def test_op_autograd_scales_by_grad_output():
    h, w, b, y = make(257, F32, bias=True)
    h3 = h.view(3, 4, D).clone().requires_grad_()
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    loss, logits, *_ = _op(h3, w, b, y.view(3, 4))
    assert logits.shape == (3, 4, 257) and not logits.requires_grad
    (loss * 2.5).backward()
    ref = reference(h, w.detach(), b.detach(), y)
    torch.testing.assert_close(loss.double(), ref["loss"], rtol=1e-6, atol=1e-6)
    assert_close(h3.grad.view(N, D), 2.5 * ref["dh"], F32, "dh")
    assert_close(w.grad, 2.5 * ref["dw"], F32, "dw")
    assert_close(b.grad, 2.5 * ref["db"], F32, "db")


def test_op_model_dtype_loss_and_missing_gradient():
    h, w, _, y = make(257, BF16)
    w = w.clone().requires_grad_()
    loss, logits, dh, _, db = _op(h, w, None, y, upcast=False, return_logits=False,
                                   needs=(False, True, False))
    assert loss.dtype == BF16 and logits.numel() == 0 and dh.numel() == 0 and db.numel() == 0
    loss.backward()
    assert w.grad is not None
    h = h.clone().requires_grad_()
    loss = _op(h, w, None, y, needs=(False, True, False))[0]
    with pytest.raises(RuntimeError, match="need_dh=False"):
        loss.backward()


def test_op_torch_path_without_interpreter(monkeypatch):
    """Without TRITON_INTERPRET (CPU, no GPU: `fusionpass explain`) the op runs the torch step."""
    h, w, b, y = make(1000, BF16, bias=True)
    want = _op(h, w, b, y, softcap=7.0, reduction="sum")
    monkeypatch.delenv("TRITON_INTERPRET")
    got = _op(h, w, b, y, softcap=7.0, reduction="sum")
    for a, e in zip(got, want):
        if e.numel():
            assert_close(a, e.float() if e.dim() == 0 else e, BF16, "torch path")


def test_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        h = torch.empty(2, 7, D, dtype=BF16)
        w = torch.empty(300, D, dtype=BF16)
        b = torch.empty(300, dtype=BF16)
        y = torch.empty(2, 7, dtype=torch.int64)
        loss, logits, dh, dw, db = _op(h, w, b, y)
        assert loss.shape == () and loss.dtype == F32
        assert logits.shape == (2, 7, 300) and logits.dtype == BF16
        assert dh.shape == h.shape and dw.shape == w.shape and db.shape == b.shape
