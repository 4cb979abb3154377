"""Dropout's random bits, shared by the LayerNorm and attention kernels: Philox4x32-10 keyed by a
per-call seed, counted by (column group, row, offset), so that a forward, its backward and
`dropout_mask` (tests) regenerate the same keep bits from (seed, offset, row, col) alone.

No mask tensor is ever stored. Element (row, col) of the [M, N] view is kept iff  u32 >= round(p * 2**32), where u32 is output
`col % 4` of Philox4x32-10 (triton's `tl.philox_impl`, the generator behind `tl.rand`) with
    key     = (seed mod 2**64) as two 32-bit words
    counter = (col // 4, row, offset mod 2**64 as two 32-bit words).
Hence the keep probability is 1 - round(p * 2**32) / 2**32 (p to within 2**-32). One Philox call
serves 4 neighbouring columns (tl.rand makes one call per element): for sm_90 the dropout adds
~27 instructions per element (ptxas, bf16 forward, 2048-wide rows), next to ~50 for the rest of the
kernel. (A 16-bit test, 8 columns per call, saved only ~7 of them and, for fp32 and the chunked
paths, added shared-memory layout conversions.) The mask is
a function of (seed, offset, row, col) only: forward and backward, every tile shape and every
launcher knob regenerate the same bits, and `dropout_mask` (for tests) runs the same code.
Different (seed, offset) pairs give independent streams (the offset is a counter word, so calls
whose offsets differ by 1 do not overlap). The caller must pass a fresh seed per call -- e.g.
`torch.randint(2**62, (1,), device=...)`, drawn from torch's generator -- or a per-layer offset,
or every layer and every step drops the same elements. Inside traced code (torch.compile, a
triton_op) pass the seed as a one-element int64 tensor: the kernels load it on the device, while a
Python int would be baked into the compiled graph as a constant.

"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from fusionpass.kernels.common import _TILE, _device_guard
from fusionpass.kernels.launch import absent, launcher

# Philox rounds (Philox4x32-10, as tl.rand and cuRAND).
N_ROUNDS = tl.constexpr(10)
# Random words per Philox call: one call covers this many neighbouring columns.
RNG_GROUP = 4
# Runtime RNG arguments: never specialized (a fresh seed per call must not recompile the kernel).
RNG_ARGS = ["seed_lo", "seed_hi", "off_lo", "off_hi", "thr"]


@triton.jit
def rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR: tl.constexpr, DROPOUT: tl.constexpr):
    """(k0, k1, o0, o1, threshold) as uint32 scalars (placeholder zeros without DROPOUT). The 32-bit
    words arrive as int32 (always the same kernel signature), the seed optionally as an int64 in
    device memory."""
    if DROPOUT:
        if SEED_PTR:
            s = tl.load(SEED)
            k0 = (s & 0xFFFFFFFF).to(tl.uint32)
            k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
        else:
            k0 = tl.cast(seed_lo, tl.int32).to(tl.uint32, bitcast=True)
            k1 = tl.cast(seed_hi, tl.int32).to(tl.uint32, bitcast=True)
        o0 = tl.cast(off_lo, tl.int32).to(tl.uint32, bitcast=True)
        o1 = tl.cast(off_hi, tl.int32).to(tl.uint32, bitcast=True)
        t = tl.cast(thr, tl.int32).to(tl.uint32, bitcast=True)
    else:
        k0, k1, o0, o1, t = 0, 0, 0, 0, 0
    return k0, k1, o0, o1, t


@triton.jit
def philox_words(k0, k1, o0, o1, rows, col0, COLS_PER_CALL: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The Philox4x32 outputs for rows `rows` ([BLOCK_M] int32) and columns col0 + [0, BLOCK_N), one
    call per COLS_PER_CALL neighbouring columns: counter (col // COLS_PER_CALL, row, o0, o1), key
    (k0, k1). Returned as [BLOCK_M, G, 2, 2] (G calls per row) with (j, s) = (0, 0) -> r0, (0, 1) -> r1,
    (1, 0) -> r2, (1, 1) -> r3: its row-major flattening is r0, r1, r2, r3 of each call in turn."""
    G: tl.constexpr = BLOCK_N // COLS_PER_CALL
    zero = tl.zeros([BLOCK_M, G], dtype=tl.uint32)
    c0 = zero + ((col0 // COLS_PER_CALL) + tl.arange(0, G)).to(tl.uint32)[None, :]
    c1 = zero + rows.to(tl.uint32, bitcast=True)[:, None]
    c2 = zero + o0
    c3 = zero + o1
    r0, r1, r2, r3 = tl.philox_impl(c0, c1, c2, c3, k0, k1, N_ROUNDS)
    return tl.join(tl.join(r0, r2), tl.join(r1, r3))


@triton.jit
def keep_mask(k0, k1, o0, o1, thr, rows, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep mask [BLOCK_M, BLOCK_N] of rows `rows` ([BLOCK_M] int32) and columns col0 + [0, BLOCK_N)
    (col0 a multiple of 4). One Philox4x32 call per 4 neighbouring columns: counter
    (col // 4, row, o0, o1), key (k0, k1); its output i decides column 4 * (col // 4) + i."""
    w = philox_words(k0, k1, o0, o1, rows, col0, 4, BLOCK_M, BLOCK_N)
    return tl.reshape(w, [BLOCK_M, BLOCK_N]) >= thr


@triton.jit
def keep_mask16(k0, k1, o0, o1, thr16, rows, col0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keep mask [BLOCK_M, BLOCK_N] of rows `rows` ([BLOCK_M] int32) and columns col0 + [0, BLOCK_N)
    (col0 a multiple of 8): one Philox4x32 call per 8 neighbouring columns, counter
    (col // 8, row, o0, o1), key (k0, k1); the low / high 16 bits of its output w decide column
    8 * (col // 8) + 2w / 2w + 1, kept iff >= thr16."""
    w = philox_words(k0, k1, o0, o1, rows, col0, 8, BLOCK_M, BLOCK_N)
    # joining the halves last makes them the fastest index: w0 lo, w0 hi, w1 lo, ...
    halves = tl.join(w & 0xFFFF, w >> 16)
    return tl.reshape(halves, [BLOCK_M, BLOCK_N]) >= thr16


@triton.jit
def mask_kernel(
    OUT, SEED, M, N, stride_o, seed_lo, seed_hi, off_lo, off_hi, thr,
    SEED_PTR: tl.constexpr, HALVES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # The keep mask as int8, for tests: the same keep_mask the forward and backward call (HALVES:
    # the attention kernels' keep_mask16).
    k0, k1, o0, o1, t = rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR, True)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_N
    c = col0 + tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < M)[:, None] & (c < N)
    if HALVES:
        kept = keep_mask16(k0, k1, o0, o1, t, rows, col0, BLOCK_M, BLOCK_N)
    else:
        kept = keep_mask(k0, k1, o0, o1, t, rows, col0, BLOCK_M, BLOCK_N)
    tl.store(OUT + rows.to(tl.int64)[:, None] * stride_o + c, kept.to(tl.int8), mask=mask)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------
def i32(v: int) -> int:
    """A 32-bit word as a signed int32 value (kernel arguments keep one type: int32)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def rng_args(p: float, seed, offset: int, device: torch.device):
    """(SEED tensor or None, seed_lo, seed_hi, off_lo, off_hi, thr, scale) for dropout probability p."""
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if p == 0.0:
        return None, 0, 0, 0, 0, 0, 1.0
    if seed is None:
        raise ValueError("dropout with p > 0 needs a seed")
    offset = int(offset)
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.numel() < 1 or seed.device != device:
            raise ValueError("a seed tensor must be int64 with at least one element, on the inputs' device")
        seed_t, lo, hi = seed, 0, 0
    else:
        seed = int(seed)
        seed_t, lo, hi = None, i32(seed), i32(seed >> 32)
    thr, scale = dropout_constants(p)
    return seed_t, lo, hi, i32(offset), i32(offset >> 32), i32(thr), scale


def dropout_mask(shape, p: float, seed, offset: int = 0, device="cpu", *, block_n: int | None = None) -> torch.Tensor:
    """The keep mask (bool, `shape`) that layer_norm_fwd/bwd use for rows of the last dim of
    `shape`, for tests. `block_n` (a power of two >= 4) only changes the tiling, not the result."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    shape = tuple(shape)
    n = shape[-1] if shape else 1
    out = torch.empty(shape, dtype=torch.int8, device=device)
    seed_t, lo, hi, olo, ohi, thr, _ = rng_args(p, seed, offset, device)
    if float(p) == 0.0:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if out.numel() == 0:
        return out.bool()
    o2 = out.view(-1, n)
    if block_n is None:
        bn = max(RNG_GROUP, min(_TILE, triton.next_power_of_2(n)))
    elif block_n < RNG_GROUP or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {RNG_GROUP}")
    else:
        bn = block_n
    fill_keep_mask(o2, (seed_t, lo, hi, olo, ohi, thr), bn, halves=False)
    return out.bool()


def fill_keep_mask(out: torch.Tensor, rng: tuple, block_n: int, halves: bool) -> None:
    """Write the keep bits of the rows of the 2-d int8 `out` (rng: `rng_args`' seed tensor, seed
    and offset words and threshold; halves: attention's 16-bit bits)."""
    seed_t, lo, hi, olo, ohi, thr = rng
    m, n = out.shape
    bm = max(1, _TILE // block_n)
    with _device_guard(out.device):
        launcher(mask_kernel, out)[(triton.cdiv(m, bm), triton.cdiv(n, block_n))](
            out, seed_t if seed_t is not None else absent(out), m, n, out.stride(0), lo, hi, olo, ohi, thr,
            SEED_PTR=seed_t is not None, HALVES=halves, BLOCK_M=bm, BLOCK_N=block_n, num_warps=4)


# --------------------------------------------------------------------------------------------------
# The same bits in torch: CPU graphs without the Triton interpreter (`fusionpass explain` on a machine
# without a GPU) run the fusions' torch references, which draw the *same* keep masks as the kernels,
# so that a CPU run and an interpreted run drop the same elements and a backward matches its forward.
# --------------------------------------------------------------------------------------------------
_U32 = 0xFFFFFFFF


def dropout_constants(p: float) -> tuple[int, float]:
    """(threshold, scale) as the kernels use them: as ATen's CUDA dropout, scale = fp32(1 / fp32(1 - p)),
    applied in fp32 (struct, not a torch tensor: this also runs while torch.compile traces a triton_op)."""
    threshold = min(round(p * 2.0**32), _U32)
    keep = struct.unpack("f", struct.pack("f", 1.0 - p))[0]
    return threshold, 1.0 / keep


def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a * b for uint32 values held in int64 (b split in 16-bit halves
    so that no product overflows 63 bits)."""
    t = a * (b & 0xFFFF)
    u = a * (b >> 16) + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def _philox(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 (tl.philox_impl) of uint32 counters held in int64 tensors, key = seed mod 2**64."""
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    for _ in range(10):
        hi_b, lo_b = _mulhilo(c2, 0xCD9E8D57)
        hi_a, lo_a = _mulhilo(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _U32, (k1 + 0xBB67AE85) & _U32
    return c0, c1, c2, c3


def _philox_words(rows: int, groups: int, seed: int, offset: int) -> torch.Tensor:
    """[rows, groups, 4] Philox outputs of counters (group, row, offset lo, offset hi)."""
    c0 = torch.arange(groups, dtype=torch.int64).expand(rows, groups)
    c1 = (torch.arange(rows, dtype=torch.int64) & _U32)[:, None].expand(rows, groups)
    c2 = torch.full_like(c0, offset & _U32)
    c3 = torch.full_like(c0, (offset >> 32) & _U32)
    return torch.stack(_philox(c0, c1, c2, c3, seed), dim=-1)


def philox_keep(rows: int, cols: int, p: float, seed: int) -> torch.Tensor:
    """The kernels' keep mask of a [rows, cols] view, in torch (bool, on the CPU)."""
    threshold, _ = dropout_constants(p)
    groups = (cols + 3) // 4
    words = _philox_words(rows, groups, seed, 0).reshape(rows, groups * 4)[:, :cols]
    return words >= threshold


def philox_keep16(rows: int, cols: int, thr16: int, seed: int, offset: int = 0) -> torch.Tensor:
    """Attention dropout's keep mask of a [rows, cols] view, in torch (bool, on the CPU): what
    `keep_mask16` draws -- counter (col // 8, row, offset), the low / high 16 bits of output word w
    for columns 8 * (col // 8) + 2w / 2w + 1, kept iff >= thr16 (the attention kernels'
    `attention_dropout_constants`)."""
    threshold = thr16
    groups = (cols + 7) // 8
    words = _philox_words(rows, groups, seed, offset)
    halves = torch.stack((words & 0xFFFF, words >> 16), dim=-1).reshape(rows, groups * 8)[:, :cols]
    return halves >= threshold
