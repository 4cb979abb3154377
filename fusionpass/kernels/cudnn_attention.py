"""cuDNN's fused attention over the padded [B, H, S, D] batch with per-row key lengths on the device
(its padding mask: `seq_len_kv`), forward and backward, through cudnn-frontend's Python graph API
(the optional nvidia-cudnn-frontend wheel, the `cudnn` extra; torch's own cuDNN entry takes only
cumulative lengths, whose offsets are those of a packed batch). fusionpass::padded_attention
(fusionpass.fusions.flash_attention.padded_op) calls it for the mask every HF collator passes: right padding
and all ones are a prefix of keys per row.

Graphs are built once per shape, dtype, strides and flags, and bound to torch's current stream at
each call. Rows of length 0 are not given to cuDNN (before cuDNN 9.25 it returns NaN for them, as
cudnn-frontend's own tests record): the caller passes a length of at least 1 and handles such rows
itself.

    padded_fwd(q, k, v, seq_len_kv, scale=, causal=, out=None) -> (out, lse [B, Hq, S] fp32, natural log)
    padded_bwd(do, q, k, v, out, lse, seq_len_kv, scale=, causal=) -> (dq, dk, dv)

out (given, or made [B, Hq, S, D]-contiguous), do and the forward's out may have any strides whose
innermost dim is dense, e.g. token-major (a [B, S, Hq, D] buffer, what attention_out_proj asks for):
the graphs are declared with them.
"""
from __future__ import annotations

import threading

import torch

_GRAPHS: dict = {}
_LOCK = threading.Lock()
_HANDLES: dict = {}


def _cudnn():
    import cudnn

    return cudnn


def available() -> bool:
    """Whether cudnn-frontend imports and a CUDA device is there (the route is chosen at compile
    time; without it flash_attention keeps our kernel and `explain` says what would be faster)."""
    if not torch.cuda.is_available():
        return False
    try:
        _cudnn()
    except Exception:  # not installed, or built against another cuDNN
        return False
    return True


def _handle(device: torch.device):
    cudnn = _cudnn()
    if device not in _HANDLES:
        with torch.cuda.device(device):
            _HANDLES[device] = cudnn.create_handle()
    cudnn.set_stream(handle=_HANDLES[device], stream=torch.cuda.current_stream(device).cuda_stream)
    return _HANDLES[device]


def _io_type(dtype: torch.dtype):
    cudnn = _cudnn()
    return {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[dtype]


class Refused(RuntimeError):
    """cuDNN builds no plan for this call (a head dim, GQA ratio or layout its version does not
    take): the caller serves it another way."""


# Plans per shape: a padding collator that pads to each batch's longest row makes a new S per
# step, so the oldest plans are dropped past this many.
_MAX_GRAPHS = 64


def _graph(key, build):
    with _LOCK:
        if key not in _GRAPHS:
            try:
                _GRAPHS[key] = build()
            except Exception as e:  # cudnn-frontend's own error types, from validate() to build_plans()
                raise Refused(f"{type(e).__name__}: {e}") from e
            while len(_GRAPHS) > _MAX_GRAPHS:
                _GRAPHS.pop(next(iter(_GRAPHS)))
        return _GRAPHS[key]


def _operand(t: torch.Tensor) -> torch.Tensor:
    """cuDNN reads dense innermost dims from 16-byte-aligned addresses: anything else is copied."""
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any(st * t.element_size() % 16 for st in t.stride()[:-1]):
        return t.contiguous()
    return t


def _bshd_or_bhsd(t: torch.Tensor) -> torch.Tensor:
    """t as a dense [B, H, S, D] tensor or the transpose of a dense [B, S, H, D] one (the two layouts
    attention outputs and their gradients come in; an expanded or other strided gradient is copied)."""
    if not (t.is_contiguous() or t.transpose(1, 2).is_contiguous()):
        t = t.contiguous()
    return _operand(t)


def _lengths(g, B):
    cudnn = _cudnn()
    return [g.tensor(name=name, dim=[B, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
            for name in ("seq_len_q", "seq_len_kv")]


def _mask_options(causal: bool) -> dict:
    cudnn = _cudnn()
    # top-left causal (query i sees keys j <= i, SDPA's is_causal over square scores)
    return dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0 if causal else None)


def _new_graph(dtype, shapes, strides, device):
    """A graph with q, k, v (the callers' strides) and the two length tensors declared."""
    cudnn = _cudnn()
    (B, Hq, S, D), (_, Hkv, _, _) = shapes
    io = _io_type(dtype)
    g = cudnn.pygraph(handle=_handle(device), io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT)
    qkv = [g.tensor(name=name, dim=[B, heads, S, D], stride=list(stride), data_type=io)
           for name, heads, stride in (("q", Hq, strides[0]), ("k", Hkv, strides[1]), ("v", Hkv, strides[2]))]
    return g, io, qkv, _lengths(g, B)


def _plan(g):
    cudnn = _cudnn()
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()


def _build_fwd(dtype, shapes, strides, scale, causal, device, out_stride):
    cudnn = _cudnn()
    (B, Hq, S, D), _ = shapes
    g, io, (q, k, v), (seq_q, seq_kv) = _new_graph(dtype, shapes, strides, device)
    o, stats = g.sdpa(name="fwd", q=q, k=k, v=v, generate_stats=True, attn_scale=scale, use_padding_mask=True,
                      seq_len_q=seq_q, seq_len_kv=seq_kv, **_mask_options(causal))
    o.set_output(True).set_dim([B, Hq, S, D]).set_stride(list(out_stride)).set_data_type(io)
    stats.set_output(True).set_dim([B, Hq, S, 1]).set_stride([Hq * S, S, 1, 1]).set_data_type(cudnn.data_type.FLOAT)
    _plan(g)
    return g, (q, k, v, o, stats, seq_q, seq_kv), g.get_workspace_size()


def _build_bwd(dtype, shapes, strides, scale, causal, device, o_do_strides):
    cudnn = _cudnn()
    (B, Hq, S, D), (_, Hkv, _, _) = shapes
    g, io, (q, k, v), (seq_q, seq_kv) = _new_graph(dtype, shapes, strides, device)
    dense = [Hq * S * D, S * D, D, 1]
    o = g.tensor(name="o", dim=[B, Hq, S, D], stride=list(o_do_strides[0]), data_type=io)
    do = g.tensor(name="dO", dim=[B, Hq, S, D], stride=list(o_do_strides[1]), data_type=io)
    stats = g.tensor(name="stats", dim=[B, Hq, S, 1], stride=[Hq * S, S, 1, 1], data_type=cudnn.data_type.FLOAT)
    dq, dk, dv = g.sdpa_backward(name="bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=scale,
                                 use_padding_mask=True, seq_len_q=seq_q, seq_len_kv=seq_kv,
                                 use_deterministic_algorithm=torch.are_deterministic_algorithms_enabled(),
                                 **_mask_options(causal))
    kv_dense = [Hkv * S * D, S * D, D, 1]
    dq.set_output(True).set_dim([B, Hq, S, D]).set_stride(dense).set_data_type(io)
    dk.set_output(True).set_dim([B, Hkv, S, D]).set_stride(kv_dense).set_data_type(io)
    dv.set_output(True).set_dim([B, Hkv, S, D]).set_stride(kv_dense).set_data_type(io)
    _plan(g)
    return g, (q, k, v, o, do, stats, seq_q, seq_kv, dq, dk, dv), g.get_workspace_size()


def _key(direction, q, k, v, scale, causal, extra):
    return (direction, q.dtype, tuple(q.shape), tuple(k.shape), q.stride(), k.stride(), v.stride(), float(scale),
            bool(causal), q.device, torch.are_deterministic_algorithms_enabled(), extra)


def _prepared(direction, build, q, k, v, seq_len_kv, scale, causal, extra):
    """The cached plan of `direction` for these operands (and `extra`, the strides of the other
    operands that the build declares), and what every execution passes it: (q, k, v as cuDNN takes
    them, graph, its tensors, seq_q, seq_kv [B, 1, 1, 1] int32, workspace)."""
    q, k, v = _operand(q), _operand(k), _operand(v)
    B, _, S, _ = q.shape
    g, t, ws = _graph(_key(direction, q, k, v, scale, causal, extra),
                      lambda: build(q.dtype, (q.shape, k.shape), (q.stride(), k.stride(), v.stride()), scale, causal,
                                    q.device, extra))
    seq_kv = seq_len_kv.to(torch.int32).reshape(B, 1, 1, 1).contiguous()
    return q, k, v, g, t, _query_lengths(B, S, q.device), seq_kv, _workspace(ws, q.device)


# What every execution of a shape passes unchanged, kept rather than made at each call: this op's
# Python runs at every step (benchmarks/results/trainer/2026-12-07-h100-gaps-bf16.md says what that
# host time cost and saved).
_QUERY_LENGTHS: dict = {}
_WORKSPACES: dict = {}


def _query_lengths(B: int, S: int, device: torch.device) -> torch.Tensor:
    """[B, 1, 1, 1] int32 of S: every query row is real (cuDNN only reads it)."""
    if torch.cuda.is_current_stream_capturing():  # a graph's pool may hand its memory on later
        return torch.full((B, 1, 1, 1), S, dtype=torch.int32, device=device)
    key = (B, S, device)
    if key not in _QUERY_LENGTHS:
        _QUERY_LENGTHS[key] = torch.full((B, 1, 1, 1), S, dtype=torch.int32, device=device)
    return _QUERY_LENGTHS[key]


def _workspace(size: int, device: torch.device) -> torch.Tensor:
    """A workspace of at least `size` bytes for this stream: executions on one stream run in order,
    so they can share one (as torch's own cuDNN calls do); one per stream keeps two streams apart."""
    if torch.cuda.is_current_stream_capturing():
        return torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    have = _WORKSPACES.get(key)
    if have is None or have.numel() < size:
        have = _WORKSPACES[key] = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    return have


def padded_fwd(q, k, v, seq_len_kv, *, scale: float, causal: bool, out: torch.Tensor | None = None):
    """(out [B, Hq, S, D], lse [B, Hq, S] fp32, natural log): every query row sees its batch row's
    first seq_len_kv keys (top-left causal with `causal`), written into `out` where given (any
    strides, innermost dense and 16-byte aligned). Raises Refused where cuDNN has no plan."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif _bshd_or_bhsd(out) is not out:
        raise ValueError("padded_fwd: out must be [B, H, S, D]-contiguous or the transpose of a contiguous "
                         "[B, S, H, D] tensor, 16-byte aligned")
    q, k, v, g, t, seq_q, seq_kv, workspace = _prepared("fwd", _build_fwd, q, k, v, seq_len_kv, scale, causal,
                                                        out.stride())
    B, Hq, S, D = q.shape
    lse = torch.empty((B, Hq, S, 1), dtype=torch.float32, device=q.device)
    tq, tk, tv, to, tstats, tseq_q, tseq_kv = t
    g.execute({tq: q, tk: k, tv: v, to: out, tstats: lse, tseq_q: seq_q, tseq_kv: seq_kv}, workspace,
              handle=_handle(q.device))
    return out, lse.view(B, Hq, S)


def padded_bwd(do, q, k, v, out, lse, seq_len_kv, *, scale: float, causal: bool):
    """(dq, dk, dv) of padded_fwd, except the rows of dk and dv past each batch row's seq_len_kv:
    cuDNN's padded backward need not write them (its own torch op declines this layout;
    cudnn-frontend's changelog lists zeroed padded rows as a newer kernel's feature), so the caller
    zeroes them (`zero_past_keys`), where Inductor fuses it into generated code."""
    out, do = _bshd_or_bhsd(out), _bshd_or_bhsd(do)
    q, k, v, g, t, seq_q, seq_kv, workspace = _prepared("bwd", _build_bwd, q, k, v, seq_len_kv, scale, causal,
                                                        (out.stride(), do.stride()))
    B, Hq, S, D = q.shape
    dq = torch.empty((B, Hq, S, D), dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    tq, tk, tv, to, tdo, tstats, tseq_q, tseq_kv, tdq, tdk, tdv = t
    g.execute({tq: q, tk: k, tv: v, to: out, tdo: do,
               tstats: lse.reshape(B, Hq, S, 1).contiguous(), tseq_q: seq_q, tseq_kv: seq_kv, tdq: dq, tdk: dk,
               tdv: dv}, workspace, handle=_handle(q.device))
    return dq, dk, dv


def zero_past_keys(dk: torch.Tensor, dv: torch.Tensor, seq_len_kv: torch.Tensor):
    """dk and dv [B, H, L, D] with each batch row's keys from seq_len_kv [B] on set to zero: no query
    sees them."""
    B, _, L, _ = dk.shape
    past = (torch.arange(L, device=dk.device)[None, :] >= seq_len_kv.view(B, 1))[:, None, :, None]
    return dk.masked_fill(past, 0), dv.masked_fill(past, 0)
