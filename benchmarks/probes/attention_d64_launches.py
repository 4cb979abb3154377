"""Launch sweep of the FA2 kernel at head dim 64, at the shapes where fusionpass routes models to
it: BERT-base (B32 H12 S512, key padding, dropout 0.1, not causal), GPT-2 small (B16 H12 S1024,
causal, dropout 0.1) and BLOOM-style (B8 H16 S2048, causal, per-key bias, no dropout). For each:
SDPA as plain torch.compile would run it (mem-efficient with the mask / flash for causal),
forward and forward+backward GPU kernel time (profiler) of the default launches and of a sweep of
forward (block_m, block_n, warps, stages) and backward (dK/dV and dQ) launches. Writes
$OUT/attention_d64_launches.json.      python benchmarks/probes/attention_d64_launches.py [seconds per shape]
"""
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import fusionpass.kernels.attention as A
from fusionpass.bench import environment, kernel_time

OUT = os.environ.get("OUT", "/tmp")
BUDGET = float(sys.argv[1]) if len(sys.argv) > 1 else 110
dev, dt = "cuda", torch.bfloat16
res = {"env": environment(), "shapes": {}}
FWD = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 32, 4, 3),
       (64, 32, 4, 4), (128, 64, 4, 4), (64, 64, 4, 2), (128, 128, 8, 2), (64, 64, 8, 3)]
DKDV = [(64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3), (32, 128, 8, 2),
        (16, 128, 4, 3), (64, 64, 8, 2), (128, 128, 8, 2)]
DQ = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3),
      (128, 128, 8, 2), (64, 64, 8, 2)]


def kt(fn):
    try:
        return round(kernel_time(fn, iters=10), 4)
    except Exception as e:
        return repr(e)[:160]


SHAPES = {
    "bert_B32_H12_S512_pad_drop": dict(B=32, H=12, S=512, causal=False, pad=True, bias=False, p=0.1),
    "gpt2_B16_H12_S1024_causal_drop": dict(B=16, H=12, S=1024, causal=True, pad=False, bias=False, p=0.1),
    "bloom_B8_H16_S2048_causal_bias": dict(B=8, H=16, S=2048, causal=True, pad=False, bias=True, p=0.0),
}
torch.manual_seed(0)
for name, c in SHAPES.items():
    t0 = time.time()
    r = res["shapes"][name] = {"fwd": {}, "dkdv": {}, "dq": {}}
    try:
        B, H, S, D = c["B"], c["H"], c["S"], 64
        q, k, v = (torch.randn(B, H, S, D, device=dev, dtype=dt) for _ in range(3))
        do = torch.randn_like(q)
        kw = dict(causal=c["causal"], dropout_p=c["p"], seed=1234 if c["p"] else None)
        mask = None
        if c["pad"]:
            lens = torch.randint(S // 2, S + 1, (B,), device=dev)
            lens[0] = S
            kp = torch.arange(S, device=dev)[None, :] < lens[:, None]
            kw["key_padding"] = kp
            mask = kp[:, None, None, :]
        if c["bias"]:
            slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=dev) / H)
            kb = (slopes[:, None] * torch.arange(S, device=dev)[None, :]).to(dt)[None].expand(B, -1, -1)
            kw["key_bias"] = kb
            mask = kb[:, :, None, :].expand(B, H, S, S) if not c["causal"] else None

        # SDPA as plain compile would call it (a mask -> mem-efficient; causal -> flash/cuDNN)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def sdpa_fb():
            if c["bias"]:
                m = torch.full((S, S), float("-inf"), device=dev).triu(1).to(dt) + kb[:, :, None, :]
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=m, dropout_p=c["p"])
            else:
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, dropout_p=c["p"],
                                                   is_causal=c["causal"] and mask is None)
            return torch.autograd.grad(o, (qg, kg, vg), do)
        r["sdpa_fwd_bwd"] = kt(sdpa_fb)

        out, lse = A.attention_fwd(q, k, v, **kw)
        r["default_fwd"] = kt(lambda: A.attention_fwd(q, k, v, **kw))
        r["default_bwd"] = kt(lambda: A.attention_bwd(do, q, k, v, out, lse, **kw))
        for cfg in FWD:
            if time.time() - t0 > BUDGET * 0.4:
                break
            bm, bn, w, st = cfg
            r["fwd"][str(cfg)] = kt(lambda: A.attention_fwd(q, k, v, block_m=bm, block_n=bn, num_warps=w,
                                                            num_stages=st, **kw))
        for cfg in DKDV:
            if time.time() - t0 > BUDGET * 0.7:
                break
            bm, bn, w, st = cfg
            r["dkdv"][str(cfg)] = kt(lambda: A.attention_bwd(do, q, k, v, out, lse, block_m=bm, block_n=bn,
                                                             num_warps=w, num_stages=st, **kw))
        for cfg in DQ:
            if time.time() - t0 > BUDGET:
                break
            bm, bn, w, st = cfg
            r["dq"][str(cfg)] = kt(lambda: A.attention_bwd(do, q, k, v, out, lse, dq_block_m=bm, dq_block_n=bn,
                                                           dq_num_warps=w, dq_num_stages=st, **kw))
        for part in ("fwd", "dkdv", "dq"):
            ok = sorted((t, k_) for k_, t in r[part].items() if isinstance(t, float))
            r[f"best_{part}"] = ok[:3]
        # the backward's split between its kernels, default launches
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            A.attention_bwd(do, q, k, v, out, lse, **kw)
            torch.cuda.synchronize()
        r["bwd_kernels"] = {e.key[:40]: round(e.device_time_total / 1e3, 4) for e in prof.key_averages()
                            if e.device_time_total > 0}
    except Exception:
        r["error"] = traceback.format_exc()[-1500:]
    r["s"] = round(time.time() - t0, 1)
    print(name, {k_: v_ for k_, v_ in r.items() if k_ not in ("fwd", "dkdv", "dq")}, flush=True)
    json.dump(res, open(f"{OUT}/attention_d64_launches.json", "w"), indent=1, default=str)
