"""The attention layers that the conformance cases of sdpa_mask, flash_attention, decode_attention,
rope_attention and attention_out_proj are built from (each fusion's cases are in its folder,
`fusionpass/fusions/<fusion>/cases.py`), what those cases share (`layer_cases`, their expected
counts, shapes) and, for the benchmarks, the same layers (`make_layers`).

The attention layers are transformers 5.17's own (LlamaAttention, MistralAttention,
BertSelfAttention, GPT2Attention, BloomAttention, MptAttention, FalconAttention, GPTJAttention,
Gemma2Attention, GptOssAttention), built from tiny configs. A small wrapper per family prepares what its model computes once per
forward and hands every layer: the mask from masking_utils (materialized under torch.compile),
rotary cos/sin from arange position ids, the ALiBi tensors of BLOOM, MPT and Falcon, the static KV
cache of a decode step. Each wrapper runs two layers over that one mask (x = x + attn(x)), as a
decoder loop does, so every count in the cases is per layer times two.

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
from fusionpass.conformance import Case, dtype_name
from fusionpass.conformance.builders import FP32

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


class _LayerTypes(nn.Module):
    """Layers of a config's `layer_types` (a sliding window, then full attention), each over the
    mask its model builds for its type."""

    def forward(self, x, attention_mask=None):
        mu = _masking()
        positions = _positions(x.shape[1], x.device)
        masks = {"full_attention": mu.create_causal_mask, "sliding_attention": mu.create_sliding_window_causal_mask}
        cos_sin = self.rotary(x, positions)
        for layer, kind in zip(self.layers, self.config.layer_types):
            mask = masks[kind](self.config, x, attention_mask, None, position_ids=positions)
            x = x + layer(x, cos_sin, mask)[0]
        return x


class Gemma2(_LayerTypes):
    """Gemma2Attention layers, eager (the implementation Gemma-2's logit soft-capping needs): the
    first layer a sliding window of about a third of the sequence, the second full, each with the
    mask Gemma2Model builds for its layer type; scores soft-capped at `softcap`."""

    def __init__(self, shape: Shape, impl: str = "eager", softcap: float = 50.0):
        super().__init__()
        import transformers
        from transformers.models.gemma2 import modeling_gemma2 as family

        self.config = transformers.Gemma2Config(
            hidden_size=64 * shape.hq, num_attention_heads=shape.hq, num_key_value_heads=shape.hkv, head_dim=shape.d,
            query_pre_attn_scalar=shape.d, attn_logit_softcapping=softcap, sliding_window=shape.s // 3 | 1,
            num_hidden_layers=LAYERS, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=4096,
            attention_dropout=0.0)
        self.config._attn_implementation = impl
        self.rotary = family.Gemma2RotaryEmbedding(self.config)
        self.layers = nn.ModuleList(family.Gemma2Attention(self.config, i) for i in range(LAYERS))


class GptOss(_LayerTypes):
    """GptOssAttention layers, eager (the implementation gpt-oss's attention sinks need): a learned
    logit per query head joins each row's softmax. The first layer a sliding window of about a
    third of the sequence, the second full, each with the mask GptOssModel builds for it."""

    def __init__(self, shape: Shape, impl: str = "eager"):
        super().__init__()
        import transformers
        from transformers.models.gpt_oss import modeling_gpt_oss as family

        self.config = transformers.GptOssConfig(
            hidden_size=64 * shape.hq, num_attention_heads=shape.hq, num_key_value_heads=shape.hkv, head_dim=shape.d,
            sliding_window=shape.s // 3 | 1, num_hidden_layers=LAYERS, layer_types=["sliding_attention", "full_attention"],
            num_local_experts=2, max_position_embeddings=4096, attention_dropout=0.0)
        self.config._attn_implementation = impl
        self.rotary = family.GptOssRotaryEmbedding(self.config)
        self.layers = nn.ModuleList(family.GptOssAttention(self.config, i) for i in range(LAYERS))
        with torch.no_grad():
            for layer in self.layers:  # (allocated, not initialized, by the module)
                layer.sinks.normal_()


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


def kernel_counts(rotary: str | None = None, rope_attention_training: bool = False, out_proj: bool = True):
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


def _case(fusion, variant, form, dtype, shape, train, make, expect, config=None, padding=None, near_miss=None):
    form = form if padding is None else f"{form}-{padding}"
    return Case(
        name=f"{fusion}/{variant}/{form}/{dtype_name(dtype)}/{shape}/{'train' if train else 'infer'}",
        fusion=fusion, variant=variant, make=make, dtype=dtype, train=train, expect=expect, config=config or {},
        near_miss=near_miss,
    )


def layer_cases(fusion, variant, form, family, expect, rows, config=None, **options) -> list[Case]:
    """One case per (dtype, shape, train, padding) row; `expect(train, shape, dtype)` gives its
    match counts. fp32 rows of a kernel route check that fp32 stays out (FP32_KEPT_OUT)."""
    return [_case(fusion, variant, form, dtype, shape, train, make_layers(family, shape, padding, **options),
                  expect(train, shape, dtype), config, padding,
                  FP32_KEPT_OUT if dtype == FP32 and getattr(expect, "kernel_route", False) else None)
            for dtype, shape, train, padding in rows]


def always(**counts):
    return lambda train, shape, dtype: counts


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
GP2049 = Shape(2, 8, 2, 2049, 64)  # past the cuDNN padding route's shortest length
M77 = Shape(2, 12, 12, 77, 64)
M513 = Shape(1, 8, 8, 513, 128)
M1000 = Shape(2, 4, 4, 1000, 256)
MP77 = Shape(3, 12, 12, 77, 64)
F77 = Shape(2, 16, 16, 77, 64)
MP513 = Shape(2, 8, 8, 513, 80)
MP1000 = Shape(2, 4, 4, 1000, 96)
