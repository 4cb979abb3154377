"""What a materialized attention mask computes, proven from the graph that builds it.

transformers 5.x builds SDPA masks under torch.compile from index arithmetic
(`masking_utils.sdpa_mask`): `arange` vectors placed on the query or key axis, compared
(`kv_idx <= q_idx`, `kv_idx > q_idx - window`, `q_idx >= 0`), AND-ed with each other and with a
key-padding lookup `attention_mask[batch_idx, kv_idx]`, then expanded to [B, 1, Q, KV]. Instead of
matching each spelling, this module evaluates that graph abstractly:

  - an index tensor is an affine function of the mask's axes (`Affine`), axes numbered from the
    right so broadcasting needs no bookkeeping (-1: key position, -2: query position);
  - a comparison of two affine values is a linear constraint `sum(coef * axis) + const <= 0`;
  - a lookup into a tensor that only exists at run time is a `RuntimeTerm`: key padding
    `padding[batch, kv]`, or sequence segments `seg[batch, q] == seg[batch, kv]` (the packed
    sequences transformers finds in position ids);
  - AND collects all of these; `expand`, `.to(device)` and bool casts change nothing.

Any op outside that vocabulary makes the mask unprovable (a near miss with its name).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator

import torch
import torch.fx as fx

from fusionpass.patterns import graph as g

Q_AXIS, KV_AXIS = -2, -1

# {placeholder of a called subgraph: the argument its caller passes}, while the pass proves masks
# in the body of a checkpointed layer from the graph that calls it (`proven_in_caller`)
_CALLER_ARGUMENTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fusionpass_caller_arguments",
                                                                                default=None)


@contextlib.contextmanager
def proven_in_caller(arguments: dict):
    """While open, a mask that is an input of a called subgraph (a `tag_activation_checkpoint`
    body: a checkpointed layer) is evaluated as the value its caller passes: the body computes
    with exactly that tensor, in the forward and in the backward's recomputation alike."""
    token = _CALLER_ARGUMENTS.set(arguments)
    try:
        yield
    finally:
        _CALLER_ARGUMENTS.reset(token)


class Unprovable(Exception):
    """The mask graph uses something this analysis cannot reason about."""


@dataclasses.dataclass(frozen=True)
class Affine:
    coef: tuple[tuple[int, int], ...]  # ((axis, coefficient), ...), axes counted from the right
    const: int
    lengths: tuple[tuple[int, object], ...] = ()  # (axis, length of the arange placed there)

    def terms(self) -> dict[int, int]:
        return dict(self.coef)

    def shifted(self, c: int) -> Affine:
        return Affine(self.coef, self.const + c, self.lengths)

    def plus(self, other: Affine, sign: int = 1) -> Affine:
        terms = self.terms()
        for axis, k in other.coef:
            terms[axis] = terms.get(axis, 0) + sign * k
        lengths = dict(self.lengths)
        lengths.update(other.lengths)
        return Affine(
            tuple(sorted((a, k) for a, k in terms.items() if k)),
            self.const + sign * other.const,
            tuple(sorted(lengths.items())),
        )


@dataclasses.dataclass(frozen=True)
class Abs:
    """|x| of an index value x (ModernBERT's `abs(q_idx - kv_idx) <= w`): only `|x| <= c` (and
    `< c`) with a constant c is a mask, the two constraints x <= c and -x <= c."""

    of: Affine


@dataclasses.dataclass(frozen=True)
class Constraint:
    """sum(coef * axis) + const <= 0 over integer positions."""

    coef: tuple[tuple[int, int], ...]
    const: int


@dataclasses.dataclass(frozen=True)
class RuntimeTerm:
    what: str
    source: fx.Node
    # the index values of the lookup `source[index...]`, one Affine per dim of source (for the
    # key-padding route to check it is exactly source[batch, kv])
    index: tuple = dataclasses.field(default=(), compare=False)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """`source[index...]` of a tensor that exists only at run time, before it is used: as a mask
    (key padding, when it reads the key axis only) or compared for equality with another lookup
    into the same tensor (sequence segments)."""

    source: fx.Node
    index: tuple  # one Affine per dim of source
    axes: frozenset  # the mask axes the index reads


KEY_PADDING, SEGMENTS, POSITIONS = "key padding", "sequence segments", "positions"


@dataclasses.dataclass(frozen=True)
class Conjunction:
    constraints: tuple[Constraint, ...] = ()
    runtime: tuple[RuntimeTerm, ...] = ()
    lengths: tuple[tuple[int, object], ...] = ()

    def and_(self, other: Conjunction) -> Conjunction:
        return Conjunction(
            self.constraints + other.constraints,
            self.runtime + other.runtime,
            tuple(sorted(dict(self.lengths + other.lengths).items())),
        )


TRUE = Conjunction()


@dataclasses.dataclass(frozen=True)
class Constant:
    """A tensor every element of which equals `value` (e.g. transformers' packed-sequence ids
    computed from position ids that are a plain arange)."""

    value: object

_COMPARISONS = {
    operator.le: "le",
    operator.lt: "lt",
    operator.ge: "ge",
    operator.gt: "gt",
    torch.le: "le",
    torch.lt: "lt",
    torch.ge: "ge",
    torch.gt: "gt",
    "le": "le",
    "lt": "lt",
    "ge": "ge",
    "gt": "gt",
    "__le__": "le",
    "__lt__": "lt",
    "__ge__": "ge",
    "__gt__": "gt",
}
_EQUALITIES = {operator.eq: "eq", torch.eq: "eq", "eq": "eq", "__eq__": "eq",
               operator.ne: "ne", torch.ne: "ne", "ne": "ne", "__ne__": "ne"}
_ANDS = {operator.and_, torch.logical_and, torch.bitwise_and, "logical_and", "__and__", "bitwise_and"}
_ABS = {abs, operator.abs, torch.abs, "abs", "__abs__"}


def _target(node: fx.Node):
    return node.target if node.op in ("call_function", "call_method") else None


def _constraint(kind: str, a: Affine, b: Affine) -> Constraint:
    if kind in ("ge", "gt"):
        a, b, kind = b, a, "le" if kind == "ge" else "lt"
    diff = a.plus(b, -1)  # a - b <= 0  (a - b + 1 <= 0 for <, over integers)
    return Constraint(diff.coef, diff.const + (1 if kind == "lt" else 0))


def _abs_constraints(kind: str, a, b) -> tuple[Constraint, ...]:
    """|x| <= c (or < c, or c >= |x|, c > |x|) with a constant c: x <= c and -x <= c."""
    if isinstance(b, Abs):
        a, b, kind = b, a, {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt"}[kind]
    if not (isinstance(a, Abs) and isinstance(b, Affine) and not b.coef and kind in ("le", "lt")):
        raise Unprovable("|x| compared other than as |x| <= constant")
    x = a.of
    minus_x = Affine(tuple((axis, -k) for axis, k in x.coef), -x.const, x.lengths)
    return _constraint(kind, x, b), _constraint(kind, minus_x, b)


def _index_placement(node: fx.Node, src: Affine) -> Affine:
    """x[(None, None, slice(None), None)]: move the 1-D index onto the axis the slice lands on."""
    index = node.args[1]
    if not isinstance(index, tuple) or src.coef == () or len(src.coef) != 1 or src.coef[0][0] != -1:
        raise Unprovable("indexing of a non-1-D index vector")
    if any(not (i is None or (isinstance(i, slice) and i == slice(None))) for i in index):
        raise Unprovable("index vector sliced or gathered")
    if sum(isinstance(i, slice) for i in index) != 1:
        raise Unprovable("index vector with several slices")
    pos = next(p for p, i in enumerate(index) if isinstance(i, slice))
    axis = pos - len(index)
    (_, k), = src.coef
    length = dict(src.lengths).get(-1)
    return Affine(((axis, k),), src.const, ((axis, length),))


def _as_mask(value) -> Conjunction:
    if isinstance(value, Conjunction):
        return value
    if isinstance(value, Lookup):
        if KV_AXIS in value.axes and Q_AXIS not in value.axes:
            return Conjunction((), (RuntimeTerm(KEY_PADDING, value.source, value.index),))
        raise Unprovable("lookup into a run-time tensor by query position")
    if isinstance(value, Constant) and value.value is True:
        return TRUE
    raise Unprovable("AND of a value that is not a proven mask")


def _reindexed_mask(node: fx.Node, mask: Conjunction) -> Conjunction:
    """mask[None, None], mask[:, None]: new size-1 dims in front of the query and key axes leave
    them where they are (axes count from the right); anything else is not proven."""
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    ndim = g.tensor(node.args[0]).dim()
    consumed = 0
    for item in index:
        if item is None:
            if consumed > ndim - 2:
                raise Unprovable("mask indexed with a new dim between its query and key axes")
        elif item == slice(None):
            consumed += 1
        else:
            raise Unprovable("mask sliced or gathered")
    return mask


def _gathered(node: fx.Node, src: Affine, placements: list) -> Affine:
    """position_ids[batch_idx, q_idx] where position_ids is itself an index tensor (transformers
    >= 5.2x compares positions, not raw indices): the source's affine function evaluated at the
    index vectors."""
    ndim = g.tensor(node.args[0]).dim()
    if len(placements) != ndim or not all(isinstance(p, Affine) for p in placements):
        raise Unprovable("gather from an index tensor with other than one index per dim")
    result = Affine((), src.const)
    for pos, placement in enumerate(placements):
        k = src.terms().get(pos - ndim, 0)
        if k:
            scaled = Affine(tuple((a, k * c) for a, c in placement.coef), k * placement.const,
                            placement.lengths)
            result = result.plus(scaled)
    return result


def _first_positions(node: fx.Node, src) -> Affine:
    """x[:, :1] (plain slices, each whole or the first position): the value at position 0 of the
    sliced axes, i.e. the affine value without their terms."""
    if not isinstance(src, Affine):
        raise Unprovable("slice of a non-index value")
    index = node.args[1]
    terms = src.terms()
    for pos, item in enumerate(index):
        axis = pos - g.tensor(node.args[0]).dim()
        if item == slice(None):
            continue
        if item.step in (None, 1) and item.start in (None, 0) and item.stop == 1:
            terms.pop(axis, None)
            continue
        raise Unprovable("index vector sliced")
    return Affine(tuple(sorted(terms.items())), src.const)


def _unsqueezed(node: fx.Node, src):
    """Axes are numbered from the right: a new dim moves only the axes left of it."""
    if isinstance(src, Constant):
        return src
    if not isinstance(src, Affine):
        raise Unprovable("unsqueeze of a non-index value")
    ndim = g.tensor(node.args[0]).dim()
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    pos = dim if dim >= 0 else dim + ndim + 1  # position of the new dim in the output
    moved = lambda axis: axis - 1 if ndim + axis < pos else axis  # noqa: E731
    return Affine(
        tuple(sorted((moved(a), k) for a, k in src.coef)),
        src.const,
        tuple(sorted((moved(a), n) for a, n in src.lengths)),
    )


def _diff(node: fx.Node, src, prepend) -> Constant:
    """torch.diff(x, prepend=x[..., :1] - k, dim=-1) of x = k * i + c along the last axis is k
    everywhere (transformers' packed-sequence detection on plain position ids)."""
    dim = node.kwargs.get("dim", -1)
    if (
        set(node.kwargs) - {"dim", "prepend"}
        or len(node.args) != 1
        or dim != -1
        or not isinstance(src, Affine)
        or not isinstance(prepend, Affine)
    ):
        raise Unprovable("diff of a non-index value")
    k = src.terms().get(-1, 0)
    if set(src.terms()) != {-1} or prepend.coef or prepend.const != src.const - k:
        raise Unprovable("diff of a non-arange value")
    return Constant(k)


def _segments(kind: str, a, b) -> Conjunction:
    """seg[batch, q] == seg[batch, kv] (either order): a query sees only keys of its own sequence
    segment, with the same batch index and no other term on either side."""
    if kind != "eq" or not (isinstance(a, Lookup) and isinstance(b, Lookup)) or a.source is not b.source:
        raise Unprovable(f"`{kind}` of run-time lookups other than seg[batch, q] == seg[batch, kv]")
    a, b = _query_and_key_lookups(a, b)
    # (batch, q position, kv position) for attention_kernel.segment_vector to check
    return Conjunction((), (RuntimeTerm(SEGMENTS, a.source, (a.index[0], a.index[1], b.index[1])),))


def _unexpanded(node):
    """`node` without the `expand` calls on it (an expand repeats rows; it changes no value a
    lookup at batch b reads)."""
    while isinstance(node, fx.Node) and _target(node) == "expand":
        node = node.args[0]
    return node


def _query_and_key_lookups(a: Lookup, b: Lookup):
    """(batch placement, q Affine, kv Affine) of x[batch, q] and x[batch, kv] (either order) of
    one tensor, else Unprovable."""
    if _unexpanded(a.source) is not _unexpanded(b.source):
        raise Unprovable("comparison of lookups into two run-time tensors")
    if KV_AXIS in a.axes:
        a, b = b, a
    if len(a.index) != 2 or len(b.index) != 2 or a.index[0] != b.index[0]:
        raise Unprovable("lookups of other than two indices, or of other batch indices")
    (q_terms, kv_terms) = (a.index[1].terms(), b.index[1].terms())
    if q_terms != {Q_AXIS: 1} or kv_terms != {KV_AXIS: 1} or a.index[1].const or b.index[1].const:
        raise Unprovable("lookups not at the query and key positions")
    return a, b


def _positions_compared(kind: str, a: Lookup, b: Lookup) -> Conjunction:
    """pos[batch, kv] <= pos[batch, q] (and the other comparisons): transformers >= 5.2x's causal
    rule on packed sequences, position ids read at both indices. Within one sequence segment of
    those position ids (`classify` requires the mask to AND the segments of the same tensor) the
    ids step by exactly 1, so the comparison is that of the indices themselves: the constraint is
    kept on the indices, with a POSITIONS term for `classify` to check."""
    q_side, kv_side = _query_and_key_lookups(a, b)
    first_is_q = a is q_side
    x, y = (q_side.index[1], kv_side.index[1]) if first_is_q else (kv_side.index[1], q_side.index[1])
    lengths = tuple(sorted(dict(x.lengths + y.lengths).items()))
    term = RuntimeTerm(POSITIONS, _unexpanded(q_side.source), (q_side.index[0], q_side.index[1], kv_side.index[1]))
    return Conjunction((_constraint(kind, x, y),), (term,), lengths)


def segments_of(node) -> fx.Node | None:
    """X (without expands) where `node` is transformers' `(diff(X, prepend=X[:, :1] - 1, dim=-1) !=
    1).cumsum(-1)`: the sequence segments of position ids X, within each of which X steps by 1."""
    if not (isinstance(node, fx.Node) and _target(node) in ("cumsum", torch.cumsum)):
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    ne = node.args[0]
    if dim != -1 or not (isinstance(ne, fx.Node) and _target(ne) in (operator.ne, torch.ne, "ne", "__ne__")):
        return None
    diff, one = ne.args[:2]
    if one != 1 or not (isinstance(diff, fx.Node) and _target(diff) is torch.diff):
        return None
    if diff.kwargs.get("dim", -1) != -1 or len(diff.args) != 1:
        return None
    x, prepend = diff.args[0], diff.kwargs.get("prepend")
    if not (isinstance(prepend, fx.Node) and _target(prepend) in (operator.sub, torch.sub, "sub")
            and prepend.args[1] == 1):
        return None
    first = prepend.args[0]
    if not (isinstance(first, fx.Node) and _target(first) is operator.getitem and first.args[0] is x
            and first.args[1] == (slice(None), slice(None, 1, None))):
        return None
    return _unexpanded(x)


class MaskAnalysis:
    """Evaluates the nodes that build one mask; results are memoized per node."""

    def __init__(self):
        self.memo: dict[fx.Node, object] = {}
        self.nodes: set[fx.Node] = set()

    def value(self, arg):
        if isinstance(arg, bool):
            if not arg:
                raise Unprovable("constant False mask")
            return TRUE
        if isinstance(arg, int):
            return Affine((), arg)
        if not isinstance(arg, fx.Node):
            raise Unprovable(f"mask operand {arg!r}")
        if arg not in self.memo:
            self.memo[arg] = self._eval(arg)
            self.nodes.add(arg)
        return self.memo[arg]

    def _eval(self, node: fx.Node):
        caller = _CALLER_ARGUMENTS.get()
        if node.op == "placeholder" and caller is not None and node in caller:
            return self.value(caller[node])
        if node.op == "placeholder":
            # built in another graph: a graph break, or DDP's graph split at bucket boundaries
            # (docs/parallelism.md), hands this graph the finished mask, whose values are unknown
            raise Unprovable(f"the mask is an input of this graph ({node.target}), built in "
                             "another graph")
        t = _target(node)
        if t is torch.arange:
            if len(node.args) != 1 or set(node.kwargs) - {"device", "dtype"}:
                raise Unprovable("arange with start/step")
            return Affine(((-1, 1),), 0, ((-1, g.value(node.args[0])),))
        if t in (operator.add, operator.sub, torch.add, torch.sub, "add", "sub"):
            a, b = (self.value(x) for x in node.args[:2])
            if node.kwargs or not (isinstance(a, Affine) and isinstance(b, Affine)):
                raise Unprovable("arithmetic on a non-index value")
            sign = -1 if t in (operator.sub, torch.sub, "sub") else 1
            return a.plus(b, sign)
        if t is operator.getitem:
            src = node.args[0]
            index = node.args[1]
            if isinstance(index, tuple) and any(isinstance(i, fx.Node) for i in index):
                return self._lookup(node)
            value = self.value(src)
            if isinstance(value, Constant):
                return value
            if isinstance(value, Conjunction):
                return _reindexed_mask(node, value)
            if isinstance(index, tuple) and index and all(isinstance(i, slice) for i in index):
                return _first_positions(node, value)
            return _index_placement(node, value)
        if t in _EQUALITIES:
            a, b = (self.value(x) for x in node.args[:2])
            if isinstance(a, Lookup) or isinstance(b, Lookup):
                return _segments(_EQUALITIES[t], a, b)
            if isinstance(a, Affine) and not a.coef:
                a = Constant(a.const)
            if isinstance(b, Affine) and not b.coef:
                b = Constant(b.const)
            if not (isinstance(a, Constant) and isinstance(b, Constant)):
                raise Unprovable(f"`{_EQUALITIES[t]}` of values not proven constant")
            return Constant((a.value == b.value) == (_EQUALITIES[t] == "eq"))
        if t is torch.diff:
            return _diff(node, self.value(node.args[0]), self.value(node.kwargs.get("prepend")))
        if t == "cumsum":
            src = self.value(node.args[0])
            if isinstance(src, Constant) and src.value in (0, False):
                return Constant(0)
            raise Unprovable("cumsum of a value not proven zero")
        if t == "unsqueeze":
            return _unsqueezed(node, self.value(node.args[0]))
        if t in _ABS:
            src = self.value(node.args[0])
            if not isinstance(src, Affine):
                raise Unprovable("abs of a non-index value")
            return Abs(src)
        if t in _COMPARISONS:
            a, b = (self.value(x) for x in node.args[:2])
            if isinstance(a, Abs) or isinstance(b, Abs):
                x = a.of if isinstance(a, Abs) else b.of
                return Conjunction(_abs_constraints(_COMPARISONS[t], a, b), (), x.lengths)
            if isinstance(a, Lookup) and isinstance(b, Lookup):
                return _positions_compared(_COMPARISONS[t], a, b)
            if isinstance(a, Lookup) or isinstance(b, Lookup):
                raise Unprovable("comparison of run-time lookups (position ids read at the query and key "
                                 "indices)")
            if not (isinstance(a, Affine) and isinstance(b, Affine)):
                raise Unprovable("comparison of non-index values")
            lengths = tuple(sorted(dict(a.lengths + b.lengths).items()))
            return Conjunction((_constraint(_COMPARISONS[t], a, b),), (), lengths)
        if t in _ANDS:
            a, b = (_as_mask(self.value(x)) for x in node.args[:2])
            return a.and_(b)
        if t in ("new_ones", torch.ones):
            # ones of another dtype: the attention_mask BLOOM makes when none is passed
            return TRUE if g.dtype(node) == torch.bool else Constant(1)
        if t in ("to", "expand", "contiguous"):
            src = self.value(node.args[0])
            if isinstance(src, Lookup):
                # (a cast to bool keeps the lookup: key_padding_vector checks the source's dtype)
                if t == "to" and g.dtype(node) not in (g.dtype(node.args[0]), torch.bool):
                    raise Unprovable("run-time lookup cast to another dtype")
                return src
            if t == "to" and g.dtype(node) != g.dtype(node.args[0]):
                if not (isinstance(src, (Conjunction, Constant)) and g.dtype(node) == torch.bool):
                    raise Unprovable("mask cast to another dtype")
                if isinstance(src, Constant):
                    if not src.value:
                        raise Unprovable("constant False mask")
                    return Constant(True)
            return src
        name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
        raise Unprovable(f"mask built with `{name}`")

    def _lookup(self, node: fx.Node):
        """attention_mask[batch_idx, kv_idx]: key padding whose values exist only at run time
        (or a gather from a tensor proven constant, which stays that constant)."""
        source = node.args[0]
        index = node.args[1]
        try:
            value = self.value(source)
        except Unprovable:
            value = None
        if isinstance(value, Constant):
            return value
        placements = [self.value(i) for i in index]
        if isinstance(value, Affine):
            return _gathered(node, value, placements)
        axes = frozenset(a for p in placements if isinstance(p, Affine) for a, _ in p.coef)
        return Lookup(source, tuple(placements), axes)


@dataclasses.dataclass(frozen=True)
class MaskKind:
    kind: str  # "none" | "causal" | "causal_offset" | "sliding_window" (bands too) | "other"
    detail: str
    nodes: frozenset[fx.Node]
    # run-time tensors the mask also depends on (key padding, sequence segments): the mask equals
    # `kind` wherever all of them are true
    runtime: tuple[RuntimeTerm, ...] = ()
    # causal and sliding_window: key j is visible to query i iff j <= i + shift (and, with a
    # window, j > i + shift - window), i and j counted from 0 on the mask's query and key axes
    shift: int = 0
    window: int | None = None


def terms_of_runtime(runtime, what: str) -> tuple[RuntimeTerm, ...]:
    return tuple(r for r in runtime if r.what == what)


def terms_of(found: MaskKind, what: str) -> tuple[RuntimeTerm, ...]:
    """The run-time terms of one kind (KEY_PADDING, SEGMENTS) of a classified mask."""
    return terms_of_runtime(found.runtime, what)


def _always_true(c: Constraint, lengths: dict) -> bool:
    """Whether a constraint holds at every position 0..len-1 of its axes: its largest value over
    that box is <= 0. Positive coefficients need the axis length as a Python int (a sliding window
    wider than a static sequence, `q >= 0`); a symbolic length proves nothing."""
    worst = c.const
    for axis, k in c.coef:
        if k > 0:
            n = lengths.get(axis)
            if not isinstance(n, int):
                return False
            worst += k * (n - 1)
    return worst <= 0


def is_band(shift: int | None, window: int | None) -> bool:
    """A bidirectional band |q - kv| <= w: the window 2w + 1 on the diagonal moved by w."""
    return bool(shift) and shift > 0 and window == 2 * shift + 1


def classify(mask: fx.Node) -> MaskKind:
    analysis = MaskAnalysis()
    # the mask's own graph's nodes only: a proof that followed a checkpointed layer's input into
    # its caller (proven_in_caller) reads the caller's nodes, which are not this graph's to erase
    def own(found):
        return frozenset(n for n in found if n.graph is mask.graph)

    try:
        value = analysis.value(mask)
    except Unprovable as why:
        return MaskKind("other", str(why), own(analysis.nodes))
    if isinstance(value, Constant) and value.value is True:
        value = TRUE
    if isinstance(value, Lookup):
        try:
            value = _as_mask(value)
        except Unprovable as why:
            return MaskKind("other", str(why), own(analysis.nodes))
    if not isinstance(value, Conjunction):
        return MaskKind("other", "not a boolean mask", own(analysis.nodes))
    nodes = own(analysis.nodes)
    positions = terms_of_runtime(value.runtime, POSITIONS)
    if positions:
        segmented = {segments_of(r.source) for r in terms_of_runtime(value.runtime, SEGMENTS)}
        if any(r.source not in segmented for r in positions):
            return MaskKind("other", "position ids compared at the query and key indices without the sequence "
                            "segments of the same ids", nodes)
        value = Conjunction(value.constraints, tuple(r for r in value.runtime if r.what != POSITIONS), value.lengths)
    lengths = dict(value.lengths)
    constraints = [c for c in value.constraints if not _always_true(c, lengths)]
    causal = [c for c in constraints if dict(c.coef) == {KV_AXIS: 1, Q_AXIS: -1}]
    window = [c for c in constraints if dict(c.coef) == {KV_AXIS: -1, Q_AXIS: 1}]
    rest = [c for c in constraints if c not in causal and c not in window]
    runtime = value.runtime
    padding = ""
    if runtime:
        padding = " with " + ", ".join(sorted({r.what for r in runtime})) + " from a run-time tensor"
    if rest or len(causal) > 1 or len(window) > 1:
        return MaskKind("other", "mask constraints of an unknown shape", nodes, runtime)
    if window:
        # q - kv + c <= 0, i.e. kv > q + shift - w with w = shift + 1 - c; without a causal bound
        # the kernel's window does not apply (shift stays None)
        shift = -causal[0].const if causal else None
        size = None if shift is None else shift + 1 - window[0].const
        # |q - kv| <= w (ModernBERT's local layers) is the window 2w + 1 on the diagonal moved by w
        what = f"bidirectional band mask (|q - kv| <= {shift})" if is_band(shift, size) else "sliding-window mask"
        return MaskKind("sliding_window", what + padding, nodes, runtime, shift=shift, window=size)
    if not causal:
        detail = "bidirectional mask" + padding if runtime else "mask is true everywhere"
        return MaskKind("none", detail, nodes, runtime)
    offset = causal[0].const  # kv - q + offset <= 0
    if offset != 0:
        detail = f"causal mask with diagonal offset {-offset}" + padding
        return MaskKind("causal_offset", detail, nodes, runtime, shift=-offset)
    return MaskKind("causal", "causal mask (kv <= q)" + padding, nodes, runtime)


def index_lengths(mask: fx.Node) -> dict[int, object]:
    """The arange lengths placed on each axis of a mask (for the shape guard)."""
    analysis = MaskAnalysis()
    try:
        value = analysis.value(mask)
    except Unprovable:
        return {}
    return dict(value.lengths) if isinstance(value, Conjunction) else {}
