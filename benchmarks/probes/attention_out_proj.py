"""GPU probe (not run yet): attention_out_proj. An eager attention block (qkv projection, attention
in torch ops, head merge, output projection, residual add) compiled three ways, interleaved:
plain torch.compile, fusionpass `attention` alone, and `attention` + `attention_out_proj` (the
kernel writes token-major, the head merge is a view). bf16, forward (no_grad) and fwd+bwd:
wall time, GPU kernel time, peak memory, the match counts, the error against plain, and the names
of the Triton kernels Inductor generated (the copy kernel between the attention op and the
projection must be gone from the forward; the backward should be unchanged).

Shapes: GPT-2-small-like (GPT-2's eager form: split of c_attn, matmul / scale / additive causal
mask / softmax / matmul, transpose(1, 2).reshape(...).contiguous(), B16 S1024 H12 D64) and
BLOOM-style (baddbmm of the ALiBi tensor, fp32 softmax, bmm, _merge_heads' view/permute/reshape,
h1024 H16 S2048 B8).

Bytes no longer moved, per avoided copy: the copy reads and writes B*S*H*D elements, so
2 * B*S*H*D * 2 bytes in bf16 (GPT-2 shape: 50.3 MB, BLOOM shape: 67.1 MB) per attention per
forward. In training the copy was also a second saved activation (the projection's input for its
weight gradient, besides the attention output for the attention backward): B*S*H*D * 2 bytes less
held per layer (peak memory is reported). Backward: GPT-2's form had no copy to remove (the
gradient of transpose+reshape is a strided view that the backward kernels read as it is); BLOOM's
had one, the gradient made contiguous for the [B*H, S, D] round-trip views, now gone (on the CPU
Inductor fused it into the bias-gradient sum: a write of B*S*H*D elements). The probe lists the
generated kernels and counts those with "clone" in their name per graph, to confirm both on the GPU.

    OUT=/some/dir python benchmarks/probes/attention_out_proj.py            # the GPU, bf16
    TRITON_INTERPRET=1 python benchmarks/probes/attention_out_proj.py --smoke  # CPU wiring check

Writes $OUT/attention_out_proj.json.
"""
import copy
import json
import os
import re
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import fusionpass
from fusionpass.bench import environment, kernel_time, peak_memory, time_interleaved

SMOKE = "--smoke" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
dev = "cpu" if SMOKE else "cuda"
dtype = torch.float32 if SMOKE else torch.bfloat16
torch._inductor.config.fx_graph_cache = False
if SMOKE:
    torch._inductor.config.cpp.max_horizontal_fusion_size = 1  # Inductor's CPU bf16/training bug
res = {"env": environment(), "smoke": SMOKE}

SHAPES = {
    # name: (form, B, S, H, D)
    "gpt2_small": ("gpt2", 16, 1024, 12, 64),
    "bloom_h1024": ("bloom", 8, 2048, 16, 64),
}
if SMOKE:
    SHAPES = {"gpt2_small": ("gpt2", 2, 32, 2, 64), "bloom_h1024": ("bloom", 2, 32, 2, 64)}
VARIANTS = {
    "plain": None,
    "attention": ["attention"],
    "attention+out_proj": ["attention", "attention_out_proj"],
}


def additive_causal_mask(S, device, dt):
    # transformers' form: index arithmetic, then torch.where(mask, 0, min) (fusionpass proves it causal)
    idx = torch.arange(S, device=device)
    causal = (idx[None, :] <= idx[:, None])[None, None]
    return torch.where(causal, 0.0, torch.finfo(dt).min).to(dt)


class GPT2Attention(torch.nn.Module):
    """HF GPT-2's eager attention (c_attn/c_proj as Linear: the head merge is the same)."""

    def __init__(self, H, D):
        super().__init__()
        self.H, self.D = H, D
        self.c_attn = torch.nn.Linear(H * D, 3 * H * D)
        self.c_proj = torch.nn.Linear(H * D, H * D)

    def forward(self, x, residual):
        B, S, E = x.shape
        q, k, v = self.c_attn(x).split(E, dim=2)
        q, k, v = (t.view(B, S, self.H, self.D).transpose(1, 2) for t in (q, k, v))
        w = torch.matmul(q, k.transpose(-1, -2)) * (self.D**-0.5)
        w = w + additive_causal_mask(S, x.device, x.dtype)
        p = F.softmax(w, dim=-1).type(v.dtype)
        o = torch.matmul(p, v)
        o = o.transpose(1, 2).reshape(B, S, -1).contiguous()
        return self.c_proj(o) + residual


class BloomAttention(torch.nn.Module):
    """HF BLOOM's eager attention: ALiBi through baddbmm, fp32 softmax, bmm, _merge_heads, dense."""

    def __init__(self, H, D):
        super().__init__()
        self.H, self.D = H, D
        self.query_key_value = torch.nn.Linear(H * D, 3 * H * D)
        self.dense = torch.nn.Linear(H * D, H * D)
        self.register_buffer("slopes", torch.tensor([2 ** (-8 * (h + 1) / H) for h in range(H)]), persistent=False)

    def forward(self, x, residual):
        B, S, E = x.shape
        H, D = self.H, self.D
        fused = self.query_key_value(x).view(B, S, H, 3, D)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        alibi = (self.slopes[:, None] * torch.arange(S, device=x.device)[None, :]).to(x.dtype)
        alibi = alibi[None].expand(B, H, S).reshape(B * H, 1, S)
        scores = alibi.baddbmm(q.reshape(B * H, S, D), k.reshape(B * H, S, D).transpose(-1, -2), beta=1.0,
                               alpha=D**-0.5)
        w = scores.view(B, H, S, S) + additive_causal_mask(S, x.device, x.dtype)
        p = F.softmax(w, dim=-1, dtype=torch.float32).to(x.dtype)
        o = torch.bmm(p.view(B * H, S, S), v.reshape(B * H, S, D))
        o = o.view(B, H, S, D).permute(0, 2, 1, 3).reshape(B, S, H * D)  # _merge_heads
        return self.dense(o) + residual


def triton_kernels(code: str) -> list[str]:
    """Names of the generated kernels a compiled graph launches (Triton on CUDA, C++ on CPU)."""
    return [a or b for a, b in re.findall(r"^\s+(triton_\w+)\.run\(|^\s+(cpp_fused\w+)\(", code, re.M)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def kt(fn):
    if SMOKE:
        return None
    try:
        return round(kernel_time(fn, iters=10), 4)
    except Exception as e:  # the profiler is optional evidence
        return repr(e)[:200]


def run_shape(name, form, B, S, H, D):
    r = res.setdefault(name, {"shape": dict(B=B, S=S, H=H, D=D), "form": form})
    elems = B * S * H * D
    r["bytes_per_avoided_copy"] = 2 * elems * torch.finfo(dtype).bits // 8
    r["saved_activation_bytes_less_per_layer"] = elems * torch.finfo(dtype).bits // 8
    torch.manual_seed(0)
    base = (GPT2Attention if form == "gpt2" else BloomAttention)(H, D).to(dev, dtype)
    x = torch.randn(B, S, H * D, device=dev, dtype=dtype)
    resid = torch.randn_like(x)
    dy = torch.randn_like(x)
    for train in (False, True):
        mode = "fwd_bwd" if train else "fwd"
        out = r.setdefault(mode, {})
        fns, results, kernels, matches = {}, {}, {}, {}
        for variant, fusions in VARIANTS.items():
            torch._dynamo.reset()
            fusionpass.reset_stats()
            m = copy.deepcopy(base).train(train)
            backend = "inductor" if fusions is None else fusionpass.backend(fusions=fusions, cpu=SMOKE)
            f = torch.compile(m, backend=backend, fullgraph=True)
            xi = x.detach().clone().requires_grad_(train)

            if train:
                def step(f=f, xi=xi, m=m):
                    y = f(xi, resid)
                    y.backward(dy)
                    return y
            else:
                def step(f=f, xi=xi):
                    with torch.no_grad():
                        return f(xi, resid)

            y, codes = run_and_get_code(step)
            matches[variant] = {f"{k[0]}/{k[1]}": n for k, n in fusionpass.stats(variants=True).items()}
            kernels[variant] = [triton_kernels(c) for c in codes]  # forward, then backward in training
            grads = [xi.grad] + [p.grad for p in m.parameters()] if train else []
            results[variant] = [y.detach().clone(), *(g.detach().clone() for g in grads)]
            m.zero_grad(set_to_none=True)
            xi.grad = None
            fns[variant] = step
        out["matches"] = matches
        out["kernels"] = kernels
        out["err_vs_plain"] = {v: [rel(a, b) for a, b in zip(results[v], results["plain"])] for v in results}
        fwd_counts = {v: len(k[0]) for v, k in kernels.items()}
        out["forward_kernel_count"] = fwd_counts
        # a heuristic for copies: Inductor names a kernel after the aten ops it fuses (clone = copy)
        out["clone_kernels"] = {v: [sum("clone" in n for n in graph) for graph in k] for v, k in kernels.items()}
        out["copy_kernels_removed_forward"] = fwd_counts["attention"] - fwd_counts["attention+out_proj"]
        if train:
            bwd = {v: len(k[1]) if len(k) > 1 else None for v, k in kernels.items()}
            out["backward_kernel_count"] = bwd
        if SMOKE:
            continue
        out["wall_ms"] = time_interleaved(fns, dev, rounds=7, iters=10)
        out["kernel_ms"] = {v: kt(fn) for v, fn in fns.items()}
        out["peak_bytes"] = {v: peak_memory(fn) for v, fn in fns.items()}
        w = out["wall_ms"]
        out["speedup_vs_plain"] = {v: round(w["plain"] / w[v], 3) for v in w}
        out["speedup_out_proj_vs_attention_alone"] = round(w["attention"] / w["attention+out_proj"], 3)
        k = out["kernel_ms"]
        if all(isinstance(k[v], float) for v in k):
            out["kernel_speedup_out_proj_vs_attention_alone"] = round(k["attention"] / k["attention+out_proj"], 3)
        out["bytes_no_longer_moved"] = out["copy_kernels_removed_forward"] * r["bytes_per_avoided_copy"]
        print(name, mode, json.dumps({key: out[key] for key in ("wall_ms", "kernel_ms", "speedup_vs_plain",
                                                                 "copy_kernels_removed_forward")}), flush=True)


for name, (form, B, S, H, D) in SHAPES.items():
    t0 = time.time()
    try:
        run_shape(name, form, B, S, H, D)
    except Exception:
        res[name + "_error"] = traceback.format_exc()[-3000:]
        print(res[name + "_error"], flush=True)
    res[name + "_s"] = round(time.time() - t0, 1)
    json.dump(res, open(f"{OUT}/attention_out_proj.json", "w"), indent=1, default=str)
print(json.dumps(res, indent=1, default=str)[:6000])
