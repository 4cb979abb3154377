"""Issue 40 probe: where a Trainer step's GPU sits idle, and what the host was doing then.

trainer_profile.py read, from the step time minus the GPU's kernel time, that with fusionpass the GPU
waits on the host for several ms per step. Summing kernels cannot say where that happens (and this
probe's timeline did not confirm it: benchmarks/results/trainer/2026-12-07-h100-gaps-bf16.md). This
probe records a timeline (torch.profiler, CPU and CUDA activity) of a few Trainer steps past the
compile, in one process per side, and reads the GPU's idle gaps from it:
- a gap is time between two GPU activities (kernels, copies, memsets) of at least `--min-gap-us`;
- the activity that ends a gap was launched by a host call (their `correlation` ids match): the
  host ops that enclose that launch (outermost first) name what the host was busy with, and the
  host call in progress when the GPU ran dry says what drained the queue (a synchronize, say);
- gaps are summed by the innermost enclosing host op, so that what costs most comes first.

    python benchmarks/probes/trainer_gaps.py [--weights bf16] [--sides fusionpass,plain] [--out FILE.json]
    python benchmarks/probes/trainer_gaps.py --smoke --device cpu --seq 32 --batch 2   # runs; no GPU, no gaps
"""
from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import trainer_runs  # noqa: E402

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CALLS = {"cuda_runtime", "cuda_driver"}
HOST_OPS = {"cpu_op", "user_annotation", "python_function"}


def _span(e) -> tuple[float, float]:
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))


def gaps(events: list[dict], min_gap_us: float, attributed: int = 300) -> list[dict]:
    """The GPU's idle gaps of at least min_gap_us in a Chrome trace's events, the largest first. The
    `attributed` largest say what ended them (`launched_by`: the host ops around the launch, outermost
    first; `launch_after_idle_us`: how long after the GPU went idle the host launched it, negative
    where it was launched before) and what preceded them (`after`: the host call in progress when
    the GPU went idle, else the last one before). (Each attribution scans the host events: a
    timeline has tens of thousands, so only the largest gaps are read.)"""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    found = []  # (idle from, the activity that ended the gap)
    busy_until = None
    for e in gpu:
        start, end = _span(e)
        if busy_until is not None and start - busy_until >= min_gap_us:
            found.append((busy_until, e))
        busy_until = end if busy_until is None else max(busy_until, end)
    found.sort(key=lambda g: -(_span(g[1])[0] - g[0]))
    calls = [e for e in events if e.get("ph") == "X" and e.get("cat") in HOST_CALLS]
    by_corr = {e.get("args", {}).get("correlation"): e for e in calls}
    ops_by_thread: dict = {}
    for o in events:
        if o.get("ph") == "X" and o.get("cat") in HOST_OPS:
            ops_by_thread.setdefault(o.get("tid"), []).append(o)
    out = []
    for i, (idle_from, e) in enumerate(found):
        row = {"gap_us": round(_span(e)[0] - idle_from, 1), "next": e["name"][:100]}
        launch = by_corr.get(e.get("args", {}).get("correlation")) if i < attributed else None
        if launch is not None:
            t, tid = float(launch["ts"]), launch.get("tid")
            around = sorted((o for o in ops_by_thread.get(tid, ()) if _span(o)[0] <= t <= _span(o)[1]),
                            key=lambda o: (o["ts"], -o.get("dur", 0.0)))
            row["launched_by"] = [o["name"][:100] for o in around][-6:]
            row["launch_after_idle_us"] = round(t - idle_from, 1)
            # the host call in progress when the GPU ran dry (a synchronize returns just after), else
            # the last one that had ended
            spanning = [c for c in calls if _span(c)[0] <= idle_from <= _span(c)[1] + 1.0]
            before = spanning or [c for c in calls if _span(c)[1] <= idle_from]
            if before:
                row["after"] = max(before, key=lambda c: _span(c)[1])["name"]
        out.append(row)
    return out


def summary(rows: list[dict], steps: int) -> dict:
    """Idle ms per step in all, and by the innermost host op that launched the work after each
    attributed gap (the rest, smaller, summed apart)."""
    by_op: dict[str, float] = {}
    for r in rows:
        key = (r.get("launched_by") or ["(no host op)"])[-1] if "launch_after_idle_us" in r else "(not attributed)"
        by_op[key] = by_op.get(key, 0.0) + r["gap_us"] / 1e3 / steps
    return {"idle_ms_per_step": round(sum(r["gap_us"] for r in rows) / 1e3 / steps, 3),
            "gaps_per_step": round(len(rows) / steps, 1),
            "by_launching_op_ms_per_step": {k: round(v, 3) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:25]},
            "largest": rows[:30]}


def run(args) -> None:
    trace = pathlib.Path(args.run).with_suffix(".trace.json")
    callback = trainer_runs.profiled_steps(args.first, args.profile_steps, args.device == "cuda",
                                           lambda prof: prof.export_chrome_trace(str(trace)))
    steps = args.first + args.profile_steps + 1
    result = trainer_runs.load_trainer().run_one(args.weights, args.side, steps, args.batch, args.seq, args.smoke,
                                                 args.device, callbacks=[callback])
    events = json.loads(trace.read_text()).get("traceEvents", []) if trace.exists() else []
    rows = gaps(events, args.min_gap_us)
    if args.keep_trace:
        with gzip.open(args.keep_trace, "wt") as f:
            json.dump({"traceEvents": events}, f)
    pathlib.Path(args.run).write_text(json.dumps({"step_ms": result["step_ms"], "matched": result["matched"],
                                                  **summary(rows, args.profile_steps)}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trainer_runs.add_arguments(p)
    trainer_runs.add_profile_arguments(p, sides="fusionpass,plain", profile_steps=2)
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--keep-trace", default=None, help="(with --run) also write the trace here, gzipped")
    p.add_argument("--trace-dir", default=None, help="write each side's gzipped trace into this folder")
    args = p.parse_args(argv)
    if args.run:
        run(args)
        return 0
    if args.trace_dir:
        pathlib.Path(args.trace_dir).mkdir(parents=True, exist_ok=True)

    def extra(side):
        keep = ["--keep-trace", str(pathlib.Path(args.trace_dir) / f"{side}.trace.json.gz")] if args.trace_dir else []
        return ["--min-gap-us", str(args.min_gap_us), *keep]

    sides = trainer_runs.each_side(__file__, args, extra)
    if sides is None:
        return 1
    result = {"weights": args.weights, "device": args.device, "smoke": args.smoke, "batch": args.batch,
              "seq": args.seq, "profiled_steps": args.profile_steps, "min_gap_us": args.min_gap_us, "sides": sides}
    return trainer_runs.report(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
