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
mirror `philox_keep16` (fusionpass.kernels.rng, the CPU reference) see the same bits.
Rows repeat only past 2**32 query rows per call (B * Hq * Lq), far beyond any tensor that fits.
As with layer_norm: pass a fresh seed per call (a one-element int64 tensor inside traced code) or
distinct offsets, and do not share a (seed, offset) pair between an attention and a layer_norm
dropout (they read the same Philox outputs, so their masks are correlated).

Layouts: q [B, Hq, Lq, D], k and v [B, Hkv, Lk, D] with any strides (passed to the kernels; the
transposes of [B, L, H, D] tensors that HF models produce need no copy). out is [B, Hq, Lq, D]
contiguous, or any [B, Hq, Lq, D] view passed as `out` (e.g. `torch.empty(B, Lq, Hq, D)
.transpose(1, 2)` for token-major output). lse is [B, Hq, Lq] fp32 contiguous. dq/dk/dv have the
inputs' dtype and, where the input is dense, its strides (`torch.empty_like`).

Files, by job: `blocks` (constants and the jitted helpers every attention kernel shares, also the
decode kernel), `forward` and `backward` (the kernels), `host` (checks, launch tables, launches,
the dropout constants and mask). This package's names are the host side's public ones.

Every kernel runs compiled on CUDA and unchanged under TRITON_INTERPRET=1 on CPU tensors (there,
tiles are converted to fp32 after each load, and rounding to bf16 is done explicitly; see
common._round). Launches take no host syncs and their grids depend on shapes only (CUDA graphs).
"""
from __future__ import annotations

from fusionpass.kernels.attention.blocks import EMPTY_LSE
from fusionpass.kernels.attention.host import (
    HEAD_DIMS,
    attention_bwd,
    attention_dropout_constants,
    attention_dropout_mask,
    attention_fwd,
    attention_sinks_grad,
    check_qkv,
)

__all__ = ["EMPTY_LSE", "HEAD_DIMS", "attention_bwd", "attention_dropout_constants", "attention_dropout_mask",
           "attention_fwd", "attention_sinks_grad", "check_qkv"]
