"""rope: the rotary embeddings model families write are matched (opted in), q and k sharing cos/sin
become one fusionpass::rope call, and the compiled module computes what the eager one computes,
forward and q/k gradients; what must not be matched is left alone with a near-miss reason.

The modules below are written the way transformers 5.x writes them: HF `apply_rotary_pos_emb` with
`rotate_half` and `cos.unsqueeze(1)` (Llama, GQA), GPT-NeoX/Phi-3 partial rotary (slice, rotate,
cat the pass-through back), GPT-J's interleaved `rotate_every_two` on [B, S, H, D] with
`repeat_interleave`d cos/sin. cos/sin are buffers (no gradient), as the models compute them.
"""
from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_outcomes_close,
    compile_and_count,
    eager,
    fused_graph,
    near_misses,
)
from torch import nn

FUSION = "rope"
FP32, BF16 = torch.float32, torch.bfloat16
B, S, D = 2, 7, 16


@pytest.fixture
def opted_in(monkeypatch):
    monkeypatch.setenv("FUSIONPASS_ROPE_KERNEL", "1")


def counts(**variants):
    return {(FUSION, v): n for v, n in variants.items()}


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


def _freqs(dim, seq=S):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    return torch.outer(torch.arange(seq).float(), inv)[None]  # [1, S, dim/2]


class LlamaRope(nn.Module):
    """HF Llama/Mistral/Qwen2 `apply_rotary_pos_emb`: q [B, Hq, S, D], k [B, Hkv, S, D] (GQA),
    both transposes of [B, S, H, D] projections."""

    def __init__(self, dtype=FP32, cos_dtype=None, seq=S):
        super().__init__()
        emb = torch.cat((_freqs(D, seq), _freqs(D, seq)), -1)
        self.register_buffer("cos", emb.cos().to(cos_dtype or dtype))
        self.register_buffer("sin", emb.sin().to(cos_dtype or dtype))

    def forward(self, q, k):
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed


class NeoXRope(nn.Module):
    """HF GPT-NeoX (rotary_pct=0.25) / Phi-3 (partial_rotary_factor): q, k chunks of one fused qkv
    projection, the first rotary_dim channels rotated, the rest concatenated back."""

    rotary_dim = D // 4

    def __init__(self):
        super().__init__()
        emb = torch.cat((_freqs(self.rotary_dim),) * 2, -1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())

    def forward(self, qkv):
        q, k, _ = qkv.view(B, S, 4, 3 * D).transpose(1, 2).chunk(3, dim=-1)
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        r = self.rotary_dim
        q_rot, q_pass = q[..., :r], q[..., r:]
        k_rot, k_pass = k[..., :r], k[..., r:]
        q_embed = (q_rot * cos) + (rotate_half(q_rot) * sin)
        k_embed = (k_rot * cos) + (rotate_half(k_rot) * sin)
        return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


class GPTJRope(nn.Module):
    """HF GPT-J: [B, S, H, D], interleaved pairs, cos/sin repeat_interleave'd; k rotated first.
    rotary_dim=None rotates every channel."""

    def __init__(self, rotary_dim=8, seq=S):
        super().__init__()
        self.rotary_dim = rotary_dim
        dim = rotary_dim or D
        self.register_buffer("sincos", torch.cat((_freqs(dim, seq).sin(), _freqs(dim, seq).cos()), -1))

    def _apply(self, t, sin, cos):
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        return (t * cos) + (rotate_every_two(t) * sin)

    def forward(self, q, k):
        sin, cos = torch.split(self.sincos, self.sincos.shape[-1] // 2, dim=-1)
        r = self.rotary_dim
        if r is None:
            return self._apply(q, sin, cos), self._apply(k, sin, cos)
        k_rot, k_pass = k[:, :, :, :r], k[:, :, :, r:]
        q_rot, q_pass = q[:, :, :, :r], q[:, :, :, r:]
        k_rot = self._apply(k_rot, sin, cos)
        q_rot = self._apply(q_rot, sin, cos)
        return torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1)


class QueryOnlyRope(LlamaRope):
    """Only q rotated (k taken as is): one single-tensor call."""

    def forward(self, q, k):
        q = q.transpose(1, 2)
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * 2


class GptOssRope(nn.Module):
    """HF gpt-oss: cos/sin [1, S, D/2], q and k chunked into halves, cat(x1 cos - x2 sin,
    x2 cos + x1 sin). `swapped`: the second half written x1 cos + x2 sin (not a rotation)."""

    def __init__(self, swapped=False):
        super().__init__()
        self.swapped = swapped
        self.register_buffer("cos", _freqs(D).cos())
        self.register_buffer("sin", _freqs(D).sin())

    def _rotate(self, x, cos, sin):
        x1, x2 = torch.chunk(x, 2, dim=-1)
        second = x1 * cos + x2 * sin if self.swapped else x2 * cos + x1 * sin
        return torch.cat((x1 * cos - x2 * sin, second), dim=-1)

    def forward(self, q, k):
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def _qk(dtype=FP32, hq=4, hkv=2, seq=S):
    return torch.randn(B, seq, hq, D).to(dtype), torch.randn(B, seq, hkv, D).to(dtype)


CASES = {
    "llama": (LlamaRope, lambda: _qk(), counts(rotate_half=1)),
    "neox_partial": (NeoXRope, lambda: (torch.randn(B, S, 12 * D),), counts(rotate_half_partial=1)),
    "gptj_partial": (GPTJRope, lambda: _qk(hkv=4), counts(interleaved_partial=1)),
    "gptj_full": (lambda: GPTJRope(None), lambda: _qk(hkv=4), counts(interleaved=1)),
    "query_only": (QueryOnlyRope, lambda: _qk(), counts(rotate_half_single=1)),
    "gpt_oss_halves": (GptOssRope, lambda: _qk(), counts(halves=1)),
}


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", list(CASES))
def test_forms_match_and_agree(case, train, opted_in):
    make, inputs, expected = CASES[case]
    module, args = make(), inputs()
    got, stats = compile_and_count(module, *args, fusions=[FUSION], train=train)
    assert stats == expected
    assert_outcomes_close(got, eager(module, *args, train=train))


def test_bf16_llama(opted_in):
    module, args = LlamaRope(BF16), _qk(BF16)
    got, stats = compile_and_count(module, *args, fusions=[FUSION], train=True)
    assert stats == counts(rotate_half=1)
    assert_outcomes_close(got, eager(module, *args, train=True), dtype=BF16)


def test_dynamic_sequence(opted_in):
    module, (q, k) = LlamaRope(), _qk()
    for t in (q, k):
        torch._dynamo.mark_dynamic(t, 0)
    got, stats = compile_and_count(module, q, k, fusions=[FUSION])
    assert stats == counts(rotate_half=1)
    assert_outcomes_close(got, eager(module, q, k))


class LlamaRopeOfInputs(nn.Module):
    """LlamaRope with cos/sin as inputs [1, S, D], as HF models pass `position_embeddings`."""

    def forward(self, q, k, cos, sin):
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


@pytest.mark.parametrize("seq, selected", [(64, True), (7, False)])
def test_cost_rule_under_dynamic_shapes(seq, selected, monkeypatch):
    # a symbolic sequence length (range 2.. with no upper bound) straddles the rule's 64 positions:
    # the rule decides at the size hint, as with a static length of that size
    monkeypatch.delenv("FUSIONPASS_ROPE_KERNEL", raising=False)
    emb = torch.cat((_freqs(D, seq), _freqs(D, seq)), -1)
    inputs = (*_qk(seq=seq), emb.cos(), emb.sin())
    for t in inputs:
        torch._dynamo.mark_dynamic(t, 1)
    module = LlamaRopeOfInputs()
    got, stats = compile_and_count(module, *inputs, fusions=[FUSION])
    if selected:
        assert stats == counts(rotate_half=1)
        assert_outcomes_close(got, eager(module, *inputs))
    else:
        assert stats == {} and near_misses("cost: positions 7 < 64 (at the size hint; symbolic, 2..)")


def test_graph_has_one_call(opted_in):
    gm, _, record = fused_graph(LlamaRope(), *_qk(), fusions=[FUSION])
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.fusionpass.rope.default]
    assert len(calls) == 1 and calls[0].kwargs == {"form": "rotate_half", "rotary_dim": D}
    assert not any(n.target is torch.cat for n in gm.graph.nodes)
    assert record.matches == counts(rotate_half=1)


# ---------------------------------------------------------------------------------------------
# near misses


def test_cost_rule(monkeypatch):
    # by default: at least 64 positions and at most 96 MiB of q and k (fusions/rope/pattern.py POSITIONS, SIZE)
    monkeypatch.delenv("FUSIONPASS_ROPE_KERNEL", raising=False)
    _, stats = compile_and_count(LlamaRope(), *_qk(), fusions=[FUSION])
    assert stats == {} and near_misses("cost: positions 7 < 64")
    module, args = LlamaRope(seq=64), _qk(seq=64)
    got, stats = compile_and_count(module, *args, fusions=[FUSION])
    assert stats == counts(rotate_half=1)
    assert_outcomes_close(got, eager(module, *args))
    # q and k here: 2 * 64 * (4 + 2) * 16 fp32 = 48 KiB
    _, stats = compile_and_count(module, *args, fusions=[FUSION], rope_max_bytes=32 * 2**10)
    assert stats == {} and near_misses("cost: q and k 0.0469 MiB > 0.0312 MiB")
    # the interleaved form with every channel rotated has a limit of its own (48 MiB by default)
    module, args = GPTJRope(None, seq=64), _qk(hkv=4, seq=64)
    _, stats = compile_and_count(module, *args, fusions=[FUSION])
    assert stats == counts(interleaved=1)
    _, stats = compile_and_count(module, *args, fusions=[FUSION], rope_interleaved_max_bytes=16 * 2**10)
    assert stats == {} and near_misses("cost: q and k (interleaved, every channel rotated) 0.0625 MiB > 0.0156 MiB")
    _, stats = compile_and_count(GPTJRope(seq=64), *args, fusions=[FUSION], rope_interleaved_max_bytes=16 * 2**10)
    assert stats == counts(interleaved_partial=1)  # partial rotary: the general limit


def test_mixed_dtypes(opted_in):
    """bf16 q/k times fp32 cos/sin computes in fp32 and returns fp32 (a projection under autocast
    and HF's fp32 cos/sin): the op writes fp32 (q_out_dtype / k_out_dtype), and the gradients of q
    and k come back in bf16, as eager's."""
    module, args = LlamaRope(BF16, cos_dtype=FP32), _qk(BF16)
    got, stats = compile_and_count(module, *args, fusions=[FUSION], train=True)
    assert sum(stats.values()) == 1, stats
    assert all(o.dtype == FP32 for o in got.outputs)
    assert_outcomes_close(got, eager(module, *args, train=True), BF16)


class CosAsInput(nn.Module):
    def forward(self, q, cos, sin):
        return q * cos + rotate_half(q) * sin


def test_cos_sin_with_grad(opted_in):
    q = torch.randn(B, 4, S, D)
    cos, sin = torch.randn(1, 1, S, D), torch.randn(1, 1, S, D)
    module = CosAsInput()
    got, stats = compile_and_count(module, q, cos, sin, fusions=[FUSION], train=True)
    assert stats == {}
    assert near_misses("cos requires grad")
    assert_outcomes_close(got, eager(module, q, cos, sin, train=True))


class LeakyRope(LlamaRope):
    def forward(self, q, k):
        q = q.transpose(1, 2)
        cos, sin = self.cos.unsqueeze(1), self.sin.unsqueeze(1)
        rotated = rotate_half(q)
        return q * cos + rotated * sin, rotated


def test_halves_not_a_rotation_left_alone(opted_in):
    # x1 cos + x2 sin in the second half: the shape of gpt-oss's rotation, not its arithmetic
    module, args = GptOssRope(swapped=True), _qk()
    got, stats = compile_and_count(module, *args, fusions=[FUSION])
    assert stats == {}
    assert_outcomes_close(got, eager(module, *args))


def test_intermediate_used_elsewhere(opted_in):
    _, stats = compile_and_count(LeakyRope(), *_qk(), fusions=[FUSION])
    assert stats == {}
    assert near_misses("is used elsewhere")


# ---------------------------------------------------------------------------------------------
# tiny Hugging Face models: 1 layer, one call per layer (q and k together), training

transformers = pytest.importorskip("transformers")

COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}


def _hf(name):
    torch.manual_seed(0)
    if name == "llama":
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(num_key_value_heads=2, **COMMON))
        variant = "rotate_half"
    elif name == "gpt_neox":
        model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(rotary_pct=0.25, **COMMON))
        variant = "rotate_half_partial"
    elif name == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **COMMON))
        variant = "rotate_half"
    elif name == "phi3":  # partial rotary with GQA
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(
            num_key_value_heads=2, partial_rotary_factor=0.5, pad_token_id=0, **COMMON))
        variant = "rotate_half_partial"
    else:
        model = transformers.GPTJForCausalLM(transformers.GPTJConfig(
            n_embd=64, n_head=4, n_layer=1, rotary_dim=8, vocab_size=128, n_positions=64))
        variant = "interleaved_partial"
    return model.eval(), variant


@pytest.mark.parametrize("name, train", [
    *[(name, True) for name in ("llama", "qwen2", "gpt_neox", "phi3", "gptj")],
    ("qwen2", False), ("gptj", False),  # inference: the rotate_half and interleaved forms
])
def test_hf_models(name, train, opted_in):
    model, variant = _hf(name)
    ids = torch.randint(0, 128, (2, 9))
    kwargs = {"use_cache": False, "labels": ids} if train else {"use_cache": False}
    got, stats = compile_and_count(model, ids, fusions=[FUSION], train=train, kwargs=kwargs)
    assert stats == counts(**{variant: 1})
    assert [m for m in near_misses() if m[0] == FUSION] == []
    assert_outcomes_close(got, eager(model, ids, train=train, kwargs=kwargs), rtol=1e-4)
