"""Where a compiled training step's peak falls: the CUDA allocator's history over one step, replayed
to the moment of the peak, with every live block named by the line that allocated it.

    python benchmarks/memory_snapshot.py --row llama8b-4l-b1-s16384 --version fusionpass [--seq S]
                                         (--version: any of training_memory.VERSIONS; liger needs liger-kernel)
                                         [--out benchmarks/results/memory/snapshot_NAME.md]

The model, step and shapes are training_memory.py's (one child there = one run here), and the
recorded step is step_peak's measured one; the history records Python frames only. The replayed
peak counts from the step's start, so it includes the gradients the step makes. For a block
allocated inside Inductor's generated code, the report prints that line of the generated file
(`buf12 = empty_strided_cuda(...)`) and the nearest "Source Nodes" comment above it, which names
the FX nodes the buffer belongs to.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import linecache
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import training_memory as tm  # noqa: E402

MIB = 2**20


def replay_to_peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """(peak bytes above the first event, the blocks alive at the peak) from one device's trace."""
    def events():
        for i, e in enumerate(trace):
            if e["action"] == "alloc":
                yield i, e, e["size"]
            elif e["action"] == "free_completed":
                yield i, e, -e["size"]

    cur = peak = 0
    peak_at = -1
    for i, _, delta in events():
        cur += delta
        if cur > peak:
            peak, peak_at = cur, i
    live: dict[int, dict] = {}
    for i, e, delta in events():
        if i > peak_at:
            break
        if delta > 0:
            live[e["addr"]] = e
        else:
            live.pop(e["addr"], None)
    return peak, live


def where(frames: list[dict]) -> tuple[str, str]:
    """(a short place, the generated source line) for the innermost frame worth naming."""
    for f in frames:
        name = f["filename"]
        if "torchinductor" in name or "/tmp/" in name and name.endswith(".py"):
            line = linecache.getline(name, f["line"]).strip()
            comment = ""
            for back in range(f["line"] - 1, max(0, f["line"] - 40), -1):
                text = linecache.getline(name, back).strip()
                if text.startswith("# Topologically Sorted Source Nodes") or text.startswith("# Source Nodes"):
                    comment = text.split(":", 1)[-1].strip()[:160]
                    break
            return f"inductor {pathlib.Path(name).name}:{f['line']} {f['name']}", f"{line[:140]} | {comment}"
        if "site-packages/torch/" not in name or "autograd" in name:
            return f"{pathlib.Path(name).name}:{f['line']} {f['name']}", ""
    f = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
    return f"{pathlib.Path(f['filename']).name}:{f['line']} {f['name']}", ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--row", default="llama8b-4l-b1-s16384", choices=list(tm.ROWS))
    p.add_argument("--version", default="fusionpass", choices=tm.VERSIONS)
    p.add_argument("--seq", type=int, default=None, help="override the row's S")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args(argv)

    import fusionpass
    from fusionpass.explain import fresh_compile_caches

    shape, batch, seq = tm.ROWS[args.row]
    seq = args.seq or seq
    probe = tm.Probe((args.version,), shape, batch, seq, "cuda", timed=False)
    torch.manual_seed(0)
    model = tm._build(probe, liger=args.version.startswith("liger"))
    params = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, shape["vocab"], (batch, seq), generator=torch.Generator().manual_seed(0)).cuda()
    with fresh_compile_caches():
        fusionpass.reset_stats()
        step = tm.make_step(tm._compiled(model, args.version, "cuda"), params, ids)
        recorded = {}

        @contextlib.contextmanager
        def record():
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python")
            try:
                yield
            finally:
                recorded["snapshot"] = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)

        above = tm.step_peak(step, params, around=record)
        snap = recorded["snapshot"]
        matches = dict(sorted(fusionpass.stats().items()))

    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, live = replay_to_peak(trace)
    groups: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for e in live.values():
        groups[where(e.get("frames", []))].append(e["size"])
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    out = [f"# Memory at the peak of one training step: {args.row}, S{seq}, {args.version}", "",
           f"- device: {torch.cuda.get_device_name()}; torch {torch.__version__}",
           f"- command: `python benchmarks/memory_snapshot.py {' '.join(argv or sys.argv[1:])}`",
           f"- matches: {json.dumps(matches)}",
           f"- the step's peak above weights and gradients (training_memory.step_peak): {above / MIB:.0f} MiB; "
           f"the replayed trace's peak above the step's start: {peak / MIB:.0f} MiB; "
           f"blocks alive then: {len(live)} ({sum(e['size'] for e in live.values()) / MIB:.0f} MiB)", "",
           "| MiB | blocks | sizes, MiB | allocated at | line |", "|---|---|---|---|---|"]
    for (place, line), sizes in rows[:args.top]:
        common = collections.Counter(round(s / MIB, 1) for s in sizes).most_common(3)
        out.append(f"| {sum(sizes) / MIB:.0f} | {len(sizes)} | {', '.join(f'{s}×{n}' for s, n in common)} "
                   f"| `{place}` | `{line.replace('|', '/')}` |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(out) + "\n")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
