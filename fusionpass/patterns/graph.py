"""Reading the Dynamo (pre-grad) graph the way a pattern needs it.

That graph is not normalized: `x + y` may be `operator.add`, `torch.add` or `x.add(y)`; an upcast
may be `.float()`, `.to(torch.float32)`, `.to(dtype=torch.float32)` or `.type_as(t)`. These helpers
give each node one canonical op name and expose the example values Dynamo recorded
(`node.meta["example_value"]`), so patterns are written once per *model* spelling, not once per
Python spelling.
"""
from __future__ import annotations

import operator
import re
from collections.abc import Iterable

import torch
import torch.fx as fx

from fusionpass.cost import Sizes

# call_function targets -> canonical op name
_FUNCTIONS = {
    operator.add: "add",
    torch.add: "add",
    operator.mul: "mul",
    torch.mul: "mul",
    operator.sub: "sub",
    torch.sub: "sub",
    operator.truediv: "div",
    torch.div: "div",
    operator.pow: "pow",
    torch.pow: "pow",
    torch.rsqrt: "rsqrt",
    torch.sqrt: "sqrt",
    torch.mean: "mean",
    torch.square: "square",
    operator.neg: "neg",
    torch.neg: "neg",
}
# call_method names -> canonical op name (in-place methods are deliberately absent: they mutate
# a tensor other nodes may still read)
_METHODS = {
    "add": "add",
    "mul": "mul",
    "sub": "sub",
    "div": "div",
    "pow": "pow",
    "rsqrt": "rsqrt",
    "sqrt": "sqrt",
    "mean": "mean",
    "square": "square",
    "neg": "neg",
    "to": "cast",
    "float": "cast",
    "half": "cast",
    "bfloat16": "cast",
    "type": "cast",
    "type_as": "cast",
}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def op(node) -> str | None:
    """Canonical op name of a call node, or None (placeholders, unknown calls, literals)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def is_op(node, name: str) -> bool:
    return op(node) == name


# One table of op spellings: a Dynamo graph writes a reshape as a method call or as a function of
# torch or torch.Tensor
VIEWS = ("view", "reshape", torch.reshape, torch.Tensor.view, torch.Tensor.reshape)
TRANSPOSES = ("transpose", torch.transpose)
PERMUTES = ("permute", torch.permute)


def is_call(node, targets) -> bool:
    """A call_function or call_method node whose target is in `targets` (functions and method names)."""
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def value(node):
    """The example value Dynamo recorded for a node (FakeTensor, SymInt, SymFloat, ...)."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def tensor(node) -> torch.Tensor | None:
    v = value(node)
    return v if isinstance(v, torch.Tensor) else None


def dtype(node) -> torch.dtype | None:
    t = tensor(node)
    return None if t is None else t.dtype


def first_arg(node):
    """The tensor a method or function is applied to."""
    return node.args[0] if node.args else None


def binary_operands(node) -> tuple | None:
    """(lhs, rhs) of a binary add/mul/sub/div; None if it has extra arguments (alpha=, out=)."""
    if len(node.args) != 2 or node.kwargs:
        return None
    return node.args[0], node.args[1]


def same_shape_add_operands(node) -> tuple | None:
    """(a, b) if node = a + b of two tensors of node's shape (a residual add, not a broadcast
    bias)."""
    if not is_op(node, "add"):
        return None
    pair = binary_operands(node)
    if pair is None:
        return None
    out = tensor(node)
    for operand in pair:
        t = tensor(operand)
        if out is None or t is None or t.shape != out.shape:
            return None
    return pair


def commuted(node) -> list[tuple]:
    """Both operand orders of a commutative binary node (add, mul)."""
    pair = binary_operands(node)
    if pair is None:
        return []
    return [pair, (pair[1], pair[0])]


def cast_source(node):
    """If `node` only changes dtype (same device, same shape), return the tensor it casts."""
    if not is_op(node, "cast"):
        return None
    src = first_arg(node)
    src_t, out_t = tensor(src), tensor(node)
    if src_t is None or out_t is None:
        return None
    if src_t.device != out_t.device or src_t.shape != out_t.shape:
        return None
    if node.target in ("to", "type"):
        # .to(dtype) / .to(dtype=...) / .type(dtype): anything else (copy=, memory_format=,
        # non_blocking=) changes more than the dtype.
        extra = [a for a in node.args[1:] if not isinstance(a, (torch.dtype, torch.device))]
        if extra or set(node.kwargs) - {"dtype", "device"}:
            return None
    return src


def strip_upcasts(node):
    """Follow exact casts back: to float32 from a float dtype of at most 32 bits (and no-op casts)."""
    while True:
        src = cast_source(node)
        if src is None:
            return node
        if dtype(node) == dtype(src) or (
            dtype(node) == torch.float32 and dtype(src) in FLOAT_DTYPES
        ):
            node = src
        else:
            return node


def scalar(arg):
    """A Python number literal, or a node that stands for one at run time (a SymFloat/SymInt from
    `.item()` under dynamic=True). Returns (ok, value_or_node)."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return True, arg
    if isinstance(arg, fx.Node) and isinstance(value(arg), (torch.SymFloat, torch.SymInt)):
        return True, arg
    return False, None


def is_literal(arg, expected) -> bool:
    return isinstance(arg, (int, float)) and not isinstance(arg, bool) and arg == expected


def reduces_last_dim(node) -> bool:
    """`mean`/`sum` over the last dimension only, keeping it (what a norm writes)."""
    args = list(node.args[1:])
    kwargs = dict(node.kwargs)
    dim = kwargs.pop("dim", args.pop(0) if args else None)
    keepdim = kwargs.pop("keepdim", args.pop(0) if args else False)
    if args or kwargs or keepdim is not True:
        return False
    t = tensor(first_arg(node))
    if t is None:
        return False
    if isinstance(dim, (list, tuple)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and dim in (-1, t.dim() - 1)


def single_user(node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def escaping(nodes: Iterable[fx.Node], keep: Iterable[fx.Node] = ()) -> list[fx.Node]:
    """Nodes of a match whose values are read outside it (excluding the ones the replacement
    provides again)."""
    inside = set(nodes)
    keep = set(keep)
    return [n for n in inside if n not in keep and any(u not in inside for u in n.users)]


def static_int(size) -> int | None:
    """A size as a Python int: a SymInt the shape environment has pinned (e.g. by a matmul with a
    weight) counts; a free symbol does not."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return None


def sizes(size) -> Sizes | None:
    """The values an int or SymInt can take (fusionpass.cost.Sizes): itself where static; for a free
    symbol or an expression of symbols, the range its shape environment allows and its hint. None
    for anything else."""
    value = static_int(size)
    if value is not None:
        return Sizes.static(value)
    if not isinstance(size, torch.SymInt):
        return None
    node = size.node
    env = node.shape_env
    found = env.bound_sympy(node.expr)
    lo, hi = _finite_int(found.lower), _finite_int(found.upper)
    hint = node.hint if isinstance(node.hint, int) else None
    return Sizes(max(lo or 0, 0), hi, hint)


def _finite_int(bound) -> int | None:
    """A sympy range bound as an int; None for an infinite one (sympy's or torch's int_oo)."""
    try:
        return int(bound) if bound.is_integer and bound.is_finite is not False else None
    except (TypeError, AttributeError, OverflowError, ValueError):
        return None


def unsupported_device(t: torch.Tensor, cfg) -> str | None:
    """Why a fusion leaves tensors on this device alone, or None: CUDA always, the CPU only with
    Config.cpu (tests, `fusionpass explain` without a GPU)."""
    if t.device.type == "cuda" or (t.device.type == "cpu" and cfg.cpu):
        return None
    return f"device {t.device.type}: Inductor's own code runs there"


def device_supported(node_of):
    """A fusion's "device" guard: `unsupported_device` of the tensor of node `node_of(bindings)`
    (the input that decides where the fused op runs)."""
    def guard(m, cfg) -> str | None:
        return unsupported_device(tensor(node_of(m.bindings)), cfg)

    return guard


def tensor_subclass(nodes: Iterable[fx.Node], dtensor_ok: bool = False) -> str | None:
    """Why a match over `nodes` (and their inputs) is left alone because a value is a tensor
    subclass, or None. Our ops take plain tensors: a DTensor (tensor or sequence parallelism)
    would reach an op with no sharding rule, unless `dtensor_ok` (the fusion's ops have them,
    Fusion.dtensor), and other wrapper subclasses are not ours to unwrap."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    seen = set()
    for node in nodes:
        for n in (node, *node.all_input_nodes):
            if n in seen:
                continue
            seen.add(n)
            v = value(n)
            if isinstance(v, torch.Tensor) and is_traceable_wrapper_subclass(v):
                if dtensor_ok and type(v).__name__ == "DTensor":
                    continue
                layout = getattr(v, "placements", None)
                layout = f" {', '.join(map(str, layout))}" if layout is not None else ""
                why = ("this fusion's ops have no sharding rule" if type(v).__name__ == "DTensor"
                       else "fusionpass's ops take plain tensors")
                return f"{where(n)} is a {type(v).__name__}{layout}: {why}; Inductor compiles it"
    return None


def last_dim_contiguous(t: torch.Tensor) -> bool:
    return t.dim() == 0 or t.shape[-1] == 1 or t.stride(-1) == 1


_INDEX = re.compile(r"\[(\d+)\]")
# Dynamo's name for the compiled model, the root of every nn_module_stack path: `L['self']` where
# model.forward itself is traced (transformers 5.17), `L['args'][0]` where a wrapper taking
# (*args, **kwargs) calls it (transformers 5.24's forward decorators), `L['model']` or
# `L['kwargs']['model']` for a model passed to a compiled function
_ROOT = re.compile(r"""^L\[['"]\w+['"]\](\[\d+\]|\[['"]\w+['"]\])*""")


def module_path(source: str) -> str:
    """A Dynamo source name of a submodule (`L['args'][0].model.layers[0]._modules['mlp']`) as its
    path in the model (`model.layers.0.mlp`)."""
    path = _ROOT.sub("", source)
    path = _INDEX.sub(r".\1", path).replace("._modules['", ".").replace("']", "")
    return path.strip(".")


def where(node: fx.Node) -> str:
    """The module path that produced a node (`model.layers.0.input_layernorm`), else its name."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        return module_path(list(stack.values())[-1][0]) or node.name
    return node.name


def fake_mode_of(nodes: Iterable) -> object | None:
    """The fake mode the example values were made in (not the ambient tracing context's)."""
    for n in nodes:
        mode = getattr(tensor(n), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def insert_call(graph: fx.Graph, before: fx.Node, target, args: tuple, like: fx.Node,
                kwargs: dict | None = None) -> fx.Node:
    """Insert `target(*args, **kwargs)` before `before`, with its example value computed under the
    graph's fake mode (later patterns read it) and provenance copied from `like`."""
    kwargs = kwargs or {}
    with graph.inserting_before(before):
        new = graph.call_function(target, args, kwargs)
    copy_provenance(new, like)
    refresh_value(new)
    return new


def refresh_value(node: fx.Node) -> None:
    """(Re)compute a call's example value from its inputs' under the graph's fake mode: after it is
    inserted, or after an input changed dtype (later patterns read it). No fake mode, no value."""
    mode = fake_mode_of(node.all_input_nodes)
    if mode is None:
        return

    def fake(a):
        return value(a) if isinstance(a, fx.Node) else a

    args = fx.node.map_aggregate(node.args, fake)
    kwargs = fx.node.map_aggregate(node.kwargs, fake)
    with mode:
        if node.op == "call_method":
            node.meta["example_value"] = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            node.meta["example_value"] = node.target(*args, **kwargs)


def insert_getitems(graph: fx.Graph, tuple_node: fx.Node, count: int) -> list[fx.Node]:
    out = []
    with graph.inserting_after(tuple_node):
        for i in reversed(range(count)):
            item = graph.call_function(operator.getitem, (tuple_node, i))
            if "example_value" in tuple_node.meta:
                item.meta["example_value"] = tuple_node.meta["example_value"][i]
            for key in ("nn_module_stack", "stack_trace"):
                if key in tuple_node.meta:
                    item.meta[key] = tuple_node.meta[key]
            out.append(item)
    return list(reversed(out))


def erase_unused(graph: fx.Graph, nodes: Iterable[fx.Node]) -> None:
    """Erase the given nodes that no longer have users, latest first."""
    pending = [n for n in nodes]
    changed = True
    while changed:
        changed = False
        for n in list(pending):
            if not n.users and not getattr(n, "_erased", False):
                graph.erase_node(n)
                pending.remove(n)
                changed = True


def call_args(node: fx.Node, names: tuple[str, ...], defaults: dict) -> dict | None:
    """Positional and keyword arguments of a call by parameter name; None if unknown ones."""
    if len(node.args) > len(names) or set(node.kwargs) - set(names):
        return None
    args = dict(defaults)
    args.update(zip(names, node.args))
    args.update(node.kwargs)
    return args


def copy_provenance(new: fx.Node, like: fx.Node) -> None:
    """Where `new` came from, for Inductor's provenance and error messages: `like`'s."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr"):
        if key in like.meta:
            new.meta[key] = like.meta[key]


def swaps_heads_and_tokens(node) -> bool:
    """node is x.transpose(1, 2) (either order, negative dims allowed) or x.permute(0, 2, 1, 3)."""
    if is_call(node, TRANSPOSES):
        dims = node.args[1:3] if len(node.args) == 3 else ()
        return len(dims) == 2 and all(isinstance(d, int) for d in dims) and {d % 4 for d in dims} == {1, 2}
    if is_call(node, PERMUTES):
        dims = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        return [d % 4 if isinstance(d, int) else d for d in dims] == [0, 2, 1, 3]
    return False


def checkpointed_bodies(graph: fx.Graph) -> list[tuple[fx.GraphModule, dict[fx.Node, object], fx.Node]]:
    """The bodies of the checkpointed regions `graph` calls (torch.utils.checkpoint under
    torch.compile: `tag_activation_checkpoint(body, *operands, **checkpoint_options)`, the body run
    as body(*operands) in the forward and again in the backward), each with {its placeholder: the
    operand its call passes} and the call. A body whose placeholders do not pair with the operands
    one to one is left out."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    module = graph.owning_module
    out = []
    for node in graph.nodes:
        if hop is None or module is None or node.op != "call_function" or node.target is not hop:
            continue
        attr = node.args[0] if node.args else None
        body = getattr(module, attr.target, None) if isinstance(attr, fx.Node) and attr.op == "get_attr" else None
        if not isinstance(body, fx.GraphModule):
            continue
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(node.args) - 1:
            continue
        out.append((body, dict(zip(placeholders, node.args[1:])), node))
    return out
