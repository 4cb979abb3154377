"""Attention kernel time with and without dropout at head dim 64 (GPT-2 B16 H12 S1024 causal, BERT
B32 H12 S512 with key padding), default and head-dim-64 launches, plus the kept fraction of the
dropout mask. Run once per kernel version to compare them (session 4: before and after the
16-bit keep bits).   python benchmarks/probes/attention_dropout_rng.py LABEL   -> $OUT/LABEL.json"""
import json, os, sys, torch
import fusionpass.kernels.attention as A
from fusionpass.bench import kernel_time
print("module", A.__file__)
dev, dt = "cuda", torch.bfloat16
res = {}
for name, (B, H, S, causal, pad) in {"gpt2": (16, 12, 1024, True, False), "bert": (32, 12, 512, False, True)}.items():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, S, 64, device=dev, dtype=dt) for _ in range(3))
    do = torch.randn_like(q)
    kw = dict(causal=causal, dropout_p=0.1, seed=1234)
    if pad:
        lens = torch.randint(S // 2, S + 1, (B,), device=dev)
        kw["key_padding"] = torch.arange(S, device=dev)[None] < lens[:, None]
    for launch in ("default", "d64"):
        fl = dict(block_m=64, block_n=64, num_warps=4, num_stages=3) if launch == "d64" else {}
        bl = dict(dq_block_m=64, dq_block_n=32, dq_num_warps=4, dq_num_stages=3) if launch == "d64" else {}
        out, lse = A.attention_fwd(q, k, v, **kw, **fl)
        r = res.setdefault(f"{name}-{launch}", {})
        for p in (0.1, 0.0):
            kk = dict(kw, dropout_p=p, seed=1234 if p else None)
            r[f"fwd_p{p}"] = round(kernel_time(lambda: A.attention_fwd(q, k, v, **kk, **fl), iters=20), 4)
            o2, l2 = A.attention_fwd(q, k, v, **kk, **fl)
            r[f"bwd_p{p}"] = round(kernel_time(lambda: A.attention_bwd(do, q, k, v, o2, l2, **kk, **bl), iters=20), 4)
        keep = A.attention_dropout_mask(B, H, S, S, 0.1, 1234).float().mean().item()
        r["keep_frac"] = round(keep, 5)
        print(name, launch, r, flush=True)
json.dump(res, open(os.environ.get("OUT", "/tmp") + "/" + sys.argv[1] + ".json", "w"), indent=1)
