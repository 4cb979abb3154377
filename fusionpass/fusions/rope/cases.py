"""Conformance cases of rope: a matrix of forms x dtypes x shapes x training and inference
(`fusionpass.conformance.builders`), decode-sized rotations at the cost rule's edge, and the one
form the matrix does not deal out.

The modules are written the way transformers 5.x writes the rotation: cos/sin computed from
position ids inside the module (so they never require grad), q/k as views of projection outputs.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
from torch import nn

from fusionpass.conformance.builders import ALL_DTYPES, BF16, FP16, case, maker


def _positions(batch, length, start):
    return (torch.arange(length) + start).repeat(batch, 1)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotate_every_two(x):  # GPT-J
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class RotaryEmbedding(nn.Module):
    """HF LlamaRotaryEmbedding: cos/sin [B, S, dim] from position ids, fp32 math, model dtype out."""

    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x, position_ids):
        inv_freq = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1).float()
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _heads(t, head_dim):
    """[B, S, H * D] projection output -> [B, H, S, D], as HF attention layers view it."""
    return t.view(*t.shape[:-1], -1, head_dim).transpose(1, 2)


def _partial_rotary(x, cos, sin):
    """GPT-NeoX / Phi-3 apply_rotary_pos_emb for one tensor: rotate the first cos.shape[-1]
    channels, concatenate the rest back."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat([(x_rot * cos) + (rotate_half(x_rot) * sin), x_pass], dim=-1)


class LlamaRope(nn.Module):
    """HF Llama/Mistral/Qwen2: full rotate_half rotation of q [B, Hq, S, D] and k [B, Hkv, S, D]."""

    def __init__(self, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.rotary = RotaryEmbedding(head_dim)

    def forward(self, q, k, position_ids):
        q, k = _heads(q, self.head_dim), _heads(k, self.head_dim)
        cos, sin = self.rotary(q, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed


class RepositionedRope(LlamaRope):
    """q and k at different positions (a chunk of queries after a cached prefix; the keys of the
    whole window rotated again, as caches that re-position keys do): two cos/sin, so two
    one-tensor rotations."""

    def forward(self, q, k, q_positions, k_positions):
        q, k = _heads(q, self.head_dim), _heads(k, self.head_dim)
        q_cos, q_sin = self.rotary(q, q_positions)
        k_cos, k_sin = self.rotary(k, k_positions)
        q_embed = (q * q_cos.unsqueeze(1)) + (rotate_half(q) * q_sin.unsqueeze(1))
        k_embed = (k * k_cos.unsqueeze(1)) + (rotate_half(k) * k_sin.unsqueeze(1))
        return q_embed, k_embed


class NeoXRope(nn.Module):
    """HF GPT-NeoX (rotary_pct=0.25): q, k, v chunks of one fused qkv projection [B, S, H*3*D],
    the first rotary_dim channels rotated. `query_only`: the keys come from elsewhere (a cache of
    rotated keys), only q is rotated."""

    def __init__(self, head_dim, rotary_pct=0.25, query_only=False):
        super().__init__()
        self.head_dim, self.query_only = head_dim, query_only
        self.rotary = RotaryEmbedding(int(head_dim * rotary_pct))

    def forward(self, qkv, position_ids):
        qkv = qkv.view(*qkv.shape[:-1], -1, 3 * self.head_dim).transpose(1, 2)
        q, k, _ = qkv.chunk(3, dim=-1)
        cos, sin = self.rotary(q, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.query_only:
            return _partial_rotary(q, cos, sin)
        return _partial_rotary(q, cos, sin), _partial_rotary(k, cos, sin)


class Phi3Rope(nn.Module):
    """HF Phi-3 (partial_rotary_factor=0.5, GQA): q, k sliced off one qkv projection."""

    def __init__(self, heads, kv_heads, head_dim, factor=0.5):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.rotary = RotaryEmbedding(int(head_dim * factor))

    def forward(self, qkv, position_ids):
        query_pos = self.heads * self.head_dim
        q = _heads(qkv[..., :query_pos], self.head_dim)
        k = _heads(qkv[..., query_pos : query_pos + self.kv_heads * self.head_dim], self.head_dim)
        cos, sin = self.rotary(q, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return _partial_rotary(q, cos, sin), _partial_rotary(k, cos, sin)


class GPTJRope(nn.Module):
    """HF GPT-J: q/k [B, S, H, D], sin/cos gathered from a sinusoid table by position and
    repeat_interleave'd for each tensor, k rotated first. rotary_dim None: every channel."""

    def __init__(self, head_dim, rotary_dim=None, max_positions=1024):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        dim = rotary_dim or head_dim
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        angles = torch.outer(torch.arange(max_positions).float(), inv_freq)
        self.register_buffer("embed_positions", torch.cat((angles.sin(), angles.cos()), dim=1))

    def sin_cos(self, position_ids, dtype):
        table = self.embed_positions.repeat(position_ids.shape[0], 1, 1)
        index = position_ids.unsqueeze(-1).repeat(1, 1, table.shape[-1])
        sincos = torch.gather(table, 1, index).to(dtype)
        return torch.split(sincos, sincos.shape[-1] // 2, dim=-1)

    @staticmethod
    def rotate(t, sin, cos):
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
        return (t * cos) + (rotate_every_two(t) * sin)

    def forward(self, q, k, position_ids):
        q = q.view(*q.shape[:-1], -1, self.head_dim)
        k = k.view(*k.shape[:-1], -1, self.head_dim)
        sin, cos = self.sin_cos(position_ids, k.dtype)
        r = self.rotary_dim
        if r is None:
            k, q = self.rotate(k, sin, cos), self.rotate(q, sin, cos)
        else:
            k = torch.cat([self.rotate(k[:, :, :, :r], sin, cos), k[:, :, :, r:]], dim=-1)
            q = torch.cat([self.rotate(q[:, :, :, :r], sin, cos), q[:, :, :, r:]], dim=-1)
        return q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3)


class GPTJKeyRope(GPTJRope):
    """Only the keys rotated, every channel (a cache re-positioning its keys): one tensor."""

    def forward(self, k, position_ids):
        k = k.view(*k.shape[:-1], -1, self.head_dim)
        sin, cos = self.sin_cos(position_ids, k.dtype)
        return self.rotate(k, sin, cos).permute(0, 2, 1, 3)


class GPTJKeyPartialRope(GPTJRope):
    """Only the keys rotated, partial rotary_dim (GPT-J's own form, one tensor)."""

    def forward(self, k, position_ids):
        k = k.view(*k.shape[:-1], -1, self.head_dim)
        sin, cos = self.sin_cos(position_ids, k.dtype)
        r = self.rotary_dim
        return torch.cat([self.rotate(k[:, :, :, :r], sin, cos), k[:, :, :, r:]], dim=-1).permute(0, 2, 1, 3)


class GptOssRope(nn.Module):
    """HF gpt-oss: cos/sin [B, S, D/2] (the frequencies once, not repeated), q and k chunked into
    halves and rotated as cat(x1 cos - x2 sin, x2 cos + x1 sin). `query_only`: q alone."""

    def __init__(self, head_dim, query_only=False):
        super().__init__()
        self.head_dim, self.query_only = head_dim, query_only
        self.register_buffer("inv_freq", 1.0 / 150000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    @staticmethod
    def rotate(x, cos, sin):
        first, second = torch.chunk(x, 2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    def forward(self, q, k, position_ids):
        q, k = _heads(q, self.head_dim), _heads(k, self.head_dim)
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        cos, sin = freqs.cos().to(q.dtype).unsqueeze(1), freqs.sin().to(q.dtype).unsqueeze(1)
        if self.query_only:
            return self.rotate(q, cos, sin), k
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin)


def _rope_gpt_oss(shape, query_only=False):
    b, s, hq, hkv, d, start = shape
    q, k = torch.randn(b, s, hq * d), torch.randn(b, s, hkv * d)
    return GptOssRope(d, query_only=query_only), (q, k, _positions(b, s, start))


def _rope_llama(shape):
    b, s, hq, hkv, d, start = shape
    mod = LlamaRope(d)
    x = torch.randn(b, s, hq * d), torch.randn(b, s, hkv * d)
    return mod, (*x, _positions(b, s, start))


def _rope_repositioned(shape):
    b, s, hq, hkv, d, start = shape
    past = 29  # cached prefix before the chunk of s queries
    q, k = torch.randn(b, s, hq * d), torch.randn(b, past + s, hkv * d)
    return RepositionedRope(d), (q, k, _positions(b, s, start + past), _positions(b, past + s, start))


def _rope_neox(shape, query_only=False):
    b, s, h, _, d, start = shape  # GPT-NeoX is multi-head: k has h heads
    return NeoXRope(d, query_only=query_only), (torch.randn(b, s, h * 3 * d), _positions(b, s, start))


def _rope_phi3(shape):
    b, s, hq, hkv, d, start = shape
    qkv = torch.randn(b, s, (hq + 2 * hkv) * d)
    return Phi3Rope(hq, hkv, d), (qkv, _positions(b, s, start))


def _rope_gptj(shape, partial=True):
    b, s, h, _, d, start = shape  # GPT-J is multi-head
    q, k = torch.randn(b, s, h * d), torch.randn(b, s, h * d)
    return GPTJRope(d, rotary_dim=d // 4 if partial else None), (q, k, _positions(b, s, start))


def _rope_gptj_keys(shape):
    b, s, h, _, d, start = shape
    return GPTJKeyRope(d), (torch.randn(b, s, h * d), _positions(b, s, start))


def _rope_gptj_keys_partial(shape):
    b, s, h, _, d, start = shape
    return GPTJKeyPartialRope(d, rotary_dim=d // 4), (torch.randn(b, s, h * d), _positions(b, s, start))


# form -> (builder, the variant it matches, rope matches)
ROPE_FORMS = {
    "llama_gqa": (_rope_llama, "rotate_half", 1),
    "neox_rotary_pct": (_rope_neox, "rotate_half_partial", 1),
    "gptj_rotary_dim": (_rope_gptj, "interleaved_partial", 1),
    "phi3_partial_gqa": (_rope_phi3, "rotate_half_partial", 1),
    "gptj_full": (lambda shape: _rope_gptj(shape, partial=False), "interleaved", 1),
    "repositioned_qk": (_rope_repositioned, "rotate_half_single", 2),
    "gptj_keys_only": (_rope_gptj_keys, "interleaved_single", 1),
    "neox_query_only": (lambda shape: _rope_neox(shape, query_only=True), "rotate_half_partial_single", 1),
}
# (batch, seq, q heads, kv heads, head dim, first position): odd sequence lengths, GQA 4:1 and
# 3:1 (multi-head forms use the q heads for k), head dims 64/80/128 (rotary dims 16..64); all at
# least rope_min_tokens positions and well under rope_max_bytes, so the default cost rule selects
# them.
ROPE_SHAPES = ((2, 67, 8, 2, 64, 0), (1, 131, 12, 4, 80, 0), (3, 257, 6, 2, 128, 5))


def _rope_shape_name(shape):
    b, s, hq, hkv, d, _ = shape
    return f"b{b}-s{s}-h{hq}kv{hkv}-d{d}"


def _rope_cases():
    cases = []
    forms = itertools.cycle(ROPE_FORMS)
    for dtype, shape in itertools.product(ALL_DTYPES, ROPE_SHAPES):
        form = next(forms)
        _, variant, n = ROPE_FORMS[form]
        for train in (True, False):
            cases.append(case("rope", variant, form, dtype, _rope_shape_name(shape), train,
                              maker(ROPE_FORMS[form][0], shape), {"rope": n}))
    # decode steps (one position, far into the sequence): under rope_min_tokens, so only with
    # rope_kernel=True (by default Inductor keeps them to fuse the k rotation with the cache write)
    for form, dtype, shape in (("llama_gqa", BF16, (3, 1, 8, 2, 64, 517)),
                               ("gptj_full", FP16, (2, 1, 4, 4, 96, 300))):
        _, variant, n = ROPE_FORMS[form]
        cases.append(case("rope", variant, form, dtype, _rope_shape_name(shape), False,
                          maker(ROPE_FORMS[form][0], shape), {"rope": n}, {"rope_kernel": True}))
    # batch and sequence dynamic (serving, varying lengths): the sequence length is symbolic, and the cost rule
    # decides at its hint, as with these static lengths
    for form, dtype, shape in (("llama_gqa", BF16, (2, 67, 8, 2, 64, 0)), ("gptj_rotary_dim", FP16, (1, 131, 12, 4, 80, 0))):
        _, variant, n = ROPE_FORMS[form]
        for train in (True, False):
            cases.append(dataclasses.replace(
                case("rope", variant, f"{form}_dynamic", dtype, _rope_shape_name(shape), train,
                     maker(ROPE_FORMS[form][0], shape), {"rope": n}), dynamic_dims=(0, 1)))
    # the one form the rotation above does not deal out (kept out of it so that its cases stay as
    # they are): partial interleaved rotary of one tensor, in both modes
    shape = (2, 67, 8, 8, 64, 0)
    for train in (True, False):
        cases.append(case("rope", "interleaved_partial_single", "gptj_keys_partial", BF16, _rope_shape_name(shape),
                          train, maker(_rope_gptj_keys_partial, shape), {"rope": 1}))
    # gpt-oss's rotation of halves (cos and sin half as wide as q; its head dim 64, GQA), q and k
    # together and q alone, every dtype
    shape = (2, 67, 8, 2, 64, 0)
    for (form, variant, query_only), dtype, train in itertools.product(
            (("gpt_oss_halves", "halves", False), ("gpt_oss_query_only", "halves_single", True)),
            ALL_DTYPES, (True, False)):
        cases.append(case("rope", variant, form, dtype, _rope_shape_name(shape), train,
                          maker(functools.partial(_rope_gpt_oss, query_only=query_only), shape), {"rope": 1}))
    return cases


CASES = _rope_cases()
