"""The pass object installed into Inductor, its cache identity, and match statistics.

Why the pre-grad hook (`torch._inductor.config.pre_grad_custom_pass`), by evidence (CPU study on
torch 2.11 and 2.13; docs/architecture.md):
  - it sees the Dynamo graph once, before AOTAutograd, for inference *and* training. Replacing a
    subgraph there with a custom op that has `register_autograd` makes AOTAutograd trace our
    backward op into the backward graph, so forward and backward are both fused from one match;
  - it handles frozen weights, inputs without grad and dynamic shapes (`dynamic=True` turns a
    norm's eps into a SymFloat from `.item()`, which a custom op's `float` argument accepts);
  - ops are still device-neutral torch calls there (`F.scaled_dot_product_attention`,
    `F.dropout`); after AOTAutograd SDPA is a device-specific op, dropout is `inductor_random`, and
    a pattern traced on CPU would not match CUDA graphs;
  - the joint-graph hook needs one traced variant per requires-grad combination and cannot express
    inputs without grad; post-grad hooks see forward and backward apart and fused 0 training
    matches in the study.
The price: the graph is not normalized, so patterns read it through `fusionpass.patterns.graph`.

torch 2.11 takes one pass per hook (2.13 also takes a list), so there is one pass object for the
hook; it runs the enabled fusions in order and then a pass the user had installed there before.
Its `uuid()` covers our sources, the config and the torch/triton versions, so Inductor's FX graph
cache stays on and never serves code compiled by another version of a pattern or kernel. On a
cache hit the pass does not run (the cached code still calls our ops): statistics count what was
compiled, so match-count tests use fresh caches.
"""
from __future__ import annotations

import hashlib
import logging
import pathlib
import threading
import time
from collections import Counter

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import fusionpass.ops  # noqa: F401  (the custom ops the replacements call)
from fusionpass import registry
from fusionpass.config import Config
from fusionpass.patterns import autocast, masks
from fusionpass.patterns import graph as g

# TORCH_LOGS="fusionpass" (or logging.getLogger("fusionpass").setLevel(logging.INFO)): each graph's
# matches and near misses as the pass makes them; "+fusionpass" (DEBUG) adds the pass's own time per
# fusion. TORCH_LOGS takes any importable module's name; registering it also lets
# torch._logging.set_logs and TORCH_LOGS="help" know it where torch has that (private) registry.
_LOG = logging.getLogger("fusionpass")
try:
    torch._logging._internal.register_log("fusionpass", "fusionpass")
except AttributeError:  # a torch without the registry: TORCH_LOGS still takes the module name
    pass


def _log_record(record: registry.Record, nodes: int) -> None:
    if not _LOG.isEnabledFor(logging.INFO) or not (record.matches or record.near_misses or record.already_fast):
        return
    matched = ", ".join(f"{f}/{v} x{n}" for (f, v), n in sorted(record.matches.items())) or "nothing"
    _LOG.info("graph of %d nodes (compile %s): matched %s", nodes, record.compile_id, matched)
    for fusion, where, reason in record.near_misses:
        _LOG.info("  near miss: %s at %s: %s", fusion, where, reason)
    for fusion, where, note in record.already_fast:
        _LOG.info("  already fast: %s at %s: %s", fusion, where, note)

_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


# Package files that decide no compiled code: the command line, reports, benchmarks, generated docs, demo models and the
# conformance suite. They stay out of the digest, which is both the FX-cache key and the key the
# committed GPU conformance result must carry (fusionpass.conformance.gate), so editing a report
# or adding a conformance case neither invalidates users' caches nor the last GPU run.
_NOT_COMPILED = ("cli.py", "explain.py", "bench.py", "bench_cases.py", "bench_report.py", "demo.py", "reference.py",
                 "conformance/")
# In a fusion's folder (fusionpass.fusions), its conformance and benchmark cases.
_NOT_COMPILED_IN_FUSIONS = ("cases.py", "bench.py")


def _compiled(relative: pathlib.PurePath) -> bool:
    if relative.as_posix().startswith(_NOT_COMPILED):
        return False
    return not (relative.parts[0] == "fusions" and relative.name in _NOT_COMPILED_IN_FUSIONS)


def digest_files() -> list[pathlib.Path]:
    """The source files the digest covers: patterns, kernels, ops, fusions, config and this machinery."""
    return [p for p in sorted(_PACKAGE_DIR.rglob("*.py")) if _compiled(p.relative_to(_PACKAGE_DIR))]


def _source_digest() -> str:
    """sha256 of `digest_files()`, names and contents."""
    h = hashlib.sha256()
    for path in digest_files():
        h.update(str(path.relative_to(_PACKAGE_DIR)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


_SOURCE_DIGEST: str | None = None


def source_digest() -> str:
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        _SOURCE_DIGEST = _source_digest()
    return _SOURCE_DIGEST


class _Statistics:
    """Match counts per fusion and per variant, and near misses, since the last reset.

    Dynamo may abandon a compile and trace the frame again (e.g. with dynamic=True, once it has to
    specialize a float that our op takes): a record replaces those of an earlier attempt at the
    same compile, so an abandoned graph never counts. The graphs of one attempt all count: DDP's
    graph split (DDPOptimizer) compiles each subgraph under the one compile id.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._records: list[registry.Record] = []

    def add(self, record: registry.Record) -> None:
        with self._lock:
            if record.compile_id is not None:
                self._records = [r for r in self._records
                                 if r.compile_id != record.compile_id or r.attempt == record.attempt]
            self._records.append(record)

    @property
    def records(self) -> list[registry.Record]:
        with self._lock:
            return list(self._records)

    def _summed(self, field: str) -> Counter:
        out: Counter = Counter()
        for r in self.records:
            out.update(getattr(r, field))
        return out

    @property
    def variants(self) -> Counter:
        """Matches per (fusion, variant)."""
        return self._summed("matches")

    @property
    def searches(self) -> Counter:
        """Matches per (fusion, declared Variant.name)."""
        return self._summed("searches")

    @property
    def seconds(self) -> Counter:
        """The pass's own time per fusion, summed over its graphs."""
        return self._summed("seconds")

    @property
    def near_misses(self) -> list[tuple[str, str, str]]:
        return [m for r in self.records for m in r.near_misses]

    def per_fusion(self) -> dict[str, int]:
        out: Counter = Counter()
        for (fusion, _), n in self.variants.items():
            out[fusion] += n
        return dict(out)


STATISTICS = _Statistics()


class PreGradFusionPass(CustomGraphPass):
    """`pre_grad_custom_pass`: runs every enabled fusion over the Dynamo graph."""

    def __init__(self, config: Config, inner=None, replaced=None):
        self.config = config
        self.inner = inner  # a pass the user had installed on this hook before us
        self.replaced = replaced  # the hook's value before us, as the user set it (uninstall)

    def __call__(self, graph: fx.Graph) -> None:
        from torch._guards import CompileContext

        trace_id = CompileContext.current_trace_id()
        record = registry.Record() if trace_id is None else registry.Record(
            compile_id=str(trace_id.compile_id), attempt=trace_id.attempt)
        start = time.perf_counter()
        changed = autocast.make_explicit(graph) if self.config.fusions else 0
        record.seconds["(autocast casts)"] = time.perf_counter() - start
        changed += self._apply_fusions(graph, record, timed=True)
        if changed:
            start = time.perf_counter()
            _sort_and_lint(graph)
            record.seconds["(sort and lint)"] = time.perf_counter() - start
        start = time.perf_counter()
        if self.config.fusions and self._checkpointed_layers(graph, record):
            record.seconds["(checkpointed layers)"] = time.perf_counter() - start
        _log_record(record, len(graph.nodes))
        _LOG.debug("fusionpass pass over %d nodes (compile %s): %.1f ms; %s", len(graph.nodes),
                   record.compile_id, 1e3 * sum(record.seconds.values()),
                   ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in record.seconds.items()))
        STATISTICS.add(record)
        if self.inner is not None:
            self.inner(graph)

    def _apply_fusions(self, graph: fx.Graph, record, timed: bool) -> int:
        """Every enabled fusion over `graph`, in the registry's order (each one's seconds in
        `record` where `timed`): the number of edits."""
        changed = 0
        for name, fusion in registry.registered().items():
            if name in self.config.fusions:
                start = time.perf_counter()
                changed += registry.apply(fusion, graph, self.config, record)
                if timed:
                    record.seconds[name] = time.perf_counter() - start
        return changed

    def _checkpointed_layers(self, graph: fx.Graph, record) -> int:
        """Fuse again in the bodies of the checkpointed layers this graph calls, knowing what the
        call passes them. Inductor runs the pass on each body first, alone (`_recursive_pre_grad_passes`),
        where the autocast state at the call and the mask the model built are unknown: its linears
        keep autocast's casts implicit, and its attention mask is an unprovable input. Here both
        come from this graph: autocast's casts under the state at the call, and masks proven
        through the call's operands (patterns/masks.proven_in_caller)."""
        bodies = g.checkpointed_bodies(graph)
        at = autocast.states(graph) if bodies else {}
        changed = 0
        for body, arguments, call in bodies:
            edits = autocast.make_explicit(body.graph, at.get(call))
            with masks.proven_in_caller(arguments):
                edits += self._apply_fusions(body.graph, record, timed=False)
            if edits:
                _sort_and_lint(body.graph)
                body.recompile()
            changed += edits
        return changed

    def uuid(self) -> str:
        import triton

        parts = [
            "fusionpass-pre-grad",
            source_digest(),
            self.config.key(),
            torch.__version__,
            triton.__version__,
        ]
        if self.inner is not None:
            inner_uuid = getattr(self.inner, "uuid", lambda: None)()
            if inner_uuid is None:
                # The user's pass cannot be keyed: neither can we (Inductor then bypasses the cache).
                return None
            parts.append(repr(inner_uuid))
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _sort_and_lint(graph: fx.Graph) -> None:
    from torch._inductor.pattern_matcher import stable_topological_sort

    stable_topological_sort(graph)
    graph.lint()


def chained(config: Config, existing) -> PreGradFusionPass:
    """Our pass in front of whatever is on the hook already (never ourselves twice)."""
    if isinstance(existing, PreGradFusionPass):
        existing = existing.replaced
    replaced = existing
    if isinstance(existing, (list, tuple)):
        existing = _Sequence(tuple(existing)) if existing else None
    return PreGradFusionPass(config, existing, replaced)


class _Sequence(CustomGraphPass):
    """Several user passes (torch >= 2.13 accepts a list on a hook) seen as one."""

    def __init__(self, passes):
        self.passes = passes

    def __call__(self, graph):
        for p in self.passes:
            p(graph)

    def uuid(self):
        uuids = [getattr(p, "uuid", lambda: None)() for p in self.passes]
        return None if any(u is None for u in uuids) else repr(uuids)
