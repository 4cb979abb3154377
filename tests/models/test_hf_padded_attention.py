"""fusionpass::padded_attention, the cuDNN route for an HF collator's mask (attention_cudnn_padding:
on by default for causal masks from attention_cudnn_padding_min_length's query length, all-true
masks opt-in): on a tiny Llama and BERT in bf16 it replaces every layer's attention, and the step equals
the kernel route's (fusionpass::flash_attention with the same key padding) for all-ones, right- and
left-padded batches, forward and every gradient. On the CPU, cuDNN's part is a torch reference with
the same key lengths: this proves the per-row choice between cuDNN and our kernel, the rewrite and
the autograd, not cuDNN (the conformance suite runs that on the GPU)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from helpers import assert_outcomes_close, compile_and_count, near_misses  # noqa: E402
from models.test_hf_attention import KERNEL_WIDTHS, LAYERS, build, inputs  # noqa: E402

from fusionpass.kernels.cudnn_attention import Refused  # noqa: E402
from fusionpass.fusions.flash_attention import padded_op as op  # noqa: E402

ATTENTION = ["flash_attention"]
VARIANTS = {"llama": "causal_kernel_padded", "bert": "none_kernel_padded"}
# the route at the tiny models' lengths (its default shortest length is longer); BERT's all-true mask
ROUTE = {"attention_cudnn_padding_min_length": 1, "attention_cudnn_padding_all_true": True}


def _count_calls(monkeypatch):
    calls = []
    real = op._library_forward

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(op, "_library_forward", counted)
    return calls


@pytest.mark.parametrize("mask", ["ones", "right", "left"])
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_route_equals_the_kernel_route(monkeypatch, family, mask):
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK", raising=False)
    config, widths = KERNEL_WIDTHS[family]
    for key, value in widths.items():
        monkeypatch.setitem(config, key, value)
    model = build(family).to(torch.bfloat16).train()
    args, kwargs = inputs(family, mask, True)
    kernel, stats = compile_and_count(model, *args, fusions=ATTENTION, train=True, kwargs=kwargs,
                                      attention_cudnn_padding=False)
    assert stats == {("flash_attention", VARIANTS[family]): LAYERS}
    calls = _count_calls(monkeypatch)
    got, stats = compile_and_count(model, *args, fusions=ATTENTION, train=True, kwargs=kwargs, **ROUTE)
    assert near_misses() == []
    assert stats == {("flash_attention", VARIANTS[family]): LAYERS}
    assert len(calls) == LAYERS  # every layer's attention went through padded_attention
    assert_outcomes_close(_without_zero_gradients(got), _without_zero_gradients(kernel), torch.bfloat16)


def _without_zero_gradients(outcome):
    """The key projection's bias adds q . b to every score of a query row, which the softmax
    ignores: its gradient is 0 analytically, and what either path returns is rounding noise."""
    grads = {name: g for name, g in outcome.grads.items() if not name.endswith("key.bias")}
    return dataclasses.replace(outcome, grads=grads)


def test_prefix_rows():
    kp = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    n, prefix = op.prefix_rows(kp)
    assert n.tolist() == [4, 2, 3, 2, 0]
    assert prefix.tolist() == [True, True, False, False, False]
    seq_kv, skipped = op._lengths(kp)
    # cuDNN never sees a row of length 0, and one key of a row it does not serve (nearly no work);
    # our kernel skips the rows cuDNN serves
    assert seq_kv.tolist() == [4, 2, 1, 1, 1] and torch.equal(skipped, prefix)


def test_on_by_default_for_causal_masks_from_the_shortest_length(monkeypatch):
    """At the default settings the route takes a causal mask from attention_cudnn_padding_min_length
    on and leaves a shorter one, and an all-true one, to our kernel, saying why."""
    from fusionpass import config as config_mod
    from fusionpass.passes import STATISTICS

    cfg = config_mod.make()
    assert cfg.attention_cudnn_padding is True and cfg.attention_cudnn_padding_all_true is False
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK", raising=False)
    for family in ("llama", "bert"):
        config, widths = KERNEL_WIDTHS[family]
        for key, value in widths.items():
            monkeypatch.setitem(config, key, value)
    for family, length, routed, why in [("llama", 1, True, None),
                                        ("llama", cfg.attention_cudnn_padding_min_length, False, "query length"),
                                        ("bert", 1, False, "all-true mask")]:
        model = build(family).to(torch.bfloat16).train()
        args, kwargs = inputs(family, "right", True)
        calls = _count_calls(monkeypatch)
        _, stats = compile_and_count(model, *args, fusions=ATTENTION, train=True, kwargs=kwargs,
                                     attention_cudnn_padding_min_length=length)
        assert stats == {("flash_attention", VARIANTS[family]): LAYERS}
        assert len(calls) == (LAYERS if routed else 0)
        kernels = [k for r in STATISTICS.records for fusion, _, k, _ in r.kernels if fusion == "flash_attention"]
        assert len(kernels) == LAYERS
        assert all(("padded_attention" in k) == routed for k in kernels)
        assert why is None or all("not cuDNN's padding route: " in k and why in k for k in kernels)


def test_a_shape_cudnn_refuses_goes_to_our_kernel(monkeypatch):
    """Where cuDNN builds no plan (a head dim or GQA ratio its version does not take), every row of
    that shape goes to our kernel, with one warning, and the result is still the kernel route's."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 19, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 19, 64, dtype=torch.bfloat16), torch.randn(2, 2, 19, 64, dtype=torch.bfloat16)
    kp = torch.ones(2, 19, dtype=torch.bool)
    kp[1, 11:] = False

    def refuse(*args):
        raise Refused("no plan")

    monkeypatch.setattr(op, "_library_forward", refuse)
    monkeypatch.setattr(op, "_REFUSED", set())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with pytest.warns(UserWarning, match="cuDNN refused the forward"):
        out, lse = torch.ops.fusionpass.padded_attention(*leaves, kp, scale=0.125, causal=True)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    expected = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = torch.ops.fusionpass.flash_attention(*expected, kp, scale=0.125, causal=True)
    ref_grads = torch.autograd.grad(ref, expected, torch.ones_like(ref))
    for a, b in zip((out, lse, *grads), (ref, ref_lse, *ref_grads)):
        torch.testing.assert_close(a, b)


def test_a_failure_other_than_a_refusal_is_raised(monkeypatch):
    """Only cuDNN's refusal to plan a shape falls back; anything else (a failure at run time) is the
    caller's to see, not a silent switch of kernels."""
    def fail(*args):
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")

    monkeypatch.setattr(op, "_library_forward", fail)
    monkeypatch.setattr(op, "_REFUSED", set())
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="EXECUTION_FAILED"):
        torch.ops.fusionpass.padded_attention(q, q, q, torch.ones(1, 8, dtype=torch.bool), scale=0.125)


@pytest.mark.parametrize("mask", ["right", "left"])
def test_route_writes_token_major_for_the_output_projection(monkeypatch, mask):
    """attention_out_proj takes the route's op as it takes the kernel's: cuDNN's out (and our
    kernel's rows in it) token-major, the head merge a view; the step equals the kernel route's."""
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK", raising=False)
    config, widths = KERNEL_WIDTHS["llama"]
    for key, value in widths.items():
        monkeypatch.setitem(config, key, value)
    model = build("llama").to(torch.bfloat16).train()
    args, kwargs = inputs("llama", mask, True)
    fusions = ATTENTION + ["attention_out_proj"]
    kernel, stats = compile_and_count(model, *args, fusions=fusions, train=True, kwargs=kwargs,
                                      attention_cudnn_padding=False)
    calls = _count_calls(monkeypatch)
    got, route_stats = compile_and_count(model, *args, fusions=fusions, train=True, kwargs=kwargs, **ROUTE)
    assert near_misses() == []
    assert route_stats == stats and stats[("flash_attention", VARIANTS["llama"])] == LAYERS
    assert sum(n for (fusion, _), n in stats.items() if fusion == "attention_out_proj") == LAYERS
    assert len(calls) == LAYERS
    assert_outcomes_close(_without_zero_gradients(got), _without_zero_gradients(kernel), torch.bfloat16)
