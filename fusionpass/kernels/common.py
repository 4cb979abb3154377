"""What the norm kernel families share: exact rounding that also holds under the Triton
interpreter, the forward tiling policy (why: benchmarks/results/latest/rms_norm_residual.md),
the row and column indexing of their kernels, the column sums of the backward's partials, the
checks of their arguments, launch helpers that torch.compile can trace, and persistent-grid
sizing."""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Forward tiles: this many elements, several short rows or a chunk of a long one.
_TILE = 2048
# Forward rows up to this width can be held in registers (see _fwd_chunk).
MAX_ONE_PASS_FWD = 16384
# Rows wider than the first and at most the second run in two passes over _TILE-column chunks
# (see _fwd_chunk); rms_norm_residual's cost rule leaves those with a partial second chunk to
# Inductor in inference (fusions/rms_norm_residual/pattern.py, PARTIAL_CHUNK).
TWO_PASS_FWD = (_TILE, 2 * _TILE)
# Backward rows whose next power of two is at most this stay in registers, one row (or a tile of
# rows) per program; longer rows loop over chunks of _CHUNK columns. rms_norm: with its warps,
# ptxas for sm_90 gives every variant <= 102 registers per thread and no spills, which a 16384 row
# would not. layer_norm: an 8192 row with dropout spills for sm_90 at 16 warps, yet measured faster
# than the best chunked launch (benchmarks/results/latest/layer_norm_dropout_residual.md).
MAX_FUSED_BWD = 8192
_CHUNK = 4096
# The backward is persistent; more programs per SM than this only grows the weight-gradient partials.
_MAX_PROGRAMS_PER_SM = 4


@triton.jit
def _rne_bf16(x):
    # fp32 -> nearest-even bf16 value, kept in fp32. The interpreter's own fp32->bf16 cast truncates,
    # and h feeds the statistics, so it has to be exact there. (A NaN with a small payload may come
    # out as inf; only the interpreter path uses this.)
    b = x.to(tl.uint32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    b = (b >> 16) << 16
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _round(x, DT: tl.constexpr, ROUND_BITS: tl.constexpr):
    """x (fp32) rounded to dtype DT, returned as fp32."""
    if DT == tl.float32:
        out = x
    elif DT == tl.bfloat16:
        if ROUND_BITS:
            out = _rne_bf16(x)
        else:
            out = x.to(tl.bfloat16).to(tl.float32)
    else:
        out = x.to(DT).to(tl.float32)
    return out


@triton.jit
def _for_store(x, DT: tl.constexpr, ROUND_BITS: tl.constexpr):
    """fp32 value ready for tl.store into DT: the store's implicit cast rounds to nearest even on
    the GPU (and numpy's fp16 cast does too), but truncates bf16 under the interpreter."""
    if DT == tl.bfloat16:
        if ROUND_BITS:
            out = _rne_bf16(x)
        else:
            out = x
    else:
        out = x
    return out


@triton.jit
def _row_block(M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward's indexing: this program's BLOCK_M rows (indices, which of them exist, int64
    offsets as a column) and the BLOCK_N column indices of one chunk."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    roff = rows.to(tl.int64)[:, None]
    return rows, cols, row_ok, roff


@triton.jit
def _plus_residual(h, R, roff, stride_r, c, mask, HAS_RESIDUAL: tl.constexpr, SUM_DT: tl.constexpr,
                   ROUND_BITS: tl.constexpr, EVICT: tl.constexpr):
    """h (+ the residual's tile, the sum rounded to SUM_DT as the model's add rounds it) in fp32."""
    if HAS_RESIDUAL:
        r = tl.load(R + roff * stride_r + c, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        h = _round(h + r, SUM_DT, ROUND_BITS)
    return h


@triton.jit
def _persistent_tiles(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The in-register backward's persistent grid: this program's index, the grid's size, the
    number of BLOCK_M-row tiles it walks, and the row's BLOCK_N columns (indices, which of them
    exist, as a row)."""
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    num_tiles = tl.cdiv(M, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    c = cols[None, :]
    return pid, num_progs, num_tiles, cols, col_ok, c


# The row indices and offsets come from helpers that take no pointers: torch's analysis of which
# arguments a launch writes (Inductor clones those) counts every pointer passed to a call as
# written where a store's address depends on that call's results.
@triton.jit
def _tile_rows(tile, M, col_ok, BLOCK_M: tl.constexpr):
    """Row tile `tile` of the in-register backward: its rows (indices, which exist), the tile's
    mask and the rows' int64 offsets as a column."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    mask = row_ok[:, None] & col_ok[None, :]
    roff = rows.to(tl.int64)[:, None]
    return rows, row_ok, mask, roff


@triton.jit
def _load_dy_h(DY, H, roff, stride_dy, stride_h, c, mask):
    """dy and h of a row tile in fp32; each is read once, so evict_first."""
    dy = tl.load(DY + roff * stride_dy + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    h = tl.load(H + roff * stride_h + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    return dy, h


@triton.jit
def _col_sum(P, OUT, G, N, pid, ROUND_BITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[cols] = column sums of the [G, N] fp32 partials P over this program's BLOCK_N columns,
    cast to OUT's dtype in the same pass (the backward's weight and bias gradients)."""
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        rows = g0 + tl.arange(0, BLOCK_G)
        mask = (rows < G)[:, None] & col_ok[None, :]
        acc += tl.load(P + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, _for_store(tl.sum(acc, axis=0), OUT.dtype.element_ty, ROUND_BITS), mask=col_ok)


def _checked_width(x: torch.Tensor) -> int:
    """The row width of a forward's input x, after checking its dtype and shape."""
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError("x must have a non-empty last dimension")
    return x.shape[-1]


def _checked_bwd_width(dy: torch.Tensor, dh: torch.Tensor | None, h: torch.Tensor) -> int:
    """The row width of a backward's h, after checking that dy (and dh, where given) match it."""
    if h.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {h.dtype}")
    n = h.shape[-1]
    if dy.shape != h.shape or dy.dtype not in _FLOAT_DTYPES or dy.device != h.device:
        raise ValueError("dy must match h in shape and device")
    if dh is not None and (dh.shape != h.shape or dh.dtype not in _FLOAT_DTYPES or dh.device != h.device):
        raise ValueError("dh must match h in shape and device")
    return n


def _check_param(p: torch.Tensor | None, n: int, device: torch.device, what: str) -> None:
    """ValueError unless the optional per-column parameter `what` (weight, bias) is [n] floats on
    `device`."""
    if p is None:
        return
    if p.dim() != 1 or p.shape[0] != n:
        raise ValueError(f"{what} must have shape [{n}], got {tuple(p.shape)}")
    if p.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"unsupported {what} dtype {p.dtype}")
    if p.device != device:
        raise ValueError(f"{what} is on a different device")


def _warps_fwd(tile: int, one_pass: bool) -> int:
    # Two passes over _TILE-element chunks (TWO_PASS_FWD): 8 warps, which measured no slower than
    # 16 there (benchmarks/results/latest/rms_norm_residual.md). One pass: ~8-16 elements per
    # thread.
    if not one_pass:
        return 8
    if tile >= 16384:
        return 32
    if tile >= 8192:
        return 16
    return 8 if tile >= 2048 else 4


def _warps_bwd(tile: int) -> int:
    # ~8 elements per thread: a backward row holds dy, h, dh, the weight and the weight-gradient
    # partials at once (rms_norm at 64 registers fits two 16-warp programs per SM).
    if tile >= 8192:
        return 32
    if tile >= 4096:
        return 16
    if tile >= 2048:
        return 8
    return 4


def _fwd_chunk(n: int) -> int:
    """Columns per chunk: the whole row (one pass in registers) except where two passes over
    _TILE-column chunks measured faster (TWO_PASS_FWD; benchmarks/results/latest/rms_norm_residual.md)
    or rows exceed registers."""
    width = triton.next_power_of_2(n)
    if width <= TWO_PASS_FWD[0] or (TWO_PASS_FWD[1] < width <= MAX_ONE_PASS_FWD):
        return width
    return _TILE


@functools.lru_cache(maxsize=None)
def _cuda_props(index: int) -> tuple[int, int]:
    """(SM count, L2 bytes) of a CUDA device."""
    p = torch.cuda.get_device_properties(index)
    return p.multi_processor_count, p.L2_cache_size


def _device_guard(device: torch.device):
    # Triton launches on the current CUDA device, not on the tensors' one.
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _as_2d(t: torch.Tensor, n: int) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    t2 = t.reshape(-1, n)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _l2_programs_per_sm(device: torch.device, row_bytes: int, cap: int) -> int:
    # Rows in flight in a chunked path must stay in (half of) L2 until their second pass.
    sms, l2 = _cuda_props(device.index or 0)
    return max(1, min(cap, (l2 // 2) // max(1, sms * row_bytes)))


def _bwd_chunk(limit: int) -> int:
    """Columns per chunk of the chunked backward, which takes rows wider than `limit`."""
    return min(_CHUNK, triton.next_power_of_2(limit))


def _chunked_bwd_grid(device: torch.device, row_bytes: int, resident_per_sm: int, m,
                      num_programs: int | None) -> int:
    """Size of the chunked backward's persistent grid over m rows of `row_bytes` each: at most
    `resident_per_sm` programs on each SM, fewer where their rows would not stay in L2 between
    the two passes."""
    cap = _l2_programs_per_sm(device, row_bytes, _MAX_PROGRAMS_PER_SM) if device.type == "cuda" else 1
    return _persistent_grid(min(cap, resident_per_sm), device, m, num_programs)


def _persistent_grid(per_sm: int, device: torch.device, work, num_programs: int | None) -> int:
    """Size of a persistent grid over `work` row tiles: `per_sm` programs on each SM (one wave);
    a few on CPU, where the interpreter runs them one by one. A symbolic `work` (torch.compile
    with dynamic shapes) gets the full wave: idle programs only write zero partials."""
    if num_programs is not None:
        cap = int(num_programs)
    elif device.type != "cuda":
        cap = 4
    else:
        cap = _cuda_props(device.index or 0)[0] * per_sm
    return max(1, min(cap, work)) if isinstance(work, int) else cap
