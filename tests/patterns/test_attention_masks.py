"""attention: SDPA masks built the way transformers 5.x builds them under torch.compile are proven
causal / all-true (optionally AND key padding from the run-time attention_mask) and rewritten, with
exact counts per variant, and the compiled module computes what the eager one computes, forward
and backward; every other mask is left alone with a near-miss reason.

`sdpa_mask` below is transformers 5.17's `masking_utils.sdpa_mask` as it runs while tracing (its
`_ignore_causal_mask_sdpa` skip is off under torch.compile, so the mask is always materialized):
non-vmap expansion, `and_masks` (`new_ones(()) & fn(...).to(device)`), the key-padding lookup
`padding_mask[batch_idx, kv_idx]`, `.expand(B, -1, Q, KV)`. `test_builder_is_transformers_sdpa_mask`
checks it against the real one.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    ATTENTION,
    attention_key,
    KnownBug,
    known_bug,
    assert_outcomes_close,
    compile_and_count,
    compiling,
    eager,
    fused_graph,
    make_backend,
    near_misses,
    run,
)
from torch import nn
from torch._inductor import config as inductor_config

import fusionpass

B, H, S, D = 2, 4, 8, 16
ALL_TRUE = torch.ops.fusionpass.all_true.default
SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)

@pytest.fixture(autouse=True)
def _run_time_check_on(monkeypatch):
    """The padded-mask rewrite (torch.cond on one all-true check) is opt-in
    (Config.attention_runtime_check); these tests exercise it, so the default kernel routes of
    causal and all-true masks with key padding (attention_causal_padding, attention_padding, which
    flash_attention takes first) are off here.
    test_all_true_padding_is_a_near_miss_without_the_kernel_route checks the check's default. The
    sliding-window route (attention_sliding_window) is off too: its near miss is what these tests
    read (test_attention_kernel_patterns.py checks the route)."""
    monkeypatch.setenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK", "1")
    monkeypatch.setenv("FUSIONPASS_ATTENTION_CAUSAL_PADDING", "0")
    monkeypatch.setenv("FUSIONPASS_ATTENTION_PADDING", "0")
    monkeypatch.setenv("FUSIONPASS_ATTENTION_SLIDING_WINDOW", "0")


def counts(**variants) -> dict:
    return {attention_key(v): n for v, n in variants.items() if n}


# ---------------------------------------------------------------------------------------------
# masks, written as transformers 5.17 writes them (masking_utils)


def and_masks(*fns):
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for fn in fns:
            result = result & fn(batch_idx, head_idx, q_idx, kv_idx).to(result.device)
        return result

    return and_mask


def causal(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def bidirectional(batch_idx, head_idx, q_idx, kv_idx):
    return q_idx >= 0


def sliding_window(window):
    def overlay(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - window

    return and_masks(overlay, causal)


def padding(padding_mask):
    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return padding_mask[batch_idx, kv_idx]

    return inner


def causal_where(batch_idx, head_idx, q_idx, kv_idx):
    """Causal, but through an op the analysis does not know."""
    return torch.where(kv_idx <= q_idx, True, False)


def band(batch_idx, head_idx, q_idx, kv_idx):
    """ModernBERT's local layers (transformers' sliding_window_bidirectional_overlay): |q - kv| <= 2."""
    return abs(q_idx - kv_idx) <= 2


MASK_FUNCTIONS = {
    "causal": causal,
    "bidirectional": bidirectional,
    "sliding_window": sliding_window(3),
    "band": and_masks(band, bidirectional),
    "where": causal_where,
}


def sdpa_mask(batch_size, q_length, kv_length, mask_function, attention_mask=None, q_offset=0,
              kv_offset=0, device="cpu"):
    if attention_mask is not None:
        mask_function = and_masks(mask_function, padding(attention_mask))
    batch_arange = torch.arange(batch_size, device=device)
    head_arange = torch.arange(1, device=device)
    q_arange = torch.arange(q_length, device=device) + q_offset
    kv_arange = torch.arange(kv_length, device=device) + kv_offset
    mask = mask_function(
        batch_arange[:, None, None, None],
        head_arange[None, :, None, None],
        q_arange[None, None, :, None],
        kv_arange[None, None, None, :],
    )
    return mask.expand(batch_size, -1, q_length, kv_length)


class Attention(nn.Module):
    """`layers` SDPA calls sharing one mask (the output of one is the next one's query), the way
    HF models build the mask once per forward. `attention_mask` is the 2-D [B, KV] int mask of
    the tokenizer; like `_preprocess_mask_arguments` the module turns it to bool first."""

    def __init__(self, mask="causal", layers=1, dropout=0.0, scale=None, q_offset=0,
                 positional=False, builder=None, repeat_kv=None):
        super().__init__()
        self.mask, self.layers, self.dropout, self.scale = mask, layers, dropout, scale
        self.q_offset, self.positional, self.builder = q_offset, positional, builder
        self.repeat_kv = repeat_kv  # grouped K/V copied up to the query heads: "hf" or "interleave"

    def build(self, q, k, attention_mask):
        padding_mask = None
        if attention_mask is not None:
            padding_mask = attention_mask.to(device=q.device, dtype=torch.bool)
        if self.builder is not None:
            return self.builder(q, k, padding_mask)
        return sdpa_mask(
            q.shape[0], q.shape[-2], k.shape[-2], MASK_FUNCTIONS[self.mask], padding_mask,
            q_offset=self.q_offset, device=q.device,
        )

    def forward(self, q, k, v, attention_mask=None):
        mask = self.build(q, k, attention_mask)
        dropout = self.dropout if self.training else 0.0
        if self.repeat_kv is not None:
            k, v = (REPEAT_KV[self.repeat_kv](t, q.shape[1] // t.shape[1]) for t in (k, v))
        out = q
        for _ in range(self.layers):
            if self.positional:
                out = F.scaled_dot_product_attention(out, k, v, mask, dropout, False, scale=self.scale)
            else:
                out = F.scaled_dot_product_attention(
                    out, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scale, is_causal=False
                )
        return out


def hf_repeat_kv(hidden_states, n_rep):
    """transformers 5.17's `repeat_kv` (models/llama/modeling_llama.py)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


REPEAT_KV = {
    "hf": hf_repeat_kv,
    "interleave": lambda t, n: torch.repeat_interleave(t, n, dim=1),
}


def qkv(batch=B, q_len=S, kv_len=S, kv_heads=H):
    return (
        torch.randn(batch, H, q_len, D),
        torch.randn(batch, kv_heads, kv_len, D),
        torch.randn(batch, kv_heads, kv_len, D),
    )


def attention_mask(kind, batch=B, length=S):
    """The tokenizer's [B, S] int mask: all ones, or rows of different lengths padded on the
    right or on the left (one row unpadded)."""
    am = torch.ones(batch, length, dtype=torch.long)
    if kind == "right":
        am[0, length - 3:] = 0
    elif kind == "left":
        am[0, :3] = 0
    else:
        assert kind == "ones"
    return am


def inputs_for(padding_kind, **shape):
    q, k, v = qkv(**shape)
    if padding_kind is None:
        return (q, k, v)
    return (q, k, v, attention_mask(padding_kind, batch=q.shape[0], length=k.shape[-2]))


def check(module, inputs, expected, train=False):
    """Compile with the attention fusions only (tests.helpers.ATTENTION), assert the counts and near-miss reasons, and
    compare outputs (and, in training, the gradients of q, k and v) with eager."""
    module.train(train)
    got, stats = compile_and_count(module, *inputs, fusions=ATTENTION, train=train)
    assert near_misses() == []
    assert stats == expected
    want = eager(module, *inputs, train=train)
    if train:
        assert sorted(got.grads) == ["input0", "input1", "input2"]
    assert_outcomes_close(got, want)
    return got


def assert_miss(module, inputs, reason, n=1, train=False, **config):
    """The pass leaves the graph alone (fused_graph: pass only, no Inductor) with `reason`, and
    the graph still computes what eager computes."""
    module.train(train)
    gm, out, record = fused_graph(module, *inputs, fusions=ATTENTION, **config)
    assert record.matches == {}
    assert [m[2] for m in record.near_misses] == [reason] * n, record.near_misses
    if not train:  # (dropout in training draws other numbers)
        torch.testing.assert_close(out, module(*inputs), rtol=1e-5, atol=1e-5)
    return gm


def nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target is target or n.target == target]


# ---------------------------------------------------------------------------------------------
# the builder is transformers' own


@pytest.mark.parametrize("fn", ["causal", "bidirectional", "sliding_window"])
@pytest.mark.parametrize("padding_kind", [None, "right", "left"])
def test_builder_is_transformers_sdpa_mask(fn, padding_kind):
    mu = pytest.importorskip("transformers.masking_utils")
    real = {
        "causal": mu.causal_mask_function,
        "bidirectional": mu.bidirectional_mask_function,
        "sliding_window": mu.sliding_window_causal_mask_function(3),
    }[fn]
    pm = None if padding_kind is None else attention_mask(padding_kind).bool()
    want = mu.sdpa_mask(B, S, S, mask_function=real, attention_mask=pm, allow_is_causal_skip=False)
    got = sdpa_mask(B, S, S, MASK_FUNCTIONS[fn], pm)
    assert torch.equal(got, want)


def test_transformers_sdpa_mask_itself():
    """The real transformers function, traced: causal AND key padding, one layer."""
    mu = pytest.importorskip("transformers.masking_utils")

    def builder(q, k, pm):
        return mu.sdpa_mask(
            q.shape[0], q.shape[-2], k.shape[-2], attention_mask=pm, allow_is_causal_skip=False
        )

    _, _, record = fused_graph(Attention(builder=builder), *inputs_for("right"), fusions=ATTENTION)
    assert record.matches == counts(causal_mask_if_unpadded=1)
    assert record.near_misses == []


# ---------------------------------------------------------------------------------------------
# proven masks: rewritten, and exact


PROVEN = [
    # (mask function, attention_mask, variant)
    ("causal", None, "causal_mask"),
    ("causal", "ones", "causal_mask_if_unpadded"),
    ("causal", "right", "causal_mask_if_unpadded"),  # the masked branch runs
    ("causal", "left", "causal_mask_if_unpadded"),  # (with fully masked query rows)
    ("bidirectional", None, "none_mask"),
    ("bidirectional", "ones", "none_mask_if_unpadded"),
    ("bidirectional", "right", "none_mask_if_unpadded"),
    ("bidirectional", "left", "none_mask_if_unpadded"),
]


@pytest.mark.parametrize(
    "fn,padding_kind,variant", PROVEN, ids=[f"{f}-{p or 'no_mask'}" for f, p, _ in PROVEN]
)
def test_proven_mask_inference(fn, padding_kind, variant):
    check(Attention(fn), inputs_for(padding_kind), counts(**{variant: 1}))


TRAINED = [PROVEN[i] for i in (0, 1, 2, 4, 7)]


@pytest.mark.parametrize(
    "fn,padding_kind,variant", TRAINED, ids=[f"{f}-{p or 'no_mask'}" for f, p, _ in TRAINED]
)
def test_proven_mask_training(fn, padding_kind, variant):
    check(Attention(fn), inputs_for(padding_kind), counts(**{variant: 1}), train=True)


def test_scale_and_positional_mask_are_kept():
    """SDPA called positionally (mask, dropout_p, is_causal) with a scale: the rewrite keeps the
    scale (outputs equal eager) for both the plain and the branched form."""
    check(Attention("causal", scale=0.3, positional=True), inputs_for(None), counts(causal_mask=1))
    check(
        Attention("bidirectional", scale=0.3, positional=True),
        inputs_for("right"),
        counts(none_mask_if_unpadded=1),
    )


def test_dynamic_causal():
    """dynamic=True: the index lengths and the q/k lengths are the same symbol, so the shape
    guard still proves them equal; one graph serves other sequence lengths."""
    module = Attention("causal").eval()
    with compiling():
        compiled = torch.compile(module, backend=make_backend(ATTENTION), dynamic=True, fullgraph=True)
        for seq in (8, 13, 5):
            inputs = inputs_for(None, q_len=seq, kv_len=seq)
            assert_outcomes_close(run(compiled, module, inputs), eager(module, *inputs))
        assert near_misses() == [], near_misses()
        assert fusionpass.stats(variants=True) == counts(causal_mask=1)  # no recompile


def test_dynamic_causal_with_padding():
    module = Attention("causal").eval()
    with compiling():
        compiled = torch.compile(module, backend=make_backend(ATTENTION), dynamic=True, fullgraph=True)
        for seq, kind in ((8, "ones"), (11, "right"), (6, "ones")):
            inputs = inputs_for(kind, q_len=seq, kv_len=seq)
            assert_outcomes_close(run(compiled, module, inputs), eager(module, *inputs))
        assert near_misses() == [], near_misses()
        assert fusionpass.stats(variants=True) == counts(causal_mask_if_unpadded=1)


# ---------------------------------------------------------------------------------------------
# grouped K/V: the repeat_kv copy goes with the mask


@pytest.mark.parametrize("form", sorted(REPEAT_KV))
def test_repeat_kv_becomes_enable_gqa(form):
    """Without padding the fast call reads the grouped K/V placeholders with enable_gqa=True and
    every node of the copy is gone; outputs and the K/V gradients (summed over each group) equal
    eager's."""
    module = Attention("causal", layers=2, repeat_kv=form)
    inputs = inputs_for(None, kv_heads=2)
    gm, _, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == counts(causal_mask=2)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sdpas = [n for n in gm.graph.nodes if n.target in SDPA_TARGETS]
    assert len(sdpas) == 2
    for n in sdpas:
        assert n.kwargs.get("enable_gqa") is True
        assert n.args[1] in placeholders and n.args[2] in placeholders
    leftover = {"expand", "reshape", "repeat_interleave", torch.repeat_interleave}
    assert not [n for n in gm.graph.nodes if n.target in leftover]
    check(module, inputs, counts(causal_mask=2), train=True)


@pytest.mark.parametrize("padding_kind", ["ones", "right"])
def test_repeat_kv_kept_under_the_run_time_check(padding_kind):
    """With the run-time check both branches read the repeated K/V (one operand list for both);
    outputs and gradients agree with eager on either branch."""
    module = Attention("causal", repeat_kv="hf")
    inputs = inputs_for(padding_kind, kv_heads=2)
    check(module, inputs, counts(causal_mask_if_unpadded=1), train=True)
    gm, _, _ = fused_graph(module, *inputs, fusions=ATTENTION)
    assert nodes(gm, "expand") and nodes(gm, "reshape")


def test_repeat_of_other_heads_is_kept():
    """K repeated but V already at the query head count: no GQA call (enable_gqa needs both);
    the rewrite still drops the mask and computes what eager computes."""

    class HalfRepeated(Attention):
        def forward(self, q, k, v):
            mask = self.build(q, k, None)
            k = hf_repeat_kv(k, 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, _ = qkv(kv_heads=2)
    v = torch.randn(B, H, S, D)
    gm, _, record = fused_graph(HalfRepeated("causal"), q, k, v, fusions=ATTENTION)
    assert record.matches == counts(causal_mask=1)
    (sdpa,) = [n for n in gm.graph.nodes if n.target in SDPA_TARGETS]
    assert "enable_gqa" not in sdpa.kwargs
    check(HalfRepeated("causal"), (q, k, v), counts(causal_mask=1))


# ---------------------------------------------------------------------------------------------
# the graph after the rewrite


def test_mask_nodes_are_gone_without_padding():
    """Two layers share one causal mask: both become is_causal=True SDPA without a mask, and the
    nodes that built the mask (aranges placed on the axes, comparison, AND, expand) are erased
    once the last layer is rewritten. (Dynamo leaves the unused batch and head aranges in its
    graph already, without users.)"""
    gm, _, record = fused_graph(Attention("causal", layers=2), *inputs_for(None), fusions=ATTENTION)
    assert record.matches == counts(causal_mask=2)
    sdpas = [n for n in gm.graph.nodes if n.target in SDPA_TARGETS]
    assert len(sdpas) == 2
    for n in sdpas:
        assert n.kwargs.get("is_causal") is True and n.kwargs.get("attn_mask") is None
        assert len(n.args) == 3
    rest = [
        n for n in gm.graph.nodes
        if n.op in ("call_function", "call_method") and n.target not in SDPA_TARGETS
    ]
    assert all(not n.users for n in rest), [n.format_node() for n in rest]
    assert all(n.target is torch.arange for n in rest), [n.format_node() for n in rest]
    assert nodes(gm, operator.le) == [] and nodes(gm, "expand") == [] and nodes(gm, "new_ones") == []


def test_all_true_once_for_layers_sharing_a_mask():
    """Two layers share one padded mask: one fusionpass::all_true (the host sync) for both, two
    torch.cond, each reading that flag; the mask itself stays for the masked branches."""
    module = Attention("causal", layers=2)
    inputs = inputs_for("ones")
    gm, out, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == counts(causal_mask_if_unpadded=2)
    (flag,) = nodes(gm, ALL_TRUE)
    conds = nodes(gm, torch.ops.higher_order.cond)
    assert len(conds) == 2 and all(c.args[0] is flag for c in conds)
    assert [n for n in gm.graph.nodes if n.target in SDPA_TARGETS] == []
    assert len(nodes(gm, "expand")) == 1
    torch.testing.assert_close(out, module(*inputs), rtol=1e-5, atol=1e-5)
    # the same graph with padding: the masked branches run
    padded = inputs_for("right")
    _, out, record = fused_graph(module, *padded, fusions=ATTENTION)
    assert record.matches == counts(causal_mask_if_unpadded=2)
    torch.testing.assert_close(out, module(*padded), rtol=1e-5, atol=1e-5)


def test_two_layers_compiled_training():
    check(
        Attention("causal", layers=2), inputs_for("left"), counts(causal_mask_if_unpadded=2),
        train=True,
    )


# ---------------------------------------------------------------------------------------------
# near misses


WINDOW_OFF = "fusionpass's sliding-window route is off (attention_sliding_window=False)"
WINDOW = "sliding-window mask: " + WINDOW_OFF


def test_sliding_window():
    assert_miss(Attention("sliding_window", layers=2), inputs_for(None), WINDOW, n=2)


def test_sliding_window_with_padding():
    assert_miss(
        Attention("sliding_window"),
        inputs_for("right"),
        "sliding-window mask with key padding from a run-time tensor: " + WINDOW_OFF,
    )


def test_bidirectional_band():
    # ModernBERT's |q - kv| <= 2, proven; a near miss here only because the fixture turns the
    # sliding-window route off (test_attention_kernel_patterns.py takes it to the kernel)
    assert_miss(Attention("band"), inputs_for(None), "bidirectional band mask (|q - kv| <= 2): " + WINDOW_OFF)


def test_causal_with_query_offset():
    """Queries are the last 4 of 8 positions (q_idx = arange(4) + 4, kv_idx = arange(8)):
    bottom-right causal, which SDPA's top-left is_causal is not."""
    assert_miss(
        Attention("causal", q_offset=4),
        inputs_for(None, q_len=4, kv_len=8),
        "causal mask with diagonal offset 4: query and key positions are offset (bottom-right "
        "causal) while SDPA's is_causal is top-left; fusionpass's attention kernel aligns "
        "bottom-right, but this route is not wired yet",
    )


def test_causal_with_fewer_queries_than_keys():
    """kv <= q with 4 queries and 8 keys (no offset): causal by its constraints, but is_causal
    on a 4x8 score matrix is not the same mask size; the shape guard refuses."""
    assert_miss(
        Attention("causal"),
        inputs_for(None, q_len=4, kv_len=8),
        "shape: query length 4 != key length 8: SDPA's is_causal would align top-left",
    )


def test_additive_float_mask():
    def builder(q, k, pm):
        allowed = sdpa_mask(q.shape[0], q.shape[-2], k.shape[-2], causal, pm)
        return torch.where(allowed, 0.0, torch.finfo(q.dtype).min)

    assert_miss(
        Attention(builder=builder),
        inputs_for(None),
        "attention mask of dtype torch.float32 (an additive bias)",
    )


def test_unknown_op():
    assert_miss(Attention("where"), inputs_for(None), "mask not provable: mask built with `where`")


def test_index_vector_shorter_than_queries():
    """The query index vector has length 1 (a [B, 1, 1, KV] mask broadcast over 8 queries):
    kv <= 0 is not a causal mask of the scores; the shape guard compares the index lengths."""

    def builder(q, k, pm):
        return sdpa_mask(q.shape[0], 1, k.shape[-2], causal, pm)

    assert_miss(
        Attention(builder=builder),
        inputs_for(None),
        "shape: mask index length 1 differs from the attention length 8",
    )


def test_sliced_mask():
    """A mask built for longer sequences and sliced to the scores: not a rewrite we prove; it
    stays a near miss, and never fails the compile."""

    def builder(q, k, pm):
        mask = sdpa_mask(q.shape[0], q.shape[-2] + 2, k.shape[-2] + 2, causal)
        return mask[:, :, : q.shape[-2], : k.shape[-2]]

    module = Attention(builder=builder)
    inputs = inputs_for(None)
    _, out, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == {}
    assert len(record.near_misses) == 1
    assert record.near_misses[0][2].startswith("mask not provable: ")
    torch.testing.assert_close(out, module(*inputs))


@pytest.mark.parametrize("spelling", ["2d_none_none", "3d_colon_none"])
def test_mask_unsqueezed_by_indexing(spelling):
    """A causal mask built on [Q, KV] (or [1, Q, KV]) and given its batch/head axes by indexing
    with None: causal_mask (or at least a near miss), never a failed compile."""

    def builder(q, k, pm):
        sq, skv = q.shape[-2], k.shape[-2]
        if spelling == "2d_none_none":
            return (torch.arange(skv)[None, :] <= torch.arange(sq)[:, None])[None, None, :, :]
        return (torch.arange(skv)[None, None, :] <= torch.arange(sq)[None, :, None])[:, None]

    module = Attention(builder=builder)
    inputs = inputs_for(None)
    _, out, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == counts(causal_mask=1)
    torch.testing.assert_close(out, module(*inputs), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# dropout and CUDA graphs: the run-time branch is not allowed


def test_dropout_with_padding_in_training():
    """torch.cond's backward would re-run the branch and draw another dropout mask."""
    assert_miss(
        Attention("causal", dropout=0.1),
        inputs_for("ones"),
        "run_time_check: attention dropout 0.1 inside a run-time branch: its backward would "
        "re-draw the mask",
        train=True,
    )


def test_dropout_with_padding_in_eval():
    """In eval the module passes dropout_p=0.0: the branch is allowed."""
    check(Attention("causal", dropout=0.1), inputs_for("right"), counts(causal_mask_if_unpadded=1))


def test_dropout_without_padding_is_rewritten():
    """No run-time branch, so dropout is fine: is_causal=True SDPA with the same dropout_p."""
    module = Attention("causal", dropout=0.5).train()
    inputs = inputs_for(None)
    gm, _, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == counts(causal_mask=1)
    (sdpa,) = [n for n in gm.graph.nodes if n.target in SDPA_TARGETS]
    assert sdpa.kwargs["dropout_p"] == 0.5 and sdpa.kwargs["is_causal"] is True
    got, stats = compile_and_count(module, *inputs, fusions=ATTENTION, train=True)
    assert stats == counts(causal_mask=1)
    assert near_misses() == []
    # (dropout draws differ from eager's; what can be checked: finite, and the loss flows)
    assert all(torch.isfinite(t).all() for t in got.outputs)
    assert sorted(got.grads) == ["input0", "input1", "input2"]
    assert all(torch.isfinite(g).all() for g in got.grads.values())


def test_cuda_graphs_forbid_the_check():
    msg = (
        "run_time_check: the all-true check of attention_mask is a host sync, not allowed under "
        "CUDA graphs"
    )
    with inductor_config.patch({"triton.cudagraphs": True}):
        assert_miss(Attention("causal", layers=2), inputs_for("ones"), msg, n=2)
        # no run-time check needed: still rewritten
        _, _, record = fused_graph(Attention("causal"), *inputs_for(None), fusions=ATTENTION)
        assert record.matches == counts(causal_mask=1)


# ---------------------------------------------------------------------------------------------
# query, key and value that alias each other (one tensor, or views of one projection)


@pytest.mark.xfail(
    strict=True,
    raises=KnownBug,
    reason="BUG: patterns/attention.py replace() passes (query, key, value, mask) to "
    "torch.ops.higher_order.cond as they are; when they alias each other (the same tensor, or "
    "GPT-2's c_attn(...).split() views) the compile fails: 'cond_true might be aliasing the input "
    "or the output!'",
)
@pytest.mark.parametrize("how", ["same_tensor", "split_views"])
def test_aliasing_qkv_with_padding(how):
    class SelfAttention(nn.Module):
        def forward(self, x, am):
            b, s, _ = x.shape
            if how == "same_tensor":
                q = k = v = x.view(b, s, H, D).transpose(1, 2)
            else:
                q, k, v = (t.view(b, s, H, D).transpose(1, 2) for t in x.split(H * D, dim=2))
            mask = sdpa_mask(b, s, s, causal, am.bool())
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    width = H * D if how == "same_tensor" else 3 * H * D
    module = SelfAttention()
    inputs = (torch.randn(B, S, width), attention_mask("right"))
    with known_bug(torch._dynamo.exc.BackendCompilerFailed, "might be aliasing the input"):
        got, stats = compile_and_count(module, *inputs, fusions=ATTENTION)
    assert stats == counts(causal_mask_if_unpadded=1)
    assert_outcomes_close(got, eager(module, *inputs))


# ---------------------------------------------------------------------------------------------
# Inductor and the branch's operand strides


@pytest.mark.xfail(
    strict=True,
    raises=KnownBug,
    reason="BUG (Inductor's torch.cond lowering, inherited by the rewrite): in inference, a "
    "query computed by Inductor from a transposed view through cat (RoPE's rotate_half) reaches "
    "the compiled branch with other strides than it was compiled for: 'expected size 4==4, "
    "stride 128==16 at dim=1' at run time. Plain torch.cond fails the same way; every "
    "Llama-family HF model with an attention_mask fails so in inference",
)
def test_rotary_query_with_padding_inference():
    class Rotary(nn.Module):
        def forward(self, x, am):
            b, s, _, d = x.shape
            q = x.transpose(1, 2)
            q = q * 0.5 + torch.cat((-q[..., d // 2:], q[..., : d // 2]), dim=-1) * 0.3
            mask = sdpa_mask(b, s, s, causal, am.bool())
            return F.scaled_dot_product_attention(q, q * 2, q + 1, attn_mask=mask)

    module = Rotary()
    inputs = (torch.randn(B, S, H, D), attention_mask("ones"))
    with known_bug(AssertionError, "expected size 4==4, stride 128==16 at dim=1"):
        got, stats = compile_and_count(module, *inputs, fusions=ATTENTION)
    assert stats == counts(causal_mask_if_unpadded=1)
    assert_outcomes_close(got, eager(module, *inputs))


def test_all_true_padding_is_a_near_miss_without_the_kernel_route(monkeypatch):
    # (all-true or causal masks AND key padding go to flash_attention's kernel by default,
    # attention_padding and attention_causal_padding: tests/patterns/test_attention_kernel_patterns.py,
    # at the kernel's head dims; off here)
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK")
    module = Attention("bidirectional").eval()
    inputs = inputs_for("ones")
    _, out, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == {}
    ((fusion, _, reason),) = record.near_misses
    assert fusion == "sdpa_runtime_check" and reason.startswith("run_time_check: key padding from a run-time")
    assert "off by default" in reason
    torch.testing.assert_close(out, module(*inputs))


def test_causal_from_position_id_lookups():
    """transformers >= 5.2x compares position ids looked up at the query and key indices
    (`pos[b, kv] <= pos[b, q]`) instead of the raw indices; with arange positions that is causal."""

    def builder(q, k, pm):
        b, sq = q.shape[0], q.shape[-2]
        pos = (torch.arange(sq) + 0).unsqueeze(0).expand(b, -1)
        batch = torch.arange(b)[:, None, None, None]
        q_idx = torch.arange(sq)[None, None, :, None]
        kv_idx = torch.arange(sq)[None, None, None, :]
        return (pos[batch, kv_idx] <= pos[batch, q_idx]).expand(b, -1, sq, sq)

    module = Attention(builder=builder)
    inputs = inputs_for(None)
    _, out, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == counts(causal_mask=1)
    torch.testing.assert_close(out, module(*inputs), rtol=1e-5, atol=1e-5)


class PackedSequences(nn.Module):
    """transformers 5.24's causal mask for packed sequences (position ids restarting at each
    sequence start): positions looked up at the query and key indices and compared, AND-ed with
    the packed-sequence ids (`remap_positions_for_packed_sequence`, `packed_sequence_mask_function`).
    Block-diagonal, not causal: no query attends to an earlier sequence."""

    def __init__(self, positions=None):
        super().__init__()
        self.positions = positions  # builds the position ids in the graph; None: a run-time input

    def forward(self, q, k, v, position_ids=None):
        b, sq = q.shape[0], q.shape[-2]
        if self.positions is not None:
            position_ids = self.positions(sq).unsqueeze(0)
        pos = position_ids.expand(b, -1)
        seq_ids = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        batch = torch.arange(b)[:, None, None, None]
        q_idx = torch.arange(sq)[None, None, :, None]
        kv_idx = torch.arange(sq)[None, None, None, :]
        causal_in_sequence = pos[batch, kv_idx] <= pos[batch, q_idx]
        same_sequence = seq_ids[batch, q_idx] == seq_ids[batch, kv_idx]
        mask = (causal_in_sequence & same_sequence).expand(b, -1, sq, sq)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)


def _packed_mask_kind(gm):
    from fusionpass.patterns import masks

    (sdpa,) = nodes(gm, F.scaled_dot_product_attention)
    return masks.classify(sdpa.kwargs["attn_mask"])


def test_packed_sequences_from_run_time_positions_are_not_causal():
    """Position ids restarting at 0 (two sequences packed in one row), given at run time: the
    mask is proven causal only within the sequence segments of those ids (a run-time term), never
    plain causal (is_causal=True would let the second sequence see the first). At this head dim the
    kernel route does not take it (its near miss); sdpa_mask leaves it."""
    from fusionpass.patterns import masks

    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    gm = assert_miss(PackedSequences(), (*qkv(), position_ids),
                     f"kernel_head_dim: head dim {D} not in the kernel's (64, 80, 96, 128, 192, 256)")
    found = _packed_mask_kind(gm)
    assert found.kind == "causal" and [r.what for r in found.runtime] == [masks.SEGMENTS]


@pytest.mark.parametrize("positions", [
    lambda s: torch.cat([torch.arange(3), torch.arange(s - 3)]),
    lambda s: torch.arange(s) % 4,
], ids=["cat", "remainder"])
def test_packed_sequences_from_graph_positions_are_not_causal(positions):
    """Restarting position ids built in the graph: the analysis knows no op that restarts an
    index vector (`cat`, `%`), so the positions are as unknown as a run-time tensor's, and the
    mask is causal within their sequence segments only."""
    from fusionpass.patterns import masks

    gm = assert_miss(PackedSequences(positions), qkv(),
                     f"kernel_head_dim: head dim {D} not in the kernel's (64, 80, 96, 128, 192, 256)")
    assert nodes(gm, F.scaled_dot_product_attention)[0].kwargs.get("attn_mask") is not None
    found = _packed_mask_kind(gm)
    assert found.kind == "causal" and [r.what for r in found.runtime] == [masks.SEGMENTS]


def test_packed_sequences_to_the_kernel():
    """transformers 5.24's packed form at a head dim the kernel takes: flash_attention with the
    sequence segments, equal to the masked SDPA it replaces."""
    position_ids = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3]])
    module = PackedSequences()
    inputs = (torch.randn(B, H, S, 64), torch.randn(B, H, S, 64), torch.randn(B, H, S, 64), position_ids)
    _, out, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == {("flash_attention", "causal_kernel_packed"): 1}
    torch.testing.assert_close(out, module(*inputs), rtol=1e-5, atol=1e-5)


class PositionsWithoutSegments(nn.Module):
    """Position ids compared at the query and key indices with no segment term: not provable (the
    ids need not step by 1)."""

    def forward(self, q, k, v, position_ids):
        b, sq = q.shape[0], q.shape[-2]
        pos = position_ids.expand(b, -1)
        batch = torch.arange(b)[:, None, None, None]
        mask = pos[batch, torch.arange(sq)[None, None, None, :]] <= pos[batch, torch.arange(sq)[None, None, :, None]]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(b, -1, sq, sq), is_causal=False)


def test_positions_without_their_segments_are_not_provable():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    assert_miss(PositionsWithoutSegments(), (*qkv(), position_ids),
                "mask not provable: position ids compared at the query and key indices without the sequence "
                "segments of the same ids", n=1)


def test_unpacked_positions_in_the_packed_form_are_causal():
    """The same 5.24 form with position ids that are a plain arange (one sequence per row, what
    the model makes without position_ids): proven causal, the packed-sequence ids constant."""
    module = PackedSequences(lambda s: torch.arange(s) + 0)
    inputs = qkv()
    _, out, record = fused_graph(module, *inputs, fusions=ATTENTION)
    assert record.matches == counts(causal_mask=1)
    torch.testing.assert_close(out, module(*inputs), rtol=1e-5, atol=1e-5)
