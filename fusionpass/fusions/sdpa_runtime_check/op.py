"""fusionpass::all_true: the one run-time check sdpa_runtime_check needs per forward."""
from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("fusionpass::all_true", mutates_args=())
def all_true(mask: Tensor) -> Tensor:
    """Whether every element of `mask` is true, as a 0-d bool tensor on the CPU.

    This is a host sync. The rewrite computes it once per forward for the attention_mask that
    every layer shares (not once per layer), and the per-layer branches read the CPU copy without
    another sync.
    """
    return mask.all().cpu()


@all_true.register_fake
def _(mask):
    return torch.empty((), dtype=torch.bool, device="cpu")
