"""Training memory on one GPU: the step's peak above weights and gradients, and its time, for plain
torch.compile, fusionpass and (when installed) Liger-Kernel, plus the largest sequence length that
trains at batch 1.

    python benchmarks/training_memory.py [--rows NAME,...] [--versions plain,fusionpass,liger,...]
                                         [--largest-s VERSIONS [--points-from JSON]]
                                         [--out-dir benchmarks/results/memory]

A row is an HF Llama built from a config at one shape (ROWS), random weights, bf16, one training
step = forward + loss + backward, no optimizer. Each measurement runs in a child process of its
own (`--child`), so an out-of-memory probe leaves nothing behind and Liger's patching of
transformers' module globals touches no other version. Plain compile and fusionpass share one
child, timed interleaved (fusionpass.bench.time_interleaved), as every other side-by-side here;
Liger's versions get their own (`apply_liger_kernel_to_llama` before the model is built, eager or
under torch.compile).

Peak: torch.cuda.max_memory_allocated during one step that starts without gradients, less what was
allocated before it (the weights) and less the gradients it made (step_peak).

--largest-s VERSIONS: for each of these versions, the largest S (a multiple of --s-step) at which the 8B-shaped
4-layer model (LARGEST_S_ROW) trains at B1. The peak grows about linearly in S, so two measured
peaks (the rows' own where they ran that model at B1, else two more runs) predict the limit;
one-step probes at the prediction and next to it then find the largest S that fits and the
smallest that does not, both reported. `--smoke --device cpu` runs the code paths at tiny
shapes (no peaks on the CPU), for tests/test_training_memory.py.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "memory"
GIB = 2**30

# the shapes of issue 18's table (ANCHORS.md, "Peers on whole training steps")
LLAMA_8L = dict(layers=8, width=2048, heads=16, kv_heads=8, intermediate=8192, vocab=128256)
LLAMA_8B_4L = dict(layers=4, width=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
ROWS = {
    "llama8l-b4-s2048": (LLAMA_8L, 4, 2048),
    "llama8b-4l-b1-s16384": (LLAMA_8B_4L, 1, 16384),
    "llama8b-4l-b1-s65536": (LLAMA_8B_4L, 1, 65536),
}
LARGEST_S_ROW = LLAMA_8B_4L
SMOKE_SHAPE = dict(layers=2, width=64, heads=4, kv_heads=2, intermediate=160, vocab=509)
# versions and the child that runs each: plain and fusionpass side by side in one process.
# fusionpass-loss-only compiles fusionpass.loss_only(model): the loss without the logits output, the
# contract Liger's patched forward has in training (it returns no logits either).
VERSIONS = ("plain", "fusionpass", "fusionpass-loss-only", "liger", "liger+compile")
SIDE_BY_SIDE = ("plain", "fusionpass", "fusionpass-loss-only")


@dataclasses.dataclass
class Probe:
    """One child's work: these versions at this shape."""

    versions: tuple[str, ...]
    shape: dict
    batch: int
    seq: int
    device: str = "cuda"
    rounds: int = 3
    iters: int = 2
    timed: bool = True
    once: bool = False  # one step only, its peak taken with the compile's (a fits-or-not probe)


def liger_installed() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _build(probe: Probe, liger: bool):
    from fusionpass.demo import build_hf

    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    dtype = torch.bfloat16 if probe.device == "cuda" else torch.float32
    s = probe.shape
    built = build_hf("llama", device=probe.device, dtype=dtype, layers=s["layers"], width=s["width"],
                     heads=s["heads"], kv_heads=s["kv_heads"], intermediate=s["intermediate"],
                     vocab=s["vocab"], positions=probe.seq)
    return built.model.train()


def _compiled(model, version: str, device: str):
    import fusionpass

    if version in ("plain", "liger+compile"):
        return torch.compile(model)
    if version == "fusionpass":
        return torch.compile(model, backend=fusionpass.backend(cpu=device == "cpu"))
    if version == "fusionpass-loss-only":
        return torch.compile(fusionpass.loss_only(model), backend=fusionpass.backend(cpu=device == "cpu"))
    return model  # liger: eager, as its users run it


def make_step(compiled, params, ids) -> Callable[[], None]:
    """One training step: gradients assigned, not accumulated (as fusionpass.bench.training_step)."""
    def step():
        for t in params:
            t.grad = None
        compiled(input_ids=ids, labels=ids).loss.backward()

    return step


def step_peak(step: Callable[[], object], params, once: bool = False,
              around=contextlib.nullcontext) -> int | None:
    """Peak bytes of one step above weights and gradients (None off CUDA).

    The step starts without gradients (step() sets them to None), and their bytes are taken off
    the peak afterwards. Starting with allocated gradients instead would count a second copy of
    each: the compiled backward returns every new gradient at once, before they are added in.
    `once`: the compiling step is the measured one (no lower than a later step's peak).
    `around`: a context manager the measured step runs in (memory_snapshot.py records there)."""
    if not torch.cuda.is_available() or not params or params[0].device.type != "cuda":
        step()
        return None
    if not once:
        step()  # the compile
    torch.cuda.synchronize()
    for t in params:
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with around():
        step()
        torch.cuda.synchronize()
    grads = sum(t.grad.numel() * t.grad.element_size() for t in params if t.grad is not None)
    return torch.cuda.max_memory_allocated() - base - grads


def run_probe(probe: Probe) -> dict:
    """In the child: build, compile, step; {version: {ms, peak_gib, matches} or {error}}."""
    import fusionpass
    from fusionpass.bench import time_interleaved
    from fusionpass.explain import fresh_compile_caches

    torch.manual_seed(0)
    liger = any(v.startswith("liger") for v in probe.versions)
    model = _build(probe, liger)
    params = [p for p in model.parameters() if p.requires_grad]
    weight_bytes = sum(p.numel() * p.element_size() for p in params)  # and as many for the grads
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, probe.shape["vocab"], (probe.batch, probe.seq), generator=gen).to(probe.device)
    out, steps = {}, {}
    with fresh_compile_caches():
        for version in probe.versions:
            torch._dynamo.reset()
            fusionpass.reset_stats()
            step = make_step(_compiled(model, version, probe.device), params, ids)

            try:
                peak = step_peak(step, params, probe.once)
            except torch.OutOfMemoryError as e:
                out[version] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                continue
            out[version] = {"peak_gib": None if peak is None else round(peak / GIB, 2),
                            "weights_and_grads_gib": round(2 * weight_bytes / GIB, 2),
                            "matches": dict(sorted(fusionpass.stats().items())) if version.startswith("fusionpass") else {}}
            steps[version] = step
            model.zero_grad(set_to_none=True)
        if probe.timed and steps:
            times = time_interleaved(steps, probe.device, rounds=probe.rounds, iters=probe.iters, warmup=1)
            for version, ms in times.items():
                out[version]["ms"] = round(ms, 2)
    return out


def in_child(probe: Probe, timeout_s: float | None = None) -> dict:
    """run_probe in a fresh Python process; a crash or a timeout becomes an error per version."""
    cmd = [sys.executable, __file__, "--child", json.dumps(dataclasses.asdict(probe))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {v: {"error": f"timed out after {timeout_s:.0f} s"} for v in probe.versions}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {v: {"error": f"child exited {done.returncode}: {tail}"} for v in probe.versions}
    return json.loads(lines[-1])


def children(versions) -> list[tuple[str, ...]]:
    """Which versions share a child: plain and fusionpass together, each Liger version alone."""
    shared = tuple(v for v in versions if v in SIDE_BY_SIDE)
    return ([shared] if shared else []) + [(v,) for v in versions if v not in SIDE_BY_SIDE]


# ---------------------------------------------------------------------------------------------
# largest S


def predict_limit(points: list[tuple[int, float]], capacity: float, step: int) -> int:
    """The largest multiple of `step` whose peak the line through two (S, bytes) points keeps
    within `capacity` bytes."""
    (s1, p1), (s2, p2) = points[:2]
    slope = (p2 - p1) / (s2 - s1)
    if slope <= 0:
        raise ValueError(f"peak does not grow with S: {points}")
    limit = s1 + (capacity - p1) / slope
    return max(step, int(limit) // step * step)


def largest_fitting(fits: Callable[[int], bool], guess: int, step: int, max_probes: int = 6) -> dict:
    """Walk from `guess` by `step` until one S fits and the next does not (or probes run out):
    {"largest_fits", "smallest_fails", "probed"}; None where not found."""
    probed: dict[int, bool] = {}
    s = guess
    while len(probed) < max_probes and s >= step:
        probed[s] = fits(s)
        ok = [t for t, f in probed.items() if f]
        bad = [t for t, f in probed.items() if not f]
        if ok and bad and min(bad) - max(ok) <= step:
            break
        s = s + step if probed[s] else s - step
        if s in probed:
            break
    ok = [t for t, f in probed.items() if f]
    bad = [t for t, f in probed.items() if not f and (not ok or t > max(ok))]
    return {"largest_fits": max(ok) if ok else None, "smallest_fails": min(bad) if bad else None,
            "probed": dict(sorted(probed.items()))}


def largest_s(version: str, shape: dict, device: str, step: int, fit_points=(16384, 32768),
              timeout_s: float | None = None, known: dict | None = None) -> dict:
    """Two peaks (`known` {S: result} where the rows measured them at this shape and B1, else
    measured at `fit_points`), the limit they predict from the GPU's total memory less weights
    and grads (what run_probe does not count), then one-step probes around it."""
    def probe(s: int) -> dict:
        return in_child(Probe((version,), shape, 1, s, device, timed=False, once=True), timeout_s)[version]

    known = {s: r for s, r in (known or {}).items() if "error" not in r}
    runs = known if len(known) >= 2 else {s: probe(s) for s in fit_points}
    if any("error" in r for r in runs.values()):
        return {"error": f"a fitting point did not run: {runs}"}
    points = sorted((s, r["peak_gib"]) for s, r in runs.items())
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    weights_and_grads = next(iter(runs.values()))["weights_and_grads_gib"]
    guess = predict_limit(points, total - weights_and_grads, step)
    errors: dict[int, str] = {}

    def fits(s: int) -> bool:
        result = probe(s)
        if "error" in result:
            errors[s] = result["error"]
        return "error" not in result

    found = largest_fitting(fits, guess, step)
    return {"points_gib": dict(points), "predicted": guess, **found, "errors": errors}


# ---------------------------------------------------------------------------------------------
# report


def report(env: dict, rows: dict, limits: dict) -> str:
    out = ["# Training memory: peak above weights and gradients, and step time", "",
           f"- date: {env['date']}; device: {env['device']}; torch {env['torch']}, "
           f"transformers {env['transformers']}; liger-kernel: {env['liger']}",
           f"- command: `{env['command']}`", "",
           "| row | version | peak GiB | ms | fusionpass matches |", "|---|---|---|---|---|"]
    for name, results in rows.items():
        for version, r in results.items():
            if "error" in r:
                out.append(f"| {name} | {version} | {r['error']} | | |")
                continue
            matches = ", ".join(f"{k} {n}" for k, n in r.get("matches", {}).items())
            out.append(f"| {name} | {version} | {r['peak_gib']} | {r.get('ms', '')} | {matches} |")
    if limits:
        out += ["", "## Largest S at B1, 8B-shaped 4 layers", "",
                "| version | largest S that trains | smallest S that does not | predicted | probes |",
                "|---|---|---|---|---|"]
        for version, r in limits.items():
            if "error" in r:
                out.append(f"| {version} | {r['error']} | | | |")
                continue
            probes = ", ".join(f"{s}: {'fits' if ok else r.get('errors', {}).get(s, 'fails')[:80]}"
                               for s, ok in r["probed"].items())
            out.append(f"| {version} | {r['largest_fits']} | {r['smallest_fails']} | {r['predicted']} | {probes} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)} ('' for none)")
    p.add_argument("--versions", default=None, help=f"comma-separated, of {', '.join(VERSIONS)} "
                   "(default: plain, fusionpass, and Liger's when it is installed)")
    p.add_argument("--largest-s", default="", metavar="VERSIONS",
                   help="comma-separated versions to find the largest trainable S for")
    p.add_argument("--points-from", type=pathlib.Path, default=None,
                   help="an earlier training_memory.json whose 8B-shaped B1 rows give the fitting points")
    p.add_argument("--s-step", type=int, default=4096)
    p.add_argument("--timeout-s", type=float, default=None, help="per child process")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU tests)")
    p.add_argument("--out-dir", type=pathlib.Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.child:
        probe = Probe(**json.loads(args.child))
        probe.versions = tuple(probe.versions)
        print(json.dumps(run_probe(probe)), flush=True)
        return 0

    import transformers

    versions = (args.versions.split(",") if args.versions
                else [*SIDE_BY_SIDE, *(("liger", "liger+compile") if liger_installed() else ())])
    unknown = set(versions) - set(VERSIONS)
    if unknown:
        p.error(f"unknown versions {sorted(unknown)}")
    env = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU (no peaks)",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "liger": _liger_version(), "command": " ".join(["python benchmarks/training_memory.py", *(argv or sys.argv[1:])]),
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows, limits = {}, {}

    def write() -> str:  # after every row and limit, so a run cut short keeps what it measured
        md = report(env, rows, limits)
        (args.out_dir / "training_memory.md").write_text(md)
        (args.out_dir / "training_memory.json").write_text(
            json.dumps({"environment": env, "rows": rows, "largest_s": limits}, indent=1) + "\n")
        return md

    for name in args.rows.split(",") if args.rows else []:
        shape, batch, seq = ROWS[name]
        if args.smoke:
            shape, batch, seq = SMOKE_SHAPE, 2, 33
        results = {}
        for group in children(versions):
            print(f"{name}: {', '.join(group)}", file=sys.stderr, flush=True)
            probe = Probe(group, shape, batch, seq, args.device,
                          **(dict(rounds=1, iters=1) if args.smoke else {}))
            results.update(in_child(probe, args.timeout_s))
        rows[name] = results
        write()
    if args.largest_s:
        if args.device != "cuda":
            p.error("--largest-s needs a GPU")
        # the fitting points: this run's rows at the search's shape and B1, else those of --points-from
        earlier = json.loads(args.points_from.read_text())["rows"] if args.points_from else {}
        measured = {**earlier, **rows}
        for version in args.largest_s.split(","):
            print(f"largest S: {version}", file=sys.stderr, flush=True)
            known = {ROWS[name][2]: r[version] for name, r in measured.items()
                     if name in ROWS and ROWS[name][0] is LARGEST_S_ROW and ROWS[name][1] == 1 and version in r}
            limits[version] = largest_s(version, LARGEST_S_ROW, args.device, args.s_step,
                                        timeout_s=args.timeout_s, known=known)
            write()
    print(write())
    return 0


def _liger_version() -> str:
    if not liger_installed():
        return "not installed"
    from importlib.metadata import version

    return version("liger-kernel")


if __name__ == "__main__":
    sys.exit(main())
