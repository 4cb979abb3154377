"""`python -m fusionpass.conformance` (also `fusionpass check`): run the conformance cases, print a
table, write the result file the CPU gate reads (fusionpass.conformance.gate).

Cases run in `--jobs` worker processes (compiling dominates; the GPU is shared), each with
uninitialized memory filled with NaN. Workers take the next unclaimed case from one list ordered
longest first by the seconds each case took in the previous result file, so that the slowest
cases do not end up queued behind each other at the end of a run.

The workers share one GPU. By default there are as many as its memory holds (GIB_PER_WORKER), and
a case that failed for want of GPU resources (RESOURCE_ERRORS) runs again once the others are
done, in a pool of a quarter as many workers. `--budget` stops claiming cases after that many
seconds and writes the result all the same, its unrun cases failed as "not run"; `--rerun-failed`
then runs only those, so a run split over several calls of a time-limited machine still ends in
one result file of one source digest. `--reuse-plain` takes plain compile's errors from earlier
result files wherever a case's plain side is unchanged (fusionpass.conformance.plain_side).
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
import tempfile
import time

DEFAULT_OUT = "benchmarks/results/conformance.json"

# GPU memory per worker: the most workers an H100 ran without out-of-memory failures, where more
# per card failed in about a tenth of the cases (the runs of 2026-12-05, in that day's closing notes).
GIB_PER_WORKER = 8
# What a case raises when the workers beside it hold the GPU's memory: besides out-of-memory
# itself, cuBLAS and cuDNN report a failed allocation inside their call as these. A case that
# raises them for a bug raises them again when it runs again, and fails then.
RESOURCE_ERRORS = ("OutOfMemoryError", "out of memory", "CUBLAS_STATUS_EXECUTION_FAILED",
                   "CUBLAS_STATUS_INTERNAL_ERROR", "CUBLAS_STATUS_ALLOC_FAILED", "CUDNN_STATUS_INTERNAL_ERROR",
                   "CUDA error: unknown error")
NOT_RUN = "not run"


def _nan_fill() -> None:
    import torch

    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.use_deterministic_algorithms(True, warn_only=True)


def _selected(only: list[str] | None, device: str = "cuda"):
    from fusionpass.conformance import all_cases

    cases = [c for c in all_cases() if device == "cuda" or c.near_miss is None]
    if only:
        cases = [c for c in cases if any(c.name.startswith(p) for p in only)]
    return cases


def _longest_first(cases, previous: str):
    """Cases by their seconds in the result file `previous`, longest first; cases it lacks first."""
    try:
        seconds = {r["name"]: r["seconds"] for r in json.loads(pathlib.Path(previous).read_text())["cases"]
                   if "seconds" in r}
    except (OSError, ValueError, KeyError):
        seconds = {}
    return sorted(cases, key=lambda c: (-seconds.get(c.name, float("inf")), c.name))


def _claim(claims: str, index: int) -> bool:
    """True for the one worker that creates the claim file of case `index` first."""
    try:
        os.close(os.open(os.path.join(claims, f"case{index}"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def _worker(args) -> int:
    import warnings

    _nan_fill()
    warnings.filterwarnings("ignore")
    from fusionpass.conformance import plain_side, run_case

    known_plain = plain_side.known_errors(args.reuse_plain or [])
    results = []
    for index, case in enumerate(_longest_first(_selected(args.only, args.device), args.timings)):
        if args.deadline is not None and time.time() > args.deadline:
            break
        if not _claim(args.claims, index):
            continue
        t0 = time.perf_counter()
        if args.device == "cpu":
            case = dataclasses.replace(case, config={**case.config, "cpu": True})
        r = run_case(case, args.device, known_plain=known_plain)
        r["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(r)
        print(f"[{args.worker}] {'PASS' if r['passed'] else 'FAIL'} {r['name']} {r.get('reason', '')}", flush=True)
        # after every case: what has run survives a worker stopped mid-way (--parts-dir)
        pathlib.Path(args.out).write_text(json.dumps(results))
    return 0


def environment(device: str) -> dict:
    import torch
    import triton

    from fusionpass.passes import source_digest

    env = {"torch": torch.__version__, "triton": triton.__version__, "source_digest": source_digest(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "device": device}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    env["gpu"] = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else None
    return env


def summary(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        s = out.setdefault(r["fusion"], {"cases": 0, "passed": 0, "variants": []})
        s["cases"] += 1
        s["passed"] += bool(r["passed"])
        if r["variant"] not in s["variants"]:
            s["variants"].append(r["variant"])
    return out


def _table(results: list[dict]) -> str:
    lines = [f"{'case':86s} {'ok':4s} {'fusionpass':>10s} {'plain':>10s}  worst tensor"]
    for r in results:
        w = r.get("worst") or {}
        lines.append(f"{r['name'][:86]:86s} {'ok' if r['passed'] else 'FAIL':4s} "
                     f"{w.get('fusionpass', float('nan')):10.2e} {w.get('plain', float('nan')):10.2e}  "
                     f"{w.get('tensor', '')}" + ("" if r["passed"] else f"  <- {r.get('reason', '')[:200]}"))
    lines.append("")
    for fusion, s in summary(results).items():
        lines.append(f"{fusion:28s} {s['passed']}/{s['cases']} passed, variants: {', '.join(s['variants'])}")
    return "\n".join(lines)


def _resource_failure(result: dict) -> bool:
    reason = result.get("reason", "")
    return not result["passed"] and any(error in reason for error in RESOURCE_ERRORS)


def default_jobs(device: str) -> int:
    """As many workers as the GPU's memory holds (GIB_PER_WORKER), and no more than CPUs."""
    cpus = os.cpu_count() or 1
    if device != "cuda":
        return min(8, cpus)
    import torch

    if not torch.cuda.is_available():
        return min(8, cpus)
    return max(1, min(cpus, torch.cuda.get_device_properties(0).total_memory // (GIB_PER_WORKER << 30)))


def _previous_passes(paths: list[str], digest: str) -> list[dict]:
    """The passing cases of result files `paths`, each of source digest `digest`."""
    kept: dict[str, dict] = {}
    for path in paths:
        previous = json.loads(pathlib.Path(path).read_text())
        if previous.get("source_digest") != digest:
            raise SystemExit(f"{path} is of another source digest: run every case")
        kept.update((r["name"], r) for r in previous["cases"] if r["passed"])
    return list(kept.values())


def _pool(args, only: list[str] | None, jobs: int, tmp: str, tag: str) -> tuple[list[dict], list[int]]:
    """Run the cases `only` selects in `jobs` worker processes; their results and exit codes."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")
    claims = tempfile.mkdtemp(prefix=f"{tag}claims-", dir=tmp)
    procs, parts = [], []
    for i in range(jobs):
        part = os.path.join(tmp, f"{tag}part{i}.json")
        parts.append(part)
        cmd = [sys.executable, "-m", "fusionpass.conformance", "--worker", str(i), "--claims", claims,
               "--timings", args.timings, "--device", args.device, "--out", part]
        cmd += (["--deadline", str(args.deadline)] if args.deadline is not None else []) + (["--only", *only] if only else [])
        cmd += ["--reuse-plain", *args.reuse_plain] if args.reuse_plain else []
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [proc.wait() for proc in procs]
    results = []
    for part in parts:
        if os.path.exists(part):
            results.extend(json.loads(pathlib.Path(part).read_text()))
    return results, codes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fusionpass check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--only", nargs="*", help="case-name prefixes (default: every case)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: as many as the GPU's "
                   f"memory holds at {GIB_PER_WORKER} GiB each, at most one per CPU)")
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--rerun-failed", metavar="RESULT", nargs="+", default=None,
                   help="run only the cases that failed or are missing in every RESULT (result files of the "
                        "same source digest) and keep their passing ones")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="claim no case after this many seconds; the result lists the rest as not run "
                        "(leave the longest case's time to spare under a time limit)")
    p.add_argument("--reuse-plain", metavar="RESULT", nargs="+", default=None,
                   help="take plain compile's errors from these result files (any source digest) for every "
                        "case whose plain side is unchanged (same graphs, values, versions and GPU) instead "
                        "of compiling it again")
    p.add_argument("--parts-dir", default=None, help="keep each worker's results here (default: a temporary folder)")
    p.add_argument("--timings", default=DEFAULT_OUT,
                   help="a result file whose per-case seconds order the run (default: the committed one)")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--claims", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # time.time() of --budget
    args = p.parse_args(argv)
    if args.worker is not None:
        return _worker(args)

    t0 = time.perf_counter()
    if args.reuse_plain:
        from fusionpass.conformance import plain_side

        try:  # a file that cannot be read stops the run here, not in every worker
            plain_side.known_errors(args.reuse_plain)
        except ValueError as e:
            raise SystemExit(str(e)) from e
    if args.deadline is None and args.budget is not None:
        args.deadline = time.time() + args.budget
    kept, selected = [], [c.name for c in _selected(args.only, args.device)]
    if args.rerun_failed:
        from fusionpass.passes import source_digest

        kept = [r for r in _previous_passes(args.rerun_failed, source_digest()) if r["name"] in set(selected)]
        done = {r["name"] for r in kept}
        args.only = [name for name in selected if name not in done]
        if not args.only:
            args.only = ["(none)"]
    jobs = max(1, min(args.jobs or default_jobs(args.device), len(_selected(args.only, args.device))))
    with (tempfile.TemporaryDirectory(prefix="fusionpass-check-") if args.parts_dir is None
          else contextlib.nullcontext(args.parts_dir)) as tmp:
        os.makedirs(tmp, exist_ok=True)
        results, codes = _pool(args, args.only, jobs, tmp, "")
        # (past the budget's deadline a retry pool's workers would start only to stop: they stay
        # failed, for --rerun-failed)
        out_of_time = args.deadline is not None and time.time() > args.deadline
        retry = [r["name"] for r in results if _resource_failure(r)] if jobs > 1 and not out_of_time else []
        if retry:
            retry_jobs = max(1, min(jobs // 4, len(retry)))
            print(f"\n{len(retry)} case(s) failed for want of GPU resources: again with {retry_jobs} worker(s)",
                  flush=True)
            again, more_codes = _pool(args, retry, retry_jobs, tmp, "retry-")
            results = [r for r in results if r["name"] not in set(retry)] + again
            codes += more_codes
    reused = sum(bool(r.get("plain_reused")) for r in results)  # of the cases run now, not those kept
    results.extend(kept)
    ran = {r["name"] for r in results}
    missing = [name for name in selected if name not in ran]
    out_of_time = args.deadline is not None and time.time() > args.deadline
    why = "the budget ran out" if out_of_time else f"worker exit codes {codes}"  # else a worker died
    for name in missing:
        results.append({"name": name, "fusion": name.split("/")[0], "variant": name.split("/")[1],
                        "passed": False, "reason": f"{NOT_RUN} ({why})"})
    results.sort(key=lambda r: r["name"])
    report = {**environment(args.device), "command": " ".join(["fusionpass check", *(argv or sys.argv[1:])]),
              "seconds": round(time.perf_counter() - t0, 1), "rerun_after_resource_errors": retry,
              "plain_reused": reused,
              "summary": summary(results), "cases": results}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(_table(results))
    failed = sum(not r["passed"] for r in results)
    print(f"\n{len(results) - failed}/{len(results)} cases passed in {report['seconds']} s -> {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
