"""flash_attention: attention the model computes in a slow form -> fusionpass::flash_attention, our
FlashAttention-2 style kernel (fusionpass/kernels/attention), forward and backward.

On by default, where SDPA has no fast kernel for what the model computes:
  - attention written in torch ops (BLOOM's baddbmm with ALiBi, MPT, Falcon, GPT-2's matmuls; see
    fusionpass.patterns.eager_attention): the kernel replaces the S x S scores, softmax and
    probabilities;
  - SDPA whose float mask is a per-key bias where a proven boolean mask is true and min elsewhere
    (Falcon with ALiBi: `masked_fill(alibi / sqrt(d), where(m, 0, min) < -1, min)`; or
    `where(m, 0, min) + bias`): SDPA runs its math or memory-efficient kernel and reads the
    [B, H, Lq, Lk] bias; the kernel takes the [B, H, Lk] key_bias. Run-time key padding too in
    inference (rows that see no key get SDPA's average of the values);
  - SDPA with a causal mask AND key padding from the run-time attention_mask (what every HF data
    collator passes, all ones or not), over square scores (Lq == Lk, no cache): plain compile runs
    SDPA with the materialized [B, 1, L, L] mask there; the kernel reads a [B, Lk] key-padding
    vector (`attention_causal_padding`, on by default up to head dim 128, `padding_cost`;
    benchmarks/results/latest/flash_attention.md, benchmarks/results/kernel/collator_attention_routes.md).
    From query length `attention_cudnn_padding_min_length` on, with the `cudnn` extra installed,
    fusionpass::padded_attention serves it instead: cuDNN with device sequence lengths for the rows
    whose keys are a prefix (all ones, right padding), our kernel for the others, chosen per row on
    the device (`attention_cudnn_padding`, `cudnn_padding_miss`);
  - SDPA with a causal mask AND the sequence segments of packed sequences (transformers' mask for
    position ids that restart at each sequence, `DataCollatorWithFlattening`: seg[b, q] ==
    seg[b, kv] with seg a cumsum over the row, so nondecreasing) over square scores: the kernel
    reads the [B, L] segment ids and skips the key blocks before each query block's sequence
    (`attention_packed`, on by default);
  - SDPA with an all-true mask AND run-time key padding over square scores (BERT, RoBERTa, XLM-R
    fine-tuned with a padding collator): plain compile runs SDPA with the materialized mask over
    every key; the kernel skips the key blocks past each row's last kept key
    (`attention_padding`, on by default at head dim 64 without attention dropout, the cost rules
    `padding_cost`; benchmarks/results/kernel/padded_attention.md);
  - SDPA with a proven sliding-window mask (Mistral, Gemma-2/3's local layers, Qwen2 with
    use_sliding_window; ModernBERT's bidirectional band |i - j| <= w, the window 2w + 1 on the
    diagonal moved by w, the kernel's `diagonal`), with or without run-time key padding, over
    square scores: plain compile runs SDPA with the materialized window mask, every key block of
    every row; the kernel visits only the blocks inside the window (`attention_sliding_window`, on
    by default; benchmarks/results/latest/attention_windows.md).
Opt-in (`attention_kernel`): causal, windowed or all-true masks with key padding over a cache
(Lq != Lk): window, alignment and the [B, Lk] key-padding vector read from the
mask's classification, grouped K/V read without repeat_kv, no torch.cond, no host sync. Off by
default because against SDPA's own kernels it won on some shapes and lost on others
(benchmarks/results/latest/flash_attention.md).
On CUDA every route takes fp16/bf16 only: the kernels' fp32 dots run on FMA units, slower than
plain torch.compile (`attention_kernel.kernel_dtypes`).

Near misses: a bias with a query dimension, a mask that is not proven, mixed dtypes, run-time
padding in training under a float mask (SDPA's gradient at rows that see no key), diagonal
offsets that are neither top-left nor bottom-right. This fusion runs before sdpa_mask and
sdpa_runtime_check, so where its kernel route is on it is preferred over their rewrites.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass import registry
from fusionpass.cost import Range, Switch, fields, mode
from fusionpass.patterns import attention_kernel as ak
from fusionpass.patterns import dropout as dp
from fusionpass.patterns import eager_attention as eager
from fusionpass.patterns import graph as g
from fusionpass.patterns import masks
from fusionpass.patterns import sdpa
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant, option


def _kernel_search(kind: str, padded: bool, packed: bool = False):
    """`kind` masks (sliding_window, causal, none), with (`padded`) or without run-time key padding,
    or (`packed`) with the sequence segments of packed sequences, for fusionpass::flash_attention."""

    def search(node: fx.Node) -> Match | None:
        args = sdpa.sdpa_arguments(node)
        mask = args["attn_mask"]
        if not isinstance(mask, fx.Node) or args["is_causal"] is not False or g.dtype(mask) != torch.bool:
            return None
        found = masks.classify(mask)
        if found.kind != kind or bool(masks.terms_of(found, masks.SEGMENTS)) != packed:
            return None
        if not packed and bool(found.runtime) != padded:
            return None
        if kind == "sliding_window" and (found.window is None or found.window < 1):
            raise NearMiss(f"{found.detail} without a causal bound: the kernel's window needs one")
        key_padding = ak.key_padding_vector(found, mask, args) if padded else None
        segments = ak.segment_vector(found, mask, args) if packed else None
        key, value = args["key"], args["value"]
        grouped = sdpa.grouped_kv(args)
        if grouped is not None:
            key, value, _ = grouped
        return Match(
            variant=f"{kind}_kernel" + ("_packed" if packed else "_padded" if padded else ""),
            anchor=node,
            nodes=[node],
            bindings=dict(args=args, mask=mask, mask_nodes=found.nodes, kind=kind, key=key, value=value,
                          key_padding=key_padding, segments=segments, shift=found.shift, window=found.window),
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
    kind, shift, window, mask_nodes, key_padding = "none", 0, None, [], None
    if e.mask is not None:
        mk = masks.classify(e.mask)
        if mk.kind not in _EAGER_KINDS:
            raise NearMiss(f"eager attention mask not provable: {mk.detail}")
        if mk.runtime:
            # with sinks a row that sees no key attends to its sink alone under the additive mask
            # too (each fill is far below the sink's logit): out 0, no gradient, as in the kernel;
            # without, it averages every value, which the replacement writes (empty_rows)
            if e.sinks is None:
                _eager_empty_rows_reproducible(e, mk, args)
            key_padding = ak.key_padding_vector(mk, e.mask, args)
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
    grouped = sdpa.grouped_kv(args)
    if grouped is not None:
        key, value, _ = grouped
    if e.softcap and e.sinks is not None:
        raise NearMiss("soft-capped scores and attention sinks together (no conformance case covers both)")
    if e.softcap or e.sinks is not None:
        variant = "eager_sinks_kernel" if e.sinks is not None else "eager_softcap_kernel"
    else:
        variant = "eager_alibi_mask_kernel" if e.mask_bias is not None else (
            "eager_alibi_kernel" if biased else "eager_kernel")
    return Match(
        variant=variant,
        anchor=node,
        nodes=list(e.nodes),
        bindings=dict(args=args, mask=e.mask, mask_nodes=mask_nodes, kind=kind,
                      key=key, value=value, key_padding=key_padding, shift=shift, window=window, eager=e,
                      empty_rows=key_padding is not None and e.sinks is None),
    )


def _eager_empty_rows_reproducible(e: eager.Eager, mk: masks.MaskKind, args: dict) -> None:
    """Eager attention under an additive mask with run-time key padding: a query row that sees no
    key (left padding) gets scores that are all the fill, so it averages every value. The
    replacement writes that average (`_average_empty_rows`) in inference, where the fill absorbs
    the scores and the rows that see no key are known (Lq == Lk); in training that row also
    differentiates a uniform softmax (through the soft-cap too), which the kernel does not."""
    why = None
    if e.mask_fill is None or not math.isfinite(e.mask_fill) or e.mask_fill > eager.ABSORBING_FILL:
        why = f"its fill {e.mask_fill} does not absorb the scores (fp16's), so such a row is not a plain average"
    elif _needs_grad(args):
        why = "in training such a row differentiates a uniform softmax, which the kernel does not"
    elif e.key_bias is not None or e.mask_bias is not None or e.dropout_p:
        why = "with a bias or dropout, not wired"
    elif mk.kind != "none" and not statically_known_true(
            g.tensor(args["query"]).shape[-2] == g.tensor(args["key"]).shape[-2]):
        why = "over a cache (Lq != Lk), where the rows that see no key are not wired"
    if why is not None:
        raise NearMiss(f"eager attention mask with run-time key padding ({mk.detail}): a query row that sees no "
                       f"key averages every value under the additive mask; {why}")


def _alibi_mask_search(node: fx.Node) -> Match | None:
    """SDPA whose float mask is a per-key bias where a proven boolean mask is true and very
    negative elsewhere (Falcon's `masked_fill(alibi / sqrt(d), where(m, 0, min) < -1, min)`, or
    `where(m, 0, min) + bias`) -> fusionpass::flash_attention with key_bias, causal and key
    padding from m. On by default: SDPA has no fast kernel for a float mask (it runs its
    memory-efficient or math kernel and reads the [B, H, Lq, Lk] bias)."""
    args = sdpa.sdpa_arguments(node)
    mask = args["attn_mask"]
    if not isinstance(mask, fx.Node) or args["is_causal"] is not False or not eager._float_node(mask):
        return None
    found = _biased_mask_read_by_sdpa(mask)
    if found is None:
        return None
    q = args["query"]
    why = eager.per_key_problem(found.bias, q, args["key"])
    if why is not None:
        raise NearMiss(f"SDPA mask with a bias: {why}")
    dtypes = {g.dtype(q), g.dtype(mask), found.dtype or g.dtype(found.bias)}
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
        key_padding = ak.key_padding_vector(mk, found.visible, args)
    key, value = args["key"], args["value"]
    grouped = sdpa.grouped_kv(args)
    if grouped is not None:
        key, value, _ = grouped
    return Match(
        variant="alibi_mask_kernel" + ("_padded" if mk.runtime else ""),
        anchor=node,
        nodes=[node],
        bindings=dict(args=args, mask=found.visible, mask_nodes=[*found.nodes, *mk.nodes], kind=mk.kind,
                      key=key, value=value, key_padding=key_padding, shift=mk.shift, window=mk.window,
                      key_bias=found.bias, key_bias_dtype=found.dtype, empty_rows=bool(mk.runtime)),
    )


def _biased_mask_read_by_sdpa(mask: fx.Node) -> eager.BiasedMask | None:
    """eager.biased_mask of SDPA's float mask, also through a cast of the whole mask (autocast's
    `.to(bf16)` of Falcon's fp32 mask in front of SDPA). A cast rounds each element on its own, so
    SDPA reads the bias rounded where the boolean mask is true (the kernel reads the bias cast the
    same way: `dtype`) and the fill rounded elsewhere (fp32's min is -inf in bf16): exact."""
    found = eager.biased_mask(mask)
    src = g.cast_source(mask)
    if found is not None or not isinstance(src, fx.Node):
        return found
    found = eager.biased_mask(src)
    if found is None:
        return None
    dtype = g.dtype(mask)
    fill = torch.tensor(found.fill, dtype=g.dtype(src)).to(dtype).item()
    if fill > eager._MASK_FILL_MAX:
        raise NearMiss(f"SDPA mask with a bias, cast to {dtype}: its fill {found.fill:g} becomes {fill:g}, not "
                       "negative enough to drive exp() to 0")
    return dataclasses.replace(found, nodes=[mask, *found.nodes], fill=fill, dtype=dtype)


def _padding_rows_reproducible(found, mk: masks.MaskKind, args: dict) -> None:
    """With run-time key padding a query row may see no key (left padding). Under the float mask
    its scores are all the fill, so SDPA averages every value; the kernel gives 0. The replacement
    writes that average into those rows (`_average_empty_rows`), which is exact only where the
    fill absorbs the scores (fp32/bf16's min, not fp16's -65504) and the rows that see no key
    are known: causal top-left with Lq == Lk (row i: no kept key <= i) or no causal bound (no
    kept key at all)."""
    if found.fill > eager.ABSORBING_FILL or not math.isfinite(found.fill):
        # an infinite fill (fp32's min cast to bf16) makes such a row's softmax NaN in SDPA
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
    elif b["kind"] == "sliding_window":
        # row i sees keys i - window < j <= i: none kept iff the kept count up to i equals the count
        # up to i - window (Lq == Lk; 0 before the first key)
        seen = call(torch.cumsum, pad, -1)
        seen_before_window = call(operator.getitem, call(torch.nn.functional.pad, seen, (b["window"], 0)),
                                  (Ellipsis, slice(None, -b["window"])))
        empty = call(torch.eq, seen, seen_before_window)
    else:
        empty = call(torch.logical_not, call(torch.any, pad, -1, True))  # [B, 1]
    empty = call(operator.getitem, empty, (slice(None), None, slice(None), None))
    q, v = b["args"]["query"], b["value"]
    hq, hkv = (g.static_int(g.tensor(n).shape[1]) for n in (q, v))

    def per_query_head(x):
        return x if hkv in (1, hq) else call(torch.repeat_interleave, x, hq // hkv, 1)

    average = per_query_head(call(torch.mean, v, -2, True))  # [B, Hq or 1, 1, D]
    return call(torch.where, empty, average, out)


def kernel_head_dim(m: Match, cfg) -> str | None:
    """q/k head dim in the kernel's HEAD_DIMS; v's the same, or smaller (MLA's 128 under 192) with
    attention_mla: the replacement pads v with zeros to q's head dim and drops the padded output
    columns, as transformers' flash-attention path does for MLA."""
    from fusionpass.kernels.attention import HEAD_DIMS

    d = g.static_int(g.tensor(m.bindings["args"]["query"]).shape[-1])
    if d not in HEAD_DIMS:
        return f"head dim {d} not in the kernel's {HEAD_DIMS}"
    dv = g.static_int(g.tensor(m.bindings["value"]).shape[-1])
    if dv is None or dv > d:
        return f"value head dim {dv} above the query's {d}"
    if dv != d and not cfg.attention_mla:
        return f"value head dim {dv} under the query's {d} (MLA): {MLA_OPT_IN}"
    return None


def _band_over_square(b: dict) -> bool:
    """A bidirectional band over square scores: the kernel takes it as a window on the diagonal
    moved by the band's width (`diagonal`)."""
    lq, lk = g.tensor(b["args"]["query"]).shape[-2], g.tensor(b["key"]).shape[-2]
    return b["kind"] == "sliding_window" and masks.is_band(b["shift"], b["window"]) and statically_known_true(lq == lk)


def kernel_constants(m: Match, cfg) -> str | None:
    """dropout_p and scale are constants; the diagonal is top-left or bottom-right aligned, or a
    band's over square scores (the kernel's `diagonal`)."""
    args = m.bindings["args"]
    p = args["dropout_p"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        return f"dropout_p {p!r} is not a constant in [0, 1)"
    scale = args["scale"]
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        return f"scale {scale!r} is not a constant"
    shift = m.bindings["shift"]
    lq, lk = g.tensor(args["query"]).shape[-2], g.tensor(args["key"]).shape[-2]
    if shift != 0 and not statically_known_true(lk - lq == shift) and not _band_over_square(m.bindings):
        return f"diagonal offset {shift} is neither 0 (top-left) nor Lk - Lq (bottom-right)"
    return None


# cuDNN's padding mask takes these head dims on sm_90 (the probe checks each:
# benchmarks/probes/collator_attention_routes.py)
_CUDNN_HEAD_DIMS = (64, 128, 256)


def cudnn_padding_miss(m: Match, cfg) -> str | None:
    """Why fusionpass::padded_attention does not serve the match, or None where it does. It takes a
    causal (top-left) mask with run-time key padding over square scores (an all-true one too where
    attention_cudnn_padding_all_true), nothing else on it (no dropout, window, bias, segments, MLA),
    fp16/bf16, a head dim cuDNN takes, a query length within CUDNN_LENGTH, and cudnn-frontend there
    when the graph is on CUDA."""
    b = m.bindings
    args = b["args"]
    if not cfg.attention_cudnn_padding:
        return "the cuDNN padding route is off (attention_cudnn_padding=False)"
    if b.get("key_padding") is None or b["kind"] not in ("causal", "none"):
        return "not a causal or all-true mask with key padding"
    if b["kind"] == "none" and not cfg.attention_cudnn_padding_all_true:
        return "an all-true mask (attention_cudnn_padding_all_true=False)"
    if b["window"] or b["shift"] != 0 or b.get("eager") is not None or b.get("empty_rows"):
        return "a window, a diagonal offset or eager math"
    if b.get("segments") is not None or b.get("key_bias") is not None or float(args["dropout_p"]) > 0:
        return "segments, a key bias or dropout"
    q, k, v = g.tensor(args["query"]), g.tensor(b["key"]), g.tensor(b["value"])
    if q.dtype not in (torch.float16, torch.bfloat16) or not statically_known_true(q.shape[-2] == k.shape[-2]):
        return "not fp16/bf16 over square scores"
    if g.static_int(q.shape[-1]) not in _CUDNN_HEAD_DIMS or g.static_int(v.shape[-1]) != g.static_int(q.shape[-1]):
        return f"head dims other than {'/'.join(map(str, _CUDNN_HEAD_DIMS))} (equal for q, k and v)"
    length = g.sizes(q.shape[-2])
    why = CUDNN_LENGTH.check_sizes(length, mode(bool(q.requires_grad)), cfg) if length is not None else "no length"
    if why is not None:
        return f"{why} (attention_cudnn_padding_min_length)"
    if q.device.type == "cuda":
        from fusionpass.kernels import cudnn_attention

        if not cudnn_attention.available():
            return "cudnn-frontend is not installed (the `cudnn` extra: pip install fusionpass[cudnn]), which is faster here"
    return None


def cudnn_padding_route(m: Match, cfg) -> bool:
    """Whether fusionpass::padded_attention serves the match instead of our kernel alone."""
    return cudnn_padding_miss(m, cfg) is None


def kernel_of(m: Match, cfg) -> str:
    """Which kernel runs for the match (explain): cuDNN's padding mask with our kernel for the rows
    it cannot take (fusionpass::padded_attention), or our kernel for the route's form."""
    why = cudnn_padding_miss(m, cfg)
    if why is None:
        return ("cuDNN with device sequence lengths for right-padded and all-ones rows, fusionpass flash for "
                "the others (padded_attention)")
    if m.variant in ("causal_kernel_padded", "none_kernel_padded"):
        return f"fusionpass flash ({m.variant}); not cuDNN's padding route: {why}"
    return f"fusionpass flash ({m.variant})"


def replace_with_kernel(graph: fx.Graph, m: Match, cfg) -> None:
    if cudnn_padding_route(m, cfg):
        _replace_with_padded_attention(graph, m)
        return
    b = m.bindings
    node, args = m.anchor, b["args"]
    q = args["query"]
    d = g.static_int(g.tensor(q).shape[-1])
    scale = float(args["scale"]) if args["scale"] is not None else d**-0.5
    p = float(args["dropout_p"])
    seed = dp.insert_seed(graph, node, q) if p > 0 else None
    causal = b["kind"] != "none"
    e = b.get("eager")
    if e is not None and (e.key_bias is not None or e.mask_bias is not None):
        key_bias = eager.insert_key_bias(graph, e, q, node)
    elif b.get("key_bias") is not None:
        key_bias = eager.insert_per_key(graph, b["key_bias"], node)
        if b.get("key_bias_dtype") is not None:
            # the bias rounded as SDPA read it, from a cast of the whole mask (_biased_mask_read_by_sdpa)
            key_bias = g.insert_call(graph, node, torch.Tensor.to, (key_bias, b["key_bias_dtype"]), node)
    else:
        key_bias = None
    # kernel_constants: a shift other than 0 is Lk - Lq (bottom-right), or a band's over square scores
    band = _band_over_square(b)
    b = {**b, "key_padding": ak.key_padding_node(graph, node, b["key_padding"])}
    options = dict(key_padding=b["key_padding"], key_bias=key_bias, scale=scale, causal=causal,
                   window=b["window"] or 0, align_bottom_right=b["shift"] != 0 and not band,
                   diagonal=b["shift"] if band else 0, dropout_p=p, seed=seed, segments=b.get("segments"))
    if e is not None and e.softcap:
        options["softcap"] = e.softcap
    if e is not None and e.sinks is not None:
        options["sinks"] = e.sinks
    value = b["value"]
    dv = g.static_int(g.tensor(value).shape[-1])
    if dv != d:
        # MLA (kernel_head_dim): zero columns of v give zero output columns, dropped below
        value = g.insert_call(graph, node, torch.nn.functional.pad, (value, (0, d - dv)), node)
    call = g.insert_call(graph, node, torch.ops.fusionpass.flash_attention.default, (q, b["key"], value), node,
                         kwargs=options)
    out, _ = g.insert_getitems(graph, call, 2)
    if dv != d:
        out = g.insert_call(graph, node, operator.getitem, (out, (Ellipsis, slice(None, dv))), node)
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
    g.erase_unused(graph, sdpa.repeat_kv_nodes(args))




def _replace_with_padded_attention(graph: fx.Graph, m: Match) -> None:
    b = m.bindings
    node, args = m.anchor, b["args"]
    q = args["query"]
    d = g.static_int(g.tensor(q).shape[-1])
    scale = float(args["scale"]) if args["scale"] is not None else d**-0.5
    key_padding = ak.key_padding_node(graph, node, b["key_padding"])
    call = g.insert_call(graph, node, torch.ops.fusionpass.padded_attention.default,
                         (q, b["key"], b["value"], key_padding), node,
                         kwargs=dict(scale=scale, causal=b["kind"] != "none"))
    out, _ = g.insert_getitems(graph, call, 2)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    g.erase_unused(graph, [n for n in b["mask_nodes"] if n.op != "placeholder"])
    g.erase_unused(graph, sdpa.repeat_kv_nodes(args))


def _only(search, variant: str):
    """`search`'s match where it names `variant`: one declared Variant per form a search tells
    apart (stats() and `fusionpass list` name the same variants)."""

    def only(node: fx.Node) -> Match | None:
        m = search(node)
        return m if m is not None and m.variant == variant else None

    return only


def _causal_padding_on(cfg) -> bool:
    return cfg.attention_kernel or cfg.attention_causal_padding


def _packed_on(cfg) -> bool:
    return cfg.attention_kernel or cfg.attention_packed


def _padding_on(cfg) -> bool:
    return cfg.attention_kernel or cfg.attention_padding


def _sliding_window_on(cfg) -> bool:
    return cfg.attention_kernel or cfg.attention_sliding_window


def _softcap_on(cfg) -> bool:
    return cfg.attention_softcap


def _softcap_off(cfg) -> bool:
    return not _softcap_on(cfg)


def _sinks_on(cfg) -> bool:
    return cfg.attention_sinks


def _sinks_off(cfg) -> bool:
    return not _sinks_on(cfg)


def _sliding_window_off(cfg) -> bool:
    return not _sliding_window_on(cfg)


# the SDPA masks the default settings send to the kernel over square scores only
_SQUARE_BY_DEFAULT = {"causal_kernel_padded": "causal key padding", "causal_kernel_packed": "packed sequences",
                      "none_kernel_padded": "key padding",
                      "sliding_window_kernel": "a sliding window", "sliding_window_kernel_padded": "a sliding window"}


def square_by_default(m: Match, cfg) -> str | None:
    """Without attention_kernel, causal key padding and sliding windows take the kernel over square
    scores only (no cache), the form the GPU conformance suite checks at the default settings."""
    what = _SQUARE_BY_DEFAULT.get(m.variant)
    if cfg.attention_kernel or what is None:
        return None
    args = m.bindings["args"]
    lq, lk = g.tensor(args["query"]).shape[-2], g.tensor(args["key"]).shape[-2]
    if not (m.bindings["shift"] == 0 and statically_known_true(lq == lk)) and not _band_over_square(m.bindings):
        return f"{what} with {lq} queries over {lk} keys (a cache): {KERNEL_OPT_IN}"
    return None


@dataclasses.dataclass(frozen=True)
class Options:
    """flash_attention's routes (settings named attention_*, as before the split)."""

    # Off by default: against SDPA's own kernels it won on some models and lost on others
    # (benchmarks/results/latest/flash_attention.md). Eager-math and ALiBi attention go to the
    # kernel regardless. Where on, it is preferred over sdpa_runtime_check's torch.cond.
    kernel: bool = option(False, "every SDPA route to the kernel: also causal, windowed or all-true masks AND "
                                 "run-time key padding over a cache -> fusionpass::flash_attention")
    # On by default: plain compile runs SDPA with the materialized mask there
    # (benchmarks/results/latest/flash_attention.md).
    causal_padding: bool = option(True, "SDPA with a causal mask AND run-time key padding over square "
                                        "scores (an HF collator's attention_mask) -> fusionpass::flash_attention")
    # On by default: plain compile runs SDPA with the materialized window mask over every key;
    # the kernel skips the blocks outside the window (benchmarks/results/latest/attention_windows.md).
    sliding_window: bool = option(True, "SDPA with a proven sliding-window mask or bidirectional band (with or "
                                        "without run-time key padding) over square scores -> "
                                        "fusionpass::flash_attention")
    # On by default: plain compile runs SDPA with the materialized block-diagonal mask over every
    # key; the kernel skips the key blocks before each query block's sequence.
    packed: bool = option(True, "SDPA with a causal mask AND the sequence segments of packed sequences (position "
                                "ids restarting at each sequence, no attention_mask) -> fusionpass::flash_attention")
    # On by default: plain compile runs SDPA with the materialized [B, 1, L, L] mask over every key;
    # the kernel skips the key blocks past each row's last kept key, so a padded encoder batch
    # costs about what its lengths cost; where an all-ones batch measured slower, the cost rules
    # (padding_cost) keep it out (benchmarks/results/kernel/padded_attention.md).
    padding: bool = option(True, "SDPA with an all-true mask AND run-time key padding over square scores (an "
                                 "encoder's padding collator: BERT, RoBERTa, XLM-R) -> fusionpass::flash_attention")
    # Off by default: v padded to q's head dim costs the kernel more than plain compile's masked
    # SDPA spends (benchmarks/results/latest/attention_head_dims.md).
    mla: bool = option(False, "q/k and v of different head dims (MLA: 192 and 128) on the routes above, v "
                              "padded with zero columns to q's head dim for the kernel")
    # On: against plain compile's S x S scores the kernel measured faster in inference; in training
    # slower, though several times leaner, so there SOFTCAP_TRAINING keeps it out unless
    # softcap_training (benchmarks/results/latest/attention_eager_forms.md).
    softcap: bool = option(True, "eager-math attention whose scaled scores are soft-capped, c * tanh(s / c) "
                                  "(Gemma-2's attn_logit_softcapping) -> fusionpass::flash_attention with softcap")
    softcap_training: bool = option(False, "the soft-capped route in training too, where it is leaner than "
                                           "plain compile but slower")
    # On: faster and leaner than plain compile's S x S scores in training and inference
    # (benchmarks/results/latest/attention_eager_forms.md).
    sinks: bool = option(True, "eager-math attention whose softmax takes a learned logit per head as a last "
                                "column (gpt-oss's attention sinks) -> fusionpass::flash_attention with sinks")
    # On from CUDNN_LENGTH's query length: there it measured faster than our kernel alone and than
    # plain compile's cuDNN-with-bias, per call (benchmarks/results/kernel/collator_attention_routes.md)
    # and on the Trainer step (benchmarks/results/trainer/2026-12-06-h100-f230b911-bf16.md against
    # benchmarks/results/trainer/2026-12-06-h100-f230b911-cudnn-padding-on-bf16.json). Needs the
    # `cudnn` extra (nvidia-cudnn-frontend); without it our kernel serves the match.
    cudnn_padding: bool = option(True, "causal masks with run-time key padding over square scores -> "
                                       "fusionpass::padded_attention: cuDNN's padding mask for rows whose keys "
                                       "are a prefix, our kernel for the others")
    cudnn_padding_min_length: int = option(2048, "the shortest query length the cuDNN padding route takes")
    # Off: on BERT's encoder shape the route lost to plain compile's masked SDPA
    # (benchmarks/results/kernel/collator_attention_routes.md).
    cudnn_padding_all_true: bool = option(False, "the cuDNN padding route for all-true (encoder) masks with "
                                                 "key padding too")


FIELDS = fields(Options)


# The encoder padding route's cost rules (none_kernel_padded at the default settings): it is
# selected where it measured faster than plain compile's masked SDPA on an all-ones batch and on a
# padded one alike, forward and forward + backward; elsewhere the all-ones batch lost
# (benchmarks/results/kernel/padded_attention.md). A compile cannot tell which batches will come.
EVERY_ROUTE = Switch(FIELDS.kernel, "every SDPA route to the kernel")
PADDING_HEAD_DIM = Range.always("head dim of an all-true mask with key padding", 64, 64)
PADDING_DROPOUT = Range.always("attention dropout (%, rounded up) of an all-true mask with key padding", 0, 0)
# The collator's causal route (causal_kernel_padded at the default settings): at head dim 256 our
# kernel lost to plain compile's cuDNN-with-bias on all-ones and right-padded batches alike; at 64
# and 128 it tied on all ones and won on padded batches
# (benchmarks/results/kernel/collator_attention_routes.md). The cuDNN route (attention_cudnn_padding)
# is not bound by it.
CAUSAL_PADDING_HEAD_DIM = Range.always("head dim of a causal mask with key padding", None, 128)
# The cuDNN padding route from the shortest query length where it measured faster (cudnn_padding_miss;
# benchmarks/results/kernel/collator_attention_routes.md)
CUDNN_LENGTH = Range.always("query length of the cuDNN padding route", FIELDS.cudnn_padding_min_length, None)
# Soft-capped eager attention: in training slower than plain compile, though leaner
# (benchmarks/results/latest/attention_eager_forms.md), so inference only unless switched on
SOFTCAPPED = Range("soft-capped eager attention", training=None)
SOFTCAP_TRAINING = Switch(FIELDS.softcap_training, "soft-capped eager attention in training too")


def softcap_cost(m: Match, cfg) -> str | None:
    """SOFTCAPPED, unless SOFTCAP_TRAINING (or attention_kernel)."""
    if m.variant != "eager_softcap_kernel" or SOFTCAP_TRAINING.on(cfg) or EVERY_ROUTE.on(cfg):
        return None
    training = mode(bool(g.tensor(m.bindings["args"]["query"]).requires_grad))
    why = SOFTCAPPED.check(0, training, cfg)
    return None if why is None else f"{SOFTCAPPED.what} {why}; attention_softcap_training=True selects it (leaner, slower)"


def padding_cost(m: Match, cfg) -> str | None:
    """PADDING_HEAD_DIM and PADDING_DROPOUT for the all-true mask with key padding,
    CAUSAL_PADDING_HEAD_DIM for the causal one (q's head dim; MLA's padded v is opted into by
    attention_mla, cuDNN's route by attention_cudnn_padding); unless attention_kernel."""
    if m.variant not in ("none_kernel_padded", "causal_kernel_padded") or EVERY_ROUTE.on(cfg):
        return None
    q = g.tensor(m.bindings["args"]["query"])
    training = mode(bool(q.requires_grad))
    if m.variant == "causal_kernel_padded":
        mla = g.static_int(g.tensor(m.bindings["value"]).shape[-1]) != g.static_int(q.shape[-1])
        if mla or cudnn_padding_route(m, cfg):
            return None
        why = CAUSAL_PADDING_HEAD_DIM.check(g.static_int(q.shape[-1]), training, cfg)
    else:
        # kernel_constants, checked before, made dropout_p a constant
        why = PADDING_HEAD_DIM.check(g.static_int(q.shape[-1]), training, cfg) or PADDING_DROPOUT.check(
            math.ceil(float(m.bindings["args"]["dropout_p"]) * 100), training, cfg)
    return None if why is None else f"{why}; attention_kernel=True / FUSIONPASS_ATTENTION_KERNEL=1 selects it anyway"


KERNEL_OPT_IN = "fusionpass's attention kernel is opt-in (attention_kernel=True / FUSIONPASS_ATTENTION_KERNEL=1)"
MLA_OPT_IN = ("the padded-v kernel route measured slower than plain compile (benchmarks/results/latest/"
              "attention_head_dims.md), opt-in (attention_mla=True)")
SLIDING_WINDOW_OFF = "fusionpass's sliding-window route is off (attention_sliding_window=False)"


def _sliding_window_opt_in(node: fx.Node) -> Match | None:
    """With the sliding-window route off: a proven sliding-window mask, which only this route takes
    (no SDPA call without a mask computes it), is a near miss that names the setting."""
    if not sdpa.is_sdpa(node):
        return None
    args = sdpa.sdpa_arguments(node)
    mask = args["attn_mask"]
    if not isinstance(mask, fx.Node) or args["is_causal"] is not False or g.dtype(mask) != torch.bool:
        return None
    found = masks.classify(mask)
    if found.kind == "sliding_window":
        raise NearMiss(f"{found.detail}: {SLIDING_WINDOW_OFF}")
    return None


SOFTCAP_OFF = "soft-capped attention scores: fusionpass's softcap route is off (attention_softcap=False)"


SINKS_OFF = "attention sinks: fusionpass's sinks route is off (attention_sinks=False)"


def _eager_variant(node: fx.Node) -> str | None:
    """The variant _eager_search gives node, or None (its near misses are its own variants' to report)."""
    try:
        found = _eager_search(node)
    except NearMiss:
        return None
    return None if found is None else found.variant


def _softcap_route_off(node: fx.Node) -> Match | None:
    """With the softcap route off: eager attention with soft-capped scores (and no sinks), a near
    miss that names the setting."""
    if _eager_variant(node) == "eager_softcap_kernel":
        raise NearMiss(SOFTCAP_OFF)
    return None


def _sinks_route_off(node: fx.Node) -> Match | None:
    """With the sinks route off: eager attention with sinks, a near miss that names the setting."""
    if _eager_variant(node) == "eager_sinks_kernel":
        raise NearMiss(SINKS_OFF)
    return None


_UNMATCHED = "softmax(scores) @ values in a form this fusion has no rewrite for"


FLASH_ATTENTION = registry.register(
    Fusion(
        name="flash_attention",
        summary="eager-math attention and ALiBi-biased SDPA masks to our FlashAttention-2 kernel",
        after=("decode_attention", "rope"),
        options=Options,
        settings_prefix="attention",
        matches=(
            "eager-math attention (BLOOM's baddbmm of the ALiBi tensor, MPT's added ALiBi slice and "
            "masked_fill, Falcon's ALiBi in scores and mask, GPT-2's matmul / scale / "
            "additive causal mask / softmax / dropout / matmul) and SDPA whose float mask carries a per-key "
            "(ALiBi) bias over a proven causal/all-true mask (+ key padding), SDPA with a causal mask AND "
            "run-time key padding or the sequence segments of packed sequences, SDPA with an all-true mask AND "
            "run-time key padding, and SDPA with a proven sliding-window mask or bidirectional band (+ key "
            "padding) -> fusionpass::flash_attention"
        ),
        selected_when=(
            "eager-math attention and ALiBi-biased SDPA masks (our kernel instead of S x S tensors); "
            "causal masks with run-time key padding over square scores up to head dim 128 (padding_cost) unless "
            "attention_causal_padding=False; "
            "sliding windows and bands over square scores unless attention_sliding_window=False; "
            "causal masks of packed sequences (sequence segments from position ids) over square scores unless "
            "attention_packed=False; "
            "all-true masks with key padding over square scores unless attention_padding=False; "
            "key padding or windows over a cache only with attention_kernel=True; "
            "v's head dim under q's (MLA) only with attention_mla=True; "
            "fp16/bf16 on CUDA (fp32 is a near miss there, kernel_dtypes)"
        ),
        cost=(EVERY_ROUTE, PADDING_HEAD_DIM, PADDING_DROPOUT, CAUSAL_PADDING_HEAD_DIM, CUDNN_LENGTH, SOFTCAPPED,
              SOFTCAP_TRAINING),
        anchor=lambda node: sdpa.has_mask_node(node) or eager.is_anchor(node),
        variants=(
            Variant("eager_kernel", _only(_eager_search, "eager_kernel")),
            Variant("eager_alibi_kernel", _only(_eager_search, "eager_alibi_kernel")),
            Variant("eager_softcap_kernel", _only(_eager_search, "eager_softcap_kernel"), when=_softcap_on),
            Variant("eager_softcap_route_off", _softcap_route_off, when=_softcap_off, reports_only=True),
            Variant("eager_sinks_kernel", _only(_eager_search, "eager_sinks_kernel"), when=_sinks_on),
            Variant("eager_sinks_route_off", _sinks_route_off, when=_sinks_off, reports_only=True),
            # Falcon's eager form with ALiBi in scores and mask: only its fp32 form reaches this (in
            # bf16/fp16 it upcasts its scores after viewing them, which the search does not
            # follow), and kernel_dtypes keeps fp32 out on CUDA
            Variant("eager_alibi_mask_kernel", _only(_eager_search, "eager_alibi_mask_kernel"), cuda=False),
            *(Variant(v, _only(_alibi_mask_search, v)) for v in ("alibi_mask_kernel", "alibi_mask_kernel_padded")),
            Variant("sliding_window_kernel", _kernel_search("sliding_window", False), when=_sliding_window_on),
            Variant("sliding_window_kernel_padded", _kernel_search("sliding_window", True), when=_sliding_window_on),
            Variant("causal_kernel_padded", _kernel_search("causal", True), when=_causal_padding_on),
            Variant("causal_kernel_packed", _kernel_search("causal", False, packed=True), when=_packed_on),
            Variant("none_kernel_padded", _kernel_search("none", True), when=_padding_on),
            Variant("sliding_window_opt_in", _sliding_window_opt_in, when=_sliding_window_off, reports_only=True),
        ),
        guards=(
            Guard("device", sdpa.query_device),
            Guard("shape", sdpa.mask_covers_the_scores),
            Guard("kernel_dtype", ak.kernel_dtypes),
            Guard("kernel_shape", ak.kernel_shapes),
            Guard("kernel_head_dim", kernel_head_dim),
            Guard("kernel_constants", kernel_constants),
            Guard("square_by_default", square_by_default),
            Guard("cost", padding_cost),
            Guard("cost", softcap_cost),
        ),
        replace=replace_with_kernel,
        kernel=kernel_of,
        # an SDPA call this fusion leaves is sdpa_mask's or sdpa_runtime_check's next
        unmatched=lambda node: _UNMATCHED if eager.is_anchor(node) else None,
    )
)
