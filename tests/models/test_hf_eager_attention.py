"""attention, eager-math route: attention written in torch ops (BLOOM's baddbmm of the ALiBi tensor,
MPT's sliced ALiBi tensor and masked_fill, GPT-2's matmuls with transformers' additive causal mask,
as GPT-J, GPT-NeoX and OPT write them too) becomes fusionpass::flash_attention, on by
default. Tiny HF models (head dim 64, the kernel's smallest) under the Triton interpreter, training
and inference: exact counts, outputs and gradients equal to plain torch.compile (dropout off); with
attention dropout on, the loss over several seeds agrees in expectation; padded batches and returned
probabilities are near misses with their reasons."""
from __future__ import annotations

import pytest
import torch
from helpers import (
    ATTENTION,
    assert_outcomes_close,
    attention_key,
    compile_and_count,
    compiling,
    fused_graph,
    near_misses,
    plain_compiled,
    run,
)

import fusionpass
from fusionpass.fusions.flash_attention import op as fa_ops

transformers = pytest.importorskip("transformers")

B, S, HEADS, HEAD_DIM = 2, 8, 2, 64
FLASH = torch.ops.fusionpass.flash_attention.default


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(fa_ops, "CPU_BLOCKS", {"block_m": 16, "block_n": 16, "dq_block_m": 16, "dq_block_n": 16})


def bloom(layers=2, dropout=0.0):
    config = transformers.BloomConfig(vocab_size=96, hidden_size=HEADS * HEAD_DIM, n_layer=layers, n_head=HEADS,
                                      attention_dropout=dropout, hidden_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.BloomForCausalLM(config)


def gpt2(layers=2, dropout=0.0):
    config = transformers.GPT2Config(vocab_size=96, n_embd=HEADS * HEAD_DIM, n_layer=layers, n_head=HEADS,
                                     n_positions=32, attn_pdrop=dropout, resid_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # else the loss lands in a second graph
    return model


def mpt(layers=2):
    config = transformers.MptConfig(vocab_size=96, d_model=HEADS * HEAD_DIM, n_layers=layers, n_heads=HEADS,
                                    max_seq_len=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MptForCausalLM(config)


def rotary(family):
    """GPT-J / GPT-NeoX (rotary, GPT-2-style eager math) and OPT (scaled q, no rotary)."""
    width = HEADS * HEAD_DIM
    if family == "gptj":
        config = transformers.GPTJConfig(vocab_size=96, n_embd=width, n_head=HEADS, n_layer=2, rotary_dim=16,
                                         n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    elif family == "gpt_neox":
        config = transformers.GPTNeoXConfig(vocab_size=96, hidden_size=width, num_attention_heads=HEADS,
                                            num_hidden_layers=2, intermediate_size=width, rotary_pct=0.25,
                                            attention_dropout=0.0, hidden_dropout=0.0)
    else:
        config = transformers.OPTConfig(vocab_size=96, hidden_size=width, num_attention_heads=HEADS,
                                        num_hidden_layers=2, ffn_dim=width, word_embed_proj_dim=width,
                                        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def ids():
    torch.manual_seed(1)
    return torch.randint(1, 96, (B, S))


def check(model, variant, train, kwargs=None, rtol=2e-4):
    x = ids()
    kwargs = {"use_cache": False, **(kwargs or {})}
    if train:
        kwargs["labels"] = x
    model.train(train)
    got, stats = compile_and_count(model, x, fusions=ATTENTION, train=train, kwargs=kwargs)
    assert near_misses() == []
    assert stats == {attention_key(variant): 2}
    with compiling():
        want = run(plain_compiled(model), model, (x,), train, kwargs=kwargs)
        assert fusionpass.stats() == {}
    assert_outcomes_close(got, want, rtol=rtol)


@pytest.mark.parametrize("train", [True, False])
def test_bloom_alibi(train):
    check(bloom(), "eager_alibi_kernel", train)


@pytest.mark.parametrize("train", [True, False])
def test_mpt_alibi(train):
    # MPT: (q k^T) * scale + the sliced [H, 1, L] ALiBi tensor, masked_fill with the bool mask
    check(mpt(), "eager_alibi_kernel", train)


@pytest.mark.parametrize("train", [True, False])
def test_gpt2_eager(train):
    check(gpt2(), "eager_kernel", train)


@pytest.mark.parametrize("family, train", [("gptj", True), ("gpt_neox", True), ("opt", False)])
def test_other_eager_families(family, train):
    # OPT only in inference: its training forward draws torch.rand for layerdrop, a graph break
    check(rotary(family), "eager_kernel", train)


def test_bloom_graph_has_no_scores():
    # the S x S scores, the softmax and the dropout of the probabilities are gone from the graph
    model = bloom(layers=1).train()
    gm, _, record = fused_graph(model, ids(), fusions=ATTENTION)
    assert record.matches == {attention_key("eager_alibi_kernel"): 1}
    targets = [n.target for n in gm.graph.nodes]
    assert FLASH in targets
    assert not [t for t in targets if t in (torch.baddbmm, "baddbmm", torch.bmm, torch.nn.functional.softmax)]


def test_padded_batch_is_a_near_miss():
    model = bloom().eval()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :3] = 0  # left padding: query rows 0..2 of row 1 see no key
    _, stats = compile_and_count(model, ids(), fusions=ATTENTION, kwargs={"attention_mask": mask, "use_cache": False})
    assert stats == {}
    reasons = [r for _, _, r in near_misses()]
    assert len(reasons) == 2 and all("run-time key padding" in r for r in reasons)


class ReturnsProbabilities(torch.nn.Module):
    def forward(self, q, k, v):
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.125, dim=-1)
        return torch.matmul(p, v), p


def test_returned_probabilities_are_a_near_miss():
    q, k, v = (torch.randn(B, HEADS, S, HEAD_DIM) for _ in range(3))
    _, _, record = fused_graph(ReturnsProbabilities(), q, k, v, fusions=ATTENTION)
    assert record.matches == {}
    ((_, _, reason),) = record.near_misses
    assert "also read outside the attention" in reason


def test_bloom_dropout_statistics():
    # Attention dropout 0.5 inside the kernel (Philox, regenerated in the backward): the mean loss
    # over seeds agrees with plain torch.compile's, and the gradients are finite and not zero.
    model = bloom(layers=1, dropout=0.5).train()
    x = ids()
    losses = {"fused": [], "plain": []}
    with compiling():
        fused = torch.compile(model, backend=fusionpass.backend(fusions=ATTENTION, cpu=True), fullgraph=True)
        plain = torch.compile(model, backend="inductor", fullgraph=True)
        for name, fn in (("fused", fused), ("plain", plain)):
            for seed in range(8):
                torch.manual_seed(seed)
                loss = fn(input_ids=x, labels=x, use_cache=False).loss
                losses[name].append(loss.item())
                if name == "fused" and seed == 0:
                    loss.backward()
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    assert grads and all(torch.isfinite(g).all() for g in grads)
                    model.zero_grad()
    fused_mean = sum(losses["fused"]) / 8
    plain_mean = sum(losses["plain"]) / 8
    assert len(set(losses["fused"])) == 8, "every call draws a new mask"
    assert abs(fused_mean - plain_mean) < 0.05 * abs(plain_mean)


def gemma2(layers=2):
    """Gemma-2: soft-capped scores (a cap the scores reach: 2), a sliding-window layer and a full one."""
    config = transformers.Gemma2Config(vocab_size=96, hidden_size=HEADS * HEAD_DIM, intermediate_size=64,
                                       num_hidden_layers=layers, num_attention_heads=HEADS, num_key_value_heads=1,
                                       head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, attn_logit_softcapping=2.0,
                                       final_logit_softcapping=None, sliding_window=4,
                                       layer_types=["sliding_attention", "full_attention"][:layers])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(config)


def gpt_oss():
    """gpt-oss's attention layers with sinks (the conformance suite's: its MoE experts' grouped_mm
    fallback does not compile in training on the CPU, and is not this fusion's)."""
    from fusionpass.conformance.attention_layers import GptOss, Shape

    torch.manual_seed(0)
    return GptOss(Shape(B, HEADS, 1, S, HEAD_DIM))


@pytest.mark.parametrize("family, variant, setting", [
    (gemma2, "eager_softcap_kernel", "attention_softcap"), (gpt_oss, "eager_sinks_kernel", "attention_sinks")])
def test_eager_forms_on_by_default(family, variant, setting):
    # every layer by default (soft-capping in training only with attention_softcap_training: there
    # it is leaner than plain compile but slower), outputs and gradients (the sinks' too) equal to
    # plain torch.compile's; with the setting off, a near miss naming it
    model = family().train()
    if family is gemma2:
        x, kwargs = ids(), {"use_cache": False, "labels": ids()}
        _, stats = compile_and_count(model, x, fusions=ATTENTION, train=True, kwargs=kwargs)
        assert stats == {} and len(near_misses("attention_softcap_training=True")) == 2
        training = {"attention_softcap_training": True}
    else:
        x, kwargs = torch.randn(B, S, HEADS * HEAD_DIM), {}
        training = {}
    _, stats = compile_and_count(model, x, fusions=ATTENTION, train=True, kwargs=kwargs,
                                 **{setting: False}, **training)
    assert stats == {} and len(near_misses(f"{setting}=False")) == 2
    got, stats = compile_and_count(model, x, fusions=ATTENTION, train=True, kwargs=kwargs, **training)
    assert stats == {attention_key(variant): 2}
    with compiling():
        want = run(plain_compiled(model), model, (x,), True, kwargs=kwargs)
    assert_outcomes_close(got, want, rtol=2e-4)


def test_sinks_under_a_collators_padding():
    # left padding: query rows 0..2 of batch row 1 see no key, and attend to their sink alone under
    # the additive mask as in the kernel (out 0, no gradient): matched, and equal to plain compile
    model = gpt_oss().train()
    x = torch.randn(B, S, HEADS * HEAD_DIM)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :3] = 0
    got, stats = compile_and_count(model, x, fusions=ATTENTION, train=True, kwargs={"attention_mask": mask})
    assert stats == {attention_key("eager_sinks_kernel"): 2}
    with compiling():
        want = run(plain_compiled(model), model, (x,), True,
                   kwargs={"attention_mask": mask})
    assert_outcomes_close(got, want, rtol=2e-4)


@pytest.mark.parametrize("train, padding", [(False, "left"), (False, "right"), (True, "left")],
                         ids=["inference-left", "inference-right", "training"])
def test_soft_capping_under_a_collators_padding(train, padding):
    # query rows that see no key average every value under the additive mask: with left padding
    # rows 0..2 of batch row 1, with right padding (3 tokens) row 7 in the window of 4 (keys 4..7).
    # The replacement writes that average in inference (both layer types). In training such a row
    # differentiates a uniform softmax, which the kernel does not: a near miss that says so
    model = gemma2().train(train)
    mask = torch.ones(B, S, dtype=torch.long)
    if padding == "left":
        mask[1, :3] = 0
    else:
        mask[1, 3:] = 0
    kwargs = {"attention_mask": mask, "use_cache": False}
    got, stats = compile_and_count(model, ids(), fusions=ATTENTION, train=train, kwargs=kwargs,
                                   attention_softcap_training=True)
    if train:
        assert stats == {} and len(near_misses("differentiates a uniform softmax")) == 2
        return
    assert stats == {attention_key("eager_softcap_kernel"): 2}
    with compiling():
        want = run(plain_compiled(model), model, (ids(),), False, kwargs=kwargs)
    assert_outcomes_close(got, want, rtol=2e-4)
