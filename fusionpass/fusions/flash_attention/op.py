"""fusionpass::flash_attention and fusionpass::flash_attention_backward: triton_ops (CUDA), host
custom ops (CPU), autograd.

    out, lse = flash_attention(q, k, v, key_padding=None, key_bias=None, seed=None,
                               rope_cos=None, rope_sin=None, segments=None, sinks=None, *, scale, causal=False,
                               window=0,
                               align_bottom_right=False, diagonal=0, dropout_p=0.0, token_major=False,
                               rope_form="", rotary_dim=0, softcap=0.0)

The rewrites pass every argument past q, k and v by name, and those that edit a call
(rope_attention, attention_out_proj) set it by name. The options are keyword-only; the optional
tensors cannot be (torch.library refuses keyword-only tensors), and they take no gradient
(`_setup` refuses one that requires it).

q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (GQA/MQA: Hq % Hkv == 0, read without repeat), key_padding
[B, Lk] bool (True = keep) or None, key_bias [B, Hq, Lk] float added to every query row's
scores (BLOOM's ALiBi tensor; no gradient) or None, window 0 = none (else key j is visible to query i iff
pos_i - window < j <= pos_i, with causal), align_bottom_right: pos_i = i + Lk - Lq (else i),
diagonal: pos_i moved by that many keys more (with causal; ModernBERT's band |i - j| <= w is
window 2w + 1 at diagonal w),
segments [B, L] integer (Lq == Lk == L) or None: key j is visible to query i only where
segments[b, i] == segments[b, j] (packed sequences; each row nondecreasing),
dropout_p > 0 needs `seed` (a one-element int64 tensor), softcap c > 0 caps the scaled scores at
c * tanh(s / c) before any bias or mask (Gemma-2), sinks [Hq] float (the one optional tensor that
takes a gradient) joins every row's softmax denominator as a logit with no value (gpt-oss). The
math, the RNG and the rows that see
no key (out 0, lse EMPTY_LSE) are those of fusionpass/kernels/attention.

Output layout: `out` is [B, Hq, Lq, D]; contiguous by default, or with `token_major=True` laid out
as a [B, Lq, Hq, D] buffer (strides (Lq*Hq*D, D, Hq*D, 1), what PyTorch's flash/cuDNN SDPA
return), so that the `out.transpose(1, 2).reshape(B, Lq, Hq*D)` every HF model does before its
output projection is a view instead of a copy kernel (fusionpass.fusions.attention_out_proj.pattern sets
it). The fake impls report the same strides as the real ones (Inductor lays out the buffers from
them). lse is [B, Hq, Lq] fp32 contiguous either way. The backward reads `out` and `dout` with
any strides (the kernels take them), so a token-major `out` and the strided `dout` the backward of
that view hands back need no copies; dq/dk/dv are laid out as before.

RoPE in the kernel: with rope_cos/rope_sin (4-d, last dim rotary_dim, broadcastable to
[B, Hq, Lq, rotary_dim], no gradient), rope_form "rotate_half" or "interleaved", q is the
*unrotated* query and the forward rotates it as it loads it (`q * cos + rot(q) * sin`, the map of
fusionpass::rope), so the rotated q is never written (fusionpass.fusions.rope_attention.pattern sets this).
The backward makes the rotated q with one fusionpass::rope launch for the backward kernels and
rotates dq back with fusionpass::rope_backward, as the unfused graph's rope backward would.

On CUDA the kernels launch from Inductor's code (triton_op). On CPU the host custom ops run the
same kernels under the Triton interpreter (TRITON_INTERPRET=1, the tests) or, without it, a torch
reference: math attention with an explicit boolean mask built from the same rule, and the kernels'
dropout keep bits drawn in torch (`philox_keep16`, the bits `attention_dropout_mask` returns). The
reference backward differentiates the reference forward.

Measured on the H200: benchmarks/results/latest/flash_attention.md.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fusionpass.ops import host

# Launch overrides for CPU tensors (the interpreter): keys of attention_fwd/attention_bwd
# (block_m, block_n, dq_block_m, dq_block_n). Empty: the kernels' defaults. Results do not depend
# on them beyond fp32 summation order; tests may shrink them.
CPU_BLOCKS: dict[str, int] = {}


def _options(key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal, dropout_p, seed,
             segments=None, softcap=0.0) -> dict:
    return dict(
        segments=segments,
        softcap=softcap,
        causal=causal,
        scale=scale,
        window=window or None,
        key_padding=key_padding,
        key_bias=key_bias,
        dropout_p=dropout_p,
        seed=seed if dropout_p > 0 else None,
        align="bottom_right" if align_bottom_right else "top_left",
        diagonal=diagonal,
    )


def token_major_empty(q: Tensor) -> Tensor:
    """An uninitialized [B, Hq, Lq, D] tensor of q's dtype laid out as a [B, Lq, Hq, D] buffer: its
    transpose(1, 2) is contiguous. One tensor with these strides, not a view of another (a view
    would make the kernel's output a mutated view under functionalization)."""
    B, Hq, Lq, D = q.shape
    return q.new_empty_strided((B, Hq, Lq, D), (Lq * Hq * D, D, Hq * D, 1))


def _check(q, k, v, dropout_p, seed, window, causal) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout with p > 0 needs a seed tensor")
    if window and not causal:
        raise ValueError("a sliding window needs causal=True")


# ---------------------------------------------------------------------------------------------
# kernels


def _rope(rope_cos, rope_sin, rope_form, rotary_dim):
    """The kernels' `rope` argument: (cos, sin, form, rotary_dim), or None without a rotation."""
    return None if rope_cos is None else (rope_cos, rope_sin, rope_form, rotary_dim)


def _kernel_forward(q, k, v, key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal, dropout_p,
                    seed, segments=None, token_major=False, rope=None, blocks=None, softcap=0.0, sinks=None):
    from fusionpass.kernels.attention import attention_fwd

    opts = _options(key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal, dropout_p, seed,
                    segments, softcap)
    blocks = {k_: v_ for k_, v_ in (blocks or {}).items() if k_ in ("block_m", "block_n")}
    # the kernel writes any [B, Hq, Lq, D] view: token-major output costs nothing extra
    out = token_major_empty(q) if token_major else None
    return attention_fwd(q, k, v, **opts, out=out, rope=rope, sinks=sinks, **blocks)


def _kernel_backward(do, q, k, v, out, lse, key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal,
                     dropout_p, seed, segments=None, blocks=None, softcap=0.0):
    from fusionpass.kernels.attention import attention_bwd

    opts = _options(key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal, dropout_p, seed,
                    segments, softcap)
    return attention_bwd(do, q, k, v, out, lse, **opts, **(blocks or {}))


# ---------------------------------------------------------------------------------------------
# torch reference (CPU without the interpreter)


def visible(B, Lq, Lk, key_padding, causal, window, align_bottom_right, device, diagonal=0, segments=None) -> Tensor:
    """The boolean mask [B, 1, Lq, Lk] the kernels apply (True = key visible)."""
    pos = torch.arange(Lq, device=device)[:, None] + (Lk - Lq if align_bottom_right else 0) + diagonal
    j = torch.arange(Lk, device=device)[None, :]
    vis = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
    if causal:
        vis = vis & (j <= pos)
    if window:
        vis = vis & (j > pos - window)
    vis = vis.expand(B, 1, Lq, Lk)
    if key_padding is not None:
        vis = vis & key_padding[:, None, None, :]
    if segments is not None:
        vis = vis & (segments[:, None, :, None] == segments[:, None, None, :])
    return vis


def _reference(q, k, v, key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal, dropout_p, seed,
               segments=None, softcap=0.0, sinks=None):
    from fusionpass.kernels.attention import EMPTY_LSE, attention_dropout_constants
    from fusionpass.kernels.rng import philox_keep16

    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    group = Hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * (D**-0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if key_bias is not None:
        s = s + key_bias.float().expand(B, Hq, Lk)[:, :, None, :]
    vis = visible(B, Lq, Lk, key_padding, causal, window, align_bottom_right, q.device, diagonal, segments)
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        # the sink's column joins the denominator and brings no value
        lse = torch.logsumexp(torch.cat([s, sinks.float()[None, :, None, None].expand(B, Hq, Lq, 1)], -1), dim=-1)
    else:
        lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)
    lse = torch.where(empty, torch.full_like(lse, EMPTY_LSE), lse)
    p = torch.exp(s - lse[..., None])
    if dropout_p > 0:
        # the kernels' keep bits (Philox row counter (b * Hq + h) * Lq + i; the ops pass offset 0)
        # and their scale, the inverse of the 16-bit threshold's keep probability
        thr16, scale = attention_dropout_constants(dropout_p)
        keep = philox_keep16(B * Hq * Lq, Lk, thr16, int(seed.reshape(-1)[0])).view(B, Hq, Lq, Lk)
        p = torch.where(keep.to(q.device), p * scale, 0.0)
    return (p @ vf).to(q.dtype), lse


def _reference_backward(do, q, k, v, out, lse, key_padding, key_bias, scale, causal, window, align_bottom_right,
                        diagonal, dropout_p, seed, segments=None, softcap=0.0, sinks=None):
    # torch.func.vjp, not torch.autograd: this runs inside a custom op's implementation, below the
    # autograd dispatch key, where enable_grad() records nothing
    def forward(q_, k_, v_):
        return _reference(q_, k_, v_, key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal,
                          dropout_p, seed, segments, softcap, sinks)[0]

    _, vjp = torch.func.vjp(forward, q, k, v)
    return vjp(do.to(q.dtype))


# ---------------------------------------------------------------------------------------------
# host custom ops (CPU): Inductor cannot trace a kernel that runs under the interpreter


@torch.library.custom_op("fusionpass::flash_attention_forward_host", mutates_args=())
def _forward_host(
    q: Tensor, k: Tensor, v: Tensor, key_padding: Tensor | None = None, key_bias: Tensor | None = None,
    seed: Tensor | None = None, rope_cos: Tensor | None = None, rope_sin: Tensor | None = None,
    segments: Tensor | None = None, sinks: Tensor | None = None, *, scale: float,
    causal: bool = False, window: int = 0, align_bottom_right: bool = False, diagonal: int = 0,
    dropout_p: float = 0.0, token_major: bool = False, rope_form: str = "", rotary_dim: int = 0,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    args = (q, k, v, key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal, dropout_p, seed,
            segments)
    rope = _rope(rope_cos, rope_sin, rope_form, rotary_dim)
    if host.interpreting():
        out, lse = _kernel_forward(*args, token_major=token_major, rope=rope, blocks=CPU_BLOCKS, softcap=softcap,
                                   sinks=sinks)
    else:
        if rope is not None:
            from fusionpass.fusions.rope.op import reference as rotate

            args = (rotate(q, rope_cos, rope_sin, rope_form, rotary_dim, False), *args[1:])
        out, lse = _reference(*args, softcap=softcap, sinks=sinks)
        out = token_major_empty(q).copy_(out) if token_major else out.contiguous()
    return out, lse.contiguous()


@_forward_host.register_fake
def _(q, k, v, *_tensors, token_major=False, **_options):
    out = token_major_empty(q) if token_major else host.empty_like(q)
    return out, q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fusionpass::flash_attention_backward_host", mutates_args=())
def _backward_host(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_padding: Tensor | None = None,
    key_bias: Tensor | None = None, seed: Tensor | None = None, segments: Tensor | None = None,
    sinks: Tensor | None = None, *, scale: float,
    causal: bool = False, window: int = 0, align_bottom_right: bool = False, diagonal: int = 0,
    dropout_p: float = 0.0, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    args = (do, q, k, v, out, lse, key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal,
            dropout_p, seed, segments)
    if host.interpreting():
        dq, dk, dv = _kernel_backward(*args, blocks=CPU_BLOCKS, softcap=softcap)
    else:
        dq, dk, dv = _reference_backward(*args, softcap=softcap, sinks=sinks)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_backward_host.register_fake
def _(do, q, k, v, out, lse, *_tensors, **_options):
    return host.empty_like(q), host.empty_like(k), host.empty_like(v)


# ---------------------------------------------------------------------------------------------
# public ops


@torch.library.triton_op("fusionpass::flash_attention", mutates_args=())
def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, key_padding: Tensor | None = None, key_bias: Tensor | None = None,
    seed: Tensor | None = None, rope_cos: Tensor | None = None, rope_sin: Tensor | None = None,
    segments: Tensor | None = None, sinks: Tensor | None = None, *, scale: float,
    causal: bool = False, window: int = 0, align_bottom_right: bool = False, diagonal: int = 0,
    dropout_p: float = 0.0, token_major: bool = False, rope_form: str = "", rotary_dim: int = 0,
    softcap: float = 0.0,
) -> tuple[Tensor, Tensor]:
    _check(q, k, v, dropout_p, seed, window, causal)
    options = dict(scale=scale, key_padding=key_padding, key_bias=key_bias, causal=causal, window=window,
                   align_bottom_right=align_bottom_right, diagonal=diagonal, dropout_p=dropout_p, seed=seed,
                   segments=segments, softcap=softcap)
    rope = dict(rope_cos=rope_cos, rope_sin=rope_sin, rope_form=rope_form, rotary_dim=rotary_dim)
    if q.device.type != "cuda":
        return _forward_host(q, k, v, **options, sinks=sinks, token_major=token_major, **rope)
    return _kernel_forward(q, k, v, key_padding, key_bias, scale, causal, window, align_bottom_right, diagonal,
                           dropout_p, seed, segments, token_major=token_major,
                           rope=_rope(rope_cos, rope_sin, rope_form, rotary_dim), softcap=softcap, sinks=sinks)


@torch.library.triton_op("fusionpass::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_padding: Tensor | None = None,
    key_bias: Tensor | None = None, seed: Tensor | None = None, segments: Tensor | None = None,
    sinks: Tensor | None = None, *, scale: float,
    causal: bool = False, window: int = 0, align_bottom_right: bool = False, diagonal: int = 0,
    dropout_p: float = 0.0, softcap: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    if do.device.type != "cuda":
        return _backward_host(do, q, k, v, out, lse, scale=scale, key_padding=key_padding, key_bias=key_bias,
                              causal=causal, window=window, align_bottom_right=align_bottom_right,
                              diagonal=diagonal, dropout_p=dropout_p, seed=seed, segments=segments,
                              sinks=sinks, softcap=softcap)
    # (the kernels need no sinks: lse, from the forward, includes them)
    return _kernel_backward(do, q, k, v, out, lse, key_padding, key_bias, scale, causal, window, align_bottom_right,
                            diagonal, dropout_p, seed, segments, softcap=softcap)


def _setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, key_padding, key_bias, seed, rope_cos, rope_sin, segments, sinks = inputs
    for what, t in (("key_bias", key_bias), ("RoPE cos/sin", rope_cos), ("RoPE cos/sin", rope_sin)):
        if t is not None and t.requires_grad:
            raise RuntimeError(f"fusionpass::flash_attention does not differentiate its {what}")
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding, key_bias, seed, rope_cos, rope_sin, segments, sinks)
    kw = keyword_only_inputs
    ctx.flags = {n: kw[n] for n in ("scale", "causal", "window", "align_bottom_right", "diagonal", "dropout_p",
                                            "softcap")
                 if n in kw}
    ctx.rope = (kw.get("rope_form", ""), kw.get("rotary_dim", 0))
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    if dout is None:
        return (None,) * 10
    q, k, v, out, lse, key_padding, key_bias, seed, rope_cos, rope_sin, segments, sinks = ctx.saved_tensors
    form, rotary_dim = ctx.rope
    if rope_cos is not None:
        # the forward rotated q as it loaded it; the backward kernels read the rotated q, made
        # here (one rotation launch), and the gradient is rotated back (the transposed map)
        q = torch.ops.fusionpass.rope(q, None, rope_cos, rope_sin, form=form, rotary_dim=rotary_dim)[0]
    dq, dk, dv = torch.ops.fusionpass.flash_attention_backward(
        dout, q, k, v, out, lse, key_padding=key_padding, key_bias=key_bias, seed=seed, segments=segments,
        sinks=sinks, **ctx.flags
    )
    if rope_cos is not None:
        dq = torch.ops.fusionpass.rope_backward(dq, None, rope_cos, rope_sin, form=form, rotary_dim=rotary_dim)[0]
    # out (saved) and dout may be token-major or otherwise strided: the kernels read their strides
    dsinks = None
    if sinks is not None:
        from fusionpass.kernels.attention import attention_sinks_grad

        dsinks = attention_sinks_grad(dout, out, lse, sinks)
    return dq, dk, dv, *(None,) * 6, dsinks


flash_attention.register_autograd(_backward, setup_context=_setup)
