"""attention on tiny Hugging Face models (built from configs, random weights, sdpa attention).

Under torch.compile transformers 5.x hands every SDPA call a materialized boolean mask with
`is_causal=False`. Per layer the fusion rewrites it to `is_causal=True` (decoders), no mask
(BERT), or, with an attention_mask passed, a branch on one all-true check per forward; sliding
windows (Mistral with `sliding_window`, Gemma-2's local layers) are near misses with the
sliding-window route off (test_sliding_window_by_default: the kernel's, by default). Each model is
compiled with only the attention fusions (tests.helpers.ATTENTION) and with plain torch.compile; logits, and in training the
loss and every parameter gradient, agree within fp32 tolerance, with padding too (the masked
branch runs then).

Models: 2 layers, hidden 64, 4 heads of 16 (2 KV heads), vocabulary 128, batch 2, sequence 8.
"""
from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import (
    ATTENTION,
    KnownBug,
    already_fast,
    assert_outcomes_close,
    attention_key,
    compile_and_count,
    compiling,
    eager,
    fused_graph,
    known_bug,
    make_backend,
    near_misses,
    plain_compiled,
    run,
)

import fusionpass

LAYERS = 2
BATCH, SEQ, VOCAB = 2, 8, 128
WINDOW = 4  # < SEQ: the window really cuts
RTOL_FP32 = 1e-4


@pytest.fixture(autouse=True)
def _run_time_check_on(monkeypatch):
    """The padded-mask rewrite (torch.cond on one all-true check) is opt-in
    (Config.attention_runtime_check); these tests exercise it, with the default kernel routes of
    causal and all-true masks with key padding off (at these head dims of 16 the kernel would
    refuse them anyway, with a near miss). test_padding_by_default checks the defaults. So is the
    sliding-window route's, whose near miss these tests read (test_sliding_window_by_default
    checks the default)."""
    monkeypatch.setenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK", "1")
    monkeypatch.setenv("FUSIONPASS_ATTENTION_CAUSAL_PADDING", "0")
    monkeypatch.setenv("FUSIONPASS_ATTENTION_PADDING", "0")
    monkeypatch.setenv("FUSIONPASS_ATTENTION_SLIDING_WINDOW", "0")


WINDOW_OFF = "fusionpass's sliding-window route is off (attention_sliding_window=False)"
SLIDING = "sliding-window mask: " + WINDOW_OFF
SLIDING_PADDED = "sliding-window mask with key padding from a run-time tensor: " + WINDOW_OFF


DECODER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "pad_token_id": 0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "attention_dropout": 0.0,
}
ENCODER = {"hidden_size": 64, "num_attention_heads": 4}


def skip_without_sdpa(family: str) -> None:
    """transformers 5.2x refuses SDPA for Gemma-2 (`_supports_sdpa = False`: SDPA has no attention
    logit softcapping); 5.17 runs it through SDPA, without the softcap."""
    if family == "gemma2" and not transformers.Gemma2PreTrainedModel._supports_sdpa:
        pytest.skip(f"transformers {transformers.__version__} has no SDPA attention for Gemma-2 (softcapping)")


def build(family: str):
    """A tiny model of `family`, in fp32, with sdpa attention and every dropout probability 0."""
    skip_without_sdpa(family)
    t = transformers
    if family == "llama":
        config, cls = t.LlamaConfig(**DECODER), t.LlamaForCausalLM
    elif family == "mistral":
        config, cls = t.MistralConfig(**DECODER, sliding_window=WINDOW), t.MistralForCausalLM
    elif family == "mistral_no_window":
        config, cls = t.MistralConfig(**DECODER, sliding_window=None), t.MistralForCausalLM
    elif family == "qwen2":
        config, cls = t.Qwen2Config(**DECODER), t.Qwen2ForCausalLM
    elif family == "gemma2":
        config, cls = t.Gemma2Config(**DECODER, sliding_window=WINDOW), t.Gemma2ForCausalLM
    elif family == "gemma3":  # a local layer, then a global one (Gemma-3 has five local per global)
        config = t.Gemma3TextConfig(**DECODER, sliding_window=WINDOW,
                                    layer_types=["sliding_attention", "full_attention"])
        cls = t.Gemma3ForCausalLM
    elif family == "modernbert":  # a global layer, then a local one (a band |i - j| <= 2 < SEQ)
        config = t.ModernBertConfig(
            hidden_size=DECODER["num_attention_heads"] * DECODER["head_dim"], intermediate_size=128,
            num_hidden_layers=LAYERS, num_attention_heads=DECODER["num_attention_heads"], vocab_size=VOCAB,
            pad_token_id=0, local_attention=4, layer_types=["full_attention", "sliding_attention"],
            attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0)
        cls = t.ModernBertForMaskedLM
    elif family == "deepseek_v3":  # MLA at DeepSeek-V3's head dims: q/k 128 + 64 rope, v 128; dense MLPs
        config = t.DeepseekV3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=2,
            num_key_value_heads=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128, first_k_dense_replace=LAYERS, vocab_size=VOCAB, pad_token_id=0, bos_token_id=0,
            eos_token_id=0, attention_dropout=0.0)
        cls = t.DeepseekV3ForCausalLM
    elif family == "phi3":
        kw = {k: v for k, v in DECODER.items() if k != "head_dim"}  # Phi-3: hidden / heads
        config = t.Phi3Config(**kw, resid_pdrop=0.0, embd_pdrop=0.0)
        cls = t.Phi3ForCausalLM
    elif family == "bert":
        config = t.BertConfig(
            **ENCODER,
            intermediate_size=128,
            num_hidden_layers=LAYERS,
            vocab_size=VOCAB,
            pad_token_id=0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        cls = t.BertForMaskedLM
    elif family == "gpt2":
        config = t.GPT2Config(
            n_embd=64,
            n_layer=LAYERS,
            n_head=4,
            n_positions=64,
            vocab_size=VOCAB,
            pad_token_id=0,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        cls = t.GPT2LMHeadModel
    else:
        raise ValueError(family)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(config)
    if family == "gpt2":
        model.loss_type = "ForCausalLM"  # else the loss lands in a second graph
    return model


def inputs(family, mask=None, train=False, seq=SEQ, use_cache=False):
    """(ids,), kwargs: `mask` None (no attention_mask), "ones", "right" or "left" (row 0 has 3
    padding tokens at that end, row 1 none)."""
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (BATCH, seq))
    kwargs = {} if family == "bert" else {"use_cache": use_cache}
    if mask is not None:
        am = torch.ones(BATCH, seq, dtype=torch.long)
        if mask == "right":
            am[0, -3:] = 0
        elif mask == "left":
            am[0, :3] = 0
        else:
            assert mask == "ones"
        kwargs["attention_mask"] = am
    if train:
        kwargs["labels"] = ids
    return (ids,), kwargs


def expected(family, padded: bool) -> tuple[dict, list[str]]:
    """(counts, near-miss reasons) for a 2-layer model, without (padded=False) or with an
    attention_mask."""
    causal = "causal_mask_if_unpadded" if padded else "causal_mask"
    if family == "bert":
        return {attention_key("none_mask_if_unpadded" if padded else "none_mask"): LAYERS}, []
    if family == "mistral":
        return {}, [SLIDING_PADDED if padded else SLIDING] * LAYERS
    if family == "gemma2":
        # layer_types alternate, sliding first: layer 0 local (near miss), layer 1 global
        return {attention_key(causal): 1}, [SLIDING_PADDED if padded else SLIDING]
    return {attention_key(causal): LAYERS}, []


def assert_fast_form(stats, counts):
    """Every SDPA call that `counts` says the fusion makes fast is fast in the end: rewritten
    (transformers 5.17 hands every call a materialized mask under torch.compile), or made so by
    transformers itself (5.24 calls SDPA with no mask where no attention_mask is given:
    is_causal=True in decoders, False in BERT), which the fusion notes as already fast."""
    fast = already_fast()
    assert all(note.startswith("attention already in the fast form") for _, _, note in fast), fast
    assert set(stats) <= set(counts), (stats, counts)
    assert sum(stats.values()) + len(fast) == sum(counts.values()), (stats, fast, counts)


def plain_compile(model, args, kwargs, train):
    """The reference: plain torch.compile (helpers.plain_compiled), no fusions."""
    with compiling():
        compiled = plain_compiled(model)
        out = run(compiled, model, args, train, kwargs=kwargs)
        assert fusionpass.stats() == {}
        return out


def check(family, mask=None, train=False, reference="compile"):
    model = build(family).train(train)
    args, kwargs = inputs(family, mask, train)
    got, stats = compile_and_count(model, *args, fusions=ATTENTION, train=train, kwargs=kwargs)
    counts, misses = expected(family, padded=mask is not None)
    assert [m[2] for m in near_misses()] == misses
    assert_fast_form(stats, counts)
    if reference == "compile":
        want = plain_compile(model, args, kwargs, train)
    else:  # the graph is left as it is: eager is reference enough
        want = eager(model, *args, train=train, kwargs=kwargs)
    if train:
        assert len(want.grads) == sum(1 for p in model.parameters() if p.requires_grad)
        assert all(g is not None for g in got.grads.values())
    assert_outcomes_close(got, want, rtol=RTOL_FP32)


def check_kernel_route(family, mask, train, variant):
    """Every layer of `family` takes flash_attention's `variant` with no near miss, and the
    outcomes equal plain compile's."""
    model = build(family).train(train)
    args, kwargs = inputs(family, mask, train)
    got, stats = compile_and_count(model, *args, fusions=ATTENTION, train=train, kwargs=kwargs)
    assert near_misses() == []
    assert stats == {("flash_attention", variant): LAYERS}
    assert_outcomes_close(got, plain_compile(model, args, kwargs, train), rtol=RTOL_FP32)


# ---------------------------------------------------------------------------------------------
# training (forward with labels + backward), no attention_mask: every family


@pytest.mark.parametrize(
    "family",
    ["llama", "qwen2", "gemma2", "phi3", "bert", "gpt2"],
)
def test_training_without_attention_mask(family):
    check(family, train=True)


def test_inference_mistral_without_window():
    """sliding_window=None: a plain causal mask in every layer."""
    check("mistral_no_window")


def test_mistral_sliding_window_training():
    """Every layer slides: two near misses, nothing rewritten (so eager is the reference)."""
    check("mistral", train=True, reference="eager")


# ---------------------------------------------------------------------------------------------
# with an attention_mask: the run-time branch


@pytest.mark.parametrize(
    "family,mask",
    [
        ("llama", "ones"),  # the fast branch runs
        ("llama", "right"),  # the masked branch runs
        ("gemma2", "left"),  # one sliding (near miss) and one global layer, left padding
        ("bert", "ones"),
        ("bert", "right"),
    ],
)
def test_training_with_attention_mask(family, mask):
    check(family, mask, train=True)


def test_mistral_sliding_window_with_padding():
    check("mistral", "right", train=False, reference="eager")


@pytest.mark.xfail(
    strict=True,
    raises=KnownBug,
    reason="BUG: GPT-2's query/key/value are views of one c_attn output (split); patterns/"
    "attention.py replace() hands them to torch.ops.higher_order.cond as they are and the "
    "compile fails: 'cond_true might be aliasing the input or the output!'",
)
def test_gpt2_with_attention_mask():
    with known_bug(torch._dynamo.exc.BackendCompilerFailed, "might be aliasing the input"):
        check("gpt2", "ones", train=True)


# widths at which the kernel takes each family's attention (head dim 64)
KERNEL_WIDTHS = {"llama": (DECODER, {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}),
                 "bert": (ENCODER, {"hidden_size": 128, "num_attention_heads": 2})}


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("mask", ["ones", "right", "left"])
@pytest.mark.parametrize("family,setting,variant", [("llama", "CAUSAL_PADDING", "causal_kernel_padded"),
                                                    ("bert", "PADDING", "none_kernel_padded")])
def test_padding_by_default(monkeypatch, family, setting, variant, mask, train):
    # the attention_mask a data collator passes (a decoder's causal mask or an encoder's all-true
    # one, AND key padding): flash_attention's kernel at the default config
    # (attention_causal_padding, attention_padding), at a head dim the kernel takes, against plain
    # compile
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK")
    monkeypatch.delenv(f"FUSIONPASS_ATTENTION_{setting}")
    config, widths = KERNEL_WIDTHS[family]
    for key, value in widths.items():
        monkeypatch.setitem(config, key, value)
    check_kernel_route(family, mask, train, variant)


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("family,mask", [("mistral", None), ("mistral", "right"), ("gemma2", "left"),
                                         ("gemma3", None), ("gemma3", "ones")])
def test_sliding_window_by_default(monkeypatch, family, mask, train):
    # sliding windows shorter than the sequence, with and without the collator's attention_mask:
    # flash_attention's kernel at the default config (attention_sliding_window), at a head dim the
    # kernel takes, against plain compile; Gemma's global layer is causal (padded: the kernel too)
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK")
    monkeypatch.delenv("FUSIONPASS_ATTENTION_CAUSAL_PADDING")
    monkeypatch.delenv("FUSIONPASS_ATTENTION_SLIDING_WINDOW")
    monkeypatch.setitem(DECODER, "num_attention_heads", 2)
    monkeypatch.setitem(DECODER, "num_key_value_heads", 1)
    monkeypatch.setitem(DECODER, "head_dim", 64)
    model = build(family).train(train)
    args, kwargs = inputs(family, mask, train)
    got, stats = compile_and_count(model, *args, fusions=ATTENTION, train=train, kwargs=kwargs)
    assert near_misses() == []
    window = "sliding_window_kernel_padded" if mask else "sliding_window_kernel"
    want = {("flash_attention", window): LAYERS} if family == "mistral" else {
        ("flash_attention", window): 1, attention_key("causal_kernel_padded" if mask else "causal_mask"): 1}
    assert_fast_form(stats, want)
    assert ("flash_attention", window) in stats
    assert_outcomes_close(got, plain_compile(model, args, kwargs, train), rtol=RTOL_FP32)


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("mask", [None, "left"])
def test_modernbert_band_by_default(monkeypatch, mask, train):
    # ModernBERT's local layer, |i - j| <= w: the sliding-window route on a moved diagonal, by
    # default, against plain compile (its global layer is another route's, or a near miss)
    for name in ("RUNTIME_CHECK", "CAUSAL_PADDING", "SLIDING_WINDOW"):
        monkeypatch.delenv(f"FUSIONPASS_ATTENTION_{name}")
    monkeypatch.setitem(DECODER, "num_attention_heads", 2)
    monkeypatch.setitem(DECODER, "head_dim", 64)
    model = build("modernbert").train(train)
    args, kwargs = inputs("bert", mask, train)
    got, stats = compile_and_count(model, *args, fusions=ATTENTION, train=train, kwargs=kwargs)
    window = "sliding_window_kernel_padded" if mask else "sliding_window_kernel"
    assert stats.get(("flash_attention", window)) == 1, (stats, near_misses())
    assert not [m for m in near_misses() if "band" in m[2]]
    assert_outcomes_close(got, plain_compile(model, args, kwargs, train), rtol=RTOL_FP32)


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("mask", ["ones", "left"])
def test_mla_causal_padding(monkeypatch, mask, train):
    # DeepSeek-V3's MLA (q/k head dim 192, v 128) with the collator's attention_mask, opted in: the
    # kernel at q's head dim, v padded with zero columns that the output drops, against plain compile
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK")
    monkeypatch.delenv("FUSIONPASS_ATTENTION_CAUSAL_PADDING")
    monkeypatch.setenv("FUSIONPASS_ATTENTION_MLA", "1")
    check_kernel_route("deepseek_v3", mask, train, "causal_kernel_padded")


def test_mla_is_opt_in(monkeypatch):
    # by default MLA stays with plain compile's SDPA, a near miss naming the setting
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK")
    monkeypatch.delenv("FUSIONPASS_ATTENTION_CAUSAL_PADDING")
    model = build("deepseek_v3").train(False)
    args, kwargs = inputs("deepseek_v3", "ones", False)
    _, stats = compile_and_count(model, *args, fusions=ATTENTION, train=False, kwargs=kwargs)
    assert stats == {}
    reasons = [m[2] for m in near_misses() if m[0] == "flash_attention"]
    assert len(reasons) == LAYERS and all("(MLA)" in r and "attention_mla=True" in r for r in reasons), reasons


# ---------------------------------------------------------------------------------------------
# inference


def test_inference_llama_without_attention_mask():
    check("llama")


def test_inference_llama_default_cache():
    """Without use_cache=False the model makes a DynamicCache, and the mask's sizes come from
    it (no packed-sequence detection): still causal in every layer."""
    model = build("llama").eval()
    args, kwargs = inputs("llama", use_cache=True)
    got, stats = compile_and_count(model, *args, fusions=ATTENTION, kwargs=kwargs)
    assert near_misses() == []
    assert_fast_form(stats, {attention_key("causal_mask"): LAYERS})
    assert_outcomes_close(got, eager(model, *args, kwargs=kwargs), rtol=RTOL_FP32)


def test_inference_bert_padded():
    check("bert", "right")


@pytest.mark.xfail(
    strict=True,
    raises=KnownBug,
    reason="BUG (Inductor's torch.cond lowering, inherited by the rewrite): in inference the "
    "rotary query/key (cat in rotate_half on a transposed view) reach the compiled branch "
    "with other strides than the branch was compiled for: run-time 'expected size 4==4, stride "
    "128==16 at dim=1'. Every Llama-family model with an attention_mask, in inference",
)
@pytest.mark.parametrize("mask", ["ones", "right"])
def test_inference_llama_with_attention_mask(mask):
    with known_bug(AssertionError, "expected size 4==4, stride 128==16 at dim=1"):
        check("llama", mask, reference="eager")


def test_other_sequence_lengths():
    model = build("llama").eval()
    with compiling():
        compiled = torch.compile(model, backend=make_backend(ATTENTION), fullgraph=True)
        for seq in (8, 5, 11):
            args, kwargs = inputs("llama", seq=seq)
            assert_outcomes_close(
                run(compiled, model, args, kwargs=kwargs),
                eager(model, *args, kwargs=kwargs),
                rtol=RTOL_FP32,
            )
        records = fusionpass.passes.STATISTICS.records
        assert len(records) == 2  # the static graph, then the symbolic one
        with known_bug(AssertionError, "differs from the attention length"):
            assert near_misses() == [], near_misses()
        assert [r.matches for r in records] == [{attention_key("causal_mask"): LAYERS}] * 2


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_repeat_kv_copies_are_gone(family):
    """GQA families (4 query heads over 2 KV heads): every rewritten SDPA reads the grouped K/V
    with enable_gqa=True, and no repeat_kv expand (the only 5-d one) is left in the graph."""
    model = build(family).eval()
    args, kwargs = inputs(family)
    sdpa = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
    gm, out, record = fused_graph(lambda ids: model(ids, **kwargs), *args, fusions=ATTENTION)
    calls = [n for n in gm.graph.nodes if n.target in sdpa]
    assert record.matches == {attention_key("causal_mask"): LAYERS}
    assert len(calls) == LAYERS
    for n in calls:
        assert n.kwargs.get("enable_gqa") is True
        assert n.args[1].meta["example_value"].shape[1] == 2
    assert not [n for n in gm.graph.nodes if n.target == "expand" and n.meta["example_value"].dim() == 5]
    torch.testing.assert_close(out.logits, model(*args, **kwargs).logits, rtol=RTOL_FP32, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# packed sequences (padding-free training): position_ids restart at each sequence, and
# transformers builds a block-diagonal causal mask from them. It must never be proven causal.


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
def test_packed_batch_by_default(monkeypatch, train):
    # DataCollatorWithFlattening's batch: one row of packed sequences (of lengths 5, 1, 9 and 1),
    # position ids restarting at each, no attention_mask: the kernel with the sequence segments
    # (attention_packed), against eager and plain compile
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK")
    monkeypatch.setitem(DECODER, "num_attention_heads", 2)
    monkeypatch.setitem(DECODER, "num_key_value_heads", 1)
    monkeypatch.setitem(DECODER, "head_dim", 64)
    model = build("llama").train(train)
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (1, 2 * SEQ))
    position_ids = torch.cat([torch.arange(n) for n in (5, 1, 9, 1)])[None]
    kwargs = {"use_cache": False, "position_ids": position_ids, **({"labels": ids} if train else {})}
    got, stats = compile_and_count(model, ids, fusions=ATTENTION, train=train, kwargs=kwargs)
    assert near_misses() == []
    assert stats == {("flash_attention", "causal_kernel_packed"): LAYERS}
    assert_outcomes_close(got, eager(model, ids, train=train, kwargs=kwargs), rtol=RTOL_FP32)
    assert_outcomes_close(got, plain_compile(model, (ids,), kwargs, train), rtol=RTOL_FP32)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_a_packed_batch_is_not_proven_causal(train):
    model = build("llama").train(train)
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (1, 2 * SEQ))
    # two packed sequences, of lengths 5 and 11, in one row
    position_ids = torch.cat([torch.arange(5), torch.arange(2 * SEQ - 5)])[None]
    kwargs = {"use_cache": False, "position_ids": position_ids, **({"labels": ids} if train else {})}
    got, stats = compile_and_count(model, ids, fusions=ATTENTION, train=train, kwargs=kwargs)
    assert stats == {} and already_fast() == [], (stats, already_fast())
    want = eager(model, ids, train=train, kwargs=kwargs)
    # the reference sees the packing: a plain causal mask would give other outputs
    causal = eager(model, ids, train=False, kwargs={"use_cache": False})
    assert (causal.outputs[-1] - want.outputs[-1]).abs().max() > 1e-3
    assert_outcomes_close(got, want, rtol=RTOL_FP32)
