"""attention, kernel route (Config.attention_kernel, FUSIONPASS_ATTENTION_KERNEL=1; sliding windows
and causal padding over square scores also by default): SDPA calls whose transformers-style mask is
proven sliding-window, or causal/all-true AND key padding from the run-time attention_mask, become
fusionpass::flash_attention (the FA2-style kernel under the Triton interpreter here), with exact
counts; outputs and q/k/v gradients equal eager within fp32 tolerance. Head dim 64 (the kernel's
smallest), short sequences, few heads."""
from __future__ import annotations

import pytest
import torch
from helpers import ATTENTION, assert_outcomes_close, compile_and_count, compiling, eager, fused_graph, near_misses, run

import fusionpass
from patterns.test_attention_masks import Attention, attention_mask, counts

from fusionpass.fusions.flash_attention import op as fa_ops

B, H, S, D = 2, 2, 8, 64
FLASH = torch.ops.fusionpass.flash_attention.default


@pytest.fixture(autouse=True)
def _kernel_on(monkeypatch):
    monkeypatch.setenv("FUSIONPASS_ATTENTION_KERNEL", "1")
    monkeypatch.delenv("FUSIONPASS_ATTENTION_RUNTIME_CHECK", raising=False)
    # one program per (batch, head) under the interpreter
    monkeypatch.setattr(fa_ops, "CPU_BLOCKS", {"block_m": 16, "block_n": 16, "dq_block_m": 16, "dq_block_n": 16})


def inputs(padding_kind=None, kv_heads=H, seq=S):
    q = torch.randn(B, H, seq, D)
    k, v = torch.randn(B, kv_heads, seq, D), torch.randn(B, kv_heads, seq, D)
    if padding_kind is None:
        return (q, k, v)
    return (q, k, v, attention_mask(padding_kind, batch=B, length=seq))


def check(module, args, expected, train=False):
    module.train(train)
    got, stats = compile_and_count(module, *args, fusions=ATTENTION, train=train)
    assert near_misses() == []
    assert stats == expected
    want = eager(module, *args, train=train)
    if train:
        assert sorted(got.grads) == ["input0", "input1", "input2"]
    assert_outcomes_close(got, want)


CASES = [
    # (mask function, attention_mask, variant)
    ("sliding_window", None, "sliding_window_kernel"),
    ("sliding_window", "right", "sliding_window_kernel_padded"),
    ("sliding_window", "left", "sliding_window_kernel_padded"),
    ("causal", "right", "causal_kernel_padded"),
    ("causal", "left", "causal_kernel_padded"),  # fully masked query rows
    ("bidirectional", "left", "none_kernel_padded"),
    ("bidirectional", "ones", "none_kernel_padded"),
]


@pytest.mark.parametrize("fn,padding_kind,variant", CASES, ids=[f"{f}-{p or 'no_mask'}" for f, p, _ in CASES])
def test_kernel_route_training(fn, padding_kind, variant):
    check(Attention(fn, layers=2), inputs(padding_kind), counts(**{variant: 2}), train=True)


def test_kernel_route_inference_padding_rows():
    """left and right padding of different lengths in one batch (rows of 8, 5 and 3 keys)."""
    q, k, v = (torch.randn(3, H, S, D) for _ in range(3))
    am = torch.ones(3, S, dtype=torch.long)
    am[1, 5:] = 0
    am[2, :5] = 0
    check(Attention("causal"), (q, k, v, am), counts(causal_kernel_padded=1))
    check(Attention("sliding_window"), (q, k, v, am), counts(sliding_window_kernel_padded=1))


@pytest.mark.parametrize("padding_kind,variant", [(None, "sliding_window_kernel"), ("right", "sliding_window_kernel_padded")])
def test_gqa_reads_grouped_kv(padding_kind, variant):
    """repeat_kv copies of 1 kv head for 2 query heads: the op reads the grouped K/V."""
    module = Attention("sliding_window", repeat_kv="hf")
    args = inputs(padding_kind, kv_heads=1)
    gm, out, record = fused_graph(module.eval(), *args, fusions=ATTENTION)
    assert record.matches == counts(**{variant: 1})
    (call,) = [n for n in gm.graph.nodes if n.target is FLASH]
    assert [a.op for a in call.args[1:3]] == ["placeholder", "placeholder"]
    assert not [n for n in gm.graph.nodes if n.target in ("expand", "reshape")]
    torch.testing.assert_close(out, module(*args), rtol=1e-5, atol=1e-5)
    check(module, args, counts(**{variant: 1}), train=True)


def test_window_size_from_the_mask():
    """The op gets the window the mask encodes (3) and top-left alignment; the mask is gone."""
    gm, _, record = fused_graph(Attention("sliding_window").eval(), *inputs(), fusions=ATTENTION)
    (call,) = [n for n in gm.graph.nodes if n.target is FLASH]
    o = call.kwargs
    assert (o["key_padding"], o["key_bias"], o["causal"], o["window"], o["align_bottom_right"], o["dropout_p"],
            o["seed"]) == (None, None, True, 3, False, 0.0, None)
    assert o["scale"] == pytest.approx(D**-0.5)
    assert not [n for n in gm.graph.nodes if n.target == "expand"]  # the mask is gone


def test_head_dim_guard():
    module = Attention("sliding_window").eval()
    args = (torch.randn(B, H, S, 16), torch.randn(B, H, S, 16), torch.randn(B, H, S, 16))
    _, _, record = fused_graph(module, *args, fusions=ATTENTION)
    assert record.matches == {}
    ((_, _, reason),) = record.near_misses
    assert reason.startswith("kernel_head_dim: head dim 16 not in the kernel's")


PADDING_ROUTES = [("causal", "CAUSAL_PADDING", "causal_kernel_padded", "causal key padding"),
                  ("bidirectional", "PADDING", "none_kernel_padded", "key padding")]


@pytest.mark.parametrize("padding_kind", ["ones", "right", "left"])
@pytest.mark.parametrize("fn,setting,variant,_", PADDING_ROUTES, ids=[r[0] for r in PADDING_ROUTES])
def test_padding_by_default(monkeypatch, fn, setting, variant, _, padding_kind):
    # attention_causal_padding and attention_padding (on by default) without attention_kernel:
    # causal and all-true masks AND run-time key padding over square scores; left padding leaves
    # causal query rows that see no key; each setting turns its route off
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL")
    check(Attention(fn, layers=2), inputs(padding_kind), counts(**{variant: 2}), train=True)
    monkeypatch.setenv(f"FUSIONPASS_ATTENTION_{setting}", "0")
    _, _, record = fused_graph(Attention(fn).eval(), *inputs(padding_kind), fusions=ATTENTION)
    assert record.matches == {}


@pytest.mark.parametrize("fn,_,__,what", PADDING_ROUTES, ids=[r[0] for r in PADDING_ROUTES])
def test_padding_over_more_keys_than_queries_is_opt_in(monkeypatch, fn, _, __, what):
    # 4 queries over 8 keys with key padding (what a cache gives): only with attention_kernel
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL")
    module = Attention(fn).eval()
    q = torch.randn(B, H, 4, D)
    k, v = torch.randn(B, H, 8, D), torch.randn(B, H, 8, D)
    args = (q, k, v, attention_mask("right", batch=B, length=8))
    _, out, record = fused_graph(module, *args, fusions=ATTENTION)
    assert record.matches == {}
    first = [(f, why.split(":")[0]) for f, _, why in record.near_misses][:1]
    assert first == [("flash_attention", "square_by_default")]
    assert f"{what} with 4 queries over 8 keys (a cache)" in record.near_misses[0][2]
    torch.testing.assert_close(out, module(*args))


@pytest.mark.parametrize("fn,head_dim,dropout,train,why", [
    ("bidirectional", 128, 0.0, False, "cost: head dim of an all-true mask with key padding 128 outside 64..64"),
    ("bidirectional", 64, 0.1, True,
     "cost: attention dropout (%, rounded up) of an all-true mask with key padding 10 outside 0..0"),
    ("bidirectional", 64, 0.001, True,
     "cost: attention dropout (%, rounded up) of an all-true mask with key padding 1 outside 0..0"),
    ("causal", 256, 0.0, True, "cost: head dim of a causal mask with key padding 256 > 128"),
], ids=["head_dim_128", "dropout_0.1", "dropout_0.001", "causal_head_dim_256"])
def test_padding_cost_rules(monkeypatch, fn, head_dim, dropout, train, why):
    # attention_padding by default only where an all-ones batch measured faster too (head dim 64,
    # no attention dropout), attention_causal_padding only up to head dim 128: elsewhere a near
    # miss naming the rule; attention_kernel takes it anyway
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL")
    module = Attention(fn, dropout=dropout).train(train)
    q, k, v = (torch.randn(B, H, S, head_dim, requires_grad=train) for _ in range(3))
    args = (q, k, v, attention_mask("right", batch=B, length=S))
    _, _, record = fused_graph(module, *args, fusions=ATTENTION)
    assert record.matches == {}
    (reason,) = [why for fusion, _, why in record.near_misses if fusion == "flash_attention"]
    assert reason.startswith(why), reason
    assert reason.endswith("attention_kernel=True / FUSIONPASS_ATTENTION_KERNEL=1 selects it anyway")
    monkeypatch.setenv("FUSIONPASS_ATTENTION_KERNEL", "1")
    _, _, record = fused_graph(module, *args, fusions=ATTENTION)
    assert record.matches == counts(**{f"{'none' if fn == 'bidirectional' else 'causal'}_kernel_padded": 1})


def test_causal_padding_cost_rule_keeps_head_dim_128(monkeypatch):
    # the causal rule's bound is inclusive: head dim 128 stays on the kernel by default
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL")
    module = Attention("causal").eval()
    q, k, v = (torch.randn(B, H, S, 128) for _ in range(3))
    _, _, record = fused_graph(module, q, k, v, attention_mask("right", batch=B, length=S), fusions=ATTENTION)
    assert record.matches == counts(causal_kernel_padded=1)


@pytest.mark.parametrize("padding_kind", [None, "right", "left"])
def test_sliding_window_by_default(monkeypatch, padding_kind):
    # attention_sliding_window (on by default) without attention_kernel: proven windows over square
    # scores, with or without run-time key padding; attention_sliding_window=False names itself
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL")
    variant = "sliding_window_kernel_padded" if padding_kind else "sliding_window_kernel"
    check(Attention("sliding_window", layers=2), inputs(padding_kind), counts(**{variant: 2}), train=True)
    monkeypatch.setenv("FUSIONPASS_ATTENTION_SLIDING_WINDOW", "0")
    _, _, record = fused_graph(Attention("sliding_window").eval(), *inputs(padding_kind), fusions=ATTENTION)
    assert record.matches == {}
    ((_, _, reason),) = record.near_misses
    assert reason.endswith("sliding-window route is off (attention_sliding_window=False)")


@pytest.mark.parametrize("padding_kind", [None, "left"])
def test_bidirectional_band_by_default(monkeypatch, padding_kind):
    # ModernBERT's |q - kv| <= 2 is the window 5 on the diagonal moved by 2: the sliding-window
    # route takes it (the kernel's `diagonal`), by default, over square scores
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL")
    variant = "sliding_window_kernel_padded" if padding_kind else "sliding_window_kernel"
    check(Attention("band", layers=2), inputs(padding_kind), counts(**{variant: 2}), train=True)
    gm, _, record = fused_graph(Attention("band").eval(), *inputs(padding_kind), fusions=ATTENTION)
    (call,) = [n for n in gm.graph.nodes if n.target is FLASH]
    assert (call.kwargs["causal"], call.kwargs["window"], call.kwargs["diagonal"],
            call.kwargs["align_bottom_right"]) == (True, 5, 2, False)


def test_sliding_window_over_more_keys_than_queries_is_opt_in(monkeypatch):
    # 4 queries over 8 keys (what a cache gives): only with attention_kernel
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL")
    module = Attention("sliding_window", q_offset=4).eval()
    args = (torch.randn(B, H, 4, D), torch.randn(B, H, 8, D), torch.randn(B, H, 8, D))
    _, out, record = fused_graph(module, *args, fusions=ATTENTION)
    assert record.matches == {}
    first = [(f, why.split(":")[0]) for f, _, why in record.near_misses][:1]
    assert first == [("flash_attention", "square_by_default")]
    assert "a sliding window with 4 queries over 8 keys (a cache)" in record.near_misses[0][2]
    torch.testing.assert_close(out, module(*args))


# ---------------------------------------------------------------------------------------------
# tiny HF Mistral, sliding_window 4 < sequence 8, head dim 64


def _mistral():
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, vocab_size=128, pad_token_id=0, bos_token_id=0,
        eos_token_id=0, attention_dropout=0.0, sliding_window=4,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config)


@pytest.mark.parametrize("train,mask", [(True, None), (False, "left")])
def test_hf_mistral_sliding_window(train, mask):
    model = _mistral().train(train)
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (B, S))
    kwargs = {"use_cache": False}
    if mask is not None:
        kwargs["attention_mask"] = attention_mask(mask, batch=B, length=S)
    if train:
        kwargs["labels"] = ids
    got, stats = compile_and_count(model, ids, fusions=ATTENTION, train=train, kwargs=kwargs)
    assert near_misses() == []
    variant = "sliding_window_kernel_padded" if mask else "sliding_window_kernel"
    assert stats == counts(**{variant: 2})
    with compiling():  # the reference: plain torch.compile
        want = run(torch.compile(model, backend="inductor", fullgraph=True), model, (ids,), train, kwargs=kwargs)
        assert fusionpass.stats() == {}
    assert_outcomes_close(got, want, rtol=1e-4)


def _kernel_match(dtype, device):
    """A kernel-route Match whose q/k/v nodes carry fake tensors of `dtype` on `device` (a CUDA
    device needs no GPU as a fake tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fusionpass.registry import Match

    graph = torch.fx.Graph()
    with FakeTensorMode(allow_non_fake_inputs=True):
        nodes = []
        for name in ("q", "k", "v"):
            node = graph.placeholder(name)
            node.meta["example_value"] = torch.empty(B, H, S, D, dtype=dtype, device=device)
            nodes.append(node)
    q, k, v = nodes
    return Match("eager_kernel", q, [], {"route": "kernel", "args": {"query": q}, "key": k, "value": v})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp32_stays_out_of_the_kernel_on_cuda_only(dtype, device):
    from fusionpass.patterns.attention_kernel import kernel_dtypes

    why = kernel_dtypes(_kernel_match(dtype, device), fusionpass.Config())
    if dtype == torch.float32 and device == "cuda":
        assert why is not None and why.startswith("fp32 q/k/v") and "benchmarks/results/" in why
    else:
        assert why is None
