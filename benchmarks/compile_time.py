"""What fusionpass adds to torch.compile's first step, on the conformance suite's small HF models
(fusionpass/conformance/cases_models.py: 2 layers at real widths, bf16, random weights).

    python benchmarks/compile_time.py [MODEL ...] [--train] [--out FILE]

For each model: the first call (compile + one step) under plain torch.compile and under fusionpass,
alternating which goes first, with Inductor's FX graph and AOT autograd caches off; fusionpass's
own pass time per fusion (`fusionpass.passes.STATISTICS.seconds`) says how much of the difference
is our pattern matching and how much Inductor compiling what the rewrites produce.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import fusionpass
from fusionpass.bench import environment
from fusionpass.conformance import cases_models
from fusionpass.passes import STATISTICS


def first_step(make, backend, train: bool, device: str) -> float:
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    torch.manual_seed(0)
    module, inputs = make(torch.bfloat16, device)
    module.train(train)
    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        compiled = torch.compile(module, backend=backend, dynamic=False)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(train):
            loss, _ = compiled(*inputs)
            if train:
                loss.backward()
        sync()
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="*", default=["llama", "gpt2-eager", "bert", "bloom", "qwen3"])
    p.add_argument("--train", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (fusionpass with cpu=True)")
    args = p.parse_args()
    rows = []
    # warm Inductor's compile workers before anything is timed
    torch.compile(lambda x: x.sin() + 1)(torch.randn(8, device=args.device))
    for i, name in enumerate(args.models):
        make = cases_models._make(*cases_models.MODELS[name])
        order = ("plain", "fusionpass") if i % 2 == 0 else ("fusionpass", "plain")
        seconds = {}
        for impl in order:
            STATISTICS.reset()
            backend = "inductor" if impl == "plain" else fusionpass.backend(cpu=args.device == "cpu")
            seconds[impl] = first_step(make, backend, args.train, args.device)
            if impl == "fusionpass":
                pass_seconds = dict(STATISTICS.seconds)
                matches = fusionpass.stats()
        row = {"model": name, "train": args.train, "plain_s": round(seconds["plain"], 2),
               "fusionpass_s": round(seconds["fusionpass"], 2),
               "added": round(seconds["fusionpass"] / seconds["plain"] - 1, 3),
               "pass_s": round(sum(pass_seconds.values()), 3),
               "pass_s_by_fusion": {k: round(v, 3) for k, v in sorted(pass_seconds.items(), key=lambda kv: -kv[1])},
               "matches": matches}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"median_added": statistics.median(r["added"] for r in rows),
               "median_pass_share_of_plain": statistics.median(r["pass_s"] / r["plain_s"] for r in rows)}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
