"""rope_attention: the rotary embedding of q moves into the attention kernel that reads it.

Runs after `flash_attention`. Its anchor is a fusionpass::flash_attention call whose query is a rotated
tensor, as the models write it (fusions/rope/pattern.py: HF `q * cos + rotate_half(q) * sin`, GPT-J's
interleaved `rotate_every_two`, partial rotary's `cat([rotated, pass], -1)`), or the q output of a
fusionpass::rope call (with rope_kernel on), possibly followed by
  - `permute(0, 2, 1, 3)` / `transpose(1, 2)`: GPT-J rotates [B, S, H, D] and permutes after;
  - casts that keep the dtype (GPT-J's `query.to(torch.float32)` in an fp32 model).
The call then gets the unrotated q and cos/sin (permuted like q where q was), and the kernel
rotates each q tile as it loads it (fusionpass.kernels.attention `_rope_q`): the rotated q is never
written to memory nor read back, 2 * |q| bytes fewer in the forward. The rotation of k is left as it
is (Inductor's code, or a k-only fusionpass::rope call): each forward program reads every k tile
of its row of blocks, so rotating k on load would repeat the rotation for every query block, and a
rotated k is what a KV cache stores anyway: left to Inductor (as rope's cost rule does for
decode-sized steps), k's rotation and its `index_copy_` into a static cache are one kernel
(benchmarks/probes/rope_kv_cache.py as of 67836ab, on the H200 and on CPU).
The rotation on load costs the kernel less than the rotation kernel it replaces (with its own
launch, _FWD_ROPE_CFG; benchmarks/results/latest/rope_attention.md); partial rotary takes a slower form (a near miss). In the backward the op rotates q again (one launch) for
the backward kernels and rotates dq back, which is what the unfused graph's rope backward did: in
training the bytes saved in the forward are spent again there (see the cost rule).

Near misses: a rotated q read by anything besides the attention (its value would have to be
written anyway), a cast that changes the dtype between the rotation and the attention other than
autocast's one rounding of an fp32 rotation of a 16-bit q (the kernel rotates in fp32 and rounds
once to the attention dtype), cos/sin that require grad or do not broadcast over q.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from fusionpass import registry
from fusionpass.patterns import graph as g
from fusionpass.fusions.rope import pattern as rope_patterns
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant, option


def _flash_attention():
    return torch.ops.fusionpass.flash_attention.default


def _has_rope(call: fx.Node) -> bool:
    return call.kwargs.get("rope_cos") is not None


def is_anchor(node) -> bool:
    """A fusionpass::flash_attention call that does not rotate its q yet, whose q comes from what
    looks like a rotation (an add of products with a cat/flatten operand, a partial rotary's cat of
    one, or fusionpass::rope)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is _flash_attention()
            and not _has_rope(node) and isinstance(node.args[0], fx.Node)):
        return False
    rotated = _walk(node.args[0])[0]
    parts = rope_patterns.joined(rotated, "cat")
    return (rope_patterns.anchor(rotated) or bool(parts and rope_patterns.anchor(parts[0]))
            or _rope_call(rotated) is not None)


def _walk(q: fx.Node) -> tuple[fx.Node, list[fx.Node], bool]:
    """Walk back from the attention's q through casts and one heads/tokens swap: (the tensor
    reached, the walked nodes, whether one of them is the swap)."""
    chain, permuted = [], False
    node = q
    while True:
        src = g.cast_source(node)
        if src is not None:
            chain.append(node)
            node = src
        elif not permuted and g.swaps_heads_and_tokens(node):
            chain.append(node)
            node = g.first_arg(node)
            permuted = True
        else:
            return node, chain, permuted


_ROUNDED_TO = (torch.float16, torch.bfloat16)


def _query_chain(q: fx.Node) -> tuple[fx.Node, list[fx.Node], bool, bool]:
    """`_walk`, and whether the rotated q is rounded once from fp32 to a 16-bit dtype on the way
    (under autocast a bf16 q rotated by fp32 cos/sin is fp32, and the attention's `.to(bf16)`
    rounds it: what the kernel does as it loads q, see `dtypes_agree`). NearMiss for any other cast
    that changes the dtype."""
    rotated, chain, permuted = _walk(q)
    rounded = False
    for node in chain:
        src = g.cast_source(node)
        if src is None or g.dtype(src) == g.dtype(node):
            continue
        if rounded or g.dtype(src) != torch.float32 or g.dtype(node) not in _ROUNDED_TO:
            raise NearMiss(f"q is cast from {g.dtype(src)} to {g.dtype(node)} between the rotation and the "
                           "attention (the model rounds the rotated q to its own dtype first)")
        rounded = True
    return rotated, chain, permuted, rounded


def _rope_call(rotated) -> fx.Node | None:
    """The fusionpass::rope call one of whose two outputs `rotated` is, or None (the call rotates
    q and k in the order the model did: GPT-J rotates k first)."""
    if not (isinstance(rotated, fx.Node) and rotated.target is operator.getitem and rotated.args[1] in (0, 1)):
        return None
    call = rotated.args[0]
    if isinstance(call, fx.Node) and call.target is torch.ops.fusionpass.rope.default:
        return call
    return None


def _graph_rotation(rotated: fx.Node):
    """The patterns.rope description of `rotated` (dict with x, cos, sin, rotary_dim, form, nodes), or
    None: an add (full rotary) or the cat of a partial rotary."""
    starts = [rotated]
    parts = rope_patterns.joined(rotated, "cat")
    if parts and len(parts) == 2:
        starts.append(parts[0])
    for start in starts:
        if not rope_patterns.anchor(start):
            continue
        for form_name, form in rope_patterns.FORMS:
            found = rope_patterns.rotated_tensor(start, form)
            if found is not None and found["out"] is rotated:
                return {**found, "form": form_name}
    return None


def _search_graph_rotation(call: fx.Node) -> Match | None:
    rotated, chain, permuted, rounded = _query_chain(call.args[0])
    found = _graph_rotation(rotated)
    if found is None:
        return None
    bindings = dict(found, rotated=rotated, chain=chain, permuted=permuted, rounded=rounded, rope_call=None)
    bindings["rotation_nodes"] = found["nodes"]
    return Match("graph_rotation", call, [*found["nodes"], *chain], bindings)


def _search_rope_call(call: fx.Node) -> Match | None:
    rotated, chain, permuted, rounded = _query_chain(call.args[0])
    rope_call = _rope_call(rotated)
    if rope_call is None:
        return None
    a = rope_patterns.rope_call_args(rope_call)
    x = a["q"] if rotated.args[1] == 0 else a["k"]
    bindings = dict(x=x, cos=a["cos"], sin=a["sin"], form=a["form"], rotary_dim=a["rotary_dim"], rotated=rotated, chain=chain,
                    permuted=permuted, rounded=rounded, rope_call=rope_call, partial=False)
    return Match("rope_kernel", call, [rotated, *chain], bindings)


# ---------------------------------------------------------------------------------------------
# guards


device_supported = g.device_supported(lambda b: b["x"])


def rotated_q_private(m: Match, cfg) -> str | None:
    """The rotated q (and every node between it and the attention) is read by the attention only."""
    b = m.bindings
    path = [b["rotated"], *reversed(b["chain"])]
    for node, reader in zip(path, [*path[1:], m.anchor]):
        if set(node.users) != {reader}:
            return f"the rotated q ({node.name}) is also read outside the attention"
    if b["rope_call"] is None:
        leaked = g.escaping(b["rotation_nodes"], keep=[b["rotated"]])
        if leaked:
            return f"intermediate {', '.join(sorted(n.name for n in leaked))} is used elsewhere"
    return None


def dtypes_agree(m: Match, cfg) -> str | None:
    """q, its rotation and the attention in one dtype; or (autocast) a 16-bit q rotated in fp32 by
    fp32 cos/sin and rounded once to q's dtype before the attention, which is what the kernel's
    rotation on load computes (fp32 math, one rounding to the attention dtype)."""
    b = m.bindings
    dtype, rotated = g.dtype(b["x"]), g.dtype(b["rotated"])
    if dtype != g.dtype(m.anchor.args[0]):
        return f"q's dtype {dtype} is not the attention's {g.dtype(m.anchor.args[0])}"
    if rotated != dtype and not (b["rounded"] and rotated == torch.float32):
        return f"the rotation changes the dtype ({dtype} to {rotated}): mixed-dtype math"
    for name in ("cos", "sin"):
        d = g.dtype(b[name])
        if d not in (dtype, torch.float32):
            return f"{name} dtype {d} is neither q's dtype {dtype} nor float32"
    return None


def cos_sin_fit(m: Match, cfg) -> str | None:
    """cos/sin as rope's shape guard wants them, against the unrotated q in its own layout (before
    GPT-J's permute, where cos/sin are in that layout too)."""
    b = m.bindings
    rotary_dim = b["rotary_dim"]
    if not isinstance(rotary_dim, int) or rotary_dim % 2:
        return f"rotary dim {rotary_dim!r} is not an even int"
    return rope_patterns.cos_sin_misfit(b, rotary_dim, [g.tensor(b["x"])])


def whole_head_rotated(m: Match, cfg) -> str | None:
    """The kernel's fast rotation (two half tiles per q tile) needs every channel rotated and a
    power-of-two head dim; the other (q loaded twice) measured slower than the unfused rotation."""
    head_dim = g.static_int(g.tensor(m.anchor.args[0]).shape[-1])
    rotary_dim = m.bindings["rotary_dim"]
    if rotary_dim != head_dim:
        return (f"partial rotary ({rotary_dim} of {head_dim} channels): rotating q on load that way measured 10-13% "
                "slower than attention on a rotated q (H200)")
    if head_dim & (head_dim - 1):
        return f"head dim {head_dim} is not a power of two (the rotation on load that takes measured slower)"
    return None


def form_measured_faster(m: Match, cfg) -> str | None:
    if m.bindings["form"] == "interleaved" and not cfg.rope_attention_interleaved:
        return ("interleaved (GPT-J) form: rotating q on load is opt-in for it "
                "(rope_attention_interleaved=True / FUSIONPASS_ROPE_ATTENTION_INTERLEAVED=1)")
    return None


def _training(m: Match) -> bool:
    return bool(getattr(g.tensor(m.anchor.args[0]), "requires_grad", False))


def cost_rule(m: Match, cfg) -> str | None:
    if _training(m) and not cfg.rope_attention_training:
        return ("training: the backward rotates q again and rotates dq back, spending the forward's saving "
                "(rope_attention_training=True / FUSIONPASS_ROPE_ATTENTION_TRAINING=1 routes it anyway)")
    return None


# ---------------------------------------------------------------------------------------------
# replacement


def _swap(graph: fx.Graph, node: fx.Node, before: fx.Node) -> fx.Node:
    return g.insert_call(graph, before, torch.permute, (node, (0, 2, 1, 3)), node)


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    b = m.bindings
    call = m.anchor
    q, cos, sin = b["x"], b["cos"], b["sin"]
    if b["permuted"]:
        q, cos, sin = (_swap(graph, t, call) for t in (q, cos, sin))
    call.args = (q, *call.args[1:])
    call.kwargs = {**call.kwargs, "rope_cos": cos, "rope_sin": sin, "rope_form": b["form"],
                   "rotary_dim": b["rotary_dim"]}
    rope_call = b["rope_call"]
    g.erase_unused(graph, m.nodes)
    if rope_call is not None:
        _other_rotation_alone(graph, rope_call)
        g.erase_unused(graph, [rope_call])


def _other_rotation_alone(graph: fx.Graph, rope_call: fx.Node) -> None:
    """fusionpass::rope(a, b, ...) of which one output is no longer read: the other (k) gets a call
    of its own."""
    a = rope_patterns.rope_call_args(rope_call)
    live = [u for u in rope_call.users if u.target is operator.getitem and u.users]
    if len(live) != 1:
        return
    (out,) = live
    if out.args[1] == 0 and a["k"] is None:
        return  # a call for one tensor already
    x = a["q"] if out.args[1] == 0 else a["k"]
    out_dtype = a["q_out_dtype"] if out.args[1] == 0 else a["k_out_dtype"]
    alone = g.insert_call(graph, rope_call, torch.ops.fusionpass.rope.default, (x, None, a["cos"], a["sin"]),
                          rope_call, kwargs=dict(form=a["form"], rotary_dim=a["rotary_dim"], q_out_dtype=out_dtype))
    (new, _) = g.insert_getitems(graph, alone, 2)
    out.replace_all_uses_with(new)
    graph.erase_node(out)


@dataclasses.dataclass(frozen=True)
class Options:
    """rope_attention's opt-in cases."""

    # the backward rotates q again for the backward kernels and dq back, spending the bytes the
    # forward saved (see the module docstring)
    training: bool = option(False, "also where q is differentiated")
    # rotating q on load in the interleaved (GPT-J) form won at one shape and lost at another
    # (H200), against a steady gain for rotate_half
    interleaved: bool = option(False, "also the interleaved (GPT-J) form")


ROPE_ATTENTION = registry.register(
    Fusion(
        name="rope_attention",
        summary="q's rotary embedding applied as the attention kernel loads q",
        after=("flash_attention", "rope"),
        options=Options,
        matches=(
            "a fusionpass::flash_attention call whose q is rotated (HF rotate_half, GPT-J interleaved, partial "
            "rotary, or fusionpass::rope's q), also through a heads/tokens permute, same-dtype casts and autocast's "
            "rounding of an fp32 rotation of a 16-bit q -> the "
            "kernel rotates q as it loads it; the rotated q is never written"
        ),
        selected_when=(
            "inference (no gradient through q), rotate_half with every channel rotated and a power-of-two head dim; "
            "training only with rope_attention_training=True, interleaved only with rope_attention_interleaved=True; cos/sin "
            "without grad in q's dtype or float32, broadcasting over q; the rotated q read by the attention only"
        ),
        anchor=is_anchor,
        variants=(
            Variant("graph_rotation", _search_graph_rotation),
            Variant("rope_kernel", _search_rope_call),
        ),
        guards=(
            Guard("device", device_supported),
            Guard("private", rotated_q_private),
            Guard("dtype", dtypes_agree),
            Guard("shape", cos_sin_fit),
            Guard("cos_sin_grad", rope_patterns.cos_sin_constant),
            Guard("layout", whole_head_rotated),
            Guard("form", form_measured_faster),
            Guard("cost", cost_rule),
        ),
        replace=replace,
        unmatched="the attention's q is not a rotary embedding this fusion knows",
    )
)
