"""`fusionpass.explain(model, *inputs)`: compile once, report what matched where and what almost did."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from collections import Counter

import torch

from fusionpass import config as config_mod
from fusionpass import registry
from fusionpass.passes import STATISTICS


@dataclasses.dataclass
class Report:
    matches: dict[str, int]  # per fusion
    variants: dict[tuple[str, str], int]  # per (fusion, variant)
    near_misses: list[tuple[str, str, str]]  # (fusion, where, reason)
    graphs: int
    graph_breaks: int
    device: str
    enabled: tuple[str, ...]
    # the pass's own seconds per fusion over every graph (pattern matching, guards, rewrites; not
    # Inductor's compile of what the rewrites produce)
    pass_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # (fusion, where, note): calls already in the form a fusion would give them, so nothing to
    # rewrite (an SDPA call with is_causal=True and no mask); neither matches nor near misses
    already_fast: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    # what the user could change for more of a fusion's gain (not about the pass's own choices)
    hints: list[str] = dataclasses.field(default_factory=list)
    # (where, kernel, why) for each attention call: which kernel runs for it and why
    attention: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "matches": self.matches,
            "variants": {f"{f}/{v}": n for (f, v), n in sorted(self.variants.items())},
            "near_misses": [
                {"fusion": f, "where": w, "reason": r} for f, w, r in self.near_misses
            ],
            "graphs": self.graphs,
            "graph_breaks": self.graph_breaks,
            "device": self.device,
            "enabled": list(self.enabled),
            "pass_seconds": {k: round(v, 4) for k, v in self.pass_seconds.items()},
            "already_fast": [
                {"fusion": f, "where": w, "note": n} for f, w, n in self.already_fast
            ],
            "hints": list(self.hints),
            "attention": [{"where": w, "kernel": k, "why": y} for w, k, y in self.attention],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        declared = registry.registered()
        lines = [
            f"fusionpass explain: {self.graphs} graph(s), {self.graph_breaks} graph break(s), "
            f"device {self.device}"
        ]
        if self.device == "cpu":
            lines.append(
                "  (CPU graphs: matches are shown as they would be made for CUDA tensors; by "
                "default fusionpass leaves CPU graphs to Inductor)"
            )
        rows = []
        for name in declared:  # in run order
            if name not in self.enabled:
                status = "disabled"
            else:
                status = ", ".join(
                    f"{v}: {n}" for (f, v), n in sorted(self.variants.items()) if f == name
                ) or "-"
            rows.append((name, str(self.matches.get(name, 0)), status))
        lines += _table(("fusion", "matches", "variants"), rows)
        if self.pass_seconds:
            spent = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(self.pass_seconds.items(), key=lambda kv: -kv[1]))
            lines.append(f"pass time: {1e3 * sum(self.pass_seconds.values()):.1f} ms ({spent} ms)")
        if self.already_fast:
            lines.append("")
            lines.append("already fast (nothing to rewrite):")
            lines += [f"  {f}: {note} in {n} call(s)"
                      for (f, note), n in Counter((f, note) for f, _, note in self.already_fast).items()]
        if self.attention:
            lines.append("")
            lines.append("attention calls (which kernel runs, and why):")
            lines += _table(("where", "kernel", "why"), self.attention)
        if self.hints:
            lines.append("")
            lines.append("hints:")
            lines += [f"  {h}" for h in self.hints]
        if self.near_misses:
            lines.append("")
            lines.append("near misses (left to Inductor):")
            lines += _table(("fusion", "where", "reason"), self.near_misses)
        return "\n".join(lines)


def _table(header, rows) -> list[str]:
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [header, tuple("-" * w for w in widths), *rows]
    return [fmt.format(*r).rstrip() for r in lines]


def _device_of(model, args) -> str:
    for t in [*args, *(p for p in getattr(model, "parameters", lambda: [])())]:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


@contextlib.contextmanager
def fresh_compile_caches():
    """Compile for real: a cache hit would skip our pass and report nothing."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    patches = [inductor_config.patch(fx_graph_cache=False)]
    if hasattr(functorch_config, "enable_autograd_cache"):
        patches.append(functorch_config.patch(enable_autograd_cache=False))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def explain(model, *args, fusions=None, train: bool | None = None, **kwargs) -> Report:
    """Compile `model` with the fusionpass backend, run it once on the inputs, and report.

    Resets Dynamo's caches and fusionpass.stats() first (so every graph is compiled afresh). `train` (default:
    `model.training`) runs the forward with grad enabled, as a training step would trace it.
    CPU models are matched as if their tensors were on CUDA (see Report).
    """
    from fusionpass.backend import FusionpassBackend

    device = _device_of(model, args)
    cfg = config_mod.make(fusions, cpu=True) if device == "cpu" else config_mod.make(fusions)
    train = getattr(model, "training", False) if train is None else train
    torch._dynamo.reset()
    STATISTICS.reset()
    breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
    compiled = torch.compile(model, backend=FusionpassBackend(cfg))
    with fresh_compile_caches(), torch.set_grad_enabled(train):
        out = compiled(*args, **kwargs)
    records = STATISTICS.records
    matches = STATISTICS.per_fusion()
    return Report(
        matches=matches,
        variants=dict(STATISTICS.variants),
        near_misses=STATISTICS.near_misses,
        graphs=len(records),
        graph_breaks=sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks_before,
        device=device,
        enabled=tuple(n for n in config_mod.FUSION_NAMES if n in cfg.fusions),
        pass_seconds=dict(STATISTICS.seconds),
        already_fast=[note for r in records for note in r.already_fast],
        hints=_hints(model, out, STATISTICS.near_misses, train, cfg.fusions),
        attention=attention_calls(records),
    )


AS_WRITTEN = "as written (torch SDPA with its mask, or the model's own ops)"


def attention_calls(records) -> list[tuple[str, str, str]]:
    """(where, kernel, why) per attention call: the kernel an attention fusion chose
    (`Fusion.kernel`), the SDPA call already in its fast form, or, where every attention fusion
    passed it by, the call as written with their near misses as the reason."""
    declared = registry.registered()
    attention = {name for name, f in declared.items() if f.kernel is not None}
    out = []
    for r in records:
        chosen = {}
        for fusion, at, kernel, variant in r.kernels:
            chosen.setdefault(at, (kernel, f"{fusion} matched ({variant})"))
        for fusion, at, note in r.already_fast:
            chosen.setdefault(at, ("SDPA as written (torch picks its kernel)", note))
        missed: dict[str, list[str]] = {}
        for fusion, at, reason in r.near_misses:
            if fusion in attention and at not in chosen:
                missed.setdefault(at, []).append(f"{fusion}: {reason}")
        out += [(at, kernel, why) for at, (kernel, why) in chosen.items()]
        out += [(at, AS_WRITTEN, "; ".join(reasons)) for at, reasons in missed.items()]
    return out


def _hints(model, out, near_misses, train: bool, enabled) -> list[str]:
    """What each enabled fusion suggests for the near misses it had (`Fusion.hint`)."""
    hints = []
    for name, fusion in registry.registered().items():
        if fusion.hint is not None and name in enabled:
            line = fusion.hint(model, out, near_misses, train)
            if line:
                hints.append(line)
    return hints
