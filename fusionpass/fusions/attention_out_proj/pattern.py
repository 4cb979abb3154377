"""attention_out_proj: the attention kernel writes its output token-major, so that merging the heads
for the output projection is a view, not a copy.

Every HF attention hands its [B, H, S, D] output to the output projection (`o_proj`, `dense`,
`c_proj`) as [B, S, H*D]:
  GPT-2 / Llama family:  out [.reshape(B, H, S, D)] .transpose(1, 2) [.contiguous()] .reshape(B, S, -1)
                         [.contiguous()]   (the same-shape reshape: transformers 5.24's SDPA path)
  BLOOM (_merge_heads):  out.view(B*H, S, D) (what the attention fusion leaves of its bmm)
                         .view(B, H, S, D).permute(0, 2, 1, 3).reshape(B, S, H*D)
then `linear(x, W, b)`, `matmul(x, W)` or Conv1D's `addmm(b, x.view(-1, H*D), W)`. With the
attention output contiguous in [B, H, S, D], Inductor lowers that reshape to a copy kernel: it
reads and writes B*S*H*D elements, and in training keeps both tensors alive (the attention
output for its backward, the copy for the projection's weight gradient). This fusion sets
`token_major=True` on the fusionpass::flash_attention call (fusionpass/fusions/flash_attention/op.py;
fusionpass::padded_attention, that fusion's cuDNN route, takes it the same way):
the kernel then stores into a [B, S, H, D] buffer (returned as its [B, H, S, D] transpose, the
layout PyTorch's flash/cuDNN SDPA return), the transpose is contiguous, the reshape a view, and the
copy kernel and the second tensor are gone. BLOOM's view round trip through [B*H, S, D] (which
token-major strides cannot take as a view) is dropped: the permute reads the kernel output itself.
An explicit `.contiguous()` stays in the graph; on a contiguous tensor it is no op.

In the backward: GPT-2/Llama's form had no copy there (the gradient of transpose + reshape is a
strided view of the projection's input gradient, which the backward kernels read as it is, before
and after); BLOOM's had one, the gradient made contiguous for the [B*H, S, D] round-trip views,
which goes with them (seen in the kernel names Inductor generates on CPU: benchmarks/probes/
attention_out_proj.py --smoke as of 67836ab).

The projection GEMM itself stays a library GEMM: fusing it into the attention kernel would make
each attention program compute all H heads of its tokens (one program per query block instead of
one per (query block, head)), which FA2's parallelism does not survive at training sizes; not
built, nothing measured. The residual add after the projection is already fused into the next
step: by Inductor into the following LayerNorm/RMSNorm kernel, or by layer_norm_dropout_residual /
rms_norm_residual where those match (GPT-2's `attn + residual` feeding ln_2, BLOOM's dropout_add
feeding post_attention_layernorm), so it needs no rule here.

Near misses: an attention output read by anything besides the head merge (another layout would
not be wrong, but the rewrite of BLOOM's views needs the chain to itself), and merged heads that
feed something other than a projection.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass import registry
from fusionpass.patterns import graph as g
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant

_LINEARS = (torch._C._nn.linear, F.linear)
_MATMULS = (torch.matmul, operator.matmul, "matmul")
_ADDMMS = (torch.addmm, "addmm")


def _attention_ops():
    # registered by fusionpass.ops, which the pass imports before any fusion runs; both take
    # token_major (padded_attention: flash_attention's cuDNN route)
    return (torch.ops.fusionpass.flash_attention.default, torch.ops.fusionpass.padded_attention.default)


def _token_major(call: fx.Node) -> bool:
    return bool(call.kwargs.get("token_major", False))


def is_anchor(node) -> bool:
    """A fusionpass::flash_attention (or padded_attention) call whose output is still
    [B, H, S, D]-contiguous."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _attention_ops() and (
        not _token_major(node))


def _shape(node) -> tuple | None:
    t = g.tensor(node)
    return None if t is None else tuple(t.shape)


def _same(shape, expected) -> bool:
    return shape is not None and len(shape) == len(expected) and all(
        statically_known_true(a == b) for a, b in zip(shape, expected)
    )


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _attention_output(call: fx.Node) -> fx.Node:
    """The `call[0]` node (out; call[1] is lse). Raises NearMiss when out has other readers."""
    outs = [u for u in call.users if g.is_call(u, (operator.getitem,)) and u.args[1] == 0]
    if len(outs) != 1:
        raise NearMiss("the attention output is not taken exactly once from the op")
    out = outs[0]
    if _only_user(out) is None:
        raise NearMiss(f"the attention output is read by {len(out.users)} nodes, not only by the head merge")
    return out


def _past_contiguous(node: fx.Node) -> fx.Node:
    """Follow `.contiguous()` calls (no-ops once the layout is token-major) to the last one."""
    while True:
        user = _only_user(node)
        if not (g.is_call(user, ("contiguous",)) and len(user.args) == 1 and not user.kwargs):
            return node
        node = user


def _projection(x: fx.Node, width) -> tuple[str, fx.Node] | None:
    """(kind, node) of the projection that reads x [B, S, H*D]: linear(x, W, b), matmul(x, W), or
    Conv1D's addmm(b, x.view(-1, H*D), W)."""
    user = _only_user(x)
    if g.is_call(user, _LINEARS) and user.args and user.args[0] is x:
        return "linear", user
    if g.is_call(user, _MATMULS) and len(user.args) == 2 and user.args[0] is x:
        return "matmul", user
    if g.is_call(user, g.VIEWS) and user.args[0] is x and len(_shape(user) or ()) == 2 and _same(
        _shape(user)[1:], (width,)
    ):
        mm = _only_user(user)
        if g.is_call(mm, _ADDMMS) and len(mm.args) >= 3 and mm.args[1] is user:
            return "addmm", mm
    return None


def _merge(start: fx.Node, shape: tuple) -> tuple[list[fx.Node], tuple[str, fx.Node]] | None:
    """From `start` ([B, H, S, D], the attention output or BLOOM's re-view of it): the transpose, the
    reshape to [B, S, H*D] and the projection. Returns (chain nodes, projection) or None."""
    B, H, S, D = shape
    t = _only_user(start)
    if not g.swaps_heads_and_tokens(t):
        return None
    x = _past_contiguous(t)
    r = _only_user(x)
    if not (g.is_call(r, g.VIEWS) and r.args[0] is x and _same(_shape(r), (B, S, H * D))):
        return None
    x = _past_contiguous(r)
    proj = _projection(x, H * D)
    if proj is None:
        user = _only_user(x)
        raise NearMiss(
            f"the merged heads feed {getattr(user, 'target', user)!r}, not an output projection"
            if user is not None else "the merged heads are read by several nodes, not one projection"
        )
    return [t, r], proj


def _past_same_shape_view(node: fx.Node, shape: tuple) -> fx.Node:
    """Past a reshape/view of `node` to its own shape: transformers 5.24's sdpa_attention_forward
    ends with `out.reshape(out.shape[0], -1, q_len, D)` (undoing its pack_gqa, else a no-op). A
    view of a tensor as its own shape is one for any strides, token-major ones too."""
    user = _only_user(node)
    if g.is_call(user, g.VIEWS) and user.args[0] is node and _same(_shape(user), shape):
        return user
    return node


def _transpose_search(call: fx.Node) -> Match | None:
    """GPT-2 / Llama family: out[.reshape(B, H, S, D)].transpose(1, 2)[.contiguous()]
    .reshape(B, S, H*D) -> projection."""
    out = _attention_output(call)
    shape = _shape(out)
    if shape is None or len(shape) != 4:
        return None
    start = _past_same_shape_view(out, shape)
    found = _merge(start, shape)
    if found is None:
        return None
    nodes, (kind, proj) = found
    nodes = [start, *nodes] if start is not out else nodes
    return Match("transpose_reshape", call, nodes, dict(out=out, projection=proj, kind=kind, round_trip=()))


def _merge_heads_search(call: fx.Node) -> Match | None:
    """BLOOM's `_merge_heads`: out.view(B*H, S, D).view(B, H, S, D).permute(0, 2, 1, 3).reshape(B, S,
    H*D) -> dense."""
    out = _attention_output(call)
    shape = _shape(out)
    if shape is None or len(shape) != 4:
        return None
    B, H, S, D = shape
    flat = _only_user(out)
    if not (g.is_call(flat, g.VIEWS) and _same(_shape(flat), (B * H, S, D))):
        return None
    heads = _only_user(flat)
    if not (g.is_call(heads, g.VIEWS) and heads.args[0] is flat and _same(_shape(heads), shape)):
        return None
    found = _merge(heads, shape)
    if found is None:
        return None
    nodes, (kind, proj) = found
    return Match("merge_heads", call, [flat, heads, *nodes],
                 dict(out=out, projection=proj, kind=kind, round_trip=(flat, heads)))


device_supported = g.device_supported(lambda b: b["out"])


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    call, out = m.anchor, m.bindings["out"]
    call.kwargs = {**call.kwargs, "token_major": True}
    # later patterns read example values: give the op and its outputs the new strides
    mode = g.fake_mode_of([a for a in call.args if isinstance(a, fx.Node)])
    if mode is not None:
        fake = [g.value(a) if isinstance(a, fx.Node) else a for a in call.args]
        kwargs = {k: g.value(a) if isinstance(a, fx.Node) else a for k, a in call.kwargs.items()}
        with mode:
            value = call.target(*fake, **kwargs)
        call.meta["example_value"] = value
        for user in call.users:
            if g.is_call(user, (operator.getitem,)):
                user.meta["example_value"] = value[user.args[1]]
    round_trip = m.bindings["round_trip"]
    if round_trip:
        # BLOOM: [B*H, S, D] is no view of token-major strides; the permute reads out itself
        flat, heads = round_trip
        heads.replace_all_uses_with(out)
        g.erase_unused(graph, [heads, flat])


ATTENTION_OUT_PROJ = registry.register(
    Fusion(
        name="attention_out_proj",
        summary='the attention kernel writes token-major output for the output projection (no head-merge copy)',
        after=("flash_attention", "rope_attention"),
        matches=(
            "fusionpass::flash_attention output merged back to [B, S, H*D] for the output projection "
            "(transpose(1, 2) [.contiguous()] .reshape/.view, BLOOM's _merge_heads view/permute/reshape) "
            "feeding linear / matmul / Conv1D addmm -> the kernel writes its output token-major, so the "
            "head merge is a view and its copy kernel is gone"
        ),
        selected_when=(
            "always where it matches: it removes a read and a write of the attention output "
            "(2 * B*S*H*D elements) in the forward and changes nothing else"
        ),
        anchor=is_anchor,
        variants=(
            Variant("transpose_reshape", _transpose_search),
            Variant("merge_heads", _merge_heads_search),
        ),
        guards=(Guard("device", device_supported),),
        replace=replace,
        unmatched="the attention output is not merged into [B, S, H*D] by a head merge this fusion knows",
    )
)
