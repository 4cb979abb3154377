"""How a fusion is declared, and the one loop that applies every declared fusion to a graph.

A fusion is data:
  - `anchor`: a cheap test that picks the node a match starts from (e.g. the `rsqrt` of a norm);
  - `variants`: search functions, one per way real models write the subgraph; each takes the
    anchor and returns a `Match` or None, or raises `NearMiss` when it recognised the subgraph but
    cannot use it;
  - `guards`: small named checks that say "safe and faster here"; the first failing one records a
    near miss with its reason and the graph is left alone;
  - `replace`: rewrites the graph for a match that passed every guard;
  - `after`: the fusions it runs after, and `options`: its settings (a frozen dataclass), from
    which `fusionpass.config` derives Config's settings and their environment overrides;
  - `cost`: its cost rules as data (`fusionpass.cost`), which its guards evaluate and from which
    the text saying where it is selected is generated.
Every fusion folder's `pattern.py` (fusionpass.fusions) is imported on first use, and each declares
its fusion with `register(Fusion(...))` (docs/architecture.md); all reuse this loop, the near-miss
reasons and the per-fusion/per-variant counts without copying them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fusionpass import cost as cost_rules
from fusionpass import fusions
from fusionpass.ops.autocast import make_neutral as autocast_neutral_ops
from fusionpass.patterns.graph import tensor, tensor_subclass, where

if TYPE_CHECKING:
    from fusionpass.config import Config


class NearMiss(Exception):
    """Raised by a search function that recognised the subgraph but cannot prove it is safe."""


@dataclasses.dataclass
class Match:
    variant: str  # the `Variant.name` of the search that found it (stats() and `fusionpass list`)
    anchor: fx.Node
    nodes: list[fx.Node]  # every node the replacement makes dead
    bindings: dict[str, Any]  # what the replacement and the guards read


@dataclasses.dataclass(frozen=True)
class Guard:
    name: str
    check: Callable[[Match, Config], str | None]  # a reason when it fails, else None


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    search: Callable[[fx.Node], Match | None]
    # tried only where this holds for the config (an opt-in route); None: always
    when: Callable[[Config], bool] | None = None
    # finds subgraphs only so that a guard can report them as near misses; never replaces (no
    # conformance case can match it, fusionpass.conformance.gate)
    reports_only: bool = False
    # False: a guard refuses its matches on CUDA tensors (the route is CPU only; say why there), so
    # the GPU conformance suite has no case for it
    cuda: bool = True


@dataclasses.dataclass(frozen=True)
class Fusion:
    name: str
    matches: str  # what it matches, in words (`fusionpass list`)
    # when it is selected, in words, beyond its cost rules (`cost`, stated from their data):
    # devices, dtypes, shapes the kernels take; no numbers that a cost rule holds
    selected_when: str
    anchor: Callable[[fx.Node], bool]
    variants: tuple[Variant, ...]
    guards: tuple[Guard, ...]
    replace: Callable[[fx.Graph, Match, Config], None]
    # reported when the anchor was found but no variant matched it; a function of the anchor where
    # that depends on it; None (or a None from the function) where another fusion that runs later
    # takes the nodes this one leaves (the attention fusions share SDPA's anchor)
    unmatched: str | Callable[[fx.Node], str | None] | None = "no known variant matches the surrounding ops"
    # fusions whose rewrites this one must see (it runs after them; `fusion_names()`)
    after: tuple[str, ...] = ()
    # A note for a node that is not an anchor because it already has the form the rewrite would
    # give it (an SDPA call transformers made with is_causal=True and no mask), else None: recorded
    # as information (explain's "already fast"), neither a match nor a near miss
    already_fast: Callable[[fx.Node], str | None] | None = None
    # Whether its ops have DTensor sharding rules (torch.distributed.tensor.experimental
    # .register_sharding, in the op's module): a match over DTensors then goes ahead, and DTensor
    # runs the op on each rank's shard. Without them a DTensor is a near miss (tensor subclass).
    dtensor: bool = False
    # The fusion's settings: a frozen dataclass whose fields have defaults and a `doc` in their
    # metadata (`option`). Each field is a `Config` setting named `<settings_prefix>_<field>`
    # (settings_prefix: the fusion's name unless given) with the environment override
    # FUSIONPASS_<SETTING> (also FUSIONPASS_<FUSION>_<FIELD>).
    options: type | None = None
    settings_prefix: str | None = None
    # Its cost rules (`fusionpass.cost.Range`, `Excluded`, `Switch`): bounds per mode, read from
    # the config where a bound names a setting; its guards call their `check`. `NotAutotuned`
    # rules are checked by `apply` for every match.
    cost: tuple = ()
    # One line for the README's table (`fusionpass list --markdown`): what it matches
    summary: str = ""
    # The result file whose measurements the cost rules rest on; derived from the name
    # (benchmarks/results/latest/<name>.md) unless given
    evidence: str = ""
    # Which kernel runs for a match, in words (explain's attention calls: "which kernel runs for
    # each attention call and why"), or None where the fusion does not choose one
    kernel: Callable[[Match, Config], str] | None = None
    # A line for explain's hints, or None: what the user can change so that this fusion applies to
    # a model it missed, from (model, its output, the near misses, whether it was a training run)
    hint: Callable[[object, object, list, bool], str | None] | None = None

    def __post_init__(self):
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"fusion name {self.name!r} is not a lower-case identifier")
        if not self.evidence:
            object.__setattr__(self, "evidence", f"benchmarks/results/latest/{self.name}.md")
        if self.options is not None and not (dataclasses.is_dataclass(self.options)
                                             and self.options.__dataclass_params__.frozen):
            raise TypeError(f"{self.name}: options must be a frozen dataclass")

    def settings(self) -> dict[str, dataclasses.Field]:
        """{Config setting name: its options field}."""
        if self.options is None:
            return {}
        prefix = self.settings_prefix or self.name
        return {f"{prefix}_{f.name}": f for f in dataclasses.fields(self.options)}

    def selection(self) -> str:
        """When it is selected, in words: its cost rules (from their data, with the defaults and
        the settings holding them), then `selected_when`."""
        names = {f.name: key for key, f in self.settings().items()}  # options field -> Config setting
        return "; ".join(t for t in (cost_rules.describe(self.cost, names), self.selected_when) if t)


def option(default, doc: str):
    """A field of a fusion's options dataclass: its default and one line saying what it does."""
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass
class Record:
    """What one pass over one graph found."""

    compile_id: str | None = None  # Dynamo's compile id (frame and recompile, not the attempt)
    attempt: int = 0  # Dynamo's attempt at that compile (it restarts an analysis with attempt + 1)
    matches: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    # the same matches by (fusion, Variant.name of the search that found them); equal to `matches`
    # where every Match names its own Variant, as the conformance gate's coverage expects
    searches: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    near_misses: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    # (fusion, where, note) for nodes already in the fused form (`Fusion.already_fast`)
    already_fast: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    # seconds the pass spent on each fusion (finding, guarding and replacing its matches)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # (fusion, where, kernel, variant) for each match of a fusion that says which kernel runs
    kernels: list[tuple[str, str, str, str]] = dataclasses.field(default_factory=list)

    def matched(self, fusion: str, variant: str, search: str) -> None:
        key = (fusion, variant)
        self.matches[key] = self.matches.get(key, 0) + 1
        self.searches[(fusion, search)] = self.searches.get((fusion, search), 0) + 1

    def missed(self, fusion: str, node: fx.Node, reason: str) -> None:
        self.near_misses.append((fusion, where(node), reason))

    def noted(self, fusion: str, node: fx.Node, note: str) -> None:
        self.already_fast.append((fusion, where(node), note))


_FUSIONS: dict[str, Fusion] = {}
# what is derived from _FUSIONS (run order, registered(), Config's settings), dropped by
# register/unregister; `version()` tells derived caches elsewhere (fusionpass.config) to drop theirs
_DERIVED: dict[str, Any] = {}
_VERSION = [0]


def _changed() -> None:
    _DERIVED.clear()
    _VERSION[0] += 1


def version() -> int:
    """A number that changes whenever a fusion is registered or unregistered."""
    _load()
    return _VERSION[0]


def register(fusion: Fusion) -> Fusion:
    if fusion.name in _FUSIONS and _FUSIONS[fusion.name] is not fusion:
        raise ValueError(f"fusion {fusion.name!r} is already registered")
    if _FUSIONS.get(fusion.name) is not fusion:
        _FUSIONS[fusion.name] = fusion
        _changed()
    return fusion


def unregister(name: str) -> None:
    """Remove a fusion (tests that declare one of their own)."""
    if _FUSIONS.pop(name, None) is not None:
        _changed()


def registered() -> Mapping[str, Fusion]:
    """Declared fusions, in the order their passes run (`fusion_names()`); read-only."""
    _load()
    if "registered" not in _DERIVED:
        _DERIVED["registered"] = MappingProxyType({n: _FUSIONS[n] for n in fusion_names()})
    return _DERIVED["registered"]


def setting_of(options: type, field: str) -> str:
    """The Config setting of field `field` of the options dataclass `options` (a registered fusion's)."""
    if "settings_of" not in _DERIVED:
        _DERIVED["settings_of"] = {(f.options, spec.name): key for f in registered().values()
                                   for key, spec in f.settings().items()}
    try:
        return _DERIVED["settings_of"][options, field]
    except KeyError:
        raise ValueError(f"{options.__qualname__}.{field} is no registered fusion's setting") from None


def fusion_names() -> tuple[str, ...]:
    """Every declared fusion, in run order: each after the fusions it names in `after`, ties by
    name (so the order does not depend on which module was imported first)."""
    _load()
    if "order" not in _DERIVED:
        _DERIVED["order"] = _run_order()
    return _DERIVED["order"]


def _run_order() -> tuple[str, ...]:
    import heapq

    waiting = {}
    for name, fusion in _FUSIONS.items():
        unknown = set(fusion.after) - set(_FUSIONS)
        if unknown:
            raise ValueError(f"fusion {name!r} runs after unknown fusion(s) {sorted(unknown)}")
        waiting[name] = set(fusion.after)
    ready = [n for n, deps in waiting.items() if not deps]
    heapq.heapify(ready)
    order = []
    while ready:
        name = heapq.heappop(ready)
        order.append(name)
        for other, deps in waiting.items():
            if name in deps:
                deps.discard(name)
                if not deps:
                    heapq.heappush(ready, other)
    if len(order) != len(waiting):
        raise ValueError(f"fusions run after each other in a cycle: {sorted(set(waiting) - set(order))}")
    return tuple(order)


_LOADED: list = []  # [the fusions package's search path when its folders were last imported]


def _load() -> None:
    # Importing every fusion folder's pattern module declares the fusions: a new fusion's folder
    # needs no list to be added to (fusionpass.fusions). A folder added to the package's search
    # path later (a test's toy fusion) is imported at the next call.
    path = tuple(fusions.__path__)
    if _LOADED and _LOADED[0] == path:
        return
    fusions.modules("pattern")
    fusions.modules("op")  # the ops the rewrites call
    autocast_neutral_ops()  # those of a folder found after fusionpass.ops was imported too
    _LOADED[:] = [path]


def _is_erased(node: fx.Node) -> bool:
    return getattr(node, "_erased", False)


def _not_autotuned(fusion: Fusion, match: Match, config: Config) -> str | None:
    """The reason of a `NotAutotuned` cost rule of the fusion (read for every match here, not by
    each fusion's guards: it depends on the compile, not on the match's shapes)."""
    rules = [r for r in fusion.cost if isinstance(r, cost_rules.NotAutotuned)]
    if not rules:
        return None
    differentiated = any(getattr(tensor(n), "requires_grad", False) for n in (match.anchor, *match.nodes))
    training = cost_rules.mode(differentiated)
    why = next((w for r in rules if (w := r.check(training, config)) is not None), None)
    return None if why is None else f"cost: {why}"


def apply(fusion: Fusion, graph: fx.Graph, config: Config, record: Record) -> int:
    """Find every anchor of `fusion` in `graph`, match, guard, replace. Returns the match count."""
    count = 0
    for node in list(graph.nodes):
        if _is_erased(node):
            continue
        if not fusion.anchor(node):
            note = fusion.already_fast(node) if fusion.already_fast is not None else None
            if note is not None:
                record.noted(fusion.name, node, note)
            continue
        match = found_by = None
        try:
            for found_by in fusion.variants:
                if found_by.when is not None and not found_by.when(config):
                    continue
                match = found_by.search(node)
                if match is not None:
                    break
        except NearMiss as miss:
            record.missed(fusion.name, node, str(miss))
            continue
        if match is None:
            why = fusion.unmatched(node) if callable(fusion.unmatched) else fusion.unmatched
            if why is not None:
                record.missed(fusion.name, node, why)
            continue
        reason = tensor_subclass([match.anchor, *match.nodes], dtensor_ok=fusion.dtensor)
        reason = f"tensor subclass: {reason}" if reason is not None else _not_autotuned(fusion, match, config)
        reason = reason if reason is not None else next(
            (
                f"{guard.name}: {why}"
                for guard in fusion.guards
                if (why := guard.check(match, config)) is not None
            ),
            None,
        )
        if reason is not None:
            record.missed(fusion.name, node, reason)
            continue
        kernel = fusion.kernel(match, config) if fusion.kernel is not None else None
        at = where(node)
        fusion.replace(graph, match, config)
        record.matched(fusion.name, match.variant, found_by.name)
        if kernel is not None:
            record.kernels.append((fusion.name, at, kernel, match.variant))
        count += 1
    return count
