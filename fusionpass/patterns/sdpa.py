"""SDPA calls as the attention fusions read them: their arguments, transformers' `repeat_kv` copies of
grouped K and V, and the guards every SDPA route shares (sdpa_mask, sdpa_runtime_check,
flash_attention, decode_attention).

transformers repeats grouped K/V up to the query head count before SDPA whenever it passes a mask
(`repeat_kv`); a rewrite that drops the mask, or hands the call to our kernels, reads the grouped
tensors instead (`grouped_kv`) and erases the copies (`repeat_kv_nodes`).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.registry import Match

SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def is_sdpa(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in SDPA


def sdpa_arguments(node: fx.Node) -> dict:
    args = dict(DEFAULTS)
    args.update(zip(PARAMS, node.args))
    args.update(node.kwargs)
    return args


def has_mask_node(node) -> bool:
    """An SDPA call whose attn_mask is a tensor of the graph (the anchor of the SDPA rewrites)."""
    return is_sdpa(node) and isinstance(sdpa_arguments(node)["attn_mask"], fx.Node)


def _dim_arg(node: fx.Node, position: int, name: str):
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name)


def _unsqueezed_at_2(node) -> fx.Node | None:
    """`t[:, :, None]` (any trailing full slices) or `t.unsqueeze(2)` of a 4-d t -> t."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    src = g.first_arg(node)
    t = g.tensor(src)
    if t is None or t.dim() != 4:
        return None
    if node.target is operator.getitem:
        index = node.args[1]
        full = slice(None, None, None)
        if (
            isinstance(index, tuple)
            and index[:3] == (full, full, None)
            and all(i == full or i is Ellipsis for i in index[3:])
        ):
            return src
        return None
    if node.target in ("unsqueeze", torch.unsqueeze) and _dim_arg(node, 1, "dim") in (2, -3):
        return src
    return None


def unrepeated_kv(node) -> tuple[fx.Node, int] | None:
    """transformers' `repeat_kv`, `t[:, :, None].expand(B, Hkv, n, S, D).reshape(B, Hkv * n, S, D)`
    (head h of the result is head h // n of t), or `repeat_interleave(t, n, dim=1)` -> (t, n)."""
    if not isinstance(node, fx.Node):
        return None
    out = g.tensor(node)
    if out is None or out.dim() != 4:
        return None
    if node.target in ("repeat_interleave", torch.repeat_interleave):
        src, n = g.first_arg(node), _dim_arg(node, 1, "repeats")
        if isinstance(n, int) and _dim_arg(node, 2, "dim") in (1, -3) and set(node.kwargs) <= {"repeats", "dim"}:
            return _checked_repeat(src, n, out)
        return None
    if node.target not in ("reshape", "view", torch.reshape):
        return None
    expanded = g.first_arg(node)
    if not (isinstance(expanded, fx.Node) and expanded.target == "expand"):
        return None
    src = _unsqueezed_at_2(g.first_arg(expanded))
    wide = g.tensor(expanded)
    if src is None or wide is None or wide.dim() != 5:
        return None
    n = g.static_int(wide.shape[2])
    return None if n is None else _checked_repeat(src, n, out)


def _checked_repeat(src, n: int, out: torch.Tensor) -> tuple[fx.Node, int] | None:
    t = g.tensor(src)
    if t is None or t.dim() != 4 or n < 1:
        return None
    b, h, s, d = t.shape
    if all(statically_known_true(a == e) for a, e in zip(out.shape, (b, h * n, s, d))):
        return src, n
    return None


def grouped_kv(args: dict) -> tuple[fx.Node, fx.Node, int] | None:
    """(key, value, n) when both are `repeat_kv` copies of grouped K and V with one n > 1 and the
    query has their head count."""
    found = [unrepeated_kv(args[name]) for name in ("key", "value")]
    if None in found or args["enable_gqa"] is not False:
        return None
    (k, n), (v, n_v) = found
    q = g.tensor(args["query"])
    if n < 2 or n != n_v or q is None or q.dim() != 4:
        return None
    if not statically_known_true(q.shape[1] == g.tensor(k).shape[1] * n):
        return None
    return k, v, n


# ---------------------------------------------------------------------------------------------
# guards and replacement pieces


query_device = g.device_supported(lambda b: b["args"]["query"])


def mask_covers_the_scores(m: Match, cfg) -> str | None:
    """The mask's index vectors span exactly the query and key lengths, and the mask is
    [.., Sq, Skv]."""
    args = m.bindings["args"]
    if m.bindings["mask"] is None:
        return None
    q, k = g.tensor(args["query"]), g.tensor(args["key"])
    mask = g.tensor(m.bindings["mask"])
    sq, skv = q.shape[-2], k.shape[-2]
    if mask.dim() < 2 or not (
        statically_known_true(mask.shape[-2] == sq) or mask.shape[-2] == 1
    ) or not statically_known_true(mask.shape[-1] == skv):
        return f"mask shape {tuple(mask.shape)} does not cover scores [.., {sq}, {skv}]"
    lengths = masks.index_lengths(m.bindings["mask"])
    for axis, size in ((masks.Q_AXIS, sq), (masks.KV_AXIS, skv)):
        n = lengths.get(axis)
        if n is not None and not statically_known_true(n == size):
            return f"mask index length {n} differs from the attention length {size}"
    return None


def fast_arguments(m: Match, grouped: bool) -> tuple[tuple, dict]:
    """SDPA's arguments without the mask: is_causal for a causal mask, nothing for an all-true
    one; with `grouped`, K/V before their repeat_kv copies and enable_gqa=True."""
    args = dict(m.bindings["args"])
    args["attn_mask"] = None
    args["is_causal"] = m.bindings["kind"] == "causal"
    found = grouped_kv(args) if grouped else None
    if found is not None:
        args["key"], args["value"], _ = found
        args["enable_gqa"] = True
    positional = tuple(args.pop(p) for p in ("query", "key", "value"))
    kwargs = {k: v for k, v in args.items() if v != DEFAULTS[k] or k == "is_causal"}
    return positional, kwargs


def repeat_kv_nodes(args: dict) -> list[fx.Node]:
    """The nodes of the repeat_kv copies the fast call no longer reads (latest first)."""
    nodes = []
    for name in ("key", "value"):
        node = args[name]
        while isinstance(node, fx.Node) and node.target in (
            "reshape", "view", torch.reshape, "expand", "unsqueeze", torch.unsqueeze,
            operator.getitem, "repeat_interleave", torch.repeat_interleave,
        ) and g.tensor(node) is not None and g.tensor(node).dim() in (4, 5):
            nodes.append(node)
            node = g.first_arg(node)
    return nodes
