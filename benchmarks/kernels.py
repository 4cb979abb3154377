"""Per-fusion kernel benchmarks on the GPU: numerics at real sizes, then eager, plain torch.compile,
fusionpass and peers timed side by side (interleaved) in one run.

    python benchmarks/kernels.py [--fusions rms_norm_residual] [--json out.json]

Each case is the subgraph written the way models write it; "fusionpass" is that same function
compiled with the fusionpass backend (so the pattern, the guards and the op are all exercised),
"inductor" is plain torch.compile of it. Training rows report wall time per step (interleaved
medians) and GPU kernel time (the profiler's summed device self time per step).
"""
from __future__ import annotations

import argparse
import json

import torch

import fusionpass
from fusionpass.bench import environment, kernel_time, peak_memory, time_interleaved

try:
    from tabulate import tabulate
except ImportError:  # pragma: no cover
    tabulate = None

DEVICE = "cuda"
# Match counts are only recorded when our pass runs, i.e. not on an FX-graph-cache hit.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
COPY_BW = None  # measured once: bytes read + written per second of a device-to-device copy


def measured_copy_bandwidth() -> float:
    global COPY_BW
    if COPY_BW is None:
        src = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device=DEVICE)
        dst = torch.empty_like(src)
        ms = time_interleaved({"copy": lambda: dst.copy_(src)}, DEVICE, rounds=5, iters=10)["copy"]
        COPY_BW = 2 * src.numel() * src.element_size() / (ms / 1e3)
    return COPY_BW


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
# rms_norm_residual


def hf_add_rms_norm(x, residual, weight, eps: float = 1e-6):
    """HF Llama's decoder-layer residual add followed by LlamaRMSNorm; returns (y, h)."""
    h = residual + x
    hf = h.to(torch.float32)
    variance = hf.pow(2).mean(-1, keepdim=True)
    hf = hf * torch.rsqrt(variance + eps)
    return weight * hf.to(x.dtype), h


def liger_add_rms_norm():
    try:
        from liger_kernel.transformers import LigerFusedAddRMSNorm
    except Exception:
        return None
    return LigerFusedAddRMSNorm


def bench_rms_norm_residual(rows: int, width: int, dtype=torch.bfloat16) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(rows, width, device=DEVICE, dtype=dtype)
    r = torch.randn(rows, width, device=DEVICE, dtype=dtype)
    w = (1 + 0.1 * torch.randn(width, device=DEVICE)).to(dtype)
    gy = torch.randn_like(x)
    gh = torch.randn_like(x)

    torch._dynamo.reset()
    fusionpass.reset_stats()
    inductor = torch.compile(hf_add_rms_norm, dynamic=False)
    fused = torch.compile(
        hf_add_rms_norm, dynamic=False, backend=fusionpass.backend(fusions=["rms_norm_residual"])
    )
    fns = {"eager": hf_add_rms_norm, "inductor": inductor, "fusionpass": fused}
    liger_cls = liger_add_rms_norm()
    if liger_cls is not None:
        liger = liger_cls(width, eps=1e-6).to(DEVICE, dtype)
        liger.weight.data.copy_(w)
        # Liger's fused add+norm returns (y, h) for (x, residual)
        fns["liger"] = lambda x_, r_, w_: liger(x_, r_)

    # numerics at this size against an fp32 reference of the same formula
    ref_y, ref_h = hf_add_rms_norm(x.float(), r.float(), w.float())
    row = {"case": f"rms_norm_residual {rows}x{width} {str(dtype).split('.')[-1]}"}
    with torch.no_grad():
        y, h = fused(x, r, w)
    row["matched"] = fusionpass.stats().get("rms_norm_residual", 0)
    row["fwd rel err y/h"] = f"{rel_err(y, ref_y):.1e}/{rel_err(h, ref_h):.1e}"

    # backward numerics: fp32 autograd reference
    xs = [t.detach().float().clone().requires_grad_() for t in (x, r, w)]
    ry, rh = hf_add_rms_norm(*xs)
    torch.autograd.backward([ry, rh], [gy.float(), gh.float()])
    xg = [t.detach().clone().requires_grad_() for t in (x, r, w)]
    fy, fh = fused(*xg)
    torch.autograd.backward([fy, fh], [gy, gh])
    row["bwd rel err dx/dw"] = (
        f"{rel_err(xg[0].grad, xs[0].grad):.1e}/{rel_err(xg[2].grad, xs[2].grad):.1e}"
    )

    results = []
    moved = 4 * rows * width * x.element_size()  # read x, r; write y, h
    with torch.no_grad():
        fwd = time_interleaved({k: (lambda f=f: f(x, r, w)) for k, f in fns.items()}, DEVICE)
    bw = measured_copy_bandwidth()
    for k, ms in fwd.items():
        results.append(
            {
                **row,
                "pass": "fwd (inference)",
                "impl": k,
                "ms": round(ms, 4),
                "TB/s": round(moved / (ms / 1e3) / 1e12, 2),
                "% copy bw": round(100 * moved / (ms / 1e3) / bw, 1),
                "vs inductor": round(fwd["inductor"] / ms, 3),
            }
        )

    def train_step(f):
        xs_ = [t.detach().clone().requires_grad_() for t in (x, r, w)]

        def step():
            for t in xs_:
                t.grad = None  # assign, not accumulate: no extra add kernels in the step
            y_, h_ = f(*xs_)
            torch.autograd.backward([y_, h_], [gy, gh])

        return step

    steps = {k: train_step(f) for k, f in fns.items()}
    wall = time_interleaved(steps, DEVICE)
    for k, step in steps.items():
        kt = kernel_time(step)
        results.append(
            {
                **row,
                "pass": "fwd+bwd",
                "impl": k,
                "ms": round(wall[k], 4),
                "kernel ms": round(kt, 4),
                "vs inductor": round(wall["inductor"] / wall[k], 3),
                "peak MiB": round(peak_memory(step) / 2**20, 1),
            }
        )
    kt_ind = next(r["kernel ms"] for r in results if r["pass"] == "fwd+bwd" and r["impl"] == "inductor")
    for r_ in results:
        if r_["pass"] == "fwd+bwd":
            r_["kernel vs inductor"] = round(kt_ind / r_["kernel ms"], 3)
    return results


def bench_rms_norm_widths(dtype=torch.bfloat16) -> list[dict]:
    """Forward only, across widths, both compiled: where the kernel wins (the cost rule's width)."""
    out = []
    for width in (128, 256, 512, 1024, 2048, 8192, 16384, 65536):
        rows = max(1, (64 * 2**20) // (width * 2))  # 64 MiB per tensor
        x = torch.randn(rows, width, device=DEVICE, dtype=dtype)
        r = torch.randn_like(x)
        w = torch.randn(width, device=DEVICE, dtype=dtype)
        torch._dynamo.reset()
        fusionpass.reset_stats()
        inductor = torch.compile(hf_add_rms_norm, dynamic=False)
        fused = torch.compile(
            hf_add_rms_norm,
            dynamic=False,
            backend=fusionpass.backend(
                fusions=["rms_norm_residual"], rms_norm_min_width=1, rms_norm_max_width=65536
            ),
        )
        with torch.no_grad():
            y, h = fused(x, r, w)
            ms = time_interleaved(
                {"inductor": lambda: inductor(x, r, w), "fusionpass": lambda: fused(x, r, w)}, DEVICE
            )
        ry, _ = hf_add_rms_norm(x.float(), r.float(), w.float())
        out.append(
            {
                "case": f"rms fwd {rows}x{width}",
                "matched": fusionpass.stats().get("rms_norm_residual", 0),
                "inductor ms": round(ms["inductor"], 4),
                "fusionpass ms": round(ms["fusionpass"], 4),
                "speedup": round(ms["inductor"] / ms["fusionpass"], 3),
                "rel err y": f"{rel_err(y, ry):.1e}",
            }
        )
    return out


def show(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}")
    if tabulate is not None:
        print(tabulate(rows, headers="keys", tablefmt="github"))
    else:
        for r in rows:
            print(r)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fusions", default="rms_norm_residual")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = environment()
    print(env)
    report = {"environment": env, "copy_bandwidth_TBps": measured_copy_bandwidth() / 1e12}
    print(f"device-to-device copy: {report['copy_bandwidth_TBps']:.2f} TB/s")
    if "rms_norm_residual" in args.fusions.split(","):
        report["rms_norm_residual"] = bench_rms_norm_residual(16384, 4096)
        show("rms_norm_residual 16384x4096 bf16", report["rms_norm_residual"])
        report["rms_norm_widths"] = bench_rms_norm_widths()
        show("rms_norm_residual forward by width (bf16, 64 MiB per tensor)", report["rms_norm_widths"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
