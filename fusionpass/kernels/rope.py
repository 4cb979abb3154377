"""Rotary position embedding: one launch rotates q and k together.

For each row x (the head_dim vector of one batch, head and position) and each rotated pair (a, b),
    y_a = x_a * cos_a - x_b * sin_a
    y_b = x_b * cos_b + x_a * sin_b
which is `x * cos + rot(x) * sin` with
    rotate_half  (HF Llama, GPT-NeoX, Phi):  a = p, b = p + rotary_dim / 2   (rot = cat(-x2, x1))
    interleaved  (GPT-J rotate_every_two):   a = 2p, b = 2p + 1             (rot = stack(-x2, x1))
Channels from rotary_dim to head_dim are copied (partial rotary). The backward is the transpose of
the same linear map, the same kernel with BACKWARD set:
    dx_a = dy_a * cos_a + dy_b * sin_b
    dx_b = dy_b * cos_b - dy_a * sin_a
(for the cos/sin models write, equal on both channels of a pair, this is the rotation by -sin).

q and k are 4-d with any strides and their own leading sizes (GQA head counts, [B, H, S, D] or
[B, S, H, D]); cos/sin are 4-d, broadcastable to both (size-1 dims read with stride 0), last dim
rotary_dim, any dtype (math in fp32). Outputs have the input's layout (`empty_like`) and dtype.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fusionpass.kernels.common import _device_guard, _for_store
from fusionpass.kernels.launch import absent, launcher


@triton.jit
def _split_pairs(x):
    """[R, 2P] -> its even and odd channels as two [R, P] fp32 tiles."""
    return tl.split(tl.reshape(x.to(tl.float32), (x.shape[0], x.shape[1] // 2, 2)))


@triton.jit
def _pair_tiles(rows, stride, row_ok, HALF: tl.constexpr, BLOCK_P: tl.constexpr, INTERLEAVED: tl.constexpr,
                EVICT: tl.constexpr):
    """Channels a and b of each rotated pair p < HALF of the rows that start at pointers `rows` ([R]),
    as two [R, BLOCK_P] fp32 tiles: a = p, b = p + HALF (rotate_half), or a = 2p, b = 2p + 1
    (interleaved). Interleaved pairs are adjacent channels: one contiguous tile, split into even and
    odd channels in registers (stride-2 loads measured far slower than Inductor;
    benchmarks/results/latest/rope.md)."""
    if INTERLEAVED:
        c = tl.arange(0, 2 * BLOCK_P)
        mask = row_ok[:, None] & (c < 2 * HALF)[None, :]
        a, b = _split_pairs(tl.load(rows[:, None] + c[None, :] * stride, mask=mask, other=0.0, eviction_policy=EVICT))
    else:
        p = tl.arange(0, BLOCK_P)
        mask = row_ok[:, None] & (p < HALF)[None, :]
        a = tl.load(rows[:, None] + p[None, :] * stride, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        b = tl.load(rows[:, None] + (p + HALF)[None, :] * stride, mask=mask, other=0.0,
                    eviction_policy=EVICT).to(tl.float32)
    return a, b


@triton.jit
def _rotate_pairs(xa, xb, cos_a, cos_b, sin_a, sin_b, BACKWARD: tl.constexpr):
    """(y_a, y_b) of the rotation, or of its transpose with BACKWARD (see the module docstring)."""
    if BACKWARD:
        ya = xa * cos_a + xb * sin_b
        yb = xb * cos_b - xa * sin_a
    else:
        ya = xa * cos_a - xb * sin_a
        yb = xb * cos_b + xa * sin_b
    return ya, yb


@triton.jit
def _rope_rows(
    x_ptr, o_ptr, cos_ptr, sin_ptr, block, n_rows, A1, A2,
    sx0, sx1, sx2, sx3,
    so0, so1, so2, so3,
    sc0, sc1, sc2, sc3,
    ss0, ss1, ss2, ss3,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr, ROUND_BITS: tl.constexpr, WIDE: tl.constexpr, STREAM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    DT: tl.constexpr = o_ptr.dtype.element_ty
    HALF: tl.constexpr = ROT_DIM // 2
    # q/k are read once (evict first); cos/sin are re-read for every head (keep them in L2)
    X_EVICT: tl.constexpr = "evict_first" if STREAM else ""
    CS_EVICT: tl.constexpr = "evict_last" if STREAM else ""
    if WIDE:
        # element offsets can pass 2**31: 64-bit index math (else 32-bit, half the address work)
        rows = block.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    else:
        rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    i2 = rows % A2
    i1 = (rows // A2) % A1
    i0 = rows // (A2 * A1)
    x_row = i0 * sx0 + i1 * sx1 + i2 * sx2
    c_row = i0 * sc0 + i1 * sc1 + i2 * sc2
    s_row = i0 * ss0 + i1 * ss1 + i2 * ss2
    o_row = i0 * so0 + i1 * so1 + i2 * so2

    xa, xb = _pair_tiles(x_ptr + x_row, sx3, row_ok, HALF, BLOCK_P, INTERLEAVED, X_EVICT)
    cos_a, cos_b = _pair_tiles(cos_ptr + c_row, sc3, row_ok, HALF, BLOCK_P, INTERLEAVED, CS_EVICT)
    sin_a, sin_b = _pair_tiles(sin_ptr + s_row, ss3, row_ok, HALF, BLOCK_P, INTERLEAVED, CS_EVICT)
    ya, yb = _rotate_pairs(xa, xb, cos_a, cos_b, sin_a, sin_b, BACKWARD)
    if INTERLEAVED:
        # stored as they were loaded: joined back into one contiguous tile
        c = tl.arange(0, 2 * BLOCK_P)
        y = tl.reshape(tl.join(_for_store(ya, DT, ROUND_BITS), _for_store(yb, DT, ROUND_BITS)), (BLOCK_R, 2 * BLOCK_P))
        tl.store(o_ptr + o_row[:, None] + c[None, :] * so3, y, mask=row_ok[:, None] & (c < ROT_DIM)[None, :])
    else:
        p = tl.arange(0, BLOCK_P)
        mask = row_ok[:, None] & (p < HALF)[None, :]
        tl.store(o_ptr + o_row[:, None] + p[None, :] * so3, _for_store(ya, DT, ROUND_BITS), mask=mask)
        tl.store(o_ptr + o_row[:, None] + (p + HALF)[None, :] * so3, _for_store(yb, DT, ROUND_BITS), mask=mask)

    if HEAD_DIM > ROT_DIM:
        c = ROT_DIM + tl.arange(0, BLOCK_PASS)
        pmask = row_ok[:, None] & (c < HEAD_DIM)[None, :]
        xp = tl.load(x_ptr + x_row[:, None] + c[None, :] * sx3, mask=pmask, other=0.0)
        tl.store(o_ptr + o_row[:, None] + c[None, :] * so3, xp, mask=pmask)


@triton.jit
def _rope_kernel(
    q_ptr, qo_ptr, k_ptr, ko_ptr, cos_ptr, sin_ptr,
    nq, QA1, QA2, sq0, sq1, sq2, sq3, sqo0, sqo1, sqo2, sqo3,
    nk, KA1, KA2, sk0, sk1, sk2, sk3, sko0, sko1, sko2, sko3,
    sc0, sc1, sc2, sc3,
    ss0, ss1, ss2, ss3,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr, ROUND_BITS: tl.constexpr, WIDE: tl.constexpr, STREAM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    pid = tl.program_id(0)
    q_blocks = tl.cdiv(nq, BLOCK_R)
    if pid < q_blocks:
        _rope_rows(q_ptr, qo_ptr, cos_ptr, sin_ptr, pid, nq, QA1, QA2,
                   sq0, sq1, sq2, sq3, sqo0, sqo1, sqo2, sqo3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
                   HEAD_DIM, ROT_DIM, INTERLEAVED, BACKWARD, ROUND_BITS, WIDE, STREAM,
                   BLOCK_R, BLOCK_P, BLOCK_PASS)
    else:
        _rope_rows(k_ptr, ko_ptr, cos_ptr, sin_ptr, pid - q_blocks, nk, KA1, KA2,
                   sk0, sk1, sk2, sk3, sko0, sko1, sko2, sko3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
                   HEAD_DIM, ROT_DIM, INTERLEAVED, BACKWARD, ROUND_BITS, WIDE, STREAM,
                   BLOCK_R, BLOCK_P, BLOCK_PASS)


FORMS = ("rotate_half", "interleaved")


def empty_out(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The output for input x: x's layout where x is dense (as the eager `x * cos + ...` gives),
    else contiguous; x's dtype unless `dtype` (bf16 q times fp32 cos is fp32 in eager). The fake
    impls use this too."""
    return torch.empty_like(x, dtype=dtype, memory_format=torch.preserve_format)


_STREAM = False  # cache hints off until a measurement (benchmarks/results/latest/rope.md) says otherwise
_WIDE_AT = 2**31  # offsets from here on need 64-bit index math


def _reach(t: torch.Tensor, block_rows: int) -> int:
    """An upper bound on the offsets the kernel computes for t: every index at most its size (the
    last block's masked rows run one past the leading dim), and the row count itself."""
    offsets = sum(abs(st) * sz for st, sz in zip(t.stride(), t.shape)) + abs(t.stride(0))
    return max(offsets, t.shape[0] * t.shape[1] * t.shape[2] + block_rows)


def check_form(form: str, rotary_dim: int, head_dim: int) -> None:
    """ValueError unless `form` is one of FORMS and rotary_dim an even int in (0, head_dim] (also for
    the attention kernel's rotation of q)."""
    if form not in FORMS:
        raise ValueError(f"unknown RoPE form {form!r}; known: {FORMS}")
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim!r} must be an even int in (0, {head_dim}]")


def check_cos_sin(cos, sin, rotary_dim: int, *tensors: torch.Tensor) -> None:
    """ValueError unless cos and sin are 4-d float tensors with last dim rotary_dim, on the device of
    `tensors`, whose first three dims are 1 or those of each tensor (the kernels read them through
    broadcast_strides, so any other size would read past them)."""
    for t, name in ((cos, "cos"), (sin, "sin")):
        for x in tensors:
            want = (*x.shape[:3], rotary_dim)
            if (not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[-1] != rotary_dim
                    or any(a not in (1, b) for a, b in zip(t.shape[:3], want)) or t.device != x.device
                    or not t.is_floating_point()):
                raise ValueError(f"rope {name} must be a 4-d float tensor broadcastable to {want} on {x.device}")


def broadcast_strides(t: torch.Tensor) -> tuple:
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def rope(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    form: str,
    rotary_dim: int,
    backward: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
    stream: bool | None = None,
    q_out_dtype: torch.dtype | None = None,
    k_out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q_out, k_out) = rotation of q and k (k may be None) in one launch; `backward` applies the
    transposed map (for gradients). The rotation is fp32 math, stored in q's and k's dtypes unless
    `q_out_dtype` / `k_out_dtype`. Block sizes: `block_rows` rows per program, `num_warps`;
    `stream`: cache hints (q/k evicted first, cos/sin kept)."""
    head_dim = int(q.shape[-1])  # a constexpr: the pattern only matches static head dims
    check_form(form, rotary_dim, head_dim)
    if q.dim() != 4 or (k is not None and k.dim() != 4):
        raise ValueError("q and k must be 4-d")
    if k is not None and k.shape[-1] != head_dim:
        raise ValueError("q and k must have the same head dim")
    check_cos_sin(cos, sin, rotary_dim, *(t for t in (q, k) if t is not None))
    q_out = empty_out(q, q_out_dtype)
    k_out = None if k is None else empty_out(k, k_out_dtype)
    # one tensor: k's pointers are placeholders (no program has a k row); q's own tensors in their
    # place made the compiled graph return an unwritten clone of q_out (fusionpass.kernels.launch)
    kk, kko = (q, q_out) if k is None else (k, k_out)
    k_ptr, ko_ptr = (absent(q), absent(q_out)) if k is None else (k, k_out)
    nq = q.shape[0] * q.shape[1] * q.shape[2]
    nk = 0 if k is None else k.shape[0] * k.shape[1] * k.shape[2]
    block_p = triton.next_power_of_2(rotary_dim // 2)
    block_pass = triton.next_power_of_2(max(head_dim - rotary_dim, 1))
    if block_rows is None:
        # ~2048 rotated pairs per program
        block_rows = max(1, min(64, 2048 // block_p))
    if block_rows & (block_rows - 1):
        raise ValueError(f"block_rows {block_rows} must be a power of 2")
    if num_warps is None:
        num_warps = 4
    if stream is None:
        stream = _STREAM
    grid = (triton.cdiv(nq, block_rows) + triton.cdiv(nk, block_rows),)
    # the largest element offset any operand can reach (rows past the end included: the last
    # program's masked rows still compute their addresses)
    reach = max(_reach(t, block_rows) for t in (q, q_out, kk, kko, cos, sin))
    round_bits = q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1"
    with _device_guard(q.device):
        launcher(_rope_kernel, q)[grid](
            q, q_out, k_ptr, ko_ptr, cos, sin,
            nq, q.shape[1], q.shape[2], *q.stride(), *q_out.stride(),
            nk, kk.shape[1], kk.shape[2], *kk.stride(), *kko.stride(),
            *broadcast_strides(cos),
            *broadcast_strides(sin),
            HEAD_DIM=head_dim, ROT_DIM=rotary_dim, INTERLEAVED=form == "interleaved",
            BACKWARD=backward, ROUND_BITS=round_bits, WIDE=reach >= _WIDE_AT, STREAM=bool(stream),
            BLOCK_R=block_rows, BLOCK_P=block_p, BLOCK_PASS=block_pass,
            num_warps=num_warps,
        )
    return q_out, k_out
