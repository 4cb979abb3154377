"""Triton split-KV ("flash-decoding") attention forward for generation: a few query rows per
sequence (plain decode, Lq = 1, or speculative verification, Lq <= 16) against a long KV cache.

Math (per batch b, query head h, kv head hk = h // GROUP, GROUP = Hq // Hkv; natural-log units)
-----------------------------------------------------------------------------------------------
    n_b      = clamp(kv_lengths[b], 0, L)   valid keys of row b; keys j >= n_b are padding of a
               static cache (never read: they may hold anything, NaN included)
    pos_i    = n_b - Lq + i                 query row i (0..Lq-1) sits at the end of the valid keys
               (causal, bottom-right aligned within the valid length)
    visible  = 0 <= j <= pos_i              (which implies j < n_b)
               and key_padding[b, j]        (with key_padding, [B, L] bool: True = may be attended;
                                             e.g. HF's generate() attention_mask padded to L, left
                                             padding included)
    s_ij     = scale * q_i . k_j - slope_h * (pos_i - j)      (ALiBi term only with alibi_slopes;
               scale = 1 / sqrt(D) unless given)
    out_i    = sum_{visible j} softmax_j(s_ij) v_j,  and out_i = 0 for a row that sees no key
               (n_b = 0, pos_i < 0, or every key j <= pos_i padded), never NaN.
Padded keys inside the valid length (key_padding False, j < n_b) are still read: as with a masked
SDPA, their k and v must be finite (those of pad tokens are); keys j >= n_b are never read.
Softmax in fp32 and base 2: scores are pre-multiplied by log2(e) (folded into the scale, and into
the ALiBi slope) and exponentiated with exp2, as in fusionpass.kernels.attention.

Split / combine structure
-------------------------
Kernel 1 (`_split_kernel`), grid (num_splits, B * Hkv * row_blocks): program (s, b, hk) takes one
kv head and ALL the query rows that read it, GROUP heads x Lq rows = one [BLOCK_M, D] tile
(GROUP * Lq padded to a power of two >= 16 for tl.dot; past _MAX_ROWS rows the group is cut into
row blocks), so a K/V element is read once per split instead of once per query head. Split s owns
the keys [s * chunk, (s + 1) * chunk) (chunk a multiple of BLOCK_N) and walks them BLOCK_N at a
time with an online softmax, stopping at n_b: the part of the chunk past the valid length is never
loaded, and a split that starts at or past n_b does nothing and stores nothing. Key blocks every
row sees whole (j <= n_b - Lq) run without causal/length masks; the rest (the causal corner of the
last Lq - 1 keys, the partial block at n_b) are masked. With key_padding (HAS_KPM) each key block
also loads its BLOCK_N padding flags and sets the scores of padded keys to -inf, in both ranges; a
split whose keys are all padded then stores the "nothing visible" marker below (lse -inf, o 0).
It writes fp32 partials, normalized within the split:
    o_part[b, h, i, s, :] = sum_{visible j in split} exp2(s2_ij - lse2_is) v_j
    lse_part[b, h, i, s]  = log2 sum_{visible j in split} exp2(s2_ij)   (-inf: nothing visible)
with s2 = s * log2(e) (base 2; these buffers are internal, unlike fusionpass.kernels.attention's natural-log lse
and its EMPTY_LSE convention). Kernel 2 (`_combine_kernel`), one program per (b, h, i), reads
only the splits that stored something (s < cdiv(n_b, chunk)) and combines them with
max-subtracted weights:
    M = max_s lse_part,  w_s = exp2(lse_part_s - M)  (0 for an empty split),
    out = sum_s w_s o_part_s / sum_s w_s             (0 where every split is empty)
written in q's dtype. No atomics: each partial has one writer.

CUDA graphs: the launch does no host sync and reads no device value on the host (no .item()); the
grids, num_splits and the chunk depend only on the shapes (B, Hkv, L, Lq, GROUP, D) and the SM
count. kv_lengths and key_padding are read only inside the kernels, so one captured graph serves
every step of a static cache whose lengths and padding change in place.

Layouts: q [B, Hq, Lq, D], k [B, Hkv, L, D] and v [B, Hkv, L, Dv] (Dv = D but for MLA's 192 / 128;
a head dim that is not a power of two is padded to one in registers, masked on load and store),
each with any strides (the [B, L, Hkv, D]
cache layout passed as `.transpose(1, 2)` needs no copy); key_padding [B, L] bool, any strides,
passed to Triton as is (an i1 pointer: no dtype view, which would break Inductor's lowering of a
triton_op). Partials: [B, Hq, Lq, num_splits, Dv] and
[B, Hq, Lq, num_splits] fp32, contiguous. out: [B, Hq, Lq, Dv] contiguous, q's dtype.

Both kernels run compiled on CUDA and unchanged under TRITON_INTERPRET=1 on CPU tensors (there,
tiles are converted to fp32 after each load and rounding to bf16 is done explicitly; see
common._round / common._for_store).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from fusionpass.kernels.attention import check_qkv
# _LOG2E from the attention blocks, not a copy: Inductor emits one value per global name for a
# kernel and the helpers it calls, so two definitions could disagree on the GPU only
from fusionpass.kernels.attention.blocks import _LOG2E, _load_kv, _mm_operand
from fusionpass.kernels.attention.blocks import _softmax_step
from fusionpass.kernels.common import (
    _cuda_props,
    _device_guard,
    _for_store,
)
from fusionpass.kernels.launch import absent, launcher

__all__ = ["HEAD_DIMS", "MAX_Q_LEN", "decode_attention", "default_num_splits"]

# q/k and v head dims, any pair (MLA: 192 / 128); dims that are not powers of two are padded
# in registers and masked on load and store
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
MAX_Q_LEN = 16

# Launch defaults by the larger padded head dim: (BLOCK_N keys per step, num_warps, num_stages) of
# the split kernel.
# First guesses, not tuned (benchmarks/probes/decode_attention_kernel.py, in git history as of 67836ab, sweeps them).
_CFG = {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 4, 2)}
_COMBINE_WARPS = 4
_SPLIT_TILE = 16          # splits per step of the combine kernel
_MAX_ROWS = 128           # query rows (GROUP * Lq) per split program; more are cut into row blocks
# Split rule (see default_num_splits).
_WAVES = 2                # programs per SM the split grid aims at
_MIN_BLOCKS_PER_SPLIT = 4  # a chunk is at least this many BLOCK_N steps
_CPU_SMS = 132            # SM count assumed off CUDA (an H100/H200), so CPU runs plan as the GPU does


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------
@triton.jit
def _steps(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, kp_base, skpl, start, end, pos, slope2,
           offs_n, offs_dk, offs_dv, kv_end, qk_scale,
           ALIBI: tl.constexpr, MASKED: tl.constexpr, HAS_KPM: tl.constexpr, DT: tl.constexpr,
           INTERP: tl.constexpr, PREC: tl.constexpr, BLOCK_N: tl.constexpr,
           DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Online softmax over the keys [start, end) in BLOCK_N steps (start a multiple of BLOCK_N).
    K/V tiles come from fusionpass.kernels.attention.blocks._load_kv: keys at or past kv_end read as 0 in MASKED blocks
    (a static cache's padding may hold NaN), and the head dims padded to a power of two read as 0."""
    dk_ok = offs_dk < DK
    dv_ok = offs_dv < DV
    # rows may see nothing yet (all keys so far masked or padded): see _softmax_step
    GUARD: tl.constexpr = MASKED or HAS_KPM
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        k = _load_kv(k_base + cols[:, None] * skn + offs_dk[None, :] * skd, cols, kv_end, dk_ok, MASKED,
                     DK == BLOCK_DK, INTERP)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        if ALIBI:
            s = s - slope2[:, None] * (pos[:, None] - cols[None, :]).to(tl.float32)
        if HAS_KPM:
            # padding flags of the block (i1 loads as 0/1; keys at or past kv_end read as padded)
            if MASKED:
                keep = tl.load(kp_base + cols * skpl, mask=cols < kv_end, other=0) != 0
            else:
                keep = tl.load(kp_base + cols * skpl) != 0
        if MASKED:
            # j <= pos_i also keeps j < kv_end (pos_i <= kv_end - 1 for every row, padded ones too)
            vis = cols[None, :] <= pos[:, None]
            if HAS_KPM:
                vis = vis & keep[None, :]
            s = tl.where(vis, s, float("-inf"))
        elif HAS_KPM:
            s = tl.where(keep[None, :], s, float("-inf"))
        p, alpha, l_i, m_new = _softmax_step(s, m_i, l_i, GUARD)
        v = _load_kv(v_base + cols[:, None] * svn + offs_dv[None, :] * svd, cols, kv_end, dv_ok, MASKED,
                     DV == BLOCK_DV, INTERP)
        acc = acc * alpha[:, None] + tl.dot(_mm_operand(p, DT, INTERP), v, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["L", "chunk"])
def _split_kernel(
    Q, K, V, OP, LSEP, KVLEN, SLOPES, KPM,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, skpb, skpl,
    Hkv, L, chunk, num_splits, row_blocks, qk_scale,
    GROUP: tl.constexpr, LQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ALIBI: tl.constexpr, HAS_KPM: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
):
    DT: tl.constexpr = Q.dtype.element_ty
    ROWS: tl.constexpr = GROUP * LQ
    # torch.compile passes Python floats as fp64 scalars; the math is fp32, in base 2.
    qk_scale = tl.cast(qk_scale, tl.float32) * _LOG2E
    split = tl.program_id(0)
    pid = tl.program_id(1)
    rb = pid % row_blocks
    bhk = pid // row_blocks
    b = bhk // Hkv
    hk = bhk % Hkv

    # rows r of the tile: query head hk * GROUP + r // LQ, query row r % LQ
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < ROWS
    h = hk * GROUP + rows // LQ
    qi = rows % LQ
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    kv_end = tl.maximum(tl.minimum(tl.load(KVLEN + b), L), 0).to(tl.int32)
    pos = kv_end - LQ + qi

    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * sqb + h[:, None].to(tl.int64) * sqh + qi[:, None] * sqm + offs_dk[None, :] * sqd,
                mask=row_ok[:, None] & (offs_dk < DK)[None, :], other=0.0)
    if INTERP:
        q = q.to(tl.float32)
    k_base = K + b64 * skb + hk.to(tl.int64) * skh
    v_base = V + b64 * svb + hk.to(tl.int64) * svh
    kp_base = KPM + b64 * skpb  # key_padding row b (bool, True = may be attended); unused without HAS_KPM
    if ALIBI:
        slope2 = tl.load(SLOPES + h, mask=row_ok, other=0.0) * _LOG2E
    else:
        slope2 = None

    # this split's keys: [lo, hi), cut at the valid length; [lo, mid) is seen whole by every row
    # (j <= kv_end - LQ, the first row's position), [mid, hi) needs element masks
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)
    full = tl.maximum(kv_end - LQ + 1, 0) // BLOCK_N * BLOCK_N
    mid = tl.maximum(tl.minimum(full, hi), lo)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _steps(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, kp_base, skpl, lo, mid,
                           pos, slope2, offs_n, offs_dk, offs_dv, kv_end, qk_scale,
                           ALIBI, False, HAS_KPM, DT, INTERP, PREC, BLOCK_N, DK, DV, BLOCK_DK, BLOCK_DV)
    acc, l_i, m_i = _steps(acc, l_i, m_i, q, k_base, v_base, skn, skd, svn, svd, kp_base, skpl, mid, hi,
                           pos, slope2, offs_n, offs_dk, offs_dv, kv_end, qk_scale,
                           ALIBI, True, HAS_KPM, DT, INTERP, PREC, BLOCK_N, DK, DV, BLOCK_DK, BLOCK_DV)

    # (a row with a visible key has l >= 1: its maximum contributes exp2(0)); a row whose keys in
    # this split are all masked or padded has l = 0, acc = 0: it stores o = 0, lse = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    # row (b * Hq + h) * LQ + qi of the [B, Hq, LQ] rows; a split past the valid length stores nothing
    grow = bhk.to(tl.int64) * ROWS + rows
    ok = row_ok & (lo < kv_end)
    tl.store(OP + (grow * num_splits + split)[:, None] * DV + offs_dv[None, :], o,
             mask=ok[:, None] & (offs_dv < DV)[None, :])
    tl.store(LSEP + grow * num_splits + split, lse2, mask=ok)


@triton.jit(do_not_specialize=["L", "chunk"])
def _combine_kernel(
    OP, LSEP, O, KVLEN, Hq, L, chunk, num_splits,
    LQ: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr, SPLIT_TILE: tl.constexpr,
    INTERP: tl.constexpr,
):
    row = tl.program_id(0)  # (b * Hq + h) * LQ + i
    b = row // (Hq * LQ)
    kv_end = tl.maximum(tl.minimum(tl.load(KVLEN + b), L), 0).to(tl.int32)
    # the splits that stored partials (see _split_kernel)
    n_act = tl.minimum((kv_end + chunk - 1) // chunk, num_splits)
    base = row.to(tl.int64) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(LSEP + base + offs_s, mask=offs_s < n_act, other=float("-inf"))
    m = tl.max(lse, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    den = tl.sum(tl.math.exp2(lse - m_use), 0)

    offs_t = tl.arange(0, SPLIT_TILE)
    offs_d = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < DV
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, n_act, SPLIT_TILE):
        s = s0 + offs_t
        s_ok = s < n_act
        w = tl.math.exp2(tl.load(LSEP + base + s, mask=s_ok, other=float("-inf")) - m_use)
        o = tl.load(OP + (base + s)[:, None] * DV + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    out = acc / tl.where(den > 0.0, den, 1.0)  # den = 0: every split empty, acc = 0
    OUT_DT: tl.constexpr = O.dtype.element_ty
    tl.store(O + row.to(tl.int64) * DV + offs_d, _for_store(out, OUT_DT, INTERP), mask=d_ok)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_props(device.index if device.index is not None else torch.cuda.current_device())[0]
    return _CPU_SMS


def default_num_splits(B: int, Hkv: int, L: int, block_n: int, sms: int, row_blocks: int = 1) -> int:
    """Number of key splits of a cache of length L, from static shapes only.

    Decode attention is a read of the whole KV cache; B * Hkv programs alone leave most SMs idle
    (B=1, Hkv=8 is 8 programs on 132 SMs). Cutting the keys into splits gives B * Hkv * num_splits
    programs; aim at _WAVES (2) programs per SM so each SM has loads of two programs in flight,
    but keep every chunk at least _MIN_BLOCKS_PER_SPLIT BLOCK_N steps long (more splits on short
    caches only add combine traffic). The chunk is then rounded up to a multiple of BLOCK_N, and
    the count recomputed so that no split is empty at full length. It depends on shapes and the
    SM count only, never on kv_lengths: the grid stays fixed for a cache shape (CUDA graphs)."""
    if L <= 0:
        return 1
    programs = max(1, B * Hkv * row_blocks)
    want = triton.cdiv(_WAVES * sms, programs)
    most = max(1, L // (_MIN_BLOCKS_PER_SPLIT * block_n))
    n = min(want, most)
    chunk = triton.cdiv(triton.cdiv(L, n), block_n) * block_n
    return triton.cdiv(L, chunk)


def _check(q, k, v, kv_lengths, alibi_slopes, key_padding):
    B, Hq, _, Lq, L, _ = check_qkv(q, k, v, HEAD_DIMS, value_dims=HEAD_DIMS)
    if not 1 <= Lq <= MAX_Q_LEN:
        raise ValueError(f"query length {Lq} not supported (1..{MAX_Q_LEN}; use attention_fwd for prefill)")
    dev = q.device
    if (not isinstance(kv_lengths, torch.Tensor) or kv_lengths.shape != (B,)
            or kv_lengths.dtype not in (torch.int32, torch.int64) or kv_lengths.device != dev):
        raise ValueError(f"kv_lengths must be an int32/int64 tensor of shape [{B}] on the inputs' device")
    if alibi_slopes is not None and (
            not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.shape != (Hq,)
            or not alibi_slopes.is_floating_point() or alibi_slopes.device != dev):
        raise ValueError(f"alibi_slopes must be a float tensor of shape [{Hq}] on the inputs' device")
    if key_padding is not None:
        if not isinstance(key_padding, torch.Tensor) or key_padding.shape != (B, L):
            shape = tuple(key_padding.shape) if isinstance(key_padding, torch.Tensor) else type(key_padding).__name__
            raise ValueError(f"key_padding must be a bool tensor of shape [B, L] = [{B}, {L}], got {shape}")
        if key_padding.dtype != torch.bool:
            raise ValueError(f"key_padding must be a torch.bool tensor (True = key may be attended), "
                             f"got {key_padding.dtype}")
        if key_padding.device != dev:
            raise ValueError(f"key_padding must be on the inputs' device {dev}, got {key_padding.device}")


def _positive(value, default, what, power_of_two=False):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1, got {value!r}")
    if power_of_two and (value < 16 or value & (value - 1)):
        raise ValueError(f"{what} must be a power of two >= 16, got {value}")
    return value


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lengths: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    key_padding: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Split-KV attention of Lq <= 16 new query rows against a KV cache (see the module docstring).

    q [B, Hq, Lq, D]; k, v [B, Hkv, L, D], any strides (Hq % Hkv == 0: query head h reads kv head
    h // (Hq // Hkv)); one dtype of fp16/bf16/fp32; D in HEAD_DIMS. kv_lengths: int32/int64 [B] on
    the inputs' device, the valid keys of each row (clamped to [0, L]); query row i sits at
    position kv_lengths[b] - Lq + i and sees the keys at or before it. alibi_slopes: float [Hq],
    bias -slope_h * (pos_i - j). key_padding: bool [B, L] on the inputs' device, any strides, True =
    key j may be attended (ANDed with the causal/length rule; e.g. a generate() attention_mask
    padded to L, left padding included); padded keys below kv_lengths must hold finite k/v.
    v may have its own head dim Dv in HEAD_DIMS (MLA). Returns [B, Hq, Lq, Dv] contiguous in q's dtype;
    rows that see no key are 0. num_splits: key splits (default `default_num_splits`, fixed by the shapes);
    block_n / num_warps / num_stages override the split kernel's launch defaults (_CFG). Results
    do not depend on them beyond fp32 summation order.
    """
    _check(q, k, v, kv_lengths, alibi_slopes, key_padding)
    B, Hq, Lq, D = q.shape
    Hkv, L, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv
    block_dk, block_dv = triton.next_power_of_2(D), triton.next_power_of_2(Dv)
    bn, warps, stages = _CFG[max(block_dk, block_dv)]
    bn = _positive(block_n, bn, "block_n", power_of_two=True)
    warps = _positive(num_warps, warps, "num_warps")
    stages = _positive(num_stages, stages, "num_stages")
    out = torch.empty((B, Hq, Lq, Dv), dtype=q.dtype, device=q.device)
    if B * Hq == 0 or L == 0:
        return out.zero_()
    rows = group * Lq
    block_m = min(max(16, triton.next_power_of_2(rows)), _MAX_ROWS)
    row_blocks = triton.cdiv(rows, block_m)
    if num_splits is None:
        num_splits = default_num_splits(B, Hkv, L, bn, _sm_count(q.device), row_blocks)
    num_splits = _positive(num_splits, None, "num_splits")
    # a forced count above cdiv(L, bn) leaves the trailing splits empty; they store nothing
    chunk = triton.cdiv(triton.cdiv(L, num_splits), bn) * bn
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    slopes = alibi_slopes.to(torch.float32).contiguous() if alibi_slopes is not None else None
    kv_lengths = kv_lengths.contiguous()
    # the bool tensor goes to Triton as is (*i1); without it, any pointer stands in (never read)
    kpm = key_padding if key_padding is not None else absent(kv_lengths)
    skpb, skpl = key_padding.stride() if key_padding is not None else (0, 0)
    o_part = torch.empty((B, Hq, Lq, num_splits, Dv), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, Hq, Lq, num_splits), dtype=torch.float32, device=q.device)
    interp = q.device.type != "cuda"
    with _device_guard(q.device):
        launcher(_split_kernel, q)[(num_splits, B * Hkv * row_blocks)](
            q, k, v, o_part, lse_part, kv_lengths, slopes if slopes is not None else absent(o_part), kpm,
            *q.stride(), *k.stride(), *v.stride(), skpb, skpl,
            Hkv, L, chunk, num_splits, row_blocks, scale,
            GROUP=group, LQ=Lq, DK=D, DV=Dv, BLOCK_DK=block_dk, BLOCK_DV=block_dv, BLOCK_M=block_m,
            BLOCK_N=bn, ALIBI=slopes is not None,
            HAS_KPM=key_padding is not None, INTERP=interp, PREC="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=warps, num_stages=stages)
        launcher(_combine_kernel, q)[(B * Hq * Lq,)](
            o_part, lse_part, out, kv_lengths, Hq, L, chunk, num_splits,
            LQ=Lq, DV=Dv, BLOCK_DV=block_dv, BLOCK_S=triton.next_power_of_2(num_splits), SPLIT_TILE=_SPLIT_TILE,
            INTERP=interp,
            num_warps=_COMBINE_WARPS)
    return out
