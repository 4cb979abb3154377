"""Issue 19 probe (results: benchmarks/results/kernel/cudnn_key_padding.md): SDPA's cuDNN kernel
with the key padding as a broadcast additive bias, against our kernel and against what plain
torch.compile runs (SDPA with the materialized [B, 1, L, L] boolean mask: the memory-efficient
kernel). If cuDNN takes a [B, 1, 1, L] bias with is_causal at its own speed, a rewrite to
`aten._scaled_dot_product_cudnn_attention` could serve the two masks every trainer passes (a
decoder's causal mask AND key padding, an encoder's all-true mask AND key padding) faster than
our kernel does.

Checks before any timing, per shape: the cuDNN call runs at all with that bias layout; its output
and gradients against float64 at right padding, left padding (causal rows that see no key) and all
ones, next to our kernel's and the memory-efficient kernel's errors; what it returns for rows that
see no key (SDPA's math gives 0 there, as our kernel does).

Timing: CUDA graphs of forward, and forward + backward (GPU-bound; medians, ms).

    python benchmarks/probes/cudnn_key_padding.py [--out FILE.json]
"""
import argparse
import json

import torch
import torch.nn.functional as F

import fusionpass  # noqa: F401  (registers fusionpass::flash_attention)
from fusionpass.bench import cuda_graph_ms

BF16 = torch.bfloat16
# (name, B, Hq, Hkv, L, D, causal): issue 19's Llama all-ones bar shape and the BERT/XLM-R one
SHAPES = [("llama", 4, 16, 4, 2048, 128, True), ("bert", 32, 12, 12, 512, 64, False)]


def key_padding(kind, B, L):
    kp = torch.ones(B, L, dtype=torch.bool, device="cuda")
    for r in range(1, B):
        cut = r * L // (B + 1)
        if kind == "right":
            kp[r, L - cut:] = False
        elif kind == "left":
            kp[r, :cut] = False
    return kp


def cudnn_call(q, k, v, kp, causal, dense_bias=False):
    """aten's cuDNN attention with the key padding as an additive bias (0 kept, -inf padded) seen as
    [B, 1, Lq, Lk] through a broadcast view, or materialized (`dense_bias`); GQA by expanding k and v
    (the op takes equal heads)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    bias = torch.zeros(kp.shape, dtype=q.dtype, device=q.device).masked_fill(~kp, float("-inf"))
    bias = bias[:, None, None, :].expand(q.shape[0], 1, q.shape[2], k.shape[2])
    if dense_bias:
        bias = bias.contiguous()
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal, False)[0]


def mem_efficient_call(q, k, v, kp, causal):
    B, L = kp.shape
    mask = kp[:, None, None, :].expand(B, 1, L, L)
    if causal:
        mask = mask & torch.ones(L, L, dtype=torch.bool, device=kp.device).tril()
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.contiguous(), enable_gqa=True)


def kernel_call(q, k, v, kp, causal):
    """fusionpass::flash_attention, the op the route inserts: its registered autograd runs our
    backward kernels."""
    return torch.ops.fusionpass.flash_attention(q, k, v, kp, scale=q.shape[-1] ** -0.5, causal=causal)[0]


CALLS = {"cudnn + broadcast bias": cudnn_call,
         "cudnn + dense bias": lambda q, k, v, kp, causal: cudnn_call(q, k, v, kp, causal, dense_bias=True),
         "memory-efficient + mask": mem_efficient_call,
         "fusionpass kernel": kernel_call}


def reference(q, k, v, do, kp, causal):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in (k64, v64))
    B, L = kp.shape
    vis = kp[:, None, None, :].expand(B, 1, L, L)
    if causal:
        vis = vis & torch.ones(L, L, dtype=torch.bool, device=kp.device).tril()
    s = (q64 @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
    empty = ~vis.any(-1, keepdim=True)
    # rows that see no key: 0 (SDPA's math and our kernel), with finite gradients
    p = torch.softmax(s.masked_fill(~vis & ~empty, float("-inf")), -1) * vis
    out = p @ vv
    return (out.detach(), *torch.autograd.grad(out, (q64, k64, v64), do.double()))


def errors(name, fn, q, k, v, do, kp, causal, ref):
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(qg, kg, vg, kp, causal)
    grads = torch.autograd.grad(out, (qg, kg, vg), do)
    got = (out, *grads)
    row = {n: (g.double() - r).abs().max().item() for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    row["nan"] = any(bool(g.isnan().any()) for g in got)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.utils.deterministic.fill_uninitialized_memory = True
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "rows": []}
    for name, B, Hq, Hkv, L, D, causal in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, L, D, device="cuda", dtype=BF16, generator=gen)
        k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
        do = torch.randn(B, Hq, L, D, device="cuda", dtype=BF16, generator=gen)
        for kind in ("right", "left", "ones"):
            kp = key_padding(kind, B, L)
            ref = reference(q, k, v, do, kp, causal)
            for call, fn in CALLS.items():
                row = {"shape": name, "padding": kind, "call": call}
                try:
                    row["error"] = errors(call, fn, q, k, v, do, kp, causal, ref)
                    if kind != "left":
                        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

                        def fwd(fn=fn, kp=kp):
                            return fn(q, k, v, kp, causal)

                        def fwd_bwd(fn=fn, kp=kp, qg=qg, kg=kg, vg=vg):
                            torch.autograd.grad(fn(qg, kg, vg, kp, causal), (qg, kg, vg), do)

                        row["fwd ms"], row["fwd+bwd ms"] = cuda_graph_ms(fwd), cuda_graph_ms(fwd_bwd)
                except Exception as e:  # the call refused this layout: that is the finding
                    row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
