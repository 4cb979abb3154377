"""`fusionpass bench`: a model's training step, inference forward and greedy generate(), compiled
by plain torch.compile and by fusionpass (and, for an ablation, by fusionpass with each matched
fusion alone), all timed interleaved in one process.

Every version compiles the same module (one set of weights): a version is a torch.compile wrapper
with its own backend, and Dynamo keeps one cache entry per backend on the model's code. The run
raises Dynamo's recompile limits for that, and makes hitting them an error, so a version can never
fall back to eager without saying so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable

import torch

import fusionpass
from fusionpass import registry
from fusionpass.bench import (first_call_seconds, inference_step, peak_memory, time_interleaved, training_step,
                              warm_up_compiler)
from fusionpass.cost import MODES, Range
from fusionpass.explain import fresh_compile_caches

STEPS = ("train", "infer", "generate")
DEFAULT_STEPS = ("train", "infer")
MODES_OF_COMPILE = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
PLAIN = "torch.compile"
FUSIONPASS = "fusionpass"


@dataclasses.dataclass
class Subject:
    """The model under test and what its steps feed it."""

    model: torch.nn.Module
    task: str  # "causal-lm", "masked-lm", "seq-cls" (fusionpass.hf_models.TASKS)
    vocab: int
    can_generate: bool
    description: str  # one line: class, Auto class, sizes
    source: str  # where its config came from
    changes: list[str] = dataclasses.field(default_factory=list)  # what the overrides changed

    @classmethod
    def from_hf(cls, built) -> Subject:
        """A `fusionpass.hf_models.BuiltModel`."""
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
class Options:
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

    def backend(self, opts: Options):
        if not self.fusionpass:
            return "inductor"
        return fusionpass.backend(fusions=self.fusions, cpu=opts.device == "cpu", **opts.backend_settings())


@dataclasses.dataclass
class Result:
    subject: Subject
    options: Options
    rows: list[dict]
    notes: list[str]


def say(message: str) -> None:
    """Progress, on stderr (stdout carries the table)."""
    print(f"[fusionpass bench] {message}", file=sys.stderr, flush=True)


def open_cost_rules() -> dict[str, int]:
    """Settings that open every cost-rule bound held in a setting (lower bounds 0, upper bounds
    unlimited): at the tiny sizes a CPU run can afford, the GPU-measured rules would keep most
    fusions out. Opt-in switches (`rope_kernel`, ...) and kernel exclusions stay as they are."""
    opened: dict[str, int] = {}
    for fusion in registry.registered().values():
        for rule in fusion.cost:
            if not isinstance(rule, Range):
                continue
            for mode in MODES:
                lo, hi = getattr(rule, mode) or (None, None)
                if isinstance(lo, str):
                    opened[lo] = 0
                if isinstance(hi, str):
                    opened[hi] = 2**62
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

    def __init__(self, subject: Subject, opts: Options):
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
    versions = [Version(PLAIN, False), Version(FUSIONPASS, True)]
    runs, rows = {}, {}
    for version in versions:
        runs[version.name] = work.step(step, work.compile(step, version))
        rows[version.name] = _first_call(step, version, runs[version.name], opts.device)
    if step in opts.ablation:
        matched = rows[FUSIONPASS]["matches"]
        for fusion in (f for f in registry.registered() if matched.get(f)):  # in run order
            fusions = with_dependencies(fusion, matched)
            extra = [f for f in fusions if f != fusion]
            version = Version(f"only {fusion}" + (f" (+ {', '.join(extra)})" if extra else ""), True, fusions)
            versions.append(version)
            runs[version.name] = work.step(step, work.compile(step, version))
            rows[version.name] = _first_call(step, version, runs[version.name], opts.device)
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


def run(subject: Subject, opts: Options) -> Result:
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
            rows.extend(measure_step(work, step))
    torch._dynamo.reset()
    say(f"done in {time.perf_counter() - t0:.0f} s")
    return Result(subject, opts, rows, notes)
