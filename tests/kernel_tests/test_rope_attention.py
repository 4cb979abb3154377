"""fusionpass::flash_attention with RoPE on q (what rope_attention sets): the kernel rotates q as it
loads it. Forward and backward (q, k, v) against a float64 reference (rotate, then causal GQA
attention), for rotate_half and interleaved, whole-head (the two-half-tile rotation) and partial
rotary (the paired-load one), q as the transpose of a [B, S, H, D] projection, odd sequence length,
cos/sin per batch row or shared; the forward equals, bit for bit, attention on the q that
fusionpass::rope rotates (the rotation rounds once, as the rope kernel does); bad rope arguments
raise. Kernels under the Triton interpreter, and the torch reference (CPU without it)."""
import pytest
import torch

from fusionpass.kernels.attention import attention_fwd
from fusionpass.fusions.flash_attention import op as fa_ops
from fusionpass.ops import host

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

OP = torch.ops.fusionpass.flash_attention.default
ROPE = torch.ops.fusionpass.rope.default
B, HQ, HKV, L, D = 2, 4, 2, 19, 64


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(fa_ops, "CPU_BLOCKS", {"block_m": 16, "block_n": 16, "dq_block_m": 16, "dq_block_n": 16})


def _rot(t, form):
    if form == "interleaved":
        return torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), -1)


def tables(form, rotary_dim, dtype, per_batch):
    freqs = torch.randn(B if per_batch else 1, L, rotary_dim // 2) * 3
    emb = torch.cat((freqs, freqs), -1) if form == "rotate_half" else freqs.repeat_interleave(2, -1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def inputs(dtype):
    q = torch.randn(B, L, HQ, D).to(dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(B, HKV, L, D).to(dtype).requires_grad_()
    v = torch.randn(B, HKV, L, D).to(dtype).requires_grad_()
    return q, k, v


def reference(q, k, v, cos, sin, form, r):
    q, k, v, cos, sin = (t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v, cos, sin))
    qr = torch.cat((q[..., :r] * cos + _rot(q[..., :r], form) * sin, q[..., r:]), -1)
    group = HQ // HKV
    out = torch.nn.functional.scaled_dot_product_attention(
        qr, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True)
    return out, (q, k, v)


def call(q, k, v, cos, sin, form, r):
    return OP(q, k, v, rope_cos=cos, rope_sin=sin, scale=D**-0.5, causal=True, rope_form=form, rotary_dim=r)


def close(got, want, dtype, what):
    tol = {torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale, msg=what)


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr(host, "interpreting", lambda: False)
    return request.param


@pytest.mark.parametrize("form, r, dtype, per_batch", [
    ("rotate_half", D, torch.float32, False),
    ("rotate_half", D, torch.bfloat16, True),
    ("interleaved", D, torch.float32, True),
    ("rotate_half", 16, torch.float32, True),   # partial (GPT-NeoX rotary_pct)
    ("interleaved", 32, torch.bfloat16, False),  # partial (GPT-J rotary_dim)
])
def test_forward_and_backward(path, form, r, dtype, per_batch):
    q, k, v = inputs(dtype)
    cos, sin = tables(form, r, dtype, per_batch)
    out, _ = call(q, k, v, cos, sin, form, r)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want, leaves = reference(q, k, v, cos, sin, form, r)
    want_grads = torch.autograd.grad(want, leaves, dout.double())
    close(out, want, dtype, "out")
    for name, got, exp in zip("qkv", grads, want_grads):
        assert got.shape == exp.shape and got.dtype == dtype
        close(got, exp, dtype, f"d{name}")


@pytest.mark.parametrize("form, r", [("rotate_half", D), ("interleaved", D), ("rotate_half", 32)])
def test_forward_equals_rotating_first(form, r):
    # the kernel rounds the rotated q once, as fusionpass::rope stores it: the same scores, bit for bit
    q, k, v = (t.detach() for t in inputs(torch.bfloat16))
    cos, sin = tables(form, r, torch.float32, True)
    fused, lse = call(q, k, v, cos, sin, form, r)
    q_rot = ROPE(q, None, cos, sin, form=form, rotary_dim=r)[0]
    unfused, lse_unfused = OP(q_rot, k, v, scale=D**-0.5, causal=True)
    assert torch.equal(fused, unfused) and torch.equal(lse, lse_unfused)


def test_bad_rope_arguments_raise():
    q, k, v = (t.detach() for t in inputs(torch.float32))
    cos, sin = tables("rotate_half", D, torch.float32, False)
    with pytest.raises(ValueError, match="rotary_dim"):
        attention_fwd(q, k, v, causal=True, rope=(cos, sin, "rotate_half", D - 1))
    with pytest.raises(ValueError, match="rope cos"):
        attention_fwd(q, k, v, causal=True, rope=(cos[..., :32], sin, "rotate_half", D))
    with pytest.raises(ValueError, match="rope sin"):
        attention_fwd(q, k, v, causal=True, rope=(cos, sin.expand(B, 3, L, D), "rotate_half", D))
    with pytest.raises(ValueError, match="RoPE form"):
        attention_fwd(q, k, v, causal=True, rope=(cos, sin, "neox", D))


def test_cos_sin_gradient_refused():
    q, k, v = inputs(torch.float32)
    cos, sin = tables("rotate_half", D, torch.float32, False)
    cos.requires_grad_()
    with pytest.raises(RuntimeError, match="cos/sin"):
        call(q, k, v, cos, sin, "rotate_half", D)
