"""linear_cross_entropy on tiny Hugging Face causal LMs (built from configs, random weights, hidden
size 64, odd vocabularies), trained one step with labels.

Each model's loss (ForCausalLMLoss over `lm_head(h)`, Gemma-2 soft-capped, the lm_head tied to the
embeddings there) is one match in evaluation and through fusionpass.loss_only; in a training graph
that returns the logits it is a near miss. The loss, the returned logits and every parameter
gradient agree with plain torch.compile within fp32 tolerance. GPT-2 computes its loss in a second
graph unless `model.loss_type = "ForCausalLM"`: explain says so, and matches once it is set.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers import (
    assert_outcomes_close,
    assert_tensors_close,
    compile_and_count,
    compiling,
    fused_graph,
    near_misses,
    plain_compiled,
    run,
)

import fusionpass
from fusionpass.demo import tiny_hf
from fusionpass.fusions.linear_cross_entropy.pattern import ANOTHER_GRAPH, RETURNED_WITH_GRAD

FUSION = "linear_cross_entropy"
RTOL_FP32 = 1e-4

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True)
def _small_vocabularies(monkeypatch):
    # tiny vocabularies; the cost rule's default, 4096, is checked in
    # tests/patterns/test_cross_entropy_patterns.py
    monkeypatch.setenv("FUSIONPASS_LINEAR_CROSS_ENTROPY_MIN_VOCAB", "128")

# family -> (vocabulary size, the variant its loss matches, num_items_in_batch given)
MODELS = {
    "llama": (160, "float_logits", False),
    "qwen2": (300, "float_logits", True),  # the Trainer's form: reduction="sum" / num_items
    "gemma2": (257, "softcap", False),  # final_logit_softcapping=30
}


def tiny(name, vocab):
    torch.manual_seed(0)
    return tiny_hf(name, layers=1, width=64, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=32, intermediate_size=128, vocab_size=vocab)


def batch(vocab, num_items):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (2, 8), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100  # prompt tokens not trained on
    kwargs = {"use_cache": False, "labels": labels}
    if num_items:
        kwargs["num_items_in_batch"] = torch.tensor(int((labels[:, 1:] != -100).sum()))
    return ids, kwargs


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step(name):
    """The model returns logits that require grad: the loss stays with Inductor (the op's logits
    carry no gradient), and the loss, logits and every gradient are plain compile's."""
    vocab, _, num_items = MODELS[name]
    model = tiny(name, vocab).train()
    ids, kwargs = batch(vocab, num_items)
    got, stats = compile_and_count(model, ids, train=True, kwargs=kwargs, fusions=[FUSION])
    assert stats == {}
    (miss,) = near_misses()
    assert miss[0] == FUSION and RETURNED_WITH_GRAD in miss[2], miss
    with compiling():
        compiled = plain_compiled(model)
        expected = run(compiled, model, (ids,), True, kwargs=kwargs)
    assert len(expected.grads) == sum(1 for p in model.parameters() if p.requires_grad)
    assert_outcomes_close(got, expected, rtol=RTOL_FP32)


@pytest.mark.parametrize("name", list(MODELS))
def test_evaluation_step(name):
    """No gradient: the op computes the loss and writes the logits the model returns."""
    vocab, variant, num_items = MODELS[name]
    model = tiny(name, vocab).eval()
    ids, kwargs = batch(vocab, num_items)
    got, stats = compile_and_count(model, ids, train=False, kwargs=kwargs, fusions=[FUSION])
    assert stats == {(FUSION, variant): 1}
    assert near_misses() == []
    with compiling():
        compiled = plain_compiled(model)
        expected = run(compiled, model, (ids,), False, kwargs=kwargs)
        assert fusionpass.stats() == {}
    assert len(got.outputs) == 2 and got.outputs[1].shape == (2, 8, vocab)
    assert_outcomes_close(got, expected, rtol=RTOL_FP32)


def test_gpt2_loss_in_another_graph():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=160, n_positions=32, n_embd=64, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 160, (2, 8))
    report = fusionpass.explain(model, ids, labels=ids, fusions=[FUSION], use_cache=False)
    assert report.matches == {}
    assert [m[2] for m in report.near_misses] == [ANOTHER_GRAPH]
    model.loss_type = "ForCausalLM"
    report = fusionpass.explain(model, ids, labels=ids, fusions=[FUSION], use_cache=False, train=False)
    assert report.variants == {(FUSION, "float_logits"): 1}
    assert report.near_misses == [] and report.graph_breaks == 0


# --- fusionpass.loss_only: the same loss, no logits output --------------------------------------
# families whose forward is transformers' standard causal-LM forward, on every release tested
STANDARD_FORWARD = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma"]


@pytest.mark.parametrize("name", STANDARD_FORWARD)
def test_loss_only_gives_the_models_loss(name):
    model = tiny(name, 160).train()
    ids, kwargs = batch(160, num_items=name == "qwen2")
    expected = model(ids, **kwargs).loss
    got = fusionpass.loss_only(model)(ids, **kwargs)
    assert got.logits is None
    torch.testing.assert_close(got.loss, expected, rtol=0, atol=0)


def test_loss_only_refuses_a_forward_that_changes_the_logits():
    model = tiny("gemma2", 257)  # soft-caps the logits between lm_head and the loss
    with pytest.raises(ValueError, match="Gemma2ForCausalLM.forward is not the standard causal-LM forward"):
        fusionpass.loss_only(model)


def test_loss_only_compiles_to_a_loss_without_logits():
    model = tiny("qwen2", 300).train()
    ids, kwargs = batch(300, num_items=True)
    wrapped = fusionpass.loss_only(model)
    got, stats = compile_and_count(wrapped, ids, train=True, kwargs=kwargs, fusions=[FUSION])
    assert stats == {(FUSION, "float_logits"): 1}
    assert len(got.outputs) == 1  # the loss, and nothing of [tokens, vocabulary]
    gm, _, _ = fused_graph(wrapped, ids, kwargs["labels"], fusions=[FUSION])
    (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.fusionpass.linear_cross_entropy.default]
    assert op.args[10] is False  # return_logits
    with compiling():
        expected = run(plain_compiled(model), model, (ids,), True, kwargs=kwargs)
    # the loss and every gradient as plain compile of the unwrapped model gives them
    assert_tensors_close(got.outputs[0], expected.outputs[0], RTOL_FP32, "loss")
    for key, grad in expected.grads.items():
        assert_tensors_close(got.grads["model." + key], grad, RTOL_FP32, key)


def test_explain_hints_at_loss_only_where_the_logits_are_returned():
    model = tiny("llama", 160).train()
    ids, kwargs = batch(160, num_items=False)
    report = fusionpass.explain(model, ids, fusions=[FUSION], **kwargs)
    assert report.matches == {}
    assert len(report.hints) == 1 and "fusionpass.loss_only(model)" in report.hints[0]
    assert "(2, 8, 160)" in report.hints[0] and "hints:" in str(report)
    wrapped = fusionpass.loss_only(model)
    report = fusionpass.explain(wrapped, ids, fusions=[FUSION], **kwargs)
    assert report.matches == {FUSION: 1} and report.hints == []
