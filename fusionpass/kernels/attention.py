"""Triton kernels for FlashAttention-2 style attention: causal (top-left or bottom-right aligned),
sliding window, ALiBi, key padding, packed sequences, attention dropout and GQA/MQA, forward and
backward.

Math (per batch b, query head h, kv head hk = h // (Hq // Hkv); natural-log units)
-----------------------------------------------------------------------------------------------
    pos_i    = i + shift,  shift = Lk - Lq for align="bottom_right", 0 for "top_left" (SDPA's
               is_causal), plus `diagonal`; Lk is the key tensor's length, also with kv_lengths
    s_ij     = scale * q_i . k_j + bias_ij + key_bias[b, h, j],  scale = 1 / sqrt(D) unless given
    bias_ij  = -slope_h * (pos_i - j)        (ALiBi; alibi_symmetric: -slope_h * |pos_i - j|)
    key_bias: a per-key additive bias, as BLOOM, MPT and Falcon pass ALiBi (`slope_h * j` rounded
               to the model dtype, the same for every query row), read as given, in fp32
    visible  = (j < Lk) & (not causal or j <= pos_i) & (no window or j > pos_i - window)
               & key_padding[b, j] & (j < kv_lengths[b]) & (segments[b, i] == segments[b, j])
    segments: [B, L] sequence ids of packed sequences (Lq == Lk == L), nondecreasing along each row
    lse_i    = log sum_{visible j} exp(s_ij)                  (fp32, natural log)
    P_ij     = exp(s_ij - lse_i) where visible, else 0
    out_i    = sum_j P_ij * Z_ij * v_j,   Z_ij = keep_ij * drop_scale   (Z = 1 without dropout; the
               keep rule and drop_scale = fp32(2**16 / (2**16 - thr16)) are under Dropout RNG)
Backward (D_i = rowsum(dout_i * out_i), which equals sum_j P_ij * dP_ij):
    dP_ij = Z_ij * (dout_i . v_j),  dS_ij = P_ij * (dP_ij - D_i)
    dq_i = scale * sum_j dS_ij k_j,  dk_j = scale * sum_{i in group} dS_ij q_i,
    dv_j = sum_{i in group} P_ij Z_ij dout_i
ALiBi: the signed form is BLOOM's `slope * j` bias and MPT's default (`slope * (j - (L - 1))`) up to
a constant per query row, which softmax ignores, so the three give the same attention with or
without causal masking; the symmetric form is MPT's bidirectional (`full`) one. The slopes are
per query head, fp32, read in the kernel; no bias tensor exists.

Key padding also cuts kv_lengths to one past each row's last kept key (`_last_kept_key`): the
visible keys are the same, and the key blocks after a right-padded row's end are never visited.

`skip_batches` [B] bool: the batch rows another kernel computes (fusionpass::padded_attention's
cuDNN rows). Their programs return before reading or writing anything, so the caller passes that
kernel's outputs as ours and this one fills in only its own rows. It travels as a negative
kv_lengths entry (user kv_lengths are clamped at 0), so it adds no pointer and no specialization.

A query row that sees no key at all (all keys padded, kv_lengths 0, or a bottom-right row with
pos_i < 0) gets out = 0 and lse = EMPTY_LSE = 1e30: finite, and large enough that exp(s - lse)
underflows to 0 for any score, so the backward gives such rows zero gradients even where it did
not mask them (-inf would make exp(-inf - -inf) NaN). Combine partial results (split-KV) only
after mapping EMPTY_LSE to -inf.

FA2 structure. Forward: one program per (query block, batch * query head), online softmax in fp32
in base 2 (scores pre-multiplied by log2(e); exp2) with the normalization deferred to the end.
Key blocks are split into three ranges: blocks left of the window for some row of the query block
(element masks), blocks every row sees whole (no element mask; only key_padding, when given), and
the diagonal / window-less tail blocks (element masks). Blocks above the diagonal and blocks left
of every row's window are never visited; with segments, neither are the key blocks before the
sequence of the query block's first row (`_key_ranges`), nor, in the dK/dV kernel, the query blocks
past the sequence of the key block's last key (`_query_ranges`): packed sequences cost about what
they would cost apart. Backward: `_bwd_pre_kernel` computes D; `_bwd_dkdv_kernel`
runs one program per (key block, batch * kv head), loops over the query heads of its group and
over the query blocks that see the key block (same three-range split), and accumulates dk and dv
in registers, written once: no atomics; `_bwd_dq_kernel` runs one program per (query block,
batch * query head) over the key blocks, as the forward. `_bwd_pre_kernel` also finds, per
(batch, query head), one past the last row whose dout is not all zero: both kernels stop there
(`_live_rows`), as rows of zero dout have dP = dS = 0 and add nothing (the rows past a padded
batch's lengths, which a loss that ignores them gives no gradient; a NaN in dout counts as
live). Scores in the dK/dV kernel are kept transposed ([keys, queries]) so that dv += P^T dout
and dk += dS^T q need no register transpose. The probabilities (P Z, dS) are rounded to the
input dtype before their matmuls, as FA2 does.

Dropout RNG (no mask tensor is ever stored)
-------------------------------------------
The keep bit of (b, h, i, j) comes from Philox4x32-10 (tl.philox_impl, as layer_norm's dropout)
with key = seed and counter = (j // 8, r, offset lo, offset hi), r = (b * Hq + h) * Lq + i
(mod 2**32). Unlike layer_norm, which compares each 32-bit output word with a 32-bit threshold
(4 columns per call), attention splits each word in two 16-bit halves: output word w (0..3) decides
columns 8 * (j // 8) + 2w (its low half) and + 2w + 1 (its high half), and the element is kept iff
its half >= thr16 = min(round(p * 2**16), 2**16 - 1) (`keep_mask16`). One Philox call thus serves 8
keys: the RNG runs on CUDA cores in the forward and again in both backward kernels, and with 32-bit
words it halved the forward's throughput at head dim 64 (an H200 measurement at a GPT-2 shape;
benchmarks/results/latest/flash_attention.md times the kernel with dropout). The realized drop probability is
thr16 / 2**16, within 2**-17 of p (FA2 compares 8-bit slices: within 2**-9), and kept values are
scaled by drop_scale = fp32(2**16 / (2**16 - thr16)), the inverse of the realized keep probability,
not of 1 - p, so the dropout stays unbiased (`attention_dropout_constants`).
The mask is a function of (seed, offset, b, h, i, j, Hq, Lq) only, not of block sizes or launch
knobs, so the forward, both backward kernels, `attention_dropout_mask` (tests) and the torch
mirror `philox_keep16` (fusionpass.ops.layer_norm, the CPU reference) see the same bits.
Rows repeat only past 2**32 query rows per call (B * Hq * Lq), far beyond any tensor that fits.
As with layer_norm: pass a fresh seed per call (a one-element int64 tensor inside traced code) or
distinct offsets, and do not share a (seed, offset) pair between an attention and a layer_norm
dropout (they read the same Philox outputs, so their masks are correlated).

Layouts: q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] with any strides (passed to the kernels; the
transposes of [B, L, H, D] tensors that HF models produce need no copy). out is [B, Hq, Lq, D]
contiguous, or any [B, Hq, Lq, D] view passed as `out` (e.g. `torch.empty(B, Lq, Hq, D)
.transpose(1, 2)` for token-major output). lse is [B, Hq, Lq] fp32 contiguous. dq/dk/dv have the
inputs' dtype and, where the input is dense, its strides (`torch.empty_like`).

Every kernel runs compiled on CUDA and unchanged under TRITON_INTERPRET=1 on CPU tensors (there,
tiles are converted to fp32 after each load, and rounding to bf16 is done explicitly; see
common._round). Launches take no host syncs and their grids depend on shapes only (CUDA graphs).
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from fusionpass.kernels.common import _TILE, _device_guard, _for_store, _round
from fusionpass.kernels.launch import absent, launcher
from fusionpass.kernels import rope as rope_kernels
from fusionpass.kernels.rope import _pair_tiles, _rotate_pairs
from fusionpass.kernels.rng import RNG_ARGS as _RNG_ARGS
from fusionpass.kernels.rng import fill_keep_mask as _fill_keep_mask
from fusionpass.kernels.rng import keep_mask16
from fusionpass.kernels.rng import rng_args as _rng_args
from fusionpass.kernels.rng import rng_key

__all__ = ["EMPTY_LSE", "HEAD_DIMS", "attention_bwd", "attention_dropout_constants", "attention_dropout_mask",
           "attention_fwd"]

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
# lse of a query row that sees no key (see the module docstring).
EMPTY_LSE = 1e30
_EMPTY = tl.constexpr(EMPTY_LSE)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NO_SPEC = ["Lq", "Lk", "window", "diag", *_RNG_ARGS]
# Keys per Philox call: 4 output words of two 16-bit halves each (see the module docstring).
_RNG16_GROUP = 8

# Launch defaults for sm_90 by padded head dim: (BLOCK_M, BLOCK_N, num_warps, num_stages). Forward
# and dQ: BLOCK_M query rows per program, BLOCK_N keys per step. dK/dV: BLOCK_N keys per program (dk
# and dv accumulators: 2 * BLOCK_N * D fp32), BLOCK_M query rows per step. Each is the fastest of
# an H200 sweep (D=128 at a Llama-sized causal shape; D=64 at BERT, GPT-2 and BLOOM shapes, where
# one launch came close to the best at all three); D=256 is scaled from D=128, not measured. The
# sweeps are in git history (benchmarks/results/2026-11-30-h200-attention-kernel.md and
# benchmarks/probes/attention_d64_launches.py as of 67836ab); the kernel's current speed is in
# benchmarks/results/latest/flash_attention.md.
_FWD_CFG = {64: (64, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 64, 8, 2)}
_DKDV_CFG = {64: (64, 128, 8, 2), 128: (64, 128, 8, 2), 256: (16, 64, 8, 2)}
_DQ_CFG = {64: (64, 32, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}
# Without causal (BERT-style encoders) at D=64: the fastest of a sweep timed as CUDA graphs on the
# H200 at a BERT shape (benchmarks/probes/padded_attention.py; results/kernel/padded_attention.md);
# the tables above stay for causal shapes, which that sweep did not time.
_BIDIRECTIONAL_FWD_CFG = {64: (128, 64, 4, 3)}
_BIDIRECTIONAL_DKDV_CFG = {64: (32, 128, 4, 2)}
_PRE_BLOCK_M = 64


def _stages(stages: int, q: torch.Tensor) -> int:
    """Pipelining depth of a launch from the tables above, which are for 16-bit inputs. fp32 tiles
    take twice the shared memory: from head dim 80 up (padded to 128) the tables' launches asked for
    more than the H200's 227 KiB (dK/dV at 96: 288 KiB), so fp32 there takes no extra stage."""
    return 1 if q.element_size() == 4 and q.shape[-1] > 64 else stages
# Forward with RoPE on q (`rope=`): at D=128 the 64-row launch loses less to the rotation than the
# 128-row one (an H200 sweep: benchmarks/probes/rope_attention_layouts.py as of 67836ab; the
# current comparison is benchmarks/results/latest/rope_attention.md).
_FWD_ROPE_CFG = {128: (64, 64, 4, 3)}


# --------------------------------------------------------------------------------------------------
# Shared jitted helpers
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load(ptrs, mask, INTERP: tl.constexpr):
    x = tl.load(ptrs, mask=mask, other=0.0)
    if INTERP:
        # the interpreter keeps bf16 as raw uint16: compute in fp32 there
        x = x.to(tl.float32)
    return x


@triton.jit
def _load_kv(ptrs, cols, kv_end, d_ok, MASKED: tl.constexpr, EVEN_D: tl.constexpr, INTERP: tl.constexpr):
    """A [BLOCK_N, BLOCK_D] key/value tile: masked on keys only in MASKED blocks (where the keys may
    run past kv_end <= Lk; zeros there, as garbage could be NaN), on the padded head dim unless EVEN_D."""
    if MASKED:
        x = tl.load(ptrs, mask=(cols < kv_end)[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    if INTERP:
        x = x.to(tl.float32)
    return x


@triton.jit
def _mm_operand(x, DT: tl.constexpr, INTERP: tl.constexpr):
    """fp32 tile x as a matmul operand of the input dtype (fp32 rounded values under the interpreter)."""
    if INTERP:
        out = _round(x, DT, True)
    else:
        out = x.to(DT)
    return out


@triton.jit
def _scores(s, pos, col, kv_end, window, slope2, kp, kb,
            CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, ALIBI: tl.constexpr, ALIBI_SYM: tl.constexpr,
            HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, MASKED: tl.constexpr):
    """Base-2 scores s (scaled) with the ALiBi bias and the key bias added and the invisible entries
    at -inf. pos (query positions), col (key indices), kp (key kept by key_padding) and kb (key bias,
    base 2) are broadcastable tiles."""
    if HAS_KB:
        s = s + kb
    if ALIBI:
        d = (pos - col).to(tl.float32)
        if ALIBI_SYM:
            d = tl.abs(d)
        s = s - slope2 * d
    if MASKED:
        valid = col < kv_end
        if CAUSAL:
            valid = valid & (col <= pos)
        if WINDOWED:
            valid = valid & (col > pos - window)
        if HAS_KPM:
            valid = valid & kp
        s = tl.where(valid, s, float("-inf"))
    elif HAS_KPM:
        s = tl.where(kp, s, float("-inf"))
    return s


@triton.jit
def _key_ranges(m0, row_end, shift, kv_end, window, seg_lo, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                HAS_SEG: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges of the query rows [m0, row_end): [lo, full_lo) and [full_hi, hi) need element
    masks, [full_lo, full_hi) is seen whole by every row (but for key padding and segments, masked
    in every block). All but hi are multiples of BLOCK_N. With segments, seg_lo is where the first
    row's sequence starts: no row of the block sees a key before it (segment ids never decrease)."""
    hi = kv_end
    full_hi = kv_end
    if CAUSAL:
        hi = tl.minimum(hi, row_end + shift)              # last row's position + 1
        full_hi = tl.minimum(full_hi, m0 + shift + 1)     # first row's position + 1
    full_hi = tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N
    lo = hi * 0
    full_lo = hi * 0
    if WINDOWED:
        lo = tl.maximum(m0 + shift - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(row_end + shift - window, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if HAS_SEG:
        first = seg_lo // BLOCK_N * BLOCK_N
        lo = tl.maximum(lo, first)
        full_lo = tl.maximum(full_lo, first)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(n0, Lq, shift, kv_end, window, seg_hi, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                  HAS_SEG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query ranges that see keys [n0, n0 + BLOCK_N): [lo, full_lo) and [full_hi, hi) need element
    masks, [full_lo, full_hi) sees the whole key block. All but hi are multiples of BLOCK_M. With
    segments, seg_hi is where the last key's sequence ends: no later row sees the block."""
    hi = Lq + n0 * 0
    lo = n0 * 0
    full_lo = n0 * 0
    full_hi = hi
    if CAUSAL:
        lo = tl.maximum(n0 - shift, 0) // BLOCK_M * BLOCK_M           # first row seeing key n0
        full_lo = (tl.maximum(n0 + BLOCK_N - 1 - shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if WINDOWED:
        hi = tl.minimum(hi, tl.maximum(n0 + BLOCK_N - 1 + window - shift, 0))  # last row + 1
        full_hi = tl.maximum(n0 + window - shift, 0) // BLOCK_M * BLOCK_M
    # a block past the valid keys is skipped; one that straddles their end is masked throughout
    if HAS_SEG:
        hi = tl.minimum(hi, seg_hi)
    hi = tl.where(n0 < kv_end, hi, lo)
    full_hi = tl.where(n0 + BLOCK_N <= kv_end, full_hi, 0)
    full_lo = tl.maximum(tl.minimum(full_lo, hi), lo)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _kept(kp, seg_rows, seg_cols, HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr):
    """The run-time part of visibility, broadcastable to the scores tile: key padding kp (already
    shaped to broadcast) AND, with segments, seg_rows == seg_cols (query and key segment ids,
    shaped to broadcast). None without either."""
    if HAS_SEG:
        keep = seg_rows == seg_cols
        if HAS_KPM:
            keep = keep & kp
    else:
        keep = kp
    return keep


@triton.jit
def _key_block_kept(kp_base, skpn, seg_base, seg_q, cols, kv_end, HAS_KPM: tl.constexpr, HAS_SEG: tl.constexpr):
    """_kept for a [rows, keys] tile of the forward and dQ loops: the key block's padding flags and
    segment ids (-2, no row's id, past the valid keys) against the rows' segment ids seg_q."""
    if HAS_KPM:
        kp = tl.load(kp_base + cols * skpn, mask=cols < kv_end, other=0) != 0
    else:
        kp = None
    if HAS_SEG:
        seg_k = tl.load(seg_base + cols, mask=cols < kv_end, other=-2)
    else:
        seg_k = None
    return _kept(kp[None, :] if HAS_KPM else None, seg_q[:, None] if HAS_SEG else None,
                 seg_k[None, :] if HAS_SEG else None, HAS_KPM, HAS_SEG)


@triton.jit
def _segment_rows(SEG, SEG_LO, b64, L, m0, rows, row_ok, HAS_SEG: tl.constexpr):
    """With segments ([B, L] contiguous, Lq == Lk == L): row b's base pointer, the segment ids of
    the query rows (-1 past Lq, equal to no key's) and the start of the first row's sequence
    (unused zeros without segments)."""
    seg_base = SEG + b64 * L  # (never read without segments)
    if HAS_SEG:
        seg_q = tl.load(seg_base + rows, mask=row_ok, other=-1)
        seg_lo = tl.load(SEG_LO + b64 * L + m0)
    else:
        seg_q = rows * 0
        seg_lo = m0 * 0
    return seg_base, seg_q, seg_lo


@triton.jit
def _diagonal_shift(Lq, Lk, BOTTOM_RIGHT: tl.constexpr):
    """Key position of query 0 (see the module docstring): Lk - Lq bottom-right, 0 top-left."""
    if BOTTOM_RIGHT:
        shift = Lk - Lq
    else:
        shift = 0
    return shift


@triton.jit
def _alibi_slope2(SLOPES, h, ALIBI: tl.constexpr):
    """Head h's ALiBi slope in the kernels' base-2 units (0 without ALiBi)."""
    if ALIBI:
        slope2 = tl.load(SLOPES + h) * _LOG2E
    else:
        slope2 = 0.0
    return slope2


@triton.jit
def _query_block(pid_m, h, GROUP, Lq, Lk, diag, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BOTTOM_RIGHT: tl.constexpr):
    """What a (query block, batch * query head) program of the forward and dQ kernels works on:
    its kv head, first row, row / key / channel offsets, which channels and rows exist, the key
    position of query 0 (`shift`) and each row's, and one past its last row."""
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    shift = _diagonal_shift(Lq, Lk, BOTTOM_RIGHT) + diag
    return (hk, m0, offs_m, tl.arange(0, BLOCK_N), offs_d, offs_d < D, offs_m < Lq, shift, offs_m + shift,
            tl.minimum(m0 + BLOCK_M, Lq))


@triton.jit
def _valid_keys(KVLEN, b, Lk, HAS_KVLEN: tl.constexpr):
    """Keys of batch row b at or past this are padding (kv_lengths clamped to [0, Lk])."""
    if HAS_KVLEN:
        kv_end = tl.maximum(tl.minimum(tl.load(KVLEN + b), Lk), 0)
    else:
        kv_end = Lk
    return kv_end


@triton.jit
def _key_bias(kb_base, skbn, cols, kv_end, HAS_KB: tl.constexpr, MASKED: tl.constexpr):
    """key_bias[b, h, cols] in the kernels' base-2 units (fp32; 0 past kv_end), or None."""
    if HAS_KB:
        if MASKED:
            kb = tl.load(kb_base + cols * skbn, mask=cols < kv_end, other=0.0)
        else:
            kb = tl.load(kb_base + cols * skbn)
        kb = kb.to(tl.float32) * _LOG2E
    else:
        kb = None
    return kb


@triton.jit
def _dropout_rows(bh, Lq, rows):
    """Philox row counter of query rows `rows` of (batch * head) bh: (bh * Lq + row) mod 2**32, int32."""
    return (bh.to(tl.int64) * Lq + rows).to(tl.int32)


# --------------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _softmax_step(s, m_i, l_i, GUARD: tl.constexpr):
    """One online-softmax step over base-2 scores s [M, N] (invisible entries at -inf), for the
    running row maxima m_i and sums l_i: (p, alpha, l_i, m_new) with p = exp2(s - m_new) unnormalized
    and alpha the factor that rescales what was accumulated before. GUARD: rows may have seen no
    key yet (m_new = -inf): exp2(-inf - 0) = 0 there instead of exp2(-inf + inf) = NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _fwd_steps(acc, l_i, m_i, q, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
               start, end, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, slope2,
               drop_rows, k0, k1, o0, o1, thr, seg_base, seg_q,
               CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, ALIBI: tl.constexpr, ALIBI_SYM: tl.constexpr,
               HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
               MASKED: tl.constexpr, EVEN_D: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
               PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        # the bias first: issued before the K tile, its load is not waited for after the dot
        kb = _key_bias(kb_base, skbn, cols, kv_end, HAS_KB, MASKED)
        k = _load_kv(k_base + cols[:, None] * skn + offs_d[None, :] * skd, cols, kv_end, d_ok, MASKED, EVEN_D, INTERP)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        keep = _key_block_kept(kp_base, skpn, seg_base, seg_q, cols, kv_end, HAS_KPM, HAS_SEG)
        s = _scores(s, pos[:, None], cols[None, :], kv_end, window, slope2, keep,
                    kb[None, :] if HAS_KB else None, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM or HAS_SEG, HAS_KB,
                    MASKED)
        # (a row may see nothing in a block of other sequences' keys)
        p, alpha, l_i, m_new = _softmax_step(s, m_i, l_i, MASKED or HAS_KPM or HAS_SEG)
        if DROPOUT:
            keep = keep_mask16(k0, k1, o0, o1, thr, drop_rows, n0, BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        v = _load_kv(v_base + cols[:, None] * svn + offs_d[None, :] * svd, cols, kv_end, d_ok, MASKED, EVEN_D, INTERP)
        acc = acc * alpha[:, None] + tl.dot(_mm_operand(p, DT, INTERP), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _rope_q(q, q_base, cos_base, sin_base, offs_m, offs_d, row_ok, sqm, sqd, scm, scd, ssm, ssd,
            ROPE: tl.constexpr, ROT_DIM: tl.constexpr, HALVES: tl.constexpr, DT: tl.constexpr,
            INTERP: tl.constexpr):
    """The q tile rotated by RoPE as it is loaded: y = q * cos + rot(q) * sin on the first ROT_DIM
    channels (the rest as loaded), in fp32, rounded once to the input dtype as a rotation kernel
    would store it. ROPE 1: rotate_half (channel d < R/2 takes -q[d + R/2], the others q[d - R/2]),
    2: interleaved (even d takes -q[d + 1], odd d q[d - 1]).
    HALVES (every channel rotated, D a power of 2): the pair's two channels are loaded as two
    [BLOCK_M, D/2] tiles and the results interleaved in registers. Otherwise (partial rotary,
    D 80/96) q is loaded a second time with the channels paired, which measured 10-13% slower than
    attention on a pre-rotated q on the H200 against 2-3% for HALVES (see _FWD_ROPE_CFG)."""
    HALF: tl.constexpr = ROT_DIM // 2
    if HALVES:
        # the pair tiles and the map of fusionpass.kernels.rope
        q_a, q_b = _pair_tiles(q_base + offs_m * sqm, sqd, row_ok, HALF, HALF, ROPE == 2, "")
        cos_a, cos_b = _pair_tiles(cos_base + offs_m * scm, scd, row_ok, HALF, HALF, ROPE == 2, "")
        sin_a, sin_b = _pair_tiles(sin_base + offs_m * ssm, ssd, row_ok, HALF, HALF, ROPE == 2, "")
        y_a, y_b = _rotate_pairs(q_a, q_b, cos_a, cos_b, sin_a, sin_b, False)
        # [BLOCK_M, D/2, 2]: pair p's channels side by side
        pairs = tl.join(_mm_operand(y_a, DT, INTERP), _mm_operand(y_b, DT, INTERP))
        if ROPE == 1:
            pairs = tl.permute(pairs, (0, 2, 1))  # rotate_half: channel p, then channel p + D/2
        out = tl.reshape(pairs, (q.shape[0], ROT_DIM))
    else:
        rotated = offs_d < ROT_DIM
        if ROPE == 1:
            first = offs_d < HALF
            partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        else:
            first = offs_d % 2 == 0
            partner = tl.where(first, offs_d + 1, offs_d - 1)
        sign = tl.where(first, -1.0, 1.0)
        mask = row_ok[:, None] & rotated[None, :]
        partner = tl.where(rotated, partner, offs_d)
        q_pair = tl.load(q_base + offs_m[:, None] * sqm + partner[None, :] * sqd, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_base + offs_m[:, None] * scm + offs_d[None, :] * scd, mask=mask, other=1.0).to(tl.float32)
        s = tl.load(sin_base + offs_m[:, None] * ssm + offs_d[None, :] * ssd, mask=mask, other=0.0).to(tl.float32)
        out = _mm_operand(q.to(tl.float32) * c + sign[None, :] * q_pair * s, DT, INTERP)
    return out


@triton.jit(do_not_specialize=_NO_SPEC)
def _fwd_kernel(
    Q, K, V, O, LSE, SLOPES, KPM, KB, KVLEN, SEED, SEG, SEG_LO, SEG_HI, COS, SIN,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, skpb, skpn,
    skbb, skbh, skbn, scb, sch, scm, scd, ssb, ssh, ssm, ssd,
    Hq, Lq, Lk, GROUP, num_m, qk_scale, window, diag, drop_scale,
    seed_lo, seed_hi, off_lo, off_hi, thr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, ALIBI: tl.constexpr,
    ALIBI_SYM: tl.constexpr, HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_KVLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROPOUT: tl.constexpr, SEED_PTR: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
    ROPE: tl.constexpr, ROT_DIM: tl.constexpr, ROPE_HALVES: tl.constexpr,
):
    DT: tl.constexpr = Q.dtype.element_ty
    EVEN_D: tl.constexpr = D == BLOCK_D
    # torch.compile passes Python floats as fp64 scalars; the math is fp32, in base 2.
    qk_scale = tl.cast(qk_scale, tl.float32) * _LOG2E
    drop_scale = tl.cast(drop_scale, tl.float32)
    k0, k1, o0, o1, t = rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR, DROPOUT)
    pid = tl.program_id(0)
    pid_m = pid % num_m
    bh = pid // num_m
    b = bh // Hq
    h = bh % Hq
    if HAS_KVLEN:
        if tl.load(KVLEN + b) < 0:  # a batch row another kernel computes (skip_batches)
            return
    hk, m0, offs_m, offs_n, offs_d, d_ok, row_ok, shift, pos, row_end = _query_block(
        pid_m, h, GROUP, Lq, Lk, diag, D, BLOCK_D, BLOCK_M, BLOCK_N, BOTTOM_RIGHT)

    b64 = b.to(tl.int64)
    q_base = Q + b64 * sqb + h.to(tl.int64) * sqh
    q = _load(q_base + offs_m[:, None] * sqm + offs_d[None, :] * sqd, row_ok[:, None] & d_ok[None, :], INTERP)
    if ROPE != 0:
        q = _rope_q(q, q_base, COS + b64 * scb + h.to(tl.int64) * sch, SIN + b64 * ssb + h.to(tl.int64) * ssh,
                    offs_m, offs_d, row_ok, sqm, sqd, scm, scd, ssm, ssd, ROPE, ROT_DIM, ROPE_HALVES, DT,
                    INTERP)
    k_base = K + b64 * skb + hk.to(tl.int64) * skh
    v_base = V + b64 * svb + hk.to(tl.int64) * svh
    kp_base = KPM + b64 * skpb
    kb_base = KB + b64 * skbb + h.to(tl.int64) * skbh
    slope2 = _alibi_slope2(SLOPES, h, ALIBI)
    kv_end = _valid_keys(KVLEN, b, Lk, HAS_KVLEN)
    drop_rows = _dropout_rows(bh, Lq, offs_m)

    seg_base, seg_q, seg_lo = _segment_rows(SEG, SEG_LO, b64, Lq, m0, offs_m, row_ok, HAS_SEG)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(m0, row_end, shift, kv_end, window, seg_lo, CAUSAL, WINDOWED, HAS_SEG,
                                           BLOCK_N)
    if WINDOWED:
        acc, l_i, m_i = _fwd_steps(
            acc, l_i, m_i, q, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn, lo, full_lo, pos, offs_n,
            offs_d, d_ok, kv_end, window, qk_scale, slope2, drop_rows, k0, k1, o0, o1, t, seg_base, seg_q,
            CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG, DROPOUT, True, EVEN_D, DT, INTERP,
            PREC, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_steps(
        acc, l_i, m_i, q, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn, full_lo, full_hi, pos, offs_n,
        offs_d, d_ok, kv_end, window, qk_scale, slope2, drop_rows, k0, k1, o0, o1, t, seg_base, seg_q,
        CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG, DROPOUT, False, EVEN_D, DT, INTERP,
        PREC, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_steps(
        acc, l_i, m_i, q, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn, full_hi, hi, pos, offs_n,
        offs_d, d_ok, kv_end, window, qk_scale, slope2, drop_rows, k0, k1, o0, o1, t, seg_base, seg_q,
        CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG, DROPOUT, True, EVEN_D, DT, INTERP,
        PREC, BLOCK_M, BLOCK_N)

    empty = l_i == 0.0  # (a row with a visible key has l >= 1: its maximum contributes exp2(0))
    l_safe = tl.where(empty, 1.0, l_i)
    if DROPOUT:
        out = acc * (drop_scale / l_safe)[:, None]
    else:
        out = acc / l_safe[:, None]
    lse = tl.where(empty, _EMPTY, (m_i + tl.math.log2(l_safe)) * _LN2)
    OUT_DT: tl.constexpr = O.dtype.element_ty
    tl.store(O + b64 * sob + h.to(tl.int64) * soh + offs_m[:, None] * som + offs_d[None, :] * sod,
             _for_store(out, OUT_DT, INTERP), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_pre_kernel(O, DO, DELTA, QEND, KVLEN, sob, soh, som, sod, sdob, sdoh, sdom, sdod, Hq, Lq, num_m,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_KVLEN: tl.constexpr):
    # delta[b, h, i] = sum_d dout * out (fp32); q_end[b, h] = one past the last row whose dout is
    # not all zero (NaN counts as not zero), by an atomic max over the row blocks (`_live_rows`)
    pid = tl.program_id(0)
    pid_m = pid % num_m
    bh = pid // num_m
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    if HAS_KVLEN:
        if tl.load(KVLEN + b) < 0:  # a batch row another kernel computes (skip_batches)
            return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < Lq)[:, None] & (offs_d < D)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=mask, other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)
    live = tl.sum((do != 0).to(tl.int32), 1) > 0
    tl.atomic_max(QEND + bh, tl.max(tl.where(live, offs_m + 1, 0), 0))


@triton.jit
def _live_rows(lo, full_lo, full_hi, hi, q_end, BLOCK_M: tl.constexpr):
    """_query_ranges cut at q_end (rounded up to a block): the rows from q_end on have dout = 0,
    so dP = dS = 0 there and they add nothing to dk or dv (the rows past a padded batch's lengths,
    which a loss that ignores them gives no gradient)."""
    last = tl.minimum(hi, (q_end + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    return tl.minimum(lo, last), tl.minimum(full_lo, last), tl.minimum(full_hi, last), last


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdom, sdod,
                start, end, n0, cols, kp, kb, offs_m, offs_d, d_ok, Lq, shift, kv_end, window, qk_scale, slope2,
                drop_scale, bh, k0, k1, o0, o1, thr, seg_base, seg_k,
                CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, ALIBI: tl.constexpr, ALIBI_SYM: tl.constexpr,
                HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
                MASKED: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Transposed tiles: [BLOCK_N keys, BLOCK_M queries]; n0 is the key block's first column.
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m
        r_ok = rows < Lq
        mask = r_ok[:, None] & d_ok[None, :]
        q = _load(q_base + rows[:, None] * sqm + offs_d[None, :] * sqd, mask, INTERP)
        do = _load(do_base + rows[:, None] * sdom + offs_d[None, :] * sdod, mask, INTERP)
        # rows past Lq: lse = EMPTY gives P = 0 whatever their (zero) q scores against the bias
        lse2 = tl.load(lse_base + rows, mask=r_ok, other=_EMPTY) * _LOG2E
        delta = tl.load(delta_base + rows, mask=r_ok, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale
        if HAS_SEG:
            seg_q = tl.load(seg_base + rows, mask=r_ok, other=-1)
        else:
            seg_q = None
        keepT = _kept(kp[:, None] if HAS_KPM else None, seg_k[:, None] if HAS_SEG else None,
                      seg_q[None, :] if HAS_SEG else None, HAS_KPM, HAS_SEG)
        sT = _scores(sT, (rows + shift)[None, :], cols[:, None], kv_end, window, slope2, keepT,
                     kb[:, None] if HAS_KB else None,
                     CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM or HAS_SEG, HAS_KB, MASKED)
        pT = tl.math.exp2(sT - lse2[None, :])
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        if DROPOUT:
            keepT = tl.trans(keep_mask16(k0, k1, o0, o1, thr, _dropout_rows(bh, Lq, rows), n0,
                                     BLOCK_M, BLOCK_N))
            pdT = tl.where(keepT, pT * drop_scale, 0.0)
            dpT = tl.where(keepT, dpT * drop_scale, 0.0)
        else:
            pdT = pT
        dv += tl.dot(_mm_operand(pdT, DT, INTERP), do, input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(_mm_operand(dsT, DT, INTERP), q, input_precision=PREC)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, QEND, DK, DV, SLOPES, KPM, KB, KVLEN, SEED, SEG, SEG_LO, SEG_HI,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, skpb, skpn, skbb, skbh, skbn,
    Hq, Hkv, Lq, Lk, GROUP, num_n, sm_scale, window, diag, drop_scale,
    seed_lo, seed_hi, off_lo, off_hi, thr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, ALIBI: tl.constexpr,
    ALIBI_SYM: tl.constexpr, HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_KVLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROPOUT: tl.constexpr, SEED_PTR: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
):
    DT: tl.constexpr = Q.dtype.element_ty
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = sm_scale * _LOG2E
    drop_scale = tl.cast(drop_scale, tl.float32)
    k0, k1, o0, o1, t = rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR, DROPOUT)
    pid = tl.program_id(0)
    pid_n = pid % num_n
    bhk = pid // num_n
    b = bhk // Hkv
    hk = bhk % Hkv
    if HAS_KVLEN:
        if tl.load(KVLEN + b) < 0:  # a batch row another kernel computes (skip_batches)
            return
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    shift = _diagonal_shift(Lq, Lk, BOTTOM_RIGHT) + diag
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    kv_mask = (cols < Lk)[:, None] & d_ok[None, :]
    k = _load(K + b64 * skb + hk64 * skh + cols[:, None] * skn + offs_d[None, :] * skd, kv_mask, INTERP)
    v = _load(V + b64 * svb + hk64 * svh + cols[:, None] * svn + offs_d[None, :] * svd, kv_mask, INTERP)
    kv_end = _valid_keys(KVLEN, b, Lk, HAS_KVLEN)
    if HAS_KPM:
        kp = tl.load(KPM + b64 * skpb + cols * skpn, mask=cols < kv_end, other=0) != 0
    else:
        kp = None
    if HAS_SEG:
        # this block's key segment ids (-2 past Lk, equal to no row's), and where the last key's
        # sequence ends (Lq == Lk: SEG_HI is indexed by position)
        seg_base = SEG + b64 * Lk
        seg_k = tl.load(seg_base + cols, mask=cols < Lk, other=-2)
        seg_hi = tl.load(SEG_HI + b64 * Lk + tl.minimum(n0 + BLOCK_N, Lk) - 1)
    else:
        seg_base = None
        seg_k = None
        seg_hi = Lq
    lo, full_lo, full_hi, hi = _query_ranges(n0, Lq, shift, kv_end, window, seg_hi, CAUSAL, WINDOWED, HAS_SEG,
                                             BLOCK_M, BLOCK_N)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # the query heads of this kv head, one after the other: dk/dv sum over the group in registers
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * Hq + h
        h64 = h.to(tl.int64)
        q_base = Q + b64 * sqb + h64 * sqh
        do_base = DO + b64 * sdob + h64 * sdoh
        lse_base = LSE + bh.to(tl.int64) * Lq
        delta_base = DELTA + bh.to(tl.int64) * Lq
        slope2 = _alibi_slope2(SLOPES, h, ALIBI)
        kb = _key_bias(KB + b64 * skbb + h64 * skbh, skbn, cols, kv_end, HAS_KB, True)
        h_lo, h_full_lo, h_full_hi, h_hi = _live_rows(lo, full_lo, full_hi, hi, tl.load(QEND + bh), BLOCK_M)
        if CAUSAL:
            dk, dv = _dkdv_steps(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdom, sdod, h_lo, h_full_lo, n0, cols,
                kp, kb,
                offs_m, offs_d, d_ok, Lq, shift, kv_end, window, qk_scale, slope2, drop_scale, bh,
                k0, k1, o0, o1, t, seg_base, seg_k, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
                DROPOUT, True, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdom, sdod, h_full_lo, h_full_hi, n0,
            cols, kp, kb,
            offs_m, offs_d, d_ok, Lq, shift, kv_end, window, qk_scale, slope2, drop_scale, bh,
            k0, k1, o0, o1, t, seg_base, seg_k, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
            DROPOUT, False, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdom, sdod, h_full_hi, h_hi, n0, cols,
            kp, kb,
            offs_m, offs_d, d_ok, Lq, shift, kv_end, window, qk_scale, slope2, drop_scale, bh,
            k0, k1, o0, o1, t, seg_base, seg_k, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
            DROPOUT, True, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
    dk = dk * sm_scale
    GRAD_DT: tl.constexpr = DK.dtype.element_ty
    tl.store(DK + b64 * sdkb + hk64 * sdkh + cols[:, None] * sdkn + offs_d[None, :] * sdkd,
             _for_store(dk, GRAD_DT, INTERP), mask=kv_mask)
    tl.store(DV + b64 * sdvb + hk64 * sdvh + cols[:, None] * sdvn + offs_d[None, :] * sdvd,
             _for_store(dv, GRAD_DT, INTERP), mask=kv_mask)


@triton.jit
def _dq_steps(dq, q, do, lse2, delta, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
              start, end, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, slope2, drop_scale,
              drop_rows, k0, k1, o0, o1, thr, seg_base, seg_q,
              CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, ALIBI: tl.constexpr, ALIBI_SYM: tl.constexpr,
              HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
              MASKED: tl.constexpr, EVEN_D: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
              PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        kb = _key_bias(kb_base, skbn, cols, kv_end, HAS_KB, MASKED)
        k = _load_kv(k_base + cols[:, None] * skn + offs_d[None, :] * skd, cols, kv_end, d_ok, MASKED, EVEN_D, INTERP)
        v = _load_kv(v_base + cols[:, None] * svn + offs_d[None, :] * svd, cols, kv_end, d_ok, MASKED, EVEN_D, INTERP)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        keep = _key_block_kept(kp_base, skpn, seg_base, seg_q, cols, kv_end, HAS_KPM, HAS_SEG)
        s = _scores(s, pos[:, None], cols[None, :], kv_end, window, slope2, keep,
                    kb[None, :] if HAS_KB else None, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM or HAS_SEG, HAS_KB,
                    MASKED)
        p = tl.math.exp2(s - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if DROPOUT:
            keep = keep_mask16(k0, k1, o0, o1, thr, drop_rows, n0, BLOCK_M, BLOCK_N)
            dp = tl.where(keep, dp * drop_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(_mm_operand(ds, DT, INTERP), k, input_precision=PREC)
    return dq


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, QEND, DQ, SLOPES, KPM, KB, KVLEN, SEED, SEG, SEG_LO, SEG_HI,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
    sdqb, sdqh, sdqm, sdqd, skpb, skpn, skbb, skbh, skbn,
    Hq, Lq, Lk, GROUP, num_m, sm_scale, window, diag, drop_scale,
    seed_lo, seed_hi, off_lo, off_hi, thr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, ALIBI: tl.constexpr,
    ALIBI_SYM: tl.constexpr, HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_KVLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROPOUT: tl.constexpr, SEED_PTR: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
):
    DT: tl.constexpr = Q.dtype.element_ty
    EVEN_D: tl.constexpr = D == BLOCK_D
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale = sm_scale * _LOG2E
    drop_scale = tl.cast(drop_scale, tl.float32)
    k0, k1, o0, o1, t = rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR, DROPOUT)
    pid = tl.program_id(0)
    pid_m = pid % num_m
    bh = pid // num_m
    b = bh // Hq
    h = bh % Hq
    if HAS_KVLEN:
        if tl.load(KVLEN + b) < 0:  # a batch row another kernel computes (skip_batches)
            return
    hk, m0, offs_m, offs_n, offs_d, d_ok, row_ok, shift, pos, row_end = _query_block(
        pid_m, h, GROUP, Lq, Lk, diag, D, BLOCK_D, BLOCK_M, BLOCK_N, BOTTOM_RIGHT)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    mask = row_ok[:, None] & d_ok[None, :]
    q = _load(Q + b64 * sqb + h64 * sqh + offs_m[:, None] * sqm + offs_d[None, :] * sqd, mask, INTERP)
    do = _load(DO + b64 * sdob + h64 * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask, INTERP)
    lse2 = tl.load(LSE + bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=_EMPTY) * _LOG2E
    delta = tl.load(DELTA + bh.to(tl.int64) * Lq + offs_m, mask=row_ok, other=0.0)
    k_base = K + b64 * skb + hk.to(tl.int64) * skh
    v_base = V + b64 * svb + hk.to(tl.int64) * svh
    kp_base = KPM + b64 * skpb
    kb_base = KB + b64 * skbb + h64 * skbh
    slope2 = _alibi_slope2(SLOPES, h, ALIBI)
    kv_end = _valid_keys(KVLEN, b, Lk, HAS_KVLEN)
    drop_rows = _dropout_rows(bh, Lq, offs_m)

    seg_base, seg_q, seg_lo = _segment_rows(SEG, SEG_LO, b64, Lq, m0, offs_m, row_ok, HAS_SEG)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, full_lo, full_hi, hi = _key_ranges(m0, row_end, shift, kv_end, window, seg_lo, CAUSAL, WINDOWED, HAS_SEG,
                                           BLOCK_N)
    # a query block whose dout is zero throughout (past q_end) has dq = 0: no key block is visited
    hi = tl.where(m0 < tl.load(QEND + bh), hi, lo)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(full_hi, hi)
    if WINDOWED:
        dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
                   lo, full_lo,
                       pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, slope2, drop_scale, drop_rows,
                       k0, k1, o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB,
                       HAS_SEG, DROPOUT, True, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
    dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
                   full_lo, full_hi,
                   pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, slope2, drop_scale, drop_rows,
                   k0, k1, o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB,
                   HAS_SEG, DROPOUT, False, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
    dq = _dq_steps(dq, q, do, lse2, delta, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
                   full_hi, hi,
                   pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, slope2, drop_scale, drop_rows,
                   k0, k1, o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB,
                   HAS_SEG, DROPOUT, True, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
    dq = dq * sm_scale
    GRAD_DT: tl.constexpr = DQ.dtype.element_ty
    tl.store(DQ + b64 * sdqb + h64 * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
             _for_store(dq, GRAD_DT, INTERP), mask=mask)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
class _Opts:
    """Checked options shared by the forward and the backward (attributes set by `_options`)."""


def check_qkv(q, k, v, head_dims=HEAD_DIMS, value_dims=None) -> tuple[int, int, int, int, int, int]:
    """(B, Hq, Hkv, Lq, Lk, D) of q [B, Hq, Lq, D] and k = v [B, Hkv, Lk, D] with Hq % Hkv == 0,
    one dtype of fp16/bf16/fp32, one device and D in `head_dims`; ValueError otherwise. The
    prefill and decode kernels share it. With `value_dims`, v [B, Hkv, Lk, Dv] may have its own
    head dim Dv in value_dims (MLA's 192 / 128)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, H, L, D]")
    B, Hq, Lq, D = q.shape
    if value_dims is not None and k.shape[:3] == v.shape[:3]:
        if v.shape[3] not in value_dims:
            raise ValueError(f"value head dim {v.shape[3]} not supported (supported: {value_dims})")
    elif k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k/v {tuple(k.shape)} do not match q {tuple(q.shape)} in batch or head dim")
    Hkv, Lk = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the kv heads ({Hkv})")
    if D not in head_dims:
        raise ValueError(f"head dim {D} not supported (supported: {head_dims})")
    if q.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype} (fp16, bf16, fp32)")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError("q, k and v must be on one device")
    return B, Hq, Hkv, Lq, Lk, D


def _options(q, k, v, causal, scale, window, alibi_slopes, alibi_symmetric, key_padding, key_bias, kv_lengths,
             dropout_p, seed, offset, align, diagonal=0, segments=None, skip_batches=None) -> _Opts:
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, v)
    dev = q.device
    o = _Opts()
    o.B, o.Hq, o.Hkv, o.Lq, o.Lk, o.D, o.group = B, Hq, Hkv, Lq, Lk, D, Hq // Hkv
    o.scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    o.causal = bool(causal)
    if window is not None:
        if not o.causal:
            raise ValueError("a sliding window needs causal=True")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
    o.window = window
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    o.bottom_right = align == "bottom_right"
    if isinstance(diagonal, bool) or not isinstance(diagonal, int) or (diagonal and not o.causal):
        raise ValueError(f"diagonal must be an int, and other than 0 only with causal=True, got {diagonal!r}")
    o.diag = diagonal
    if alibi_slopes is not None:
        if alibi_slopes.shape != (Hq,) or not alibi_slopes.is_floating_point() or alibi_slopes.device != dev:
            raise ValueError(f"alibi_slopes must be a float tensor of shape [{Hq}] on the inputs' device")
        alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
    o.slopes = alibi_slopes
    o.alibi_sym = bool(alibi_symmetric)
    if key_padding is not None:
        if key_padding.shape != (B, Lk) or key_padding.dtype != torch.bool or key_padding.device != dev:
            raise ValueError(f"key_padding must be a bool tensor of shape [{B}, {Lk}] on the inputs' device")
    o.kpm = key_padding
    if key_bias is not None:
        if (key_bias.dim() != 3 or any(a not in (1, b_) for a, b_ in zip(key_bias.shape, (B, Hq, Lk)))
                or not key_bias.is_floating_point() or key_bias.device != dev):
            raise ValueError(f"key_bias must be a float tensor broadcastable as [{B}, {Hq}, {Lk}] on the inputs' device")
        key_bias = key_bias.expand(B, Hq, Lk)
    o.kb = key_bias
    if kv_lengths is not None:
        if (kv_lengths.shape != (B,) or kv_lengths.dtype not in (torch.int32, torch.int64)
                or kv_lengths.device != dev):
            raise ValueError(f"kv_lengths must be an int32 tensor of shape [{B}] on the inputs' device")
        # (a negative entry is skip_batches' mark: a user's means no key, as before)
        kv_lengths = kv_lengths.to(torch.int32).clamp(min=0)
    if key_padding is not None and Lk > 0:
        kv_lengths = _last_kept_key(key_padding, kv_lengths)
    if skip_batches is not None:
        if skip_batches.shape != (B,) or skip_batches.dtype != torch.bool or skip_batches.device != dev:
            raise ValueError(f"skip_batches must be a bool tensor of shape [{B}] on the inputs' device")
        kept = torch.full((B,), Lk, dtype=torch.int32, device=dev) if kv_lengths is None else kv_lengths
        kv_lengths = torch.where(skip_batches, -1, kept).to(torch.int32)
    o.kvlen = kv_lengths
    o.seg = _segments(segments, B, Lq, Lk, dev)
    o.rng = _rng16_args(dropout_p, seed, offset, dev)
    o.dropout = float(dropout_p) > 0.0
    o.interp = dev.type != "cuda"
    o.prec = "ieee" if q.dtype == torch.float32 else "tf32"
    return o


def _last_kept_key(key_padding: torch.Tensor, kv_lengths: torch.Tensor | None) -> torch.Tensor:
    """kv_lengths cut to one past each row's last kept key: the same visible keys, but the key
    blocks past a right-padded row's length are skipped instead of masked, so a padded batch costs
    about what its lengths cost (one [B, Lk] reduction on the device, no host sync)."""
    Lk = key_padding.shape[-1]
    last = torch.where(key_padding, torch.arange(1, Lk + 1, device=key_padding.device, dtype=torch.int32),
                       0).amax(-1)
    return last if kv_lengths is None else torch.minimum(kv_lengths, last)


def _segments(segments, B, Lq, Lk, dev):
    """(ids, starts, ends) as [B, L] int32 contiguous tensors, or None: starts[b, i] / ends[b, i]
    are the first and one past the last position of the sequence of position i (segment ids never
    decrease along a row, so searchsorted finds them; no host sync)."""
    if segments is None:
        return None
    if Lq != Lk:
        raise ValueError(f"segments need square scores (Lq == Lk), got Lq {Lq} and Lk {Lk}")
    if (not isinstance(segments, torch.Tensor) or segments.shape != (B, Lk) or segments.is_floating_point()
            or segments.dtype == torch.bool or segments.device != dev):
        raise ValueError(f"segments must be an integer tensor of shape [{B}, {Lk}] on the inputs' device")
    ids = segments.contiguous()
    starts = torch.searchsorted(ids, ids, right=False).to(torch.int32)
    ends = torch.searchsorted(ids, ids, right=True).to(torch.int32)
    return ids.to(torch.int32), starts, ends


def _block(value, default, what):
    if value is None:
        return default
    if value < 16 or value & (value - 1):
        raise ValueError(f"{what} must be a power of two >= 16, got {value}")
    return value


def _flags(o: _Opts):
    return {"D": o.D, "BLOCK_D": triton.next_power_of_2(o.D), "CAUSAL": o.causal,
            "WINDOWED": o.window is not None, "BOTTOM_RIGHT": o.bottom_right, "ALIBI": o.slopes is not None,
            "ALIBI_SYM": o.alibi_sym, "HAS_KPM": o.kpm is not None, "HAS_KB": o.kb is not None,
            "HAS_KVLEN": o.kvlen is not None, "HAS_SEG": o.seg is not None,
            "DROPOUT": o.dropout, "SEED_PTR": o.rng[0] is not None, "INTERP": o.interp, "PREC": o.prec}


def _aux(o: _Opts, like):
    """(SLOPES, KPM, KB, KVLEN, SEED, SEG, SEG_LO, SEG_HI) pointers (placeholders like `like` where
    unused, fusionpass.kernels.launch says why) and the strides of key_padding and key_bias (0
    where broadcast or unused)."""
    def ptr(t):
        return t if t is not None else absent(like)
    kp_strides = o.kpm.stride() if o.kpm is not None else (0, 0)
    kb_strides = o.kb.stride() if o.kb is not None else (0, 0, 0)
    seg = o.seg if o.seg is not None else (None, None, None)
    return ((ptr(o.slopes), ptr(o.kpm), ptr(o.kb), ptr(o.kvlen), ptr(o.rng[0]), *map(ptr, seg)),
            (*kp_strides, *kb_strides))


_ROPE_HALVES = True  # see _rope_q; False: the partner-load form everywhere


def _rope_args(rope, q):
    """(COS, SIN) pointers, their [B, H, L, D] strides (0 where broadcast) and the ROPE/ROT_DIM
    flags for the forward; placeholders and zero strides without rope."""
    if rope is None:
        return (absent(q), absent(q)), (0,) * 8, {"ROPE": 0, "ROT_DIM": 0, "ROPE_HALVES": False}
    cos, sin, form, rotary_dim = rope
    D = q.shape[-1]
    rope_kernels.check_form(form, rotary_dim, D)
    rope_kernels.check_cos_sin(cos, sin, rotary_dim, q)
    strides = (*rope_kernels.broadcast_strides(cos), *rope_kernels.broadcast_strides(sin))
    halves = _ROPE_HALVES and rotary_dim == D and D & (D - 1) == 0
    # ROPE 1: rotate_half, 2: interleaved (the order of fusionpass.kernels.rope.FORMS)
    flags = {"ROPE": rope_kernels.FORMS.index(form) + 1, "ROT_DIM": rotary_dim, "ROPE_HALVES": halves}
    return (cos, sin), strides, flags


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_symmetric: bool = False,
    key_padding: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
    kv_lengths: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    offset: int = 0,
    align: str = "top_left",
    diagonal: int = 0,
    segments: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    skip_batches: torch.Tensor | None = None,
    rope: tuple | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward (see the module docstring for the math). Returns (out, lse).

    q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (Hq % Hkv == 0; query head h reads kv head h // (Hq // Hkv)),
    any strides, one dtype of fp16/bf16/fp32, D in HEAD_DIMS. `window` (with causal only): key j is
    visible to query i iff pos_i - window < j <= pos_i. `alibi_slopes` [Hq] float: bias
    -slope * (pos_i - j) (|pos_i - j| with `alibi_symmetric`). `key_padding` [B, Lk] bool (True =
    keep) and/or `kv_lengths` [B] int32 (keys >= length are masked). `key_bias`: float, broadcastable
    as [B, Hq, Lk], any strides (no gradient is computed for it). `dropout_p` > 0 needs `seed`
    (int, or a one-element int64 tensor on the inputs' device) and takes `offset`. `align`:
    "top_left" (pos_i = i, SDPA's is_causal) or "bottom_right" (pos_i = i + Lk - Lq); `diagonal`
    (with causal) moves the diagonal by that many keys more (pos_i = i + diagonal top-left): with
    a window of 2w + 1 and diagonal w, a bidirectional band |i - j| <= w (ModernBERT's local layers).
    `segments` [B, L] integer, Lq == Lk == L, each row nondecreasing: key j is visible to query i
    only where segments[b, i] == segments[b, j] (packed sequences); the kernels skip the key blocks
    before each query block's first sequence and the query blocks past each key block's last.
    out: [B, Hq, Lq, D] in q's dtype, contiguous, or written into `out` (any [B, Hq, Lq, D] view of
    q's dtype, e.g. a transpose of a [B, Lq, Hq, D] buffer). lse: [B, Hq, Lq] fp32, natural log of
    the softmax denominator of the scaled, biased scores; EMPTY_LSE for rows that see no key.
    `lse`: a [B, Hq, Lq] fp32 contiguous tensor to write lse into. `skip_batches` [B] bool: the batch
    rows another kernel computes; nothing of theirs is read or written, so `out` and `lse` (given
    with it) keep that kernel's values there (fusionpass::padded_attention).
    rope: (cos, sin, form, rotary_dim): q is rotated as it is loaded (`_rope_q`; the rotated q is
    never written), `q * cos + rot(q) * sin` of fusionpass.kernels.rope with form "rotate_half" or
    "interleaved"; cos/sin 4-d, last dim rotary_dim, broadcastable to [B, Hq, Lq, rotary_dim].
    block_m/block_n/num_warps/num_stages override the launch defaults (_FWD_CFG); results do not
    depend on them beyond fp32 summation order.
    """
    o = _options(q, k, v, causal, scale, window, alibi_slopes, alibi_symmetric, key_padding, key_bias,
                 kv_lengths, dropout_p, seed, offset, align, diagonal, segments, skip_batches)
    B, Hq, Lq, D = o.B, o.Hq, o.Lq, o.D
    if skip_batches is not None and (out is None or lse is None):
        raise ValueError("skip_batches needs out and lse: the skipped rows keep what they hold")
    if out is None:
        out = torch.empty((B, Hq, Lq, D), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on q's device")
    if lse is None:
        lse = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    elif lse.shape != (B, Hq, Lq) or lse.dtype != torch.float32 or lse.device != q.device or not lse.is_contiguous():
        raise ValueError(f"lse must be a contiguous float32 tensor of shape [{B}, {Hq}, {Lq}] on q's device")
    if B * Hq * Lq == 0:
        return out, lse
    padded = triton.next_power_of_2(D)
    if rope is not None:
        bm, bn, warps, stages = _FWD_ROPE_CFG.get(padded, _FWD_CFG[padded])
    else:
        bm, bn, warps, stages = (_FWD_CFG if o.causal else _FWD_CFG | _BIDIRECTIONAL_FWD_CFG)[padded]
    bm = _block(block_m, bm, "block_m")
    bn = _block(block_n, bn, "block_n")
    num_m = triton.cdiv(Lq, bm)
    ptrs, aux_strides = _aux(o, q)
    rope_ptrs, rope_strides, rope_flags = _rope_args(rope, q)
    _, lo, hi, olo, ohi, thr, drop_scale = o.rng
    with _device_guard(q.device):
        launcher(_fwd_kernel, q)[(num_m * B * Hq,)](
            q, k, v, out, lse, *ptrs, *rope_ptrs,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *aux_strides, *rope_strides,
            Hq, Lq, o.Lk, o.group, num_m, o.scale, o.window or 0, o.diag, float(drop_scale),
            lo, hi, olo, ohi, thr,
            **_flags(o), **rope_flags, BLOCK_M=bm, BLOCK_N=bn,
            num_warps=num_warps or warps, num_stages=num_stages or _stages(stages, q))
    return out, lse


def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_symmetric: bool = False,
    key_padding: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
    kv_lengths: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seed: int | torch.Tensor | None = None,
    offset: int = 0,
    align: str = "top_left",
    diagonal: int = 0,
    segments: torch.Tensor | None = None,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    skip_batches: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dq_block_m: int | None = None,
    dq_block_n: int | None = None,
    dq_num_warps: int | None = None,
    dq_num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attention_fwd` (same options; out and lse are its outputs, do the gradient of
    out, any strides). Returns (dq, dk, dv) in the inputs' dtype, shaped as q, k, v and, where those
    are dense, with their strides. block_m/block_n/num_warps/num_stages: the dK/dV kernel (block_n
    keys per program, block_m query rows per step; defaults _DKDV_CFG); dq_*: the dQ kernel
    (dq_block_m query rows per program, dq_block_n keys per step; defaults _DQ_CFG).
    `grads`: (dq, dk, dv) tensors shaped as q, k, v to write into; with `skip_batches` (as
    attention_fwd's) they keep another kernel's gradients in the skipped batch rows.
    """
    o = _options(q, k, v, causal, scale, window, alibi_slopes, alibi_symmetric, key_padding, key_bias,
                 kv_lengths, dropout_p, seed, offset, align, diagonal, segments, skip_batches)
    B, Hq, Hkv, Lq, Lk, D = o.B, o.Hq, o.Hkv, o.Lq, o.Lk, o.D
    for t, name in ((do, "do"), (out, "out")):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q in shape, dtype and device")
    if lse.shape != (B, Hq, Lq) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be a float32 tensor of shape [{B}, {Hq}, {Lq}] on q's device")
    lse = lse.contiguous()
    if grads is None:
        if skip_batches is not None:
            raise ValueError("skip_batches needs grads: the skipped rows keep what they hold")
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    elif any(g.shape != t.shape or g.dtype != t.dtype or g.device != t.device for g, t in zip(grads, (q, k, v))):
        raise ValueError("grads must be three tensors shaped as q, k and v, in their dtype and device")
    dq, dk, dv = grads
    if B * Hq * Lq == 0 or Lk == 0:
        if skip_batches is not None:
            return dq, dk, dv
        return dq.zero_(), dk.zero_(), dv.zero_()
    pad_d = triton.next_power_of_2(D)
    flags = _flags(o)
    ptrs, aux_strides = _aux(o, q)
    _, lo, hi, olo, ohi, thr, drop_scale = o.rng
    rng = (lo, hi, olo, ohi, thr)
    delta = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    q_end = torch.zeros((B, Hq), dtype=torch.int32, device=q.device)
    with _device_guard(q.device):
        num_m = triton.cdiv(Lq, _PRE_BLOCK_M)
        launcher(_bwd_pre_kernel, q)[(num_m * B * Hq,)](
            out, do, delta, q_end, ptrs[3], *out.stride(), *do.stride(), Hq, Lq, num_m,
            D=D, BLOCK_D=pad_d, BLOCK_M=_PRE_BLOCK_M, HAS_KVLEN=flags["HAS_KVLEN"], num_warps=4)

        bm, bn, warps, stages = (_DKDV_CFG if o.causal else _DKDV_CFG | _BIDIRECTIONAL_DKDV_CFG)[pad_d]
        bm = _block(block_m, bm, "block_m")
        bn = _block(block_n, bn, "block_n")
        num_n = triton.cdiv(Lk, bn)
        launcher(_bwd_dkdv_kernel, q)[(num_n * B * Hkv,)](
            q, k, v, do, lse, delta, q_end, dk, dv, *ptrs,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *aux_strides,
            Hq, Hkv, Lq, Lk, o.group, num_n, o.scale, o.window or 0, o.diag, float(drop_scale), *rng,
            **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=num_warps or warps, num_stages=num_stages or _stages(stages, q))

        bm, bn, warps, stages = _DQ_CFG[pad_d]
        bm = _block(dq_block_m, bm, "dq_block_m")
        bn = _block(dq_block_n, bn, "dq_block_n")
        num_m = triton.cdiv(Lq, bm)
        launcher(_bwd_dq_kernel, q)[(num_m * B * Hq,)](
            q, k, v, do, lse, delta, q_end, dq, *ptrs,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *aux_strides,
            Hq, Lq, Lk, o.group, num_m, o.scale, o.window or 0, o.diag, float(drop_scale), *rng,
            **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=dq_num_warps or warps,
            num_stages=dq_num_stages or _stages(stages, q))
    return dq, dk, dv


def attention_dropout_constants(p: float) -> tuple[int, float]:
    """(thr16, drop_scale) of attention dropout with probability p: an element is kept iff its 16-bit
    random value >= thr16 = min(round(p * 2**16), 2**16 - 1), and kept values are multiplied by
    drop_scale = 2**16 / (2**16 - thr16) rounded to fp32 (the value the kernels multiply by), the
    inverse of the realized keep probability 1 - thr16 / 2**16."""
    thr16 = min(round(float(p) * 65536.0), 65535)
    # struct, not a torch tensor: this also runs while torch.compile traces a triton_op
    scale = struct.unpack("f", struct.pack("f", 65536.0 / (65536 - thr16)))[0]
    return thr16, scale


def _rng16_args(p: float, seed, offset: int, device: torch.device):
    """fusionpass.kernels.rng's `rng_args` (checks, seed and offset words) with attention's 16-bit threshold
    and its scale in place of the 32-bit ones."""
    seed_t, lo, hi, olo, ohi, _, _ = _rng_args(p, seed, offset, device)
    if float(p) == 0.0:
        return seed_t, lo, hi, olo, ohi, 0, 1.0
    thr16, scale = attention_dropout_constants(p)
    return seed_t, lo, hi, olo, ohi, thr16, scale


def attention_dropout_mask(B: int, H: int, Lq: int, Lk: int, p: float, seed, offset: int = 0,
                           device="cpu", *, block_n: int | None = None) -> torch.Tensor:
    """The keep mask (bool [B, H, Lq, Lk]) of attention dropout with (p, seed, offset), for tests,
    made by the same jitted `keep_mask16` the attention kernels call (H is the number of query heads;
    mask row (b * H + h) * Lq + i is Philox row counter r). `block_n` (a power of two >= 16, as
    the kernels' key blocks) only changes the tiling, not the result."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    seed_t, lo, hi, olo, ohi, thr, _ = _rng16_args(p, seed, offset, device)
    if float(p) == 0.0:
        return torch.ones((B, H, Lq, Lk), dtype=torch.bool, device=device)
    out = torch.empty((B * H * Lq, Lk), dtype=torch.int8, device=device)
    if out.numel() == 0:
        return out.bool().view(B, H, Lq, Lk)
    bn = _block(block_n, max(2 * _RNG16_GROUP, min(_TILE, triton.next_power_of_2(Lk))), "block_n")
    _fill_keep_mask(out, (seed_t, lo, hi, olo, ohi, thr), bn, halves=True)
    return out.bool().view(B, H, Lq, Lk)
