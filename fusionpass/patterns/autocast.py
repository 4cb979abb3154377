"""Autocast made explicit in the pre-grad graph, before any fusion reads it.

Under `torch.autocast` (the HF Trainer's `bf16=True`: autocast over fp32 weights) the Dynamo graph
holds the ops as the model wrote them: `F.linear(x_fp32, w_fp32)`, whose example value is already
bf16 because autocast will cast its inputs when AOTAutograd traces the graph. The casts themselves
are not in the graph yet. A fusion that replaced that linear would see fp32 inputs and a bf16
result, and its op (`fusionpass::*`, autocast-neutral: `fusionpass.ops.autocast`) would compute in
fp32: not what autocast computes.

So the pass first writes autocast's casts into the graph (`make_explicit`): every input that
autocast would cast for an op of its lower-precision list (linear, matmul, SDPA) gets an explicit
`.to(dtype)` in front of that op, under the autocast state active at the node (the `_enter_autocast`
/ `_exit_autocast` regions Dynamo records, inside an autocast that was on when the compile started).
Autocast then finds those inputs already in its dtype and does nothing more, so the graph computes
exactly what it computed before; every fusion after it sees one dtype per op and needs no autocast
rule of its own. Ops of autocast's fp32 list (softmax, cross-entropy, ...) are left alone: the
fusions that replace them compute in fp32 already, and their example values say so.

Casts of one tensor to one dtype are shared (as autocast's own weight cache shares them), so
`gate(x)` and `up(x)` still read one x. A cast is put above the shape-only ops that lead to the op
(transformers' `repeat_kv`: getitem, expand, reshape), where they have no other reader: the copy
is then made in the narrow dtype, and the attention fusions see repeat_kv over the cast tensor.
"""
from __future__ import annotations

import builtins
import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from fusionpass.patterns import graph as g

# autocast's lower-precision ops as the Dynamo graph spells them (functions and method names); the
# rest of its list (conv, addmm, RNN cells, ...) is no fusion's business, and autocast still casts
# those when AOTAutograd traces the graph
LOWER_PRECISION = (
    F.linear, torch._C._nn.linear, torch.matmul, operator.matmul, torch.mm, torch.bmm,
    F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention,
    "matmul", "mm", "bmm",
)
# ops that only rearrange elements: a cast commutes with them
_SHAPE_ONLY = (*g.VIEWS, *g.TRANSPOSES, *g.PERMUTES, "t", torch.t, "expand", torch.Tensor.expand, "contiguous",
               "unsqueeze", torch.unsqueeze, operator.getitem)
_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast
DEVICES = ("cuda", "cpu")


@dataclasses.dataclass(frozen=True)
class State:
    """The autocast dtype per device type, None where autocast is off."""

    dtypes: tuple[tuple[str, torch.dtype | None], ...]

    def dtype(self, device: str) -> torch.dtype | None:
        return dict(self.dtypes).get(device)

    def entered(self, device: str, dtype, enabled: bool) -> "State":
        if dtype is None:
            dtype = torch.get_autocast_dtype(device) if device in DEVICES else None
        table = dict(self.dtypes)
        table[device] = dtype if enabled else None
        return State(tuple(sorted(table.items())))


def ambient() -> State:
    """The autocast state the compile runs under (a `with torch.autocast(...)` around the compiled
    call: Dynamo guards on it and AOTAutograd traces under it)."""
    return State(tuple(sorted(
        (d, torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None) for d in DEVICES)))


def states(graph: fx.Graph, start: State | None = None) -> dict[fx.Node, State]:
    """The autocast state at every node, from `start` (default the ambient one; a called
    subgraph's: the state at its call) and the regions in the graph."""
    stack = [start if start is not None else ambient()]
    entered: dict[fx.Node, int] = {}
    out = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is _ENTER:
            device, dtype, enabled = (list(node.args) + [None, None, True])[:3]
            entered[node] = len(stack)
            stack.append(stack[-1].entered(device, dtype, bool(enabled)))
        elif node.op == "call_function" and node.target is _EXIT and node.args and node.args[0] in entered:
            del stack[entered.pop(node.args[0]):]
        out[node] = stack[-1]
    return out


def _eligible(arg, device: str, dtype: torch.dtype) -> bool:
    """autocast casts a floating tensor of its device other than float64 (aten's is_autocast_eligible)."""
    t = g.tensor(arg)
    return (t is not None and t.is_floating_point() and t.device.type == device
            and t.dtype not in (torch.float64, dtype))


def _shape_only(node) -> bool:
    """A node that only rearranges its first argument's elements: a cast commutes with it. `w.T`
    (tied embeddings' `h @ embed.weight.T`) is a getattr call in the Dynamo graph."""
    return g.is_call(node, _SHAPE_ONLY) or (
        isinstance(node, fx.Node) and node.op == "call_function" and node.target is builtins.getattr
        and len(node.args) == 2 and node.args[1] in ("T", "mT"))


def _root(arg: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """The tensor a chain of shape-only ops with one reader each leads from (and the chain, first
    op first), for a cast above them."""
    chain = []
    node = arg
    while (_shape_only(node) and len(node.users) == 1 and isinstance(g.first_arg(node), fx.Node)
           and g.tensor(g.first_arg(node)) is not None
           and not any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values()))):
        chain.append(node)
        node = g.first_arg(node)
    return node, list(reversed(chain))


def _cast_after(graph: fx.Graph, root: fx.Node, dtype: torch.dtype, like: fx.Node) -> fx.Node:
    """`root.to(dtype)` right after root (after the last placeholder for an input), so that every
    later reader can share it."""
    if root.op == "placeholder":
        anchor = next(n for n in graph.nodes if n.op != "placeholder")
        inserting = graph.inserting_before(anchor)
    else:
        inserting = graph.inserting_after(root)
    with inserting:
        cast = graph.call_method("to", (root, dtype))
    g.copy_provenance(cast, like)
    g.refresh_value(cast)
    return cast


def make_explicit(graph: fx.Graph, start: State | None = None) -> int:
    """Write autocast's casts of the lower-precision ops' inputs into the graph (under `start`, as
    `states`); returns how many casts were added."""
    at = states(graph, start)
    casts: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    added = 0
    for node in list(graph.nodes):
        if not g.is_call(node, LOWER_PRECISION) or node not in at:
            continue
        out = g.tensor(node)
        if out is None:
            continue
        device = out.device.type
        dtype = at[node].dtype(device)
        if dtype is None or out.dtype != dtype:
            continue  # autocast off here, or the op computes in another dtype (float64 inputs)
        for arg in dict.fromkeys(node.all_input_nodes):
            if not _eligible(arg, device, dtype):
                continue
            root, chain = _root(arg)
            cast = casts.get((root, dtype))
            if cast is None:
                cast = casts[(root, dtype)] = _cast_after(graph, root, dtype, like=node)
                added += 1
            if chain:
                chain[0].replace_input_with(root, cast)
                for link in chain:
                    g.refresh_value(link)
            else:
                node.replace_input_with(arg, cast)
    return added


def rounded_by_readers(node: fx.Node) -> torch.dtype | None:
    """The narrower float dtype every reader casts `node` to (any cast: autocast's, made explicit
    above, in front of the attention, or the model's own `.to()`), or None. A replacement that computes `node` in fp32 may then
    write that dtype directly: the value every reader sees is the same rounding of the same fp32."""
    users = list(node.users)
    dtypes = {g.dtype(u) for u in users if g.cast_source(u) is node}
    if not users or len(dtypes) != 1 or len(dtypes) != len({g.dtype(u) for u in users}) \
            or not all(g.cast_source(u) is node for u in users):
        return None
    dtype = dtypes.pop()
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


def drop_noop_casts(node: fx.Node) -> None:
    """Readers that cast `node` to its own dtype read it directly."""
    for user in list(node.users):
        if g.cast_source(user) is node and g.dtype(user) == g.dtype(node):
            user.replace_all_uses_with(node)
            node.graph.erase_node(user)
