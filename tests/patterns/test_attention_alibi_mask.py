"""attention, ALiBi in the SDPA mask: a float mask that is a per-key bias where a proven boolean mask
is true and very negative elsewhere (Falcon's `masked_fill(alibi / sqrt(d), where(m, 0, min) < -1,
min)`, `where(m, 0, min) + bias`, `bias.masked_fill(~m, min)`) becomes fusionpass::flash_attention
with key_bias, on by default; exact counts, outputs and q/k/v gradients equal eager within fp32
tolerance, with and without left padding (rows that see no key). Biases that are not per key and
masks that cannot be proven are near misses with their reasons. Head dim 64, short sequences."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import ATTENTION, attention_key, assert_outcomes_close, compile_and_count, eager, fused_graph, near_misses
from torch import nn

from fusionpass.fusions.flash_attention import op as fa_ops
from patterns.test_attention_masks import attention_mask, causal, sdpa_mask

B, H, S, D = 2, 2, 8, 64
MIN = torch.finfo(torch.float32).min
FLASH = torch.ops.fusionpass.flash_attention.default


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    # the route is on by default: no FUSIONPASS_ATTENTION_KERNEL here
    monkeypatch.delenv("FUSIONPASS_ATTENTION_KERNEL", raising=False)
    monkeypatch.setattr(fa_ops, "CPU_BLOCKS", {"block_m": 16, "block_n": 16, "dq_block_m": 16, "dq_block_n": 16})


def alibi(length, batch=1, query_rows=1):
    """[batch, H, query_rows, L]: slope_h * j (BLOOM's / Falcon's ALiBi, per key)."""
    slopes = torch.tensor([0.25, 0.0625])[:, None, None]
    bias = slopes * torch.arange(length, dtype=torch.float32)[None, None, :]
    return bias[None].expand(batch, H, query_rows, length)


def fold(form, visible, bias):
    """The float mask a model hands SDPA: `bias` where visible, about MIN elsewhere."""
    if form == "falcon":
        additive = torch.where(visible, torch.full((), 0.0), MIN)
        return torch.masked_fill(bias / 8.0, additive < -1, MIN)
    if form == "additive":
        return torch.where(visible, torch.tensor(0.0), MIN) + bias
    if form == "additive_zeros":  # transformers 5.24's zero: torch.zeros(())
        return torch.where(visible, torch.zeros(()), MIN) + bias
    if form == "additive_ones":  # not a mask: visible scores get +1
        return torch.where(visible, torch.ones(()), MIN) + bias
    assert form == "not"
    return bias.masked_fill(~visible, MIN)


class BiasedAttention(nn.Module):
    """`layers` SDPA calls sharing one biased mask, built like transformers' sdpa_mask (causal,
    AND key padding from the tokenizer's mask when given)."""

    def __init__(self, form="falcon", layers=1, query_rows=1, dropout=0.0):
        super().__init__()
        self.form, self.layers, self.query_rows, self.dropout = form, layers, query_rows, dropout

    def forward(self, q, k, v, attention_mask=None):
        padding = None if attention_mask is None else attention_mask.to(dtype=torch.bool)
        visible = sdpa_mask(q.shape[0], q.shape[-2], k.shape[-2], causal, padding)
        mask = fold(self.form, visible, alibi(k.shape[-2], q.shape[0], self.query_rows))
        out = q
        for _ in range(self.layers):
            out = F.scaled_dot_product_attention(out, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
        return out


def qkv(kv_heads=H):
    return torch.randn(B, H, S, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)


def check(module, args, variant, count, train):
    module.train(train)
    got, stats = compile_and_count(module, *args, fusions=ATTENTION, train=train)
    assert near_misses() == []
    assert stats == {attention_key(variant): count}
    want = eager(module, *args, train=train)
    if train:
        assert sorted(got.grads) == ["input0", "input1", "input2"]
    assert_outcomes_close(got, want)


@pytest.mark.parametrize("form", ["falcon", "additive", "additive_zeros", "not"])
@pytest.mark.parametrize("train", [True, False])
def test_biased_mask_forms(form, train):
    check(BiasedAttention(form, layers=2), qkv(), "alibi_mask_kernel", 2, train)


def test_additive_mask_of_nonzero_where_visible_is_not_matched():
    # `where(m, 1, min)` adds 1 to every visible score: no per-key bias over a boolean mask
    _, _, record = fused_graph(BiasedAttention("additive_ones").eval(), *qkv(), fusions=ATTENTION)
    assert record.matches == {}


def test_left_padding_rows_that_see_no_key():
    # row 0 keeps keys 3..7: its queries 0..2 see no key, and SDPA averages every value there
    args = (*qkv(kv_heads=1), attention_mask("left"))
    check(BiasedAttention("falcon"), args, "alibi_mask_kernel_padded", 1, False)


def test_left_padding_in_training_is_a_near_miss():
    # SDPA's gradient for q and k at the rows that see no key is not reproduced by the kernel
    module = BiasedAttention("falcon").train()
    got, stats = compile_and_count(module, *qkv(kv_heads=1), attention_mask("left"), fusions=ATTENTION, train=True)
    assert stats == {}
    ((_, _, reason),) = near_misses()
    assert reason.startswith("SDPA mask with a bias and run-time key padding in training")


def test_replacement_reads_the_per_key_bias():
    """One kernel call with causal=True and the bias [B, H, L] selected from [B, H, 1, L]; the
    mask (masked_fill, where, comparison) is gone."""
    gm, out, record = fused_graph(BiasedAttention("falcon").eval(), *qkv(), fusions=ATTENTION)
    assert record.matches == {attention_key("alibi_mask_kernel"): 1}
    (call,) = [n for n in gm.graph.nodes if n.target is FLASH]
    o = call.kwargs
    assert (o["key_padding"], o["causal"], o["window"], o["align_bottom_right"], o["dropout_p"], o["seed"]) == (
        None, True, 0, False, 0.0, None)
    key_bias = o["key_bias"]
    assert tuple(key_bias.meta["example_value"].shape) == (B, H, S)
    assert not [n for n in gm.graph.nodes if n.target in (torch.masked_fill, torch.where)]


def test_bias_with_a_query_dimension_is_a_near_miss():
    # [B, H, L, L]: a bias that could differ per query row (e.g. T5's relative positions)
    _, _, record = fused_graph(BiasedAttention("falcon", query_rows=S).eval(), *qkv(), fusions=ATTENTION)
    assert record.matches == {}
    ((_, _, reason),) = record.near_misses
    assert "has a query dimension" in reason


class RunTimeMask(nn.Module):
    def forward(self, q, k, v, visible):
        mask = fold("falcon", visible, alibi(S, B))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_unprovable_mask_is_a_near_miss():
    visible = torch.ones(B, 1, S, S, dtype=torch.bool).tril()
    _, _, record = fused_graph(RunTimeMask().eval(), *qkv(), visible, fusions=ATTENTION)
    assert record.matches == {}
    ((_, _, reason),) = record.near_misses
    assert "the boolean mask under it is not provable" in reason


class GradBias(nn.Module):
    def forward(self, q, k, v, bias):
        visible = sdpa_mask(B, S, S, causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=fold("falcon", visible, bias))


def test_bias_that_needs_a_gradient_is_a_near_miss():
    bias = alibi(S, B).clone().requires_grad_(True)
    _, _, record = fused_graph(GradBias().train(), *qkv(), bias, fusions=ATTENTION)
    assert record.matches == {}
    ((_, _, reason),) = record.near_misses
    assert "requires grad" in reason
