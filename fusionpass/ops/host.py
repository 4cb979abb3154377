"""What the ops share: how CPU tensors are run, and how outputs fit their schemas."""
from __future__ import annotations

import os

import torch
from torch import Tensor


def interpreting() -> bool:
    """CPU tensors run the Triton kernels under the interpreter (the tests), else a torch
    reference (`fusionpass explain` on a machine without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def schema_of(op) -> str:
    """The arguments and returns of the custom op `op`, as custom_op's `schema` takes them: a host
    op that takes what its public op takes declares its arguments once, in the public op."""
    return op._schema


def empty_like(t: Tensor) -> Tensor:
    """A contiguous output of t's shape and dtype."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def none(t: Tensor) -> Tensor:
    """An output the call does not produce: schemas return Tensors, so an empty one."""
    return t.new_empty(0)
