"""Attention written out in torch ops ("eager" attention), read back into one description that the
flash_attention fusion routes to fusionpass::flash_attention.

The forms, as real models write them (pre-grad graph, Dynamo's torch IR):
  BLOOM:
      scores = alibi.baddbmm(q.reshape(B*H, Lq, D), k.reshape(B*H, Lk, D).transpose(-1, -2),
                             beta=1.0, alpha=scale)                    alibi [B*H, 1, Lk]
      w = scores.view(B, H, Lq, Lk) + mask;  p = softmax(w, -1, dtype=float32).to(dtype)
      out = bmm(dropout(p).view(B*H, Lq, Lk), v.reshape(B*H, Lk, D))
  MPT: w = matmul(q, k.transpose(-1, -2)) * scale + alibi[:, :, -Lk:]   alibi [H, 1, L]
      w = w.masked_fill(mask.to(bool), min);  p = softmax(w.float(), -1).to(dtype)   (mask additive)
  Falcon (alibi=True): w = (matmul(q, k.transpose(-1, -2)) [.float()] + alibi.view(B, H, 1, L)) *= s
      p = softmax(w + mask, -1)   mask = masked_fill(alibi / sqrt(d), where(m, 0, min) < -1, min)
      (the bias counted twice, as the model computes it: key_bias = alibi * s + alibi / sqrt(d))
  GPT-2 / GPT-J / OPT / older HF code:
      w = matmul(q, k.transpose(-1, -2)) * scale (or / c);  w = w + mask;  p = softmax(w, -1)
      out = matmul(dropout(p.type(v.dtype)), v)                        (k, v maybe repeat_kv copies)
The mask is transformers' additive one, `torch.where(bool_mask, 0.0, very negative)`; its boolean
mask is classified by fusionpass.patterns.masks like SDPA's. ALiBi given as a [B*H, 1, Lk] tensor
is a per-key bias (the same for every query row): the kernel adds it as given (key_bias), so no
proof about how it was built is needed; so is MPT's [H, 1, Lk] slice of its ALiBi tensor, and
Falcon's [B, H, 1, Lk] one, in its scores and in its mask (`biased_mask`, also read by the SDPA
route of fusionpass.fusions.flash_attention.pattern).

Not matched (left to Inductor), each with its reason: a chain node read by anything else (the
probabilities returned with output_attentions, a score hook), a bias that needs a gradient or is
not per-key, a non-constant scale or dropout probability, masks with run-time key padding (a
query row that sees no key gets the uniform average of every value from the additive mask, and 0
from the kernel), masks that do not classify.

The kernel computes the softmax in fp32 from fp32 scores. Where the model computes its scores in
bf16/fp16 (BLOOM's baddbmm adds `slope * j`, up to thousands, before the softmax; GPT-2 takes its
softmax in the model dtype), the kernel's result is the closer one to the exact math; plain
torch.compile rounds as the model does.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass.patterns import dropout as dp
from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.patterns.softcap import softcap_of
from fusionpass.registry import NearMiss

_MATMULS = (torch.matmul, operator.matmul, "matmul")
_BMMS = (torch.bmm, "bmm")
_SOFTMAXES = (F.softmax, torch.softmax, "softmax")
# the additive mask's fill must drive exp() to exactly 0 next to any visible score
_MASK_FILL_MAX = -1e4


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def is_anchor(node) -> bool:
    """The probabilities-times-values product that ends an eager attention: a bmm or matmul whose
    left operand is a softmax over the last dim (through views, a dropout, casts and gpt-oss's
    dropped sink column)."""
    if not (g.is_call(node, _MATMULS + _BMMS) and len(node.args) == 2):
        return False
    x = node.args[0]
    for _ in range(5):
        if g.is_call(x, g.VIEWS) or dp.dropout_args(x) is not None or _without_last_column(x) is not None:
            x = g.first_arg(x)
        elif g.cast_source(x) is not None:
            x = g.cast_source(x)
        else:
            break
    return g.is_call(x, _SOFTMAXES)


def _shape(node) -> tuple | None:
    t = g.tensor(node)
    return None if t is None else tuple(t.shape)


def _same(shape, expected) -> bool:
    return shape is not None and len(shape) == len(expected) and all(
        statically_known_true(a == b) for a, b in zip(shape, expected)
    )


def _heads_4d(node) -> fx.Node | None:
    """x if node is `x.reshape(B*H, L, D)` of a 4-D x [B, H, L, D] (BLOOM folds heads into batch)."""
    if not g.is_call(node, g.VIEWS):
        return None
    src = g.first_arg(node)
    s = _shape(src)
    if s is None or len(s) != 4 or not _same(_shape(node), (s[0] * s[1], s[2], s[3])):
        return None
    return src


def _transposed_last(node) -> fx.Node | None:
    """x if node is x.transpose(-1, -2) (or (2, 3) / (1, 2) on 4-D / 3-D x)."""
    if not g.is_call(node, ("transpose", torch.transpose)):
        return None
    x = g.first_arg(node)
    s = _shape(x)
    if s is None:
        return None
    dims = {d % len(s) for d in node.args[1:3] if isinstance(d, int)}
    return x if len(node.args) == 3 and dims == {len(s) - 1, len(s) - 2} else None


class Eager:
    """What one eager attention computes, in SDPA's terms (4-D q/k/v [B, H, L, D])."""

    def __init__(self, anchor: fx.Node):
        self.anchor = anchor
        self.nodes: list[fx.Node] = [anchor]  # the chain the kernel replaces
        self.key_bias: fx.Node | None = None  # [B*H, 1, Lk]
        self.mask: fx.Node | None = None  # the boolean mask under the additive one
        self.mask_nodes: list[fx.Node] = []
        self.mask_fill: float | None = None  # what the masked scores are set to (added to, or filled with)
        self.dropout_p = 0.0
        self.scale = 1.0
        # Falcon adds its ALiBi tensor before the scale (`(q k^T + alibi) * s`): key_bias counts
        # key_bias_scale times; its mask carries a second per-key bias (mask_bias, added once)
        self.key_bias_scale = 1.0
        self.mask_bias: fx.Node | None = None
        # Gemma-2 caps the scaled scores, c * tanh(s / c), before adding the mask (0: no cap)
        self.softcap = 0.0
        # gpt-oss's attention sinks: the [H] logits that join the softmax as a last column
        self.sinks: fx.Node | None = None


def _single_use(node: fx.Node, user: fx.Node) -> None:
    if list(node.users) != [user]:
        raise NearMiss(f"{node.name} is also read outside the attention (e.g. probabilities returned)")


def _through_casts(e: "Eager", node: fx.Node, user: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Walk from `node` (read only by `user`) through its chain of casts, adding them to the
    nodes the kernel replaces; returns the new (user, node)."""
    while g.cast_source(node) is not None:
        _single_use(node, user)
        e.nodes.append(node)
        user, node = node, g.cast_source(node)
    return user, node


def _probs_rounding(dtypes: list) -> str | None:
    """Why the probabilities' dtypes, from the softmax to the product with v, are not what the
    kernel computes: P in fp32, rounded once to the product's dtype (bf16 P @ bf16 v; under autocast
    `softmax(.., dtype=float32).to(float32)`, dropout, then autocast's `.to(bf16)`). A model whose
    softmax is already in the product's dtype (GPT-2) rounds no differently; a detour through
    another dtype (fp32 -> fp16 -> bf16) rounds twice, not reproduced."""
    wide = 0
    while wide < len(dtypes) and dtypes[wide] == torch.float32:
        wide += 1
    if all(d == dtypes[-1] for d in dtypes[wide:]):
        return None
    return (f"attention probabilities cast {' -> '.join(str(d) for d in dtypes)}: not rounded once from fp32 to "
            f"{dtypes[-1]} as the kernel does")


def _scale_of(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(scores, c) for `scores * c`, `c * scores` or `scores / c` with a constant c (a literal or a
    `torch.full([], c)`), else None."""
    kind = g.op(node)
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target in (operator.imul, operator.itruediv):
        # `w *= c` on a fresh product is `w * c` when nothing else reads w (the caller's
        # single-use check of w's producer)
        kind = "mul" if node.target is operator.imul else "div"
    if kind not in ("mul", "div"):
        return None
    pairs = g.commuted(node) if kind == "mul" else [g.binary_operands(node) or (None, None)]
    for x, c in pairs:
        value = c
        if g.is_call(c, (torch.full,)) and _arg(c, 0, "size") in ([], ()) and len(c.users) == 1:
            value = _arg(c, 1, "fill_value")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0 and isinstance(x, fx.Node):
            return x, (float(value) if kind == "mul" else 1.0 / float(value))
    return None


def _number(x):
    """A literal, `torch.tensor(c)`, `torch.full((), c)` or `torch.zeros(())` (transformers' zero of
    the additive mask: 5.17 writes `torch.tensor(0.0)`, 5.24 `torch.zeros(())`) as a Python number,
    else None."""
    if g.is_call(x, (torch.tensor,)) and len(x.args) == 1 and isinstance(x.args[0], (int, float)):
        return x.args[0]
    if g.is_call(x, (torch.zeros,)) and x.args in (((),), ([],)) and set(x.kwargs) <= {"device", "dtype"}:
        return 0
    if g.is_call(x, (torch.full,)) and len(x.args) == 2 and x.args[0] in ((), []):
        x = x.args[1]
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _additive_mask(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(bool_mask, nodes) for transformers' `torch.where(bool_mask, 0.0, fill)` (maybe cast)."""
    nodes = []
    while g.cast_source(node) is not None:
        nodes.append(node)
        node = g.cast_source(node)
    if not (g.is_call(node, (torch.where,)) and len(node.args) == 3 and not node.kwargs):
        return None
    cond, keep, fill = node.args
    if g.dtype(cond) != torch.bool:
        return None

    if _number(keep) != 0 or _number(fill) is None or _number(fill) > _MASK_FILL_MAX:
        return None
    extra = [keep] if isinstance(keep, fx.Node) else []
    return cond, [*nodes, node, *extra]


def _masked_fill(node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(scores, visible, nodes) for `scores.masked_fill(masked, fill)` with a very negative fill,
    where `masked` is transformers' additive mask cast to bool (MPT: True where the additive mask
    is its fill, i.e. where the boolean mask under it is False)."""
    if not g.is_call(node, ("masked_fill", torch.masked_fill)) or len(node.args) != 3 or node.kwargs:
        return None
    scores, masked, fill = node.args
    if not isinstance(fill, (int, float)) or isinstance(fill, bool) or fill > _MASK_FILL_MAX:
        return None
    if not (g.is_call(masked, ("to",)) and g.dtype(masked) == torch.bool and len(masked.args) == 2):
        return None
    found = _additive_mask(masked.args[0])
    if found is None:
        return None
    visible, nodes = found
    return scores, visible, [masked, *nodes]


def _per_key(node: fx.Node) -> bool:
    """A bias of shape [..., H, 1, Lk] (the same for every query row): MPT's sliced ALiBi tensor."""
    t = g.tensor(node)
    return t is not None and t.dim() in (3, 4) and t.shape[-2] == 1


_LESS = (operator.lt, torch.lt, "lt", "__lt__")
_NOTS = (operator.invert, torch.logical_not, torch.bitwise_not, "logical_not", "bitwise_not", "__invert__")
# a fill this negative absorbs any score added to it (|score| far below its ulp, ~2e31 at fp32's
# min): a query row that sees no key then has equal scores everywhere
ABSORBING_FILL = -1e30


@dataclasses.dataclass
class BiasedMask:
    """A float attention mask that carries a bias: `bias` where `visible` is true, about `fill`
    elsewhere (Falcon folds its ALiBi tensor into the mask this way)."""

    bias: fx.Node
    visible: fx.Node  # the boolean mask under it, True = attend
    nodes: list[fx.Node]  # the mask's own nodes (not the bias's), for erasing
    fill: float
    # the dtype a cast of the whole mask rounds it to before SDPA reads it (autocast's `.to(bf16)`
    # of an fp32 mask): the kernel reads the bias cast the same way; None where read as built
    dtype: torch.dtype | None = None


def _additive_fill(node: fx.Node) -> float | None:
    """The fill of transformers' additive mask `where(m, 0, fill)` (maybe cast)."""
    while g.cast_source(node) is not None:
        node = g.cast_source(node)
    return _number(node.args[2])


def _masked_positions(cond) -> tuple[fx.Node, list[fx.Node]] | None:
    """(m, nodes) when `cond` is True exactly where the boolean mask m is False:
    `where(m, 0, fill) < c` with fill < c <= 0 (Falcon), `where(m, 0, fill).to(bool)` (MPT's
    spelling), `~m` / `logical_not(m)`."""
    if g.is_call(cond, _NOTS) and len(cond.args) == 1 and g.dtype(cond.args[0]) == torch.bool:
        return cond.args[0], [cond]
    if g.is_call(cond, _LESS) and len(cond.args) == 2 and not cond.kwargs and isinstance(cond.args[0], fx.Node):
        found, c = _additive_mask(cond.args[0]), _number(cond.args[1])
        # 0 (visible) is not below c, the fill is: the comparison is exactly `not m`
        if found is not None and c is not None and _additive_fill(cond.args[0]) < c <= 0:
            return found[0], [cond, *found[1]]
        return None
    if g.is_call(cond, ("to",)) and g.dtype(cond) == torch.bool and len(cond.args) == 2 and not cond.kwargs:
        found = _additive_mask(cond.args[0]) if isinstance(cond.args[0], fx.Node) else None
        if found is not None:  # 0 -> False, the (nonzero) fill -> True
            return found[0], [cond, *found[1]]
    return None


def _float_node(x) -> bool:
    t = g.tensor(x)
    return t is not None and t.is_floating_point()


def biased_mask(node) -> BiasedMask | None:
    """A float mask that is a bias where a boolean mask is true and very negative elsewhere:
    Falcon's `masked_fill(alibi / sqrt(d), where(m, 0, min) < -1, min)`, or transformers'
    additive mask plus a bias, `where(m, 0, fill) + bias`. The bias is any float tensor here;
    callers check it is per key."""
    if g.is_call(node, ("masked_fill", torch.masked_fill)) and len(node.args) == 3 and not node.kwargs:
        bias, cond, fill = node.args
        fill = _number(fill)
        found = _masked_positions(cond)
        if fill is None or fill > _MASK_FILL_MAX or not _float_node(bias) or found is None:
            return None
        return BiasedMask(bias, found[0], [node, *found[1]], float(fill))
    if g.op(node) == "add":
        for a, b in g.commuted(node):
            found = _additive_mask(a) if isinstance(a, fx.Node) else None
            if found is not None and _float_node(b):
                return BiasedMask(b, found[0], [node, *found[1]], float(_additive_fill(a)))
    return None


def per_key_problem(bias: fx.Node, q: fx.Node, k: fx.Node) -> str | None:
    """Why `bias` is not a per-key bias the kernel can add for q [B, Hq, Lq, D], k [.., Lk, D]:
    it must be float, need no gradient and have shape [H', 1, Lk] or [B', H', 1, Lk] with B' in
    (1, B), H' in (1, Hq): one value per key, the same for every query row."""
    t = g.tensor(bias)
    if t is None or not t.is_floating_point():
        return "the bias is not a float tensor"
    if t.requires_grad:
        return "the bias requires grad (the kernel computes no gradient for it)"
    qs, lk = g.tensor(q).shape, g.tensor(k).shape[-2]
    shape = tuple(t.shape)
    if len(shape) not in (3, 4) or not _same(shape[-1:], (lk,)):
        return f"bias of shape {shape}, not [.., H, 1, {lk}]"
    if shape[-2] != 1:
        return f"bias of shape {shape} has a query dimension: not provably the same for every query row"
    lead_ok = all(d == 1 or _same((d,), (full,)) for d, full in zip(shape[:-2][::-1], (qs[1], qs[0])))
    return None if lead_ok else f"bias of shape {shape} does not broadcast as [B, Hq, 1, Lk]"


def insert_per_key(graph: fx.Graph, bias: fx.Node, before: fx.Node) -> fx.Node:
    """A [.., H, 1, Lk] bias as the kernel's [B or 1, H or 1, Lk]: the query axis selected away
    (and a leading 1 added to a 3-d one)."""
    out = g.insert_call(graph, before, torch.select, (bias, -2, 0), before)
    if g.tensor(out).dim() == 2:
        out = g.insert_call(graph, before, torch.unsqueeze, (out, 0), before)
    return out


_ALL_BUT_LAST = (Ellipsis, slice(None, -1, None))


def _without_last_column(node) -> fx.Node | None:
    """x for `x[..., :-1]` (gpt-oss drops its sinks' column from the probabilities)."""
    if g.is_call(node, (operator.getitem,)) and len(node.args) == 2 and node.args[1] == _ALL_BUT_LAST:
        return node.args[0]
    return None


def _max_values(node, of: fx.Node) -> bool:
    """node is `of.max(dim=-1, keepdim=True).values` (a getitem 0 of the max in Dynamo's graph)."""
    if not (g.is_call(node, (operator.getitem,)) and node.args[1:] == (0,)):
        return False
    m = node.args[0]
    dim, keepdim = _arg(m, 1, "dim"), _arg(m, 2, "keepdim", False)
    return g.is_call(m, ("max", torch.max)) and g.first_arg(m) is of and dim in (-1, 3) and keepdim is True


def _per_head_column(node, heads: int) -> tuple[fx.Node, list[fx.Node]] | None:
    """(src, nodes) where node [B, H, Lq, 1] is a 1-D src [H] reshaped to [1, H, 1, 1] and
    expanded (gpt-oss's `sinks.reshape(1, -1, 1, 1).expand(B, -1, Lq, -1)`): node[b, h, i, 0] =
    src[h]."""
    nodes = []
    while g.is_call(node, ("expand", *g.VIEWS)):
        nodes.append(node)
        node = g.first_arg(node)
    t = g.tensor(node)
    if not nodes or t is None or t.dim() != 1 or not _same(tuple(t.shape), (heads,)):
        return None
    if any(len(_shape(n) or ()) != 4 or not _same(_shape(n)[1:2], (heads,)) or _shape(n)[3] != 1 for n in nodes):
        return None
    return node, nodes


def _sink_logits(node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(scores, sinks [H], nodes) for gpt-oss's softmax input, `cat([scores, sinks_column], -1)`
    less its row maximum (the shift softmax ignores), else None."""
    nodes = []
    if g.op(node) == "sub" and g.binary_operands(node) is not None:
        combined, m = node.args
        if not _max_values(m, combined):
            return None
        nodes += [node, m, m.args[0]]
        node = combined
    if not (g.is_call(node, (torch.cat,)) and _arg(node, 1, "dim") in (-1, 3) and len(node.args[0]) == 2):
        return None
    scores, column = node.args[0]
    found = _per_head_column(column, (_shape(scores) or (0, 0))[1])
    if found is None:
        return None
    return scores, found[0], [*nodes, node, *found[1]]


def describe(anchor: fx.Node) -> tuple[Eager, dict] | None:
    """Read the eager attention ending at `anchor` (probs @ v). Returns (Eager, SDPA-like args), None
    when it is not one, NearMiss when it is one this route cannot take."""
    e = Eager(anchor)
    probs, v = anchor.args
    folded = g.is_call(anchor, _BMMS)
    if folded:
        probs4 = probs if g.is_call(probs, g.VIEWS) else None
        v4 = _heads_4d(v)
        if probs4 is None or v4 is None:
            return None
        _single_use(probs4, anchor)
        e.nodes.append(probs4)
        probs = g.first_arg(probs4)
        if len(_shape(probs) or ()) != 4:
            return None
        v = v4
    elif g.is_call(probs, g.VIEWS) and _same(_shape(g.first_arg(probs)), _shape(probs) or ()):
        # Falcon views the probabilities as the shape they already have
        _single_use(probs, anchor)
        e.nodes.append(probs)
        probs = g.first_arg(probs)
    if len(_shape(probs) or ()) != 4 or len(_shape(v) or ()) != 4:
        return None

    # casts (autocast's `.to(bf16)` of the fp32 probabilities for the product), dropout (active or
    # not), casts, then the softmax
    node, user = probs, e.nodes[-1]
    first = len(e.nodes)
    user, node = _through_casts(e, node, user)
    d = dp.dropout_of(node)
    if d is not None:
        _single_use(node, user)
        e.nodes.append(node)
        if d.active:
            if not isinstance(d.p, float):
                raise NearMiss("attention dropout probability is not a constant")
            e.dropout_p = d.p
        user, node = node, d.x
    user, node = _through_casts(e, node, user)
    sliced = _without_last_column(node)
    if sliced is not None:  # gpt-oss: the sinks' column dropped after the softmax
        _single_use(node, user)
        e.nodes.append(node)
        user, node = node, sliced
    if not g.is_call(node, _SOFTMAXES):
        return None
    dim = _arg(node, 1, "dim")
    if dim not in (-1, 3):
        return None
    _single_use(node, user)
    e.nodes.append(node)
    why = _probs_rounding([g.dtype(n) for n in reversed(e.nodes[first:])])
    if why is not None:
        raise NearMiss(why)
    user, node = node, g.first_arg(node)
    if sliced is not None:
        found = _sink_logits(node)
        if found is None:
            raise NearMiss("probabilities without their last column, over scores that are not [scores, a logit "
                           "per head] (gpt-oss's attention sinks)")
        scores, e.sinks, sink_nodes = found
        inside = {*sink_nodes, user}
        for n in sink_nodes:
            if any(u not in inside for u in n.users):
                raise NearMiss(f"{n.name} is also read outside the attention")
        e.nodes += sink_nodes
        user, node = next(n for n in sink_nodes if g.is_call(n, (torch.cat,))), scores

    # casts of the scores (MPT's `.float()`), then the mask (added, or a masked_fill) and a per-key
    # bias added to the scaled scores (MPT's ALiBi), in either order
    user, node = _through_casts(e, node, user)
    for _ in range(2):
        found = _masked_fill(node) if e.mask is None else None
        if found is not None:
            _single_use(node, user)
            e.nodes.append(node)
            e.mask, e.mask_nodes = found[1], found[2]
            e.mask_fill = float(node.args[2])
            user, node = node, found[0]
            continue
        if g.op(node) != "add":
            break
        for a, b in g.commuted(node):
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                continue
            found = _additive_mask(b) if e.mask is None else None
            if found is not None:
                e.mask, e.mask_nodes = found
                e.mask_fill = float(_additive_fill(b))
                break
            biased = biased_mask(b) if e.mask is None else None
            if biased is not None:  # Falcon: the mask carries ALiBi / sqrt(d)
                e.mask, e.mask_nodes, e.mask_bias = biased.visible, biased.nodes, biased.bias
                break
            if e.key_bias is None and _per_key(b):
                e.key_bias = b
                break
        else:
            raise NearMiss("scores plus a tensor that is neither transformers' additive mask nor a per-key bias")
        _single_use(node, user)
        e.nodes.append(node)
        user, node = node, a

    # Gemma-2's soft-capping of the scaled scores, under the mask
    capped = softcap_of(node)
    if capped is not None:
        for n, reader in zip(capped[2], [user, *capped[2]]):
            _single_use(n, reader)
        e.nodes += capped[2]
        user, node = capped[2][-1], capped[0]
        e.softcap = capped[1]
    capped_bias = e.key_bias  # a bias added after the cap, as the kernel adds it

    # the scores: view(baddbmm(key_bias, q3, k3^T)), matmul(q, k^T) [* or / constant]
    if g.is_call(node, g.VIEWS) and g.is_call(g.first_arg(node), (torch.baddbmm, "baddbmm")):
        _single_use(node, user)
        e.nodes.append(node)
        user, node = node, g.first_arg(node)
        names = ("input", "batch1", "batch2", "beta", "alpha")
        args = dict(zip(names, node.args))
        args.update(node.kwargs)
        if set(args) - set(names) or args.get("beta", 1) != 1:
            raise NearMiss(f"baddbmm with beta={args.get('beta')} (the bias must be added once)")
        alpha = args.get("alpha", 1)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise NearMiss("baddbmm's alpha (the scale) is not a constant")
        q, kt = _heads_4d(args["batch1"]), _transposed_last(args["batch2"])
        k = _heads_4d(kt) if kt is not None else None
        if q is None or k is None:
            return None
        if e.key_bias is not None:
            raise NearMiss("two biases added to the scores")
        _single_use(node, user)
        e.nodes += [node, args["batch2"], kt, args["batch1"]]
        e.scale = float(alpha)
        e.key_bias = args["input"]
    else:
        scaled = _scale_of(node)
        if scaled is not None:
            _single_use(node, user)
            e.nodes.append(node)
            user, node = node, scaled[0]
            e.scale = scaled[1]
            # Falcon: (q k^T + alibi) * s, the per-key bias scaled with the scores
            pair = next(((a, b) for a, b in g.commuted(node) if isinstance(b, fx.Node) and _per_key(b)), None)
            if g.op(node) == "add" and pair is not None:
                if e.key_bias is not None:
                    raise NearMiss("two per-key biases added to the scores")
                _single_use(node, user)
                e.nodes.append(node)
                e.key_bias, e.key_bias_scale = pair[1], e.scale
                user, node = node, pair[0]
        # Falcon views the scores as the shape they already have, and upcasts bf16/fp16 ones
        if g.is_call(node, g.VIEWS) and _same(_shape(g.first_arg(node)), _shape(node) or ()):
            _single_use(node, user)
            e.nodes.append(node)
            user, node = node, g.first_arg(node)
        user, node = _through_casts(e, node, user)
        if not g.is_call(node, _MATMULS) or len(node.args) != 2:
            return None
        q, kt = node.args
        k = _transposed_last(kt)
        if k is None or len(_shape(q) or ()) != 4:
            return None
        _single_use(node, user)
        e.nodes += [node, kt]
    if e.softcap and e.key_bias is not capped_bias:
        raise NearMiss("a bias added to the scores inside the soft-cap (the kernel adds biases after it)")
    # the transposes/reshapes of q and k go only if nothing else reads them
    e.nodes = [n for n in e.nodes if n is not None]
    args = {"query": q, "key": k, "value": v, "attn_mask": e.mask, "dropout_p": e.dropout_p,
            "is_causal": False, "scale": e.scale, "enable_gqa": False}
    return e, args


def _folded(e: Eager, q: fx.Node) -> bool:
    """The bias is BLOOM's [B*H, 1, Lk] (added by baddbmm to the head-folded scores)."""
    qs = g.tensor(q).shape
    return len(e.nodes) > 0 and any(g.is_call(n, (torch.baddbmm, "baddbmm")) for n in e.nodes) and _same(
        tuple(g.tensor(e.key_bias).shape)[:1], (qs[0] * qs[1],))


def check_key_bias(e: Eager, q: fx.Node, k: fx.Node) -> str | None:
    """The bias is per key, the same for every query row: BLOOM's [B*H, 1, Lk] or a broadcast
    [H, 1, Lk] / [1 or B, H, 1, Lk] (MPT, Falcon); float, and needs no gradient. So is the bias
    Falcon's mask carries."""
    if e.mask_bias is not None and (why := per_key_problem(e.mask_bias, q, k)) is not None:
        return f"the mask's {why}"
    if e.key_bias is None:
        return None
    t = g.tensor(e.key_bias)
    qs, ks = g.tensor(q).shape, g.tensor(k).shape
    if t is None or not t.is_floating_point():
        return "the scores' bias is not a float tensor"
    if t.requires_grad:
        return "the scores' bias requires grad (the kernel computes no gradient for it)"
    shape = tuple(t.shape)
    if _folded(e, q):
        ok = _same(shape, (qs[0] * qs[1], 1, ks[2]))
    else:
        lead = shape[:-2]
        ok = shape[-2] == 1 and _same(shape[-1:], (ks[2],)) and (
            _same(lead, (qs[1],)) or (len(lead) == 2 and (lead[0] == 1 or _same(lead[:1], (qs[0],)))
                                       and _same(lead[1:], (qs[1],))))
    return None if ok else f"bias of shape {tuple(shape)}, not per key ([B*H, 1, Lk] or [.., H, 1, Lk])"


def insert_key_bias(graph: fx.Graph, e: Eager, q: fx.Node, before: fx.Node) -> fx.Node:
    """The bias as the kernel's [B or 1, H, Lk]: a view of BLOOM's [B*H, 1, Lk], or the query axis
    of a [.., H, 1, Lk] bias selected away (and a leading 1 added to a 3-d one).
    Falcon's two biases become one, in fp32 like its scores: key_bias * key_bias_scale +
    mask_bias."""
    if e.key_bias is not None and _folded(e, q):
        b, h = g.tensor(q).shape[:2]
        lk = g.tensor(e.key_bias).shape[-1]
        return g.insert_call(graph, before, torch.Tensor.view, (e.key_bias, [b, h, lk]), before)
    if e.mask_bias is None and e.key_bias_scale == 1.0:
        return insert_per_key(graph, e.key_bias, before)
    terms = []
    if e.key_bias is not None:
        bias = g.insert_call(graph, before, torch.Tensor.float, (insert_per_key(graph, e.key_bias, before),), before)
        terms.append(g.insert_call(graph, before, torch.mul, (bias, e.key_bias_scale), before))
    if e.mask_bias is not None:
        terms.append(g.insert_call(graph, before, torch.Tensor.float, (insert_per_key(graph, e.mask_bias, before),),
                                   before))
    return terms[0] if len(terms) == 1 else g.insert_call(graph, before, torch.add, tuple(terms), before)


def classify_mask(e: Eager) -> masks.MaskKind | None:
    return None if e.mask is None else masks.classify(e.mask)
