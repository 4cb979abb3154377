"""attention: give SDPA its fast path back when the mask it is handed is provably not needed.

Under torch.compile transformers 5.x passes every SDPA call a materialized boolean mask with
`is_causal=False`, even with no padding at all, and SDPA then leaves its flash/cuDNN kernels
(several times slower: docs/architecture.md, Baselines). `fusionpass.patterns.masks` proves what the mask is:
  - purely causal with query and key positions aligned  -> `is_causal=True`, no mask
  - true everywhere (bidirectional, no padding)          -> no mask
  - either of those AND key padding from the run-time `attention_mask` -> a branch
    (`torch.cond`) on one check per forward, "is the attention_mask all true": the fast call if
    so, the original masked call otherwise, so any padding stays exact. The check is a host sync,
    made once for the mask all layers share; it is not made under CUDA graphs. Opt-in
    (`Config.attention_runtime_check`) and CPU only: Inductor's cond lowering fails on some CPU graphs
    and on every CUDA graph the GPU conformance suite tried.
SDPA whose float mask is a per-key bias where a proven boolean mask is true and min elsewhere
(Falcon with ALiBi: `masked_fill(alibi / sqrt(d), where(m, 0, min) < -1, min)`; or
`where(m, 0, min) + bias`) goes to fusionpass::flash_attention with that key_bias by default, with
run-time key padding too in inference (rows that see no key get SDPA's average of the values): SDPA
has no fast kernel for a float mask (Falcon-ALiBi h1024 12L B8 S2048 on the H200: training 1.19x,
inference 1.55x). A bias with a query dimension, a mask that is not proven, mixed dtypes, and
run-time padding in training (SDPA's gradient at rows that see no key) are near misses.
On CUDA every route to fusionpass::flash_attention (and decode_attention's) takes fp16/bf16 only:
the kernels' fp32 dots run on FMA units, far slower than plain torch.compile (`kernel_dtypes`).
Attention written in torch ops (BLOOM's baddbmm with ALiBi, MPT, Falcon, GPT-2's matmuls; see
fusionpass.patterns.eager_attention) goes to fusionpass::flash_attention by default: it replaces
S x S scores, softmax and probabilities (BLOOM-style 12L training 1.62x, GPT-2 eager 1.35x on the
H200). With `Config.attention_kernel` (opt-in: against SDPA's own kernels it measured 1.10x on
Llama with a padded mask, 0.93x on BERT), sliding-window masks and
causal/all-true masks AND run-time key padding go to fusionpass::flash_attention instead (no
branch, no sync; see "the kernel route" below). Everything else is a near miss with its reason:
diagonal offsets, and the masks above while the kernel route is off.

Where the mask goes outright, transformers' `repeat_kv` copy of K and V up to the query head count
(it only skips it, for `enable_gqa=True`, when no mask is passed) goes too: the call reads the
grouped K and V with `enable_gqa=True` (cuDNN's GQA path on the H200: 0.61 vs 0.64 ms fwd+bwd
kernel time at B4 H16/4 S2048 D128, and no copy kernels; benchmarks/results/).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass import registry
from fusionpass.patterns import eager_attention as eager
from fusionpass.patterns import dropout as dp
from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant, option

_SDPA = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def is_sdpa(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _SDPA


def sdpa_arguments(node: fx.Node) -> dict:
    args = dict(_DEFAULTS)
    args.update(zip(_PARAMS, node.args))
    args.update(node.kwargs)
    return args


OPT_IN = (
    "fusionpass's attention kernel is opt-in (attention_kernel=True / FUSIONPASS_ATTENTION_KERNEL=1): "
    "against SDPA it measured 1.10x on Llama but 0.93x on BERT"
)
_NEEDS_KERNEL = {
    "sliding_window": OPT_IN,
    "causal_offset": "query and key positions are offset (bottom-right causal) while SDPA's "
    "is_causal is top-left; fusionpass's attention kernel aligns bottom-right, but this route "
    "is not wired yet",
}


def _search(kind: str, checked: bool):
    """Masks that are `kind` outright, or (`checked`) `kind` AND run-time key padding."""

    def search(node: fx.Node) -> Match | None:
        args = sdpa_arguments(node)
        mask = args["attn_mask"]
        if not isinstance(mask, fx.Node) or args["is_causal"] is not False:
            return None
        if g.dtype(mask) != torch.bool:
            raise NearMiss(f"attention mask of dtype {g.dtype(mask)} (an additive bias)")
        found = masks.classify(mask)
        if found.kind in _NEEDS_KERNEL:
            raise NearMiss(f"{found.detail}: {_NEEDS_KERNEL[found.kind]}")
        if found.kind == "other":
            raise NearMiss(f"mask not provable: {found.detail}")
        if found.kind != kind or bool(found.runtime) != checked:
            return None
        sources = tuple(dict.fromkeys(r.source for r in found.runtime))
        return Match(
            variant=f"{kind}_mask" + ("_if_unpadded" if checked else ""),
            anchor=node,
            nodes=[node],
            bindings=dict(args=args, mask=mask, mask_nodes=found.nodes, padding=sources, kind=kind),
        )

    return search


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


def _grouped_kv(args: dict) -> tuple[fx.Node, fx.Node, int] | None:
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
# guards


device_supported = g.device_supported(lambda b: b["args"]["query"])


def mask_covers_the_scores(m: Match, cfg) -> str | None:
    """The mask's index vectors span exactly the query and key lengths, and the mask is
    [.., Sq, Skv]; for is_causal the two lengths must be equal (SDPA aligns top-left)."""
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
    if (m.bindings["kind"] == "causal" and m.bindings.get("route") != "kernel"
            and not statically_known_true(sq == skv)):
        return f"query length {sq} != key length {skv}: SDPA's is_causal would align top-left"
    return None


def run_time_check_allowed(m: Match, cfg) -> str | None:
    if not m.bindings["padding"] or m.bindings.get("route") == "kernel":
        return None
    if not cfg.attention_runtime_check:
        return (
            "key padding from a run-time attention_mask; the all-true check (torch.cond) is off "
            "by default (attention_runtime_check=True / FUSIONPASS_ATTENTION_RUNTIME_CHECK=1 turns "
            "it on; see fusionpass/config.py for why)"
        )
    if g.tensor(m.bindings["args"]["query"]).device.type == "cuda":
        # switched off on CUDA: Inductor's lowering of the torch.cond failed there with an output
        # stride assertion in 8 of 8 conformance cases, training and inference
        # (benchmarks/results/2026-12-01-h200-conformance.md); CPU graphs keep the route
        return ("the all-true check (torch.cond) is switched off on CUDA: Inductor's CUDA lowering of the cond fails "
                "(output stride assertion)")
    from torch._inductor import config as inductor_config

    if inductor_config.triton.cudagraphs:
        return "the all-true check of attention_mask is a host sync, not allowed under CUDA graphs"
    dropout = m.bindings["args"]["dropout_p"]
    if not g.is_literal(dropout, 0):
        # torch.cond's backward re-runs its branch: dropout would draw other random numbers there
        # than in the forward, and the gradients would be wrong (seen on CPU: 1.2 relative error)
        return f"attention dropout {dropout} inside a run-time branch: its backward would re-draw the mask"
    return None


# ---------------------------------------------------------------------------------------------
# replacement


def _fast_arguments(m: Match, grouped: bool) -> tuple[tuple, dict]:
    """SDPA's arguments without the mask: is_causal for a causal mask, nothing for an all-true
    one; with `grouped`, K/V before their repeat_kv copies and enable_gqa=True."""
    args = dict(m.bindings["args"])
    args["attn_mask"] = None
    args["is_causal"] = m.bindings["kind"] == "causal"
    found = _grouped_kv(args) if grouped else None
    if found is not None:
        args["key"], args["value"], _ = found
        args["enable_gqa"] = True
    positional = tuple(args.pop(p) for p in ("query", "key", "value"))
    kwargs = {k: v for k, v in args.items() if v != _DEFAULTS[k] or k == "is_causal"}
    return positional, kwargs


def _sdpa_branch(target, kwargs: dict, with_mask: bool) -> fx.GraphModule:
    """A branch of torch.cond: (query, key, value, mask) -> (SDPA(...),)."""
    graph = fx.Graph()
    q, k, v, mask = (graph.placeholder(name) for name in ("query", "key", "value", "mask"))
    kwargs = dict(kwargs)
    if with_mask:
        kwargs.update(attn_mask=mask, is_causal=False)
    out = graph.call_function(target, (q, k, v), kwargs)
    graph.output((out,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _all_true_flag(graph: fx.Graph, source: fx.Node) -> fx.Node:
    """One fusionpass::all_true per run-time mask, shared by every layer reading it."""
    for user in source.users:
        if user.target is torch.ops.fusionpass.all_true.default:
            return user
    return g.insert_call(
        graph, source.next, torch.ops.fusionpass.all_true.default, (source,), source
    )


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    node = m.anchor
    # Grouped K/V only in the unconditional call: in a torch.cond both branches must take the same
    # operands, and a branch that repeats K/V itself gives their gradients other strides than the
    # enable_gqa branch (Inductor refuses that).
    positional, kwargs = _fast_arguments(m, grouped=not m.bindings["padding"])
    if not m.bindings["padding"]:
        with graph.inserting_before(node):
            new = graph.call_function(node.target, positional, kwargs)
        new.meta.update(node.meta)
    else:
        flags = [_all_true_flag(graph, source) for source in m.bindings["padding"]]
        module = graph.owning_module
        with graph.inserting_before(node):
            flag = flags[0]
            for other in flags[1:]:
                flag = graph.call_function(torch.logical_and, (flag, other))
            names = []
            for with_mask in (False, True):
                name = _free_attribute(module, "fusionpass_sdpa_masked" if with_mask else "fusionpass_sdpa_fast")
                module.register_module(name, _sdpa_branch(node.target, kwargs, with_mask))
                names.append(graph.get_attr(name))
            operands = (*positional, m.bindings["mask"])
            branch = graph.call_function(torch.ops.higher_order.cond, (flag, *names, operands))
            new = graph.call_function(operator.getitem, (branch, 0))
        new.meta.update(node.meta)
        branch.meta["example_value"] = (node.meta.get("example_value"),)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    # the mask is shared by every layer: it goes once its last reader is rewritten
    g.erase_unused(graph, [n for n in m.bindings["mask_nodes"] if n.op != "placeholder"])
    g.erase_unused(graph, _repeat_kv_nodes(m.bindings["args"]))


def _repeat_kv_nodes(args: dict) -> list[fx.Node]:
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


def _free_attribute(module: torch.nn.Module, prefix: str) -> str:
    i = 0
    while hasattr(module, f"{prefix}_{i}"):
        i += 1
    return f"{prefix}_{i}"


# ---------------------------------------------------------------------------------------------
# the kernel route (Config.attention_kernel): fusionpass::flash_attention
#
# A sliding-window mask (Mistral, Gemma-2's local layers, Qwen2 with use_sliding_window), and a
# causal or all-true mask AND key padding from the run-time attention_mask, become one call of
# fusionpass::flash_attention: window, alignment and the [B, Lk] key-padding vector read from the
# mask's classification, grouped K/V read without repeat_kv. No torch.cond, no host sync.

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _key_padding_vector(found: masks.MaskKind, mask: fx.Node, args: dict) -> fx.Node:
    """The [B, Lk] bool tensor the mask reads as `padding[batch_idx, kv_idx]`, exactly."""
    if len({r.source for r in found.runtime}) != 1:
        raise NearMiss("key padding from several run-time tensors: one key-padding vector only")
    term = found.runtime[0]
    source, index = term.source, term.index
    q, k, t = g.tensor(args["query"]), g.tensor(args["key"]), g.tensor(source)
    m = g.tensor(mask)
    why = None
    if t is None or t.dim() != 2 or len(index) != 2 or m is None or m.dim() != 4:
        why = "not a 2-D lookup into a 4-D mask"
    elif t.dtype != torch.bool:
        why = f"key-padding tensor of dtype {t.dtype}"
    else:
        (b_idx, kv_idx) = index
        batch_axis = -m.dim()
        for placement, axis, size, name in ((b_idx, batch_axis, q.shape[0], "batch"),
                                             (kv_idx, masks.KV_AXIS, k.shape[-2], "key")):
            length = dict(placement.lengths).get(axis)
            if placement.coef != ((axis, 1),) or placement.const != 0 or length is None or not (
                statically_known_true(length == size)
            ):
                why = f"its {name} index is not arange({size}) on the mask's {name} axis"
                break
        if why is None and not (
            statically_known_true(t.shape[0] == q.shape[0]) and statically_known_true(t.shape[1] == k.shape[-2])
        ):
            why = f"key-padding tensor of shape {tuple(t.shape)}, not [{q.shape[0]}, {k.shape[-2]}]"
    if why is not None:
        raise NearMiss(f"key padding not provably attention_mask[batch, kv]: {why}")
    return source


def _kernel_search(kind: str, padded: bool):
    """`kind` masks (sliding_window, causal, none), with (`padded`) or without run-time key padding,
    for fusionpass::flash_attention."""

    def search(node: fx.Node) -> Match | None:
        args = sdpa_arguments(node)
        mask = args["attn_mask"]
        if not isinstance(mask, fx.Node) or args["is_causal"] is not False or g.dtype(mask) != torch.bool:
            return None
        found = masks.classify(mask)
        if found.kind != kind or bool(found.runtime) != padded:
            return None
        if kind == "sliding_window" and (found.window is None or found.window < 1):
            raise NearMiss(f"{found.detail} without a causal bound: the kernel's window needs one")
        key_padding = _key_padding_vector(found, mask, args) if padded else None
        key, value = args["key"], args["value"]
        grouped = _grouped_kv(args)
        if grouped is not None:
            key, value, _ = grouped
        variant = {"sliding_window": "sliding_window", "causal": "causal", "none": "none"}[kind]
        return Match(
            variant=f"{variant}_kernel" + ("_padded" if padded else ""),
            anchor=node,
            nodes=[node],
            bindings=dict(args=args, mask=mask, mask_nodes=found.nodes, padding=(), kind=kind, route="kernel",
                          key=key, value=value, key_padding=key_padding, shift=found.shift, window=found.window),
        )

    return search


_EAGER_KINDS = ("causal", "none", "sliding_window")


def _eager_search(node: fx.Node) -> Match | None:
    """Attention written in torch ops (BLOOM's baddbmm with ALiBi, GPT-2's matmuls; see
    fusionpass.patterns.eager_attention) -> fusionpass::flash_attention."""
    if not eager.is_anchor(node):
        return None
    found = eager.describe(node)
    if found is None:
        return None
    e, args = found
    kind, shift, window, mask_nodes = "none", 0, None, []
    if e.mask is not None:
        mk = masks.classify(e.mask)
        if mk.kind not in _EAGER_KINDS:
            raise NearMiss(f"eager attention mask not provable: {mk.detail}")
        if mk.runtime:
            raise NearMiss(
                f"eager attention mask with run-time key padding ({mk.detail}): a query row that sees no "
                "key averages every value under the additive mask, and is 0 in the kernel"
            )
        if mk.kind == "sliding_window" and (mk.window is None or mk.window < 1):
            raise NearMiss(f"{mk.detail} without a causal bound: the kernel's window needs one")
        kind, shift, window = mk.kind, mk.shift, mk.window
        mask_nodes = [*e.mask_nodes, *mk.nodes]
    biased = e.key_bias is not None or e.mask_bias is not None
    if biased:
        why = eager.check_key_bias(e, args["query"], args["key"])
        if why is not None:
            raise NearMiss(why)
    key, value = args["key"], args["value"]
    grouped = _grouped_kv(args)
    if grouped is not None:
        key, value, _ = grouped
    variant = "eager_alibi_mask_kernel" if e.mask_bias is not None else (
        "eager_alibi_kernel" if biased else "eager_kernel")
    return Match(
        variant=variant,
        anchor=node,
        nodes=list(e.nodes),
        bindings=dict(args=args, mask=e.mask, mask_nodes=mask_nodes, padding=(), kind=kind, route="kernel",
                      key=key, value=value, key_padding=None, shift=shift, window=window, eager=e),
    )


def _alibi_mask_search(node: fx.Node) -> Match | None:
    """SDPA whose float mask is a per-key bias where a proven boolean mask is true and very
    negative elsewhere (Falcon's `masked_fill(alibi / sqrt(d), where(m, 0, min) < -1, min)`, or
    `where(m, 0, min) + bias`) -> fusionpass::flash_attention with key_bias, causal and key
    padding from m. On by default: SDPA has no fast kernel for a float mask (it runs its
    memory-efficient or math kernel and reads the [B, H, Lq, Lk] bias)."""
    args = sdpa_arguments(node)
    mask = args["attn_mask"]
    if not isinstance(mask, fx.Node) or args["is_causal"] is not False or not eager._float_node(mask):
        return None
    found = eager.biased_mask(mask)
    if found is None:
        return None
    q = args["query"]
    why = eager.per_key_problem(found.bias, q, args["key"])
    if why is not None:
        raise NearMiss(f"SDPA mask with a bias: {why}")
    dtypes = {g.dtype(n) for n in (q, mask, found.bias)}
    if len(dtypes) != 1:
        raise NearMiss(f"SDPA mask with a bias: query, mask and bias dtypes {sorted(map(str, dtypes))} differ")
    mk = masks.classify(found.visible)
    if mk.kind not in ("causal", "none", "sliding_window"):
        raise NearMiss(f"SDPA mask with a bias: the boolean mask under it is not provable ({mk.detail})")
    if mk.kind == "sliding_window" and (mk.window is None or mk.window < 1):
        raise NearMiss(f"{mk.detail} without a causal bound: the kernel's window needs one")
    key_padding = None
    if mk.runtime:
        _padding_rows_reproducible(found, mk, args)
        key_padding = _key_padding_vector(mk, found.visible, args)
    key, value = args["key"], args["value"]
    grouped = _grouped_kv(args)
    if grouped is not None:
        key, value, _ = grouped
    return Match(
        variant="alibi_mask_kernel" + ("_padded" if mk.runtime else ""),
        anchor=node,
        nodes=[node],
        bindings=dict(args=args, mask=found.visible, mask_nodes=[*found.nodes, *mk.nodes], padding=(),
                      kind=mk.kind, route="kernel", key=key, value=value, key_padding=key_padding,
                      shift=mk.shift, window=mk.window, key_bias=found.bias, empty_rows=bool(mk.runtime)),
    )


def _padding_rows_reproducible(found, mk: masks.MaskKind, args: dict) -> None:
    """With run-time key padding a query row may see no key (left padding). Under the float mask
    its scores are all the fill, so SDPA averages every value; the kernel gives 0. The replacement
    writes that average into those rows (`_average_empty_rows`), which is exact only where the
    fill absorbs the scores (fp32/bf16's min, not fp16's -65504) and the rows that see no key
    are known: causal top-left with Lq == Lk (row i: no kept key <= i) or no causal bound (no
    kept key at all)."""
    if found.fill > eager.ABSORBING_FILL:
        raise NearMiss(
            f"SDPA mask with a bias and run-time key padding, fill {found.fill:g}: a query row that sees no "
            "key gets softmax(scores + fill) from SDPA, not reproducible by the kernel"
        )
    lq, lk = g.tensor(args["query"]).shape[-2], g.tensor(args["key"]).shape[-2]
    if mk.kind == "sliding_window" or (mk.kind == "causal" and not statically_known_true(lq == lk)):
        raise NearMiss(f"SDPA mask with a bias: {mk.detail}, where the rows that see no key are not wired")
    if _needs_grad(args):
        # SDPA differentiates its softmax at those rows as a uniform one, which gives q and k a
        # gradient there; emulating it (an extra q (k - mean k)^T v term) crashed Inductor's CPU
        # code in training, so training with padding stays on SDPA
        raise NearMiss("SDPA mask with a bias and run-time key padding in training: the gradient SDPA gives "
                       "q and k at query rows that see no key is not reproduced by the kernel")


def _needs_grad(args: dict) -> bool:
    return any(getattr(g.tensor(args[n]), "requires_grad", False) for n in ("query", "key"))


def _average_empty_rows(graph: fx.Graph, out: fx.Node, b: dict, before: fx.Node) -> fx.Node:
    """out, with the rows that see no key replaced by the mean of every value (what SDPA computes
    there under a float mask whose fill absorbs the scores; the kernel leaves 0). Causal: row i is
    empty iff no key <= i is kept; otherwise iff no key is kept."""
    def call(target, *args):
        return g.insert_call(graph, before, target, args, before)

    pad = b["key_padding"]  # [B, Lk] bool
    if b["kind"] == "causal":
        empty = call(torch.eq, call(torch.cumsum, pad, -1), 0)  # [B, Lq], Lq == Lk
    else:
        empty = call(torch.logical_not, call(torch.any, pad, -1, True))  # [B, 1]
    empty = call(operator.getitem, empty, (slice(None), None, slice(None), None))
    q, v = b["args"]["query"], b["value"]
    hq, hkv = (g.static_int(g.tensor(n).shape[1]) for n in (q, v))

    def per_query_head(x):
        return x if hkv in (1, hq) else call(torch.repeat_interleave, x, hq // hkv, 1)

    average = per_query_head(call(torch.mean, v, -2, True))  # [B, Hq or 1, 1, D]
    return call(torch.where, empty, average, out)


def _kernel_only(check):
    def guard(m: Match, cfg) -> str | None:
        return check(m, cfg) if m.bindings.get("route") == "kernel" else None

    guard.__doc__ = check.__doc__
    return guard


def kernel_dtypes(m: Match, cfg) -> str | None:
    """q, k and v share one dtype of fp16/bf16/fp32, and on CUDA not fp32: the kernels' fp32 dot
    products are IEEE fp32 on FMA units, and on the H200 fp32 attention through them was far
    slower than plain torch.compile's (benchmarks/results/2026-12-01-h200-fp32-attention.md), so
    fp32 graphs keep their attention there. (CPU graphs, which run the host ops, keep fp32.)"""
    b = m.bindings
    q = b["args"]["query"]
    dtypes = [g.dtype(n) for n in (q, b["key"], b["value"])]
    if len(set(dtypes)) != 1:
        return f"q/k/v dtypes {[str(d) for d in dtypes]} differ: the kernel takes one of fp16/bf16/fp32"
    if dtypes[0] == torch.float32 and g.tensor(q).device.type == "cuda":
        return ("fp32 q/k/v: the kernel's fp32 dot products run on FMA units, slower than plain "
                "torch.compile's attention (benchmarks/results/2026-12-01-h200-fp32-attention.md)")
    if dtypes[0] not in _KERNEL_DTYPES:
        return f"q/k/v dtype {dtypes[0]}: the kernel takes one of fp16/bf16/fp32"
    return None


def kernel_shapes(m: Match, cfg) -> str | None:
    """q [B, Hq, Lq, D], k = v [B, Hkv, Lk, D], Hq % Hkv == 0, statically."""
    b = m.bindings
    q, k, v = (g.tensor(n) for n in (b["args"]["query"], b["key"], b["value"]))
    if any(t is None or t.dim() != 4 for t in (q, k, v)):
        return "q/k/v are not all 4-D [B, H, L, D]"
    hq, hkv = g.static_int(q.shape[1]), g.static_int(k.shape[1])
    same = all(statically_known_true(a == c) for a, c in zip(k.shape, v.shape))
    if not same or not statically_known_true(q.shape[0] == k.shape[0]) or not statically_known_true(
        q.shape[3] == k.shape[3]
    ):
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not [B, H, L, D] alike"
    if hq is None or hkv is None or hkv == 0 or hq % hkv:
        return f"query heads {q.shape[1]} not a static multiple of kv heads {k.shape[1]}"
    return None


def kernel_head_dim(m: Match, cfg) -> str | None:
    from fusionpass.kernels.attention import HEAD_DIMS

    d = g.static_int(g.tensor(m.bindings["args"]["query"]).shape[-1])
    if d not in HEAD_DIMS:
        return f"head dim {d} not in the kernel's {HEAD_DIMS}"
    return None


def kernel_constants(m: Match, cfg) -> str | None:
    """dropout_p and scale are constants; the diagonal is top-left or bottom-right aligned."""
    args = m.bindings["args"]
    p = args["dropout_p"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        return f"dropout_p {p!r} is not a constant in [0, 1)"
    scale = args["scale"]
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        return f"scale {scale!r} is not a constant"
    shift = m.bindings["shift"]
    lq, lk = g.tensor(args["query"]).shape[-2], g.tensor(args["key"]).shape[-2]
    if shift != 0 and not statically_known_true(lk - lq == shift):
        return f"diagonal offset {shift} is neither 0 (top-left) nor Lk - Lq (bottom-right)"
    return None


def replace_with_kernel(graph: fx.Graph, m: Match, cfg) -> None:
    b = m.bindings
    node, args = m.anchor, b["args"]
    q = args["query"]
    d = g.static_int(g.tensor(q).shape[-1])
    scale = float(args["scale"]) if args["scale"] is not None else d**-0.5
    p = float(args["dropout_p"])
    seed = None
    if p > 0:

        seed = dp.insert_seed(graph, node, q)
    causal = b["kind"] != "none"
    e = b.get("eager")
    if e is not None and (e.key_bias is not None or e.mask_bias is not None):
        key_bias = eager.insert_key_bias(graph, e, q, node)
    elif b.get("key_bias") is not None:
        key_bias = eager.insert_per_key(graph, b["key_bias"], node)
    else:
        key_bias = None
    call = g.insert_call(
        graph,
        node,
        torch.ops.fusionpass.flash_attention.default,
        (q, b["key"], b["value"], b["key_padding"], key_bias, scale, causal, b["window"] or 0, b["shift"] != 0, p,
         seed),
        node,
    )
    out, _ = g.insert_getitems(graph, call, 2)
    if b.get("empty_rows"):
        out = _average_empty_rows(graph, out, b, node)
    if e is not None and g.tensor(node).dim() == 3:
        # BLOOM's bmm gives [B*H, Lq, D]; the kernel's output is contiguous [B, H, Lq, D] here
        # (attention_out_proj may then make it token-major and drop this view with _merge_heads' own)
        with graph.inserting_after(out):
            flat = graph.call_method("view", (out, list(g.tensor(node).shape)))
        flat.meta.update(node.meta)
        out = flat
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    if e is not None:
        g.erase_unused(graph, [n for n in e.nodes if n is not node])
    g.erase_unused(graph, [n for n in b["mask_nodes"] if n.op != "placeholder"])
    g.erase_unused(graph, _repeat_kv_nodes(args))


def _replace(graph: fx.Graph, m: Match, cfg) -> None:
    if m.bindings.get("route") == "kernel":
        replace_with_kernel(graph, m, cfg)
    else:
        replace(graph, m, cfg)


def _kernel_on(cfg) -> bool:
    return cfg.attention_kernel


@dataclasses.dataclass(frozen=True)
class Options:
    """attention's opt-in routes."""

    # Masks that are causal/all-true AND key padding from a run-time attention_mask become a
    # torch.cond on one "all true?" check per forward. Off by default: Inductor's cond lowering
    # crashed Llama-family inference graphs and refuses q/k/v that alias one tensor (GPT-2's
    # split), seen on CPU (tests/patterns/test_attention_masks.py); never on CUDA, where the
    # lowering failed in every conformance case (`run_time_check_allowed`).
    runtime_check: bool = option(False, "causal/all-true masks AND run-time key padding -> torch.cond "
                                        "on one all-true check per forward (CPU graphs only)")
    # Off by default: against SDPA's own kernels it won on Llama with an all-ones mask and lost on
    # BERT-base (benchmarks/results/2026-11-30-h200-attention-kernel.md). Eager-math attention goes
    # to the kernel regardless. Where on, it is preferred over the torch.cond check above.
    kernel: bool = option(False, "SDPA with a proven sliding-window mask, or causal/all-true AND "
                                 "run-time key padding -> fusionpass::flash_attention")


ATTENTION = registry.register(
    Fusion(
        name="attention",
        summary='SDPA masks proven causal or all-true dropped; eager-math and ALiBi attention to our FlashAttention-2 kernel',
        when='mask rewrites always; the kernel for eager/ALiBi attention in fp16/bf16 (attention_kernel: SDPA windows and padding too)',
        evidence='benchmarks/results/2026-11-30-h200-attention-masks.md',
        after=("decode_attention", "rope"),
        options=Options,
        matches=(
            "eager-math attention (BLOOM's baddbmm of the ALiBi tensor, MPT's added ALiBi slice and "
            "masked_fill, Falcon's ALiBi in scores and mask, GPT-2's matmul / scale / "
            "additive causal mask / softmax / dropout / matmul) and SDPA whose float mask carries a per-key "
            "(ALiBi) bias over a proven causal/all-true mask (+ key padding) -> fusionpass::flash_attention; "
            "F.scaled_dot_product_attention with a boolean mask built from index arithmetic "
            "(transformers' sdpa_mask): proven causal -> is_causal=True, proven all-true -> no mask; "
            "the same AND key padding -> that fast call when attention_mask is all true (one "
            "check per forward), the original call otherwise; without that branch the call reads "
            "grouped K/V (enable_gqa=True) instead of repeat_kv copies"
        ),
        selected_when=(
            "always where the mask is proven (dropping a mask never slows SDPA down), for "
            "eager-math attention and for ALiBi-biased SDPA masks (our kernel instead of S x S tensors); sliding windows and "
            "run-time key padding in SDPA go to fusionpass::flash_attention only with "
            "attention_kernel=True (opt-in: 1.10x on Llama, 0.93x on BERT), else they are near "
            "misses, as are offset diagonals; every route to fusionpass::flash_attention takes "
            "fp16/bf16 on CUDA (fp32 is a near miss there, kernel_dtypes)"
        ),
        anchor=lambda node: (is_sdpa(node) and isinstance(sdpa_arguments(node)["attn_mask"], fx.Node))
        or eager.is_anchor(node),
        variants=(
            Variant("eager_kernel", _eager_search),
            # before the SDPA mask variants, which call any float mask a near miss
            Variant("alibi_mask_kernel", _alibi_mask_search),
            Variant("sliding_window_kernel", _kernel_search("sliding_window", False), when=_kernel_on),
            Variant("sliding_window_kernel_padded", _kernel_search("sliding_window", True), when=_kernel_on),
            Variant("causal_kernel_padded", _kernel_search("causal", True), when=_kernel_on),
            Variant("none_kernel_padded", _kernel_search("none", True), when=_kernel_on),
            Variant("causal_mask", _search("causal", checked=False)),
            Variant("none_mask", _search("none", checked=False)),
            # CPU only (see run_time_check_allowed)
            Variant("causal_mask_if_unpadded", _search("causal", checked=True), cuda=False),
            Variant("none_mask_if_unpadded", _search("none", checked=True), cuda=False),
        ),
        guards=(
            Guard("device", device_supported),
            Guard("shape", mask_covers_the_scores),
            Guard("run_time_check", run_time_check_allowed),
            Guard("kernel_dtype", _kernel_only(kernel_dtypes)),
            Guard("kernel_shape", _kernel_only(kernel_shapes)),
            Guard("kernel_head_dim", _kernel_only(kernel_head_dim)),
            Guard("kernel_constants", _kernel_only(kernel_constants)),
        ),
        replace=_replace,
        modules=("fusionpass.patterns.masks", "fusionpass.patterns.eager_attention", "fusionpass.ops.flash_attention",
                 "fusionpass.kernels.attention"),
        unmatched="SDPA with a mask, or softmax(scores) @ values, in a form this fusion has no rewrite for",
    )
)
