"""The toy fusion's kernel: out = x + x, over a flat contiguous tensor."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _double_kernel(X, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(OUT + offs, x + x, mask=offs < n)


def double(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _double_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, BLOCK=_BLOCK)
    return out
