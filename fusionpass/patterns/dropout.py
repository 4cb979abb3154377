"""Dropout as the patterns read it (`dropout_of`) and the per-call seed a fused op's in-kernel
dropout draws from (`insert_seed`); shared by the LayerNorm and attention fusions."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from fusionpass.patterns import graph as g
from fusionpass.registry import NearMiss

DROPOUTS = (F.dropout, torch.dropout)
# seeds are drawn in [0, 2**62): non-negative int64, 62 random bits for Philox's 64-bit key
SEED_HIGH = 2**62


def dropout_args(node) -> dict | None:
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in DROPOUTS):
        return None
    if node.target is torch.dropout:
        args = g.call_args(node, ("input", "p", "train"), {})
        if args is not None:
            args["training"] = args.pop("train", None)
        return args
    return g.call_args(node, ("input", "p", "training", "inplace"), {"p": 0.5, "training": True})


class Dropout:
    """A dropout node: `active` when it drops in this graph (training and p != 0); `p` a Python
    float or a SymFloat node."""

    def __init__(self, node: fx.Node, args: dict):
        self.node, self.x = node, args["input"]
        training = args.get("training")
        if not isinstance(training, bool):
            raise NearMiss("dropout's training flag is not a constant")
        ok, p = g.scalar(args.get("p"))
        if not ok:
            raise NearMiss("dropout probability is not a constant (a tensor)")
        self.p = float(p) if isinstance(p, (int, float)) else p
        self.active = training and not (isinstance(self.p, float) and self.p == 0.0)
        if self.active and isinstance(self.p, float) and not 0.0 < self.p < 1.0:
            raise NearMiss(f"dropout probability {self.p} is outside [0, 1)")
        if self.active and args.get("inplace"):
            raise NearMiss("in-place dropout (it overwrites a tensor other ops may read)")


def dropout_of(node) -> Dropout | None:
    args = dropout_args(node)
    return None if args is None else Dropout(node, args)


def insert_seed(graph: fx.Graph, before: fx.Node, like: fx.Node) -> fx.Node:
    """A one-element int64 seed, drawn per call (Inductor lowers randint onto its own RNG)."""
    device = g.tensor(like).device
    args, kwargs = (0, SEED_HIGH, (1,)), {"device": device}
    with graph.inserting_before(before):
        seed = graph.call_function(torch.randint, args, kwargs)
    mode = g.fake_mode_of([like])
    if mode is not None:
        with mode:
            seed.meta["example_value"] = torch.randint(*args, **kwargs)
    g.copy_provenance(seed, like)
    return seed
