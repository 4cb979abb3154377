"""attention, Falcon with ALiBi (transformers 5.17, `alibi=True`): the model folds its ALiBi tensor
into the 4-D mask (`masked_fill(alibi / sqrt(d), where(m, 0, min) < -1, min)`).
  - sdpa: that mask handed to SDPA -> alibi_mask_kernel (alibi_mask_kernel_padded with a padded
    attention_mask), on by default;
  - eager: `(q k^T + alibi) *= 1/sqrt(d)`, `softmax(logits + mask)` -> eager_alibi_mask_kernel
    (the bias counted twice, as the model computes it); padded batches are near misses there.
Falcon with rotary embeddings (`alibi=False`): eager -> eager_kernel, sdpa -> the causal mask rewrite.
Tiny 2-layer models (head dim 64) under the Triton interpreter, training and inference: exact
counts, outputs and gradients equal to plain torch.compile (dropout off)."""
from __future__ import annotations

import pytest
import torch
from helpers import (
    ATTENTION,
    assert_outcomes_close,
    attention_key,
    compile_and_count,
    compiling,
    near_misses,
    plain_compiled,
    run,
)

import fusionpass
from fusionpass.fusions.flash_attention import op as fa_ops

transformers = pytest.importorskip("transformers")

B, S, HEADS, HEAD_DIM = 2, 8, 2, 64


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL", raising=False)
    monkeypatch.setattr(fa_ops, "CPU_BLOCKS", {"block_m": 16, "block_n": 16, "dq_block_m": 16, "dq_block_n": 16})


def falcon(impl, multi_query=False, layers=2, alibi=True):
    config = transformers.FalconConfig(
        vocab_size=96, hidden_size=HEADS * HEAD_DIM, num_hidden_layers=layers, num_attention_heads=HEADS,
        alibi=alibi, new_decoder_architecture=False, multi_query=multi_query, attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    config._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.FalconForCausalLM(config)


def ids():
    torch.manual_seed(1)
    return torch.randint(1, 96, (B, S))


def left_padded():
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :3] = 0  # query rows 0..2 of row 1 see no key
    return mask


def check(model, variant, train, attention_mask=None, rtol=2e-4):
    x = ids()
    kwargs = {"use_cache": False}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if train:
        kwargs["labels"] = x.clone()
    model.train(train)
    got, stats = compile_and_count(model, x, fusions=ATTENTION, train=train, kwargs=kwargs)
    assert near_misses() == []
    assert stats == {attention_key(variant): 2}
    with compiling():
        want = run(plain_compiled(model), model, (x,), train, kwargs=kwargs)
        assert fusionpass.stats() == {}
    assert_outcomes_close(got, want, rtol=rtol)


@pytest.mark.parametrize("train", [True, False])
def test_falcon_sdpa_alibi(train):
    check(falcon("sdpa"), "alibi_mask_kernel", train)


def test_falcon_sdpa_alibi_left_padded():
    # multi-query (one K/V head for two query heads), rows that see no key
    check(falcon("sdpa", multi_query=True), "alibi_mask_kernel_padded", False, attention_mask=left_padded())


def test_falcon_sdpa_alibi_left_padded_training():
    """With left padding in training, query rows that see no key get a gradient for q and k from
    SDPA (that of a uniform softmax) that the kernel does not reproduce: a near miss, and the
    model runs as plain torch.compile does."""
    model = falcon("sdpa", multi_query=True).train()
    x = ids()
    kwargs = {"use_cache": False, "attention_mask": left_padded(), "labels": x}
    got, stats = compile_and_count(model, x, fusions=ATTENTION, train=True, kwargs=kwargs)
    assert stats == {}
    reasons = {r for _, _, r in near_misses()}
    assert reasons == {"SDPA mask with a bias and run-time key padding in training: the gradient SDPA gives "
                       "q and k at query rows that see no key is not reproduced by the kernel"}, reasons
    with compiling():  # Inductor's own: at rows that see no key its gradient is not eager's
        want = run(torch.compile(model, backend="inductor", fullgraph=True), model, (x,), True, kwargs=kwargs)
    assert_outcomes_close(got, want, rtol=2e-4)


@pytest.mark.parametrize("train", [True, False])
def test_falcon_eager_alibi(train):
    check(falcon("eager"), "eager_alibi_mask_kernel", train)


def test_falcon_eager_padded_batch_is_a_near_miss():
    model = falcon("eager").eval()
    kwargs = {"attention_mask": left_padded(), "use_cache": False}
    _, stats = compile_and_count(model, ids(), fusions=ATTENTION, kwargs=kwargs)
    assert stats == {}
    reasons = [r for _, _, r in near_misses()]
    assert len(reasons) == 2 and all("run-time key padding" in r for r in reasons)


@pytest.mark.parametrize("train", [True, False])
def test_falcon_rotary_eager(train):
    # alibi=False: rotary q/k, then GPT-2-style eager math (scores / sqrt(d) + the additive causal
    # mask, softmax, @ v) -> the kernel's eager route
    check(falcon("eager", alibi=False), "eager_kernel", train)


def test_falcon_rotary_sdpa():
    # alibi=False with sdpa: transformers materializes the causal mask; it is proven causal and the
    # call becomes is_causal=True SDPA (the mask rewrite, no kernel; training is Llama's case)
    check(falcon("sdpa", alibi=False), "causal_mask", False)
