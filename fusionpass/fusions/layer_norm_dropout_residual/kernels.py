"""Triton kernels for LayerNorm with a fused dropout and residual add (`layer_norm_dropout_residual`).

Forward:   d = dropout(x, p)               keep ? round(x * s) : 0,  s = fp32(1 / fp32(1 - p))
           h = round(d + residual)         (or h = d; h = x itself when p == 0 and no residual)
           mean, var = row mean and biased variance of h in fp32;  rstd = 1 / sqrt(var + eps)
           y = round((h - mean) * rstd * w + b)
Backward:  xhat = (h - mean) * rstd,  g = dy * w
           dh_total = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dh
           dresidual = round(dh_total);  dx = keep ? round(dresidual * s) : 0
           dweight = sum_rows dy * xhat,  dbias = sum_rows dy   (fp32 partials, no atomics)
`round` is to the input dtype, as the model does (BERT/RoBERTa/GPT-2/... compute
`LayerNorm(dropout(x) + residual)` with bf16 tensors in between; F.layer_norm and F.dropout compute
in fp32 and round once). The scale and the keep test follow ATen's CUDA dropout.

Dropout draws from fusionpass.kernels.rng (Philox; no mask tensor is ever stored).

Every kernel runs compiled on CUDA and unchanged under TRITON_INTERPRET=1 on CPU tensors; the only
difference is ROUND_BITS (see `_round`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusionpass.kernels import common
# the jit helpers by name: a kernel calls what its module's globals hold
from fusionpass.kernels.common import (_col_sum, _for_store, _load_dy_h, _persistent_tiles, _plus_residual,
                                         _round, _row_block, _tile_rows)
from fusionpass.kernels.launch import absent, launcher
from fusionpass.kernels.rng import RNG_ARGS as _RNG_ARGS
from fusionpass.kernels.rng import RNG_GROUP as _RNG_GROUP
from fusionpass.kernels.rng import dropout_mask  # noqa: F401  (the keep mask of these kernels, for tests)
from fusionpass.kernels.rng import keep_mask
from fusionpass.kernels.rng import rng_args as _rng_args
from fusionpass.kernels.rng import rng_key

__all__ = ["dropout_mask", "layer_norm_bwd", "layer_norm_fwd"]

# Registers per thread of the backward kernels for sm_90 (ptxas, every flag combination and dtype:
# 59..116, the most with dropout, dh, dweight, dbias and dresidual): residency of a persistent
# program on launches the measured tables below do not cover.
_BWD_REGS = 116



@triton.jit(do_not_specialize=_RNG_ARGS)
def _fwd_kernel(
    X, R, W, B, Y, H, MEAN, RSTD, SEED,
    M, N, stride_x, stride_r, stride_y, stride_h,
    eps, scale, seed_lo, seed_hi, off_lo, off_hi, thr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    DROPOUT: tl.constexpr, SEED_PTR: tl.constexpr, STORE_H: tl.constexpr, REREAD_H: tl.constexpr,
    H_FP32: tl.constexpr, ROUND_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    # torch.compile passes Python floats as fp64 scalars; the math is fp32.
    eps = tl.cast(eps, tl.float32)
    scale = tl.cast(scale, tl.float32)
    # [BLOCK_M, BLOCK_N] tiles. A row that fits one chunk (ONE_PASS) stays in registers: one read,
    # one write. Longer rows take two passes: pass 1 builds h, writes it (when h is an output) and
    # folds each chunk's mean and M2 into the row's (Chan et al.; stable where sum/sum-of-squares is
    # not), pass 2 re-reads h (REREAD_H: from L2, h being just written or x itself) or rebuilds it
    # from x and residual (when h is not stored), and writes y.
    IN_DT: tl.constexpr = X.dtype.element_ty
    OUT_DT: tl.constexpr = Y.dtype.element_ty
    # h's dtype: x's, or fp32 where a 16-bit x meets an fp32 residual (autocast's promotion: the
    # residual stream stays fp32 while the block's output is bf16), or the other way round
    H_DT: tl.constexpr = tl.float32 if H_FP32 else IN_DT
    k0, k1, o0, o1, t = rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR, DROPOUT)
    rows, cols, row_ok, roff = _row_block(M, BLOCK_M, BLOCK_N)

    if ONE_PASS:
        c = cols[None, :]
        mask = row_ok[:, None] & (c < N)
        h = _load_h(X, R, roff, rows, 0, c, mask, stride_x, stride_r, scale, k0, k1, o0, o1, t,
                    HAS_RESIDUAL, DROPOUT, IN_DT, H_DT, ROUND_BITS, BLOCK_M, BLOCK_N, "evict_first")
        if STORE_H:
            tl.store(H + roff * stride_h + c, h, mask=mask)
        mean = tl.sum(h, axis=1) / N
        xc = tl.where(mask, h - mean[:, None], 0.0)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xc * xc, axis=1) / N + eps))
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        y = xc * rstd[:, None]
        # weight and bias as [BLOCK_N] vectors: loaded as [1, BLOCK_N] tiles they get a layout of
        # their own when BLOCK_M > 1, and y would round-trip through shared memory to meet it.
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
        tl.store(Y + roff * stride_y + c, _for_store(y, OUT_DT, ROUND_BITS), mask=mask)
    else:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols[None, :]
            mask = row_ok[:, None] & (c < N)
            if STORE_H:
                # pass 2 reads h back: x and residual are done with
                h = _load_h(X, R, roff, rows, c0, c, mask, stride_x, stride_r, scale, k0, k1, o0, o1, t,
                            HAS_RESIDUAL, DROPOUT, IN_DT, H_DT, ROUND_BITS, BLOCK_M, BLOCK_N, "evict_first")
                tl.store(H + roff * stride_h + c, h, mask=mask, eviction_policy="evict_last")
            else:
                h = _load_h(X, R, roff, rows, c0, c, mask, stride_x, stride_r, scale, k0, k1, o0, o1, t,
                            HAS_RESIDUAL, DROPOUT, IN_DT, H_DT, ROUND_BITS, BLOCK_M, BLOCK_N, "evict_last")
            n_old = tl.cast(c0, tl.float32)
            cnt = tl.cast(tl.minimum(N - c0, BLOCK_N), tl.float32)
            n_new = n_old + cnt
            cmean = tl.sum(h, axis=1) / cnt
            d = tl.where(mask, h - cmean[:, None], 0.0)
            delta = cmean - mean
            mean += delta * (cnt / n_new)
            m2 += tl.sum(d * d, axis=1) + delta * delta * (n_old * cnt / n_new)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(m2 / N + eps))
        tl.store(MEAN + rows, mean, mask=row_ok)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols[None, :]
            mask = row_ok[:, None] & (c < N)
            if REREAD_H:
                h = tl.load(H + roff * stride_h + c, mask=mask, other=0.0, eviction_policy="evict_first")
                h = h.to(tl.float32)
            else:
                h = _load_h(X, R, roff, rows, c0, c, mask, stride_x, stride_r, scale, k0, k1, o0, o1, t,
                            HAS_RESIDUAL, DROPOUT, IN_DT, H_DT, ROUND_BITS, BLOCK_M, BLOCK_N, "evict_first")
            _fwd_store_y(h - mean[:, None], rstd, W, B, Y, roff, c, mask, N, stride_y,
                         HAS_WEIGHT, HAS_BIAS, OUT_DT, ROUND_BITS)


@triton.jit
def _load_h(X, R, roff, rows, c0, c, mask, stride_x, stride_r, scale, k0, k1, o0, o1, t,
            HAS_RESIDUAL: tl.constexpr, DROPOUT: tl.constexpr, IN_DT: tl.constexpr, H_DT: tl.constexpr,
            ROUND_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVICT: tl.constexpr):
    """h = round(dropout(x)) (+ r, rounded to h's dtype) in fp32, as the model computes it: the
    dropout in x's dtype, the add in the promoted one."""
    h = tl.load(X + roff * stride_x + c, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if DROPOUT:
        keep = keep_mask(k0, k1, o0, o1, t, rows, c0, BLOCK_M, BLOCK_N)
        h = tl.where(keep, _round(h * scale, IN_DT, ROUND_BITS), 0.0)
    return _plus_residual(h, R, roff, stride_r, c, mask, HAS_RESIDUAL, H_DT, ROUND_BITS, EVICT)


@triton.jit
def _fwd_store_y(xc, rstd, W, B, Y, roff, c, mask, N, stride_y,
                 HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_DT: tl.constexpr,
                 ROUND_BITS: tl.constexpr):
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(Y + roff * stride_y + c, _for_store(y, OUT_DT, ROUND_BITS), mask=mask)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_grads(dt, rows, c0, DX, DR, roff, c, mask, stride_dx, stride_dr, scale, k0, k1, o0, o1, t,
               DROPOUT: tl.constexpr, STORE_DR: tl.constexpr, DX_DT: tl.constexpr, DR_DT: tl.constexpr,
               ROUND_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store dx (and dresidual) from dh_total (fp32). The add's backward hands each operand the
    gradient in its own dtype: dresidual in the residual's, and the dropped x's in x's, rounded
    before dropout's backward scales it."""
    if STORE_DR:
        tl.store(DR + roff * stride_dr + c, _for_store(dt, DR_DT, ROUND_BITS), mask=mask)
    if DROPOUT:
        keep = keep_mask(k0, k1, o0, o1, t, rows, c0, BLOCK_M, BLOCK_N)
        dx = tl.where(keep, _round(dt, DX_DT, ROUND_BITS) * scale, 0.0)
    else:
        dx = dt
    tl.store(DX + roff * stride_dx + c, _for_store(dx, DX_DT, ROUND_BITS), mask=mask)


@triton.jit(do_not_specialize=_RNG_ARGS)
def _bwd_kernel(
    DY, DH, H, MEAN, RSTD, W, DX, DR, DWP, DBP, SEED,
    M, N, stride_dy, stride_dh, stride_h, stride_dx, stride_dr,
    scale, seed_lo, seed_hi, off_lo, off_hi, thr,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    DROPOUT: tl.constexpr, SEED_PTR: tl.constexpr, STORE_DR: tl.constexpr, ROUND_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Persistent: each program walks row tiles pid, pid + G, ... and keeps its dweight and dbias
    # partials in registers across them, writing them once to DWP[pid, :] / DBP[pid, :] (no atomics).
    scale = tl.cast(scale, tl.float32)
    DX_DT: tl.constexpr = DX.dtype.element_ty
    DR_DT: tl.constexpr = DR.dtype.element_ty
    k0, k1, o0, o1, t = rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR, DROPOUT)
    pid, num_progs, num_tiles, cols, col_ok, c = _persistent_tiles(M, N, BLOCK_M, BLOCK_N)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(pid, num_tiles, num_progs):
        rows, row_ok, mask, roff = _tile_rows(tile, M, col_ok, BLOCK_M)
        dy, h = _load_dy_h(DY, H, roff, stride_dy, stride_h, c, mask)
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        xhat = tl.where(mask, (h - mean) * rstd, 0.0)
        if HAS_WEIGHT:
            g = dy * w
        else:
            g = dy
        mean_gx = (tl.sum(g * xhat, axis=1) / N)[:, None]
        mean_g = (tl.sum(g, axis=1) / N)[:, None]
        dt = rstd * (g - mean_g - xhat * mean_gx)
        if HAS_DH:
            dt += tl.load(DH + roff * stride_dh + c, mask=mask, other=0.0,
                          eviction_policy="evict_first").to(tl.float32)
        _bwd_grads(dt, rows, 0, DX, DR, roff, c, mask, stride_dx, stride_dr, scale, k0, k1, o0, o1, t,
                   DROPOUT, STORE_DR, DX_DT, DR_DT, ROUND_BITS, BLOCK_M, BLOCK_N)
        if NEED_DW:
            dw_acc += dy * xhat
        if NEED_DB:
            db_acc += dy
    if NEED_DW:
        tl.store(DWP + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    if NEED_DB:
        tl.store(DBP + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_ok)


@triton.jit(do_not_specialize=_RNG_ARGS)
def _bwd_chunked_kernel(
    DY, DH, H, MEAN, RSTD, W, DX, DR, DWP, DBP, SEED,
    M, N, stride_dy, stride_dh, stride_h, stride_dx, stride_dr,
    scale, seed_lo, seed_hi, off_lo, off_hi, thr,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
    DROPOUT: tl.constexpr, SEED_PTR: tl.constexpr, STORE_DR: tl.constexpr, ROUND_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Long rows: pass 1 sums g and g*xhat over the row, pass 2 (backwards, L2-hot) writes dx (and
    # dresidual) and adds into this program's own partial rows DWP[pid, :], DBP[pid, :], which no
    # other program touches.
    scale = tl.cast(scale, tl.float32)
    DX_DT: tl.constexpr = DX.dtype.element_ty
    DR_DT: tl.constexpr = DR.dtype.element_ty
    k0, k1, o0, o1, t = rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR, DROPOUT)
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    num_chunks = tl.cdiv(N, BLOCK_N)
    dwp_row = DWP + pid.to(tl.int64) * N
    dbp_row = DBP + pid.to(tl.int64) * N
    for k in range(num_chunks):
        c = k * BLOCK_N + cols
        if NEED_DW:
            tl.store(dwp_row + c, tl.zeros([BLOCK_N], dtype=tl.float32), mask=c < N)
        if NEED_DB:
            tl.store(dbp_row + c, tl.zeros([BLOCK_N], dtype=tl.float32), mask=c < N)
    for row in range(pid, M, num_progs):
        roff = tl.cast(row, tl.int64)  # (the interpreter hands loop variables over as Python ints)
        rows = tl.zeros([1], dtype=tl.int32) + row
        dy_row = DY + roff * stride_dy
        h_row = H + roff * stride_h
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)

        acc_gx = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(num_chunks):
            c = k * BLOCK_N + cols
            m = c < N
            dy = tl.load(dy_row + c, mask=m, other=0.0).to(tl.float32)
            h = tl.load(h_row + c, mask=m, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                g = dy * tl.load(W + c, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
            else:
                g = dy
            acc_gx += g * (h - mean)
            acc_g += g
        mean_gx = tl.sum(acc_gx, axis=0) * rstd / N
        mean_g = tl.sum(acc_g, axis=0) / N

        for k in range(num_chunks):
            c0 = (num_chunks - 1 - k) * BLOCK_N
            c = c0 + cols
            m = c < N
            dy = tl.load(dy_row + c, mask=m, other=0.0).to(tl.float32)
            h = tl.load(h_row + c, mask=m, other=0.0).to(tl.float32)
            xhat = (h - mean) * rstd
            if HAS_WEIGHT:
                g = dy * tl.load(W + c, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
            else:
                g = dy
            dt = rstd * (g - mean_g - xhat * mean_gx)
            if HAS_DH:
                dt += tl.load(DH + roff * stride_dh + c, mask=m, other=0.0).to(tl.float32)
            _bwd_grads(dt[None, :], rows, c0, DX, DR, roff, c[None, :], m[None, :], stride_dx, stride_dr,
                       scale, k0, k1, o0, o1, t, DROPOUT, STORE_DR, DX_DT, DR_DT, ROUND_BITS, 1, BLOCK_N)
            # Same offsets and layout as the zeroing stores: each thread re-reads its own writes.
            if NEED_DW:
                p = tl.load(dwp_row + c, mask=m, other=0.0)
                tl.store(dwp_row + c, p + dy * xhat, mask=m)
            if NEED_DB:
                q = tl.load(dbp_row + c, mask=m, other=0.0)
                tl.store(dbp_row + c, q + dy, mask=m)


@triton.jit
def _reduce_kernel(P0, OUT0, P1, OUT1, G, N, ROUND_BITS: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    # Column sums of [G, N] fp32 partials, cast to the parameter's dtype in the same pass; grid axis 1
    # picks the array (dweight, dbias), so one launch serves both.
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        _col_sum(P0, OUT0, G, N, pid, ROUND_BITS, BLOCK_G, BLOCK_N)
    else:
        _col_sum(P1, OUT1, G, N, pid, ROUND_BITS, BLOCK_G, BLOCK_N)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


# Launch tables, from a sweep of warps x chunk x programs per SM (benchmarks/results/latest/layer_norm_dropout_residual.md). Rows of up to 4096
# columns: one pass in registers; 8192 with h stored (training): two passes over 2048-column
# chunks, h re-read from L2 (faster than one pass there); without h: one pass at 16 warps.


def _fwd_plan(n: int, store_h: bool) -> tuple[int, int] | None:
    """(columns per chunk, warps) for rows of n columns, or None: the shared norm defaults."""
    width = triton.next_power_of_2(n)
    if width <= 4096:
        return width, (8 if width == 4096 else 4)
    if width <= 8192:
        return (common._TILE, 4) if store_h else (width, 16)
    return None


def _bwd_plan(width: int, dropout: bool) -> tuple[int, int]:
    """(warps, programs per SM) of the in-register backward for rows of `width` (a power of two)."""
    if width <= 1024:
        return 4, 4
    if width <= 2048:
        return (8, 2) if dropout else (4, 4)
    if width <= 4096:
        return 4, 2
    return 16, 2


def _programs_per_sm(num_warps: int) -> int:
    # Resident programs per SM: 64K registers and 64 warps per SM bound them. A persistent grid
    # larger than one wave would run its last programs after the others had finished their share.
    return max(1, min(64 // num_warps, 65536 // (_BWD_REGS * 32 * num_warps)))


def _checked_params_and_rng(weight, bias, n, device, p, seed, offset):
    """(rng arguments, whether dropout is on) of a call, after checking weight and bias: the
    kernels read them at unit stride."""
    for param, what in ((weight, "weight"), (bias, "bias")):
        common._check_param(param, n, device, what)
        if param is not None and param.stride(0) != 1:
            raise ValueError(f"{what} must be contiguous")
    return _rng_args(p, seed, offset, device), float(p) > 0.0


def sum_dtype(x_dtype: torch.dtype, residual_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of dropout(x) + residual: x's, or fp32 where one is fp32 and the other 16-bit
    (the promotion autocast's fp32 residual stream meets). Two different 16-bit dtypes are refused:
    their sum is fp32 in torch but no model writes it."""
    if residual_dtype is None or residual_dtype == x_dtype:
        return x_dtype
    if torch.float32 in (x_dtype, residual_dtype) and {x_dtype, residual_dtype} <= set(common._FLOAT_DTYPES):
        return torch.float32
    raise ValueError(f"residual dtype {residual_dtype} and x dtype {x_dtype}: one must be float32 or both equal")


def layer_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    offset: int = 0,
    residual_first: bool = False,
    store_h: bool = True,
    max_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """LayerNorm of h = round(dropout(x, p)) (+ residual, rounded) over the last dim.
    Returns (y, h, mean, rstd).

    y and h have x's shape and the dtype of dropout(x) + residual: x's, or fp32 where one of x and
    residual is fp32 and the other 16-bit (the dropout rounds to x's dtype, the add to fp32). h is x
    itself when p == 0 and there is no residual, None when `store_h` is False. mean and rstd are fp32 of shape [numel // N]. weight and bias ([N], x's dtype
    or fp32) are optional. With p > 0 the mask comes from (seed, offset) (see the module docstring):
    `seed` is a Python int or a one-element int64 tensor on x's device (use the tensor in traced
    code), `offset` an int. `residual_first` (the model wrote residual + dropout(x)) does not change
    the result: one fp32 add, rounded. `max_chunk` (widest column chunk, a power of two) is a testing
    knob; results do not depend on it.
    """
    del residual_first  # addition in fp32 then one rounding is commutative
    n = common._checked_width(x)
    if residual is not None and (residual.shape != x.shape or residual.device != x.device):
        raise ValueError("residual must match x in shape and device")
    h_dtype = sum_dtype(x.dtype, None if residual is None else residual.dtype)
    rng, dropout = _checked_params_and_rng(weight, bias, n, x.device, p, seed, offset)

    x2 = common._as_2d(x, n)
    m = x2.shape[0]
    y = torch.empty(x.shape, dtype=h_dtype, device=x.device)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    h_is_x = residual is None and not dropout
    write_h = store_h and not h_is_x
    h = torch.empty(x.shape, dtype=h_dtype, device=x.device) if write_h else None
    h_out = (x if h_is_x else h) if store_h else None
    if isinstance(m, int) and m == 0:
        return y, h_out, mean, rstd

    with common._device_guard(x.device):
        _launch_fwd(x2, residual, weight, bias, eps, rng, dropout, y, h, h_is_x, mean, rstd, max_chunk)
    return y, h_out, mean, rstd


def _launch_fwd(x2, residual, weight, bias, eps, rng, dropout, y, h, h_is_x, mean, rstd, max_chunk):
    m, n = x2.shape
    has_res = residual is not None
    write_h = h is not None
    r2 = common._as_2d(residual, n) if has_res else absent(x2)
    y2 = y.view(-1, n)
    # Without a transform h is x: pass 2 of the chunked path re-reads it through H (REREAD_H), which
    # the kernel then only reads
    h2 = h.view(-1, n) if write_h else (x2 if h_is_x else absent(x2))
    seed_t, lo, hi, olo, ohi, thr, scale = rng
    # placeholders for the pointers the flags leave unused (fusionpass.kernels.launch says why)
    w = weight if weight is not None else absent(x2)
    b = bias if bias is not None else absent(x2)
    args = (x2, r2, w, b, y2, h2, mean, rstd, seed_t if seed_t is not None else absent(x2),
            m, n, x2.stride(0), r2.stride(0) if has_res else x2.stride(0), y2.stride(0),
            h2.stride(0) if write_h or h_is_x else x2.stride(0),
            float(eps), float(scale), lo, hi, olo, ohi, thr)
    flags = dict(HAS_RESIDUAL=has_res, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                 DROPOUT=dropout, SEED_PTR=seed_t is not None, STORE_H=write_h,
                 REREAD_H=write_h or h_is_x, H_FP32=y.dtype == torch.float32 != x2.dtype,
                 ROUND_BITS=x2.device.type != "cuda")
    # Tiles of _TILE elements: whole short rows packed several per program, long rows in chunks.
    plan = _fwd_plan(n, write_h) if max_chunk is None else None
    if plan is not None:
        block_n, warps = plan
    else:
        block_n = common._fwd_chunk(n) if max_chunk is None else min(triton.next_power_of_2(n), max_chunk)
        warps = None
    if dropout:
        block_n = max(block_n, _RNG_GROUP)  # one Philox call covers 4 columns
    block_m = max(1, common._TILE // block_n)
    one_pass = block_n >= n
    launcher(_fwd_kernel, x2)[(triton.cdiv(m, block_m),)](
        *args, **flags, BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=one_pass,
        num_warps=warps or common._warps_fwd(block_m * block_n, one_pass))


def layer_norm_bwd(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    offset: int = 0,
    need_dweight: bool = True,
    need_dbias: bool = True,
    need_dresidual: bool = True,
    x_dtype: torch.dtype | None = None,
    residual_dtype: torch.dtype | None = None,
    max_chunk: int | None = None,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of `layer_norm_fwd`. Returns (dx, dresidual, dweight, dbias).

    dh (optional) is the gradient reaching h from its other uses. dx and dresidual have h's shape,
    and the dtypes of x and of the residual (`x_dtype`, `residual_dtype`: h's by default; they differ
    from h's where the forward promoted the sum to fp32). With p > 0 (same p, seed and offset as the
    forward), or dtypes that differ, dresidual is a separate tensor, or None when `need_dresidual`
    is False. Otherwise the two gradients are equal and dresidual is dx itself (one write; clone it
    where outputs must not alias), or None when `need_dresidual` is False. dweight/dbias are in weight's/bias's dtype, None without the parameter or when not needed.
    `max_chunk` (rows wider than this take the chunked path, with chunks of at most this many
    columns) and `num_programs` (persistent grid size) are tuning/testing knobs.
    """
    n = common._checked_bwd_width(dy, dh, h)
    rng, dropout = _checked_params_and_rng(weight, bias, n, h.device, p, seed, offset)
    h2 = common._as_2d(h, n)
    m = h2.shape[0]
    for t, what in ((mean, "mean"), (rstd, "rstd")):
        if t.dtype != torch.float32 or t.numel() != m:
            raise ValueError(f"{what} must be fp32 with {m} elements")
    mean = mean.reshape(m).contiguous()
    rstd = rstd.reshape(m).contiguous()

    need_dw = bool(need_dweight) and weight is not None
    need_db = bool(need_dbias) and bias is not None
    x_dtype = x_dtype or h.dtype
    residual_dtype = residual_dtype or h.dtype
    if sum_dtype(x_dtype, residual_dtype) != h.dtype:
        raise ValueError(f"h dtype {h.dtype} is not the sum's of x {x_dtype} and residual {residual_dtype}")
    apart = dropout or residual_dtype != x_dtype
    store_dr = bool(need_dresidual) and apart
    dx = torch.empty(h.shape, dtype=x_dtype, device=h.device)
    dr = torch.empty(h.shape, dtype=residual_dtype, device=h.device) if store_dr else None
    if isinstance(m, int) and m == 0:
        dw = torch.zeros_like(weight) if need_dw else None
        db = torch.zeros_like(bias) if need_db else None
    else:
        with common._device_guard(h.device):
            dw, db = _launch_bwd(dy, dh, h2, mean, rstd, weight, bias, rng, dropout, need_dw, need_db,
                                 dx, dr, max_chunk, num_programs)
    if apart:
        dres = dr
    else:
        dres = dx if need_dresidual else None
    return dx, dres, dw, db


def _launch_bwd(dy, dh, h2, mean, rstd, weight, bias, rng, dropout, need_dw, need_db, dx, dr, max_chunk,
                num_programs):
    m, n = h2.shape
    dev = h2.device
    dy2 = common._as_2d(dy, n)
    dh2 = common._as_2d(dh, n) if dh is not None else absent(dy2)
    dx2 = dx.view(-1, n)
    dr2 = dr.view(-1, n) if dr is not None else absent(dx2)
    w = weight if weight is not None else absent(h2)
    seed_t, lo, hi, olo, ohi, thr, scale = rng
    flags = dict(HAS_DH=dh is not None, HAS_WEIGHT=weight is not None, NEED_DW=need_dw, NEED_DB=need_db,
                 DROPOUT=dropout, SEED_PTR=seed_t is not None, STORE_DR=dr is not None,
                 ROUND_BITS=dev.type != "cuda")

    def args(dwp, dbp):
        return (dy2, dh2, h2, mean, rstd, w, dx2, dr2, dwp, dbp, seed_t if seed_t is not None else absent(mean),
                m, n, dy2.stride(0), (dh2 if dh is not None else dy2).stride(0), h2.stride(0), dx2.stride(0),
                (dr2 if dr is not None else dx2).stride(0),
                float(scale), lo, hi, olo, ohi, thr)

    def partials(grid):
        dwp = torch.empty((grid, n), dtype=torch.float32, device=dev) if need_dw else absent(mean)
        dbp = torch.empty((grid, n), dtype=torch.float32, device=dev) if need_db else absent(mean)
        return dwp, dbp

    limit = common.MAX_FUSED_BWD if max_chunk is None else max_chunk
    width = triton.next_power_of_2(n)
    if width <= limit:
        block_n = max(width, _RNG_GROUP) if dropout else width
        block_m = max(1, common._TILE // block_n)
        warps, per_sm = _bwd_plan(block_n, dropout)
        grid = common._persistent_grid(per_sm, dev, triton.cdiv(m, block_m), num_programs)
        dwp, dbp = partials(grid)
        launcher(_bwd_kernel, h2)[(grid,)](*args(dwp, dbp), **flags, BLOCK_M=block_m, BLOCK_N=block_n,
                                            num_warps=warps)
    else:
        block_n = max(_RNG_GROUP, common._bwd_chunk(limit))
        warps = common._warps_bwd(block_n)
        elt = (dy2.element_size() + h2.element_size() + 8 + (dh2.element_size() if dh is not None else 0))
        grid = common._chunked_bwd_grid(dev, n * elt, _programs_per_sm(warps), m, num_programs)
        dwp, dbp = partials(grid)
        launcher(_bwd_chunked_kernel, h2)[(grid,)](*args(dwp, dbp), **flags, BLOCK_N=block_n, num_warps=warps)

    outs = []
    if need_dw:
        outs.append((dwp, torch.empty((n,), dtype=weight.dtype, device=dev)))
    if need_db:
        outs.append((dbp, torch.empty((n,), dtype=bias.dtype, device=dev)))
    if outs:
        # one launch for both column sums; with one parameter the second pair is placeholders that
        # no program reads or writes (its grid axis has one index). Passing the one pair twice made
        # the compiled graph return an unwritten clone of the gradient (fusionpass.kernels.launch).
        p0, o0 = outs[0]
        p1, o1 = outs[1] if len(outs) == 2 else (absent(p0), absent(o0))
        block_nr = 32
        launcher(_reduce_kernel, h2)[(triton.cdiv(n, block_nr), len(outs))](
            p0, o0, p1, o1, grid, n, ROUND_BITS=dev.type != "cuda",
            BLOCK_G=min(64, triton.next_power_of_2(grid)), BLOCK_N=block_nr, num_warps=4)
    dw = outs[0][1] if need_dw else None
    db = outs[-1][1] if need_db else None
    return dw, db


