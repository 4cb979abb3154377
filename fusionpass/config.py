"""Which fusions are on, their settings, and FUSIONPASS_* environment overrides.

Nothing here names a fusion: each fusion declares its name, run order and options in its own
module (`fusionpass.registry.Fusion`), and the settings of a `Config` are derived from those
declarations. A setting is `<prefix>_<option>` (e.g. `rms_norm_min_width`, `attention_kernel`),
overridden by FUSIONPASS_<SETTING> in the environment or by keyword arguments to
`fusionpass.backend(...)`.

A `Config` is immutable and hashable: it is part of every pass's `uuid()`, so two compiles with
different settings never share an FX-graph-cache entry.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from fusionpass import registry

_TRUE = ("1", "true", "on", "yes")


def fusion_names() -> tuple[str, ...]:
    """Every declared fusion, in the order the pass runs them."""
    return registry.fusion_names()


def __getattr__(name: str):
    # FUSION_NAMES stays importable (`from fusionpass.config import FUSION_NAMES`), derived from
    # the declarations when first read
    if name == "FUSION_NAMES":
        return fusion_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str  # the Config keyword, e.g. "rms_norm_min_width"
    fusion: str
    option: str  # the field of the fusion's options dataclass
    default: object
    doc: str

    @property
    def env(self) -> str:
        return f"FUSIONPASS_{self.name.upper()}"

    @property
    def env_long(self) -> str:
        return f"FUSIONPASS_{self.fusion.upper()}_{self.option.upper()}"


_SETTINGS: list = []  # [(registry.version(), settings)]: derived once per set of declarations


def settings() -> Mapping[str, Setting]:
    """Every fusion's settings, by Config keyword, in run order (read-only; derived again only
    after a fusion is registered or unregistered)."""
    version = registry.version()
    if _SETTINGS and _SETTINGS[0][0] == version:
        return _SETTINGS[0][1]
    out = {}
    for name, fusion in registry.registered().items():
        for key, field in fusion.settings().items():
            if key in out or key in ("fusions", "cpu"):
                raise ValueError(f"setting {key!r} of {name} is declared twice")
            out[key] = Setting(key, name, field.name, field.default, field.metadata.get("doc", ""))
    _SETTINGS[:] = [(version, MappingProxyType(out))]
    return _SETTINGS[0][1]


class Config:
    """fusions: the fusions on (default every declared one). cpu: match graphs whose tensors live
    on the CPU; the kernels are Triton kernels for CUDA and on CPU Inductor's own C++ code beats an
    opaque op, so by default CPU graphs are left alone (near miss "device cpu"). When on, the fused
    ops run their Triton kernels under the interpreter if TRITON_INTERPRET=1 (the tests), else a
    torch reference (`fusionpass explain` without a GPU). Every other keyword is a fusion's
    setting (`settings()`); unset ones take the fusion's defaults."""

    __slots__ = ("fusions", "cpu", "_values")

    def __init__(self, fusions: Iterable[str] | None = None, cpu: bool = False, **values):
        known = settings()
        unknown = set(values) - set(known)
        if unknown:
            raise TypeError(f"unknown setting(s) {sorted(unknown)}; known: fusions, cpu, {', '.join(known)}")
        names = fusion_names()
        fusions = frozenset(names if fusions is None else fusions)
        bad = fusions - set(names)
        if bad:
            raise ValueError(f"unknown fusion(s) {sorted(bad)}; known: {', '.join(names)}")
        object.__setattr__(self, "fusions", fusions)
        object.__setattr__(self, "cpu", bool(cpu))
        object.__setattr__(self, "_values", MappingProxyType({k: values.get(k, s.default) for k, s in known.items()}))

    def __getattr__(self, name):
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"Config has no setting {name!r}") from None

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def option(self, options: type, name: str):
        """The value of field `name` of the options dataclass `options` (a fusion's) in this config:
        what a cost rule's `cost.Field` bound reads."""
        return getattr(self, registry.setting_of(options, name))

    def options(self, fusion: str):
        """The options dataclass of `fusion` with this config's values."""
        declared = registry.registered()[fusion]
        values = dict(self._values)
        return declared.options(**{f.name: values[key] for key, f in declared.settings().items()})

    def _fields(self) -> dict:
        return {"fusions": self.fusions, "cpu": self.cpu, **dict(self._values)}

    def replace(self, **changes) -> Config:
        return Config(**{**self._fields(), **changes})

    def key(self) -> str:
        """A stable text form for cache keys."""
        fields = self._fields()
        fields["fusions"] = sorted(self.fusions)
        return repr(sorted(fields.items()))

    def __eq__(self, other):
        return isinstance(other, Config) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    def __reduce__(self):
        # Pickling and copying go through the constructor (frozen slots). The fusions go as a
        # sorted tuple: a frozenset's pickle follows the process's string hash seed, and torch 2.11
        # hashes pre_grad_custom_pass (our pass, holding this config) by its pickle into Inductor's
        # and AOTAutograd's cache keys, so a set made every second process miss both caches.
        return (_from_fields, ({**self._fields(), "fusions": tuple(sorted(self.fusions))},))

    def __repr__(self):
        known = settings()
        changed = {k: v for k, v in self._values.items() if k in known and v != known[k].default}
        return f"Config(fusions={sorted(self.fusions)}, cpu={self.cpu}" + "".join(
            f", {k}={v!r}" for k, v in changed.items()) + ")"


def _from_fields(fields: dict) -> Config:
    return Config(**fields)


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def _parse(value: str, default):
    if isinstance(default, bool):
        return value.lower() in _TRUE
    return type(default)(value)


def from_env(base: Config | None = None, environ=os.environ) -> Config:
    """Apply FUSIONPASS_FUSIONS (comma list, replaces the set), FUSIONPASS_DISABLE (comma list,
    removed from it), FUSIONPASS_CPU and FUSIONPASS_<SETTING> (or FUSIONPASS_<FUSION>_<OPTION>)
    for every declared setting over `base` (booleans: 1/true/on/yes, else off)."""
    cfg = base or Config()
    if "FUSIONPASS_FUSIONS" in environ:
        cfg = cfg.replace(fusions=frozenset(_split(environ["FUSIONPASS_FUSIONS"])))
    if "FUSIONPASS_DISABLE" in environ:
        cfg = cfg.replace(fusions=cfg.fusions - frozenset(_split(environ["FUSIONPASS_DISABLE"])))
    changes = {}
    if "FUSIONPASS_CPU" in environ:
        changes["cpu"] = environ["FUSIONPASS_CPU"].lower() in _TRUE
    for name, setting in settings().items():
        for var in (setting.env_long, setting.env):  # the short name wins where both are set
            if var in environ:
                changes[name] = _parse(environ[var], setting.default)
    return cfg.replace(**changes) if changes else cfg


def make(fusions: Iterable[str] | None = None, **overrides) -> Config:
    """The config for one backend: environment overrides first, then the caller's arguments."""
    cfg = from_env()
    if fusions is not None:
        cfg = cfg.replace(fusions=frozenset(fusions))
    return cfg.replace(**overrides) if overrides else cfg
