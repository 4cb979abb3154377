"""Launch sweep of the split-KV decode kernel at the issue's four shapes (GQA 32/8, D128, bf16,
q_len 1, full caches): BLOCK_N x num_warps x num_stages x num_splits, GPU kernel time (both
kernels, profiler), cuDNN (enable_gqa, no mask) timed in the same run. Writes
$OUT/decode_attention_sweep.json.   python benchmarks/probes/decode_attention_sweep.py [seconds]
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import fusionpass.kernels.decode_attention as DA
from fusionpass.bench import environment, kernel_time

OUT = os.environ.get("OUT", "/tmp")
BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 150
Hq, Hkv, D, dt = 32, 8, 128, torch.bfloat16
SHAPES = [(1, 32768), (1, 131072), (8, 8192), (32, 4096)]
res = {"env": environment(), "shapes": {}}
T0 = time.time()


def kt(fn):
    try:
        return round(kernel_time(fn, iters=20), 5)
    except Exception as e:
        return repr(e)[:160]


def tbs(ms, B, L):
    return round(2 * B * Hkv * L * D * 2 / (ms * 1e-3) / 1e12, 3) if isinstance(ms, float) else None


torch.manual_seed(0)
per_shape = BUDGET / len(SHAPES)
for B, L in SHAPES:
    t_shape = time.time()
    r = res["shapes"][f"B{B}-L{L}"] = {"sweep": {}}
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=dt)
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=dt)
    v = torch.randn(B, Hkv, L, D, device="cuda", dtype=dt)
    lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    r["cudnn"] = kt(cudnn)
    r["default"] = kt(lambda: DA.decode_attention(q, k, v, lens))
    r["default_splits"] = DA.default_num_splits(B, Hkv, L, DA._CFG[D][0], DA._sm_count(q.device))
    base = B * Hkv
    for bn in (64, 128):
        for nw in (4, 8):
            for st in (2, 3, 4):
                for waves in (1, 2, 3, 4, 6):
                    if time.time() - t_shape > per_shape:
                        break
                    ns = max(1, min(-(-waves * 132 // base), L // (2 * bn)))
                    key = f"bn{bn}-w{nw}-st{st}-s{ns}"
                    if key in r["sweep"]:
                        continue
                    t = kt(lambda: DA.decode_attention(q, k, v, lens, num_splits=ns, block_n=bn,
                                                       num_warps=nw, num_stages=st))
                    r["sweep"][key] = t
    ok = sorted((t, k_) for k_, t in r["sweep"].items() if isinstance(t, float))
    r["best"] = [(t, k_, tbs(t, B, L)) for t, k_ in ok[:6]]
    r["TBs"] = {"cudnn": tbs(r["cudnn"], B, L), "default": tbs(r["default"], B, L)}
    print(f"B{B} L{L}", r["TBs"], r["best"][:3], flush=True)
    torch.cuda.empty_cache()
    json.dump(res, open(f"{OUT}/decode_attention_sweep.json", "w"), indent=1, default=str)
res["total_s"] = round(time.time() - T0, 1)
json.dump(res, open(f"{OUT}/decode_attention_sweep.json", "w"), indent=1, default=str)
