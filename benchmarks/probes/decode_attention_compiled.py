"""decode_attention through torch.compile: transformers' static-cache decode SDPA (repeat_kv copies
and the mask kv_idx <= arange(Lq) + cache length) compiled plain vs with fusionpass, B1 L32768 GQA
32/8 D128 bf16, q_len 1; kernel time (profiler) and wall, default mode."""
import json, os
import torch, torch.nn.functional as F
import fusionpass
from fusionpass.bench import kernel_time, time_interleaved, environment

OUT = os.environ.get("OUT", "/tmp")
torch._inductor.config.fx_graph_cache = False
dev = "cuda"


def repeat_kv(x, n):
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def step(q, k_cache, v_cache, offset):
    L, lq = k_cache.shape[2], q.shape[2]
    q_pos = torch.arange(lq, device=q.device) + offset
    mask = (torch.arange(L, device=q.device)[None, None, None, :] <= q_pos[None, None, :, None]).expand(
        q.shape[0], -1, lq, L)
    return F.scaled_dot_product_attention(q, repeat_kv(k_cache, 4), repeat_kv(v_cache, 4), attn_mask=mask,
                                          scale=128 ** -0.5)


res = {"env": environment()}
for B, L in ((1, 32768), (8, 8192)):
    q = torch.randn(B, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, 8, L, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, 8, L, 128, device=dev, dtype=torch.bfloat16)
    offset = torch.tensor([L - 1], device=dev)
    torch._dynamo.reset(); fusionpass.reset_stats()
    plain = torch.compile(step)
    fused = torch.compile(step, backend=fusionpass.backend(fusions=["decode_attention"]))
    with torch.no_grad():
        a, b_ = plain(q, k, v, offset), fused(q, k, v, offset)
        fns = {"plain": lambda: plain(q, k, v, offset), "fused": lambda: fused(q, k, v, offset)}
        r = {"matches": str(fusionpass.stats()),
             "err": ((a.float() - b_.float()).norm() / a.float().norm()).item(),
             "kernel_ms": {n: round(kernel_time(f, 20), 4) for n, f in fns.items()},
             "wall_ms": time_interleaved(fns, dev, rounds=5, iters=50)}
    r["TBs_kernel"] = {n: round(2 * B * 8 * L * 128 * 2 / ms / 1e9, 2) for n, ms in r["kernel_ms"].items()}
    res[f"B{B}-L{L}"] = r
    print(B, L, r, flush=True)
json.dump(res, open(f"{OUT}/decode_attention_compiled.json", "w"), indent=1, default=str)
