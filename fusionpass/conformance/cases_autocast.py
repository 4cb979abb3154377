"""AMP twins of every fusion's training cases (each fusion folder's `cases.py`): the same module and
inputs with fp32 parameters and inputs, run under `torch.autocast(device, torch.bfloat16)`, as the
HF Trainer's `bf16=True` runs a model built from a config (autocast over fp32 weights).

Autocast decides the arithmetic (linear, matmul and SDPA in bf16; softmax, norms and the loss in
fp32; elementwise ops promote), and fusionpass writes its casts into the graph before matching
(`fusionpass/patterns/autocast.py`), so each twin must match what its bf16 case matches. The
float64 reference is the same module without any cast (autocast leaves float64 tensors alone), so
it is the exact function that the autocast computation approximates; the arithmetic is bf16's, so
the floor is bf16's. Cases that prove a fallback (`near_miss`) and whole models (they have Trainer
cases of their own in cases_models) have no twin.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fusionpass.conformance import FLOOR, Case, case_modules


class Autocast(nn.Module):
    """`inner(*inputs)` under bf16 autocast on the inputs' device: accelerate's autocast around a
    model's forward, as a Trainer with bf16=True runs it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *inputs, **kwargs):
        device = next(t.device.type for t in inputs if isinstance(t, torch.Tensor))
        with torch.autocast(device, dtype=torch.bfloat16):
            return self.inner(*inputs, **kwargs)


# Twins whose fusion does not match under autocast yet, by the bf16 case's name up to its dtype:
# the near miss and what matches instead, so that each twin is checked as a fallback (correct, and
# the near miss named) until its fusion takes the autocast form. None now.
GAPS: dict[str, tuple[str, dict]] = {}


def twin(case: Case) -> Case:
    """`case` with fp32 parameters and inputs, run under bf16 autocast: named `.../amp/...`."""
    make_fp32 = case.make

    def make(dtype, device):
        module, inputs = make_fp32(dtype, device)
        return Autocast(module), inputs

    near_miss, expect = GAPS.get(case.name.split("/bf16/", 1)[0], (None, case.expect))
    return dataclasses.replace(case, name=case.name.replace("/bf16/", "/amp/", 1), make=make,
                               dtype=torch.float32, floor=FLOOR[torch.bfloat16], near_miss=near_miss,
                               expect=expect)


def _twinned(case: Case) -> bool:
    return (case.fusion != "model" and case.train and case.dtype == torch.bfloat16 and case.near_miss is None
            and "/bf16/" in case.name)


CASES = [twin(c) for module in case_modules(twins=False) for c in module.CASES if _twinned(c)]
