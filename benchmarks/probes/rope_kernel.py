"""Standalone RoPE on the H200: fusionpass.kernels.rope (one launch for q and k) against plain
torch.compile of HF's `q * cos + rotate_half(q) * sin` (and k), q (4,32,4096,128), k (4,8,4096,128)
bf16, cos/sin [B, S, 128] as HF passes them. Sweeps block_rows x num_warps x cache hints
(`stream`) x index width (32-bit, and 64-bit forced through _WIDE_AT), kernel time (profiler),
two rounds each. Writes $OUT/rope_kernel.json.   python benchmarks/probes/rope_kernel.py
"""
import json
import os

import torch

import fusionpass.kernels.rope as R
from fusionpass.bench import environment, kernel_time

OUT = os.environ.get("OUT", "/tmp")
torch._inductor.config.fx_graph_cache = False
dev = "cuda"
res = {"env": environment(), "shape": "q (4,32,4096,128), k (4,8,4096,128), bf16, rotate_half"}
q = torch.randn(4, 32, 4096, 128, device=dev, dtype=torch.bfloat16)
k = torch.randn(4, 8, 4096, 128, device=dev, dtype=torch.bfloat16)
inv = 1.0 / (10000 ** (torch.arange(0, 128, 2, device=dev).float() / 128))
fr = torch.outer(torch.arange(4096, device=dev).float(), inv)
emb = torch.cat((fr, fr), -1)
cos = emb.cos().to(torch.bfloat16)[None].expand(4, -1, -1)
sin = emb.sin().to(torch.bfloat16)[None].expand(4, -1, -1)
c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)


def rot(x):
    return torch.cat((-x[..., 64:], x[..., :64]), -1)


def hf(q, k, cos, sin):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rot(q) * s, k * c + rot(k) * s


compiled = torch.compile(hf)
rq, rk = compiled(q, k, cos, sin)
gb = (q.numel() + k.numel()) * 2 * 2 / 1e9
res["GB_moved"] = gb


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kt(fn):
    return round(kernel_time(fn, iters=20), 5)


rows = {}
for rnd in range(2):
    rows.setdefault("inductor", []).append(kt(lambda: compiled(q, k, cos, sin)))
    for wide in (False, True):
        R._WIDE_AT = 0 if wide else 2**31
        for stream in (False, True):
            for br in (16, 32, 64):
                for w in (4, 8):
                    key = f"wide{int(wide)}-stream{int(stream)}-r{br}-w{w}"
                    fn = lambda: R.rope(q, k, c4, s4, "rotate_half", 128, block_rows=br, num_warps=w,  # noqa: E731
                                        stream=stream)
                    if rnd == 0:
                        oq, ok = fn()
                        res.setdefault("err", {})[key] = max(rel(oq, rq), rel(ok, rk))
                    rows.setdefault(key, []).append(kt(fn))
R._WIDE_AT = 2**31
res["ms"] = {key: min(v) for key, v in rows.items()}
res["ms_rounds"] = rows
res["TBs"] = {key: round(gb / ms, 3) for key, ms in res["ms"].items()}
best = sorted((ms, key) for key, ms in res["ms"].items() if key != "inductor")[:6]
res["best"] = best
res["default"] = R.rope.__defaults__
json.dump(res, open(f"{OUT}/rope_kernel.json", "w"), indent=1, default=str)
print("inductor", res["ms"]["inductor"], "best", best, "max err", max(res["err"].values()))
