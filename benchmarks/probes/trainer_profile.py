"""Issue 39 probe: where a Trainer step's GPU time goes, plain compile beside fusionpass.

The Trainer path's step (benchmarks/trainer.py: `Trainer(bf16=True, torch_compile=True)`, the
Llama-3.2-1B-shaped model) is still short of the issue's speed bars, and the causal split showed
that cutting attention kernel time alone no longer moves the step
(benchmarks/results/kernel/collator_attention_routes.md). This probe profiles a few steps past the
compile, in one process per side, and sums the GPU kernels' time per step by family (`FAMILIES`,
matched on kernel names in order) and lists the largest kernels, so the next change can aim at
what the difference is made of.

    python benchmarks/probes/trainer_profile.py [--weights bf16] [--out FILE.json]
    python benchmarks/probes/trainer_profile.py --smoke --device cpu --seq 32 --batch 2   # CPU ops instead

On the CPU (a check that it runs) the profiler's CPU ops stand in for kernels. On CUDA the host's
ops are profiled too (`host`): the ops with the most self CPU time per step, and the host syncs
(`aten::item`, `_local_scalar_dense`, stream and device synchronizes), since a step whose GPU waits on
the host is bounded by the host, not by its kernels.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

# trainer_runs lies beside this file: found also where this file is loaded by path (the tests)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import trainer_runs  # noqa: E402

# (family, pattern on the kernel's name); the first that matches names it. fusionpass's Triton
# kernels are the `_*_kernel` functions of fusionpass/kernels (names without Inductor's `triton_`
# prefix); Inductor's generated kernels start with `triton_`.
FAMILIES = (
    ("Inductor-generated Triton", r"^triton_"),
    ("fusionpass Triton", r"^_\w+_kernel$"),
    ("SDPA library attention (cuDNN, flash)", r"cudnn|flash|fmha|sdpa|attention"),
    ("GEMM (cuBLAS, CUTLASS)", r"gemm|cutlass|nvjet|xmma|cublas|matmul|_mm|addmm|bmm"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copies and casts", r"copy|cast|convert|to_copy"),
    ("reductions and elementwise (ATen)", r"reduce|elementwise|vectorized|unrolled|fill|index"),
)
OTHER = "other"


def family(name: str) -> str:
    for label, pattern in FAMILIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return OTHER


def _kernels_and_host_ops(cuda: bool, sink: dict):
    """What trainer_runs.profiled_steps calls at the end: (name, total µs, calls) of each kernel (CUDA)
    or op (CPU) into sink["events"], and on CUDA of each host op into sink["host"]."""
    import torch

    def done(prof) -> None:
        events, host = [], []
        for e in prof.key_averages():
            if cuda and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
                if e.self_device_time_total > 0:
                    events.append((e.key, e.self_device_time_total, e.count))
            elif e.self_cpu_time_total > 0:
                (host if cuda else events).append((e.key, e.self_cpu_time_total, e.count))
        sink["events"], sink["host"] = events, host

    return done


def run(args) -> None:
    sink: dict = {}
    cuda = args.device == "cuda"
    callback = trainer_runs.profiled_steps(args.first, args.profile_steps, cuda, _kernels_and_host_ops(cuda, sink))
    steps = args.first + args.profile_steps + 1
    result = trainer_runs.load_trainer().run_one(args.weights, args.side, steps, args.batch, args.seq, args.smoke,
                                                 args.device, callbacks=[callback])
    pathlib.Path(args.run).write_text(json.dumps({"events": sink.get("events", []), "host": sink.get("host", []),
                                                  "step_ms": result["step_ms"], "matched": result["matched"]}))


def summary(events: list, steps: int) -> dict:
    """ms per step by family, and the 15 largest kernels."""
    by_family: dict[str, float] = {}
    for name, us, _calls in events:
        by_family[family(name)] = by_family.get(family(name), 0.0) + us / 1e3 / steps
    top = sorted(events, key=lambda e: -e[1])[:15]
    return {"ms_per_step": {k: round(v, 3) for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
            "total_ms_per_step": round(sum(by_family.values()), 3),
            "largest": [{"name": n[:120], "ms_per_step": round(us / 1e3 / steps, 3), "calls_per_step": c / steps,
                         "family": family(n)} for n, us, c in top]}


# host ops that wait for the GPU: each one drains the queue the host had built ahead
SYNCS = re.compile(r"aten::item|_local_scalar_dense|Synchronize|aten::nonzero|is_nonzero")


def host_summary(host: list, steps: int) -> dict:
    """The 20 host ops with the most self CPU time per step, and the syncs among all of them."""
    def row(name, us, calls):
        return {"name": name[:120], "ms_per_step": round(us / 1e3 / steps, 3), "calls_per_step": calls / steps}

    top = sorted(host, key=lambda e: -e[1])[:20]
    return {"largest": [row(*e) for e in top],
            "syncs": [row(*e) for e in host if SYNCS.search(e[0])]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    trainer_runs.add_arguments(p)
    trainer_runs.add_profile_arguments(p, sides="plain,fusionpass", profile_steps=3)
    args = p.parse_args(argv)
    if args.run:
        run(args)
        return 0
    raws = trainer_runs.each_side(__file__, args)
    if raws is None:
        return 1
    sides = {}
    for side, raw in raws.items():
        sides[side] = {"step_ms": raw["step_ms"], "matched": raw["matched"], **summary(raw["events"], args.profile_steps)}
        if raw.get("host"):
            sides[side]["host"] = host_summary(raw["host"], args.profile_steps)
    result = {"weights": args.weights, "device": args.device, "smoke": args.smoke, "batch": args.batch,
              "seq": args.seq, "profiled_steps": args.profile_steps, "sides": sides}
    if {"plain", "fusionpass"} <= set(sides):
        plain, fused = sides["plain"]["ms_per_step"], sides["fusionpass"]["ms_per_step"]
        result["fusionpass_minus_plain_ms"] = {f: round(fused.get(f, 0.0) - plain.get(f, 0.0), 3)
                                               for f in sorted(set(plain) | set(fused))}
    return trainer_runs.report(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
