"""Why rope_attention wins inside HF Llama (eager attention) but not at the kernel level with
contiguous q: GPU kernel times (profiler, best of 3) of
  attention only      attention_fwd(q_rot) against attention_fwd(q, rope=...) (the prologue's cost),
                      the rotation loading each pair's channels as two tiles (`halves`) or q and a
                      second, channel-paired load of it (`partner loads`)
  rotation only       Inductor's `q * cos + rotate_half(q) * sin` (+ k), fusionpass rope(q, k), rope(k)
for q contiguous [B, H, S, D] and q as HF makes it (a transpose of the q_proj output [B, S, H, D]),
at the issue's shape (B4 H32/8 S4096) and at the Llama 8L benchmark's (B4 H16/4 S2048), bf16, causal.
Then a profile of one HF Llama layer (eager attention, B4 S2048 h2048) in inference with and
without rope_attention: the kernels and their times.
    OUT=/dir python benchmarks/probes/rope_attention_layouts.py     writes $OUT/rope_attention_layouts.json
"""
import copy
import json
import os

import torch

import fusionpass
from fusionpass.bench import environment, kernel_time
import fusionpass.kernels.attention as A
from fusionpass.kernels.attention import attention_fwd
from fusionpass.kernels.rope import rope

OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
torch._inductor.config.fx_graph_cache = False
res = {"env": environment(), "kernels": {}}


def hf_rope(q, k, c, s):
    h = q.shape[-1] // 2
    return (q * c + torch.cat((-q[..., h:], q[..., :h]), -1) * s,
            k * c + torch.cat((-k[..., h:], k[..., :h]), -1) * s)


inductor_rope = torch.compile(hf_rope)


def best(fn):
    return min(round(kernel_time(fn, iters=10), 4) for _ in range(3))


for B, H, Hk, S in ((4, 32, 8, 4096), (4, 16, 4, 2048)):
    D = 128
    for layout in ("contiguous", "token_major"):
        torch.manual_seed(0)
        if layout == "contiguous":
            q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, Hk, S, D, device=dev, dtype=torch.bfloat16)
        else:
            q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            k = torch.randn(B, S, Hk, D, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(B, Hk, S, D, device=dev, dtype=torch.bfloat16)
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev).float() / D))
        fr = torch.outer(torch.arange(S, device=dev).float(), inv)
        emb = torch.cat((fr, fr), -1)
        c = emb.cos().to(torch.bfloat16)[None, None].expand(B, 1, S, D)
        s = emb.sin().to(torch.bfloat16)[None, None].expand(B, 1, S, D)
        qr, kr = inductor_rope(q, k, c, s)
        row = {}
        with torch.no_grad():
            row["inductor rope q+k"] = best(lambda: inductor_rope(q, k, c, s))
            row["fusionpass rope q+k"] = best(lambda: rope(q, k, c, s, "rotate_half", D))
            row["fusionpass rope k"] = best(lambda: rope(k, None, c, s, "rotate_half", D))
            row["attention(q_rot)"] = best(lambda: attention_fwd(qr, kr, v, causal=True))
            for halves in (True, False):
                A._ROPE_HALVES = halves
                form = "halves" if halves else "partner loads"
                row[f"attention(q, rope) {form}"] = best(lambda: attention_fwd(q, kr, v, causal=True,
                                                                               rope=(c, s, "rotate_half", D)))
                for bm, bn, w, st in ((64, 64, 4, 3),):
                    if halves:
                        row[f"attention(q_rot) {bm}x{bn} w{w}"] = best(
                            lambda: attention_fwd(qr, kr, v, causal=True, block_m=bm, block_n=bn, num_warps=w,
                                                  num_stages=st))
                    row[f"attention(q, rope) {form} {bm}x{bn} w{w}"] = best(
                        lambda: attention_fwd(q, kr, v, causal=True, rope=(c, s, "rotate_half", D), block_m=bm,
                                              block_n=bn, num_warps=w, num_stages=st))
            A._ROPE_HALVES = True
            o1 = attention_fwd(qr, kr, v, causal=True)[0]
            o2 = attention_fwd(q, kr, v, causal=True, rope=(c, s, "rotate_half", D))[0]
            row["max |out diff|"] = (o1.float() - o2.float()).abs().max().item()
        res["kernels"][f"B{B} H{H}/{Hk} S{S} {layout}"] = row
        print(f"B{B} H{H}/{Hk} S{S} {layout}", json.dumps(row), flush=True)

if os.environ.get("SKIP_PROFILE"):
    with open(os.path.join(OUT, "rope_attention_layouts.json"), "w") as f:
        json.dump(res, f, indent=1)
    raise SystemExit

# one HF Llama layer, eager attention, inference: the kernels with and without rope_attention
import transformers  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
                                  num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=32000,
                                  max_position_embeddings=8192)
config._attn_implementation = "eager"
torch.manual_seed(0)
base = transformers.AutoModelForCausalLM.from_config(config).to(dev, torch.bfloat16).eval()
ids = torch.randint(0, 32000, (4, 2048), device=dev)
res["profile"] = {}
for name, fusions in (("with rope_attention", None),
                      ("without rope_attention", sorted(set(fusionpass.config.make().fusions) - {"rope_attention"}))):
    torch._dynamo.reset()
    fusionpass.reset_stats()
    model = torch.compile(copy.deepcopy(base), backend=fusionpass.backend(fusions=fusions))
    with torch.no_grad():
        for _ in range(3):
            model(ids)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                model(ids)
            torch.cuda.synchronize()
    rows = sorted(((e.key, round(e.device_time_total / 5 / 1e3, 4)) for e in prof.key_averages()
                   if e.device_time_total > 0), key=lambda r: -r[1])
    res["profile"][name] = {"matches": fusionpass.stats(), "kernels ms": rows[:25]}
    print(name, json.dumps(res["profile"][name], indent=0), flush=True)

with open(os.path.join(OUT, "rope_attention_layouts.json"), "w") as f:
    json.dump(res, f, indent=1)
