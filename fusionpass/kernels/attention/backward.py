"""The attention backward kernels (fusionpass.kernels.attention says the math and the structure):
D = rowsum(dout * out) and the live rows, then dK/dV per key block and dQ per query block."""
from __future__ import annotations

import triton
import triton.language as tl

from fusionpass.kernels.attention.blocks import (
    _alibi_slope2,
    _capped_ds,
    _diagonal_shift,
    _dropout_rows,
    _EMPTY,
    _kept,
    _key_bias,
    _key_steps,
    _key_ranges,
    _load,
    _LOG2E,
    _mm_operand,
    _NO_SPEC,
    _query_block,
    _query_ranges,
    _raw_scores,
    _scale_and_cap,
    _scores,
    _segment_rows,
    _valid_keys,
)
from fusionpass.kernels.common import _for_store
from fusionpass.kernels.rng import keep_mask16, rng_key


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
def _bwd_setup(sm_scale, softcap, drop_scale, SEED, seed_lo, seed_hi, off_lo, off_hi, thr, num_blocks, heads,
               SOFTCAP: tl.constexpr, SEED_PTR: tl.constexpr, DROPOUT: tl.constexpr):
    """What both backward kernels start with: the scales in fp32 (torch.compile passes Python floats
    as fp64 scalars), the dropout key, and this program's (block, batch x head, batch, head), its
    programs laid out as num_blocks blocks per head."""
    sm_scale = tl.cast(sm_scale, tl.float32)
    qk_scale, cap2 = _scale_and_cap(sm_scale, softcap, SOFTCAP)
    drop_scale = tl.cast(drop_scale, tl.float32)
    k0, k1, o0, o1, t = rng_key(SEED, seed_lo, seed_hi, off_lo, off_hi, thr, SEED_PTR, DROPOUT)
    pid = tl.program_id(0)
    bh = pid // num_blocks
    return sm_scale, qk_scale, cap2, drop_scale, k0, k1, o0, o1, t, pid % num_blocks, bh, bh // heads, bh % heads


@triton.jit
def _live_rows(lo, full_lo, full_hi, hi, q_end, BLOCK_M: tl.constexpr):
    """_query_ranges cut at q_end (rounded up to a block): the rows from q_end on have dout = 0,
    so dP = dS = 0 there and they add nothing to dk or dv (the rows past a padded batch's lengths,
    which a loss that ignores them gives no gradient)."""
    last = tl.minimum(hi, (q_end + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
    return tl.minimum(lo, last), tl.minimum(full_lo, last), tl.minimum(full_hi, last), last


@triton.jit
def _dkdv_steps(dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdom, sdod,
                start, end, n0, cols, kp, kb, offs_m, offs_d, d_ok, Lq, shift, kv_end, window, qk_scale, cap2, slope2,
                drop_scale, bh, k0, k1, o0, o1, thr, seg_base, seg_k,
                CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, ALIBI: tl.constexpr, ALIBI_SYM: tl.constexpr,
                HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_SEG: tl.constexpr, DROPOUT: tl.constexpr,
                SOFTCAP: tl.constexpr, MASKED: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
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
        sT, tT = _raw_scores(tl.dot(k, tl.trans(q), input_precision=PREC), qk_scale, cap2, SOFTCAP)
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
        dsT = _capped_ds(pT * (dpT - delta[None, :]), tT, SOFTCAP)
        dk += tl.dot(_mm_operand(dsT, DT, INTERP), q, input_precision=PREC)
    return dk, dv


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, QEND, DK, DV, SLOPES, KPM, KB, KVLEN, SEED, SEG, SEG_LO, SEG_HI,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
    sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd, skpb, skpn, skbb, skbh, skbn,
    Hq, Hkv, Lq, Lk, GROUP, num_n, sm_scale, window, diag, drop_scale, softcap,
    seed_lo, seed_hi, off_lo, off_hi, thr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, ALIBI: tl.constexpr,
    ALIBI_SYM: tl.constexpr, HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_KVLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, SEED_PTR: tl.constexpr, INTERP: tl.constexpr,
    PREC: tl.constexpr,
):
    DT: tl.constexpr = Q.dtype.element_ty
    sm_scale, qk_scale, cap2, drop_scale, k0, k1, o0, o1, t, pid_n, bhk, b, hk = _bwd_setup(
        sm_scale, softcap, drop_scale, SEED, seed_lo, seed_hi, off_lo, off_hi, thr, num_n, Hkv, SOFTCAP, SEED_PTR,
        DROPOUT)
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
                offs_m, offs_d, d_ok, Lq, shift, kv_end, window, qk_scale, cap2, slope2, drop_scale, bh,
                k0, k1, o0, o1, t, seg_base, seg_k, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
                DROPOUT, SOFTCAP, True, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdom, sdod, h_full_lo, h_full_hi, n0,
            cols, kp, kb,
            offs_m, offs_d, d_ok, Lq, shift, kv_end, window, qk_scale, cap2, slope2, drop_scale, bh,
            k0, k1, o0, o1, t, seg_base, seg_k, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
            DROPOUT, SOFTCAP, False, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
        dk, dv = _dkdv_steps(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, sqm, sqd, sdom, sdod, h_full_hi, h_hi, n0, cols,
            kp, kb,
            offs_m, offs_d, d_ok, Lq, shift, kv_end, window, qk_scale, cap2, slope2, drop_scale, bh,
            k0, k1, o0, o1, t, seg_base, seg_k, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
            DROPOUT, SOFTCAP, True, DT, INTERP, PREC, BLOCK_M, BLOCK_N)
    dk = dk * sm_scale
    GRAD_DT: tl.constexpr = DK.dtype.element_ty
    tl.store(DK + b64 * sdkb + hk64 * sdkh + cols[:, None] * sdkn + offs_d[None, :] * sdkd,
             _for_store(dk, GRAD_DT, INTERP), mask=kv_mask)
    tl.store(DV + b64 * sdvb + hk64 * sdvh + cols[:, None] * sdvn + offs_d[None, :] * sdvd,
             _for_store(dv, GRAD_DT, INTERP), mask=kv_mask)


@triton.jit(do_not_specialize=_NO_SPEC)
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, QEND, DQ, SLOPES, KPM, KB, KVLEN, SEED, SEG, SEG_LO, SEG_HI,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sdob, sdoh, sdom, sdod,
    sdqb, sdqh, sdqm, sdqd, skpb, skpn, skbb, skbh, skbn,
    Hq, Lq, Lk, GROUP, num_m, sm_scale, window, diag, drop_scale, softcap,
    seed_lo, seed_hi, off_lo, off_hi, thr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, ALIBI: tl.constexpr,
    ALIBI_SYM: tl.constexpr, HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_KVLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, SEED_PTR: tl.constexpr, INTERP: tl.constexpr,
    PREC: tl.constexpr,
):
    DT: tl.constexpr = Q.dtype.element_ty
    EVEN_D: tl.constexpr = D == BLOCK_D
    sm_scale, qk_scale, cap2, drop_scale, k0, k1, o0, o1, t, pid_m, bh, b, h = _bwd_setup(
        sm_scale, softcap, drop_scale, SEED, seed_lo, seed_hi, off_lo, off_hi, thr, num_m, Hq, SOFTCAP, SEED_PTR,
        DROPOUT)
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
        dq, _l, _m = _key_steps(
            dq, lse2, lse2, q, do, lse2, delta, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
            lo, full_lo, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, cap2, slope2, drop_scale, drop_rows,
            k0, k1, o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
            DROPOUT, SOFTCAP, True, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N, True)
    dq, _l, _m = _key_steps(
        dq, lse2, lse2, q, do, lse2, delta, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
        full_lo, full_hi, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, cap2, slope2, drop_scale, drop_rows,
        k0, k1, o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
        DROPOUT, SOFTCAP, False, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N, True)
    dq, _l, _m = _key_steps(
        dq, lse2, lse2, q, do, lse2, delta, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
        full_hi, hi, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, cap2, slope2, drop_scale, drop_rows,
        k0, k1, o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG,
        DROPOUT, SOFTCAP, True, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N, True)
    dq = dq * sm_scale
    GRAD_DT: tl.constexpr = DQ.dtype.element_ty
    tl.store(DQ + b64 * sdqb + h64 * sdqh + offs_m[:, None] * sdqm + offs_d[None, :] * sdqd,
             _for_store(dq, GRAD_DT, INTERP), mask=mask)

