"""sdpa_runtime_check: a causal or all-true mask AND key padding from the run-time attention_mask
-> a branch (`torch.cond`) on one check per forward, "is the attention_mask all true": SDPA
without the mask (sdpa_mask's fast call) if so, the original masked call otherwise, so any padding
stays exact.

The check (fusionpass::all_true) is a host sync, made once for the mask all layers share, and not
under CUDA graphs. Opt-in (`attention_runtime_check`) and CPU only: Inductor's lowering of the cond
failed on some CPU graphs (tests/patterns/test_attention_masks.py) and on every CUDA graph the GPU
conformance suite tried (an output stride assertion). Where flash_attention's kernel route is on
it takes these masks first, with no branch and no sync.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from fusionpass import registry
from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.patterns import sdpa
from fusionpass.fusions.sdpa_mask import pattern as sdpa_mask
from fusionpass.registry import Fusion, Guard, Match, Variant, option


def _search(kind: str):
    """`kind` (causal or all-true) masks AND run-time key padding; every other call is another
    fusion's (or sdpa_mask's near miss)."""

    def search(node: fx.Node) -> Match | None:
        args = sdpa.sdpa_arguments(node)
        mask = args["attn_mask"]
        if not isinstance(mask, fx.Node) or args["is_causal"] is not False or g.dtype(mask) != torch.bool:
            return None
        found = masks.classify(mask)
        if found.kind != kind or not found.runtime:
            return None
        if any(r.what != masks.KEY_PADDING for r in found.runtime):
            return None  # sequence segments: no all-true check makes them vanish
        sources = tuple(dict.fromkeys(r.source for r in found.runtime))
        if any(s.graph is not node.graph for s in sources):
            return None  # the attention_mask lives in the calling graph (a checkpointed layer)
        return Match(variant=f"{kind}_mask_if_unpadded", anchor=node, nodes=[node],
                     bindings=dict(args=args, mask=mask, mask_nodes=found.nodes, padding=sources, kind=kind))

    return search


def run_time_check_allowed(m: Match, cfg) -> str | None:
    if not cfg.attention_runtime_check:
        return (
            "key padding from a run-time attention_mask; the all-true check (torch.cond) is off "
            "by default (attention_runtime_check=True / FUSIONPASS_ATTENTION_RUNTIME_CHECK=1 turns "
            "it on; see fusionpass/fusions/sdpa_runtime_check/pattern.py for why)"
        )
    if g.tensor(m.bindings["args"]["query"]).device.type == "cuda":
        # switched off on CUDA: Inductor's lowering of the torch.cond failed there with an output
        # stride assertion in 8 of 8 conformance cases, training and inference
        # (benchmarks/results/2026-12-01-h200-conformance.md as of 67836ab); CPU graphs keep the route
        return ("the all-true check (torch.cond) is switched off on CUDA: Inductor's CUDA lowering of the cond fails "
                "(output stride assertion)")
    from torch._inductor import config as inductor_config

    if inductor_config.triton.cudagraphs:
        return "the all-true check of attention_mask is a host sync, not allowed under CUDA graphs"
    dropout = m.bindings["args"]["dropout_p"]
    if not g.is_literal(dropout, 0):
        # torch.cond's backward re-runs its branch: dropout would draw other random numbers there
        # than in the forward, and the gradients would be wrong (seen on CPU: 1.2 relative error)
        return f"attention dropout {dropout} inside a run-time branch: its backward would re-draw the mask"
    return None



# ---------------------------------------------------------------------------------------------
# replacement


def _sdpa_branch(target, kwargs: dict, with_mask: bool) -> fx.GraphModule:
    """A branch of torch.cond: (query, key, value, mask) -> (SDPA(...),)."""
    graph = fx.Graph()
    q, k, v, mask = (graph.placeholder(name) for name in ("query", "key", "value", "mask"))
    kwargs = dict(kwargs)
    if with_mask:
        kwargs.update(attn_mask=mask, is_causal=False)
    out = graph.call_function(target, (q, k, v), kwargs)
    graph.output((out,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _all_true_flag(graph: fx.Graph, source: fx.Node) -> fx.Node:
    """One fusionpass::all_true per run-time mask, shared by every layer reading it."""
    for user in source.users:
        if user.target is torch.ops.fusionpass.all_true.default:
            return user
    return g.insert_call(
        graph, source.next, torch.ops.fusionpass.all_true.default, (source,), source
    )


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    node = m.anchor
    # Grouped K/V only in an unconditional call: in a torch.cond both branches must take the same
    # operands, and a branch that repeats K/V itself gives their gradients other strides than the
    # enable_gqa branch (Inductor refuses that).
    positional, kwargs = sdpa.fast_arguments(m, grouped=False)
    flags = [_all_true_flag(graph, source) for source in m.bindings["padding"]]
    module = graph.owning_module
    with graph.inserting_before(node):
        flag = flags[0]
        for other in flags[1:]:
            flag = graph.call_function(torch.logical_and, (flag, other))
        names = []
        for with_mask in (False, True):
            name = _free_attribute(module, "fusionpass_sdpa_masked" if with_mask else "fusionpass_sdpa_fast")
            module.register_module(name, _sdpa_branch(node.target, kwargs, with_mask))
            names.append(graph.get_attr(name))
        operands = (*positional, m.bindings["mask"])
        branch = graph.call_function(torch.ops.higher_order.cond, (flag, *names, operands))
        new = graph.call_function(operator.getitem, (branch, 0))
    new.meta.update(node.meta)
    branch.meta["example_value"] = (node.meta.get("example_value"),)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    sdpa_mask.erase_mask(graph, m)


def _free_attribute(module: torch.nn.Module, prefix: str) -> str:
    i = 0
    while hasattr(module, f"{prefix}_{i}"):
        i += 1
    return f"{prefix}_{i}"



@dataclasses.dataclass(frozen=True)
class Options:
    """sdpa_runtime_check's switch (settings named attention_*, as before the split)."""

    # Off by default: Inductor's cond lowering crashed Llama-family inference graphs and refuses
    # q/k/v that alias one tensor (GPT-2's split), seen on CPU (tests/patterns/test_attention_masks.py);
    # never on CUDA, where the lowering failed in every conformance case (`run_time_check_allowed`).
    runtime_check: bool = option(False, "causal/all-true masks AND run-time key padding -> torch.cond "
                                        "on one all-true check per forward (CPU graphs only)")


SDPA_RUNTIME_CHECK = registry.register(
    Fusion(
        name="sdpa_runtime_check",
        summary="SDPA with a proven causal/all-true mask AND run-time key padding: the fast call when attention_mask is all true",
        after=("flash_attention",),
        options=Options,
        settings_prefix="attention",
        # CPU only, so nothing to time on the GPU: why it is off on CUDA
        evidence="docs/correctness.md",
        matches=(
            "F.scaled_dot_product_attention whose boolean mask is proven causal or all-true AND key "
            "padding from the run-time attention_mask -> torch.cond on one all-true check per forward: "
            "sdpa_mask's fast call if so, the original masked call otherwise"
        ),
        selected_when=(
            "opt-in (attention_runtime_check=True), on CPU graphs without CUDA graphs or attention "
            "dropout; Inductor's CUDA lowering of the cond fails"
        ),
        anchor=sdpa.has_mask_node,
        variants=(
            # CPU only (see run_time_check_allowed)
            Variant("causal_mask_if_unpadded", _search("causal"), cuda=False),
            Variant("none_mask_if_unpadded", _search("none"), cuda=False),
        ),
        guards=(
            Guard("device", sdpa.query_device),
            Guard("shape", sdpa_mask.covers_the_scores_top_left),
            Guard("run_time_check", run_time_check_allowed),
        ),
        replace=replace,
        kernel=lambda m, cfg: "torch.cond: SDPA without the mask when attention_mask is all true, with it otherwise",
        # every other masked call is another fusion's, or sdpa_mask's near miss
        unmatched=None,
    )
)
