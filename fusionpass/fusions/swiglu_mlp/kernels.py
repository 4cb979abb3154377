"""Gated-MLP kernels (swiglu_mlp): h = act(x @ Wg^T + bg) * (x @ Wu^T + bu), act SiLU or GELU-tanh.

- `swiglu_decode_fwd`: the decode regime (M <= DECODE_MAX_M rows). Each program owns BLOCK_N output
  columns, loops over K and holds all M rows of x at once, so W_gate and W_up are read exactly once;
  two fp32 accumulators (gate, up), act*mul in registers. Writes h and, for the backward, the
  pre-activations g and u (M*N each: negligible next to the 2*N*K weights at decode sizes).
- `act_mul_fwd`: h = act(g) * u for g, u from library GEMMs (the prefill/training regime).
- `act_mul_bwd`: dg = dh * u * act'(g), du = dh * act(g), one elementwise pass.

g and u are rounded to the model dtype before the activation, as the model computes them (its
linears return the model dtype), so h and the backward see the same g and u.

Block sizes are not tuned yet (no GPU measurement): the defaults live in DEFAULTS and every launcher
takes them as keywords.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusionpass.kernels.common import (
    _as_2d,
    _device_guard,
    _for_store,
    _round,
)
from fusionpass.kernels.launch import absent, launcher

__all__ = ["ACTIVATIONS", "DECODE_MAX_M", "DEFAULTS", "act_mul_bwd", "act_mul_fwd", "swiglu_decode_fwd"]

# activation name (as the op and the pattern spell it) -> the kernels' ACT flag
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# rows up to which the op uses the decode kernel (the decode regime)
DECODE_MAX_M = 64
# Launch parameters, in one place (to be tuned on the H200).
DEFAULTS = {
    "decode_block_n": 64,
    "decode_block_k": 64,
    "decode_num_warps": 4,
    "elementwise_block": 1024,
    "elementwise_num_warps": 4,
}

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_C = tl.constexpr(0.044715)


@triton.jit
def _sigmoid(z):
    return 1.0 / (1.0 + tl.exp(-z))


@triton.jit
def _tanh(z):
    # tanh(z) = 2 sigmoid(2z) - 1 (tl has no tanh that also runs under the interpreter)
    return 2.0 * _sigmoid(2.0 * z) - 1.0


@triton.jit
def _act(g, ACT: tl.constexpr):
    if ACT == 0:
        out = g * _sigmoid(g)
    else:
        inner = _SQRT_2_OVER_PI * (g + _GELU_C * g * g * g)
        out = 0.5 * g * (1.0 + _tanh(inner))
    return out


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32."""
    if ACT == 0:
        s = _sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    else:
        inner = _SQRT_2_OVER_PI * (g + _GELU_C * g * g * g)
        t = _tanh(inner)
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_C * g * g)
    return a, da


@triton.jit
def _decode_kernel(
    X, WG, BG, WU, BU, H, G, U,
    M, N, K,
    stride_xm, stride_wg, stride_wu, stride_h,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, STORE_GU: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, ROUND_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    DT: tl.constexpr = H.dtype.element_ty
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk0 = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wn = rn.to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        k_mask = rk < K
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        # [BLOCK_N, BLOCK_K] tiles, contiguous along K (coalesced), used transposed
        wg = tl.load(WG + wn[:, None] * stride_wg + rk[None, :], mask=w_mask, other=0.0,
                     eviction_policy="evict_first")
        wu = tl.load(WU + wn[:, None] * stride_wu + rk[None, :], mask=w_mask, other=0.0,
                     eviction_policy="evict_first")
        if UPCAST:
            # the interpreter stores bf16 as uint16: compute in fp32 there
            x = x.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=PRECISION)
    if HAS_BIAS:
        acc_g += tl.load(BG + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(BU + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    g = _round(acc_g, DT, ROUND_BITS)
    u = _round(acc_u, DT, ROUND_BITS)
    h = _act(g, ACT) * u
    out_mask = m_mask[:, None] & n_mask[None, :]
    offs = rm[:, None] * stride_h + rn[None, :]
    tl.store(H + offs, _for_store(h, DT, ROUND_BITS), mask=out_mask)
    if STORE_GU:
        tl.store(G + offs, g, mask=out_mask)
        tl.store(U + offs, u, mask=out_mask)


@triton.jit
def _act_mul_fwd_kernel(G, U, H, rows, cols, ACT: tl.constexpr, ROUND_BITS: tl.constexpr,
                        BLOCK: tl.constexpr):
    DT: tl.constexpr = H.dtype.element_ty
    # the element count as rows x cols, multiplied here in int64: torch 2.11's Inductor cannot
    # pass a static integer of 2^31 or more to a user-defined kernel (fusions/swiglu_mlp/pattern.py). tl.cast,
    # not .to: Triton specializes an argument equal to 1 into a plain int.
    numel = tl.cast(rows, tl.int64) * cols
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(H + offs, _for_store(_act(g, ACT) * u, DT, ROUND_BITS), mask=mask)


@triton.jit
def _act_mul_bwd_kernel(DH, G, U, DG, DU, rows, cols, ACT: tl.constexpr, ROUND_BITS: tl.constexpr,
                        BLOCK: tl.constexpr):
    DT: tl.constexpr = DG.dtype.element_ty
    numel = tl.cast(rows, tl.int64) * cols  # as in the forward
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    dh = tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_and_grad(g, ACT)
    tl.store(DG + offs, _for_store(dh * u * da, DT, ROUND_BITS), mask=mask)
    tl.store(DU + offs, _for_store(dh * a, DT, ROUND_BITS), mask=mask)


def _act_flag(activation: str) -> int:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[activation]


def _check_linear(w: torch.Tensor, b: torch.Tensor | None, k: int, what: str) -> None:
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"{what} weight of shape {tuple(w.shape)} does not take {k} inputs")
    if b is not None and (b.dim() != 1 or b.shape[0] != w.shape[0]):
        raise ValueError(f"{what} bias of shape {tuple(b.shape)} does not match {w.shape[0]} outputs")


def _k_contiguous(w: torch.Tensor) -> torch.Tensor:
    return w if w.stride(-1) == 1 else w.contiguous()


def swiglu_decode_fwd(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor | None,
    w_up: torch.Tensor,
    b_up: torch.Tensor | None,
    activation: str,
    *,
    store_gu: bool = True,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
):
    """(h, g, u) for x [..., K] with at most DECODE_MAX_M rows; g and u are None without store_gu."""
    act = _act_flag(activation)
    k = x.shape[-1]
    _check_linear(w_gate, b_gate, k, "gate")
    _check_linear(w_up, b_up, k, "up")
    if w_gate.shape != w_up.shape or (b_gate is None) != (b_up is None):
        raise ValueError("gate and up projections differ in shape or in having a bias")
    n = w_gate.shape[0]
    x2 = _as_2d(x, k)
    m = x2.shape[0]
    if m > DECODE_MAX_M:
        raise ValueError(f"{m} rows > {DECODE_MAX_M}: the decode kernel holds all rows at once")
    wg, wu = _k_contiguous(w_gate), _k_contiguous(w_up)
    shape = (*x.shape[:-1], n)
    h = x.new_empty(shape)
    g = x.new_empty(shape) if store_gu else None
    u = x.new_empty(shape) if store_gu else None
    if m == 0 or n == 0:
        return h, g, u
    h2 = h.view(-1, n)
    block_n = block_n or DEFAULTS["decode_block_n"]
    block_k = block_k or DEFAULTS["decode_block_k"]
    block_m = max(16, triton.next_power_of_2(m))  # tl.dot needs 16 rows at least
    on_gpu = x.device.type == "cuda"
    # placeholders for the pointers the flags leave unused (fusionpass.kernels.launch says why)
    bias = (b_gate, b_up) if b_gate is not None else (absent(wg), absent(wu))
    with _device_guard(x.device):
        launcher(_decode_kernel, x2)[(triton.cdiv(n, block_n),)](
            x2, wg, bias[0], wu, bias[1], h2,
            g.view(-1, n) if store_gu else absent(h2), u.view(-1, n) if store_gu else absent(h2),
            m, n, k, x2.stride(0), wg.stride(0), wu.stride(0), h2.stride(0),
            HAS_BIAS=b_gate is not None, ACT=act, STORE_GU=store_gu, UPCAST=not on_gpu,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", ROUND_BITS=not on_gpu,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps or DEFAULTS["decode_num_warps"],
        )
    return h, g, u


def _elementwise_launch(kernel, tensors, act, device, block, num_warps):
    block = block or DEFAULTS["elementwise_block"]
    cols = tensors[0].shape[-1] if tensors[0].dim() else 1
    rows = tensors[0].numel() // cols
    with _device_guard(device):
        launcher(kernel, tensors[0])[(triton.cdiv(rows * cols, block),)](
            *tensors, rows, cols, ACT=act, ROUND_BITS=device.type != "cuda", BLOCK=block,
            num_warps=num_warps or DEFAULTS["elementwise_num_warps"],
        )


def _same_shape(*ts: torch.Tensor) -> None:
    if any(t.shape != ts[0].shape for t in ts):
        raise ValueError(f"shapes differ: {[tuple(t.shape) for t in ts]}")


def act_mul_fwd(g: torch.Tensor, u: torch.Tensor, activation: str, *, block: int | None = None,
                num_warps: int | None = None) -> torch.Tensor:
    """h = act(g) * u, elementwise, in g's dtype."""
    act = _act_flag(activation)
    _same_shape(g, u)
    g, u = g.contiguous(), u.contiguous()
    h = torch.empty_like(g)
    if g.numel():
        _elementwise_launch(_act_mul_fwd_kernel, (g, u, h), act, g.device, block, num_warps)
    return h


def act_mul_bwd(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str, *,
                block: int | None = None, num_warps: int | None = None):
    """(dg, du) = (dh * u * act'(g), dh * act(g)), one pass, in g's dtype."""
    act = _act_flag(activation)
    _same_shape(dh, g, u)
    dh, g, u = dh.contiguous(), g.contiguous(), u.contiguous()
    dg = torch.empty_like(g)
    du = torch.empty_like(u)
    if g.numel():
        _elementwise_launch(_act_mul_bwd_kernel, (dh, g, u, dg, du), act, g.device, block,
                            num_warps)
    return dg, du
