"""Test session setup.

Triton must see TRITON_INTERPRET before any @triton.jit runs, so it is set here, before the package
is imported; the tests then run every Triton kernel on CPU tensors.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
