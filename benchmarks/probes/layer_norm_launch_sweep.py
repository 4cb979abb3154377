"""GPU probe 2: layer_norm kernel launch-parameter sweep (kernel time, 16384 x N bf16)."""
import json, os, sys
import torch, triton
import triton.language as tl
import fusionpass.kernels.layer_norm as L
from fusionpass.kernels import common
from fusionpass.bench import kernel_time
OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
M = 16384
res = {"fwd": {}, "bwd": {}}
orig_chunk, orig_wf, orig_wb = L._fwd_chunk, L._warps_fwd, L._warps_bwd

def kt(fn):
    try:
        return round(kernel_time(fn, iters=20), 4)
    except Exception as e:
        return repr(e)[:120]

rounds = int(os.environ.get("ROUNDS", "10"))
if rounds != 10:
    L._N_ROUNDS = tl.constexpr(rounds)

for N in [768, 1024, 2048, 4096, 8192]:
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(N, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, device=dev, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    seed = torch.randint(2**62, (1,), device=dev)
    width = triton.next_power_of_2(N)
    chunks = [width] + ([2048] if width > 2048 else []) + ([1024] if width >= 4096 else [])
    for mode in ("train", "infer"):
        p = 0.1 if mode == "train" else 0.0
        for chunk in chunks:
            for warps in (4, 8, 16, 32):
                L._fwd_chunk = lambda n, c=chunk: c
                L._warps_fwd = lambda tile, one, wv=warps: wv
                f = lambda: L.layer_norm_fwd(x, r, w, b, 1e-5, p=p, seed=seed, store_h=(mode == "train"))
                res["fwd"][f"{N}/{mode}/chunk{chunk}/w{warps}"] = kt(f)
        L._fwd_chunk, L._warps_fwd = orig_chunk, orig_wf
        res["fwd"][f"{N}/{mode}/default"] = kt(lambda: L.layer_norm_fwd(x, r, w, b, 1e-5, p=p, seed=seed, store_h=(mode == "train")))
    print({k: v for k, v in res["fwd"].items() if k.startswith(f"{N}/")}, flush=True)
    y, h, mean, rstd = L.layer_norm_fwd(x, r, w, b, 1e-5, p=0.1, seed=seed)
    for p in (0.1, 0.0):
        for warps in (4, 8, 16, 32):
            L._warps_bwd = lambda tile, wv=warps: wv
            for per_sm in (1, 2, 4, 8):
                f = lambda: L.layer_norm_bwd(dy, None, h, mean, rstd, w, b, p=p, seed=seed, max_chunk=width, num_programs=132 * per_sm)
                res["bwd"][f"{N}/p{p}/fused/w{warps}/sm{per_sm}"] = kt(f)
            if width >= 4096:
                for mc in (1024, 2048):
                    for per_sm in (1, 2, 4):
                        f = lambda: L.layer_norm_bwd(dy, None, h, mean, rstd, w, b, p=p, seed=seed, max_chunk=mc, num_programs=132 * per_sm)
                        res["bwd"][f"{N}/p{p}/chunk{mc}/w{warps}/sm{per_sm}"] = kt(f)
        L._warps_bwd = orig_wb
        res["bwd"][f"{N}/p{p}/default"] = kt(lambda: L.layer_norm_bwd(dy, None, h, mean, rstd, w, b, p=p, seed=seed))
    print({k: v for k, v in res["bwd"].items() if k.startswith(f"{N}/")}, flush=True)
    json.dump(res, open(f"{OUT}/gpu2_r{rounds}.json", "w"), indent=1)
