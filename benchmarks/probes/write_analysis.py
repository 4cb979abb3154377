"""How long torch's analysis of which tensors our attention kernels write takes over the calls of
a model, with and without fusionpass.ops.write_analysis's memo (issue 41).

Under torch.compile torch asks it at every traced launch of a user kernel and again in later
phases; this probe asks it once per launch of 8 layers' attention forward and backward (Llama-3.2-1B's
shape, bf16, the collator's key padding), as functionalization does, for an sm_90 target. It needs
no GPU: the analysis makes TTIR, which needs a target only (fusionpass.kernels.launch's stand-in).

    python benchmarks/probes/write_analysis.py --out benchmarks/results/kernel/write_analysis.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

import torch
import triton

from fusionpass.kernels import launch
from fusionpass.kernels.attention import host as attention
from fusionpass.ops import write_analysis

LAYERS, B, HQ, HKV, L, D = 8, 4, 32, 8, 2048, 64


def _asking(analysis):
    """A launcher that asks `analysis` about each launch instead of running it."""

    class Ask:
        def __init__(self, kernel, like):
            self.kernel = kernel

        def __getitem__(self, grid):
            def ask(*args, **kwargs):
                named = dict(zip(self.kernel.arg_names, args))
                named.update((k, launch._CUDA_FLAGS.get(k, v)) for k, v in kwargs.items() if k in self.kernel.arg_names)
                analysis(self.kernel, named, {})

            return ask

    return Ask


def seconds(analysis) -> float:
    q = torch.randn(B, HQ, L, D, dtype=torch.bfloat16)
    k, v = (torch.randn(B, HKV, L, D, dtype=torch.bfloat16) for _ in range(2))
    kp = torch.ones(B, L, dtype=torch.bool)
    saved, attention.launcher = attention.launcher, _asking(analysis)
    try:
        with launch._cuda_target():
            start = time.perf_counter()
            for _ in range(LAYERS):
                out, lse = attention.attention_fwd(q, k, v, causal=True, key_padding=kp)
                attention.attention_bwd(q, q, k, v, out, lse, causal=True, key_padding=kp)
            return time.perf_counter() - start
    finally:
        attention.launcher = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from torch._higher_order_ops import triton_kernel_wrap

    name = write_analysis.install()[-1]
    memo = getattr(triton_kernel_wrap, name)
    rows = {"torch's analysis": round(seconds(memo.analysis), 2), "memoized": round(seconds(memo), 2)}
    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"CPU ({platform.processor() or platform.machine()})",
              "target": "sm_90 (stand-in)", "torch": torch.__version__, "triton": triton.__version__,
              "analysis": f"torch._higher_order_ops.triton_kernel_wrap.{name}",
              "command": "python benchmarks/probes/write_analysis.py --out " + args.out,
              "what": f"{LAYERS} layers' attention fwd + bwd launches (4 kernels each), B{B} Hq{HQ} Hkv{HKV} S{L} D{D} "
                      "bf16, causal + key padding; seconds for asking once per launch",
              "seconds": rows, "misses": memo.asked}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
