"""Cost rules as data: where a fusion is selected, per mode, as bounds its guards evaluate.

A rule's bound is a number or the name of a `Config` setting that holds it (so the bounds stay
user-settable: `rms_norm_min_width`, FUSIONPASS_RMS_NORM_MIN_WIDTH); the rule reads it from the
config it is checked against (`registry.default_settings()` where it is described). A fusion lists its
rules in `Fusion.cost`: `fusionpass list`, the README and docs/fusions.md state them from this
data, and its guards call `check`, whose reason states the rule ("row width 1024 outside
2048..8192 in training"). Why a rule exists, and the measurements behind it, are in the fusion's
`evidence` file (benchmarks/results/latest/<fusion>.md), not here.
"""
from __future__ import annotations

import dataclasses
from typing import Union

MODES = ("training", "inference")

Bound = Union[int, str, None]  # a number, a Config setting's name, or None: unbounded


def mode(training: bool) -> str:
    return "training" if training else "inference"


def _value(bound: Bound, cfg) -> int | None:
    """A bound's number: itself, or the value of the setting it names in `cfg` (a Config, or any
    object with the settings as attributes: `registry.Fusion.selection` passes the defaults)."""
    if isinstance(bound, str):
        if cfg is None:
            raise ValueError(f"the bound {bound!r} is a setting: checking or describing it needs the config")
        return getattr(cfg, bound)
    return bound


def _span(lo, hi, show=str) -> str:
    if lo is None:
        return f"at most {show(hi)}"
    if hi is None:
        return f"at least {show(lo)}"
    return f"{show(lo)}..{show(hi)}"


def _names(bounds) -> str:
    names = [b for b in bounds if isinstance(b, str)]
    return f" ({', '.join(names)})" if names else ""


@dataclasses.dataclass(frozen=True)
class Range:
    """`what` must lie in lo..hi (inclusive; None: unbounded) in each mode; a mode given None is
    not selected at all. `check(value, mode, cfg)` is the guard's test."""

    what: str  # the quantity, e.g. "row width", "rows"
    training: tuple[Bound, Bound] | None = (None, None)
    inference: tuple[Bound, Bound] | None = (None, None)
    unit: str = ""  # values are shown divided by `scale`, in `unit` (e.g. 2**20, "MiB")
    scale: int = 1

    @classmethod
    def always(cls, what: str, lo: Bound = None, hi: Bound = None, **kw) -> Range:
        """The same bounds in every mode (its reasons and description name no mode)."""
        return cls(what, (lo, hi), (lo, hi), **kw)

    def _show(self, value) -> str:
        if self.scale == 1:
            return f"{value}{' ' + self.unit if self.unit else ''}"
        return f"{value / self.scale:.3g} {self.unit}"

    def _modal(self) -> bool:
        return self.training != self.inference

    def bounds(self, mode: str, cfg=None) -> tuple[int | None, int | None] | None:
        declared = getattr(self, mode)
        return None if declared is None else (_value(declared[0], cfg), _value(declared[1], cfg))

    def check(self, value: int, mode: str, cfg=None) -> str | None:
        """The reason `value` is outside the rule in `mode`, else None."""
        bounds = self.bounds(mode, cfg)
        if bounds is None:
            return f"not selected in {mode}"
        lo, hi = bounds
        where = f" in {mode}" if self._modal() else ""
        if lo is not None and hi is not None and not lo <= value <= hi:
            return f"{self.what} {self._show(value)} outside {_span(lo, hi, self._show)}{where}"
        if lo is not None and value < lo:
            return f"{self.what} {self._show(value)} < {self._show(lo)}{where}"
        if hi is not None and value > hi:
            return f"{self.what} {self._show(value)} > {self._show(hi)}{where}"
        return None

    def describe(self, cfg=None) -> str:
        """The rule in words, with the defaults (or `cfg`'s values) and the settings holding them."""
        parts = []
        for m in MODES if self._modal() else MODES[:1]:
            declared = getattr(self, m)
            if declared is None:
                parts.append(f"not in {m}")
            elif declared != (None, None):
                where = f" in {m}" if self._modal() else ""
                parts.append(f"{_span(*self.bounds(m, cfg), self._show)}{_names(declared)}{where}")
        return f"{self.what} {', '.join(parts)}" if parts else ""


@dataclasses.dataclass(frozen=True)
class Excluded:
    """Values lo..hi (inclusive) of `what` are not selected in `modes`, for the reason `why` (a
    rule about the kernel, e.g. how it tiles such rows)."""

    what: str
    lo: Bound
    hi: Bound
    why: str
    modes: tuple[str, ...] = MODES

    def check(self, value: int, mode: str, cfg=None) -> str | None:
        lo, hi = _value(self.lo, cfg), _value(self.hi, cfg)
        if mode in self.modes and lo <= value <= hi:
            return f"{self.what} {value} in {lo}..{hi} in {mode} ({self.why})"
        return None

    def describe(self, cfg=None) -> str:
        lo, hi = _value(self.lo, cfg), _value(self.hi, cfg)
        return f"{self.what} not {lo}..{hi}{_names((self.lo, self.hi))} in {' or '.join(self.modes)} ({self.why})"


def autotuning() -> bool:
    """Whether Inductor autotunes this compile: torch.compile's modes "max-autotune" and
    "max-autotune-no-cudagraphs" set its max_autotune (in force while the pass runs); a user may set
    max_autotune_gemm alone."""
    from torch._inductor import config

    return bool(config.max_autotune or config.max_autotune_gemm)


@dataclasses.dataclass(frozen=True)
class NotAutotuned:
    """Not selected in `modes` while Inductor autotunes (`autotuning`), for the reason `why`. The
    registry checks it for every match, the mode being training where a tensor of the match
    requires grad."""

    why: str
    modes: tuple[str, ...] = ("training",)

    def check(self, mode: str, cfg=None) -> str | None:
        if mode in self.modes and autotuning():
            return f"Inductor autotunes (max-autotune) in {mode} ({self.why})"
        return None

    def describe(self, cfg=None) -> str:
        return f"not while Inductor autotunes (max-autotune) in {' or '.join(self.modes)} ({self.why})"


# Training under max-autotune measured slower with the norm, RoPE, mask and MLP fusions than
# without them, as a set; no ablation says which (an autotuning compile per fusion): so none of
# them is selected there until one does.
NOT_AUTOTUNED_TRAINING = NotAutotuned(
    "training measured slower with them than without, benchmarks/results/bench/modes.md")


@dataclasses.dataclass(frozen=True)
class Switch:
    """A boolean setting that, when on, selects every match whatever the other rules say."""

    setting: str
    what: str = "every match"

    def on(self, cfg) -> bool:
        return bool(_value(self.setting, cfg))

    def describe(self, cfg=None) -> str:
        return f"{self.setting}=True: {self.what}"


def describe(rules, cfg) -> str:
    """The rules of one fusion in words (`Fusion.cost`), joined, with `cfg`'s values of the settings
    they name."""
    return "; ".join(d for r in rules if (d := r.describe(cfg)))
