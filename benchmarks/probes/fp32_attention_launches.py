"""fp32 attention on the H200: what compiling the FA2 and split-KV decode kernels costs and how
fast they run, at the default launches and smaller fp32 tiles, beside SDPA as plain torch.compile
runs it. fp32 dots in these kernels are IEEE fp32 (FMA, no tensor cores), and the conformance
suite's fp32 attention cases spent most of their time compiling our kernels.

    python benchmarks/probes/fp32_attention_launches.py GROUP D   # GROUP: train | decode | decode-plain
Each process starts from an empty Triton cache (TRITON_CACHE_DIR) so a launch's first call
includes its compile. Writes $OUT/fp32_attention_<group>.json.
"""
import json
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fusionpass.kernels.attention as A  # noqa: E402
import fusionpass.kernels.decode_attention as DA  # noqa: E402
from fusionpass.bench import environment, kernel_time  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
group, D = sys.argv[1], int(sys.argv[2])
dev = "cuda"
res = {"env": environment(), "group": group, "D": D, "runs": []}


def first_and_steady(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    return round(first, 2), round(kernel_time(fn, iters=10), 4)


def record(**kw):
    res["runs"].append(kw)
    print(kw, flush=True)
    with open(os.path.join(OUT, f"fp32_attention_{group}_{D}.json"), "w") as f:
        json.dump(res, f, indent=1)


if group == "train":
    # mistral-sdpa-like: B1 H12/2 S1000 causal (the conformance fp32 training shapes)
    B, Hq, Hkv, S = 1, 12, 2, 1000
    # (fwd, dkdv, dq) launches (block_m, block_n, warps, stages); None = the defaults
    LAUNCHES = {
        "default": None,
        "64x32w4": ((64, 32, 4, 1), (32, 64, 4, 1), (64, 32, 4, 1)),
        "32x32w4": ((32, 32, 4, 1), (32, 32, 4, 1), (32, 32, 4, 1)),
        "64x64w4": ((64, 64, 4, 1), (32, 64, 4, 1), (64, 64, 4, 1)),
        "32x16w2": ((32, 16, 2, 1), (16, 32, 2, 1), (32, 16, 2, 1)),
    }
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, Hq, S, D, device=dev, generator=g).to(dtype)
        k = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(dtype)
        v = torch.randn(B, Hkv, S, D, device=dev, generator=g).to(dtype)
        do = torch.randn(B, Hq, S, D, device=dev, generator=g).to(dtype)
        ref = [t.double() for t in (q, k, v, do)]
        qr, kr, vr = (t.clone().requires_grad_() for t in ref[:3])
        o_ref = F.scaled_dot_product_attention(qr, kr.repeat_interleave(Hq // Hkv, 1),
                                               vr.repeat_interleave(Hq // Hkv, 1), is_causal=True)
        o_ref.backward(ref[3])
        refs = (o_ref.detach(), qr.grad, kr.grad, vr.grad)

        def err(xs):
            return [round(((x.double() - r).norm() / r.norm()).item(), 9) for x, r in zip(xs, refs)]

        for name, launch in (LAUNCHES.items() if dtype == torch.float32 else [("default", None)]):
            fw, kv, dq = launch or ((None,) * 4,) * 3

            def step():
                o, lse = A.attention_fwd(q, k, v, causal=True, block_m=fw[0], block_n=fw[1],
                                         num_warps=fw[2], num_stages=fw[3])
                grads = A.attention_bwd(do, q, k, v, o, lse, causal=True, block_m=kv[0], block_n=kv[1],
                                        num_warps=kv[2], num_stages=kv[3], dq_block_m=dq[0], dq_block_n=dq[1],
                                        dq_num_warps=dq[2], dq_num_stages=dq[3])
                return (o, *grads)
            try:
                first, steady = first_and_steady(step)
                record(kind="fusionpass", dtype=str(dtype), launch=name, first_s=first, ms=steady, err=err(step()))
            except Exception as e:  # noqa: BLE001
                record(kind="fusionpass", dtype=str(dtype), launch=name, error=repr(e)[:300])

        # SDPA under plain torch.compile (GQA by enable_gqa, as HF's sdpa_attention calls it)
        def sdpa(q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        compiled = torch.compile(sdpa, dynamic=False)
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))

        def plain():
            qs.grad = ks.grad = vs.grad = None
            o = compiled(qs, ks, vs)
            o.backward(do)
            return (o, qs.grad, ks.grad, vs.grad)
        first, steady = first_and_steady(plain)
        record(kind="plain", dtype=str(dtype), first_s=first, ms=steady, err=err(plain()))
else:
    # static_cache-like decode: B1 H12/2, 16 new rows against a 333-long cache
    B, Hq, Hkv, Lq, L = 1, 12, 2, 16, 333
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(B, Hq, Lq, D, device=dev, generator=g).to(dtype)
        k = torch.randn(B, Hkv, L, D, device=dev, generator=g).to(dtype)
        v = torch.randn(B, Hkv, L, D, device=dev, generator=g).to(dtype)
        lengths = torch.full((B,), L, device=dev, dtype=torch.int32)
        launches = {"default": (None, None, None), "16w4s1": (16, 4, 1), "32w4s1": (32, 4, 1),
                    "16w2s1": (16, 2, 1), "32w8s1": (32, 8, 1)}
        def sdpa(q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        compiled = torch.compile(sdpa, dynamic=False)
        # the decode mask: the last Lq positions of the cache, causal among themselves
        mask = (torch.arange(L, device=dev)[None, :] <= torch.arange(L - Lq, L, device=dev)[:, None])[None, None]
        first, steady = first_and_steady(lambda: compiled(q, k, v, mask))
        record(kind="plain", dtype=str(dtype), first_s=first, ms=steady)
        if group == "decode-plain":
            continue
        for name, (bn, w, s) in (launches.items() if dtype == torch.float32 else [("default", (None,) * 3)]):
            try:
                first, steady = first_and_steady(lambda: DA.decode_attention(
                    q, k, v, lengths, block_n=bn, num_warps=w, num_stages=s))
                record(kind="fusionpass", dtype=str(dtype), launch=name, first_s=first, ms=steady)
            except Exception as e:  # noqa: BLE001
                record(kind="fusionpass", dtype=str(dtype), launch=name, error=repr(e)[:300])
