"""Conformance cases of rope, swiglu_mlp and linear_cross_entropy.

Each fusion gets a matrix: every dtype it claims (fp32, fp16, bf16) x three shapes with odd sizes
(sequence lengths, rows and vocabularies that are no multiple of a block) x training and
inference. The model forms a fusion knows are dealt out over the matrix's slots in turn, so that
every form appears (in both training and inference) and every registered variant matches; a few
extra cases cover the cost rules' edges (decode-sized rotations, the 64-row decode limit of the
MLP, an LLM-sized vocabulary at the default cost rule).

The modules are written the way transformers 5.x writes these subgraphs: cos/sin computed from
position ids inside the module (so they never require grad), q/k as views of projection outputs,
gated MLPs holding their activation module, losses through ForCausalLMLoss's `.float()`/pad/shift.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from fusionpass.conformance import DTYPES, Case, dtype_name

FP32, FP16, BF16 = DTYPES["fp32"], DTYPES["fp16"], DTYPES["bf16"]
ALL_DTYPES = (FP32, FP16, BF16)


def _case(fusion, variant, form, dtype, shape, train, make, expect, config=None):
    mode = "train" if train else "infer"
    return Case(
        name=f"{fusion}/{variant}/{form}/{dtype_name(dtype)}/{shape}/{mode}",
        fusion=fusion, variant=variant, make=make, dtype=dtype, train=train,
        expect=expect, config=config or {},
    )


def _positions(batch, length, start):
    return (torch.arange(length) + start).repeat(batch, 1)


def _maker(build, *args):
    """Case.make from `build(*args) -> (module, inputs)`, built on the CPU (the same draws on every
    device) in fp32, then moved: the module and floating inputs to the case's dtype, integer
    inputs (positions, labels) as they are."""

    def make(dtype, device):
        module, inputs = build(*args)
        moved = tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in inputs)
        return module.to(device, dtype), moved

    return make


# =============================================================================================
# rope


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
            cases.append(_case("rope", variant, form, dtype, _rope_shape_name(shape), train,
                               _maker(ROPE_FORMS[form][0], shape), {"rope": n}))
    # decode steps (one position, far into the sequence): under rope_min_tokens, so only with
    # rope_kernel=True (by default Inductor keeps them to fuse the k rotation with the cache write)
    for form, dtype, shape in (("llama_gqa", BF16, (3, 1, 8, 2, 64, 517)),
                               ("gptj_full", FP16, (2, 1, 4, 4, 96, 300))):
        _, variant, n = ROPE_FORMS[form]
        cases.append(_case("rope", variant, form, dtype, _rope_shape_name(shape), False,
                           _maker(ROPE_FORMS[form][0], shape), {"rope": n}, {"rope_kernel": True}))
    # the one form the rotation above does not deal out (kept out of it so that its cases stay as
    # they are): partial interleaved rotary of one tensor, in both modes
    shape = (2, 67, 8, 8, 64, 0)
    for train in (True, False):
        cases.append(_case("rope", "interleaved_partial_single", "gptj_keys_partial", BF16, _rope_shape_name(shape),
                           train, _maker(_rope_gptj_keys_partial, shape), {"rope": 1}))
    return cases


# =============================================================================================
# swiglu_mlp


class GatedMLP(nn.Module):
    """HF Llama/Mistral/Qwen2 (SiLU; Llama's mlp_bias for biases) and Gemma (GELU-tanh):
    down_proj(act_fn(gate_proj(x)) * up_proj(x))."""

    def __init__(self, hidden, inter, act, bias=False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class GateUpMLP(nn.Module):
    """HF Phi-3: one gate_up_proj, chunked, `up_states * act(gate)`."""

    def __init__(self, hidden, inter, act, bias=False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.activation_fn = act

    def forward(self, hidden_states):
        up_states = self.gate_up_proj(hidden_states)
        gate, up_states = up_states.chunk(2, dim=-1)
        up_states = up_states * self.activation_fn(gate)
        return self.down_proj(up_states)


def _silu():
    return nn.SiLU()


def _gelu_tanh():  # Gemma's gelu_pytorch_tanh
    return nn.GELU(approximate="tanh")


# form -> (module class, activation, bias, the variant it matches)
SWIGLU_FORMS = {
    "llama": (GatedMLP, _silu, False, "silu"),
    "gemma": (GatedMLP, _gelu_tanh, False, "gelu_tanh"),
    "phi3_gate_up": (GateUpMLP, _silu, False, "silu_gate_up"),
    # Phi-3's fused projection with Gemma's activation and biases: the gelu_tanh_gate_up route
    "gate_up_gelu_bias": (GateUpMLP, _gelu_tanh, True, "gelu_tanh_gate_up"),
    "llama_mlp_bias": (GatedMLP, _silu, True, "silu"),
}
# (batch, seq, hidden, intermediate): a decode step of 3 sequences (the decode kernel, selected
# by default), and prefills of 134 and 389 rows (library GEMMs + the act*mul kernel; selected
# with swiglu_mlp_kernel=True), odd widths throughout.
SWIGLU_SHAPES = ((3, 1, 203, 517), (2, 67, 384, 1031), (1, 389, 515, 1377))
DECODE_MAX_ROWS = 64  # fusionpass.fusions.swiglu_mlp.kernels.DECODE_MAX_M: the default cost rule's limit


def _swiglu_build(form, shape):
    cls, act, bias, _ = SWIGLU_FORMS[form]
    b, s, hidden, inter = shape
    return cls(hidden, inter, act(), bias), (torch.randn(b, s, hidden),)


def _swiglu_case(form, dtype, shape, train):
    variant = SWIGLU_FORMS[form][3]
    b, s, hidden, inter = shape
    # the default cost rule selects decode-sized inference only; the rest is opened
    decode = not train and b * s <= DECODE_MAX_ROWS
    # training without the down projection in the op (the default recomputes h: the cases below)
    config = None if decode else {"swiglu_mlp_kernel": True, "swiglu_mlp_recompute_product": False}
    return _case("swiglu_mlp", variant, form, dtype, f"b{b}-s{s}-k{hidden}-n{inter}", train,
                 _maker(_swiglu_build, form, shape), {"swiglu_mlp": 1}, config)


def _rotating(forms, shapes, case) -> list[Case]:
    """case(form, dtype, shape, train) for every dtype and shape, training and inference, the forms
    taken in turn (each form at several dtypes and shapes without the full product)."""
    cycle = itertools.cycle(forms)
    return [case(form, dtype, shape, train)
            for dtype, shape in itertools.product(ALL_DTYPES, shapes)
            for form in (next(cycle),) for train in (True, False)]


def _swiglu_cases():
    cases = _rotating(SWIGLU_FORMS, SWIGLU_SHAPES, _swiglu_case)
    # every form at the default cost rule at least once, and both sides of the 64-row limit:
    # one row (a single sequence decoding), exactly 64 rows, and 65 rows (the prefill regime)
    cases += [
        _swiglu_case("phi3_gate_up", FP32, (1, 1, 203, 517), False),
        _swiglu_case("llama_mlp_bias", BF16, (4, 16, 384, 1031), False),
        _swiglu_case("gemma", FP16, (5, 13, 384, 1031), False),
    ]
    # training at the default: the down projection in the op (swiglu_mlp_recompute_product),
    # every form, the dtypes in turn, at both prefill shapes
    dtypes = itertools.cycle(ALL_DTYPES)
    cases += [_swiglu_recompute_case(form, next(dtypes), shape)
              for form in SWIGLU_FORMS for shape in SWIGLU_SHAPES[1:]]
    # training on one row: the act·mul kernels get rows == 1, which Triton specializes into a plain
    # int (their CUDA build once failed there while the interpreter ran it)
    cases += [_swiglu_case("phi3_gate_up", FP32, (1, 1, 203, 517), True),
              _swiglu_recompute_case("llama", BF16, (1, 1, 203, 517))]
    return cases


def _swiglu_recompute_case(form, dtype, shape):
    variant = SWIGLU_FORMS[form][3]
    b, s, hidden, inter = shape
    return _case("swiglu_mlp", variant, f"{form}+recompute_product", dtype,
                 f"b{b}-s{s}-k{hidden}-n{inter}", True, _maker(_swiglu_build, form, shape),
                 {"swiglu_mlp": 1}, None)


# =============================================================================================
# linear_cross_entropy


def _fixed_cross_entropy(source, target, num_items_in_batch=None, ignore_index=-100):
    """transformers 5.x loss_utils.fixed_cross_entropy: mean, or sum / num_items_in_batch (the
    Trainer's gradient-accumulation form)."""
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(source, target, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch.to(loss.device)
    return loss


def _causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100):
    """transformers 5.x ForCausalLMLoss: upcast, pad the labels with one ignored position, shift."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    return _fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index)


class CausalLMHead(nn.Module):
    """HF *ForCausalLM: `logits = lm_head(hidden_states[:, slice_indices, :])`, Gemma-2's
    final_logit_softcapping when set, then ForCausalLMLoss. Training returns the loss only: the
    fused op's logits are non-differentiable (fusions/linear_cross_entropy/pattern.py), and a gradient through
    them is not what training computes; inference returns (loss, logits) as the model does."""

    def __init__(self, hidden, vocab, softcap=None):
        super().__init__()
        self.vocab, self.softcap = vocab, softcap
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden_states, labels, num_items_in_batch=None):
        logits = self.lm_head(hidden_states[:, slice(0, None), :])
        if self.softcap is not None:
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        loss = _causal_lm_loss(logits, labels, self.vocab, num_items_in_batch)
        return (loss, logits) if not self.training else loss


class ShiftLogitsHead(nn.Module):
    """Older HF causal LMs (GPT-2/GPT-NeoX before the loss refactor): shift the logits against
    labels[..., 1:], CrossEntropyLoss on the model-dtype scores."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.vocab = vocab
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden_states, labels):
        lm_logits = self.lm_head(hidden_states)
        shift_logits = lm_logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = nn.CrossEntropyLoss()(shift_logits.view(-1, self.vocab), shift_labels.view(-1))
        return (loss, lm_logits) if not self.training else loss


class TiedMatmulHead(nn.Module):
    """Plain training code with tied embeddings: `h @ embedding.weight.T`, label smoothing."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, h, labels):
        logits = h.reshape(-1, h.shape[-1]) @ self.embed.weight.T
        return F.cross_entropy(logits, labels.reshape(-1), label_smoothing=0.1)


class MaskedLMHead(nn.Module):
    """BERT's MLM loss: CrossEntropyLoss on the model-dtype scores of a biased decoder."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.vocab = vocab
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, sequence_output, labels):
        prediction_scores = self.decoder(sequence_output)
        loss = nn.CrossEntropyLoss()(prediction_scores.view(-1, self.vocab), labels.view(-1))
        return (loss, prediction_scores) if not self.training else loss


def _causal_labels(b, s, vocab):
    """Next-token labels: a prompt of -100 on the first sequence, right padding (-100) on the last."""
    labels = torch.randint(0, vocab, (b, s))
    labels[0, : s // 3] = -100
    labels[-1, s - 5 :] = -100
    return labels


def _mlm_labels(b, s, vocab):
    """About 15% of the positions carry a label, the rest -100."""
    labels = torch.randint(0, vocab, (b, s))
    return torch.where(torch.rand(b, s) < 0.15, labels, -100)


def _trained_scale(weight):
    """Logits of standard deviation 2 for unit hidden states (a trained LM's spread, not the
    near-uniform softmax of nn.Linear's init): peaked rows, and soft-cap tails that bend."""
    nn.init.normal_(weight, std=2.0 * weight.shape[1] ** -0.5)


def _ce_hf(shape, num_items=False, softcap=None):
    b, s, hidden, vocab = shape
    head = CausalLMHead(hidden, vocab, softcap)
    _trained_scale(head.lm_head.weight)
    labels = _causal_labels(b, s, vocab)
    inputs = (torch.randn(b, s, hidden), labels)
    if num_items:  # what the Trainer passes: the number of labelled tokens after the shift
        inputs += (torch.tensor(int((labels[:, 1:] != -100).sum())),)
    return head, inputs


def _ce_shift(shape):
    b, s, hidden, vocab = shape
    head = ShiftLogitsHead(hidden, vocab)
    _trained_scale(head.lm_head.weight)
    return head, (torch.randn(b, s, hidden), _causal_labels(b, s, vocab))


def _ce_matmul(shape):
    b, s, hidden, vocab = shape
    head = TiedMatmulHead(hidden, vocab)
    _trained_scale(head.embed.weight)
    return head, (torch.randn(b, s, hidden), _causal_labels(b, s, vocab))


def _ce_mlm(shape):
    b, s, hidden, vocab = shape
    head = MaskedLMHead(hidden, vocab)
    _trained_scale(head.decoder.weight)
    return head, (torch.randn(b, s, hidden), _mlm_labels(b, s, vocab))


# form -> (builder, the variant it matches). Dealt out in this order, the first three land on
# fp32 and bf16, the last three on fp16: label smoothing stays off fp16, where torch's own loss
# overflows (the smoothing term sums log-probabilities over the vocabulary in fp16: inf, eager and
# compiled), which would leave the case nothing to compare against.
CE_FORMS = {
    "hf_causal_mean": (_ce_hf, "float_logits"),
    "gemma2_softcap": (lambda shape: _ce_hf(shape, softcap=5.0), "softcap"),
    "tied_matmul_smoothing": (_ce_matmul, "matmul"),
    "shift_logits": (_ce_shift, "shift_logits"),
    "hf_causal_num_items": (lambda shape: _ce_hf(shape, num_items=True), "float_logits"),
    "bert_mlm": (_ce_mlm, "model_dtype_logits"),  # BERT-style fp16 training: a model-dtype loss
}
# (batch, seq, hidden, vocab): odd token counts and vocabularies; logits of at most ~4.3M
# entries. The soft-cap (5.0, Gemma-2 has 30 for larger logits) is within the logits' tails, so
# that the tanh bends them.
CE_SHAPES = ((2, 37, 64, 5003), (1, 131, 96, 12347), (2, 67, 80, 32001))
CE_MIN_VOCAB = {"linear_cross_entropy_min_vocab": 5000}  # the default (100000) is LLM-sized


def _ce_case(form, dtype, shape, train, config=CE_MIN_VOCAB):
    b, s, hidden, vocab = shape
    return _case("linear_cross_entropy", CE_FORMS[form][1], form, dtype, f"b{b}-s{s}-d{hidden}-v{vocab}",
                 train, _maker(CE_FORMS[form][0], shape), {"linear_cross_entropy": 1}, config)


def _ce_cases():
    cases = _rotating(CE_FORMS, CE_SHAPES, _ce_case)
    # an LLM-sized vocabulary at the default cost rule (min vocab 100000)
    cases.append(_ce_case("hf_causal_mean", BF16, (2, 19, 48, 100003), True, config={}))
    return cases


CASES = _rope_cases() + _swiglu_cases() + _ce_cases()
