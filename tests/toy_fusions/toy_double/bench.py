"""The toy fusion's benchmark topic, found by benchmarks/suite.py in its folder."""
from __future__ import annotations

import torch
from torch import nn

from fusionpass.bench_cases import Case, on_device

ORDER = 1000  # after every real fusion's topics


class _TimesTwo(nn.Module):
    def forward(self, x):
        return torch.sin(x) * 2


def toy_double_cases(smoke):
    def build(device, dtype):
        return on_device(device, _TimesTwo), (torch.randn(64, 64, device=device, dtype=dtype),)

    return [Case("sin(x) * 2, 64x64", build, False, ("toy_double",), True)]


TOPICS = {"toy_double": toy_double_cases}
