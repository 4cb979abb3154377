"""Triton kernels for RMSNorm with an optional fused residual add (`rms_norm_residual`).

Forward:   h = round(x + residual)   (or h = x)
           rstd = 1 / sqrt(mean(h_f32^2) + eps)
           y = round(round(n) * w)        weight_after_cast (Llama, Mistral, Qwen2)
           y = round(n * (w + offset))    otherwise (Gemma with offset 1.0, fp32 RMSNorm)
Backward:  dx = round(rstd * (g - n * mean(g * n)) + dh),  g = dy * (w + offset)
           dweight = sum_rows dy * round(n)  (or dy * n), reduced without atomics.

Every kernel runs compiled on CUDA and unchanged under TRITON_INTERPRET=1 on CPU tensors; the
only difference is ROUND_BITS (see `_round`).
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

__all__ = ["rms_norm_fwd", "rms_norm_bwd"]


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_kernel(
    X, R, W, Y, H, RSTD,
    M, N, stride_x, stride_r, stride_y, stride_h,
    eps, weight_offset,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_AFTER_CAST: tl.constexpr,
    STORE_H: tl.constexpr, ROUND_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
):
    # torch.compile passes Python floats as fp64 scalars; the math is fp32.
    eps = tl.cast(eps, tl.float32)
    weight_offset = tl.cast(weight_offset, tl.float32)
    # [BLOCK_M, BLOCK_N] tiles. A row that fits one chunk (ONE_PASS) stays in registers: one read,
    # one write. Longer rows take two passes: pass 1 sums squares with its loads marked evict_last,
    # pass 2 re-reads the row from L2 and writes h and y. Two passes beat whole rows in registers
    # at width 4096, one pass won at 2048 and below (kernels/common.py, _fwd_chunk; benchmarks/results/latest/rms_norm_residual.md).
    IN_DT: tl.constexpr = X.dtype.element_ty
    OUT_DT: tl.constexpr = Y.dtype.element_ty
    rows, cols, row_ok, roff = _row_block(M, BLOCK_M, BLOCK_N)

    if ONE_PASS:
        c = cols[None, :]
        mask = row_ok[:, None] & (c < N)
        h = _load_h(X, R, roff, c, mask, stride_x, stride_r, HAS_RESIDUAL, IN_DT, ROUND_BITS, "evict_first")
        if HAS_RESIDUAL and STORE_H:
            tl.store(H + roff * stride_h + c, h, mask=mask)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(h * h, axis=1) / N + eps))
        tl.store(RSTD + rows, rstd, mask=row_ok)
        _fwd_store_y(h, rstd, W, Y, roff, c, mask, N, stride_y, weight_offset,
                     HAS_WEIGHT, WEIGHT_AFTER_CAST, IN_DT, OUT_DT, ROUND_BITS)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols[None, :]
            mask = row_ok[:, None] & (c < N)
            h = _load_h(X, R, roff, c, mask, stride_x, stride_r, HAS_RESIDUAL, IN_DT, ROUND_BITS, "evict_last")
            acc += h * h
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(acc, axis=1) / N + eps))
        tl.store(RSTD + rows, rstd, mask=row_ok)
        for c0 in range(0, N, BLOCK_N):
            c = c0 + cols[None, :]
            mask = row_ok[:, None] & (c < N)
            h = _load_h(X, R, roff, c, mask, stride_x, stride_r, HAS_RESIDUAL, IN_DT, ROUND_BITS, "evict_first")
            if HAS_RESIDUAL and STORE_H:
                tl.store(H + roff * stride_h + c, h, mask=mask)
            _fwd_store_y(h, rstd, W, Y, roff, c, mask, N, stride_y, weight_offset,
                         HAS_WEIGHT, WEIGHT_AFTER_CAST, IN_DT, OUT_DT, ROUND_BITS)


@triton.jit
def _load_h(X, R, roff, c, mask, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr, IN_DT: tl.constexpr,
            ROUND_BITS: tl.constexpr, EVICT: tl.constexpr):
    """h = x (+ r) in fp32. The model adds in the input dtype, so the statistics see the rounded sum."""
    h = tl.load(X + roff * stride_x + c, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return _plus_residual(h, R, roff, stride_r, c, mask, HAS_RESIDUAL, IN_DT, ROUND_BITS, EVICT)


@triton.jit
def _fwd_store_y(h, rstd, W, Y, roff, c, mask, N, stride_y, weight_offset,
                 HAS_WEIGHT: tl.constexpr, WEIGHT_AFTER_CAST: tl.constexpr, IN_DT: tl.constexpr,
                 OUT_DT: tl.constexpr, ROUND_BITS: tl.constexpr):
    n = h * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + c, mask=c < N, other=0.0, eviction_policy="evict_last").to(tl.float32)
        w = w + weight_offset
        if WEIGHT_AFTER_CAST:
            y = _round(n, IN_DT, ROUND_BITS) * w
        else:
            y = n * w
    else:
        y = _round(n, IN_DT, ROUND_BITS)
    tl.store(Y + roff * stride_y + c, _for_store(y, OUT_DT, ROUND_BITS), mask=mask)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_kernel(
    DY, DH, H, RSTD, W, DX, DWP,
    M, N, stride_dy, stride_dh, stride_h, stride_dx,
    weight_offset,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_AFTER_CAST: tl.constexpr,
    NEED_DW: tl.constexpr, ROUND_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # torch.compile passes Python floats as fp64 scalars; the math is fp32.
    weight_offset = tl.cast(weight_offset, tl.float32)
    # Persistent: each program walks row tiles pid, pid + G, ... and keeps its dweight partial in
    # registers across them, writing it once to DWP[pid, :] (no atomics).
    IN_DT: tl.constexpr = H.dtype.element_ty
    DX_DT: tl.constexpr = DX.dtype.element_ty
    pid, num_progs, num_tiles, cols, col_ok, c = _persistent_tiles(M, N, BLOCK_M, BLOCK_N)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = (w + weight_offset)[None, :]
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for tile in range(pid, num_tiles, num_progs):
        rows, row_ok, mask, roff = _tile_rows(tile, M, col_ok, BLOCK_M)
        dy, h = _load_dy_h(DY, H, roff, stride_dy, stride_h, c, mask)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]
        n = h * rstd
        if HAS_WEIGHT:
            g = dy * w
        else:
            g = dy
        mean_gn = (tl.sum(g * n, axis=1) / N)[:, None]
        dx = rstd * (g - n * mean_gn)
        if HAS_DH:
            dx += tl.load(DH + roff * stride_dh + c, mask=mask, other=0.0,
                          eviction_policy="evict_first").to(tl.float32)
        tl.store(DX + roff * stride_dx + c, _for_store(dx, DX_DT, ROUND_BITS), mask=mask)
        if NEED_DW:
            if WEIGHT_AFTER_CAST:
                dw_acc += dy * _round(n, IN_DT, ROUND_BITS)
            else:
                dw_acc += dy * n
    if NEED_DW:
        tl.store(DWP + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)


@triton.jit
def _bwd_chunked_kernel(
    DY, DH, H, RSTD, W, DX, DWP,
    M, N, stride_dy, stride_dh, stride_h, stride_dx,
    weight_offset,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_AFTER_CAST: tl.constexpr,
    NEED_DW: tl.constexpr, ROUND_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # torch.compile passes Python floats as fp64 scalars; the math is fp32.
    weight_offset = tl.cast(weight_offset, tl.float32)
    # Long rows: pass 1 sums g*n over the row, pass 2 (backwards, L2-hot) writes dx and adds into
    # this program's own partial row DWP[pid, :], which no other program touches.
    IN_DT: tl.constexpr = H.dtype.element_ty
    DX_DT: tl.constexpr = DX.dtype.element_ty
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    num_chunks = tl.cdiv(N, BLOCK_N)
    dwp_row = DWP + pid.to(tl.int64) * N
    if NEED_DW:
        for k in range(0, num_chunks):
            c = k * BLOCK_N + cols
            tl.store(dwp_row + c, tl.zeros([BLOCK_N], dtype=tl.float32), mask=c < N)
    for row in range(pid, M, num_progs):
        roff = tl.cast(row, tl.int64)  # (the interpreter hands loop variables over as Python ints)
        dy_row = DY + roff * stride_dy
        h_row = H + roff * stride_h
        rstd = tl.load(RSTD + row)

        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in range(0, num_chunks):
            c = k * BLOCK_N + cols
            m = c < N
            dy = tl.load(dy_row + c, mask=m, other=0.0).to(tl.float32)
            h = tl.load(h_row + c, mask=m, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                w = tl.load(W + c, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
                acc += dy * (w + weight_offset) * h
            else:
                acc += dy * h
        mean_gn = tl.sum(acc, axis=0) * rstd / N

        for k in range(0, num_chunks):
            c = (num_chunks - 1 - k) * BLOCK_N + cols
            m = c < N
            dy = tl.load(dy_row + c, mask=m, other=0.0).to(tl.float32)
            h = tl.load(h_row + c, mask=m, other=0.0).to(tl.float32)
            n = h * rstd
            if HAS_WEIGHT:
                w = tl.load(W + c, mask=m, other=0.0, eviction_policy="evict_last").to(tl.float32)
                g = dy * (w + weight_offset)
            else:
                g = dy
            dx = rstd * (g - n * mean_gn)
            if HAS_DH:
                dx += tl.load(DH + roff * stride_dh + c, mask=m, other=0.0).to(tl.float32)
            tl.store(DX + roff * stride_dx + c, _for_store(dx, DX_DT, ROUND_BITS), mask=m)
            if NEED_DW:
                # Same offsets and layout as the zeroing store: each thread re-reads its own writes.
                p = tl.load(dwp_row + c, mask=m, other=0.0)
                if WEIGHT_AFTER_CAST:
                    p += dy * _round(n, IN_DT, ROUND_BITS)
                else:
                    p += dy * n
                tl.store(dwp_row + c, p, mask=m)


@triton.jit
def _dw_reduce_kernel(P, DW, G, N, ROUND_BITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    # Column sums of the [G, N] fp32 partials, cast to the weight dtype in the same pass.
    _col_sum(P, DW, G, N, tl.program_id(0), ROUND_BITS, BLOCK_G, BLOCK_N)


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def _programs_per_sm(num_warps: int) -> int:
    # Every variant compiles to <= 102 registers per thread for sm_90 (kernels/common.py,
    # MAX_FUSED_BWD), so up to 64 warps could be resident; half of that measured faster
    # (benchmarks/results/latest/rms_norm_residual.md).
    return max(1, 32 // num_warps)


def _row_tile(n: int) -> tuple[int, int]:
    # Depends on the row width only: under torch.compile the row count may be symbolic, and
    # branching on it would specialize the graph.
    block_n = triton.next_power_of_2(n)
    return max(1, common._TILE // block_n), block_n


def rms_norm_fwd(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    eps: float,
    *,
    weight_offset: float = 0.0,
    weight_after_cast: bool = True,
    store_h: bool = True,
    out_dtype: torch.dtype | None = None,
    max_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """RMSNorm of h = x (+ residual) over the last dim. Returns (y, h, rstd).

    y has x's shape and `out_dtype` (default x.dtype; pass the promoted dtype for a Llama-style norm
    whose weight dtype differs from the input's). A float32 x may take a 16-bit residual (added in
    float32). h is x's dtype and shape: x itself when there is no
    residual, None when `store_h` is False. rstd is fp32 of shape [numel // N].
    `max_chunk` (widest column chunk, a power of two) is a testing knob; results do not depend on it.
    """
    n = common._checked_width(x)
    if residual is not None and (residual.shape != x.shape or residual.device != x.device
                                 or not _residual_dtype_ok(x.dtype, residual.dtype)):
        raise ValueError("residual must match x in shape and device, and in dtype unless x is float32 "
                         "and residual 16-bit (added in float32)")
    common._check_param(weight, n, x.device, "weight")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in common._FLOAT_DTYPES:
        raise ValueError(f"unsupported out_dtype {out_dtype}")

    x2 = common._as_2d(x, n)
    m = x2.shape[0]
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    has_res = residual is not None
    write_h = has_res and store_h
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device) if write_h else None
    h_out = h if has_res else x
    if not store_h:
        h_out = None
    if isinstance(m, int) and m == 0:
        return y, h_out, rstd

    with common._device_guard(x.device):
        _launch_fwd(x, residual, weight, eps, weight_offset, weight_after_cast, x2, y, h, rstd, max_chunk)
    return y, h_out, rstd


def _residual_dtype_ok(x_dtype: torch.dtype, residual_dtype: torch.dtype) -> bool:
    """x's dtype is h's (IN_DT: the kernel rounds the sum to it), so a 16-bit residual may join
    an fp32 x (autocast over fp32 weights), not the other way round."""
    return residual_dtype == x_dtype or (x_dtype == torch.float32
                                         and residual_dtype in (torch.float16, torch.bfloat16))


def _launch_fwd(x, residual, weight, eps, weight_offset, weight_after_cast, x2, y, h, rstd, max_chunk):
    m, n = x2.shape
    has_res = residual is not None
    write_h = h is not None
    r2 = common._as_2d(residual, n) if has_res else absent(x2)
    y2 = y.view(-1, n)
    h2 = h.view(-1, n) if write_h else absent(x2)
    # placeholders for the pointers the flags leave unused (fusionpass.kernels.launch says why)
    w = weight if weight is not None else absent(x2)
    args = (x2, r2, w, y2, h2, rstd, m, n, x2.stride(0), r2.stride(0) if has_res else x2.stride(0), y2.stride(0),
            h2.stride(0) if write_h else x2.stride(0),
            float(eps), float(weight_offset))
    flags = dict(HAS_RESIDUAL=has_res, HAS_WEIGHT=weight is not None,
                 WEIGHT_AFTER_CAST=bool(weight_after_cast), STORE_H=write_h,
                 ROUND_BITS=x.device.type != "cuda")
    # Tiles of _TILE elements: whole short rows packed several per program, long rows in chunks.
    block_n = common._fwd_chunk(n) if max_chunk is None else min(triton.next_power_of_2(n), max_chunk)
    block_m = max(1, common._TILE // block_n)
    one_pass = block_n >= n
    launcher(_fwd_kernel, x2)[(triton.cdiv(m, block_m),)](
        *args, **flags, BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=one_pass,
        num_warps=common._warps_fwd(block_m * block_n, one_pass))


def rms_norm_bwd(
    dy: torch.Tensor,
    dh: torch.Tensor | None,
    h: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    weight_offset: float = 0.0,
    weight_after_cast: bool = True,
    need_dweight: bool = True,
    max_fused: int | None = None,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of `rms_norm_fwd`. Returns (dx, dweight).

    dx (h's dtype and shape) is the gradient of both x and residual, dh included when given.
    dweight is in weight's dtype, or None without weight or when `need_dweight` is False.
    `max_fused` and `num_programs` (persistent grid size) are tuning/testing knobs.
    """
    n = common._checked_bwd_width(dy, dh, h)
    common._check_param(weight, n, h.device, "weight")
    h2 = common._as_2d(h, n)
    m = h2.shape[0]
    if rstd.dtype != torch.float32 or rstd.numel() != m:
        raise ValueError(f"rstd must be fp32 with {m} elements")
    rstd = rstd.reshape(m).contiguous()

    need_dw = bool(need_dweight) and weight is not None
    dx = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if isinstance(m, int) and m == 0:
        dw = torch.zeros_like(weight) if need_dw else None
        return dx, dw

    with common._device_guard(h.device):
        dw = _launch_bwd(dy, dh, h, h2, rstd, weight, weight_offset, weight_after_cast, need_dw, dx, max_fused,
                         num_programs)
    return dx, dw


def _launch_bwd(dy, dh, h, h2, rstd, weight, weight_offset, weight_after_cast, need_dw, dx, max_fused,
                num_programs):
    m, n = h2.shape
    dy2 = common._as_2d(dy, n)
    dh2 = common._as_2d(dh, n) if dh is not None else absent(dy2)
    dx2 = dx.view(-1, n)
    w = weight if weight is not None else absent(h2)
    flags = dict(HAS_DH=dh is not None, HAS_WEIGHT=weight is not None,
                 WEIGHT_AFTER_CAST=bool(weight_after_cast), NEED_DW=need_dw,
                 ROUND_BITS=h.device.type != "cuda")

    def args(dwp):
        return (dy2, dh2, h2, rstd, w, dx2, dwp, m, n, dy2.stride(0), (dh2 if dh is not None else dy2).stride(0),
                h2.stride(0),
                dx2.stride(0), float(weight_offset))

    max_fused = common.MAX_FUSED_BWD if max_fused is None else max_fused
    if triton.next_power_of_2(n) <= max_fused:
        block_m, block_n = _row_tile(n)
        warps = common._warps_bwd(block_m * block_n)
        consts = dict(flags, BLOCK_M=block_m, BLOCK_N=block_n)
        per_sm = min(common._MAX_PROGRAMS_PER_SM, _programs_per_sm(warps))
        grid = common._persistent_grid(per_sm, h.device, triton.cdiv(m, block_m), num_programs)
        dwp = torch.empty((grid, n), dtype=torch.float32, device=h.device) if need_dw else absent(rstd)
        launcher(_bwd_kernel, h2)[(grid,)](*args(dwp), **consts, num_warps=warps)
    else:
        block_n = common._bwd_chunk(max_fused)
        consts = dict(flags, BLOCK_N=block_n)
        warps = common._warps_bwd(block_n)
        row_bytes = n * (dy.element_size() + h.element_size() + 4 + (dh.element_size() if dh is not None else 0))
        grid = common._chunked_bwd_grid(h.device, row_bytes, _programs_per_sm(warps), m, num_programs)
        dwp = torch.empty((grid, n), dtype=torch.float32, device=h.device) if need_dw else absent(rstd)
        launcher(_bwd_chunked_kernel, h2)[(grid,)](*args(dwp), **consts, num_warps=warps)

    if not need_dw:
        return None
    dw = torch.empty((n,), dtype=weight.dtype, device=h.device)
    block_g = min(64, triton.next_power_of_2(grid))
    block_nr = 32
    launcher(_dw_reduce_kernel, h2)[(triton.cdiv(n, block_nr),)](
        dwp, dw, grid, n, ROUND_BITS=h.device.type != "cuda", BLOCK_G=block_g, BLOCK_N=block_nr, num_warps=4)
    return dw
