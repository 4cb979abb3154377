"""RoPE + causal attention on the H200 (issue: rope and attention_out_proj). q (4,32,4096,128),
k/v (4,8,4096,128), bf16, HF rotate_half with cos/sin [B, S, 128]; GPU kernel time (profiler),
best of 3 rounds:
  plain torch.compile   HF `q * cos + rotate_half(q) * sin` (and k) + SDPA(is_causal, enable_gqa)
  rope + kernel         fusionpass::rope (q and k, one launch) + fusionpass::flash_attention
  rope(k) + kernel(q)   fusionpass::rope (k alone) + flash_attention rotating q as it loads it
                        (what patterns/rope_attention.py makes)
forward alone and forward + backward (through the ops' autograd). Also the error of each against an
fp32 reference (rotation and attention in fp32), forward and gradients, and at an odd shape
(L 1000, interleaved partial rotary 32 of 128).
    OUT=/dir python benchmarks/probes/rope_attention.py         writes $OUT/rope_attention.json
"""
import json
import os

import torch
import torch.nn.functional as F

import fusionpass.ops  # noqa: F401
from fusionpass.bench import environment, kernel_time
from fusionpass.ops.rope import _rot

OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
torch._inductor.config.fx_graph_cache = False
res = {"env": environment()}


def tables(B, L, D, r, form, dtype=torch.bfloat16):
    inv = 1.0 / (10000 ** (torch.arange(0, r, 2, device=dev).float() / r))
    fr = torch.outer(torch.arange(L, device=dev).float(), inv)
    emb = torch.cat((fr, fr), -1) if form == "rotate_half" else fr.repeat_interleave(2, -1)
    return (emb.cos().to(dtype)[None].expand(B, -1, -1).unsqueeze(1),
            emb.sin().to(dtype)[None].expand(B, -1, -1).unsqueeze(1))


def rotate(x, c, s, form, r):
    return torch.cat((x[..., :r] * c + _rot(x[..., :r], form, r) * s, x[..., r:]), -1)


def plain_fn(q, k, v, c, s):
    qr = q * c + torch.cat((-q[..., 64:], q[..., :64]), -1) * s
    kr = k * c + torch.cat((-k[..., 64:], k[..., :64]), -1) * s
    return F.scaled_dot_product_attention(qr, kr, v, is_causal=True, enable_gqa=True)


def unfused(q, k, v, c, s, form="rotate_half", r=128):
    qr, kr = torch.ops.fusionpass.rope(q, k, c, s, form, r)
    return torch.ops.fusionpass.flash_attention(qr, kr, v, None, None, q.shape[-1] ** -0.5, True, 0, False, 0.0,
                                                None)[0]


def fused(q, k, v, c, s, form="rotate_half", r=128):
    kr = torch.ops.fusionpass.rope(k, None, c, s, form, r)[0]
    return torch.ops.fusionpass.flash_attention(q, kr, v, None, None, q.shape[-1] ** -0.5, True, 0, False, 0.0,
                                                None, False, c, s, form, r)[0]


def reference(q, k, v, c, s, form="rotate_half", r=128):
    q, k, v, c, s = (t.float() for t in (q, k, v, c, s))
    return F.scaled_dot_product_attention(rotate(q, c, s, form, r), rotate(k, c, s, form, r), v, is_causal=True,
                                          enable_gqa=True)


def leaves(*shapes):
    return [torch.randn(*sh, device=dev, dtype=torch.bfloat16).requires_grad_() for sh in shapes]


def errors(fns, B, H, Hk, L, D, r, form):
    torch.manual_seed(0)
    q, k, v = leaves((B, H, L, D), (B, Hk, L, D), (B, Hk, L, D))
    c, s = tables(B, L, D, r, form)
    g = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
    want = reference(q, k, v, c, s, form, r)
    want_grads = torch.autograd.grad(want, (q, k, v), g.float())
    out = {}
    for name, fn in fns.items():
        got = fn(q, k, v, c, s, form, r)
        grads = torch.autograd.grad(got, (q, k, v), g)
        rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
        out[name] = {"out": rel(got, want), **{f"d{n}": rel(a, b) for n, a, b in zip("qkv", grads, want_grads)}}
    return out


res["errors_bar_shape"] = errors({"rope + kernel": unfused, "rope(k) + kernel(q)": fused}, 2, 32, 8, 1024, 128, 128,
                                 "rotate_half")
res["errors_odd_interleaved_partial"] = errors({"rope + kernel": unfused, "rope(k) + kernel(q)": fused}, 2, 6, 2,
                                               1000, 128, 32, "interleaved")
print(json.dumps(res, indent=1), flush=True)

B, H, Hk, L, D = 4, 32, 8, 4096, 128
torch.manual_seed(0)
q, k, v = leaves((B, H, L, D), (B, Hk, L, D), (B, Hk, L, D))
c, s = tables(B, L, D, D, "rotate_half")
g = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
plain = torch.compile(plain_fn)


def fwd(fn):
    def run():
        with torch.no_grad():
            return fn(q, k, v, c, s)
    return run


def fwd_bwd(fn):
    def run():
        q.grad = k.grad = v.grad = None
        fn(q, k, v, c, s).backward(g)
    return run


impls = {"plain torch.compile": plain, "rope + kernel": unfused, "rope(k) + kernel(q)": fused}
ms = {}
for rnd in range(3):
    for mode, wrap in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
        for name, fn in impls.items():
            ms.setdefault(f"{mode} {name}", []).append(round(kernel_time(wrap(fn), iters=10), 4))
res["ms_rounds"] = ms
res["ms"] = {key: min(v) for key, v in ms.items()}
for mode in ("fwd", "fwd+bwd"):
    base = res["ms"][f"{mode} plain torch.compile"]
    res[f"{mode} vs plain"] = {n: round(base / res["ms"][f"{mode} {n}"], 3) for n in impls}
    res[f"{mode} fused vs unfused"] = round(res["ms"][f"{mode} rope + kernel"] / res["ms"][f"{mode} rope(k) + kernel(q)"],
                                          3)
print(json.dumps(res, indent=1))
with open(os.path.join(OUT, "rope_attention.json"), "w") as f:
    json.dump(res, f, indent=1)
