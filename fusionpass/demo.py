"""Models for `fusionpass explain` and `fusionpass bench`: a built-in tiny Llama-style model (no
download, no transformers), and tiny configs of installed Hugging Face model families."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# built-in demo: written the way HF Llama writes its blocks, so it shows the same matches


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, width, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, width, heads, kv_heads, hidden):
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = Attention(width, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(width)
        self.mlp = MLP(width, hidden)

    def forward(self, h, cos, sin, mask):
        residual = h
        h = self.self_attn(self.input_layernorm(h), cos, sin, mask)
        h = residual + h
        residual = h
        h = self.mlp(self.post_attention_layernorm(h))
        return residual + h


class DemoLlama(nn.Module):
    """A tiny Llama-style causal LM: pre-norm blocks, RoPE, GQA attention with a materialized
    causal mask (as HF models pass it under torch.compile), SwiGLU MLP."""

    def __init__(self, vocab=256, width=512, layers=2, heads=8, kv_heads=4, hidden=1024):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        head_dim = width // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, input_ids, labels=None):
        h = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).float()
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        # a materialized causal mask, as transformers builds it under torch.compile
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = positions[None, None, None, :] <= positions[None, None, :, None]
        mask = mask.expand(input_ids.shape[0], -1, -1, -1)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        logits = self.lm_head(self.norm(h))
        if labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )


# ---------------------------------------------------------------------------------------------
# tiny Hugging Face models, built from configs (random weights, nothing downloaded)

# name -> (config class, overrides). Every family gets the given width and a head_dim of 64.
HF_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {}),
    "phi3": ("Phi3Config", {}),
    # LayerNorm families; BLOOM has only eager attention (ALiBi), routed to fusionpass's kernel
    "gpt2": ("GPT2Config", {"bos_token_id": 0, "eos_token_id": 0}),
    "bloom": ("BloomConfig", {"attn": "eager"}),
}


def tiny_hf(name: str, layers: int = 2, attn: str = "sdpa", width: int = 512, **overrides):
    """A tiny causal LM of an installed transformers model family (`width`: hidden size)."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("`--model` needs transformers: pip install 'fusionpass[test]'") from e
    if name not in HF_FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(HF_FAMILIES)}")
    config_name, family = HF_FAMILIES[name]
    family = dict(family)
    attn = family.pop("attn", attn)
    kwargs = dict(
        vocab_size=256,
        hidden_size=width,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 128,
        head_dim=64,
        max_position_embeddings=512,
        pad_token_id=0,  # some families default to an id beyond the tiny vocabulary
    )
    kwargs.update(family)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = attn
    return transformers.AutoModelForCausalLM.from_config(config)


def build(name: str = "demo", layers: int = 2, width: int = 2048, **overrides):
    """The CLI's models. The default width 2048 lies inside rms_norm_residual's cost rule (see
    fusionpass.config), so the report shows what a real model of that width gets."""
    if name == "demo":
        return DemoLlama(layers=layers, width=width, heads=width // 64, kv_heads=width // 128, **overrides)
    return tiny_hf(name, layers=layers, width=width, **overrides)
