"""Issue 41 probe: why a second process misses the compile caches on the Trainer path with fusionpass.

`benchmarks/results/latest/trainer-compile-time.md` shows plain compile's warm process hitting
Inductor's FX graph cache and the AOTAutograd cache, and fusionpass's missing both, so its warm
first step costs about a cold one. A miss means the cache key differs between the two processes
(or the first never saved). This probe runs one Trainer configuration of benchmarks/trainer.py
twice, each in its own process over one pair of cache folders (cold, then warm), records in each
the keys torch computes with the lines they are hashed from (`autograd_cache_key`,
`compiled_fx_graph_hash`), and lists the lines that differ between the processes: what makes the
key unstable.

    python benchmarks/probes/cache_keys.py [--weights bf16] [--side fusionpass] [--out FILE.json]
    python benchmarks/probes/cache_keys.py --smoke --device cpu     # the tiny model on the CPU

The result (JSON): per process, the keys in the order computed and the cache counters; per key
kind and position, whether the keys agree and, where not, the debug lines found in one process
only (each cut to 400 characters).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

# trainer_runs lies beside this file: found also where this file is loaded by path (the tests)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import trainer_runs  # noqa: E402


def _record_keys(records: dict) -> None:
    """Wrap torch's two key functions so that each key and its debug lines land in `records`."""
    from torch._functorch._aot_autograd import autograd_cache
    from torch._inductor import codecache

    def wrap(module, name, kind):
        original = getattr(module, name)

        def recorded(*args, **kwargs):
            key, lines = original(*args, **kwargs)
            records.setdefault(kind, []).append({"key": key, "lines": [str(x) for x in lines]})
            return key, lines

        setattr(module, name, recorded)

    wrap(autograd_cache, "autograd_cache_key", "aot_autograd")
    wrap(codecache, "compiled_fx_graph_hash", "fx_graph")


def run(args) -> None:
    records: dict = {}
    _record_keys(records)
    result = trainer_runs.load_trainer().run_one(args.weights, args.side, args.steps, args.batch, args.seq,
                                                 args.smoke, args.device)
    records["caches"] = result.get("caches", {})
    records["first_step_s"] = result.get("first_step_s")
    pathlib.Path(args.run).write_text(json.dumps(records))


def _differences(first: list, second: list) -> list[dict]:
    rows = []
    for i in range(max(len(first), len(second))):
        a = first[i] if i < len(first) else {"key": None, "lines": []}
        b = second[i] if i < len(second) else {"key": None, "lines": []}
        row = {"position": i, "same key": a["key"] == b["key"]}
        if a["key"] != b["key"]:
            only_a, only_b = set(a["lines"]) - set(b["lines"]), set(b["lines"]) - set(a["lines"])
            row["cold only"] = sorted(x[:400] for x in only_a)
            row["warm only"] = sorted(x[:400] for x in only_b)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trainer_runs.add_arguments(p)
    p.add_argument("--side", default="fusionpass")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--run", default=None, help="(internal) one process: write its keys here")
    args = p.parse_args(argv)
    if args.run:
        run(args)
        return 0
    processes = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
        for state in ("cold", "warm"):
            found = trainer_runs.child(__file__, pathlib.Path(cache) / f"{state}.json",
                                       ["--side", args.side, "--steps", str(args.steps), *trainer_runs.forwarded(args)],
                                       env)
            if found is None:
                return 1
            processes[state] = found
    result = {"weights": args.weights, "side": args.side, "device": args.device, "smoke": args.smoke,
              "processes": {s: {"caches": r["caches"], "first_step_s": r["first_step_s"],
                                "keys": {k: [x["key"] for x in r.get(k, [])] for k in ("aot_autograd", "fx_graph")}}
                            for s, r in processes.items()},
              "differences": {k: _differences(processes["cold"].get(k, []), processes["warm"].get(k, []))
                              for k in ("aot_autograd", "fx_graph")}}
    return trainer_runs.report(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
