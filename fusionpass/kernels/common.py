"""What the norm kernel families share: exact rounding that also holds under the Triton
interpreter, the forward tiling policy (why: benchmarks/results/latest/rms_norm_residual.md),
launch helpers that torch.compile can trace, and persistent-grid sizing."""
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
