"""What every attention kernel shares (fusionpass.kernels.attention says the math): constants, and
jitted helpers for loads, scores and their masks, the key and query ranges a block visits, packed
sequences, ALiBi and the dropout row counter. The decode kernel (fusionpass.fusions.decode_attention.kernels)
uses them too."""
from __future__ import annotations

import triton
import triton.language as tl

from fusionpass.kernels.common import _round
from fusionpass.kernels.rng import RNG_ARGS as _RNG_ARGS
from fusionpass.kernels.rng import keep_mask16
from fusionpass.kernels.tanh import tanh

# lse of a query row that sees no key (see fusionpass.kernels.attention's docstring).
EMPTY_LSE = 1e30
_EMPTY = tl.constexpr(EMPTY_LSE)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_NO_SPEC = ["Lq", "Lk", "window", "diag", *_RNG_ARGS]
# Keys per Philox call: 4 output words of two 16-bit halves each (see the module docstring).
_RNG16_GROUP = 8


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
def _scale_and_cap(qk_scale, softcap, SOFTCAP: tl.constexpr):
    """(the factor of the q . k products, cap2) for `_raw_scores` from the host's scale and softcap:
    scale * log2(e) and unused, or with SOFTCAP scale / c and c * log2(e)."""
    scale = tl.cast(qk_scale, tl.float32)
    if SOFTCAP:
        cap = tl.cast(softcap, tl.float32)
        factor = scale / cap
        cap2 = cap * _LOG2E
    else:
        factor = scale * _LOG2E
        cap2 = scale * 0.0
    return factor, cap2


@triton.jit
def _raw_scores(x, factor, cap2, SOFTCAP: tl.constexpr):
    """(base-2 scores, t) of the products x = q . k before any bias or mask: x * factor, or with
    SOFTCAP the soft-capped c * tanh(scale * x / c) (Gemma-2's attn_logit_softcapping) and
    t = tanh(scale * x / c), whose derivative 1 - t^2 the backward multiplies dS by (t is x
    without SOFTCAP, unused)."""
    if SOFTCAP:
        t = tanh(x * factor)
        s = t * cap2
    else:
        t = x
        s = x * factor
    return s, t


@triton.jit
def _capped_ds(ds, t, SOFTCAP: tl.constexpr):
    """dS with respect to the products' scaled values: through the cap's tanh with SOFTCAP."""
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return ds


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


@triton.jit
def _masked_scores(q, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn, cols, pos, offs_d, d_ok,
                   kv_end, window, qk_scale, cap2, slope2, seg_base, seg_q,
                   CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, ALIBI: tl.constexpr, ALIBI_SYM: tl.constexpr,
                   HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_SEG: tl.constexpr, SOFTCAP: tl.constexpr,
                   MASKED: tl.constexpr, EVEN_D: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
                   V_FIRST: tl.constexpr):
    """One key block of a query block's loop (forward and dQ): (scores in base 2 with every mask and
    bias applied, the soft cap's tanh, the key tile, the value tile where V_FIRST).
    The key bias is issued before the K tile: its load is not waited for after the dot. V_FIRST
    loads V right after K, before the scores (dQ needs it at once for dP); the forward loads it
    after its softmax step."""
    kb = _key_bias(kb_base, skbn, cols, kv_end, HAS_KB, MASKED)
    k = _load_kv(k_base + cols[:, None] * skn + offs_d[None, :] * skd, cols, kv_end, d_ok, MASKED, EVEN_D, INTERP)
    if V_FIRST:
        v = _load_kv(v_base + cols[:, None] * svn + offs_d[None, :] * svd, cols, kv_end, d_ok, MASKED, EVEN_D, INTERP)
    else:
        v = k  # a placeholder the caller ignores (a jitted function returns tensors, not None)
    s, t_cap = _raw_scores(tl.dot(q, tl.trans(k), input_precision=PREC), qk_scale, cap2, SOFTCAP)
    keep = _key_block_kept(kp_base, skpn, seg_base, seg_q, cols, kv_end, HAS_KPM, HAS_SEG)
    s = _scores(s, pos[:, None], cols[None, :], kv_end, window, slope2, keep,
                kb[None, :] if HAS_KB else None, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM or HAS_SEG, HAS_KB,
                MASKED)
    return s, t_cap, k, v


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
def _key_steps(acc, l_i, m_i, q, do, lse2, delta, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
               start, end, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, cap2, slope2, drop_scale,
               drop_rows, k0, k1, o0, o1, thr, seg_base, seg_q,
               CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, ALIBI: tl.constexpr, ALIBI_SYM: tl.constexpr,
               HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
               SOFTCAP: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, DT: tl.constexpr,
               INTERP: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DQ: tl.constexpr):
    """A query block's loop over the key blocks start..end (MASKED: a block may hold invisible
    entries). The forward: the online softmax of the scores into acc (unnormalized out), the row
    sums l_i and maxima m_i. DQ: dS from the forward's lse2 and delta and the block's dP, summed
    into acc as dq; l_i and m_i pass through, and `do`, `lse2`, `delta` and `drop_scale` are read
    only there (the forward passes placeholders)."""
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        s, t_cap, k, v = _masked_scores(
            q, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn, cols, pos, offs_d, d_ok, kv_end,
            window, qk_scale, cap2, slope2, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB,
            HAS_SEG, SOFTCAP, MASKED, EVEN_D, INTERP, PREC, DQ)
        if DQ:
            p = tl.math.exp2(s - lse2[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            if DROPOUT:
                keep = keep_mask16(k0, k1, o0, o1, thr, drop_rows, n0, BLOCK_M, BLOCK_N)
                dp = tl.where(keep, dp * drop_scale, 0.0)
            ds = _capped_ds(p * (dp - delta[:, None]), t_cap, SOFTCAP)
            acc += tl.dot(_mm_operand(ds, DT, INTERP), k, input_precision=PREC)
        else:
            # (a row may see nothing in a block of other sequences' keys)
            p, alpha, l_i, m_new = _softmax_step(s, m_i, l_i, MASKED or HAS_KPM or HAS_SEG)
            if DROPOUT:
                keep = keep_mask16(k0, k1, o0, o1, thr, drop_rows, n0, BLOCK_M, BLOCK_N)
                p = tl.where(keep, p, 0.0)
            v = _load_kv(v_base + cols[:, None] * svn + offs_d[None, :] * svd, cols, kv_end, d_ok, MASKED, EVEN_D,
                         INTERP)
            acc = acc * alpha[:, None] + tl.dot(_mm_operand(p, DT, INTERP), v, input_precision=PREC)
            m_i = m_new
    return acc, l_i, m_i
