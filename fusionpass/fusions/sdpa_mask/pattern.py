"""sdpa_mask: give SDPA its fast path back when the mask it is handed is provably not needed.

Under torch.compile transformers 5.x passes every SDPA call a materialized boolean mask with
`is_causal=False`, even with no padding at all, and SDPA then leaves its flash/cuDNN kernels
(benchmarks/results/latest/sdpa_mask.md). `fusionpass.patterns.masks` proves what the mask is:
  - purely causal with query and key positions aligned -> `is_causal=True`, no mask;
  - true everywhere (bidirectional, no padding)         -> no mask.
Dropping a mask never makes SDPA slower, so there is no cost rule. The call then reads grouped
K and V (`enable_gqa=True`) instead of transformers' `repeat_kv` copies, which go too.

The same masks AND key padding from the run-time attention_mask are sdpa_runtime_check's (a
branch on one check per forward); sliding windows, padding and ALiBi biases are flash_attention's,
which runs first, so a near miss here is a mask neither could take.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass import registry
from fusionpass.cost import NOT_AUTOTUNED_TRAINING
from fusionpass.patterns import eager_attention as eager
from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.patterns import sdpa
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant

# mask kinds that no SDPA call without a mask computes (sliding windows are flash_attention's, which
# reports them)
_NO_FAST_CALL = {
    "causal_offset": "query and key positions are offset (bottom-right causal) while SDPA's "
    "is_causal is top-left; fusionpass's attention kernel aligns bottom-right, but this route "
    "is not wired yet",
}


def _search(kind: str):
    """Masks that are `kind` outright; a boolean mask that no call without a mask computes is a
    near miss."""

    def search(node: fx.Node) -> Match | None:
        args = sdpa.sdpa_arguments(node)
        mask = args["attn_mask"]
        if args["is_causal"] is not False:
            raise NearMiss(f"a mask and is_causal={args['is_causal']!r} together")
        if g.dtype(mask) != torch.bool:
            if eager.biased_mask(mask) is not None:
                return None  # a per-key bias over a boolean mask: flash_attention's, which said why not
            raise NearMiss(f"attention mask of dtype {g.dtype(mask)} (an additive bias)")
        found = masks.classify(mask)
        if found.kind == "sliding_window":
            return None
        if found.kind in _NO_FAST_CALL:
            raise NearMiss(f"{found.detail}: {_NO_FAST_CALL[found.kind]}")
        if found.kind == "other":
            raise NearMiss(f"mask not provable: {found.detail}")
        if found.kind != kind or found.runtime:
            return None
        return Match(variant=f"{kind}_mask", anchor=node, nodes=[node],
                     bindings=dict(args=args, mask=mask, mask_nodes=found.nodes, kind=kind))

    return search


def already_fast(node: fx.Node) -> str | None:
    """An SDPA call with no mask at all is already what this fusion makes (transformers >= 5.2x
    passes is_causal=True and no mask itself where no attention_mask is given): say so."""
    if not sdpa.is_sdpa(node):
        return None
    args = sdpa.sdpa_arguments(node)
    if args["attn_mask"] is not None or not isinstance(args["is_causal"], bool):
        return None
    return f"attention already in the fast form (is_causal={args['is_causal']}, no mask)"


def covers_the_scores_top_left(m: Match, cfg) -> str | None:
    """The mask covers the scores (`sdpa.mask_covers_the_scores`), and a causal one has Lq == Lk:
    is_causal aligns the diagonal top-left."""
    why = sdpa.mask_covers_the_scores(m, cfg)
    if why is not None:
        return why
    args = m.bindings["args"]
    sq, skv = g.tensor(args["query"]).shape[-2], g.tensor(args["key"]).shape[-2]
    if m.bindings["kind"] == "causal" and not statically_known_true(sq == skv):
        return f"query length {sq} != key length {skv}: SDPA's is_causal would align top-left"
    return None


def erase_mask(graph: fx.Graph, m: Match) -> None:
    """The mask is shared by every layer: it goes once its last reader is rewritten; so do the
    repeat_kv copies the new call no longer reads."""
    g.erase_unused(graph, [n for n in m.bindings["mask_nodes"] if n.op != "placeholder"])
    g.erase_unused(graph, sdpa.repeat_kv_nodes(m.bindings["args"]))


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    node = m.anchor
    positional, kwargs = sdpa.fast_arguments(m, grouped=True)
    with graph.inserting_before(node):
        new = graph.call_function(node.target, positional, kwargs)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    erase_mask(graph, m)


SDPA_MASK = registry.register(
    Fusion(
        name="sdpa_mask",
        summary="SDPA with a materialized boolean mask proven causal (-> is_causal=True) or all-true (-> no mask)",
        after=("flash_attention",),
        matches=(
            "F.scaled_dot_product_attention with a boolean mask built from index arithmetic "
            "(transformers' sdpa_mask): proven causal -> is_causal=True, proven all-true -> no mask; "
            "the call then reads grouped K/V (enable_gqa=True) instead of repeat_kv copies"
        ),
        selected_when="where the mask is proven",
        anchor=sdpa.has_mask_node,
        variants=(
            Variant("causal_mask", _search("causal")),
            Variant("none_mask", _search("none")),
        ),
        guards=(
            Guard("device", sdpa.query_device),
            Guard("shape", covers_the_scores_top_left),
        ),
        cost=(NOT_AUTOTUNED_TRAINING,),
        replace=replace,
        kernel=lambda m, cfg: ("SDPA with is_causal=True and no mask (torch picks its kernel: cuDNN's causal one on "
                               "H100/H200)" if m.variant == "causal_mask" else
                               "SDPA without a mask (torch picks its kernel)"),
        # padded masks are sdpa_runtime_check's, which reports them
        unmatched=None,
        already_fast=already_fast,
    )
)
