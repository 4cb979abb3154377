"""Logit soft-capping, `c * tanh(x / c)` (Gemma-2's attn_logit_softcapping on the attention
scores and final_logit_softcapping on the logits), read from a graph: the attention fusion and
linear_cross_entropy both take it."""
from __future__ import annotations

import torch
from torch import fx

from fusionpass.patterns import graph as g
from fusionpass.registry import NearMiss

TANH = (torch.tanh,)


def literal(arg) -> float | None:
    """A Python int or float (not a bool) as a float, else None."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    return None


def softcap_of(node: fx.Node) -> tuple[fx.Node, float, list[fx.Node]] | None:
    """(x, |c|, nodes) of `tanh(x / c) * c` (or `tanh(x * (1/c)) * c`) with a constant c != 0 (the
    map is even in c), else None; NearMiss where the two constants differ or the cap is not a
    constant. nodes: the mul, the tanh and the division, outermost first."""
    if not g.is_op(node, "mul"):
        return None
    for tanh, c in g.commuted(node):
        c = literal(c)
        if c is None or not isinstance(tanh, fx.Node):
            continue
        is_tanh = (tanh.op == "call_function" and tanh.target in TANH) or (
            tanh.op == "call_method" and tanh.target == "tanh"
        )
        if not is_tanh or len(tanh.args) != 1 or tanh.kwargs:
            continue
        inner = tanh.args[0]
        if g.is_op(inner, "div") and g.binary_operands(inner):
            x, d = inner.args
            if literal(d) is None or not isinstance(x, fx.Node):
                continue
            if literal(d) != c:
                raise NearMiss(f"soft-cap divides by {d} but multiplies by {c}")
        elif g.is_op(inner, "mul") and g.binary_operands(inner):
            pair = next(
                ((x, s) for x, s in g.commuted(inner) if isinstance(x, fx.Node) and literal(s) is not None),
                None,
            )
            if pair is None:
                continue
            x, s = pair
            if abs(literal(s) * c - 1.0) > 1e-6:
                raise NearMiss(f"soft-cap scales by {s} but multiplies by {c}")
        else:
            continue
        if c == 0.0:
            return None
        return x, abs(c), [node, tanh, inner]
    if any(
        isinstance(a, fx.Node) and (a.target in TANH or a.target == "tanh") for a in node.args
    ):
        raise NearMiss("tanh soft-capping whose cap is not a constant")
    return None
