"""The toy fusion's op, fusionpass::toy_double: its folder's kernel (on CPU tensors under the Triton
interpreter, as the tests run it)."""
from __future__ import annotations

import torch

from fusionpass.fusions.toy_double import kernels


@torch.library.custom_op("fusionpass::toy_double", mutates_args=())
def toy_double(x: torch.Tensor) -> torch.Tensor:
    return kernels.double(x)


@toy_double.register_fake
def _(x):
    return torch.empty_like(x)
