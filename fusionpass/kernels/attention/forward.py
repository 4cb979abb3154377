"""The attention forward kernel (fusionpass.kernels.attention says the math and the structure):
online softmax over the key blocks of each query block, with RoPE on q where asked."""
from __future__ import annotations

import triton
import triton.language as tl

from fusionpass.kernels.attention.blocks import (
    _alibi_slope2,
    _dropout_rows,
    _EMPTY,
    _key_ranges,
    _LN2,
    _LOG2E,
    _load,
    _key_steps,
    _mm_operand,
    _NO_SPEC,
    _query_block,
    _scale_and_cap,
    _segment_rows,
    _valid_keys,
)
from fusionpass.kernels.common import _for_store
from fusionpass.kernels.rng import rng_key
from fusionpass.kernels.rope import _pair_tiles, _rotate_pairs


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
    Q, K, V, O, LSE, SLOPES, KPM, KB, KVLEN, SEED, SEG, SEG_LO, SEG_HI, COS, SIN, SINKS,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod, skpb, skpn,
    skbb, skbh, skbn, scb, sch, scm, scd, ssb, ssh, ssm, ssd,
    Hq, Lq, Lk, GROUP, num_m, qk_scale, window, diag, drop_scale, softcap,
    seed_lo, seed_hi, off_lo, off_hi, thr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, ALIBI: tl.constexpr,
    ALIBI_SYM: tl.constexpr, HAS_KPM: tl.constexpr, HAS_KB: tl.constexpr, HAS_KVLEN: tl.constexpr,
    HAS_SEG: tl.constexpr,
    DROPOUT: tl.constexpr, SOFTCAP: tl.constexpr, SEED_PTR: tl.constexpr, INTERP: tl.constexpr,
    PREC: tl.constexpr, ROPE: tl.constexpr, ROT_DIM: tl.constexpr, ROPE_HALVES: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    DT: tl.constexpr = Q.dtype.element_ty
    EVEN_D: tl.constexpr = D == BLOCK_D
    # torch.compile passes Python floats as fp64 scalars; the math is fp32, in base 2.
    qk_scale, cap2 = _scale_and_cap(qk_scale, softcap, SOFTCAP)
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
        acc, l_i, m_i = _key_steps(
            acc, l_i, m_i, q, q, l_i, l_i, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
            lo, full_lo, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, cap2, slope2, 1.0, drop_rows, k0, k1,
            o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG, DROPOUT,
            SOFTCAP, True, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N, False)
    acc, l_i, m_i = _key_steps(
        acc, l_i, m_i, q, q, l_i, l_i, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
        full_lo, full_hi, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, cap2, slope2, 1.0, drop_rows, k0, k1,
        o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG, DROPOUT,
        SOFTCAP, False, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N, False)
    acc, l_i, m_i = _key_steps(
        acc, l_i, m_i, q, q, l_i, l_i, k_base, v_base, kp_base, kb_base, skn, skd, svn, svd, skpn, skbn,
        full_hi, hi, pos, offs_n, offs_d, d_ok, kv_end, window, qk_scale, cap2, slope2, 1.0, drop_rows, k0, k1,
        o0, o1, t, seg_base, seg_q, CAUSAL, WINDOWED, ALIBI, ALIBI_SYM, HAS_KPM, HAS_KB, HAS_SEG, DROPOUT,
        SOFTCAP, True, EVEN_D, DT, INTERP, PREC, BLOCK_M, BLOCK_N, False)

    if HAS_SINKS:
        # a logit per head that joins every row's softmax denominator and brings no value
        # (gpt-oss): a row that sees no key attends to its sink alone, out 0 and lse the sink
        sink2 = tl.load(SINKS + h) * _LOG2E
        m_new = tl.maximum(m_i, sink2)
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.math.exp2(sink2 - m_new)
        m_i = m_new
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

