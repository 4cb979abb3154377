"""rms_norm_residual on tiny Hugging Face models (built from configs, random weights, width 512).

A model of L layers has 2L + 1 RMSNorms: the first layer's input norm reads the embeddings (no
residual add), every other norm reads a residual sum. Each model is compiled with the fusionpass
backend and with plain torch.compile; the logits, and in training the loss and every parameter
gradient, agree within fp32 tolerance.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from helpers import (
    FUSION,
    assert_outcomes_close,
    compile_and_count,
    compiling,
    make_backend,
    near_misses,
    plain_compiled,
    run,
)

import fusionpass
from fusionpass.demo import tiny_hf

LAYERS = 2
RTOL_FP32 = 1e-4

# model family -> the variant its norms match
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma": "gemma"}


def expected_counts(variant, layers=LAYERS):
    return {(FUSION, variant): 2 * layers, (FUSION, f"{variant}_no_residual"): 1}


def model_and_inputs(name, train, dtype=torch.float32, batch=2, seq=16):
    torch.manual_seed(0)
    model = tiny_hf(name, layers=LAYERS).to(dtype)
    model.train(train)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    kwargs = {"use_cache": False}
    if train:
        kwargs["labels"] = ids
    return model, ids, kwargs


def plain_compile(model, ids, kwargs, train):
    """The reference: plain torch.compile (helpers.plain_compiled), no fusions."""
    with compiling():
        compiled = plain_compiled(model)
        out = run(compiled, model, (ids,), train, kwargs=kwargs)
        assert fusionpass.stats() == {}
        return out


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_tiny_hf_model(name, train):
    model, ids, kwargs = model_and_inputs(name, train)
    got, stats = compile_and_count(model, ids, train=train, kwargs=kwargs, fusions=[FUSION])
    assert stats == expected_counts(FAMILIES[name])
    assert near_misses() == []
    expected = plain_compile(model, ids, kwargs, train)
    if train:
        # the loss (first output) and every parameter got a gradient
        assert len(expected.grads) == sum(1 for p in model.parameters() if p.requires_grad)
        assert all(g is not None for g in got.grads.values())
    assert_outcomes_close(got, expected, rtol=RTOL_FP32)


def test_tiny_llama_bf16_inference():
    model, ids, kwargs = model_and_inputs("llama", train=False, dtype=torch.bfloat16)
    got, stats = compile_and_count(model, ids, kwargs=kwargs, fusions=[FUSION])
    assert stats == expected_counts("llama")
    assert got.outputs[0].dtype == torch.bfloat16
    expected = plain_compile(model, ids, kwargs, train=False)
    assert_outcomes_close(got, expected, torch.bfloat16)


def test_tiny_llama_explain_and_other_sequence_lengths():
    """explain() on an HF model reports the same counts. The compiled model then runs other
    sequence lengths correctly: Dynamo recompiles once, on the first change of sequence length,
    into a graph symbolic in it (fully matched again: eps and widths stay static), and reuses
    that graph for every later length."""
    model, ids, _ = model_and_inputs("llama", train=False)
    report = fusionpass.explain(model, ids, fusions=[FUSION], use_cache=False)
    assert report.matches == {FUSION: 2 * LAYERS + 1}
    assert report.variants == expected_counts("llama")
    assert report.near_misses == []
    assert report.graph_breaks == 0
    with compiling():
        compiled = torch.compile(model, backend=make_backend([FUSION]), fullgraph=True)
        for seq in (16, 9, 5, 12):
            x = torch.randint(0, model.config.vocab_size, (2, seq))
            with torch.no_grad():
                got = compiled(x, use_cache=False).logits
                want = model(x, use_cache=False).logits
            torch.testing.assert_close(got, want, rtol=RTOL_FP32, atol=RTOL_FP32)
        records = fusionpass.passes.STATISTICS.records
        assert [r.matches for r in records] == [expected_counts("llama")] * 2
        assert near_misses() == []


def test_tiny_phi3_builds():
    model = tiny_hf("phi3", layers=1)
    assert model.config.hidden_size == 512


def test_explain_names_where_by_module_path():
    """explain's "where" is the module's path in the model on every release: transformers 5.17's
    forward is traced as `L['self']`, 5.24's decorated forward as `L['args'][0]` (Dynamo's names)."""
    torch.manual_seed(0)
    model = tiny_hf("llama", layers=1, width=256).eval()  # width 256: outside the norm's cost rule
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    report = fusionpass.explain(model, ids, fusions=[FUSION], use_cache=False)
    assert report.matches == {}
    assert sorted(w for _, w, _ in report.near_misses) == [
        "model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"]
