"""What every route to our attention kernels checks (flash_attention, decode_attention): one
dtype for q, k and v, [B, H, L, D] shapes with whole query groups per kv head, and the run-time
key-padding vector a mask reads, proven to be `attention_mask[batch, kv]`.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.registry import Match, NearMiss

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _not_aranges(indices) -> str | None:
    """Why a run-time lookup's indices are not arange(size) placed on their mask axes, or None.
    indices: (placement, axis, size, name) per index of the lookup."""
    for placement, axis, size, name in indices:
        length = dict(placement.lengths).get(axis)
        if placement.coef != ((axis, 1),) or placement.const != 0 or length is None or not (
            statically_known_true(length == size)
        ):
            return f"its {name} index is not arange({size}) on the mask's {name} axis"
    return None


def key_padding_vector(found: masks.MaskKind, mask: fx.Node, args: dict) -> fx.Node:
    """The [B, Lk] bool tensor the mask reads as `padding[batch_idx, kv_idx]`, exactly."""
    if len({r.source for r in found.runtime}) != 1 or masks.terms_of(found, masks.SEGMENTS):
        raise NearMiss("key padding from several run-time tensors, or with sequence segments: one "
                       "key-padding vector only")
    term = found.runtime[0]
    source, index = term.source, term.index
    q, k, t = g.tensor(args["query"]), g.tensor(args["key"]), g.tensor(source)
    m = g.tensor(mask)
    why = None
    if t is None or t.dim() != 2 or len(index) != 2 or m is None or m.dim() != 4:
        why = "not a 2-D lookup into a 4-D mask"
    elif t.dtype != torch.bool:
        why = f"key-padding tensor of dtype {t.dtype}"
    else:
        (b_idx, kv_idx) = index
        why = _not_aranges(((b_idx, -m.dim(), q.shape[0], "batch"), (kv_idx, masks.KV_AXIS, k.shape[-2], "key")))
        if why is None and not (
            statically_known_true(t.shape[0] == q.shape[0]) and statically_known_true(t.shape[1] == k.shape[-2])
        ):
            why = f"key-padding tensor of shape {tuple(t.shape)}, not [{q.shape[0]}, {k.shape[-2]}]"
    if why is not None:
        raise NearMiss(f"key padding not provably attention_mask[batch, kv]: {why}")
    if source.graph is not mask.graph:
        return _row_of_the_mask(found, mask)
    return source


@dataclasses.dataclass(frozen=True)
class MaskRow:
    """The key-padding vector of a mask proven in the caller's graph (a checkpointed layer, whose
    attention_mask lives in the model's graph): a row of the layer's own mask input,
    `mask[:, 0, row, :]`, the row that sees every key the padding keeps. `key_padding_node` writes
    it into the graph when the replacement is made."""

    mask: fx.Node
    row: int


def _row_of_the_mask(found: masks.MaskKind, mask: fx.Node) -> MaskRow:
    """An all-true mask AND padding is the padding in every row; a causal one (kv <= q) over square
    scores in its last row, where kv <= q holds for every key. Windows and diagonal offsets hide
    keys in every row, so no row is the padding alone."""
    m = g.tensor(mask)
    if found.kind == "none":
        return MaskRow(mask, 0)
    if found.kind == "causal" and found.shift == 0 and statically_known_true(m.shape[-2] == m.shape[-1]):
        return MaskRow(mask, -1)
    raise NearMiss(f"{found.detail}, proven in the calling graph: no row of the mask is the key padding alone "
                   "(only causal masks over square scores and all-true masks have one)")


def key_padding_node(graph: fx.Graph, before: fx.Node, key_padding):
    """The [B, Lk] key-padding node a replacement passes to the kernel (None stays None)."""
    if not isinstance(key_padding, MaskRow):
        return key_padding
    index = (slice(None), 0, key_padding.row, slice(None))
    return g.insert_call(graph, before, operator.getitem, (key_padding.mask, index), before)


def _nondecreasing_rows(node: fx.Node) -> bool:
    """Whether every row of `node` [B, L] is provably nondecreasing: a cumsum over the last dim of
    a bool tensor (transformers' `(diff(position_ids) != 1).cumsum(-1)`)."""
    if not (isinstance(node, fx.Node) and node.op in ("call_method", "call_function")):
        return False
    if node.target not in ("cumsum", torch.cumsum):
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    src = node.args[0]
    t = g.tensor(node)
    return (t is not None and dim in (-1, t.dim() - 1) and isinstance(src, fx.Node)
            and g.dtype(src) == torch.bool and "dtype" not in node.kwargs)


def segment_vector(found: masks.MaskKind, mask: fx.Node, args: dict) -> fx.Node:
    """The [B, L] tensor of sequence-segment ids the mask compares as `seg[batch, q] ==
    seg[batch, kv]` (packed sequences), exactly, with Lq == Lk == L and each row nondecreasing
    (the kernel skips the key blocks before a query block's segment). NearMiss otherwise."""
    (term,) = masks.terms_of(found, masks.SEGMENTS) or (None,)
    if term is None or len(found.runtime) != 1:
        raise NearMiss("sequence segments together with other run-time terms (key padding): one segment "
                       "vector only")
    q, k, t, m = (g.tensor(n) for n in (args["query"], args["key"], term.source, mask))
    b_idx, q_idx, kv_idx = term.index
    why = None
    if t is None or t.dim() != 2 or m is None or m.dim() != 4 or t.dtype in (torch.bool,) or t.is_floating_point():
        why = "not a 2-D integer tensor read by a 4-D mask"
    else:
        why = _not_aranges(((b_idx, -m.dim(), q.shape[0], "batch"), (q_idx, masks.Q_AXIS, q.shape[-2], "query"),
                            (kv_idx, masks.KV_AXIS, k.shape[-2], "key")))
        if why is None and not (statically_known_true(t.shape[0] == q.shape[0])
                                and statically_known_true(t.shape[1] == q.shape[-2])
                                and statically_known_true(q.shape[-2] == k.shape[-2])):
            why = f"segment tensor of shape {tuple(t.shape)} over {q.shape[-2]} queries and {k.shape[-2]} keys"
        if why is None and not _nondecreasing_rows(term.source):
            why = "segment ids not proven nondecreasing along the sequence (a cumsum of a bool tensor)"
        if why is None and term.source.graph is not mask.graph:
            why = "the segment ids live in the calling graph (a checkpointed layer), not in this one"
    if why is not None:
        raise NearMiss(f"sequence segments not provably seg[batch, q] == seg[batch, kv]: {why}")
    return term.source


def kernel_dtypes(m: Match, cfg) -> str | None:
    """q, k and v share one dtype of fp16/bf16/fp32, and on CUDA not fp32: the kernels' fp32 dot
    products are IEEE fp32 on FMA units, and on the H200 fp32 attention through them was far
    slower than plain torch.compile's (benchmarks/results/2026-12-01-h200-fp32-attention.md as of 67836ab), so
    fp32 graphs keep their attention there. (CPU graphs, which run the host ops, keep fp32.)"""
    b = m.bindings
    q = b["args"]["query"]
    dtypes = [g.dtype(n) for n in (q, b["key"], b["value"])]
    if len(set(dtypes)) != 1:
        return f"q/k/v dtypes {[str(d) for d in dtypes]} differ: the kernel takes one of fp16/bf16/fp32"
    if dtypes[0] == torch.float32 and g.tensor(q).device.type == "cuda":
        return ("fp32 q/k/v: the kernel's fp32 dot products run on FMA units, slower than plain "
                "torch.compile's attention (benchmarks/results/2026-12-01-h200-fp32-attention.md as of 67836ab)")
    if dtypes[0] not in DTYPES:
        return f"q/k/v dtype {dtypes[0]}: the kernel takes one of fp16/bf16/fp32"
    return None


def kernel_shapes(m: Match, cfg) -> str | None:
    """q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], Hq % Hkv == 0, statically. Dv is
    D but for MLA (DeepSeek's q/k 192, v 128): each route's head-dim guard says which it takes."""
    b = m.bindings
    q, k, v = (g.tensor(n) for n in (b["args"]["query"], b["key"], b["value"]))
    if any(t is None or t.dim() != 4 for t in (q, k, v)):
        return "q/k/v are not all 4-D [B, H, L, D]"
    hq, hkv = g.static_int(q.shape[1]), g.static_int(k.shape[1])
    same = all(statically_known_true(a == c) for a, c in zip(k.shape[:3], v.shape[:3]))
    if not same or not statically_known_true(q.shape[0] == k.shape[0]) or not statically_known_true(
        q.shape[3] == k.shape[3]
    ):
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not [B, H, L, D] alike"
    if hq is None or hkv is None or hkv == 0 or hq % hkv:
        return f"query heads {q.shape[1]} not a static multiple of kv heads {k.shape[1]}"
    return None
