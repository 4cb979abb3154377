"""The attention kernels' host side: input checks, the launch tables, the forward and backward
launches, and attention dropout's constants and keep mask (for tests)."""
from __future__ import annotations

import math
import struct

import torch
import triton

from fusionpass.kernels import rope as rope_kernels
from fusionpass.kernels.attention.backward import _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_pre_kernel
from fusionpass.kernels.attention.blocks import _RNG16_GROUP
from fusionpass.kernels.attention.forward import _fwd_kernel
from fusionpass.kernels.common import _TILE, _device_guard
from fusionpass.kernels.launch import absent, launcher
from fusionpass.kernels.rng import fill_keep_mask as _fill_keep_mask
from fusionpass.kernels.rng import rng_args as _rng_args

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

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



class _Opts:
    """Checked options shared by the forward and the backward (attributes set by `check_options`)."""


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


def check_options(
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
    skip_batches: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> _Opts:
    """The options `attention_fwd` and `attention_bwd` share (the forward's and the backward's
    `**options`), checked: ValueError on a bad one, TypeError on an unknown one.

    `window` (with causal only): key j is visible to query i iff pos_i - window < j <= pos_i.
    `alibi_slopes` [Hq] float: bias -slope * (pos_i - j) (|pos_i - j| with `alibi_symmetric`).
    `key_padding` [B, Lk] bool (True = keep) and/or `kv_lengths` [B] int32 (keys >= length are
    masked). `key_bias`: float, broadcastable as [B, Hq, Lk], any strides (no gradient is computed
    for it). `dropout_p` > 0 needs `seed` (int, or a one-element int64 tensor on the inputs'
    device) and takes `offset`. `align`: "top_left" (pos_i = i, SDPA's is_causal) or
    "bottom_right" (pos_i = i + Lk - Lq); `diagonal` (with causal) moves the diagonal by that many
    keys more (pos_i = i + diagonal top-left): with a window of 2w + 1 and diagonal w, a
    bidirectional band |i - j| <= w (ModernBERT's local layers). `segments` [B, L] integer,
    Lq == Lk == L, each row nondecreasing: key j is visible to query i only where
    segments[b, i] == segments[b, j] (packed sequences); the kernels skip the key blocks before each
    query block's first sequence and the query blocks past each key block's last.
    `skip_batches` [B] bool: the batch rows another kernel computes; nothing of theirs is read or
    written, so the outputs given with it keep that kernel's values there
    (fusionpass::padded_attention).
    `softcap` c > 0: the scaled scores are soft-capped, c * tanh(scale * q . k / c), before any
    bias or mask (Gemma-2's attn_logit_softcapping); 0 = none.
    """
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, v)
    dev = q.device
    o = _Opts()
    o.B, o.Hq, o.Hkv, o.Lq, o.Lk, o.D, o.group = B, Hq, Hkv, Lq, Lk, D, Hq // Hkv
    o.scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not (0.0 <= softcap < math.inf):
        raise ValueError(f"softcap must be a finite number >= 0 (0: no capping), got {softcap!r}")
    o.softcap = float(softcap)
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
    o.skips = skip_batches is not None
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
            "DROPOUT": o.dropout, "SOFTCAP": o.softcap > 0.0, "SEED_PTR": o.rng[0] is not None,
            "INTERP": o.interp, "PREC": o.prec}


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
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    rope: tuple | None = None,
    sinks: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward (fusionpass.kernels.attention says the math). Returns (out, lse).

    q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (Hq % Hkv == 0; query head h reads kv head h // (Hq // Hkv)),
    any strides, one dtype of fp16/bf16/fp32, D in HEAD_DIMS. options: `check_options`' (causal,
    scale, window, ALiBi, key padding and bias, kv lengths, dropout, alignment, packed segments and
    skipped batch rows).
    out: [B, Hq, Lq, D] in q's dtype, contiguous, or written into `out` (any [B, Hq, Lq, D] view of
    q's dtype, e.g. a transpose of a [B, Lq, Hq, D] buffer). lse: [B, Hq, Lq] fp32, natural log of
    the softmax denominator of the scaled, biased scores; EMPTY_LSE for rows that see no key.
    `lse`: a [B, Hq, Lq] fp32 contiguous tensor to write lse into (both given with skip_batches).
    rope: (cos, sin, form, rotary_dim): q is rotated as it is loaded (`_rope_q`; the rotated q is
    never written), `q * cos + rot(q) * sin` of fusionpass.kernels.rope with form "rotate_half" or
    "interleaved"; cos/sin 4-d, last dim rotary_dim, broadcastable to [B, Hq, Lq, rotary_dim].
    sinks: [Hq] float, a logit per query head that joins every row's softmax denominator and
    brings no value (gpt-oss's attention sinks): lse includes it, so `attention_bwd` needs no
    argument for it (the gradient of the sinks is -sum over rows of exp(sink - lse) * rowsum(dout
    * out), which the caller forms); a row that sees no key gets out 0 and lse the sink.
    block_m/block_n/num_warps/num_stages override the launch defaults (_FWD_CFG); results do not
    depend on them beyond fp32 summation order.
    """
    o = check_options(q, k, v, **options)
    B, Hq, Lq, D = o.B, o.Hq, o.Lq, o.D
    if sinks is not None:
        if sinks.shape != (Hq,) or not sinks.is_floating_point() or sinks.device != q.device:
            raise ValueError(f"sinks must be a float tensor of shape [{Hq}] on q's device")
        sinks = sinks.detach().to(torch.float32).contiguous()
    if o.skips and (out is None or lse is None):
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
            q, k, v, out, lse, *ptrs, *rope_ptrs, sinks if sinks is not None else absent(q),
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *aux_strides, *rope_strides,
            Hq, Lq, o.Lk, o.group, num_m, o.scale, o.window or 0, o.diag, float(drop_scale), o.softcap,
            lo, hi, olo, ohi, thr,
            **_flags(o), **rope_flags, HAS_SINKS=sinks is not None, BLOCK_M=bm, BLOCK_N=bn,
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
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dq_block_m: int | None = None,
    dq_block_n: int | None = None,
    dq_num_warps: int | None = None,
    dq_num_stages: int | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `attention_fwd` (same options; out and lse are its outputs, do the gradient of
    out, any strides). Returns (dq, dk, dv) in the inputs' dtype, shaped as q, k, v and, where those
    are dense, with their strides. block_m/block_n/num_warps/num_stages: the dK/dV kernel (block_n
    keys per program, block_m query rows per step; defaults _DKDV_CFG); dq_*: the dQ kernel
    (dq_block_m query rows per program, dq_block_n keys per step; defaults _DQ_CFG).
    `grads`: (dq, dk, dv) tensors shaped as q, k, v to write into; with `skip_batches` (as
    attention_fwd's) they keep another kernel's gradients in the skipped batch rows.
    """
    o = check_options(q, k, v, **options)
    B, Hq, Hkv, Lq, Lk, D = o.B, o.Hq, o.Hkv, o.Lq, o.Lk, o.D
    for t, name in ((do, "do"), (out, "out")):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q in shape, dtype and device")
    if lse.shape != (B, Hq, Lq) or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be a float32 tensor of shape [{B}, {Hq}, {Lq}] on q's device")
    lse = lse.contiguous()
    if grads is None:
        if o.skips:
            raise ValueError("skip_batches needs grads: the skipped rows keep what they hold")
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    elif any(g.shape != t.shape or g.dtype != t.dtype or g.device != t.device for g, t in zip(grads, (q, k, v))):
        raise ValueError("grads must be three tensors shaped as q, k and v, in their dtype and device")
    dq, dk, dv = grads
    if B * Hq * Lq == 0 or Lk == 0:
        if o.skips:
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
            Hq, Hkv, Lq, Lk, o.group, num_n, o.scale, o.window or 0, o.diag, float(drop_scale), o.softcap, *rng,
            **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=num_warps or warps, num_stages=num_stages or _stages(stages, q))

        bm, bn, warps, stages = _DQ_CFG[pad_d]
        bm = _block(dq_block_m, bm, "dq_block_m")
        bn = _block(dq_block_n, bn, "dq_block_n")
        num_m = triton.cdiv(Lq, bm)
        launcher(_bwd_dq_kernel, q)[(num_m * B * Hq,)](
            q, k, v, do, lse, delta, q_end, dq, *ptrs,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), *aux_strides,
            Hq, Lq, Lk, o.group, num_m, o.scale, o.window or 0, o.diag, float(drop_scale), o.softcap, *rng,
            **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=dq_num_warps or warps,
            num_stages=dq_num_stages or _stages(stages, q))
    return dq, dk, dv


def attention_sinks_grad(do: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of `attention_fwd`'s sinks [Hq]: the sink's probability in each row,
    exp(sink - lse), times its dP - D with dP = 0 (it brings no value) and D = rowsum(dout * out),
    summed over the batch and the rows; in the sinks' dtype (with dropout too: D = rowsum(dout *
    out) is the sum of P Z dP over the kept values either way)."""
    delta = (do.float() * out.float()).sum(-1)
    p_sink = torch.exp(sinks.float()[None, :, None] - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


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
