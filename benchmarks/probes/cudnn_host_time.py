"""Issue 40 probe: the host time of one attention call, the cuDNN padding route beside our kernel.

On the Trainer path the cuDNN route (attention_cudnn_padding) cut the step's GPU kernel time yet made
the step slower: the GPU waited on the host longer (benchmarks/results/trainer/
2026-12-06-h100-bf16-cudnn-padding-profile.md). This probe times, at a shape small enough that the
GPU never holds the host back, how long the host takes to issue each layer of that route, and where
in the route the time goes (a profiler's CPU-side view, CUDA runtime calls included).

    python benchmarks/probes/cudnn_host_time.py [--calls 200] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import fusionpass  # noqa: F401  (registers the ops)


def _issue_us(fn, calls: int) -> float:
    """Microseconds per call to issue `fn` (the GPU work is small enough to stay behind the host)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - t
    torch.cuda.synchronize()
    return round(issued / calls * 1e6, 1)


def _cases(B, H, Hkv, S, D):
    from fusionpass.fusions.flash_attention.padded_op import _lengths
    from fusionpass.kernels import cudnn_attention

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, H, S, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, device=dev, dtype=dt, requires_grad=True)
    keep = torch.ones(B, S, dtype=torch.bool, device=dev)
    scale = D**-0.5
    seq_kv, _prefix = _lengths(keep)
    out, lse = cudnn_attention.padded_fwd(q.detach(), k.detach(), v.detach(), seq_kv, scale=scale, causal=True)
    do = torch.randn_like(out)
    k_rep = k.detach().repeat_interleave(H // Hkv, 1).requires_grad_()
    v_rep = v.detach().repeat_interleave(H // Hkv, 1).requires_grad_()

    def ours_fwd():
        return torch.ops.fusionpass.flash_attention(q, k, v, keep, scale=scale, causal=True)

    def ours_fwd_bwd():
        o, _ = torch.ops.fusionpass.flash_attention(q, k, v, keep, scale=scale, causal=True)
        o.backward(do)

    def route_fwd():
        return torch.ops.fusionpass.padded_attention(q, k, v, keep, scale=scale, causal=True)

    def route_fwd_bwd():
        o, _ = torch.ops.fusionpass.padded_attention(q, k, v, keep, scale=scale, causal=True)
        o.backward(do)

    def cudnn_fwd_only():
        return cudnn_attention.padded_fwd(q.detach(), k.detach(), v.detach(), seq_kv, scale=scale, causal=True)

    def cudnn_bwd_only():
        return cudnn_attention.padded_bwd(do, q.detach(), k.detach(), v.detach(), out, lse, seq_kv, scale=scale,
                                          causal=True)

    def lengths_only():
        return _lengths(keep)

    def sdpa_causal_fwd_bwd():
        # plain compile's no-mask route, eager here: the library's own entry, for scale
        o = torch.nn.functional.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
        o.backward(do)

    return {"ours_fwd": ours_fwd, "ours_fwd_bwd": ours_fwd_bwd, "route_fwd": route_fwd,
            "route_fwd_bwd": route_fwd_bwd, "cudnn_frontend_fwd": cudnn_fwd_only,
            "cudnn_frontend_bwd": cudnn_bwd_only, "lengths": lengths_only, "sdpa_causal_fwd_bwd": sdpa_causal_fwd_bwd}


def _profile(fn, calls: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    return [{"name": e.key[:100], "self_cpu_us_per_call": round(e.self_cpu_time_total / calls, 1),
             "count_per_call": e.count / calls} for e in rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--shape", default="4,32,8,256,64", help="B,H,Hkv,S,D")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    B, H, Hkv, S, D = (int(x) for x in args.shape.split(","))
    cases = _cases(B, H, Hkv, S, D)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": dict(B=B, H=H, Hkv=Hkv, S=S, D=D),
              "issue_us_per_call": {name: _issue_us(fn, args.calls) for name, fn in cases.items()},
              "profile_route_fwd_bwd": _profile(cases["route_fwd_bwd"], 20),
              "profile_ours_fwd_bwd": _profile(cases["ours_fwd_bwd"], 20)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
