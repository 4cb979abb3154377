"""rope: rotary position embedding of q and k, as model families write it (opt-in).

The match starts at the `add` of
    x_embed = x * cos + rot(x) * sin                    (operands of add and mul in either order)
with rot(x) one of the forms
    rotate_half  cat((-x[..., h:], x[..., :h]), dim=-1)                  HF Llama, GPT-NeoX, Phi-3
    interleaved  stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)  GPT-J rotate_every_two
gpt-oss writes the rotation of halves itself, over cos and sin half as wide as x,
    x1, x2 = chunk(x, 2, dim=-1);  cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
the arithmetic of rotate_half over cos and sin repeated twice, which the replacement builds
(variants halves, halves_single; matched from x to the cat).
Partial rotary (GPT-NeoX rotary_pct, Phi-3 partial_rotary_factor, GPT-J rotary_dim) writes
    x_rot, x_pass = x[..., :r], x[..., r:];  cat([x_rot * cos + rot(x_rot) * sin, x_pass], dim=-1)
and is matched from x to the cat. The second rotation that reads the same cos and sin (k for q)
joins the match: one fusionpass::rope call rotates both; a lone rotation gets a call of its own.

Cost rule (`cost_rule`, the rules POSITIONS, SIZE and INTERLEAVED_SIZE): selected where q and
k together are small enough and the rotation covers enough positions (rope_max_bytes,
rope_interleaved_max_bytes, rope_min_tokens; why: benchmarks/results/latest/rope.md).
rope_kernel=True / FUSIONPASS_ROPE_KERNEL=1 routes every match. Where the rotated q feeds fusionpass's attention
kernel, fusions/rope_attention/pattern.py moves q's rotation into that kernel instead (with or without
this fusion).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from fusionpass import registry
from fusionpass.cost import NOT_AUTOTUNED_TRAINING, Range, Sizes, Switch, fields
from fusionpass.patterns import autocast
from fusionpass.patterns import graph as g
from fusionpass.registry import Fusion, Guard, Match, Variant, option

# ---------------------------------------------------------------------------------------------
# spelling helpers


def _last_dim_slice(node):
    """(base, start, stop, step) if node is base[..., start:stop:step] indexing the last dim only."""
    if not (
        isinstance(node, fx.Node)
        and node.op == "call_function"
        and node.target is operator.getitem
        and len(node.args) == 2
    ):
        return None
    base, index = node.args
    t = g.tensor(base)
    if t is None or not isinstance(index, tuple) or not index:
        return None
    *lead, last = index
    if not isinstance(last, slice):
        return None
    if lead != [Ellipsis] and not (
        len(lead) == t.dim() - 1 and all(s == slice(None) for s in lead)
    ):
        return None
    return base, last.start, last.stop, last.step


def _is_last_dim(dim, node) -> bool:
    t = g.tensor(node)
    return t is not None and isinstance(dim, int) and dim in (-1, t.dim() - 1)


def joined(node, name: str):
    """The tensor list of a cat/stack over the last dim, or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return None
    if node.target is not getattr(torch, name):
        return None
    if not node.args or not isinstance(node.args[0], (list, tuple)):
        return None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    extra = set(node.kwargs) - {"dim"}
    if extra or len(node.args) > 2:
        return None
    # the stack's dim is the new last dim: compare against its output
    if not _is_last_dim(dim, node):
        return None
    return list(node.args[0])


def _negated(node):
    if g.is_op(node, "neg") and len(node.args) == 1 and not node.kwargs:
        return node.args[0]
    return None


def _pair_slices(x1, x2, x, first, second) -> bool:
    """x1 = x[first], x2 = x[second] where first/second are (start, stop, step) sets."""
    s1, s2 = _last_dim_slice(x1), _last_dim_slice(x2)
    if s1 is None or s2 is None or s1[0] is not x or s2[0] is not x:
        return False
    return s1[1:] in first and s2[1:] in second


def rotate_half(rot, x):
    """Nodes of rot = cat((-x[..., h:], x[..., :h]), -1), or None."""
    parts = joined(rot, "cat")
    if parts is None or len(parts) != 2:
        return None
    neg, x1 = parts
    x2 = _negated(neg)
    width = g.static_int(g.tensor(x).shape[-1]) if g.tensor(x) is not None else None
    if x2 is None or width is None or width % 2:
        return None
    h = width // 2
    first = {(None, h, None), (0, h, None), (0, h, 1), (None, h, 1)}
    second = {(h, None, None), (h, width, None), (h, None, 1), (h, width, 1)}
    if not _pair_slices(x1, x2, x, first, second):
        return None
    return [rot, neg, x1, x2]


def _is_flatten(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "flatten") or (
        node.op == "call_function" and node.target is torch.flatten
    )


def _flattened(node):
    """t if node is t.flatten(-2) / torch.flatten(t, -2) (over the last two dims)."""
    if not isinstance(node, fx.Node):
        return None
    if not _is_flatten(node):
        return None
    args = list(node.args[1:])
    kwargs = dict(node.kwargs)
    start = kwargs.pop("start_dim", args.pop(0) if args else 0)
    end = kwargs.pop("end_dim", args.pop(0) if args else -1)
    src = g.first_arg(node)
    t = g.tensor(src)
    if args or kwargs or t is None:
        return None
    if start not in (-2, t.dim() - 2) or end not in (-1, t.dim() - 1):
        return None
    return src


def interleaved(rot, x):
    """Nodes of rot = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2), or None."""
    stack = _flattened(rot)
    parts = joined(stack, "stack")
    if parts is None or len(parts) != 2:
        return None
    neg, x1 = parts
    x2 = _negated(neg)
    if x2 is None:
        return None
    first = {(None, None, 2), (0, None, 2)}
    second = {(1, None, 2)}
    if not _pair_slices(x1, x2, x, first, second):
        return None
    return [rot, stack, neg, x1, x2]


FORMS = (("rotate_half", rotate_half), ("interleaved", interleaved))


def _halves(x1, x2):
    """x, chunk if x1, x2 = torch.chunk(x, 2, dim=-1) (or x.chunk), first and second; else None."""
    if not all(g.is_call(n, (operator.getitem,)) and len(n.args) == 2 for n in (x1, x2)):
        return None
    chunk = x1.args[0]
    if x2.args[0] is not chunk or (x1.args[1], x2.args[1]) != (0, 1):
        return None
    if not g.is_call(chunk, (torch.chunk, "chunk")) or len(chunk.users) != 2:
        return None
    args, kwargs = list(chunk.args[1:]), dict(chunk.kwargs)
    chunks = kwargs.pop("chunks", args.pop(0) if args else None)
    dim = kwargs.pop("dim", args.pop(0) if args else 0)
    x = g.first_arg(chunk)
    width = g.static_int(g.tensor(x).shape[-1]) if g.tensor(x) is not None else None
    if args or kwargs or chunks != 2 or not _is_last_dim(dim, x) or width is None or width % 2:
        return None
    return x, chunk


def _products(node) -> set | None:
    """{(a, b), (b, a)} pairs of both products of node = a * b (op) c * d, or None."""
    pair = g.binary_operands(node) if isinstance(node, fx.Node) else None
    if pair is None or not all(_is_mul(m) for m in pair):
        return None
    return pair


def rotated_halves(cat: fx.Node):
    """One rotation of halves: dict(x, out, cos, sin, rotary_dim, partial, nodes) as
    rotated_tensor gives, cos and sin half as wide as x; or None."""
    parts = joined(cat, "cat")
    if parts is None or len(parts) != 2 or not g.is_op(parts[0], "sub") or not g.is_op(parts[1], "add"):
        return None
    first, second = _products(parts[0]), _products(parts[1])
    if first is None or second is None:
        return None
    for x1, cos in g.commuted(first[0]):
        for x2, sin in g.commuted(first[1]):
            found = _halves(x1, x2)
            if found is None or not isinstance(cos, fx.Node) or not isinstance(sin, fx.Node):
                continue
            # the second half: x2 * cos + x1 * sin, products and operands in any order
            wanted = {frozenset((x2, cos)), frozenset((x1, sin))}
            if {frozenset(m.args) for m in second} != wanted or len(wanted) != 2:
                continue
            x, chunk = found
            return {"x": x, "out": cat, "cos": cos, "sin": sin, "rotary_dim": g.static_int(g.tensor(x).shape[-1]),
                    "partial": False, "nodes": [cat, parts[0], parts[1], *first, *second, x1, x2, chunk]}
    return None


# ---------------------------------------------------------------------------------------------
# search


def _is_mul(node) -> bool:
    return g.is_op(node, "mul") and g.binary_operands(node) is not None


def _rotated_operand(node) -> bool:
    return isinstance(node, fx.Node) and (
        (node.op == "call_function" and node.target is torch.cat) or _is_flatten(node)
    )


def anchor(node) -> bool:
    """add of two products, one of which multiplies a cat or a flatten (the rotated x); or a cat
    of a difference and a sum of products (the rotation of halves)."""
    if _halves_anchor(node):
        return True
    if not g.is_op(node, "add") or g.binary_operands(node) is None:
        return False
    if not all(_is_mul(a) for a in node.args):
        return False
    return any(_rotated_operand(x) for m in node.args for x in m.args)


def _halves_anchor(node) -> bool:
    parts = joined(node, "cat")
    return (parts is not None and len(parts) == 2 and g.is_op(parts[0], "sub") and g.is_op(parts[1], "add")
            and _products(parts[0]) is not None and _products(parts[1]) is not None)


def _rotation(add: fx.Node, form):
    """(x, cos, sin, nodes) of add = x * cos + form(x) * sin, or None."""
    if not anchor(add):
        return None
    for m1, m2 in g.commuted(add):
        for x, cos in g.commuted(m1):
            if not isinstance(x, fx.Node) or not isinstance(cos, fx.Node):
                continue
            for rot, sin in g.commuted(m2):
                if not isinstance(sin, fx.Node):
                    continue
                nodes = form(rot, x)
                if nodes is not None:
                    return x, cos, sin, [add, m1, m2, *nodes]
    return None


def _widened(x: fx.Node, out: fx.Node):
    """Partial rotary: (base, cat, pass_node, rotary_dim) if x = base[..., :r] and the rotation's
    only use is cat([out, base[..., r:]], -1); else None."""
    sliced = _last_dim_slice(x)
    if sliced is None:
        return None
    base, start, stop, step = sliced
    if start not in (None, 0) or step not in (None, 1) or not isinstance(stop, int):
        return None
    cat = g.single_user(out)
    parts = joined(cat, "cat")
    if parts is None or len(parts) != 2 or parts[0] is not out:
        return None
    rest = _last_dim_slice(parts[1])
    if rest is None or rest[0] is not base or rest[1:] not in {(stop, None, None), (stop, None, 1)}:
        return None
    return base, cat, parts[1], stop


def rotated_tensor(add: fx.Node, form):
    """One rotated tensor: dict(x, out, cos, sin, rotary_dim, partial, nodes), or None."""
    if form is rotated_halves:
        return rotated_halves(add)
    found = _rotation(add, form)
    if found is None:
        return None
    x, cos, sin, nodes = found
    wide = _widened(x, add)
    if wide is not None:
        base, cat, rest, rotary_dim = wide
        return {"x": base, "out": cat, "cos": cos, "sin": sin, "rotary_dim": rotary_dim, "partial": True,
                    "nodes": [*nodes, x, cat, rest]}
    width = g.static_int(g.tensor(x).shape[-1])
    return {"x": x, "out": add, "cos": cos, "sin": sin, "rotary_dim": width, "partial": False, "nodes": nodes}


def _same_value(a, b, depth: int = 6) -> bool:
    """a and b compute the same value: the same node, or the same pure call on the same values
    (GPT-J recomputes cos/sin with `repeat_interleave` for q and for k)."""
    if a is b:
        return True
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or depth == 0:
        return a == b if not isinstance(a, fx.Node) and not isinstance(b, fx.Node) else False
    if a.op != b.op or a.target != b.target or a.op not in ("call_function", "call_method"):
        return False
    if g.tensor(a) is None or getattr(a.target, "__name__", a.target) in _IMPURE:
        return False
    if len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
        return False
    pairs = [*zip(a.args, b.args), *((a.kwargs[k], b.kwargs[k]) for k in a.kwargs)]
    return all(_same_value(x, y, depth - 1) for x, y in pairs)


# calls that do not give the same value twice
_IMPURE = {"rand", "randn", "rand_like", "randn_like", "dropout", "bernoulli", "normal_"}


def _cos_sin_nodes(node: fx.Node) -> list[fx.Node]:
    """node and the call nodes it is computed from (up to a few levels), for erasing."""
    out, todo = [], [node]
    while todo and len(out) < 16:
        n = todo.pop()
        if isinstance(n, fx.Node) and n.op in ("call_function", "call_method") and n not in out:
            out.append(n)
            todo.extend(a for a in n.all_input_nodes)
    return out


# how far after the first rotation its partner is looked for when cos/sin are recomputed for it
# (GPT-J: 12 nodes); a partner reading the very same cos node is found wherever it is
_PARTNER_WINDOW = 100


def _candidates(first: dict, add: fx.Node):
    seen = {add}
    for mul in first["cos"].users:
        if _is_mul(mul):
            for other in mul.users:
                if other not in seen:
                    seen.add(other)
                    yield other
    node = add.next
    for _ in range(_PARTNER_WINDOW):
        if node.op == "output":
            return
        if node not in seen and anchor(node):
            seen.add(node)
            yield node
        node = node.next


def _partner(first: dict, add: fx.Node, form):
    """The other rotation reading the same cos and sin (k for q), or None."""
    for other in _candidates(first, add):
        if getattr(other, "_erased", False):
            continue
        second = rotated_tensor(other, form)
        if (
            second is not None
            and _same_value(second["cos"], first["cos"])
            and _same_value(second["sin"], first["sin"])
            and second["rotary_dim"] == first["rotary_dim"]
            and second["partial"] == first["partial"]
            and second["x"] is not first["x"]
        ):
            return second
    return None


def _variant(form_name: str, partial: bool, single: bool) -> str:
    """<form>[_partial][_single]: partial rotary, and a lone rotation (no k sharing cos/sin)."""
    return form_name + ("_partial" if partial else "") + ("_single" if single else "")


def _search(form_name, form, partial: bool, single: bool):
    def search(add: fx.Node) -> Match | None:
        first = rotated_tensor(add, form)
        if first is None or bool(first["partial"]) != partial:
            return None
        second = _partner(first, add, form)
        if (second is None) != single:
            return None
        variant = _variant(form_name, partial, single)
        nodes = [*first["nodes"], *(second["nodes"] if second else ())]
        return Match(
            variant=variant,
            anchor=add,
            nodes=list(dict.fromkeys(nodes)),
            bindings={
                "q": first["x"],
                "q_out": first["out"],
                "k": second["x"] if second else None,
                "k_out": second["out"] if second else None,
                "cos": first["cos"],
                "sin": first["sin"],
                "form": form_name,
                "rotary_dim": first["rotary_dim"],
                # the partner's own cos/sin computation, dead once the call reads the first's
                "dead": [
                    n
                    for name in ("cos", "sin")
                    if second and second[name] is not first[name]
                    for n in _cos_sin_nodes(second[name])
                ],
            },
        )

    return search


# ---------------------------------------------------------------------------------------------
# guards


device_supported = g.device_supported(lambda b: b["q"])


def dtypes_agree(m: Match, cfg) -> str | None:
    b = m.bindings
    dtype = g.dtype(b["q"])
    if dtype not in g.FLOAT_DTYPES:
        return f"q dtype {dtype} is not float32/float16/bfloat16"
    if b["k"] is not None and g.dtype(b["k"]) != dtype:
        return f"k dtype {g.dtype(b['k'])} differs from q dtype {dtype}"
    for name in ("cos", "sin"):
        d = g.dtype(b[name])
        if d not in (dtype, torch.float32):
            return f"{name} dtype {d} is neither q's dtype {dtype} nor float32"
    for name in ("q_out", "k_out"):
        out = b[name]
        if out is None or g.dtype(out) == dtype:
            continue
        # q in bf16 (a projection under autocast) times fp32 cos/sin is fp32 math: the op's own
        # (q_out_dtype / k_out_dtype), or, where every reader rounds it back to q's dtype
        # (autocast's cast for the attention), that rounding done once in the op
        if not (g.dtype(out) == torch.float32 and torch.float32 in (g.dtype(b["cos"]), g.dtype(b["sin"]))):
            return (f"result dtype {g.dtype(out)} differs from input dtype {dtype} "
                    "(mixed-dtype math)")
    return None


def shapes_fit(m: Match, cfg) -> str | None:
    b = m.bindings
    rotary_dim = b["rotary_dim"]
    if not isinstance(rotary_dim, int):
        return "rotary dim is symbolic"
    if rotary_dim % 2:
        return f"rotary dim {rotary_dim} is odd"
    tensors = [g.tensor(b["q"])] + ([g.tensor(b["k"])] if b["k"] is not None else [])
    for t in tensors:
        if t is None or t.dim() != 4:
            return "q/k are not 4-d"
        if g.static_int(t.shape[-1]) is None:
            return "head dim is symbolic"
    if b["k"] is not None and g.static_int(tensors[1].shape[-1]) != g.static_int(tensors[0].shape[-1]):
        return "q and k head dims differ"
    return cos_sin_misfit(b, rotary_dim, tensors, halves=b["form"] == "halves")


def cos_sin_misfit(b: dict, rotary_dim: int, tensors, halves: bool = False) -> str | None:
    """Why the bindings' cos and sin cannot rotate `tensors` (4-d, last dim rotary_dim, or half of
    it for the rotation of halves, the first three dims 1 or the tensors'), or None (also
    rope_attention's check)."""
    width = rotary_dim // 2 if halves else rotary_dim
    for name in ("cos", "sin"):
        c = g.tensor(b[name])
        if c is None or c.dim() != 4:
            return f"{name} is not 4-d (broadcast as the rotation needs)"
        if g.static_int(c.shape[-1]) != width:
            return f"{name} last dim {c.shape[-1]} is not {'half ' if halves else ''}the rotary dim {rotary_dim}"
        for t in tensors:
            for d in range(3):
                if not (c.shape[d] == 1 or c.shape[d] == t.shape[d]):
                    return f"{name} of shape {tuple(c.shape)} does not broadcast to {tuple(t.shape)}"
    return None


def cos_sin_constant(m: Match, cfg) -> str | None:
    for name in ("cos", "sin"):
        if getattr(g.tensor(m.bindings[name]), "requires_grad", False):
            return f"{name} requires grad (the op does not differentiate cos/sin)"
    return None


def intermediates_private(m: Match, cfg) -> str | None:
    b = m.bindings
    leaked = g.escaping(m.nodes, keep=[n for n in (b["q_out"], b["k_out"]) if n is not None])
    if leaked:
        return f"intermediate {', '.join(sorted(n.name for n in leaked))} is used elsewhere"
    return None


def _order(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _last_input(m: Match, order: dict) -> fx.Node:
    b = m.bindings
    inputs = [b[k] for k in ("q", "k", "cos", "sin") if b[k] is not None]
    return max(inputs, key=order.__getitem__)


def order_allows(m: Match, cfg) -> str | None:
    """One call must come after every input and before every use of either output."""
    b = m.bindings
    order = _order(m.anchor.graph)
    last = order[_last_input(m, order)]
    for out in (b["q_out"], b["k_out"]):
        if out is not None and any(order[u] <= last for u in out.users):
            return f"{out.name} is used before the other rotation's inputs exist"
    return None


def _positions(m: Match) -> Sizes | None:
    """How many positions the rotation covers: cos's non-batch, non-channel extent ([B, 1, S, r]
    for [B, H, S, D] q/k, [B, S, 1, r] for GPT-J's [B, S, H, D]), static or symbolic."""
    dims = [n for n in g.tensor(m.bindings["cos"]).shape[1:3] if g.static_int(n) != 1]
    if len(dims) <= 1:
        return g.sizes(dims[0]) if dims else Sizes.static(1)
    static = [g.static_int(n) for n in dims]
    return None if None in static else Sizes.static(max(static))


@dataclasses.dataclass(frozen=True)
class Options:
    """rope's cost rule: the bounds of POSITIONS, SIZE and INTERLEAVED_SIZE, and the switch
    ANY_SIZE."""

    kernel: bool = option(False, "route every match to fusionpass::rope, whatever its size")
    max_bytes: int = option(96 * 2**20, "largest q + k fused (bytes)")
    interleaved_max_bytes: int = option(48 * 2**20, "largest q + k fused in the full interleaved form (bytes)")
    min_tokens: int = option(64, "fewest positions rotated")


FIELDS = fields(Options)


# The cost rules (why: benchmarks/results/latest/rope.md): decode-sized rotations stay with
# Inductor, which writes the rotated k into a static KV cache in the same kernel; large ones stay
# with Inductor too, sooner for the interleaved form with every channel rotated (partial
# interleaved rotary, GPT-J's own form, keeps rope_max_bytes).
ANY_SIZE = Switch(FIELDS.kernel)
POSITIONS = Range.always("positions", FIELDS.min_tokens, None)
SIZE = Range.always("q and k", None, FIELDS.max_bytes, unit="MiB", scale=2**20)
INTERLEAVED_SIZE = Range.always("q and k (interleaved, every channel rotated)", None, FIELDS.interleaved_max_bytes,
                                unit="MiB", scale=2**20)


def cost_rule(m: Match, cfg) -> str | None:
    """The cost rules (POSITIONS, SIZE, INTERLEAVED_SIZE), unless rope_kernel."""
    if ANY_SIZE.on(cfg):
        return None
    tensors = [g.tensor(m.bindings[n]) for n in ("q", "k") if m.bindings[n] is not None]
    nbytes = g.sizes(sum(t.numel() * t.element_size() for t in tensors))
    positions = _positions(m)
    if nbytes is None or positions is None:
        return "sizes the cost rule cannot read (rope_kernel=True routes it anyway)"
    head_dim = g.static_int(tensors[0].shape[-1])
    full_interleaved = m.bindings["form"] == "interleaved" and m.bindings["rotary_dim"] == head_dim
    size = INTERLEAVED_SIZE if full_interleaved else SIZE
    return POSITIONS.check_sizes(positions, "inference", cfg) or size.check_sizes(nbytes, "inference", cfg)


# ---------------------------------------------------------------------------------------------
# replacement


ROPE_ARGS = ("q", "k", "cos", "sin", "form", "rotary_dim", "q_out_dtype", "k_out_dtype")


def rope_call_args(call: fx.Node) -> dict:
    """A fusionpass::rope call's arguments by name."""
    return g.call_args(call, ROPE_ARGS, {"q_out_dtype": None, "k_out_dtype": None})


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    b = m.bindings
    before = _last_input(m, _order(graph)).next
    cos, sin, form = b["cos"], b["sin"], b["form"]
    if form == "halves":  # rotate_half over cos and sin repeated twice
        cos, sin = (g.insert_call(graph, before, torch.cat, ((t, t),), b["q_out"], kwargs={"dim": -1})
                    for t in (cos, sin))
        form = "rotate_half"
    kwargs = dict(form=form, rotary_dim=b["rotary_dim"])
    for name, x in (("q", b["q"]), ("k", b["k"])):
        out = b[f"{name}_out"]
        if out is not None and g.dtype(out) != g.dtype(x) and autocast.rounded_by_readers(out) is None:
            kwargs[f"{name}_out_dtype"] = g.dtype(out)  # fp32, as eager's promotion gives (guard dtype)
    fused = g.insert_call(graph, before, torch.ops.fusionpass.rope.default, (b["q"], b["k"], cos, sin),
                          b["q_out"], kwargs=kwargs)
    q_new, k_new = g.insert_getitems(graph, fused, 2)
    b["q_out"].replace_all_uses_with(q_new)
    if b["k_out"] is not None:
        b["k_out"].replace_all_uses_with(k_new)
    for new in (q_new, k_new):
        autocast.drop_noop_casts(new)  # the rounding the readers did (guard dtype)
    g.erase_unused(graph, m.nodes)
    g.erase_unused(graph, b["dead"])


ROPE = registry.register(
    Fusion(
        name="rope",
        summary='rotary embedding of q and k in one launch (HF `rotate_half`, GPT-J interleaved, gpt-oss halves, '
                'partial rotary)',
        options=Options,
        cost=(ANY_SIZE, POSITIONS, SIZE, INTERLEAVED_SIZE, NOT_AUTOTUNED_TRAINING),
        matches=(
            "rotary embedding x * cos + rot(x) * sin with HF rotate_half (Llama, GPT-NeoX, Phi-3) or "
            "GPT-J's interleaved rotate_every_two, partial rotary (slice + cat) included, or gpt-oss's "
            "rotation of halves cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin); q and k "
            "sharing cos/sin are rotated by one call"
        ),
        selected_when=(
            "CUDA tensors; 4-d q/k of one float dtype, cos/sin in that dtype or float32 broadcasting "
            "over them, even rotary dim, cos/sin without grad"
        ),
        anchor=anchor,
        variants=(
            *(Variant(_variant(name, partial, single), _search(name, form, partial, single))
              for name, form in FORMS
              for partial in (False, True)
              for single in (False, True)),
            *(Variant(_variant("halves", False, single), _search("halves", rotated_halves, False, single))
              for single in (False, True)),
        ),
        guards=(
            Guard("device", device_supported),
            Guard("dtype", dtypes_agree),
            Guard("shape", shapes_fit),
            Guard("cos_sin_grad", cos_sin_constant),
            Guard("intermediates", intermediates_private),
            Guard("order", order_allows),
            Guard("cost", cost_rule),
        ),
        replace=replace,
        unmatched="add of two products found, but not x * cos + rotate_half(x) / "
        "rotate_every_two(x) * sin",
    )
)
