"""Kernel tests run with uninitialized memory filled with NaN (and integer outputs with their
largest value), as the GPU conformance suite does: an output element the kernel never writes, or a
buffer read before it is written, then fails the comparison instead of passing on leftover data."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _nan_fill():
    fill, deterministic = torch.utils.deterministic.fill_uninitialized_memory, torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
