"""fusionpass::padded_attention: attention over square scores (causal or bidirectional) with an HF
collator's key padding, served by cuDNN's padding mask where a row's mask is a prefix of keys, and
by our kernel where it is not, picked per row on the device.

    out, lse = padded_attention(q, k, v, key_padding, *, scale, causal=False)

q [B, Hq, L, D], k/v [B, Hkv, L, D] fp16/bf16, key_padding [B, L] bool (True = keep). The result is
that of fusionpass::flash_attention with the same key padding (rows that see no key: out 0, lse
EMPTY_LSE). How:
- per row b, on the device: n_b = key_padding[b].sum(), and whether key_padding[b] is exactly
  n_b leading ones with n_b > 0 (right padding, all ones: a "prefix row");
- cuDNN (fusionpass.kernels.cudnn_attention) computes every row with key lengths n_b for prefix
  rows and 1 for the others: their result is not used, and over one key cuDNN's work on them is
  nearly nothing (at length L a left-padded batch cost cuDNN's whole time before our kernel's,
  benchmarks/results/kernel/collator_attention_routes.md). No row of length 0 reaches cuDNN, which
  returns NaN there before 9.25; under its top-left causal alignment every query sees key 0;
- our kernel computes the other rows (left padding, holes, empty rows) with the key padding,
  writing them into cuDNN's out and lse (in the backward its dq, dk and dv); its programs of
  prefix rows return before reading or writing anything (`skip_batches`), so a batch of prefix
  rows costs cuDNN's time and one launch that does nothing.
No host sync, no shape that depends on data. The backward runs both the same way, each with the
out and lse of the forward.

The op is a triton_op: under torch.compile Inductor traces through it, so the key lengths become
its generated code and our kernel its launch, and only cuDNN's part (padded_attention_library_forward
and _backward, cudnn-frontend's Python) stays an op called at each step. As one custom op, its whole
body ran as Python at each step, and the Trainer step waited on it.

On CPU (the tests) cuDNN's part is a torch reference with the same key lengths, so the per-row
choice is tested there; cuDNN itself only runs on CUDA (the conformance suite).
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

from fusionpass.fusions.flash_attention.op import token_major_empty
from fusionpass.kernels.cudnn_attention import zero_past_keys
from fusionpass.ops import host


def prefix_rows(key_padding: Tensor) -> tuple[Tensor, Tensor]:
    """(n [B] int32, prefix [B] bool): each row's kept keys, and whether they are its first n_b keys
    with n_b > 0."""
    n = key_padding.sum(-1, dtype=torch.int32)
    positions = torch.arange(key_padding.shape[-1], device=key_padding.device)
    prefix = (key_padding == (positions[None, :] < n[:, None])).all(-1) & (n > 0)
    return n, prefix


def _lengths(key_padding: Tensor):
    """(cuDNN's key lengths, prefix): cuDNN takes one key for the rows it does not serve."""
    n, prefix = prefix_rows(key_padding)
    return torch.where(prefix, n, torch.ones_like(n)), prefix


# cuDNN's refusals, by (direction, shape, dtype): where it builds no plan (a head dim or a GQA
# ratio its version does not take), every row goes to our kernel, with one warning per shape
_REFUSED: set = set()


def _refusal_key(direction, q, k):
    return direction, tuple(q.shape), tuple(k.shape), q.dtype, q.device


def _try_library(direction, call, q, k):
    """call()'s result, or None where cuDNN builds no plan for it (kernels.cudnn_attention.Refused;
    any other failure, at run time, is raised)."""
    from fusionpass.kernels.cudnn_attention import Refused

    key = _refusal_key(direction, q, k)
    if key in _REFUSED:
        return None
    try:
        return call()
    except Refused as e:
        _REFUSED.add(key)
        warnings.warn(f"fusionpass::padded_attention: cuDNN refused the {direction} of q {tuple(q.shape)}, "
                      f"k {tuple(k.shape)} ({type(e).__name__}: {str(e)[:200]}); our kernel serves every row")
        return None


# ---------------------------------------------------------------------------------------------
# cuDNN's part: the library on CUDA, a torch reference on CPU


def _library_forward(q, k, v, seq_kv, scale, causal, out):
    """(out, lse), written into `out`."""
    if q.device.type == "cuda":
        from fusionpass.kernels.cudnn_attention import padded_fwd

        return padded_fwd(q, k, v, seq_kv, scale=scale, causal=causal, out=out)
    from fusionpass.fusions.flash_attention.op import _reference

    ref, lse = _reference(q, k, v, _prefix_mask(seq_kv, k.shape[2]), None, scale, causal, 0, False, 0, 0.0, None)
    return out.copy_(ref), lse


def _library_backward(do, q, k, v, out, lse, seq_kv, scale, causal):
    if q.device.type == "cuda":
        from fusionpass.kernels.cudnn_attention import padded_bwd

        return padded_bwd(do, q, k, v, out, lse, seq_kv, scale=scale, causal=causal)
    from fusionpass.fusions.flash_attention.op import _reference_backward

    return _reference_backward(do, q, k, v, out, lse, _prefix_mask(seq_kv, k.shape[2]), None, scale, causal, 0,
                               False, 0, 0.0, None)


def _prefix_mask(lengths: Tensor, L: int) -> Tensor:
    return torch.arange(L, device=lengths.device)[None, :] < lengths[:, None]


# ---------------------------------------------------------------------------------------------
# cuDNN's part as an op of its own: the one piece Inductor cannot trace (cudnn-frontend's Python)


def _empty_out(q: Tensor, token_major: bool) -> Tensor:
    """The output buffer: [B, Hq, L, D]-contiguous, or token-major (attention_out_proj)."""
    return token_major_empty(q) if token_major else host.empty_like(q)


@torch.library.custom_op("fusionpass::padded_attention_library_forward", mutates_args=())
def library_forward(q: Tensor, k: Tensor, v: Tensor, seq_kv: Tensor, prefix: Tensor, *, scale: float,
                    causal: bool, token_major: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse, served): cuDNN's out and lse over every row with key lengths seq_kv, and the rows
    it serves (prefix), or, where it builds no plan for the shape, outputs our kernel fills in whole
    and no row served."""
    out = _empty_out(q, token_major)
    got = _try_library("forward", lambda: _library_forward(q, k, v, seq_kv, scale, causal, out), q, k)
    if got is None:
        return out, q.new_empty(q.shape[:-1], dtype=torch.float32), torch.zeros_like(prefix)
    return out, got[1].contiguous(), prefix.clone()


@library_forward.register_fake
def _(q, k, v, seq_kv, prefix, *, scale, causal, token_major):
    return _empty_out(q, token_major), q.new_empty(q.shape[:-1], dtype=torch.float32), torch.empty_like(prefix)


@torch.library.custom_op("fusionpass::padded_attention_library_backward", mutates_args=())
def library_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seq_kv: Tensor,
                     prefix: Tensor, *, scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, served), as library_forward. Our kernel's backward takes any correct forward's out
    and lse, cuDNN's rows included, so either direction may be refused on its own."""
    got = None if _refusal_key("forward", q, k) in _REFUSED else _try_library(
        "backward", lambda: _library_backward(do, q, k, v, out, lse, seq_kv, scale, causal), q, k)
    if got is None:
        return host.empty_like(q), host.empty_like(k), host.empty_like(v), torch.zeros_like(prefix)
    return (*(t.contiguous() for t in got), prefix.clone())


@library_backward.register_fake
def _(do, q, k, v, out, lse, seq_kv, prefix, *, scale, causal):
    return host.empty_like(q), host.empty_like(k), host.empty_like(v), torch.empty_like(prefix)


# ---------------------------------------------------------------------------------------------
# our kernel's part, on the rows cuDNN does not serve: on CUDA a launch Inductor traces (no op of
# its own to call at each step); on CPU a host op, as fusionpass::flash_attention's


def _ours_on_torch(q) -> bool:
    """CPU without the Triton interpreter: flash_attention's torch reference stands in for our kernel."""
    return q.device.type != "cuda" and not host.interpreting()


def _kernel_forward(q, k, v, key_padding, scale, causal, out, lse, served):
    """Our kernel on the rows not `served`, written into cuDNN's `out` and `lse`, whose served rows
    it neither reads nor writes (`skip_batches`)."""
    if _ours_on_torch(q):
        from fusionpass.fusions.flash_attention.op import _reference

        ours = _reference(q, k, v, key_padding, None, scale, causal, 0, False, 0, 0.0, None)
        return tuple(_by_row(served, a, b) for a, b in zip((out, lse), ours))
    from fusionpass.kernels.attention import attention_fwd

    return attention_fwd(q, k, v, causal=causal, scale=scale, key_padding=key_padding, out=out, lse=lse,
                         skip_batches=served)


def _kernel_backward(do, q, k, v, out, lse, key_padding, scale, causal, grads, served):
    """`_kernel_forward`'s backward, written into cuDNN's dq, dk, dv (`grads`)."""
    if _ours_on_torch(q):
        from fusionpass.fusions.flash_attention.op import _reference_backward

        ours = _reference_backward(do, q, k, v, out, lse, key_padding, None, scale, causal, 0, False, 0, 0.0, None)
        return tuple(_by_row(served, a, b) for a, b in zip(grads, ours))
    from fusionpass.kernels.attention import attention_bwd

    return attention_bwd(do, q, k, v, out, lse, causal=causal, scale=scale, key_padding=key_padding, grads=grads,
                         skip_batches=served)


def _by_row(served: Tensor, library: Tensor, ours: Tensor) -> Tensor:
    return torch.where(served.view(-1, *([1] * (library.dim() - 1))), library, ours)


@torch.library.custom_op("fusionpass::padded_attention_rows_host", mutates_args=())
def _rows_host(q: Tensor, k: Tensor, v: Tensor, key_padding: Tensor, out: Tensor, lse: Tensor, served: Tensor, *,
               scale: float, causal: bool, token_major: bool) -> tuple[Tensor, Tensor]:
    mine = _empty_out(q, token_major).copy_(out)
    got, lse = _kernel_forward(q, k, v, key_padding, scale, causal, mine, lse.clone(), served)
    return mine.copy_(got), lse.contiguous()


@_rows_host.register_fake
def _(q, k, v, key_padding, out, lse, served, *, scale, causal, token_major):
    return _empty_out(q, token_major), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fusionpass::padded_attention_backward_rows_host", mutates_args=())
def _backward_rows_host(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_padding: Tensor,
                        dq: Tensor, dk: Tensor, dv: Tensor, served: Tensor, *, scale: float,
                        causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    grads = tuple(t.clone() for t in (dq, dk, dv))
    return tuple(t.contiguous() for t in _kernel_backward(do, q, k, v, out, lse, key_padding, scale, causal, grads,
                                                          served))


@_backward_rows_host.register_fake
def _(do, q, k, v, out, lse, key_padding, dq, dk, dv, served, *, scale, causal):
    return host.empty_like(q), host.empty_like(k), host.empty_like(v)


# ---------------------------------------------------------------------------------------------
# the op: a triton_op, so that under torch.compile only cuDNN's part stays an op called at each step
# (its Python); the key lengths become Inductor's code and our kernel's launch Inductor's launch
# (benchmarks/results/kernel/cudnn_host_time.md)


@torch.library.triton_op("fusionpass::padded_attention", mutates_args=())
def padded_attention(q: Tensor, k: Tensor, v: Tensor, key_padding: Tensor, *, scale: float,
                     causal: bool = False, token_major: bool = False) -> tuple[Tensor, Tensor]:
    if q.dtype not in (torch.float16, torch.bfloat16) or key_padding.dtype != torch.bool:
        raise ValueError("padded_attention takes fp16/bf16 q, k, v and a bool key_padding")
    if q.shape[2] != k.shape[2] or key_padding.shape != (q.shape[0], k.shape[2]):
        raise ValueError("padded_attention takes square scores and a [B, L] key_padding")
    seq_kv, prefix = _lengths(key_padding)
    out, lse, served = torch.ops.fusionpass.padded_attention_library_forward(
        q, k, v, seq_kv, prefix, scale=scale, causal=causal, token_major=token_major)
    if q.device.type != "cuda":
        return _rows_host(q, k, v, key_padding, out, lse, served, scale=scale, causal=causal,
                          token_major=token_major)
    return _kernel_forward(q, k, v, key_padding, scale, causal, out, lse, served)


@torch.library.triton_op("fusionpass::padded_attention_backward", mutates_args=())
def padded_attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              key_padding: Tensor, *, scale: float,
                              causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    seq_kv, prefix = _lengths(key_padding)
    dq, dk, dv, served = torch.ops.fusionpass.padded_attention_library_backward(
        do, q, k, v, out, lse, seq_kv, prefix, scale=scale, causal=causal)
    dk, dv = zero_past_keys(dk, dv, seq_kv)  # traced, so not the opaque op's host time
    if q.device.type != "cuda":
        return _backward_rows_host(do, q, k, v, out, lse, key_padding, dq, dk, dv, served, scale=scale, causal=causal)
    return _kernel_backward(do, q, k, v, out, lse, key_padding, scale, causal, (dq, dk, dv), served)


def _setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, key_padding = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding)
    ctx.scale, ctx.causal = keyword_only_inputs["scale"], keyword_only_inputs.get("causal", False)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    if dout is None:
        return None, None, None, None
    q, k, v, out, lse, key_padding = ctx.saved_tensors
    dq, dk, dv = torch.ops.fusionpass.padded_attention_backward(dout, q, k, v, out, lse, key_padding,
                                                                scale=ctx.scale, causal=ctx.causal)
    return dq, dk, dv, None


padded_attention.register_autograd(_backward, setup_context=_setup)
