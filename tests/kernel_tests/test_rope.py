"""fusionpass.kernels.rope and fusionpass::rope: every RoPE form, forward and backward, against a
float64 torch reference (CPU, Triton interpreter): rotate_half and interleaved, full and partial
rotary, GQA head counts, odd sequence lengths, q/k as transposes of [B, S, H, D], cos/sin per batch
or shared, bf16 and fp32."""
from __future__ import annotations

import pytest
import torch

import fusionpass.ops  # noqa: F401  (registers fusionpass::rope)
from fusionpass.kernels.rope import rope
from fusionpass.fusions.rope.op import reference

FP32, BF16 = torch.float32, torch.bfloat16
FORMS = ("rotate_half", "interleaved")


def _rot(t, form):
    if form == "interleaved":
        return torch.stack((-t[..., 1::2], t[..., ::2]), -1).flatten(-2)
    h = t.shape[-1] // 2
    return torch.cat((-t[..., h:], t[..., :h]), -1)


def _ref(x, cos, sin, form, rotary_dim, backward=False):
    """float64 rotation of the first rotary_dim channels (the transposed map for backward)."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    xr, xp = x[..., :rotary_dim], x[..., rotary_dim:]
    y = xr * cos - _rot(xr * sin, form) if backward else xr * cos + _rot(xr, form) * sin
    return torch.cat((y, xp), -1)


def _close(actual, expected, dtype, what):
    assert actual.dtype == dtype and actual.shape == expected.shape, what
    tol = 1e-5 if dtype == FP32 else 1.6e-2
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=tol, atol=tol * scale, msg=what)


def _inputs(dtype, rotary_dim, B=2, S=7, Hq=4, Hkv=2, D=16, per_batch=False):
    # q/k as the models have them: [B, S, H, D] projections, transposed to [B, H, S, D]
    q = torch.randn(B, S, Hq, D).to(dtype).transpose(1, 2)
    k = torch.randn(B, S, Hkv, D).to(dtype).transpose(1, 2)
    freqs = torch.randn(B if per_batch else 1, S, rotary_dim // 2) * 3
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
    return q, k, cos, sin


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_forward_and_backward(form, partial, dtype):
    rotary_dim = 8 if partial else 16
    q, k, cos, sin = _inputs(dtype, rotary_dim, per_batch=partial)
    assert not q.is_contiguous() and not k.is_contiguous()
    for backward in (False, True):
        q_out, k_out = rope(q, k, cos, sin, form, rotary_dim, backward=backward)
        _close(q_out, _ref(q, cos, sin, form, rotary_dim, backward), dtype, f"q bwd={backward}")
        _close(k_out, _ref(k, cos, sin, form, rotary_dim, backward), dtype, f"k bwd={backward}")
        # the output keeps the input's (dense) layout, as eager `q * cos + ...` does
        assert q_out.stride() == q.stride()


@pytest.mark.parametrize("form", FORMS)
def test_general_cos_sin_backward_is_the_transpose(form):
    """cos/sin that differ on the two channels of a pair (not what models write, but inputs):
    the backward is still the exact transpose of the forward map."""
    q = torch.randn(1, 3, 5, 8, dtype=torch.float64).float()
    cos, sin = torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    x = q.double().requires_grad_()
    y = _ref(x, cos, sin, form, 8)
    dy = torch.randn_like(y)
    y.backward(dy)
    dq, _ = rope(dy.float(), None, cos, sin, form, 8, backward=True)
    _close(dq, x.grad, FP32, "dq")


def test_gptj_layout_and_block_override():
    """q/k in [B, S, H, D] (GPT-J), cos/sin [1, S, 1, R], odd S, small blocks (many programs)."""
    B, S, D, R = 2, 5, 16, 8
    q, k = torch.randn(B, S, 4, D), torch.randn(B, S, 4, D)
    cos = torch.randn(1, S, R // 2).repeat_interleave(2, -1)[:, :, None]
    sin = torch.randn(1, S, R // 2).repeat_interleave(2, -1)[:, :, None]
    q_out, k_out = rope(q, k, cos, sin, "interleaved", R, block_rows=2, num_warps=1)
    _close(q_out, _ref(q, cos, sin, "interleaved", R), FP32, "q")
    _close(k_out, _ref(k, cos, sin, "interleaved", R), FP32, "k")


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_index_width_and_cache_hints(monkeypatch, wide, stream):
    """32-bit index math (offsets below 2**31) and 64-bit (forced here by lowering the threshold),
    with and without the cache hints: the same rotation."""
    from fusionpass.kernels import rope as rope_kernels

    monkeypatch.setattr(rope_kernels, "_WIDE_AT", 0 if wide else 2**31)
    q, k, cos, sin = _inputs(FP32, 16, S=9)
    q_out, k_out = rope(q, k, cos, sin, "rotate_half", 16, stream=stream, block_rows=4)
    _close(q_out, _ref(q, cos, sin, "rotate_half", 16), FP32, "q")
    _close(k_out, _ref(k, cos, sin, "rotate_half", 16), FP32, "k")


def test_rejects_bad_arguments():
    q = torch.randn(1, 2, 3, 8)
    cos = torch.randn(1, 1, 3, 8)
    with pytest.raises(ValueError, match="form"):
        rope(q, None, cos, cos, "spiral", 8)
    with pytest.raises(ValueError, match="even"):
        rope(q, None, cos[..., :7], cos[..., :7], "rotate_half", 7)
    # cos/sin that do not broadcast over q or k would be read past their end
    with pytest.raises(ValueError, match="rope cos"):
        rope(q, None, cos.expand(1, 3, 3, 8), cos, "rotate_half", 8)
    with pytest.raises(ValueError, match="rope sin"):
        rope(q, None, cos, cos.expand(1, 3, 3, 8), "rotate_half", 8)
    with pytest.raises(ValueError, match=r"rope cos .*\(1, 1, 2, 8\)"):  # k's positions
        rope(q, torch.randn(1, 1, 2, 8), cos, cos, "rotate_half", 8)


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("form", FORMS)
def test_op_autograd(form, dtype):
    """fusionpass::rope through autograd: gradients of q and k equal the float64 reference's."""
    rotary_dim = 8
    q, k, cos, sin = _inputs(dtype, rotary_dim, S=5, Hq=6, Hkv=2)
    qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
    q_out, k_out = torch.ops.fusionpass.rope(qq, kk, cos, sin, form=form, rotary_dim=rotary_dim)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq_out, dk_out))
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    r_q, r_k = _ref(q64, cos, sin, form, rotary_dim), _ref(k64, cos, sin, form, rotary_dim)
    torch.autograd.backward((r_q, r_k), (dq_out.double(), dk_out.double()))
    _close(q_out, r_q.detach(), dtype, "q_out")
    _close(k_out, r_k.detach(), dtype, "k_out")
    _close(qq.grad, q64.grad, dtype, "dq")
    _close(kk.grad, k64.grad, dtype, "dk")


def test_op_single_tensor_and_reference():
    q, _, cos, sin = _inputs(FP32, 16)
    q_out, k_out = torch.ops.fusionpass.rope(q, None, cos, sin, form="rotate_half", rotary_dim=16)
    assert k_out.numel() == 0
    _close(q_out, _ref(q, cos, sin, "rotate_half", 16), FP32, "q")
    # the torch reference (CPU without the interpreter) computes the same
    _close(reference(q, cos, sin, "rotate_half", 16, False), _ref(q, cos, sin, "rotate_half", 16),
           FP32, "reference")


def test_op_refuses_cos_gradients():
    q, k, cos, sin = _inputs(FP32, 16)
    cos = cos.detach().requires_grad_()
    q_out, _ = torch.ops.fusionpass.rope(q.requires_grad_(), k, cos, sin, form="rotate_half", rotary_dim=16)
    with pytest.raises(RuntimeError, match="cos/sin"):
        q_out.sum().backward()
