"""Conformance cases of attention (every route), decode_attention, rope_attention and
attention_out_proj.

The attention layers are transformers 5.17's own (LlamaAttention, MistralAttention,
BertSelfAttention, GPT2Attention, BloomAttention, MptAttention, FalconAttention, GPTJAttention),
built from tiny configs. A small wrapper per family prepares what its model computes once per
forward and hands every layer: the mask from masking_utils (materialized under torch.compile),
rotary cos/sin from arange position ids, the ALiBi tensors of BLOOM, MPT and Falcon, the static KV
cache of a decode step. Each wrapper runs two layers over that one mask (x = x + attn(x)), as a
decoder loop does, so every count below is per layer times two.

Padding comes from the tokenizer's [B, L] int attention_mask: "ones" (the run-time check's fast
branch, the kernel with an all-true key padding), "right" (rows of different lengths, padded at the
end) and "left" (generate()'s layout: with a causal mask the first query rows of a padded row see
no key). SDPA's own masked call (the torch.cond branch) gets right padding only: what SDPA returns
for a query row that sees no key is SDPA's business, not ours.

Attention dropout is 0 everywhere (the kernel's keep mask cannot be reproduced by the float64
reference). Sequence lengths (77, 513, 1000, ...) are no multiple of any block; head dims are the
ones each route claims (the kernel's 64/80/96/128/256, powers of two for rope_attention, 64/128/256
for the decode kernel).
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from fusionpass.config import FUSION_NAMES
from fusionpass.conformance import DTYPES, Case, dtype_name

FP32, FP16, BF16 = DTYPES["fp32"], DTYPES["fp16"], DTYPES["bf16"]
LAYERS = 2
KERNEL = {"attention_kernel": True}  # the opt-in SDPA kernel route
NO_ROPE = {"fusions": [f for f in FUSION_NAMES if f != "rope"]}  # q's rotation stays in the graph


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    hq: int
    hkv: int
    s: int  # sequence length (a decode step: the cache length)
    d: int
    q: int = 0  # decode steps: query tokens per step

    def __str__(self):
        step = f"-q{self.q}" if self.q else ""
        return f"b{self.b}-h{self.hq}x{self.hkv}{step}-s{self.s}-d{self.d}"


def _attention_mask(kind: str | None, batch: int, length: int, device) -> torch.Tensor | None:
    """The tokenizer's [B, L] int mask; row 0 is never padded, row r loses r * L // (B + 1) tokens
    ("left_empty": left padding with the last row padded whole, a batch row with no token)."""
    if kind is None:
        return None
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    for row in range(1, batch):
        n = row * length // (batch + 1)
        if kind == "right":
            mask[row, length - n:] = 0
        elif kind in ("left", "left_empty"):
            mask[row, :n] = 0
        else:
            assert kind == "ones", kind
    if kind == "left_empty":
        mask[-1] = 0
    return mask


def _no_zero_parameters(module: nn.Module) -> nn.Module:
    # HF initializes some biases to zero (GPT-2's Conv1D); a zero parameter hides what it multiplies
    with torch.no_grad():
        for p in module.parameters():
            if not p.any():
                p.normal_(0, 0.02)
    return module


def _hidden(shape: Shape, width: int, dtype, device) -> torch.Tensor:
    # x 2.5: scores with a standard deviation of about 2 (a softmax that is not close to uniform)
    return (2.5 * torch.randn(shape.b, shape.q or shape.s, width, device=device)).to(dtype)


_MASKING = []


def _masking():
    # transformers.masking_utils, imported once outside any trace (`make` below): the import
    # statement inside a compiled forward is a graph break on torch 2.11 (transformers is a
    # _LazyModule), and the ALiBi tensor and positions computed before it reached the
    # attention as run-time inputs, so BLOOM's and GPT-J's masks were not provable on the H200
    if not _MASKING:
        from transformers import masking_utils

        _MASKING.append(masking_utils)
    return _MASKING[0]


def _positions(length: int, device, offset=0) -> torch.Tensor:
    # what LlamaModel, GPT2Model and FalconModel compute without position_ids: arange + past length
    return (torch.arange(length, device=device) + offset).unsqueeze(0)


# =============================================================================================
# the families


class Llama(nn.Module):
    """LlamaAttention layers (MistralAttention with a sliding window: `window` keys, or with
    window=True about a third of the sequence): rotary cos/sin and create_causal_mask
    (create_sliding_window_causal_mask) as LlamaModel / MistralModel call them."""

    def __init__(self, shape: Shape, impl: str, window: bool | int = False):
        super().__init__()
        import transformers
        from transformers.models.llama import modeling_llama
        from transformers.models.mistral import modeling_mistral

        config_class, family = (
            (transformers.MistralConfig, modeling_mistral) if window else (transformers.LlamaConfig, modeling_llama))
        prefix = "Mistral" if window else "Llama"
        extra = {"sliding_window": shape.s // 3 | 1 if window is True else window} if window else {}
        self.config = config_class(hidden_size=64 * shape.hq, num_attention_heads=shape.hq, num_key_value_heads=shape.hkv,
                                   head_dim=shape.d, max_position_embeddings=4096, attention_dropout=0.0, **extra)
        self.config._attn_implementation = impl
        self.rotary = getattr(family, f"{prefix}RotaryEmbedding")(self.config)
        attention = getattr(family, f"{prefix}Attention")
        self.layers = nn.ModuleList(attention(self.config, i) for i in range(LAYERS))

    def forward(self, x, attention_mask=None):
        mu = _masking()
        positions = _positions(x.shape[1], x.device)
        windowed = getattr(self.config, "sliding_window", None)
        build = mu.create_sliding_window_causal_mask if windowed else mu.create_causal_mask
        mask = build(self.config, x, attention_mask, None, position_ids=positions)
        cos_sin = self.rotary(x, positions)
        for layer in self.layers:
            x = x + layer(x, cos_sin, mask)[0]
        return x


def packed_positions(length: int, device) -> torch.Tensor:
    """[1, length] position ids of packed sequences as DataCollatorWithFlattening makes them,
    restarting at each sequence: lengths 1, a third, 1 and the rest (sequences of one token too)."""
    third = length // 3
    lengths = [1, third, 1, length - third - 2]
    return torch.cat([torch.arange(n, device=device) for n in lengths])[None]


class PackedLlama(Llama):
    """Llama layers over one row of packed sequences: position ids restarting at each sequence (a
    run-time input) and no attention_mask, so create_causal_mask adds the sequence segments of those
    ids (transformers' packed-sequence detection, always on under torch.compile)."""

    def forward(self, x, position_ids):
        mu = _masking()
        mask = mu.create_causal_mask(self.config, x, None, None, position_ids=position_ids)
        cos_sin = self.rotary(x, position_ids)
        for layer in self.layers:
            x = x + layer(x, cos_sin, mask)[0]
        return x


class DeepseekMLA(nn.Module):
    """DeepseekV3Attention layers (multi-head latent attention: q/k head dim shape.d = 128 + 64
    rotary, v head dim 128, keys and values expanded from a 64-wide latent), with its rotary
    cos/sin and create_causal_mask as DeepseekV3Model calls them."""

    def __init__(self, shape: Shape, impl: str = "sdpa"):
        super().__init__()
        import transformers
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as family

        rope = 64
        self.config = transformers.DeepseekV3Config(
            hidden_size=64 * shape.hq, num_attention_heads=shape.hq, num_key_value_heads=shape.hkv,
            kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=shape.d - rope, qk_rope_head_dim=rope,
            v_head_dim=128, max_position_embeddings=4096, attention_dropout=0.0)
        self.config._attn_implementation = impl
        self.rotary = family.DeepseekV3RotaryEmbedding(self.config)
        self.layers = nn.ModuleList(family.DeepseekV3Attention(self.config, i) for i in range(LAYERS))

    def forward(self, x, attention_mask=None):
        mu = _masking()
        positions = _positions(x.shape[1], x.device)
        mask = mu.create_causal_mask(self.config, x, attention_mask, None, position_ids=positions)
        cos_sin = self.rotary(x, positions)
        for layer in self.layers:
            x = x + layer(x, cos_sin, mask)[0]
        return x


class Bert(nn.Module):
    """BertSelfAttention layers, each followed by its output dense (BertSelfOutput without the
    LayerNorm), over create_bidirectional_mask as BertModel calls it."""

    def __init__(self, shape: Shape, impl: str = "sdpa"):
        super().__init__()
        import transformers
        from transformers.models.bert import modeling_bert

        width = shape.hq * shape.d
        self.config = transformers.BertConfig(hidden_size=width, num_attention_heads=shape.hq,
                                              intermediate_size=width, attention_probs_dropout_prob=0.0,
                                              hidden_dropout_prob=0.0)
        self.config._attn_implementation = impl
        self.layers = nn.ModuleList(modeling_bert.BertSelfAttention(self.config, layer_idx=i) for i in range(LAYERS))
        self.dense = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))
        for layer in self.layers:
            # the key bias adds one constant to every score of a query row: its gradient is zero in
            # exact arithmetic, and its relative error rounding over rounding; not compared
            layer.key.bias.requires_grad_(False)

    def forward(self, x, attention_mask=None):
        mask = _masking().create_bidirectional_mask(self.config, x, attention_mask)
        for layer, dense in zip(self.layers, self.dense):
            x = x + dense(layer(x, mask)[0])
        return x


class GPT2(nn.Module):
    """GPT2Attention layers (c_attn split into q/k/v views, Conv1D c_proj) over create_causal_mask."""

    def __init__(self, shape: Shape, impl: str = "eager"):
        super().__init__()
        import transformers
        from transformers.models.gpt2 import modeling_gpt2

        self.config = transformers.GPT2Config(n_embd=shape.hq * shape.d, n_head=shape.hq, n_positions=4096,
                                              attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        self.config._attn_implementation = impl
        self.layers = nn.ModuleList(modeling_gpt2.GPT2Attention(self.config, layer_idx=i) for i in range(LAYERS))

    def forward(self, x, attention_mask=None):
        mask = _masking().create_causal_mask(self.config, x, attention_mask, None,
                                             position_ids=_positions(x.shape[1], x.device))
        for layer in self.layers:
            x = x + layer(x, attention_mask=mask)[0]
        return x


class Bloom(nn.Module):
    """BloomAttention layers (baddbmm of the [B*H, 1, L] ALiBi tensor, bmm, _merge_heads, and its
    own dropout_add of the residual), ALiBi and mask as BloomModel builds them (from an all-ones
    attention_mask when none is given)."""

    def __init__(self, shape: Shape):
        super().__init__()
        import transformers
        from transformers.models.bloom import modeling_bloom

        self.config = transformers.BloomConfig(hidden_size=shape.hq * shape.d, n_head=shape.hq,
                                               attention_dropout=0.0, hidden_dropout=0.0)
        self.config._attn_implementation = "eager"
        self.layers = nn.ModuleList(modeling_bloom.BloomAttention(self.config, i) for i in range(LAYERS))
        self.build_alibi = modeling_bloom.build_alibi_tensor

    def forward(self, x):
        ones = torch.ones(x.shape[:2], device=x.device)
        alibi = self.build_alibi(ones, self.config.n_head, dtype=x.dtype)
        mask = _masking().create_causal_mask(self.config, x, ones, None)
        for layer in self.layers:
            x = layer(x, residual=x, alibi=alibi, attention_mask=mask)[0]
        return x


class Mpt(nn.Module):
    """MptAttention layers: (q k^T) * scale + the [H, 1, L] slice of an fp32 ALiBi tensor built for
    max_seq_len (longer than the sequence, so the slice really cuts), masked_fill with the mask cast
    to bool, softmax of .float()."""

    def __init__(self, shape: Shape):
        super().__init__()
        import transformers
        from transformers.models.mpt import modeling_mpt

        # attention dropout: MptAttentionConfig's default attn_pdrop 0
        self.config = transformers.MptConfig(d_model=shape.hq * shape.d, n_heads=shape.hq, max_seq_len=shape.s + 7)
        self.config._attn_implementation = "eager"
        self.layers = nn.ModuleList(modeling_mpt.MptAttention(self.config, i) for i in range(LAYERS))
        self.build_alibi = modeling_mpt.build_mpt_alibi_tensor

    def forward(self, x):
        alibi = self.build_alibi(self.config.n_heads, self.config.max_seq_len, device=x.device)
        mask = _masking().create_causal_mask(self.config, x, None, None).to(torch.bool)
        for layer in self.layers:
            x = x + layer(x, position_bias=alibi, attention_mask=mask)[0]
        return x


class Falcon(nn.Module):
    """FalconAttention layers with ALiBi (alibi=True): FalconModel's mask, the boolean causal mask
    (AND the attention_mask's padding) turned additive and ALiBi / sqrt(d) folded into it. SDPA
    reads that float mask; eager adds ALiBi to the scores too, then the mask."""

    def __init__(self, shape: Shape, impl: str):
        super().__init__()
        import transformers
        from transformers.models.falcon import modeling_falcon

        self.config = transformers.FalconConfig(
            hidden_size=shape.hq * shape.d, num_attention_heads=shape.hq, alibi=True,
            new_decoder_architecture=False, multi_query=shape.hkv == 1, attention_dropout=0.0, hidden_dropout=0.0)
        self.config._attn_implementation = impl
        self.layers = nn.ModuleList(modeling_falcon.FalconAttention(self.config, i) for i in range(LAYERS))
        self.build_alibi = modeling_falcon.build_alibi_tensor

    def forward(self, x, attention_mask=None):
        b, s, _ = x.shape
        heads = self.config.num_attention_heads
        tokens = attention_mask if attention_mask is not None else torch.ones(b, s, device=x.device, dtype=torch.long)
        alibi = self.build_alibi(tokens, heads, dtype=x.dtype).reshape(b, heads, 1, s)
        mask = _masking().create_causal_mask(self.config, x, attention_mask, None, allow_is_causal_skip=False)
        fill = torch.finfo(x.dtype).min
        if mask.dtype == torch.bool:
            mask = torch.where(mask, torch.full((), 0.0, device=x.device, dtype=x.dtype), fill)
        mask = torch.masked_fill(alibi / math.sqrt(self.config.hidden_size // heads), mask < -1, fill)
        positions = _positions(s, x.device)
        for layer in self.layers:
            x = x + layer(x, alibi=alibi, attention_mask=mask, position_ids=positions)[0]
        return x


class GPTJ(nn.Module):
    """GPTJAttention layers (fp32 only: its _attn upcasts q and k): q/k rotated interleaved in
    [B, S, H, D] from the sinusoid table by position, permuted after; rotary_dim = head dim."""

    def __init__(self, shape: Shape):
        super().__init__()
        import transformers
        from transformers.models.gptj import modeling_gptj

        self.config = transformers.GPTJConfig(n_embd=shape.hq * shape.d, n_head=shape.hq, rotary_dim=shape.d,
                                              n_positions=4096, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        self.config._attn_implementation = "eager"
        self.layers = nn.ModuleList(modeling_gptj.GPTJAttention(self.config, i) for i in range(LAYERS))

    def forward(self, x):
        positions = _positions(x.shape[1], x.device)
        mask = _masking().create_causal_mask(self.config, x, None, None, position_ids=positions)
        for layer in self.layers:
            x = x + layer(x, attention_mask=mask, position_ids=positions)[0]
        return x


class _StaticLayers:
    """What LlamaAttention calls on a transformers StaticCache (StaticLayer.update), over the
    decoder's buffers: the new keys/values written at arange(Lq) + the cache length with
    index_copy_, the whole cache returned. (StaticLayer also advances its length in place; here the
    length is the caller's, so that a step re-run from the same state computes the same.)"""

    def __init__(self, owner: "StaticCacheDecode", length: torch.Tensor):
        self.owner, self.length = owner, length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = getattr(self.owner, f"keys{layer_idx}"), getattr(self.owner, f"values{layer_idx}")
        positions = torch.arange(key_states.shape[-2], device=keys.device) + self.length
        keys.index_copy_(2, positions, key_states)
        values.index_copy_(2, positions, value_states)
        return keys, values


class StaticCacheDecode(nn.Module):
    """One decode (Lq = 1) or verification (Lq <= 16) step of LlamaAttention layers over a static
    cache of shape.s slots holding a `prompt`-token prefix (zeros past it, as in a StaticCache).
    `length` is the cache's length before the step (a 0-d int tensor, StaticCache's
    cumulative_length); the mask is what create_causal_mask makes there (sdpa_mask / eager_mask
    with that length as the query offset, the attention_mask padded to the cache), rotary at the
    step's positions. `prebuilt`: generate() with a compiled forward, which hands the graph a
    [B, 1, 1, L] mask built outside it."""

    def __init__(self, shape: Shape, impl: str, prompt: int, prebuilt: bool = False):
        super().__init__()
        import transformers
        from transformers.models.llama import modeling_llama

        self.config = transformers.LlamaConfig(hidden_size=64 * shape.hq, num_attention_heads=shape.hq,
                                               num_key_value_heads=shape.hkv, head_dim=shape.d,
                                               max_position_embeddings=4096, attention_dropout=0.0)
        self.config._attn_implementation = impl
        self.prompt, self.prebuilt = prompt, prebuilt
        self.rotary = modeling_llama.LlamaRotaryEmbedding(self.config)
        self.layers = nn.ModuleList(modeling_llama.LlamaAttention(self.config, i) for i in range(LAYERS))
        for i in range(LAYERS):
            for name in ("keys", "values"):
                cache = torch.zeros(shape.b, shape.hkv, shape.s, shape.d)
                cache[:, :, :prompt] = 2 * torch.randn(shape.b, shape.hkv, prompt, shape.d)
                self.register_buffer(f"{name}{i}", cache)

    def forward(self, x, length, attention_mask=None):
        mu = _masking()
        b, lq, _ = x.shape
        if self.prebuilt:
            mask = attention_mask
        else:
            build = mu.sdpa_mask if self.config._attn_implementation == "sdpa" else mu.eager_mask
            padding = None if attention_mask is None else attention_mask.to(torch.bool)
            mask = build(batch_size=b, q_length=lq, kv_length=self.keys0.shape[2], q_offset=length,
                         mask_function=mu.causal_mask_function, attention_mask=padding,
                         allow_is_causal_skip=False, dtype=x.dtype, device=x.device)
        cos_sin = self.rotary(x, _positions(lq, x.device, length))
        cache = _StaticLayers(self, length)
        for layer in self.layers:
            x = x + layer(x, cos_sin, mask, past_key_values=cache)[0]
        return x


# =============================================================================================
# forms: how each family is built, and what it matches


def make_layers(family, shape: Shape, padding: str | None = None, **options):
    """make(dtype, device) for the conformance runner: the wrapper in `dtype` and its inputs (the
    hidden states, and the attention_mask where `padding` is given; a decode step also gets the
    cache length, and its attention_mask covers the tokens seen so far, as generate() passes it)."""

    def make(dtype, device):
        _masking()
        module = _no_zero_parameters(family(shape, **options)).to(device, dtype)
        inputs = [_hidden(shape, module.config.hidden_size, dtype, device)]
        if family is StaticCacheDecode:
            inputs.append(torch.tensor(module.prompt, device=device))
            seen = module.prompt + shape.q
            if options.get("prebuilt"):
                mask = torch.zeros(shape.b, 1, 1, shape.s, dtype=torch.bool, device=device)
                mask[:, 0, 0, :seen] = _attention_mask(padding or "ones", shape.b, seen, device).bool()
            else:
                mask = _attention_mask(padding, shape.b, seen, device)
        elif family is PackedLlama:
            mask = packed_positions(shape.s, device)  # (the position ids, in the mask's place)
        else:
            mask = _attention_mask(padding, shape.b, shape.s, device)
        return module, (*inputs, *([] if mask is None else [mask]))

    return make


# What keeps fp32 attention out of the kernels on CUDA (fusionpass.patterns.attention_kernel.kernel_dtypes)
FP32_KEPT_OUT = "fp32 q/k/v"


def _kernel(rotary: str | None = None, rope_attention_training: bool = False, out_proj: bool = True):
    """expect(train, shape, dtype) where every layer goes to fusionpass::flash_attention, and its
    output straight to the output projection (attention_out_proj; not Falcon's eager flatten +
    _merge_heads, a near miss). `rotary`: "rope" where the rope fusion rotates q and k first,
    "graph" where their rotation stays in the graph; either way rope_attention then moves q's
    rotation into the kernel, in inference (in training where opted in), for head dims that are
    powers of two. fp32 stays out of the kernel (only rope's match is left)."""

    def expect(train: bool, shape: Shape, dtype) -> dict:
        counts = {"rope": LAYERS} if rotary == "rope" else {}
        if dtype == FP32:
            return counts
        counts["flash_attention"] = LAYERS
        if out_proj:
            counts["attention_out_proj"] = LAYERS
        if rotary and (not train or rope_attention_training) and not shape.d & (shape.d - 1):
            counts["rope_attention"] = LAYERS
        return counts

    expect.kernel_route = True
    return expect


def _decode(train: bool, shape: Shape, dtype) -> dict:
    return {} if dtype == FP32 else {"decode_attention": LAYERS}


_decode.kernel_route = True


def _case(fusion, variant, form, dtype, shape, train, make, expect, config=None, padding=None, near_miss=None):
    form = form if padding is None else f"{form}-{padding}"
    return Case(
        name=f"{fusion}/{variant}/{form}/{dtype_name(dtype)}/{shape}/{'train' if train else 'infer'}",
        fusion=fusion, variant=variant, make=make, dtype=dtype, train=train, expect=expect, config=config or {},
        near_miss=near_miss,
    )


def _cases(fusion, variant, form, family, expect, rows, config=None, **options) -> list[Case]:
    """One case per (dtype, shape, train, padding) row; `expect(train, shape, dtype)` gives its
    match counts. fp32 rows of a kernel route check that fp32 stays out (FP32_KEPT_OUT)."""
    return [_case(fusion, variant, form, dtype, shape, train, make_layers(family, shape, padding, **options),
                  expect(train, shape, dtype), config, padding,
                  FP32_KEPT_OUT if dtype == FP32 and getattr(expect, "kernel_route", False) else None)
            for dtype, shape, train, padding in rows]


def _always(**counts):
    return lambda train, shape, dtype: counts


CUDNN_PADDING = {"attention_cudnn_padding": True}  # fusionpass::padded_attention (opt-in)


def _cudnn_route(train: bool, shape: Shape, dtype) -> dict:
    """Every layer's attention through fusionpass::padded_attention: rope matches, flash_attention
    counts the match; the op is not one attention_out_proj or rope_attention edit."""
    return {"rope": LAYERS} if dtype == FP32 else {"rope": LAYERS, "flash_attention": LAYERS}


_cudnn_route.kernel_route = True


def _cudnn_cases(rows) -> list[Case]:
    """The cuDNN route's cases: on CUDA they fail without cudnn-frontend (the `cudnn` extra), so that
    a run without it can never pass them through our kernel alone."""
    cases = _cases("flash_attention", "causal_kernel_padded", "llama-sdpa-cudnn", Llama, _cudnn_route, rows,
                   CUDNN_PADDING, impl="sdpa")

    def needs_cudnn(make):
        def checked(dtype, device):
            from fusionpass.kernels import cudnn_attention

            if torch.device(device).type == "cuda" and not cudnn_attention.available():
                raise RuntimeError("cudnn-frontend is not installed: the cuDNN route's cases need the cudnn extra")
            return make(dtype, device)

        return checked

    return [dataclasses.replace(c, make=needs_cudnn(c.make)) for c in cases]


# shapes: GQA decoders (Llama, Mistral), then multi-head families; padded ones have B >= 2
G77 = Shape(2, 16, 4, 77, 64)
G513 = Shape(1, 8, 8, 513, 128)
G1000 = Shape(1, 12, 2, 1000, 96)
GP77 = Shape(3, 16, 4, 77, 64)
GP513 = Shape(2, 8, 8, 513, 128)
GP1000 = Shape(2, 12, 2, 1000, 80)
GPD256 = Shape(2, 4, 2, 301, 256)  # Gemma's head dim
G1000_128 = Shape(1, 12, 2, 1000, 128)  # rope_attention: power-of-two head dims only
G333_256 = Shape(2, 4, 2, 333, 256)
M77 = Shape(2, 12, 12, 77, 64)
M513 = Shape(1, 8, 8, 513, 128)
M1000 = Shape(2, 4, 4, 1000, 256)
MP77 = Shape(3, 12, 12, 77, 64)
F77 = Shape(2, 16, 16, 77, 64)
MP513 = Shape(2, 8, 8, 513, 80)
MP1000 = Shape(2, 4, 4, 1000, 96)

ATTENTION_CASES = [
    # SDPA with transformers' boolean masks, proven causal / all-true: SDPA keeps the call, without
    # the mask (GQA through enable_gqa); rope fuses the Llama rotation alongside
    *_cases("sdpa_mask", "causal_mask", "llama-sdpa", Llama, _always(rope=LAYERS, sdpa_mask=LAYERS), [
        (BF16, G77, True, None), (FP16, G513, False, None), (FP32, G1000, True, None),
    ], impl="sdpa"),
    *_cases("sdpa_mask", "none_mask", "bert-sdpa", Bert, _always(sdpa_mask=LAYERS), [
        (BF16, M513, True, None), (FP16, M77, False, None), (FP32, M1000, False, None),
    ]),
    # (the same AND the attention_mask's padding through torch.cond, causal/none_mask_if_unpadded,
    # is CPU only: Inductor's CUDA lowering of the cond failed in every case, fusions/sdpa_runtime_check/pattern.py)
    # attention written in torch ops -> fusionpass::flash_attention (on by default)
    *_cases("flash_attention", "eager_kernel", "gpt2-eager", GPT2, _kernel(), [
        (BF16, M77, True, None), (FP16, M513, True, None), (FP32, M1000, False, None), (BF16, M1000, False, None),
    ]),
    *_cases("flash_attention", "eager_alibi_kernel", "bloom-eager", Bloom, _kernel(), [
        (BF16, M77, True, None), (FP16, M513, False, None), (BF16, Shape(2, 12, 12, 1000, 80), True, None),
        (FP32, Shape(2, 12, 12, 1000, 80), True, None),
    ]),
    *_cases("flash_attention", "eager_alibi_kernel", "mpt-eager", Mpt, _kernel(), [
        (BF16, Shape(2, 8, 8, 333, 96), False, None), (FP16, M77, True, None), (BF16, M513, True, None),
        (FP32, M513, True, None),
    ]),
    # Falcon: power-of-two head counts (its ALiBi rounds slope * position to bf16 even in an fp32
    # model, which Inductor's code does not: with other head counts plain torch.compile is 1e-3 off)
    # fp32 only, so never selected on CUDA (FP32_KEPT_OUT): in bf16/fp16 Falcon upcasts its scores
    # after viewing them, which the eager route does not follow (a near miss). (Its _merge_heads
    # after a flatten is no head merge attention_out_proj knows, a near miss too.)
    *_cases("flash_attention", "eager_alibi_mask_kernel", "falcon-eager", Falcon, _kernel(out_proj=False), [
        (FP32, M513, True, None), (FP32, F77, False, None),
    ], impl="eager"),
    # SDPA whose float mask carries Falcon's ALiBi -> the kernel with a per-key bias (on by default)
    *_cases("flash_attention", "alibi_mask_kernel", "falcon-sdpa", Falcon, _kernel(), [
        (BF16, F77, False, None), (FP16, M513, True, None), (FP32, M1000, False, None),
        (BF16, Shape(2, 16, 1, 513, 64), True, None),  # multi-query
    ], impl="sdpa"),
    # the same with left padding, inference only: the rows that see no key get SDPA's average of
    # the values (written after the kernel, so no token-major output for the projection). Not
    # fp16, whose fill (-65504) does not absorb the scores (a near miss by design)
    *_cases("flash_attention", "alibi_mask_kernel_padded", "falcon-sdpa", Falcon, _kernel(out_proj=False), [
        (BF16, Shape(3, 16, 1, 513, 64), False, "left"), (BF16, Shape(3, 16, 16, 77, 64), False, "left"),
        (FP32, Shape(3, 16, 16, 77, 64), False, "left"),
    ], impl="sdpa"),
    # the opt-in kernel route for SDPA: sliding windows, causal / all-true masks AND padding
    *_cases("flash_attention", "sliding_window_kernel", "mistral-sdpa", Llama, _kernel("rope"), [
        (BF16, G77, True, None), (FP16, G513, False, None), (BF16, G1000, True, None), (FP32, G1000, True, None),
    ], KERNEL, impl="sdpa", window=True),
    *_cases("flash_attention", "sliding_window_kernel_padded", "mistral-sdpa", Llama,
            _kernel("rope"), [
        (BF16, GP513, False, "left"), (FP16, GP77, True, "right"), (BF16, GP1000, False, "right"),
        (FP32, GP1000, False, "right"),
    ], KERNEL, impl="sdpa", window=True),
    *_cases("flash_attention", "causal_kernel_padded", "llama-sdpa", Llama, _kernel("rope"), [
        (BF16, GP77, True, "right"), (FP16, GP513, False, "left"), (BF16, GP1000, True, "left"),
        (FP32, GP1000, True, "left"),
    ], KERNEL, impl="sdpa"),
    # causal AND padding at the default config (attention_causal_padding), without attention_kernel
    *_cases("flash_attention", "causal_kernel_padded", "llama-sdpa-default", Llama, _kernel("rope"), [
        (BF16, GP77, True, "ones"), (FP16, GP513, True, "left"), (BF16, GP1000, False, "right"),
        (FP16, GP1000, True, "right"), (FP32, GP77, True, "left"), (BF16, GP77, True, "left_empty"),
        (FP16, GP513, False, "left_empty"),
    ], impl="sdpa"),
    # ... but not at head dim 256, where our kernel lost to plain compile's masked SDPA
    # (CAUSAL_PADDING_HEAD_DIM): plain compile's route stays, with the rule as its near miss
    *[dataclasses.replace(c, near_miss="head dim of a causal mask with key padding 256 > 128")
      for c in _cases("flash_attention", "causal_kernel_padded", "llama-sdpa-default-d256", Llama, _always(rope=LAYERS),
                      [(BF16, GPD256, True, "right"), (FP16, GPD256, False, "ones")], impl="sdpa")],
    # the cuDNN route (attention_cudnn_padding): each head dim it takes, all ones, right and left
    # padding, a row with no token, training and inference
    *_cudnn_cases([
        (BF16, GP77, True, "ones"), (BF16, GP77, True, "right"), (FP16, GP77, True, "left"),
        (BF16, GP77, False, "left_empty"), (BF16, GP513, True, "right"), (FP16, GP513, True, "left_empty"),
        (BF16, GPD256, True, "right"), (BF16, GPD256, False, "ones"), (FP32, GP77, True, "right"),
    ]),
    # sliding windows at the default config (attention_sliding_window), without attention_kernel:
    # windows of 1, 64 and 333 keys, with and without padding (left padding: rows that see no key)
    *_cases("flash_attention", "sliding_window_kernel", "mistral-sdpa-default-w1", Llama, _kernel("rope"), [
        (BF16, G77, True, None), (FP16, G77, False, None),
    ], impl="sdpa", window=1),
    *_cases("flash_attention", "sliding_window_kernel", "mistral-sdpa-default-w64", Llama, _kernel("rope"), [
        (BF16, G513, True, None), (FP16, G513, False, None), (FP32, G513, True, None),
    ], impl="sdpa", window=64),
    *_cases("flash_attention", "sliding_window_kernel_padded", "mistral-sdpa-default-w64", Llama, _kernel("rope"), [
        (BF16, GP513, True, "left"), (FP16, GP77, True, "right"), (BF16, GP77, False, "ones"),
        (BF16, GP513, True, "left_empty"),
    ], impl="sdpa", window=64),
    *_cases("flash_attention", "sliding_window_kernel", "mistral-sdpa-default-w333", Llama, _kernel("rope"), [
        (BF16, G1000, True, None), (FP16, G1000_128, False, None),
    ], impl="sdpa", window=333),
    *_cases("flash_attention", "sliding_window_kernel_padded", "mistral-sdpa-default-w333", Llama,
            _kernel("rope"), [
        (BF16, GP1000, True, "right"), (FP16, GP1000, False, "left"),
    ], impl="sdpa", window=333),
    # MLA (q/k head dim 192, v 128: v padded to 192 for the kernel, the output cut back) with the
    # collator's attention_mask (opt-in: attention_mla); the cut output is no head merge for
    # attention_out_proj
    *_cases("flash_attention", "causal_kernel_padded", "deepseek-v3-mla-sdpa", DeepseekMLA, _kernel(out_proj=False), [
        (BF16, Shape(2, 8, 8, 333, 192), True, "ones"), (BF16, Shape(3, 4, 4, 513, 192), True, "left_empty"),
        (FP16, Shape(2, 8, 8, 77, 192), False, "right"), (FP32, Shape(2, 4, 4, 77, 192), True, "left"),
    ], {"attention_mla": True}),
    # packed sequences (DataCollatorWithFlattening: one row, position ids restarting, sequences of
    # one token among them) at the default config (attention_packed)
    *_cases("flash_attention", "causal_kernel_packed", "llama-sdpa-packed", PackedLlama, _kernel("rope"), [
        (BF16, Shape(1, 16, 4, 333, 64), True, None), (FP16, Shape(1, 8, 8, 513, 128), False, None),
        (BF16, Shape(1, 12, 2, 1000, 80), True, None), (FP32, Shape(1, 16, 4, 77, 64), True, None),
    ], impl="sdpa"),
    *_cases("flash_attention", "none_kernel_padded", "bert-sdpa", Bert, _kernel(), [
        (BF16, MP513, False, "left"), (FP16, MP77, True, "right"), (FP16, MP1000, False, "ones"),
        (FP32, MP1000, False, "ones"),
    ], KERNEL),
    # an encoder's padding collator at the default config (attention_padding), without
    # attention_kernel: right and left padding, no row padded, a batch row padded whole; head dim
    # 64, where its cost rules select it
    *_cases("flash_attention", "none_kernel_padded", "bert-sdpa-default", Bert, _kernel(), [
        (BF16, Shape(2, 8, 8, 513, 64), True, "right"), (FP16, MP77, True, "left"),
        (BF16, Shape(3, 12, 12, 333, 64), True, "ones"), (BF16, MP77, True, "left_empty"),
        (FP16, Shape(2, 4, 4, 1000, 64), False, "right"), (FP32, MP77, True, "right"),
    ]),
]

# decode steps over a static cache (inference only: the kernel is forward-only); the prompt fills
# part of the cache, the step's tokens go after it
DECODE_CASES = [
    *_cases("decode_attention", "static_cache", "llama-sdpa", StaticCacheDecode, _decode, [
        (BF16, Shape(2, 16, 4, 1000, 128, q=1), False, None), (FP16, Shape(3, 8, 8, 513, 64, q=4), False, "left"),
        (BF16, Shape(1, 12, 2, 333, 256, q=16), False, None), (FP32, Shape(1, 12, 2, 333, 256, q=16), False, None),
    ], impl="sdpa", prompt=301),
    # head dims that are not powers of two (padded in registers; opt-in: decode_attention_padded_head_dims)
    *_cases("decode_attention", "static_cache", "llama-sdpa", StaticCacheDecode, _decode, [
        (BF16, Shape(2, 16, 4, 1000, 80, q=1), False, "left"), (FP16, Shape(3, 8, 8, 333, 96, q=4), False, None),
    ], {"decode_attention_padded_head_dims": True}, impl="sdpa", prompt=301),
    *_cases("decode_attention", "static_cache", "llama-eager", StaticCacheDecode, _decode, [
        (BF16, Shape(3, 8, 2, 513, 64, q=4), False, "left"), (FP16, Shape(1, 16, 4, 1000, 256, q=1), False, None),
        (FP16, Shape(2, 12, 12, 77, 128, q=16), False, "right"), (FP32, Shape(2, 12, 12, 77, 128, q=16), False, "right"),
    ], impl="eager", prompt=45),
    # generate()'s compiled decode step: a [B, 1, 1, L] mask built outside the graph
    *_cases("decode_attention", "one_query_any_mask", "llama-sdpa-prebuilt", StaticCacheDecode,
            _decode, [
        (BF16, Shape(2, 16, 4, 513, 128, q=1), False, "left"),
    ], impl="sdpa", prompt=301, prebuilt=True),
]

# q's rotation moved into the kernel that reads it: inference by default (training opted in).
# rope_kernel: rope fused q and k into one fusionpass::rope call first (sequences of >= 64 tokens),
# rope_attention takes q's output and leaves a k-only rope call; graph_rotation: rope off, q's
# rotation is still the graph's (rotate_half; GPT-J's interleaved partial form, fp32, stays out)
ROPE_ATTENTION_CASES = [
    *_cases("rope_attention", "rope_kernel", "llama-eager", Llama, _kernel("rope"), [
        (BF16, G77, False, None), (FP16, G513, False, None), (BF16, G1000_128, False, None),
        (FP32, G1000_128, False, None),
    ], impl="eager"),
    *_cases("rope_attention", "rope_kernel", "llama-eager", Llama,
            _kernel("rope", True), [
        (BF16, G333_256, True, None),
    ], {"rope_attention_training": True}, impl="eager"),
    *_cases("rope_attention", "rope_kernel", "llama-sdpa", Llama, _kernel("rope"), [
        (BF16, Shape(3, 16, 4, 333, 128), False, "right"),
    ], KERNEL, impl="sdpa"),
    # GPT-J is fp32 only (its _attn upcasts q and k), so on CUDA these check that it stays out
    *_cases("rope_attention", "rope_kernel", "gptj-eager", GPTJ, _kernel("rope"), [
        (FP32, M77, False, None),
    ], {"rope_attention_interleaved": True}),
    *_cases("rope_attention", "graph_rotation", "llama-eager", Llama,
            _kernel("graph", True), [
        (BF16, G77, False, None), (FP16, G1000_128, False, None), (BF16, G513, False, None), (FP32, G513, False, None),
    ], NO_ROPE, impl="eager"),
    *_cases("rope_attention", "graph_rotation", "llama-eager", Llama,
            _kernel("graph", True), [
        (BF16, G77, True, None), (FP32, G77, True, None),
    ], {**NO_ROPE, "rope_attention_training": True}, impl="eager"),
    *_cases("rope_attention", "graph_rotation", "gptj-eager", GPTJ,
            _kernel("graph", True), [
        (FP32, M513, False, None),
    ], {**NO_ROPE, "rope_attention_interleaved": True}),
]

# the kernel writes its output token-major where the heads are merged for the output projection
OUT_PROJ_CASES = [
    *_cases("attention_out_proj", "merge_heads", "bloom-eager", Bloom, _kernel(), [
        (BF16, M1000, False, None), (FP16, Shape(2, 12, 12, 77, 80), True, None), (BF16, M513, False, None),
        (FP32, M513, False, None),
    ]),
    *_cases("attention_out_proj", "transpose_reshape", "gpt2-eager", GPT2,
            _kernel(), [
        (BF16, M77, True, None), (FP32, M77, True, None),
    ]),
    *_cases("attention_out_proj", "transpose_reshape", "llama-eager", Llama,
            _kernel("rope"), [
        (BF16, G513, True, None),
    ], impl="eager"),
    *_cases("attention_out_proj", "transpose_reshape", "mpt-eager", Mpt, _kernel(), [
        (FP16, MP1000, False, None),
    ]),
]

CASES = [*ATTENTION_CASES, *DECODE_CASES, *ROPE_ATTENTION_CASES, *OUT_PROJ_CASES]
