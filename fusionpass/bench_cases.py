"""The benchmark suite's kernel-level cases (benchmarks/suite.py): what every fusion's topics share.

Each fusion folder that has kernel-level topics holds them in its `bench.py`
(fusionpass/fusions/<fusion>/bench.py):

- `TOPICS`: {topic: cases(smoke) -> list[Case]}, a folder's topics in their order;
- `ORDER`: where the folder's topics stand among every folder's (the suite's topic list, the
  README's performance table, `--only kernels`): norms first, then the loss, rotation,
  attention and the MLP. A number, with room between folders, so that a new fusion's topics go
  where they belong without a central edit.

The suite collects them (`fusionpass.fusions.modules("bench")`), sorted by ORDER. Like the
conformance cases, none of this decides compiled code: it is outside the source digest.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from fusionpass.conformance.attention_layers import StaticCacheDecode, make_layers

BF16 = torch.bfloat16


@dataclasses.dataclass
class Case:
    name: str  # the subgraph as models write it, and its shape
    # build(device, dtype) -> (module, inputs); floating inputs are made leaves in training
    build: Callable[[str, torch.dtype], tuple[nn.Module, tuple]]
    train: bool
    fusions: tuple[str, ...]  # the fusions on in the fusionpass column (names as the suite knows them)
    selected: bool  # whether the default cost rule selects this case
    settings: dict = dataclasses.field(default_factory=dict)  # fusionpass.backend(**settings)
    # also time fusionpass without this fusion (what one fusion adds on top of the ones it needs)
    without: str | None = None
    dtype: torch.dtype = BF16
    kwargs: dict = dataclasses.field(default_factory=dict)  # forward keyword inputs (HF models)
    # the size a measured cost rule reads (a row width, a vocabulary): set on the cases of a topic
    # whose table `benchmarks/suite.py --cost-tables` turns into the fusion's cost_table.py
    shape_class: int | None = None

    @property
    def mode(self) -> str:
        return "train" if self.train else "inference"


def on_device(device, make):
    """make() with parameters and buffers created on `device` (no multi-GiB init on the host)."""
    with torch.device(device):
        return make()


def rows_module(module_class, rows, width, **kw):
    """build(device, dtype) of module_class(width, **kw) over two inputs of rows x width (x and the
    residual)."""
    def build(device, dtype):
        module = on_device(device, lambda: module_class(width, **kw)).to(dtype)
        x, r = (torch.randn(rows, width, device=device, dtype=dtype) for _ in range(2))
        return module, (x, r)

    return build


def attention_layers(family, shape, padding=None, **options):
    """Two HF attention layers of `family` over the mask (and rotary, ALiBi, cache) their model
    builds, from the conformance suite (fusionpass/conformance/attention_layers.py)."""
    make = make_layers(family, shape, padding, **options)
    return lambda device, dtype: make(dtype, device)


def decode_step_case(shape, selected=True, settings=None):
    """A Llama static-cache decode step of `shape`, the cache full but for the step's token."""
    return Case(f"Llama static-cache decode step (sdpa) {shape}",
                attention_layers(StaticCacheDecode, shape, impl="sdpa", prompt=shape.s - 1), False,
                ("decode_attention",), selected, settings or {})
