"""One folder per fusion: `fusionpass/fusions/<fusion>/` holds its declaration and rewrite
(`pattern.py`), its custom ops (`op.py`, or any `*_op.py`), its own Triton kernels (`kernels.py`),
and, outside the source digest, its conformance cases (`cases.py`) and benchmark cases
(`bench.py`). Nothing central lists the folders: the registry, the ops package, `fusionpass check`
and the benchmark suite import what they find here. What several fusions share stays in the shared
packages: `fusionpass.patterns` (graph reading, masks, SDPA and eager attention forms, autocast),
`fusionpass.kernels` (the attention kernel family, rotation, norm helpers, launch checks, RNG) and
`fusionpass.ops` (host ops, autocast neutrality)."""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def names() -> list[str]:
    """The fusion folders, by name (over this package's __path__, which a test may extend with a
    folder of its own)."""
    return sorted({info.name for info in pkgutil.iter_modules(__path__) if info.ispkg})


def _is_op(module: str) -> bool:
    return module == "op" or module.endswith("_op")


def modules(kind: str) -> list[ModuleType]:
    """Every fusion folder's module of that kind, imported (importing a pattern module declares its
    fusion): "pattern", "cases", "bench", or "op" (each folder's `op` and `*_op` modules)."""
    found = []
    for name in names():
        folder = importlib.import_module(f"{__name__}.{name}")
        for info in sorted(pkgutil.iter_modules(folder.__path__), key=lambda i: i.name):
            if info.name == kind or (kind == "op" and _is_op(info.name)):
                found.append(importlib.import_module(f"{folder.__name__}.{info.name}"))
    return found
