"""A torchtitan-style Llama (written for these tests and the benchmark suite, after torchtitan's
llama3 model: its module names, its forward order, its loss outside the model).

    TransformerBlock: h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))
    Attention:        wq/wk/wv, RoPE, repeat_kv (GQA), F.scaled_dot_product_attention(is_causal=True), wo
    FeedForward:      w2(silu(w1(x)) * w3(x))
    Transformer:      tok_embeddings, layers (a ModuleDict, as torchtitan keys them), norm, output

Two spellings of each part that varies between torchtitan's versions and its forks:
- `norm`: "torch" is `torch.nn.RMSNorm` (torchtitan today); "llama" is Meta's reference RMSNorm
  class (`self._norm(x.float()).type_as(x) * self.weight`, torchtitan before nn.RMSNorm).
- `rope`: "complex" is torchtitan's `view_as_complex(x) * freqs_cis` over polar frequencies;
  "rotate_half" is the real form `x * cos + rotate_half(x) * sin` (HF's), on the same frequencies.

Regional compilation compiles each block on its own (`block.compile()`), so the loss is not in the
model either: `cross_entropy_loss` is torchtitan's.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class ModelArgs:
    dim: int = 512
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_dim: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64
    norm: str = "torch"  # "torch" (nn.RMSNorm) or "llama" (Meta's reference RMSNorm class)
    rope: str = "complex"  # "complex" (view_as_complex, torchtitan) or "rotate_half" (real)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class LlamaRMSNorm(nn.Module):
    """Meta's reference RMSNorm: statistics in fp32, the weight applied after the downcast."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


def build_norm(args: ModelArgs) -> nn.Module:
    if args.norm == "torch":
        return nn.RMSNorm(args.dim, eps=args.norm_eps)
    if args.norm == "llama":
        return LlamaRMSNorm(args.dim, args.norm_eps)
    raise ValueError(f"unknown norm {args.norm!r}")


def precompute_freqs_cis(head_dim: int, end: int, theta: float) -> torch.Tensor:
    """torchtitan's frequencies: complex64 [end, head_dim / 2] of unit length."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _broadcast_to(freqs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """freqs[:seqlen] viewed as [1, seqlen, 1, last] against x [bs, seqlen, heads, last]."""
    seqlen = x.shape[1]
    freqs = freqs[0:seqlen]
    shape = [d if i in (1, x.ndim - 1) else 1 for i, d in enumerate(x.shape)]
    return freqs.view(*shape)


def apply_rotary_emb_complex(xq, xk, freqs_cis):
    """torchtitan's form: adjacent channel pairs (2i, 2i+1) as complex numbers, times freqs_cis."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = _broadcast_to(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb_real(xq, xk, cos, sin):
    """The real form over halves (HF's rotate_half): cos/sin [max_seq_len, head_dim] viewed as
    [1, seqlen, 1, head_dim] against xq/xk [bs, seqlen, heads, head_dim]."""
    cos = _broadcast_to(cos, xq).to(xq.dtype)
    sin = _broadcast_to(sin, xq).to(xq.dtype)
    return xq * cos + rotate_half(xq) * sin, xk * cos + rotate_half(xk) * sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.rope = args.rope
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, freqs):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        if self.rope == "complex":
            xq, xk = apply_rotary_emb_complex(xq, xk, freqs)
        else:
            cos, sin = freqs
            xq, xk = apply_rotary_emb_real(xq, xk, cos, sin)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = build_norm(args)
        self.ffn_norm = build_norm(args)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        freqs_cis = precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta)
        if args.rope == "complex":
            self.register_buffer("freqs_cis", freqs_cis, persistent=False)
        else:  # the same angles for both halves of the head (rotate_half pairs i with i + d/2)
            angles = torch.cat([freqs_cis.angle()] * 2, dim=-1)
            self.register_buffer("rope_cos", angles.cos(), persistent=False)
            self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = build_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    @property
    def freqs(self):
        return self.freqs_cis if self.args.rope == "complex" else (self.rope_cos, self.rope_sin)

    def hidden(self, tokens):
        """The blocks' output before the final norm."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        return h

    def forward(self, tokens):
        return self.output(self.norm(self.hidden(tokens)))


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: cross-entropy in fp32 over the flattened batch and sequence."""
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


class NormOutputLoss(nn.Module):
    """The region after the last block: final norm, output projection and the loss (h, labels ->
    loss), sharing the model's norm and output modules."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.norm, self.output = model.norm, model.output

    def forward(self, h, labels):
        return cross_entropy_loss(self.output(self.norm(h)), labels)


def compile_regions(model: Transformer, **compile_kwargs) -> None:
    """torchtitan's per-block compile (`block.compile()` on every layer, in place)."""
    for block in model.layers.values():
        block.compile(**compile_kwargs)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Parameters to `dtype`, buffers kept, as FSDP's mixed precision casts them (Module.to(bf16)
    would drop the imaginary part of the complex freqs_cis)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def make(args: ModelArgs | None = None, seed: int = 0, **changes) -> Transformer:
    """A model with weights that give the norms something to do (weights not all ones)."""
    args = dataclasses.replace(args or ModelArgs(), **changes)
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


class RegionalTraining(nn.Module):
    """A torchtitan training step's forward under regional compilation: the embedding runs
    eagerly, every block is compiled on its own (`compile_regions`), and the final norm + output
    projection + loss are one more compiled region. (ids, labels) -> loss."""

    def __init__(self, model: Transformer, **compile_kwargs):
        super().__init__()
        self.model = model
        compile_regions(model, **compile_kwargs)
        self.loss_region = torch.compile(NormOutputLoss(model), **compile_kwargs)

    def forward(self, ids, labels):
        return self.loss_region(self.model.hidden(ids), labels)
