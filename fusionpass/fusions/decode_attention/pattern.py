"""decode_attention: a few query tokens attending over a static KV cache -> fusionpass::decode_attention
(the split-KV kernel of fusionpass/fusions/decode_attention/kernels.py).

transformers 5.x with a StaticCache, in a decode (or speculative-verification) step, calls
    SDPA(q [B, Hq, Lq, D], repeat_kv(cache_k), repeat_kv(cache_v), attn_mask=mask, scale=s)
with Lq small and static, the cache of static length L, and the mask built by masking_utils as
    q_pos = arange(Lq) + offset          offset: the cache's cumulative length, a run-time tensor
    mask  = (arange(L)[None, None, None, :] <= q_pos[None, None, :, None]).expand(B, 1, Lq, L)
(possibly AND-ed with a constant-true start, and cast), i.e. "query i sees the cache up to its own
position". That is the kernel's rule with kv_lengths[b] = q_pos[-1] + 1 for every row: query i at
position kv_lengths - Lq + i, keys past it not read at all (the SDPA call reads all L). The kernel
reads the cache's grouped heads directly: the repeat_kv copies go.

The same step written in torch ops (attn_implementation="eager": `matmul(q, repeat_kv(k)^T) *
scale + torch.where(mask, 0, min)`, an fp32 softmax, `matmul(p, repeat_kv(v))`, read by
fusionpass.patterns.eager_attention) is matched the same way through the boolean mask under the
additive one. There a query row that sees no key would average every value, where the kernel
gives 0; in a decode step the new token always sees its own key.

With an attention_mask (generate() passes one), the mask is also AND-ed with a lookup
`padding[batch_idx, kv_idx]` into the [B, L] bool tensor transformers pads the attention_mask to;
that tensor goes to the kernel as its key-padding vector. With one query token, any boolean mask
of shape [B or 1, 1, 1, L] is a key-padding vector as it stands: generate() with a compiled
forward passes the mask it built outside the graph, and that is matched as such
("one_query_any_mask"; a row that sees no key gives 0, where SDPA would give NaN). Matched only in
inference graphs (no gradient), for head dims 64/128/256 (80, 96 and MLA's 192 / 128 with
decode_attention_padded_head_dims), Lq within QUERY, one float dtype. A mask with other terms
(sliding windows, several padding tensors) is a near miss with its reason.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass import registry
from fusionpass.cost import Range
from fusionpass.fusions.decode_attention.kernels import HEAD_DIMS, MAX_Q_LEN
from fusionpass.patterns import eager_attention as eager
from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.patterns.attention_kernel import key_padding_vector, kernel_dtypes, kernel_shapes
from fusionpass.patterns.sdpa import grouped_kv, is_sdpa, query_device, repeat_kv_nodes, sdpa_arguments
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant, option

# Which attention steps are decode steps: at most the decode kernel's query length (its hard
# limit); longer ones (prefill, training) are the attention fusion's.
QUERY = Range.always("query length", 1, MAX_Q_LEN)
_ANDS = (operator.and_, torch.logical_and, torch.bitwise_and, "__and__", "logical_and")
_PASS_THROUGH = ("expand", "to", "contiguous")


def _target(node):
    return node.target if isinstance(node, fx.Node) and node.op in ("call_function", "call_method") else None


def _is_true_constant(node) -> bool:
    return _target(node) in ("new_ones", torch.ones) and g.dtype(node) == torch.bool


def _arange(node) -> int | None:
    """n for `torch.arange(n)` or `torch.arange(n) + 0` with a static n, else None."""
    if _target(node) in (operator.add, torch.add, "add") and len(node.args) == 2 and node.args[1] == 0:
        node = node.args[0]
    if _target(node) is torch.arange and len(node.args) == 1 and set(node.kwargs) <= {"device", "dtype"}:
        return g.static_int(g.value(node.args[0]))
    return None


def _placed(node, position: int):
    """x for x[None, None, :, None] (position 2) or x[None, None, None, :] (position 3)."""
    if _target(node) is not operator.getitem:
        return None
    full = slice(None, None, None)
    index = node.args[1]
    want = tuple(full if i == position else None for i in range(4))
    return node.args[0] if index == want else None


def _query_positions(node) -> tuple[fx.Node, int, fx.Node] | None:
    """(q_pos, Lq, offset) for q_pos = arange(Lq) + offset, offset a one-element integer tensor."""
    if _target(node) not in (operator.add, torch.add, "add") or len(node.args) != 2 or node.kwargs:
        return None
    for a, off in (node.args, node.args[::-1]):
        n = _arange(a)
        t = g.tensor(off)
        if n is not None and t is not None and t.numel() == 1 and not t.is_floating_point():
            return node, n, off
    return None


def _causal_term(node) -> tuple[fx.Node, int, int, list[fx.Node]] | None:
    """(q_pos, Lq, L, nodes) if node is `arange(L)[None, None, None, :] <= q_pos[None, None, :, None]`
    with q_pos = arange(Lq) + offset, else None."""
    if _target(node) in (operator.le, torch.le, "le"):
        kv, q = node.args
    elif _target(node) in (operator.ge, torch.ge, "ge"):
        q, kv = node.args
    else:
        return None
    kv_src, q_src = _placed(kv, 3), _placed(q, 2)
    length = _arange(kv_src) if kv_src is not None else None
    found = _query_positions(q_src) if q_src is not None else None
    if length is None or found is None:
        return None
    q_pos, lq, _ = found
    return q_pos, lq, length, [node, kv, q, kv_src]


def _terms(node, nodes: list) -> list:
    """The operands of a tree of `&`, through expand/to/contiguous, constant-true ones dropped."""
    while _target(node) in _PASS_THROUGH:
        nodes.append(node)
        node = node.args[0]
    if _target(node) in _ANDS and len(node.args) == 2:
        nodes.append(node)
        return [t for a in node.args for t in _terms(a, nodes)]
    if _is_true_constant(node):
        nodes.append(node)
        return []
    return [node]


def decode_mask(mask: fx.Node, args: dict) -> tuple[fx.Node, int, int, list[fx.Node], fx.Node | None]:
    """(q_pos, Lq, L, nodes, key_padding) of `kv_idx <= q_pos[q_idx]` over a cache of L keys, AND-ed
    with at most a key-padding lookup `padding[batch_idx, kv_idx]` (key_padding: that [B, L] bool
    tensor, else None). NearMiss if the mask has other terms."""
    nodes: list[fx.Node] = []
    causal, others = None, []
    for term in _terms(mask, nodes):
        found = _causal_term(term) if causal is None else None
        if found is not None:
            causal = found
        else:
            others.append(term)
    if causal is None:
        raise NearMiss("decode mask without the term `kv_idx <= arange(Lq) + cache length`")
    q_pos, lq, length, causal_nodes = causal
    key_padding = None
    if others:
        padding_nodes = []
        kinds = [masks.classify(t) for t in others]
        if any(k.kind != "none" or not k.runtime for k in kinds) or len(
            {r.source for k in kinds for r in k.runtime}
        ) != 1:
            raise NearMiss("decode mask with more than the causal term and one key-padding lookup "
                           f"({'; '.join(k.detail for k in kinds)})")
        key_padding = key_padding_vector(kinds[0], mask, args)
        if not isinstance(key_padding, fx.Node):
            raise NearMiss("decode mask proven in the calling graph: its key padding is not a tensor of this graph")
        for k in kinds:
            padding_nodes += k.nodes
        nodes += padding_nodes
    return q_pos, lq, length, [*nodes, *causal_nodes], key_padding


def _decode_sized(lq, lk) -> bool:
    lq, lk = g.static_int(lq), g.static_int(lk)
    return lq is not None and lk is not None and QUERY.check(lq, "inference") is None and lk > lq


def _is_sdpa_decode_step(node) -> bool:
    if not (is_sdpa(node) and isinstance(sdpa_arguments(node)["attn_mask"], fx.Node)):
        return False
    args = sdpa_arguments(node)
    q, k = g.tensor(args["query"]), g.tensor(args["key"])
    if q is None or k is None or q.dim() != 4 or k.dim() != 4:
        return False
    return _decode_sized(q.shape[2], k.shape[2])


def _is_eager_decode_step(node) -> bool:
    # probs @ v with the output's rows (the query length) few and v's (the cache) more
    if not eager.is_anchor(node):
        return False
    out, v = g.tensor(node), g.tensor(node.args[1])
    return out is not None and v is not None and out.dim() >= 3 and v.dim() >= 3 and _decode_sized(
        out.shape[-2], v.shape[-2])


def is_decode_step(node) -> bool:
    """SDPA with a mask, or eager-math attention (matmuls and a softmax), with a static query
    length within QUERY and a longer static key length (prefill and training are the attention
    fusion's)."""
    return _is_sdpa_decode_step(node) or _is_eager_decode_step(node)


def _one_query_key_mask(mask: fx.Node, q: torch.Tensor, lk: int) -> bool:
    """The mask is [B or 1, 1, 1, L] (one value per batch row and key)."""
    t = g.tensor(mask)
    return (
        t is not None
        and t.dim() == 4
        and (statically_known_true(t.shape[0] == q.shape[0]) or t.shape[0] == 1)
        and t.shape[1] == 1
        and t.shape[2] == 1
        and statically_known_true(t.shape[3] == lk)
    )


def _searcher(variant: str):
    def found(node: fx.Node) -> Match | None:
        match = search(node)
        return match if match is None or match.variant == variant else None

    return found


def search(node: fx.Node) -> Match | None:
    """The match of either variant: static_cache (transformers' decode mask) or
    one_query_any_mask (one query token, any [B, 1, 1, L] boolean mask)."""
    if is_sdpa(node):
        args = sdpa_arguments(node)
        return _search(node, args, args["attn_mask"], [node], [])
    found = eager.describe(node)
    if found is None:
        return None
    e, args = found
    if e.key_bias is not None:
        raise NearMiss("eager decode attention with a bias on the scores (ALiBi tensor): the decode kernel "
                       "takes per-head slopes, not a bias tensor")
    if e.mask is None:
        raise NearMiss("eager decode attention without a mask over the cache (the mask decides which "
                       "cache slots are valid)")
    # the additive mask's boolean mask: a query row seeing no key would average every value under
    # the additive mask and get 0 from the kernel; in a decode step the new token always sees its
    # own key, so only a malformed mask can tell them apart
    return _search(node, args, e.mask, list(e.nodes), list(e.mask_nodes))


search_static_cache = _searcher("static_cache")
search_one_query = _searcher("one_query_any_mask")


def _search(node: fx.Node, args: dict, mask: fx.Node, nodes: list, extra_mask_nodes: list) -> Match:
    q, k = g.tensor(args["query"]), g.tensor(args["key"])
    lq, lk = g.static_int(q.shape[2]), g.static_int(k.shape[2])
    if g.dtype(mask) != torch.bool:
        raise NearMiss(f"decode attention mask of dtype {g.dtype(mask)} (an additive bias)")
    key, value = args["key"], args["value"]
    grouped = grouped_kv(args)
    if grouped is not None:
        key, value, _ = grouped
    try:
        q_pos, mask_lq, mask_l, mask_nodes, key_padding = decode_mask(mask, args)
    except NearMiss:
        if lq == 1 and _one_query_key_mask(mask, q, lk):
            # one query row: any [B, 1, 1, L] mask is a key-padding vector (generate() with a
            # compiled forward passes the mask it built outside the graph)
            return Match(
                variant="one_query_any_mask",
                anchor=node,
                nodes=nodes,
                bindings=dict(args=args, key=key, value=value, q_pos=None, mask_nodes=extra_mask_nodes,
                              key_padding=mask),
            )
        raise
    if mask_lq != lq or mask_l != lk:
        raise NearMiss(f"decode mask over {mask_lq} x {mask_l} positions, attention over {lq} x {lk}")
    return Match(
        variant="static_cache",
        anchor=node,
        nodes=nodes,
        bindings=dict(args=args, key=key, value=value, q_pos=q_pos, mask_nodes=[*extra_mask_nodes, *mask_nodes],
                      key_padding=key_padding),
    )


# ---------------------------------------------------------------------------------------------
# guards




def inference_only(m: Match, cfg) -> str | None:
    """Decode has no backward: the kernel has none."""
    tensors = [g.tensor(m.bindings["args"][n]) for n in ("query", "key", "value")]
    if any(t.requires_grad for t in tensors):
        return "q/k/v require grad (training): the decode kernel is forward-only"
    return None


def constants(m: Match, cfg) -> str | None:
    args = m.bindings["args"]
    if not g.is_literal(args["dropout_p"], 0) and args["dropout_p"] != 0.0:
        return f"dropout_p {args['dropout_p']!r} in a decode step"
    if args["is_causal"] is not False:
        return "is_causal together with a mask"
    scale = args["scale"]
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        return f"scale {scale!r} is not a constant"
    return None


def head_dim(m: Match, cfg) -> str | None:
    """q/k and v head dims in HEAD_DIMS, v's its own for MLA (the kernel takes them apart); other
    than 64/128/256 only with decode_attention_padded_head_dims."""
    for what, n in (("head dim", m.bindings["args"]["query"]), ("value head dim", m.bindings["value"])):
        d = g.static_int(g.tensor(n).shape[3])
        if d not in HEAD_DIMS:
            return f"{what} {d} not in the decode kernel's {HEAD_DIMS}"
        if d not in SELECTED_HEAD_DIMS and not cfg.decode_attention_padded_head_dims:
            return f"{what} {d}: {PADDED_OPT_IN}"
    return None


# 80 and 96 measured no faster than plain compile (benchmarks/results/latest/attention_head_dims.md);
# MLA's 192 / 128 was not measured
SELECTED_HEAD_DIMS = (64, 128, 256)
PADDED_OPT_IN = ("decode steps at head dims other than 64/128/256 measured no faster than plain compile or "
                 "were not measured (benchmarks/results/latest/attention_head_dims.md), opt-in "
                 "(decode_attention_padded_head_dims=True)")


@dataclasses.dataclass(frozen=True)
class Options:
    # Off by default: see SELECTED_HEAD_DIMS
    padded_head_dims: bool = option(False, "decode steps at head dims 80, 96 and 192 (MLA: q/k 192 with v 128) "
                                           "-> fusionpass::decode_attention")


# ---------------------------------------------------------------------------------------------
# replacement


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    b = m.bindings
    node, args = m.anchor, b["args"]
    q = args["query"]
    qt = g.tensor(q)
    d = g.static_int(qt.shape[3])
    scale = float(args["scale"]) if args["scale"] is not None else d**-0.5
    batch, cache = qt.shape[0], g.tensor(b["key"]).shape[2]
    key_padding = b["key_padding"]
    if key_padding is not None and g.tensor(key_padding).dim() == 4:
        # a [B or 1, 1, 1, L] mask as the [B, L] vector
        key_padding = g.insert_call(graph, node, torch.Tensor.expand, (key_padding, batch, 1, 1, cache), node)
        key_padding = g.insert_call(graph, node, torch.reshape, (key_padding, (batch, cache)), node)
    if b["q_pos"] is None:
        lengths = None  # every key of the cache, the mask decides
    else:
        # every row's valid length: the last query's position + 1 (q_pos is a fresh tensor,
        # computed before the cache's length is advanced in place)
        last = g.insert_call(graph, node, operator.getitem, (b["q_pos"], slice(-1, None, None)), node)
        plus = g.insert_call(graph, node, torch.add, (last, 1), node)
        lengths32 = g.insert_call(graph, node, torch.Tensor.to, (plus, torch.int32), node)
        lengths = g.insert_call(graph, node, torch.Tensor.expand, (lengths32, batch), node)
    out = g.insert_call(
        graph, node, torch.ops.fusionpass.decode_attention.default,
        (q, b["key"], b["value"], lengths, key_padding, scale), node
    )
    out.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
    if g.tensor(node).dim() == 3:
        # an eager bmm's [B*H, Lq, D]
        with graph.inserting_after(out):
            flat = graph.call_method("reshape", (out, list(g.tensor(node).shape)))
        flat.meta.update(node.meta)
        out = flat
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    g.erase_unused(graph, [n for n in m.nodes if n is not node])
    g.erase_unused(graph, [n for n in b["mask_nodes"] if n.op != "placeholder"])
    g.erase_unused(graph, repeat_kv_nodes(args))


DECODE_ATTENTION = registry.register(
    Fusion(
        name="decode_attention",
        summary='static-cache decode attention (a few new tokens) to a split-KV kernel',
        after=("rope",),
        cost=(QUERY,),
        options=Options,
        matches=(
            "SDPA or eager-math attention (matmul, additive mask, softmax, matmul) of a few "
            "query tokens over a static KV cache with transformers' decode mask "
            "(kv_idx <= arange(Lq) + cache length, and generate()'s key-padding lookup), or one "
            "query token with any [B, 1, 1, L] boolean mask (variant one_query_any_mask); repeat_kv "
            "copies or enable_gqa"
        ),
        selected_when=(
            "inference graphs with a static query length, head dim 64/128/256 (80/96/192, and MLA's v head "
            "dim of its own, with decode_attention_padded_head_dims=True), one float "
            "dtype, fp16/bf16 on CUDA (fp32 is a near miss there: attention_kernel.kernel_dtypes); the causal "
            "term with at most one key-padding lookup (windows are near misses)"
        ),
        anchor=is_decode_step,
        variants=(Variant("static_cache", search_static_cache), Variant("one_query_any_mask", search_one_query)),
        guards=(
            Guard("device", query_device),
            Guard("inference", inference_only),
            Guard("constants", constants),
            Guard("dtype", kernel_dtypes),
            Guard("shape", kernel_shapes),
            Guard("head_dim", head_dim),
        ),
        replace=replace,
        kernel=lambda m, cfg: f"fusionpass split-KV decode ({m.variant})",
        unmatched="a decode-sized SDPA whose mask is not transformers' static-cache decode mask",
    )
)
