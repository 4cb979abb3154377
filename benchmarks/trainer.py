"""The path users train on: transformers' Trainer with `bf16=True` and `torch_compile=True`, plain
compile against `fusionpass.install()` (and Liger-Kernel's `use_liger_kernel=True`, eager, where its
wheel is installed), with fp32 weights (a model built from a config: autocast over fp32 weights)
and with bf16 weights (transformers 5's `from_pretrained` of a bf16 checkpoint).

Each run is a process of its own (peak memory is the process's, and no compile cache or Triton
kernel crosses runs); a run reports its step times (CUDA-synchronized, from a TrainerCallback), its
peak allocated memory, the seconds to its first step (compile included), the losses of every step
and what fusionpass matched. The model is Llama-3.2-1B-shaped with fewer layers; the data are fixed
random tokens with a collator's all-ones attention_mask, so the Trainer passes num_items_in_batch.

    python benchmarks/trainer.py                         # every row, writes benchmarks/results/latest/trainer.*
    python benchmarks/trainer.py --steps 200 --repeat-plain   # the loss-curve check: plain twice
    python benchmarks/trainer.py --smoke --device cpu    # the CPU test's tiny run
    python benchmarks/trainer.py --compile-time [--breakdown]   # first steps, cold and warm: trainer-compile-time.*
    python benchmarks/trainer.py --logging-steps 500 --out-dir DIR   # the Trainer's default logging cadence

--logging-steps: the table's runs log every step (a loss per step for the loss check), and each
logged step makes the Trainer read the loss and the gradient norm on the host, a synchronize per
read. The Trainer's default logs every 500 steps, so a user's step syncs only where the Trainer
always does (its input copies, its check of the loss for NaN). With N > 1 the step clock does not
synchronize at every step either: step ms is the mean over the timed steps between two synchronized
marks, and the losses are those the cadence logs.

--compile-time (issue 41): per weight dtype and side, a cold run (empty Inductor and Triton cache
folders of its own) and a warm run (a second process over the folders the cold one filled), each to
its first steps only. --breakdown adds a cold run per side with Inductor's compile workers off
(TORCHINDUCTOR_COMPILE_THREADS=1), so that every Triton compile happens in the process and is
timed by kernel, beside Dynamo's phase times and fusionpass's own pass: where the added seconds go.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WEIGHTS = ("fp32", "bf16")
SIDES = ("plain", "fusionpass", "liger")
# Llama-3.2-1B's widths (h2048, 32/8 heads of 64, ffn 8192, tied vocab 128256), 8 of its 16 layers
MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
             tie_word_embeddings=True, rope_theta=500000.0)
SMOKE_MODEL = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
SMOKE_SETTINGS = dict(cpu=True, rope_min_tokens=1, linear_cross_entropy_min_vocab=1, rms_norm_min_width=1)


class TritonCompileClock:
    """Seconds of each triton.compile in this process, by kernel name (Inductor's compile workers
    off: see --breakdown)."""

    def __init__(self):
        import triton

        self.seconds: dict[str, float] = {}
        compile_ = triton.compile

        def timed(src, *args, **kwargs):
            start = time.perf_counter()
            try:
                return compile_(src, *args, **kwargs)
            finally:
                name = getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", None) or "?"
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

        # every name it is called by: Inductor's `triton.compile`, a JIT function's binder's
        # `triton.compiler.compile` (bound at its first launch, after this)
        import triton.compiler
        import triton.compiler.compiler

        triton.compile = triton.compiler.compile = triton.compiler.compiler.compile = timed
        # torch's analysis of which tensors a user kernel writes makes the kernel's TTIR at each call
        # site it traces (functionalization, Inductor's lowering): its seconds and calls by kernel
        from torch._higher_order_ops import triton_kernel_wrap

        self.ttir_seconds: dict[str, list[float]] = {}
        generate_ttir = triton_kernel_wrap.generate_ttir

        def timed_ttir(kernel, *args, **kwargs):
            start = time.perf_counter()
            try:
                return generate_ttir(kernel, *args, **kwargs)
            finally:
                name = getattr(getattr(kernel, "fn", kernel), "__name__", "?")
                self.ttir_seconds.setdefault(name, []).append(time.perf_counter() - start)

        triton_kernel_wrap.generate_ttir = timed_ttir

    def report(self, top: int = 12) -> dict:
        ours = {k: v for k, v in self.seconds.items() if not k.startswith("triton_")}
        ttir = sorted(self.ttir_seconds.items(), key=lambda kv: -sum(kv[1]))
        return {"total_s": round(sum(self.seconds.values()), 2), "kernels": len(self.seconds),
                "ttir_s": round(sum(sum(v) for v in self.ttir_seconds.values()), 2),
                "ttir_calls": {k: [len(v), round(sum(v), 2)] for k, v in ttir[:top]},
                "inductor_generated_s": round(sum(v for k, v in self.seconds.items() if k.startswith("triton_")), 2),
                "user_kernels_s": {k: round(v, 2) for k, v in sorted(ours.items(), key=lambda kv: -kv[1])[:top]}}


def compile_phases() -> dict:
    """Dynamo's compile phase seconds (summed over graphs), its graph and break counts."""
    from torch._dynamo import utils

    phases = {k: round(sum(v), 2) for k, v in getattr(utils, "compilation_time_metrics", {}).items() if v}
    counters = utils.counters
    caches = {f"{group}.{k}": v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
              if "cache" in k}
    return {"phases_s": dict(sorted(phases.items(), key=lambda kv: -kv[1])[:16]),
            "unique_graphs": counters["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(counters["graph_break"].values()), "caches": caches}


def run_one(weights: str, side: str, steps: int, batch: int, seq: int, smoke: bool, device: str,
            breakdown: bool = False, callbacks=(), logging_steps: int = 1) -> dict:
    """One Trainer run in this process (`callbacks`: more TrainerCallbacks, e.g. a profiler's)."""
    import torch
    import transformers

    cuda = device == "cuda"  # timing runs: correctness is the conformance suite's (NaN-filled memory there)
    matched = {}
    triton_clock = TritonCompileClock() if breakdown else None
    if side == "fusionpass":
        import fusionpass

        fusionpass.install(**(SMOKE_SETTINGS if smoke else {}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(SMOKE_MODEL if smoke else MODEL))
    model = transformers.LlamaForCausalLM(config)
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch * steps, seq), generator=gen)
    data = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]
    marks: list[float] = []
    first_timed = max(1, steps // 5)  # the timed steps start past the first fifth (allocator, autotune)
    per_step = logging_steps == 1

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            # at the Trainer's own cadence only the window's two ends synchronize
            if cuda and (per_step or state.global_step in (first_timed, steps)):
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-4,
            lr_scheduler_type="constant", logging_steps=logging_steps, report_to=[], bf16=True, save_strategy="no",
            torch_compile=side != "liger", use_liger_kernel=side == "liger", use_cpu=not cuda,
            dataloader_num_workers=0, disable_tqdm=True, seed=0, data_seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock(), *callbacks])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.train()
    pass_s, pass_parts, kernels = None, {}, {}
    if side == "fusionpass":
        import fusionpass
        from fusionpass.passes import STATISTICS

        matched = fusionpass.stats()
        pass_s = round(sum(STATISTICS.seconds.values()), 3)
        # per fusion and per step of the pass (the first fusion that imports a kernel or library pays it)
        pass_parts = {k: round(v, 3) for k, v in STATISTICS.seconds.most_common()}
        # which kernel each attention match chose (the cuDNN route or ours, and why not the other)
        kernels = dict(collections.Counter(k for r in STATISTICS.records for _, _, k, _ in r.kernels))
    phases = compile_phases()
    if per_step:
        steps_ms = [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
        timed = steps_ms[len(steps_ms) // 5:] or steps_ms  # past the first fifth (allocator and autotune warm-up)
        step_ms = round(statistics.median(timed), 2) if timed else None
    else:  # the mean between the synchronized marks (the end of step first_timed, the last step's end)
        step_ms = round(1e3 * (marks[-1] - marks[first_timed - 1]) / (steps - first_timed), 2) \
            if len(marks) == steps and steps > first_timed else None
    return {
        "weights": weights, "side": side, "steps": steps, "logging_steps": logging_steps,
        "step_ms": step_ms,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "first_step_s": round(marks[0] - start, 1) if marks else None,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "matched": matched, "kernels": kernels, "pass_s": pass_s, "pass_parts_s": pass_parts,
        "caches": phases["caches"],
        **({"breakdown": {**phases, "triton": triton_clock.report()}} if breakdown else {}),
    }


def _spawn(weights, side, args, env: dict | None = None, breakdown: bool = False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--one", weights, side, "--json", f.name, "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq", str(args.seq), "--device", args.device,
               "--logging-steps", str(args.logging_steps)]
        if args.smoke:
            cmd.append("--smoke")
        if breakdown:
            cmd.append("--breakdown")
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
        if done.returncode != 0:
            return {"weights": weights, "side": side, "error": (done.stderr or done.stdout).strip().splitlines()[-1][:300]}
        return json.loads(pathlib.Path(f.name).read_text())


def run_environment(suite, argv) -> dict:
    """The suite's environment, the command, and the fusionpass settings given by environment
    variables (FUSIONPASS_*, e.g. FUSIONPASS_ATTENTION_CUDNN_PADDING=1 for an opt-in route), which
    every run of this command inherits."""
    env = suite.suite_environment()
    env["command"] = "python benchmarks/trainer.py " + " ".join(argv if argv is not None else sys.argv[1:])
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FUSIONPASS_")}
    if settings:
        env["fusionpass settings"] = ", ".join(f"{k}={v}" for k, v in settings.items())
    return env


def _liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def spread(a: list[float], b: list[float]) -> float | None:
    """The largest difference of two loss curves, step by step (past the first step); None where
    they have no step past the first in common (a cadence that logs once or never)."""
    return max((abs(x - y) for x, y in zip(a[1:], b[1:])), default=None)


def _rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def rows_of(runs: list[dict]) -> list[dict]:
    """One row per weight dtype: plain / fusionpass, memory, first steps, Liger beside them."""
    rows = []
    for weights in WEIGHTS:
        by = {}
        for r in runs:
            if r["weights"] == weights:
                by.setdefault(r["side"], []).append(r)
        plain, fused = by.get("plain", [None])[0], by.get("fusionpass", [None])[0]
        case = f"Trainer, {weights} weights"
        if not plain or not fused or "error" in plain or "error" in fused:
            errors = "; ".join(f"{r['side']}: {r['error']}" for rs in by.values() for r in rs if "error" in r)
            rows.append({"case": case, "mode": "training", "error": errors or "not run"})
            continue
        row = {"case": case, "mode": "training", "dtype": "bf16 autocast",
               "plain_ms": plain["step_ms"], "fusionpass_ms": fused["step_ms"],
               "ratio": round(plain["step_ms"] / fused["step_ms"], 3),
               "plain_peak_gib": plain["peak_gib"], "fusionpass_peak_gib": fused["peak_gib"],
               "plain_first_step_s": plain["first_step_s"], "fusionpass_first_step_s": fused["first_step_s"],
               "matched": fused["matched"],
               "loss_gap": _rounded(spread(plain["losses"], fused["losses"]), 4)}
        if len(by["plain"]) > 1 and "error" not in by["plain"][1]:
            row["plain_loss_spread"] = _rounded(spread(plain["losses"], by["plain"][1]["losses"]), 4)
        liger = by.get("liger", [None])[0]
        if liger:
            row.update({"liger_ms": liger.get("step_ms"), "liger_peak_gib": liger.get("peak_gib")}
                       if "error" not in liger else {"liger_error": liger["error"]})
        rows.append(row)
    return rows


class _Runs(list):
    """The runs so far, written to `path` after each one: a run stopped by a time limit (the GPU
    machine's) leaves the runs it finished, which --rewrite turns into the table."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = path
        self._write()

    def append(self, run: dict) -> None:
        super().append(run)
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self, indent=1) + "\n")


def compile_time_runs(args, runs: list) -> list[dict]:
    """Cold, warm (and with --breakdown, in-process compile) runs per weight dtype and side; the
    sides alternate which goes first from one dtype to the next."""
    for i, weights in enumerate(args.weights.split(",")):
        for side in ("plain", "fusionpass")[::(-1) ** i]:
            with tempfile.TemporaryDirectory() as cache:
                caches = {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
                for cache_state in ("cold", "warm"):
                    print(f"trainer compile time: {weights} weights, {side}, {cache_state}", flush=True)
                    runs.append({**_spawn(weights, side, args, caches), "cache": cache_state})
            if args.breakdown:
                with tempfile.TemporaryDirectory() as cache:
                    env = {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton",
                           "TORCHINDUCTOR_COMPILE_THREADS": "1"}
                    print(f"trainer compile time: {weights} weights, {side}, breakdown", flush=True)
                    runs.append({**_spawn(weights, side, args, env, breakdown=True), "cache": "cold, in-process compile"})
    return runs


def compile_time_rows(runs: list[dict]) -> list[dict]:
    """One row per weight dtype and cache state: plain's and fusionpass's first steps, the added share."""
    rows = []
    for weights in WEIGHTS:
        for cache in ("cold", "warm", "cold, in-process compile"):
            by = {r["side"]: r for r in runs if r["weights"] == weights and r.get("cache") == cache}
            if not by:
                continue
            plain, fused = by.get("plain"), by.get("fusionpass")
            case = f"Trainer, {weights} weights"
            if not plain or not fused or "error" in plain or "error" in fused:
                errors = "; ".join(f"{r['side']}: {r['error']}" for r in by.values() if "error" in r)
                rows.append({"case": case, "mode": "training", "cache": cache, "error": errors or "not run"})
                continue
            rows.append({"case": case, "mode": "training", "cache": cache, "plain_s": plain["first_step_s"],
                         "fusionpass_s": fused["first_step_s"],
                         "added": round(fused["first_step_s"] / plain["first_step_s"] - 1, 3),
                         "pass_s": fused.get("pass_s")})
    return rows


_CACHE_COUNTERS = (("inductor.fxgraph_cache_hit", "FX graph hit"), ("inductor.fxgraph_cache_miss", "FX graph miss"),
                   ("inductor.fxgraph_cache_bypass", "FX graph bypass"),
                   ("aot_autograd.autograd_cache_hit", "AOTAutograd hit"),
                   ("aot_autograd.autograd_cache_miss", "AOTAutograd miss"),
                   ("aot_autograd.autograd_cache_bypass", "AOTAutograd bypass"))


def cache_lines(runs: list[dict]) -> list[str]:
    """What each run found in the compile caches (a warm run that misses compiles again)."""
    lines = []
    for r in runs:
        seen = ", ".join(f"{label} {r['caches'][key]}" for key, label in _CACHE_COUNTERS if r.get("caches", {}).get(key))
        if seen:
            lines.append(f"- caches, {r['weights']} weights, {r['side']}, {r.get('cache', '')}: {seen}")
    return lines


def breakdown_lines(runs: list[dict]) -> list[str]:
    """Where the seconds go, per in-process-compile run: Dynamo's phases, Triton compiles."""
    lines = []
    for r in runs:
        b = r.get("breakdown")
        if not b:
            continue
        t = b["triton"]
        lines += [f"- {r['weights']} weights, {r['side']}: first step {r['first_step_s']} s; Triton compiled "
                  f"{t['kernels']} kernels in {t['total_s']} s (Inductor's own {t['inductor_generated_s']} s; "
                  f"user kernels: {', '.join(f'{k} {v}' for k, v in t['user_kernels_s'].items()) or 'none'}); "
                  f"torch's TTIR analysis of user kernels {t['ttir_s']} s ("
                  + ", ".join(f"{k} {n}x {s_} s" for k, (n, s_) in t["ttir_calls"].items()) + "); "
                  f"{b['unique_graphs']} graphs, {b['graph_breaks']} graph breaks; phases: "
                  + ", ".join(f"{k} {v}" for k, v in list(b["phases_s"].items())[:8])]
    return ["Breakdown (compile workers off, so each Triton compile is timed in the process):", "", *lines, ""] if lines else []


COMPILE_COLUMNS = [("case", "case"), ("mode", "mode"), ("cache", "caches"), ("plain_s", "plain first step s"),
                   ("fusionpass_s", "fusionpass first step s"), ("added", "added (fusionpass / plain - 1)"),
                   ("pass_s", "fusionpass's own pass s")]


COLUMNS = [("case", "case"), ("mode", "mode"), ("plain_ms", "plain torch.compile ms"), ("fusionpass_ms", "fusionpass ms"),
           ("ratio", "plain / fusionpass"), ("plain_peak_gib", "plain peak GiB"),
           ("fusionpass_peak_gib", "fusionpass peak GiB"), ("liger_ms", "Liger (eager) ms"),
           ("liger_peak_gib", "Liger peak GiB"), ("liger_error", "Liger"),
           ("plain_first_step_s", "plain first step s"), ("fusionpass_first_step_s", "fusionpass first step s"),
           ("loss_gap", "largest loss difference, plain vs fusionpass"),
           ("plain_loss_spread", "largest loss difference, plain vs plain"), ("matched", "matched")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", nargs=2, metavar=("WEIGHTS", "SIDE"), help="run one configuration in this process")
    p.add_argument("--json", help="with --one: where to write its result")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 60; 3 with --compile-time)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="the tiny model (a CPU test)")
    p.add_argument("--repeat-plain", action="store_true", help="plain compile twice: its own run-to-run spread")
    p.add_argument("--weights", default=",".join(WEIGHTS))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "latest"))
    p.add_argument("--rewrite", action="store_true",
                   help="write trainer.md/.json again from the runs and environment in --out-dir (no run)")
    p.add_argument("--compile-time", action="store_true",
                   help="first steps only, cold and warm caches: writes trainer-compile-time.md/.json")
    p.add_argument("--breakdown", action="store_true",
                   help="with --compile-time (or --one): also time each Triton compile and Dynamo phase")
    p.add_argument("--logging-steps", type=int, default=1,
                   help="the Trainer's logging_steps (default 1: a loss per step, a synchronized clock per step; "
                        "the Trainer's own default is 500)")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.compile_time else 60
    if args.one:
        result = run_one(*args.one, args.steps, args.batch, args.seq, args.smoke, args.device, args.breakdown,
                         logging_steps=args.logging_steps)
        pathlib.Path(args.json).write_text(json.dumps(result))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import suite

    out_dir = pathlib.Path(args.out_dir)
    if args.compile_time:
        return compile_time_main(args, argv, suite, out_dir)
    runs, env = runs_and_environment(args, argv, suite, out_dir, "trainer", "trainer_runs.json", step_runs)
    rows = rows_of(runs)
    steps = env.get("steps", runs[0].get("steps") if runs else None)
    logging_steps = env.get("logging_steps", 1)
    clock = (f"the median past the first fifth of {steps} steps, each synchronized" if logging_steps == 1 else
             f"the mean past the first fifth of {steps} steps between two synchronized marks, logging every "
             f"{logging_steps} steps")
    suite.write_topic(out_dir, "trainer", env, rows, COLUMNS, footer=(
        f"Generated by benchmarks/trainer.py from trainer_runs.json: each run is its own process; step ms is "
        f"{clock}; peak is torch.cuda.max_memory_allocated over the run; "
        "first step is the seconds to the first step's end, compile included, with whatever Inductor cache "
        "the machine had (a side run earlier on the same machine compiles from its cache). "
        "plain / fusionpass > 1 means fusionpass is faster."))
    return 0 if all("error" not in r for r in rows) else 1


def step_runs(args, runs: list) -> list[dict]:
    """One run per weight dtype and side (Liger where installed; plain twice with --repeat-plain)."""
    sides = [s for s in SIDES if s != "liger" or _liger_installed()]
    for weights in args.weights.split(","):
        for side in sides + (["plain"] if args.repeat_plain else []):
            print(f"trainer: {weights} weights, {side}", flush=True)
            runs.append(_spawn(weights, side, args))
            print("  ", {k: v for k, v in runs[-1].items() if k != "losses"}, flush=True)
    return runs


def runs_and_environment(args, argv, suite, out_dir: pathlib.Path, topic: str, runs_name: str, measure):
    """(runs, environment): measured by `measure(args, runs)`, which writes `runs_name` as each run
    finishes, or with --rewrite read back from it and from the topic's JSON."""
    runs_path = out_dir / runs_name
    if args.rewrite:
        return json.loads(runs_path.read_text()), json.loads((out_dir / f"{topic}.json").read_text())["environment"]
    env = run_environment(suite, argv)
    env["model"] = f"LlamaForCausalLM {SMOKE_MODEL if args.smoke else MODEL}, B{args.batch} S{args.seq}, AdamW"
    env["steps"] = args.steps
    env["logging_steps"] = args.logging_steps
    # the environment first, so that --rewrite can make the table of a run stopped midway
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{topic}.json").write_text(json.dumps({"environment": env, "rows": []}, indent=1) + "\n")
    return list(measure(args, _Runs(runs_path))), env


def compile_time_main(args, argv, suite, out_dir: pathlib.Path) -> int:
    runs, env = runs_and_environment(args, argv, suite, out_dir, "trainer-compile-time", "trainer_compile_runs.json",
                                     compile_time_runs)
    rows = compile_time_rows(runs)
    suite.write_topic(out_dir, "trainer-compile-time", env, rows, COMPILE_COLUMNS,
                      extra=breakdown_lines(runs) + cache_lines(runs), footer=(
        "Generated by benchmarks/trainer.py --compile-time from trainer_compile_runs.json: each run is its own process; "
        "first step is the seconds to the first step's end, compile included. cold: empty Inductor and Triton "
        "cache folders of the run's own; warm: a second process over the folders its cold run filled. "
        "added > 0 means fusionpass's first step is slower."))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
