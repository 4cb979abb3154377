"""Attention written out in torch ops ("eager" attention), read back into one description that the
attention fusion routes to fusionpass::flash_attention.

The forms, as real models write them (pre-grad graph, Dynamo's torch IR):
  BLOOM:
      scores = alibi.baddbmm(q.reshape(B*H, Lq, D), k.reshape(B*H, Lk, D).transpose(-1, -2),
                             beta=1.0, alpha=scale)                    alibi [B*H, 1, Lk]
      w = scores.view(B, H, Lq, Lk) + mask;  p = softmax(w, -1, dtype=float32).to(dtype)
      out = bmm(dropout(p).view(B*H, Lq, Lk), v.reshape(B*H, Lk, D))
  MPT: w = matmul(q, k.transpose(-1, -2)) * scale + alibi[:, :, -Lk:]   alibi [H, 1, L]
      w = w.masked_fill(mask.to(bool), min);  p = softmax(w.float(), -1).to(dtype)   (mask additive)
  GPT-2 / GPT-J / OPT / older HF code:
      w = matmul(q, k.transpose(-1, -2)) * scale (or / c);  w = w + mask;  p = softmax(w, -1)
      out = matmul(dropout(p.type(v.dtype)), v)                        (k, v maybe repeat_kv copies)
The mask is transformers' additive one, `torch.where(bool_mask, 0.0, very negative)`; its boolean
mask is classified by fusionpass.patterns.masks like SDPA's. ALiBi given as a [B*H, 1, Lk] tensor
is a per-key bias (the same for every query row): the kernel adds it as given (key_bias), so no
proof about how it was built is needed; so is MPT's [H, 1, Lk] slice of its ALiBi tensor. (Falcon
with ALiBi folds the bias into a masked_fill-built mask: not matched.)

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

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.registry import NearMiss

_MATMULS = (torch.matmul, operator.matmul, "matmul")
_BMMS = (torch.bmm, "bmm")
_SOFTMAXES = (F.softmax, torch.softmax, "softmax")
_VIEWS = ("view", "reshape", torch.reshape)
# the additive mask's fill must drive exp() to exactly 0 next to any visible score
_MASK_FILL_MAX = -1e4


def _is_call(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def _arg(node: fx.Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def is_anchor(node) -> bool:
    """The probabilities-times-values product that ends an eager attention: a bmm or matmul whose
    left operand is a softmax over the last dim (through views, a dropout and casts)."""
    if not (_is_call(node, _MATMULS + _BMMS) and len(node.args) == 2):
        return False
    from fusionpass.patterns.layer_norm import _dropout_args

    x = node.args[0]
    for _ in range(4):
        if _is_call(x, _VIEWS) or _dropout_args(x) is not None:
            x = g.first_arg(x)
        elif g.cast_source(x) is not None:
            x = g.cast_source(x)
        else:
            break
    return _is_call(x, _SOFTMAXES)


def _shape(node) -> tuple | None:
    t = g.tensor(node)
    return None if t is None else tuple(t.shape)


def _same(shape, expected) -> bool:
    return shape is not None and len(shape) == len(expected) and all(
        statically_known_true(a == b) for a, b in zip(shape, expected)
    )


def _heads_4d(node) -> fx.Node | None:
    """x if node is `x.reshape(B*H, L, D)` of a 4-D x [B, H, L, D] (BLOOM folds heads into batch)."""
    if not _is_call(node, _VIEWS):
        return None
    src = g.first_arg(node)
    s = _shape(src)
    if s is None or len(s) != 4 or not _same(_shape(node), (s[0] * s[1], s[2], s[3])):
        return None
    return src


def _transposed_last(node) -> fx.Node | None:
    """x if node is x.transpose(-1, -2) (or (2, 3) / (1, 2) on 4-D / 3-D x)."""
    if not _is_call(node, ("transpose", torch.transpose)):
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
        self.dropout_p = 0.0
        self.scale = 1.0


def _single_use(node: fx.Node, user: fx.Node) -> None:
    if list(node.users) != [user]:
        raise NearMiss(f"{node.name} is also read outside the attention (e.g. probabilities returned)")


def _scale_of(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(scores, c) for `scores * c`, `c * scores` or `scores / c` with a constant c (a literal or a
    `torch.full([], c)`), else None."""
    kind = g.op(node)
    if kind not in ("mul", "div"):
        return None
    pairs = g.commuted(node) if kind == "mul" else [g.binary_operands(node) or (None, None)]
    for x, c in pairs:
        value = c
        if _is_call(c, (torch.full,)) and _arg(c, 0, "size") in ([], ()) and len(c.users) == 1:
            value = _arg(c, 1, "fill_value")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0 and isinstance(x, fx.Node):
            return x, (float(value) if kind == "mul" else 1.0 / float(value))
    return None


def _additive_mask(node: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(bool_mask, nodes) for transformers' `torch.where(bool_mask, 0.0, fill)` (maybe cast)."""
    nodes = []
    while g.cast_source(node) is not None:
        nodes.append(node)
        node = g.cast_source(node)
    if not (_is_call(node, (torch.where,)) and len(node.args) == 3 and not node.kwargs):
        return None
    cond, keep, fill = node.args
    if g.dtype(cond) != torch.bool:
        return None

    def number(x):
        if _is_call(x, (torch.tensor,)) and len(x.args) == 1 and isinstance(x.args[0], (int, float)):
            return x.args[0]
        return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None

    if number(keep) != 0 or number(fill) is None or number(fill) > _MASK_FILL_MAX:
        return None
    extra = [keep] if isinstance(keep, fx.Node) else []
    return cond, [*nodes, node, *extra]


def _masked_fill(node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(scores, visible, nodes) for `scores.masked_fill(masked, fill)` with a very negative fill,
    where `masked` is transformers' additive mask cast to bool (MPT: True where the additive mask
    is its fill, i.e. where the boolean mask under it is False)."""
    if not _is_call(node, ("masked_fill", torch.masked_fill)) or len(node.args) != 3 or node.kwargs:
        return None
    scores, masked, fill = node.args
    if not isinstance(fill, (int, float)) or isinstance(fill, bool) or fill > _MASK_FILL_MAX:
        return None
    if not (_is_call(masked, ("to",)) and g.dtype(masked) == torch.bool and len(masked.args) == 2):
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


def describe(anchor: fx.Node) -> tuple[Eager, dict] | None:
    """Read the eager attention ending at `anchor` (probs @ v). Returns (Eager, SDPA-like args), None
    when it is not one, NearMiss when it is one this route cannot take."""
    e = Eager(anchor)
    probs, v = anchor.args
    folded = _is_call(anchor, _BMMS)
    if folded:
        probs4 = probs if _is_call(probs, _VIEWS) else None
        v4 = _heads_4d(v)
        if probs4 is None or v4 is None:
            return None
        _single_use(probs4, anchor)
        e.nodes.append(probs4)
        probs = g.first_arg(probs4)
        if len(_shape(probs) or ()) != 4:
            return None
        v = v4
    if len(_shape(probs) or ()) != 4 or len(_shape(v) or ()) != 4:
        return None

    from fusionpass.patterns.layer_norm import _dropout

    # dropout (active or not), then casts, then the softmax
    node, user = probs, anchor if not folded else e.nodes[-1]
    d = _dropout(node)
    if d is not None:
        _single_use(node, user)
        e.nodes.append(node)
        if d.active:
            if not isinstance(d.p, float):
                raise NearMiss("attention dropout probability is not a constant")
            e.dropout_p = d.p
        user, node = node, d.x
    while g.cast_source(node) is not None:
        _single_use(node, user)
        e.nodes.append(node)
        user, node = node, g.cast_source(node)
    if not _is_call(node, _SOFTMAXES):
        return None
    dim = _arg(node, 1, "dim")
    if dim not in (-1, 3):
        return None
    _single_use(node, user)
    e.nodes.append(node)
    user, node = node, g.first_arg(node)

    # casts of the scores (MPT's `.float()`), then the mask (added, or a masked_fill) and a per-key
    # bias added to the scaled scores (MPT's ALiBi), in either order
    while g.cast_source(node) is not None:
        _single_use(node, user)
        e.nodes.append(node)
        user, node = node, g.cast_source(node)
    for _ in range(2):
        found = _masked_fill(node) if e.mask is None else None
        if found is not None:
            _single_use(node, user)
            e.nodes.append(node)
            e.mask, e.mask_nodes = found[1], found[2]
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
                break
            if e.key_bias is None and _per_key(b):
                e.key_bias = b
                break
        else:
            raise NearMiss("scores plus a tensor that is neither transformers' additive mask nor a per-key bias")
        _single_use(node, user)
        e.nodes.append(node)
        user, node = node, a

    # the scores: view(baddbmm(key_bias, q3, k3^T)), matmul(q, k^T) [* or / constant]
    if _is_call(node, _VIEWS) and _is_call(g.first_arg(node), (torch.baddbmm, "baddbmm")):
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
        if not _is_call(node, _MATMULS) or len(node.args) != 2:
            return None
        q, kt = node.args
        k = _transposed_last(kt)
        if k is None or len(_shape(q) or ()) != 4:
            return None
        _single_use(node, user)
        e.nodes += [node, kt]
    # the transposes/reshapes of q and k go only if nothing else reads them
    e.nodes = [n for n in e.nodes if n is not None]
    args = {"query": q, "key": k, "value": v, "attn_mask": e.mask, "dropout_p": e.dropout_p,
            "is_causal": False, "scale": e.scale, "enable_gqa": False}
    return e, args


def _folded(e: Eager, q: fx.Node) -> bool:
    """The bias is BLOOM's [B*H, 1, Lk] (added by baddbmm to the head-folded scores)."""
    qs = g.tensor(q).shape
    return len(e.nodes) > 0 and any(_is_call(n, (torch.baddbmm, "baddbmm")) for n in e.nodes) and _same(
        tuple(g.tensor(e.key_bias).shape)[:1], (qs[0] * qs[1],))


def check_key_bias(e: Eager, q: fx.Node, k: fx.Node) -> str | None:
    """The bias is per key, the same for every query row: BLOOM's [B*H, 1, Lk] or a broadcast
    [H, 1, Lk] / [1 or B, H, 1, Lk] (MPT); float, and needs no gradient."""
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
    of a [.., H, 1, Lk] bias selected away (and a leading 1 added to a 3-d one)."""
    b, h = g.tensor(q).shape[:2]
    lk = g.tensor(e.key_bias).shape[-1]
    if _folded(e, q):
        return g.insert_call(graph, before, torch.Tensor.view, (e.key_bias, [b, h, lk]), before)
    bias = g.insert_call(graph, before, torch.select, (e.key_bias, -2, 0), before)
    if g.tensor(bias).dim() == 2:
        bias = g.insert_call(graph, before, torch.unsqueeze, (bias, 0), before)
    return bias


def classify_mask(e: Eager) -> masks.MaskKind | None:
    return None if e.mask is None else masks.classify(e.mask)
