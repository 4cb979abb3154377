"""GPU probe: split-KV decode attention kernel (fusionpass.kernels.decode_attention) on the H200.

Shapes: GQA 32/8 heads, D 128, bf16, q_len 1, full cache (kv_lengths = L), at B1 L32768,
B1 L131072, B8 L8192, B32 L4096. For each: our kernel (both launches) and SDPA (cuDNN and flash
backends, enable_gqa=True), GPU kernel ms from the profiler, TB/s of KV read (2 * B * Hkv * L * D *
2 bytes / time), relative error against an fp32 reference and against SDPA. Then a sweep of
num_splits / block_n / num_warps at B1 L32768, a numerics check with ragged kv_lengths and
Lq = 4, and a CUDA-graph check (capture once, change kv_lengths in place, replay).
Writes $OUT/decode_attention_kernel.json and prints a summary. Run: python
benchmarks/probes/decode_attention_kernel.py
"""
import json
import math
import os
import time
import traceback

import torch
import torch.nn.functional as F

import fusionpass.kernels.decode_attention as DA
from fusionpass.bench import environment, kernel_time

OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
Hq, Hkv, D, dt = 32, 8, 128, torch.bfloat16
SHAPES = [(1, 32768), (1, 131072), (8, 8192), (32, 4096)]
res = {"env": environment(), "shapes": {}, "sweep": {}, "notes": "GQA 32/8 D128 bf16 q_len 1, full cache"}
T0 = time.time()


def save():
    json.dump(res, open(f"{OUT}/decode_attention_kernel.json", "w"), indent=1, default=str)


def kt(fn, iters=20):
    try:
        return round(kernel_time(fn, iters=iters), 5)
    except Exception as e:
        return repr(e)[:200]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def tbs(ms, B, L):
    return round(2 * B * Hkv * L * D * 2 / (ms * 1e-3) / 1e12, 3) if isinstance(ms, float) else None


def ref_fp32(q, k, v, lens):
    # q [B, Hq, Lq, D] against k/v [B, Hkv, L, D] without repeating k/v: [B, Hkv, G * Lq, D] rows
    B, _, Lq, _ = q.shape
    L = k.shape[2]
    g = Hq // Hkv
    qg = q.float().reshape(B, Hkv, g * Lq, D)
    s = qg @ k.float().transpose(-1, -2) / math.sqrt(D)
    pos = (lens.long()[:, None] - Lq + torch.arange(Lq, device=dev)[None, :]).repeat(1, g)  # [B, g*Lq]
    vis = torch.arange(L, device=dev)[None, None, :] <= pos[:, :, None]
    s = s.masked_fill(~vis[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v.float()).reshape(B, Hq, Lq, D)


def sdpa(q, k, v, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def fn():
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return fn


torch.manual_seed(0)
for B, L in SHAPES:
    name = f"B{B}-L{L}"
    r = res["shapes"][name] = {}
    try:
        q = torch.randn(B, Hq, 1, D, device=dev, dtype=dt)
        k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
        v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
        lens = torch.full((B,), L, device=dev, dtype=torch.int32)
        ours = DA.decode_attention(q, k, v, lens)
        ref = ref_fp32(q, k, v, lens)
        r["num_splits"] = DA.default_num_splits(B, Hkv, L, DA._CFG[D][0], DA._sm_count(q.device))
        r["err_vs_fp32"] = rel(ours, ref)
        t = kt(lambda: DA.decode_attention(q, k, v, lens))
        r["ours_ms"], r["ours_TBs"] = t, tbs(t, B, L)
        for be in ("cudnn", "flash"):
            try:
                fn = sdpa(q, k, v, be)
                o = fn()
                r[f"err_vs_sdpa_{be}"] = rel(ours, o)
                r[f"sdpa_{be}_err_vs_fp32"] = rel(o, ref)
                t = kt(fn)
                r[f"sdpa_{be}_ms"], r[f"sdpa_{be}_TBs"] = t, tbs(t, B, L)
            except Exception as e:
                r[f"sdpa_{be}"] = repr(e)[:300]
        del q, k, v, ref
        torch.cuda.empty_cache()
    except Exception:
        r["error"] = traceback.format_exc()[-1500:]
    print(name, r, flush=True)
    save()

# launch sweep at B1 L32768 (default: BLOCK_N 64, 4 warps, 3 stages, 32 splits on 132 SMs)
try:
    B, L = 1, 32768
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=dt)
    k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
    v = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
    lens = torch.full((B,), L, device=dev, dtype=torch.int32)
    for bn in (32, 64, 128):
        for nw in (2, 4, 8):
            for ns in (8, 16, 32, 64, 128):
                if time.time() - T0 > 40:
                    break
                key = f"bn{bn}-w{nw}-s{ns}"
                t = kt(lambda: DA.decode_attention(q, k, v, lens, num_splits=ns, block_n=bn, num_warps=nw))
                res["sweep"][key] = (t, tbs(t, B, L))
    best = sorted((v_[0], k_) for k_, v_ in res["sweep"].items() if isinstance(v_[0], float))[:5]
    res["sweep_best"] = best
    print("sweep best (ms, cfg):", best, flush=True)
except Exception:
    res["sweep_error"] = traceback.format_exc()[-1500:]
save()

# ragged lengths and speculative rows (Lq 4), then a CUDA graph replay with lengths changed in place
try:
    B, L, Lq = 8, 8192, 4
    q = torch.randn(B, Hq, Lq, D, device=dev, dtype=dt)
    k = torch.randn(B, L, Hkv, D, device=dev, dtype=dt).transpose(1, 2)  # token-major cache
    v = torch.randn(B, L, Hkv, D, device=dev, dtype=dt).transpose(1, 2)
    lens = torch.tensor([L, 1, 2, 3, 4097, 100, 0, 8000], device=dev, dtype=torch.int32)
    out = DA.decode_attention(q, k, v, lens)
    res["ragged_q4_err"] = rel(out, ref_fp32(q, k, v, lens))
    res["ragged_q4_finite"] = bool(torch.isfinite(out).all())
    static_out = DA.decode_attention(q, k, v, lens)  # warm (compiled) before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = DA.decode_attention(q, k, v, lens)
    lens.copy_(torch.tensor([5, L, 7000, 64, 1, 0, 3000, 2], device=dev, dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    res["graph_replay_err"] = rel(static_out, ref_fp32(q, k, v, lens))
except Exception:
    res["ragged_error"] = traceback.format_exc()[-1500:]
res["total_s"] = round(time.time() - T0, 1)
save()

print("\n== decode attention, GQA 32/8 D128 bf16 q_len 1 (ms / TB/s) ==")
for name, r in res["shapes"].items():
    cells = [f"ours {r.get('ours_ms')} / {r.get('ours_TBs')} (splits {r.get('num_splits')})"]
    for be in ("cudnn", "flash"):
        cells.append(f"{be} {r.get(f'sdpa_{be}_ms', r.get(f'sdpa_{be}', '?'))} / {r.get(f'sdpa_{be}_TBs')}")
    errs = {k_: f"{v_:.1e}" for k_, v_ in r.items() if k_.startswith("err")}
    print(f"{name:12s} " + " | ".join(cells) + f" | {errs}")
for k_ in ("ragged_q4_err", "ragged_q4_finite", "graph_replay_err", "ragged_error", "sweep_error", "total_s"):
    if k_ in res:
        print(k_, res[k_] if not isinstance(res[k_], str) else res[k_][-400:])
