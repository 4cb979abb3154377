"""The toy fusion's conformance case, found by `fusionpass check` in its folder."""
from __future__ import annotations

import torch
from torch import nn

from fusionpass.conformance import Case


class _TimesTwo(nn.Module):
    def forward(self, x):
        return torch.sin(x) * 2


def _make(dtype, device):
    return _TimesTwo(), (torch.randn(5, 3, dtype=dtype, device=device),)


CASES = [Case(name="toy_double/times_two/sin/fp32/5x3/infer", fusion="toy_double", variant="times_two", make=_make,
              dtype=torch.float32, train=False, expect={"toy_double": 1}, config={"cpu": True})]
