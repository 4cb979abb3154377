"""Per-fusion kernel benchmarks on the GPU: numerics at real sizes, then eager, plain torch.compile,
fusionpass and peers timed side by side (interleaved) in one run.

    python benchmarks/kernels.py [--fusions rms_norm_residual,layer_norm_dropout_residual] [--json out.json]

Each case is the subgraph written the way models write it; "fusionpass" is that same function
compiled with the fusionpass backend (so the pattern, the guards and the op are all exercised),
"inductor" is plain torch.compile of it. Training rows report wall time per step (interleaved
medians) and GPU kernel time (the profiler's summed device self time per step).
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

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
    """Across widths, both compiled: forward (wall) and forward+backward (kernel time), where the
    kernel wins (the cost rule's widths)."""
    out = []
    for width in (128, 256, 512, 1024, 2048, 3072, 8192, 16384, 65536):
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
        gy, gh = torch.randn_like(x), torch.randn_like(x)
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w)]

        def train(f):
            def step():
                for t in leaves:
                    t.grad = None
                torch.autograd.backward(list(f(*leaves)), [gy, gh])
            return step

        kt = {k: kernel_time(train(f)) for k, f in (("inductor", inductor), ("fusionpass", fused))}
        out.append(
            {
                "case": f"rms {rows}x{width}",
                "matched": fusionpass.stats().get("rms_norm_residual", 0),
                "fwd inductor ms": round(ms["inductor"], 4),
                "fwd fusionpass ms": round(ms["fusionpass"], 4),
                "fwd speedup": round(ms["inductor"] / ms["fusionpass"], 3),
                "fwd+bwd kernel inductor ms": round(kt["inductor"], 4),
                "fwd+bwd kernel fusionpass ms": round(kt["fusionpass"], 4),
                "fwd+bwd kernel speedup": round(kt["inductor"] / kt["fusionpass"], 3),
                "rel err y": f"{rel_err(y, ry):.1e}",
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# layer_norm_dropout_residual


def bert_output(x, r, w, b, p: float = 0.1):
    """BERT's output block after its dense layer: LayerNorm(dropout(x) + input_tensor)."""
    return F.layer_norm(F.dropout(x, p, training=p > 0) + r, (x.shape[-1],), w, b, 1e-12)


def pre_ln(x, r, w, b, p: float = 0.1):
    """GPT-2/NeoX/OPT pre-LN: h = residual + dropout(out); the next block's LayerNorm(h); h goes on."""
    h = r + F.dropout(x, p, training=p > 0)
    return F.layer_norm(h, (x.shape[-1],), w, b, 1e-5), h


LN_FUSION = "layer_norm_dropout_residual"


def _ln_backends():
    torch._dynamo.reset()
    fusionpass.reset_stats()
    wide = {"layer_norm_min_width": 1, "layer_norm_max_width": 1 << 20}
    return fusionpass.backend(fusions=[LN_FUSION], **wide)


def bench_layer_norm_dropout_residual(rows: int, width: int, dtype=torch.bfloat16) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(rows, width, device=DEVICE, dtype=dtype)
    r = torch.randn(rows, width, device=DEVICE, dtype=dtype)
    w = (1 + 0.1 * torch.randn(width, device=DEVICE)).to(dtype)
    b = (0.1 * torch.randn(width, device=DEVICE)).to(dtype)
    gy = torch.randn_like(x)
    results = []
    bw = measured_copy_bandwidth()
    for form, fn in (("LN(dropout(x)+r)", bert_output), ("h=r+dropout(x); LN(h)", pre_ln)):
        backend = _ln_backends()
        fns = {
            "eager": fn,
            "inductor": torch.compile(fn, dynamic=False),
            "fusionpass": torch.compile(fn, dynamic=False, backend=backend),
        }
        two = form.startswith("h=")
        row = {"case": f"{form} {rows}x{width} {str(dtype).split('.')[-1]}"}

        # numerics with p=0 against an fp32 reference, forward and backward
        ref_in = [t.detach().float().clone().requires_grad_() for t in (x, r, w, b)]
        ref = fn(*ref_in, p=0.0)
        got_in = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
        got = fns["fusionpass"](*got_in, p=0.0)
        outs = (ref, got) if not two else (ref[0], got[0])
        torch.autograd.backward(outs[0], gy.float())
        torch.autograd.backward(outs[1], gy)
        row["p=0 rel err y/dx/dw"] = "/".join(
            f"{rel_err(a, b_):.1e}" for a, b_ in ((outs[1], outs[0]), (got_in[0].grad, ref_in[0].grad),
                                                 (got_in[2].grad, ref_in[2].grad))
        )
        # p=0.1: the dropped fraction of dx (exact zeros where dropped), against p
        got_in = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
        out = fns["fusionpass"](*got_in)
        torch.autograd.backward(out if not two else out[0], gy)
        row["dropped frac"] = round((got_in[0].grad == 0).float().mean().item(), 4)
        row["matched"] = fusionpass.stats().get(LN_FUSION, 0)

        def train_step(f):
            leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]

            def step():
                for t in leaves:
                    t.grad = None
                o = f(*leaves)
                torch.autograd.backward(o if not two else o[0], gy)

            return step

        def forward(f):
            leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
            return lambda: f(*leaves)

        for name, make in (("fwd (training)", forward), ("fwd+bwd", train_step)):
            steps = {k: make(f) for k, f in fns.items()}
            wall = time_interleaved(steps, DEVICE)
            kts = {k: kernel_time(step) for k, step in steps.items()}
            for k in fns:
                results.append({**row, "pass": name, "impl": k, "ms": round(wall[k], 4),
                                "vs inductor": round(wall["inductor"] / wall[k], 3),
                                "kernel ms": round(kts[k], 4),
                                "kernel vs inductor": round(kts["inductor"] / kts[k], 3),
                                "peak MiB": round(peak_memory(steps[k]) / 2**20, 1)})
        with torch.no_grad():
            inf = {k: (lambda f=f: f(x, r, w, b, p=0.0)) for k, f in fns.items()}
            wall = time_interleaved(inf, DEVICE)
            kts = {k: kernel_time(f) for k, f in inf.items()}
        moved = 3 * rows * width * x.element_size()  # read x, r; write y
        for k in fns:
            results.append({**row, "pass": "fwd (inference)", "impl": k, "ms": round(wall[k], 4),
                            "vs inductor": round(wall["inductor"] / wall[k], 3),
                            "kernel ms": round(kts[k], 4),
                            "kernel vs inductor": round(kts["inductor"] / kts[k], 3),
                            "% copy bw (kernel)": round(100 * moved / (kts[k] / 1e3) / bw, 1)})
    return results


def bench_layer_norm_widths(dtype=torch.bfloat16) -> list[dict]:
    """BERT form at 16384 rows across widths, kernel time: training fwd+bwd (p=0.1) and inference."""
    out = []
    for width in (768, 1024, 2048, 4096, 8192):
        x = torch.randn(16384, width, device=DEVICE, dtype=dtype)
        r, gy = torch.randn_like(x), torch.randn_like(x)
        w = torch.randn(width, device=DEVICE, dtype=dtype)
        b = torch.randn(width, device=DEVICE, dtype=dtype)
        backend = _ln_backends()
        inductor = torch.compile(bert_output, dynamic=False)
        fused = torch.compile(bert_output, dynamic=False, backend=backend)
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]

        def step(f):
            def run():
                for t in leaves:
                    t.grad = None
                f(*leaves).backward(gy)
            return run

        with torch.no_grad():
            inf = {k: kernel_time(lambda f=f: f(x, r, w, b, p=0.0)) for k, f in
                   (("inductor", inductor), ("fusionpass", fused))}
        train = {k: kernel_time(step(f)) for k, f in (("inductor", inductor), ("fusionpass", fused))}
        out.append({"case": f"16384x{width}", "matched": fusionpass.stats().get(LN_FUSION, 0),
                    "train fwd+bwd inductor ms": round(train["inductor"], 4),
                    "train fwd+bwd fusionpass ms": round(train["fusionpass"], 4),
                    "train speedup": round(train["inductor"] / train["fusionpass"], 3),
                    "inference inductor ms": round(inf["inductor"], 4),
                    "inference fusionpass ms": round(inf["fusionpass"], 4),
                    "inference speedup": round(inf["inductor"] / inf["fusionpass"], 3)})
    return out


# ---------------------------------------------------------------------------------------------
# linear_cross_entropy

CE_FUSION = "linear_cross_entropy"


def hf_causal_lm_loss(h, weight, labels):
    """The lm_head and transformers' ForCausalLMLoss core: fp32 logits, mean over non-ignored."""
    logits = torch.nn.functional.linear(h, weight)
    return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="mean")


def bench_linear_cross_entropy(tokens: int, width: int, vocab: int, dtype=torch.bfloat16,
                               tilings: tuple = ()) -> list[dict]:
    """Forward+backward of lm_head + CE (logits not returned), plain torch.compile against the
    fused op; `tilings`: (chunk MiB, block_v, warps) launches of the op to compare as well."""
    from fusionpass.kernels import cross_entropy as ce_kernels

    torch.manual_seed(0)
    h = (torch.randn(tokens, width, device=DEVICE) / width**0.5).to(dtype)
    w = (torch.randn(vocab, width, device=DEVICE) / width**0.25).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE)
    labels[::7] = -100
    torch._dynamo.reset()
    fusionpass.reset_stats()
    inductor = torch.compile(hf_causal_lm_loss, dynamic=False)
    fused = torch.compile(hf_causal_lm_loss, dynamic=False, backend=fusionpass.backend(fusions=[CE_FUSION]))
    # numerics against fp32 autograd
    ref_in = [h.float().requires_grad_(), w.float().requires_grad_()]
    ref = hf_causal_lm_loss(*ref_in, labels)
    ref.backward()
    got_in = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    got = fused(*got_in, labels)
    got.backward()
    row = {"case": f"linear+CE N{tokens} D{width} V{vocab} {str(dtype).split('.')[-1]}",
           "matched": fusionpass.stats().get(CE_FUSION, 0),
           "rel err loss/dh/dw": f"{abs(got.item() - ref.item()) / abs(ref.item()):.1e}/"
                                 f"{rel_err(got_in[0].grad, ref_in[0].grad):.1e}/{rel_err(got_in[1].grad, ref_in[1].grad):.1e}"}
    del ref_in, ref, got_in, got
    torch.cuda.empty_cache()
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]

    def step(f):
        def run():
            for t in leaves:
                t.grad = None
            f(*leaves, labels).backward()
        return run

    steps = {"inductor": step(inductor), "fusionpass": step(fused)}
    default = ce_kernels.CUDA_TILING
    for mib, block_v, warps in tilings:
        tiling = ce_kernels.Tiling(chunk_bytes=mib << 20, block_v=block_v, num_warps=warps)

        def tuned(t=tiling):
            ce_kernels.CUDA_TILING = t
            try:
                steps["fusionpass"]()
            finally:
                ce_kernels.CUDA_TILING = default
        steps[f"fusionpass {mib}MiB/bv{block_v}/w{warps}"] = tuned
    wall = time_interleaved(steps, DEVICE, rounds=3, iters=3, warmup=1)
    out = []
    for k, f in steps.items():
        for t in leaves:
            t.grad = None
        out.append({**row, "impl": k, "ms": round(wall[k], 3),
                    "vs inductor": round(wall["inductor"] / wall[k], 3),
                    "extra peak GiB": round(peak_memory(f) / 2**30, 3)})
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
        show("rms_norm_residual by width (bf16, 64 MiB per tensor)", report["rms_norm_widths"])
    if LN_FUSION in args.fusions.split(","):
        report[LN_FUSION] = bench_layer_norm_dropout_residual(16384, 4096)
        show(f"{LN_FUSION} 16384x4096 bf16, p=0.1", report[LN_FUSION])
        report["layer_norm_widths"] = bench_layer_norm_widths()
        show(f"{LN_FUSION} by width (kernel time, every width forced on)", report["layer_norm_widths"])
    if CE_FUSION in args.fusions.split(","):
        tilings = ((256, 4096, 8), (256, 8192, 16), (512, 4096, 8), (128, 4096, 8), (256, 2048, 4))
        report[CE_FUSION] = bench_linear_cross_entropy(8192, 4096, 128256, tilings=tilings)
        show(f"{CE_FUSION} N8192 D4096 V128256 bf16, fwd+bwd", report[CE_FUSION])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
