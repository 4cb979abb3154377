"""What several fusions' conformance cases are built from (each fusion's own cases are in its folder,
`fusionpass/fusions/<fusion>/cases.py`; the attention layers that five of them share are in
`fusionpass.conformance.attention_layers`).

The norm fusions' cases draw hidden states of a `NormShape`. The rotary, gated-MLP and loss
fusions each get a matrix: every dtype the fusion claims (fp32,
fp16, bf16) x three shapes with odd sizes (sequence lengths, rows and vocabularies that are no
multiple of a block) x training and inference. The model forms a fusion knows are dealt out over
the matrix's slots in turn (`rotating`), so that every form appears (in both training and
inference) and every registered variant matches; a few extra cases cover the cost rules' edges.
Their modules are built on the CPU in fp32 and then moved (`maker`).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch

from fusionpass.conformance import DTYPES, Case, dtype_name

FP32, FP16, BF16 = DTYPES["fp32"], DTYPES["fp16"], DTYPES["bf16"]
ALL_DTYPES = (FP32, FP16, BF16)


# =============================================================================================
# norms


@dataclasses.dataclass(frozen=True)
class NormShape:
    """[batch, seq, width] hidden states of a norm case. Row counts are odd on purpose (8x125 =
    1000, 17x241 = 4097, 27x19 = 513 rows: no multiple of any row tile), and widths are odd too
    where the cost rule can be opened for them through `config` (the kernels must be correct
    everywhere they may be selected)."""

    batch: int
    seq: int
    width: int
    config: tuple = ()  # cost-rule overrides needed to select this width, as (name, value) pairs

    @property
    def label(self) -> str:
        return f"{self.batch}x{self.seq}x{self.width}"


def randn_hidden(shape: NormShape, dtype, device, away_from_zero=False):
    t = torch.randn(shape.batch, shape.seq, shape.width, device=device)
    if away_from_zero:  # makes a dropout mask readable from the outputs (the dropout norm's cases)
        t = torch.where(t >= 0, t + 0.25, t - 0.25)
    return t.to(dtype)


# =============================================================================================
# matrices of forms x dtypes x shapes (the rotary, gated-MLP and loss fusions)


def case(fusion, variant, form, dtype, shape, train, make, expect, config=None) -> Case:
    mode = "train" if train else "infer"
    return Case(
        name=f"{fusion}/{variant}/{form}/{dtype_name(dtype)}/{shape}/{mode}",
        fusion=fusion, variant=variant, make=make, dtype=dtype, train=train,
        expect=expect, config=config or {},
    )


def maker(build, *args):
    """Case.make from `build(*args) -> (module, inputs)`, built on the CPU (the same draws on every
    device) in fp32, then moved: the module and floating inputs to the case's dtype, integer
    inputs (positions, labels) as they are."""

    def make(dtype, device):
        module, inputs = build(*args)
        moved = tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in inputs)
        return module.to(device, dtype), moved

    return make


def rotating(forms, shapes, make_case) -> list[Case]:
    """make_case(form, dtype, shape, train) for every dtype and shape, training and inference, the forms
    taken in turn (each form at several dtypes and shapes without the full product)."""
    cycle = itertools.cycle(forms)
    return [make_case(form, dtype, shape, train)
            for dtype, shape in itertools.product(ALL_DTYPES, shapes)
            for form in (next(cycle),) for train in (True, False)]
