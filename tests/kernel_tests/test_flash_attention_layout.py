"""fusionpass::flash_attention with `token_major=True` (what attention_out_proj sets): the output is
[B, Hq, Lq, D] with the strides of a [B, Lq, Hq, D] buffer, the fake impl reports the same strides
as the real op (Inductor lays out buffers from the fake), and the values and gradients are those
of the contiguous output, also when the backward gets `dout` strided as Inductor hands it (a view
of the projection's input gradient) or contiguous. Kernels under the Triton interpreter, and the
torch reference (CPU without it)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fusionpass.fusions.flash_attention import op as fa_ops
from fusionpass.ops import host

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

OP = torch.ops.fusionpass.flash_attention.default
B, H, L, D = 2, 3, 17, 64


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(fa_ops, "CPU_BLOCKS", {"block_m": 16, "block_n": 16, "dq_block_m": 16, "dq_block_n": 16})


@pytest.fixture(params=["kernel", "reference"])
def path(request, monkeypatch):
    if request.param == "reference":
        monkeypatch.setattr(host, "interpreting", lambda: False)
    return request.param


def token_major(*shape, dtype=torch.float32, grad=False):
    """[B, H, L, D] as a transpose of a [B, L, H, D] tensor (HF's q/k/v, and the dout Inductor gives)."""
    b, h, n, d = shape
    t = torch.randn(b, n, h, d).to(dtype).transpose(1, 2)
    return t.detach().requires_grad_(grad)


def call(q, k, v, token_major, bias=None, dropout_p=0.0):
    seed = torch.tensor([1234], dtype=torch.int64) if dropout_p > 0 else None
    return OP(q, k, v, key_bias=bias, seed=seed, scale=D**-0.5, causal=True, dropout_p=dropout_p,
              token_major=token_major)


TOKEN_MAJOR_STRIDES = (L * H * D, D, H * D, 1)


@pytest.mark.parametrize("tm", [False, True])
def test_real_and_fake_strides(path, tm):
    q, k, v = (token_major(B, H, L, D) for _ in range(3))
    out, lse = call(q, k, v, tm)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fout, flse = call(fq, fk, fv, tm)
    assert out.shape == fout.shape == (B, H, L, D)
    assert out.stride() == fout.stride() == (TOKEN_MAJOR_STRIDES if tm else (H * L * D, L * D, D, 1))
    assert out.transpose(1, 2).is_contiguous() == tm
    assert lse.stride() == flse.stride() == (H * L, L, 1)


@pytest.mark.parametrize("dtype, dout_layout", [(torch.float32, "token_major"), (torch.bfloat16, "token_major"),
                                                (torch.float32, "contiguous")])
def test_token_major_forward_backward(path, dtype, dout_layout):
    # ALiBi-like per-key bias and attention dropout: every input the op takes
    q, k, v = (token_major(B, H, L, D, dtype=dtype, grad=True) for _ in range(3))
    bias = torch.randn(B, H, L).to(dtype)
    dout = token_major(B, H, L, D, dtype=dtype)
    if dout_layout == "contiguous":
        dout = dout.contiguous()
    results = {}
    for tm in (False, True):
        out, lse = call(q, k, v, tm, bias, dropout_p=0.25)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        results[tm] = (out, lse, *grads)
    assert results[True][0].stride() == TOKEN_MAJOR_STRIDES
    # one computation, two layouts of its output: the same values and gradients, bit for bit
    for a, b, name in zip(results[False], results[True], ("out", "lse", "dq", "dk", "dv")):
        assert torch.equal(a, b), name
    # and they are attention: the torch reference in fp32 (same keep bits)
    ref_out, ref_lse = fa_ops._reference(*(t.detach() for t in (q, k, v)), None, bias, D**-0.5, True, 0, False,
                                         0, 0.25, torch.tensor([1234]))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(results[True][0].float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(results[True][1], ref_lse, rtol=1e-5, atol=1e-5)
    ref_grads = fa_ops._reference_backward(dout.float(), *(t.detach().float() for t in (q, k, v)), None, None,
                                           None, bias.float(), D**-0.5, True, 0, False, 0, 0.25,
                                           torch.tensor([1234]))
    for got, want, name in zip(results[True][2:], ref_grads, ("dq", "dk", "dv")):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * scale, msg=lambda m: f"{name}: {m}")
