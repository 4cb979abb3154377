"""Cost rules as data: where a fusion is selected, per mode, as bounds its guards evaluate.

A rule's bound is a number or a field of the fusion's options dataclass (`fields(Options).min_width`),
which is a `Config` setting (so the bounds stay user-settable: `rms_norm_min_width`,
FUSIONPASS_RMS_NORM_MIN_WIDTH); the rule reads it from the config it is checked against, or takes
the field's default where no config is given (the docs). A fusion lists its
rules in `Fusion.cost`: `fusionpass list`, the README and docs/fusions.md state them from this
data, and its guards call `check`, whose reason states the rule ("row width 16384 outside
512..8192 in training"). Why a rule exists, and the measurements behind it, are in the fusion's
`evidence` file (benchmarks/results/latest/<fusion>.md), not here.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Union

MODES = ("training", "inference")



@dataclasses.dataclass(frozen=True)
class Field:
    """A field of a fusion's options dataclass, held by a cost rule: the config's value of that
    setting where the rule is checked (`Config.option`), its default where it is described."""

    options: type
    name: str
    default: object


def fields(options: type) -> SimpleNamespace:
    """Each field of an options dataclass as a `Field`, by name: a rule names a field that does not
    exist with an AttributeError where it is declared, not a wrong number where it is checked."""
    return SimpleNamespace(**{f.name: Field(options, f.name, f.default) for f in dataclasses.fields(options)})


Bound = Union[int, Field, None]  # a number, an options field, or None: unbounded


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The values a size can take where a rule is checked: one, where it is static; under dynamic
    shapes lo..hi (hi None: unbounded), the range the shape environment allows, and the hint, the
    value it was traced at (None where there is none)."""

    lo: int
    hi: int | None
    hint: int | None

    @classmethod
    def static(cls, value: int) -> Sizes:
        return cls(value, value, value)

    def show(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}..{'' if self.hi is None else self.hi}"


def mode(training: bool) -> str:
    return "training" if training else "inference"


def _value(bound: Bound, cfg) -> int | None:
    """A bound's number: itself, or its field's value in `cfg` (a Config; None: the default)."""
    if isinstance(bound, Field):
        return bound.default if cfg is None else cfg.option(bound.options, bound.name)
    return bound


def _span(lo, hi, show=str) -> str:
    if lo is None:
        return f"at most {show(hi)}"
    if hi is None:
        return f"at least {show(lo)}"
    return f"{show(lo)}..{show(hi)}"


def _names(bounds, names: Mapping[str, str]) -> str:
    """The settings holding `bounds`, by their Config names (`names`: options field -> setting)."""
    held = [names[b.name] for b in bounds if isinstance(b, Field)]
    return f" ({', '.join(held)})" if held else ""


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

    def check_sizes(self, sizes: Sizes, mode: str, cfg=None) -> str | None:
        """`check` over every value a symbolic size can take: None where all of them lie inside the
        rule, the reason where none does. Where the range straddles a bound, the rule decides at the
        hint, as Inductor tunes its own code for dynamic shapes at their hints: the replacement is
        exact at every size, so only its speed depends on the choice."""
        if sizes.lo == sizes.hi:
            return self.check(sizes.lo, mode, cfg)
        bounds = self.bounds(mode, cfg)
        if bounds is None:
            return f"not selected in {mode}"
        lo, hi = bounds
        if (lo is None or sizes.lo >= lo) and (hi is None or (sizes.hi is not None and sizes.hi <= hi)):
            return None
        where = f" in {mode}" if self._modal() else ""
        if (hi is not None and sizes.lo > hi) or (lo is not None and sizes.hi is not None and sizes.hi < lo):
            return f"{self.what} {sizes.show()} (symbolic) outside {_span(lo, hi, self._show)}{where}"
        if sizes.hint is None:
            return f"{self.what} {sizes.show()} (symbolic, no size hint) not within {_span(lo, hi, self._show)}{where}"
        why = self.check(sizes.hint, mode, cfg)
        return None if why is None else f"{why} (at the size hint; symbolic, {sizes.show()})"

    def describe(self, names: Mapping[str, str], cfg=None) -> str:
        """The rule in words, with the defaults (or `cfg`'s values) and the settings holding them
        (`names`: options field -> Config setting)."""
        parts = []
        for m in MODES if self._modal() else MODES[:1]:
            declared = getattr(self, m)
            if declared is None:
                parts.append(f"not in {m}")
            elif declared != (None, None):
                where = f" in {m}" if self._modal() else ""
                parts.append(f"{_span(*self.bounds(m, cfg), self._show)}{_names(declared, names)}{where}")
        return f"{self.what} {', '.join(parts)}" if parts else ""


@dataclasses.dataclass(frozen=True)
class Measured:
    """Selected in a mode where the measured shape class nearest the value (by ratio) was at least
    `least` times as fast as plain compile. `speedups`: mode -> {shape class: plain / fusionpass},
    the table a benchmark topic measured (the fusion folder's generated cost_table.py); `source`,
    its result file. Values outside the span of the measured classes, and modes without rows, are
    not selected: there is no measurement to stand on. `least` is a number or an options field (a
    user-settable bound); at 0 or below the rule is open."""

    what: str
    speedups: Mapping[str, Mapping[int, float]]
    source: str
    least: Bound = 1.0

    def nearest(self, value: int, mode: str) -> tuple[int, float] | None:
        rows = self.speedups.get(mode) or {}
        if not rows or not min(rows) <= value <= max(rows):
            return None
        measured = min(rows, key=lambda c: (abs(math.log(value / c)), c))
        return measured, rows[measured]

    def check(self, value: int, mode: str, cfg=None) -> str | None:
        least = _value(self.least, cfg)
        if least <= 0:
            return None
        rows = self.speedups.get(mode) or {}
        if not rows:
            return f"{self.what} {value}: not measured in {mode} ({self.source})"
        found = self.nearest(value, mode)
        if found is None:
            return f"{self.what} {value} outside the measured {min(rows)}..{max(rows)} in {mode} ({self.source})"
        measured, speedup = found
        if speedup >= least:
            return None
        return (f"{self.what} {value} in {mode}: at {measured}, the nearest measured, plain / fusionpass was "
                f"{speedup:.3g}, under {least:g} ({self.source})")

    def check_sizes(self, sizes: Sizes, mode: str, cfg=None) -> str | None:
        """Over a symbolic size: at its hint (else its lower bound), as Range.check_sizes decides."""
        return self.check(sizes.hint if sizes.hint is not None else max(sizes.lo, 1), mode, cfg)

    def describe(self, names: Mapping[str, str], cfg=None) -> str:
        least = _value(self.least, cfg)
        return (f"{self.what} where plain / fusionpass at the nearest measured class was at least {least:g}"
                f"{_names((self.least,), names)} ({self.source})")


@dataclasses.dataclass(frozen=True)
class Either:
    """Selected where either rule selects (e.g. a fusion leaner at large sizes and faster at some
    smaller ones); the reason names both."""

    first: Range | Measured
    second: Range | Measured

    def check(self, value: int, mode: str, cfg=None) -> str | None:
        first = self.first.check(value, mode, cfg)
        second = None if first is None else self.second.check(value, mode, cfg)
        return None if second is None else f"{first}; nor {second}"

    def check_sizes(self, sizes: Sizes, mode: str, cfg=None) -> str | None:
        first = self.first.check_sizes(sizes, mode, cfg)
        second = None if first is None else self.second.check_sizes(sizes, mode, cfg)
        return None if second is None else f"{first}; nor {second}"

    def describe(self, names: Mapping[str, str], cfg=None) -> str:
        return f"{self.first.describe(names, cfg)}, or {self.second.describe(names, cfg)}"


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

    def describe(self, names: Mapping[str, str], cfg=None) -> str:
        lo, hi = _value(self.lo, cfg), _value(self.hi, cfg)
        return f"{self.what} not {lo}..{hi}{_names((self.lo, self.hi), names)} in {' or '.join(self.modes)} ({self.why})"


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

    def describe(self, names: Mapping[str, str], cfg=None) -> str:
        return f"not while Inductor autotunes (max-autotune) in {' or '.join(self.modes)} ({self.why})"


# Training under max-autotune measured slower with the norm, RoPE, mask and MLP fusions than
# without them, as a set; no ablation says which (an autotuning compile per fusion): so none of
# them is selected there until one does.
NOT_AUTOTUNED_TRAINING = NotAutotuned(
    "training measured slower with them than without, benchmarks/results/bench/modes.md")


@dataclasses.dataclass(frozen=True)
class Switch:
    """A boolean setting that, when on, selects every match whatever the other rules say."""

    setting: Field
    what: str = "every match"

    def on(self, cfg) -> bool:
        return bool(_value(self.setting, cfg))

    def describe(self, names: Mapping[str, str], cfg=None) -> str:
        return f"{names[self.setting.name]}=True: {self.what}"


def describe(rules, names: Mapping[str, str], cfg=None) -> str:
    """The rules of one fusion in words (`Fusion.cost`), joined: with the defaults (or `cfg`'s
    values) of the options fields they hold and those fields' Config names (`names`)."""
    return "; ".join(d for r in rules if (d := r.describe(names, cfg)))
