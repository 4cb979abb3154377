"""The toy fusion's declaration, as every fusion's pattern.py: importing it is all it takes for the
pass, Config, the environment, `fusionpass list` and the run order to know it. It rewrites `x * 2`
into fusionpass::toy_double (this folder's op)."""
from __future__ import annotations

import dataclasses
import operator

import torch

from fusionpass import registry
from fusionpass.patterns import graph as g
from fusionpass.registry import Fusion, Guard, Match, Variant, option

NAME = "toy_double"


@dataclasses.dataclass(frozen=True)
class Options:
    min_rank: int = option(1, "fewest dimensions of x rewritten")


def _is_times_two(node) -> bool:
    return node.op == "call_function" and node.target in (operator.mul, torch.mul) and len(node.args) == 2 \
        and node.args[1] == 2


def _search(node) -> Match | None:
    return Match("times_two", node, [node], {"x": node.args[0]})


def rank_in_range(m: Match, cfg) -> str | None:
    rank = g.tensor(m.bindings["x"]).dim()
    if rank < cfg.options(NAME).min_rank:
        return f"rank {rank} < {cfg.options(NAME).min_rank}"
    return None


def _replace(graph, m: Match, cfg) -> None:
    with graph.inserting_before(m.anchor):
        new = graph.call_function(torch.ops.fusionpass.toy_double.default, (m.bindings["x"],))
    new.meta = dict(m.anchor.meta)
    m.anchor.replace_all_uses_with(new)
    graph.erase_node(m.anchor)


def rank_hint(model, out, near_misses, train) -> str | None:
    """explain's hint where the rank rule kept a match out."""
    if any(fusion == NAME for fusion, _, _ in near_misses):
        return "toy_double: lower FUSIONPASS_TOY_DOUBLE_MIN_RANK to rewrite x * 2 of fewer dimensions"
    return None


TOY_DOUBLE = registry.register(Fusion(
    name=NAME,
    after=("rms_norm_residual",),
    options=Options,
    matches="x * 2",
    selected_when=f"x of at least {Options.min_rank} dimensions",
    anchor=_is_times_two,
    variants=(Variant("times_two", _search),),
    guards=(Guard("rank", rank_in_range),),
    replace=_replace,
    hint=rank_hint,
))
