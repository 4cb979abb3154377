"""Side-by-side timing: versions run interleaved (A B A B ...) in one process, medians reported.

The helpers are used by the benchmark suite (benchmarks/suite.py) and by `fusionpass bench`, whose
model steps and run follow them (`bench_model`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

import fusionpass
from fusionpass import registry
from fusionpass.cost import MODES, Either, Field, Measured, Range
from fusionpass.explain import fresh_compile_caches


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cuda_graph_ms(fn: Callable[[], object], rounds: int = 5, replays: int = 20) -> float:
    """Median milliseconds of one fn() replayed from a CUDA graph: the launches' host cost stays
    out (GPU-bound kernel timing). fn is warmed up on a side stream first, as capture requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    return statistics.median(samples)


def time_interleaved(
    fns: dict[str, Callable[[], object]], device: str, rounds: int = 5, iters: int = 10, warmup: int = 3,
    on_round: Callable[[int], None] | None = None, min_sample_ms: float = 0.0,
) -> dict[str, float]:
    """Median milliseconds per call of each fn; each round times every fn once, in turn.
    `on_round(i)` is called before round i (0-based) starts: progress for long runs.
    `min_sample_ms`: more iterations per sample where `iters` calls of the slowest fn would take
    less (one untimed-for-the-result call of each fn measures them): short steps get samples as
    long as long steps', so a round is not a handful of milliseconds of a noisy machine."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    if min_sample_ms > 0:
        slowest = 0.0
        for fn in fns.values():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            slowest = max(slowest, (time.perf_counter() - t0) * 1e3)
        iters = max(iters, math.ceil(min_sample_ms / max(slowest, 1e-3)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds):
        if on_round is not None:
            on_round(i)
        for name, fn in fns.items():
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                samples[name].append((time.perf_counter() - t0) * 1e3 / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def spread(fns: dict[str, Callable[[], object]], device: str, **kw) -> dict[str, tuple[float, float]]:
    """(median, max/min - 1) per fn over rounds: how much to trust a difference."""
    raw = {name: [] for name in fns}
    for _ in range(kw.pop("repeats", 3)):
        for name, ms in time_interleaved(fns, device, **kw).items():
            raw[name].append(ms)
    return {n: (statistics.median(v), max(v) / min(v) - 1) for n, v in raw.items()}


def peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on the GPU above what was allocated before the call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def kernel_time(fn: Callable[[], object], iters: int = 10) -> float:
    """GPU kernel milliseconds per call: the profiler's summed device self time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    # Only the kernels themselves: an op's entry also carries the device time of the kernels it
    # launched, so summing every entry would count each kernel twice.
    total_us = sum(
        e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return total_us / 1e3 / iters


def floating_outputs(out) -> list[torch.Tensor]:
    """The floating tensors of a module's output (a tensor, a tuple of them, or an HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in floating_outputs(o)]
    return []


def training_step(fn: Callable, *args, leaves=(), **kwargs) -> Callable[[], object]:
    """One forward and backward of `fn(*args, **kwargs)`: the `loss` of an HF output, else every
    floating output against fixed random cotangents (made on the first call, so the timed calls
    do not draw them). `leaves` (inputs and parameters) get their .grad set to None first: assigned,
    not accumulated, so the step has no extra add kernels."""
    cotangents: list[torch.Tensor] = []

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*args, **kwargs)
        loss = getattr(out, "loss", None)
        if loss is not None:
            loss.backward()
            return out
        outs = [o for o in floating_outputs(out) if o.requires_grad]
        if not cotangents:
            gen = torch.Generator(device=outs[0].device).manual_seed(0)
            cotangents.extend(torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outs)
        torch.autograd.backward(outs, cotangents)
        return out

    return step


def inference_step(fn: Callable, *args, **kwargs) -> Callable[[], object]:
    def step():
        with torch.no_grad():
            return fn(*args, **kwargs)

    return step


def first_call_seconds(fn: Callable[[], object], device: str) -> float:
    """Wall seconds of one call (the first call of a compiled step is its compile)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def warm_up_compiler(device: str) -> None:
    """Compile something small first, so neither side's compile time pays for importing and
    initializing Inductor and Triton."""
    f = torch.compile(lambda t: torch.nn.functional.silu(t) * 2)
    f(torch.randn(64, device=device))


def environment() -> dict:
    """What a committed result table must say about where it was measured."""
    import triton

    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
    }


# ---------------------------------------------------------------------------------------------
# `fusionpass bench`: a model's training step, inference forward and greedy generate(), compiled
# by plain torch.compile and by fusionpass (and, for an ablation, by fusionpass with each matched
# fusion alone), all timed interleaved in one process.
#
# Every version compiles the same module (one set of weights): a version is a torch.compile wrapper
# with its own backend, and Dynamo keeps one cache entry per backend on the model's code. The run
# raises Dynamo's recompile limits for that, and makes hitting them an error, so a version can never
# fall back to eager without saying so.


STEPS = ("train", "infer", "generate")
DEFAULT_STEPS = ("train", "infer")
MODES_OF_COMPILE = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PLAIN = "torch.compile"
FUSIONPASS = "fusionpass"


@dataclasses.dataclass
class Subject:
    """The model under test and what its steps feed it."""

    model: torch.nn.Module
    task: str  # "causal-lm", "masked-lm", "seq-cls" (fusionpass.demo.TASKS)
    vocab: int
    can_generate: bool
    description: str  # one line: class, Auto class, sizes
    source: str  # where its config came from
    changes: list[str] = dataclasses.field(default_factory=list)  # what the overrides changed

    @classmethod
    def from_hf(cls, built) -> Subject:
        """A `fusionpass.demo.BuiltModel`."""
        return cls(built.model, built.task, built.config.vocab_size, built.can_generate, built.describe(),
                   built.source, built.changes)

    @classmethod
    def demo(cls, layers: int, width: int, device: str, dtype: torch.dtype) -> Subject:
        """The built-in Llama-style model (no transformers): train and infer, no generate()."""
        from fusionpass.demo import build

        model = build("demo", layers=layers, width=width).to(device=device, dtype=dtype)
        return cls(model, "causal-lm", model.lm_head.out_features, False,
                   f"DemoLlama (fusionpass.demo, built in), layers {layers}, hidden {width}", "fusionpass.demo")

    def why_no_generate(self) -> str:
        return (f"{self.task} models do not generate (a causal LM does)" if self.task != "causal-lm"
                else f"{type(self.model).__name__} has no generate()")


@dataclasses.dataclass
class BenchOptions:
    steps: tuple[str, ...] = DEFAULT_STEPS
    batch: int = 4
    seq: int = 512  # tokens per sequence; generate's prompt length
    new_tokens: int = 32  # generate's greedy tokens
    cache: str = "static"  # generate's KV cache: "static" (StaticCache) or "dynamic" (DynamicCache)
    mode: str | None = None  # torch.compile's mode, the same for every version
    device: str = "cpu"
    rounds: int = 5
    iters: int = 10  # calls per round and version (generate: one call per round)
    warmup: int = 2
    ablation: tuple[str, ...] = ()  # the steps that also time each matched fusion alone
    open_cost_rules: bool = False  # open_cost_rules() under `settings`
    settings: dict = dataclasses.field(default_factory=dict)  # fusionpass.backend(**settings)

    def backend_settings(self) -> dict:
        return {**(open_cost_rules() if self.open_cost_rules else {}), **self.settings}


@dataclasses.dataclass(frozen=True)
class Version:
    """One way of compiling: plain torch.compile (fusions None) or fusionpass with `fusions`
    (None inside `fusionpass`: the default set)."""

    name: str
    fusionpass: bool
    fusions: tuple[str, ...] | None = None

    def backend(self, opts: BenchOptions):
        if not self.fusionpass:
            return "inductor"
        return fusionpass.backend(fusions=self.fusions, cpu=opts.device == "cpu", **opts.backend_settings())


@dataclasses.dataclass
class BenchResult:
    subject: Subject
    options: BenchOptions
    rows: list[dict]
    notes: list[str]


def say(message: str) -> None:
    """Progress, on stderr (stdout carries the table)."""
    print(f"[fusionpass bench] {message}", file=sys.stderr, flush=True)


def open_cost_rules() -> dict[str, int]:
    """Settings that open every cost-rule bound held in a setting (lower bounds and measured
    rules' least speedups 0, upper bounds unlimited): at the tiny sizes a CPU run can afford, the
    GPU-measured rules would keep most fusions out. Opt-in switches (`rope_kernel`, ...) and kernel
    exclusions stay as they are."""
    opened: dict[str, int] = {}

    def open_rule(rule) -> None:
        if isinstance(rule, Either):
            open_rule(rule.first)
            open_rule(rule.second)
        elif isinstance(rule, Measured) and isinstance(rule.least, Field):
            opened[registry.setting_of(rule.least.options, rule.least.name)] = 0
        elif isinstance(rule, Range):
            for mode in MODES:
                lo, hi = getattr(rule, mode) or (None, None)
                if isinstance(lo, Field):
                    opened[registry.setting_of(lo.options, lo.name)] = 0
                if isinstance(hi, Field):
                    opened[registry.setting_of(hi.options, hi.name)] = 2**62

    for fusion in registry.registered().values():
        for rule in fusion.cost:
            open_rule(rule)
    return opened


def with_dependencies(fusion: str, matched) -> tuple[str, ...]:
    """`fusion` and, transitively, the matched fusions it runs after (whose rewrites it reads:
    attention_out_proj takes flash_attention's output), in run order."""
    declared = registry.registered()
    wanted, todo = {fusion}, [fusion]
    while todo:
        for dep in declared[todo.pop()].after:
            if dep in matched and dep not in wanted:
                wanted.add(dep)
                todo.append(dep)
    return tuple(n for n in declared if n in wanted)


# ---------------------------------------------------------------------------------------------
# steps: each returns a no-argument callable that runs one step of one version


class Workload:
    """The inputs of every step (made once: every version reads the same tensors), and each
    version's compiled step."""

    def __init__(self, subject: Subject, opts: BenchOptions):
        gen = torch.Generator(device="cpu").manual_seed(0)
        self.ids = torch.randint(0, subject.vocab, (opts.batch, opts.seq), generator=gen).to(opts.device)
        if subject.task == "seq-cls":
            self.labels = torch.zeros(opts.batch, dtype=torch.long, device=opts.device)
        else:  # causal LM: the model shifts them; masked LM: every position predicted, as timing needs
            self.labels = self.ids
        self.subject, self.opts = subject, opts
        self.leaves = [p for p in subject.model.parameters() if p.requires_grad]
        self._forward = subject.model.forward  # the class's, before generate swaps in a compiled one

    def tokens(self, step: str) -> int:
        return self.opts.batch * (self.opts.new_tokens if step == "generate" else self.opts.seq)

    def compile(self, step: str, version: Version):
        opts = self.opts
        target = self._forward if step == "generate" else self.subject.model
        # a static cache and fixed inputs have static shapes; a dynamic cache grows every token, so
        # Dynamo's automatic dynamic shapes take it after the first recompile
        dynamic = None if step == "generate" and opts.cache == "dynamic" else False
        mode = None if opts.mode in (None, "default") else opts.mode
        return torch.compile(target, backend=version.backend(opts), mode=mode, dynamic=dynamic)

    def step(self, step: str, compiled) -> Callable[[], object]:
        if step == "train":
            run = training_step(compiled, self.ids, labels=self.labels, leaves=self.leaves)
        elif step == "infer":
            run = inference_step(compiled, self.ids)
        else:
            run = self._generate(compiled)
        if self.opts.mode == "reduce-overhead":
            # CUDA graphs: each call is a new step (the versions' graphs interleave)
            def marked(run=run):
                torch.compiler.cudagraph_mark_step_begin()
                return run()

            return marked
        return run

    def _generate(self, compiled_forward) -> Callable[[], object]:
        model, n = self.subject.model, self.opts.new_tokens
        kwargs = dict(
            attention_mask=torch.ones_like(self.ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            num_beams=1, pad_token_id=model.config.pad_token_id,
            cache_implementation="static" if self.opts.cache == "static" else None,
            # transformers would compile the forward itself (Inductor) on top of ours
            disable_compile=True,
        )

        def run():
            model.forward = compiled_forward  # generate() calls self(...): this version's forward
            try:
                with torch.no_grad():
                    return model.generate(self.ids, **kwargs)
            finally:
                del model.forward

        return run

    def clear_grads(self) -> None:
        for p in self.leaves:
            p.grad = None


# ---------------------------------------------------------------------------------------------
# the run


@contextlib.contextmanager
def _compiling_every_version():
    """Dynamo keeps every version's graphs (one cache entry per backend and grad mode on the same
    code); Inductor's caches stay off so that every fusionpass compile runs the pass and counts."""
    limits = dict(recompile_limit=1024, accumulated_recompile_limit=8192, fail_on_recompile_limit_hit=True)
    known = {k: v for k, v in limits.items() if hasattr(torch._dynamo.config, k)}
    with torch._dynamo.config.patch(**known), fresh_compile_caches():
        yield


def _first_call(step: str, version: Version, run: Callable[[], object], device: str) -> dict:
    say(f"{step}: compiling {version.name} (first call) ...")
    fusionpass.reset_stats()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    seconds = first_call_seconds(run, device)
    row = {"first_call_s": round(seconds, 2),
           "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks}
    if version.fusionpass:
        row["matches"] = fusionpass.stats()
        row["variants"] = {f"{f}/{v}": n for (f, v), n in sorted(fusionpass.stats(variants=True).items())}
    matched = ", ".join(f"{f} {n}" for f, n in row.get("matches", {}).items())
    say(f"{step}: {version.name} compiled, first call {seconds:.1f} s"
        + (f"; matches {matched or 'none'}" if version.fusionpass else ""))
    return row


def measure_step(work: Workload, step: str) -> list[dict]:
    """Rows for one step: every version's first call (its compile), then all timed interleaved."""
    opts = work.opts
    model = work.subject.model
    model.train(step == "train")
    versions, runs, rows = [], {}, {}

    def add(version: Version) -> None:
        versions.append(version)
        runs[version.name] = work.step(step, work.compile(step, version))
        rows[version.name] = _first_call(step, version, runs[version.name], opts.device)

    add(Version(PLAIN, False))
    add(Version(FUSIONPASS, True))
    if step in opts.ablation:
        matched = rows[FUSIONPASS]["matches"]
        for fusion in (f for f in registry.registered() if matched.get(f)):  # in run order
            fusions = with_dependencies(fusion, matched)
            extra = [f for f in fusions if f != fusion]
            add(Version(f"only {fusion}" + (f" (+ {', '.join(extra)})" if extra else ""), True, fusions))
    iters = 1 if step == "generate" else opts.iters
    say(f"{step}: timing {len(runs)} versions interleaved, {opts.warmup} warm-up + {opts.rounds} rounds "
        f"x {iters} call(s)")
    ms = time_interleaved(runs, opts.device, rounds=opts.rounds, iters=iters, warmup=opts.warmup,
                          on_round=lambda i: say(f"{step}: round {i + 1}/{opts.rounds}"))
    tokens = work.tokens(step)
    out = []
    for version in versions:
        row = {"step": step, "version": version.name,
               "fusions": None if not version.fusionpass else list(version.fusions or ["all"]),
               "ms": round(ms[version.name], 4), "tokens_per_s": round(tokens / ms[version.name] * 1e3, 1),
               "speedup": round(ms[PLAIN] / ms[version.name], 3), "peak_mib": None, **rows[version.name]}
        if opts.device == "cuda":
            work.clear_grads()  # each version's peak counts its own gradients, from none
            row["peak_mib"] = round(peak_memory(runs[version.name]) / 2**20, 1)
        out.append(row)
    work.clear_grads()
    return out


def parse_steps(text: str) -> tuple[str, ...]:
    """`train,infer` -> ("train", "infer"); `all`: every step."""
    steps = STEPS if text.strip() == "all" else tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise ValueError(f"unknown step(s) {unknown or text!r}; known: {', '.join(STEPS)}, all")
    return steps


def bench_model(subject: Subject, opts: BenchOptions) -> BenchResult:
    notes = []
    if opts.device != "cuda":
        notes.append("peak memory is measured on CUDA only (torch.cuda.max_memory_allocated above what "
                     "was allocated before the step)")
    if opts.device == "cpu":
        notes.append("CPU: fusionpass runs with cpu=True (its ops run Triton kernels under the interpreter "
                     "with TRITON_INTERPRET=1, else a torch reference): times show the wiring, not GPU speed")
    work = Workload(subject, opts)
    rows = []
    torch._dynamo.reset()
    t0 = time.perf_counter()
    warm_up_compiler(opts.device)  # the first version's first call should not pay Inductor's start
    with _compiling_every_version():
        for step in opts.steps:
            if step == "generate" and not subject.can_generate:
                notes.append(f"generate skipped: {subject.why_no_generate()}")
                say(notes[-1])
                continue
            measured = measure_step(work, step)
            for row in measured:  # as they come: a run cut short by a time limit keeps them
                say(f"{step}: {row['version']} {row['ms']} ms ({row['speedup']:.3f}x against torch.compile)")
            rows.extend(measured)
    torch._dynamo.reset()
    say(f"done in {time.perf_counter() - t0:.0f} s")
    return BenchResult(subject, opts, rows, notes)
