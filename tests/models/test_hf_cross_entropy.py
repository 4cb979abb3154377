"""linear_cross_entropy on tiny Hugging Face causal LMs (built from configs, random weights, hidden
size 64, odd vocabularies), trained one step with labels.

Each model's loss (ForCausalLMLoss over `lm_head(h)`, Gemma-2 soft-capped, the lm_head tied to the
embeddings there) is one match; the loss, the returned logits and every parameter gradient agree
with plain torch.compile within fp32 tolerance. GPT-2 computes its loss in a second graph unless
`model.loss_type = "ForCausalLM"`: explain says so, and matches once it is set.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers import (
    assert_outcomes_close,
    compile_and_count,
    compiling,
    near_misses,
    run,
)

import fusionpass
from fusionpass.demo import tiny_hf
from fusionpass.patterns.cross_entropy import ANOTHER_GRAPH

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
    vocab, variant, num_items = MODELS[name]
    model = tiny(name, vocab).train()
    ids, kwargs = batch(vocab, num_items)
    got, stats = compile_and_count(model, ids, train=True, kwargs=kwargs, fusions=[FUSION])
    assert stats == {(FUSION, variant): 1}
    assert near_misses() == []
    with compiling():
        compiled = torch.compile(model, backend="inductor", fullgraph=True)
        expected = run(compiled, model, (ids,), True, kwargs=kwargs)
        assert fusionpass.stats() == {}
    # loss and logits, and a gradient for every parameter
    assert len(got.outputs) == 2 and got.outputs[1].shape == (2, 8, vocab)
    assert len(expected.grads) == sum(1 for p in model.parameters() if p.requires_grad)
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
    report = fusionpass.explain(model, ids, labels=ids, fusions=[FUSION], use_cache=False)
    assert report.variants == {(FUSION, "float_logits"): 1}
    assert report.near_misses == [] and report.graph_breaks == 0
