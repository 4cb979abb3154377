"""fusionpass::decode_attention: split-KV attention of a few query tokens over a static KV cache
(triton_op on CUDA, host custom op on CPU). Forward only: decode graphs have no backward.

    out = decode_attention(q, k, v, kv_lengths, key_padding, scale)

q [B, Hq, Lq, D] (Lq <= 16), k [B, Hkv, L, D] and v [B, Hkv, L, Dv] (the cache, any strides,
Hq % Hkv == 0, read without repeat; Dv = D but for MLA), kv_lengths [B] int32 (None: all L):
valid keys per batch row; query i sits at position kv_lengths[b] - Lq + i and sees the keys at or
before it that key_padding ([B, L] bool, or None) keeps (fusionpass/fusions/decode_attention/kernels.py).
On CPU: the kernel under TRITON_INTERPRET=1 (tests), else a torch reference with the same mask.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fusionpass.ops import host

# Launch overrides for CPU tensors (the interpreter), e.g. {"block_n": 16}; tests may set them.
CPU_LAUNCH: dict = {}


def reference(q: Tensor, k: Tensor, v: Tensor, kv_lengths: Tensor | None, key_padding: Tensor | None,
              scale: float) -> Tensor:
    """Math attention in fp32 with the kernel's mask; rows that see no key are 0."""
    B, Hq, Lq, D = q.shape
    L = k.shape[2]
    group = Hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    kv_lengths = _all_keys(q, k) if kv_lengths is None else kv_lengths
    lengths = kv_lengths.to(torch.int64).view(B, 1, 1, 1)
    pos = lengths - Lq + torch.arange(Lq, device=q.device).view(1, 1, Lq, 1)
    j = torch.arange(L, device=q.device).view(1, 1, 1, L)
    visible = (j <= pos) & (j < lengths)
    if key_padding is not None:
        visible = visible & key_padding.view(B, 1, 1, L)
    s = s.masked_fill(~visible, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ vf).to(q.dtype)


def _all_keys(q: Tensor, k: Tensor) -> Tensor:
    return torch.full((q.shape[0],), k.shape[2], dtype=torch.int32, device=q.device)


def _kernel(q, k, v, kv_lengths, key_padding, scale, launch=None):
    from fusionpass.fusions.decode_attention.kernels import decode_attention as kernel

    kv_lengths = _all_keys(q, k) if kv_lengths is None else kv_lengths
    return kernel(q, k, v, kv_lengths, scale=scale, key_padding=key_padding, **(launch or {}))


@torch.library.custom_op("fusionpass::decode_attention_host", mutates_args=())
def _host(
    q: Tensor, k: Tensor, v: Tensor, kv_lengths: Tensor | None, key_padding: Tensor | None, scale: float
) -> Tensor:
    if host.interpreting():
        return _kernel(q, k, v, kv_lengths, key_padding, scale, CPU_LAUNCH).contiguous()
    return reference(q, k, v, kv_lengths, key_padding, scale).contiguous()


@_host.register_fake
def _(q, k, v, kv_lengths, key_padding, scale):
    return torch.empty((*q.shape[:3], v.shape[3]), dtype=q.dtype, device=q.device)


@torch.library.triton_op("fusionpass::decode_attention", mutates_args=())
def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, kv_lengths: Tensor | None, key_padding: Tensor | None, scale: float
) -> Tensor:
    if q.device.type != "cuda":
        return _host(q, k, v, kv_lengths, key_padding, scale)
    return _kernel(q, k, v, kv_lengths, key_padding, scale)
