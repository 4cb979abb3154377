"""Issue 19 probe: bidirectional attention with run-time key padding at BERT/XLM-R shapes, our
kernel against what plain torch.compile runs there (SDPA with the materialized [B, 1, L, L]
boolean mask: the memory-efficient kernel over every key), timed as CUDA graphs so that neither
side's host launch cost counts (GPU-bound). Forward, and forward + backward, for an all-ones
attention_mask and for right padding with lengths uniform in 64..512 (dout zero past each length,
as the model's loss gives it). Then a sweep of the
kernels' launches at head dim 64 (forward, dK/dV, dQ), all-ones.

    python benchmarks/probes/padded_attention.py [--out FILE.json] [--no-sweep] [--dropout P] [--head-dim D]
        [--causal] [--shape B,H,L]

--causal times a decoder's mask instead (causal AND key padding: plain compile's SDPA reads the
materialized [B, 1, L, L] mask, the kernel the key-padding vector and the causal bound).
"""
import argparse
import json

import torch
import torch.nn.functional as F

from fusionpass.bench import cuda_graph_ms
from fusionpass.kernels import attention as ak

B, H, L, D = 32, 12, 512, 64
CAUSAL = False
BF16 = torch.bfloat16


def visible(kp):
    """[B, 1, L, L] bool: the keys each query sees (key padding, and the causal bound with --causal)."""
    vis = kp[:, None, None, :].expand(B, 1, L, L)
    return vis & torch.ones(L, L, dtype=torch.bool, device=kp.device).tril() if CAUSAL else vis


def inputs(lengths):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, L, D, device="cuda", dtype=BF16, generator=gen) for _ in range(4))
    kp = torch.arange(L, device="cuda")[None, :] < lengths[:, None]
    # dout is zero at the rows past each length, as a loss that ignores padding makes it
    return q, k, v, do * kp[:, None, :, None], kp


def sdpa_steps(q, k, v, do, kp, dropout_p=0.0):
    """Plain compile's call: SDPA with the [B, 1, L, L] boolean mask (memory-efficient kernel)."""
    mask = visible(kp).contiguous()
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, dropout_p=dropout_p)
        torch.autograd.grad(out, (qg, kg, vg), do)

    return fwd, fwd_bwd


def kernel_steps(q, k, v, do, kp, fwd_cfg=None, bwd_cfg=None, dropout_p=0.0):
    drop = {"dropout_p": dropout_p, "seed": torch.tensor([1234], device="cuda")} if dropout_p else {}
    drop["causal"] = CAUSAL
    fwd_cfg, bwd_cfg = {**drop, **(fwd_cfg or {})}, {**drop, **(bwd_cfg or {})}
    out, lse = ak.attention_fwd(q, k, v, key_padding=kp, **fwd_cfg)

    def fwd():
        return ak.attention_fwd(q, k, v, key_padding=kp, **fwd_cfg)

    def bwd():
        return ak.attention_bwd(do, q, k, v, out, lse, key_padding=kp, **bwd_cfg)

    def fwd_bwd():
        o, s = ak.attention_fwd(q, k, v, key_padding=kp, **fwd_cfg)
        return ak.attention_bwd(do, q, k, v, o, s, key_padding=kp, **bwd_cfg)

    return fwd, bwd, fwd_bwd


def max_error(q, k, v, do, kp):
    """Kernel and SDPA against float64, forward and backward: the larger |error| of each."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=visible(kp))
    grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    out, lse = ak.attention_fwd(q, k, v, key_padding=kp, causal=CAUSAL)
    ours = (out, *ak.attention_bwd(do, q, k, v, out, lse, key_padding=kp, causal=CAUSAL))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=visible(kp))
    theirs = (o, *torch.autograd.grad(o, (qg, kg, vg), do))
    refs = (ref, *grads)
    return {name: {"kernel": (a.double() - r).abs().max().item(), "sdpa": (b.double() - r).abs().max().item()}
            for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, refs)}


def main():
    global B, H, L, D, CAUSAL
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-sweep", action="store_true", help="the two batches only")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="also time both batches with attention dropout p (BERT's 0.1; no error check: "
                             "the two sides draw other masks)")
    parser.add_argument("--head-dim", type=int, default=D,
                        help="the two batches at another head dim (same B, H, L), to see where the route wins")
    parser.add_argument("--causal", action="store_true", help="a decoder's causal mask AND key padding")
    parser.add_argument("--shape", default=None, help="B,H,L instead of 32,12,512")
    args = parser.parse_args()
    D, CAUSAL = args.head_dim, args.causal
    if args.shape:
        B, H, L = (int(x) for x in args.shape.split(","))
    torch.utils.deterministic.fill_uninitialized_memory = True
    result = {"shape": f"B{B} H{H} L{L} D{D} bf16, {'causal' if CAUSAL else 'bidirectional'}, key padding", "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": [], "sweep": []}
    gen = torch.Generator().manual_seed(0)
    batches = {"all ones": torch.full((B,), L),
               f"right padding 64..{L}": torch.randint(64, L + 1, (B,), generator=gen)}
    for name, lengths in batches.items():
        q, k, v, do, kp = inputs(lengths.cuda())
        s_fwd, s_fb = sdpa_steps(q, k, v, do, kp)
        k_fwd, k_bwd, k_fb = kernel_steps(q, k, v, do, kp)
        row = {"batch": name, "mean length": lengths.float().mean().item(),
               "sdpa fwd ms": cuda_graph_ms(s_fwd), "kernel fwd ms": cuda_graph_ms(k_fwd),
               "sdpa fwd+bwd ms": cuda_graph_ms(s_fb), "kernel fwd+bwd ms": cuda_graph_ms(k_fb),
               "kernel bwd ms": cuda_graph_ms(k_bwd), "max |error| vs float64": max_error(q, k, v, do, kp)}
        print(json.dumps(row), flush=True)
        result["rows"].append(row)
        if args.dropout:
            s_fwd, s_fb = sdpa_steps(q, k, v, do, kp, args.dropout)
            k_fwd, _, k_fb = kernel_steps(q, k, v, do, kp, dropout_p=args.dropout)
            row = {"batch": f"{name}, dropout {args.dropout}", "mean length": lengths.float().mean().item(),
                   "sdpa fwd ms": cuda_graph_ms(s_fwd), "kernel fwd ms": cuda_graph_ms(k_fwd),
                   "sdpa fwd+bwd ms": cuda_graph_ms(s_fb), "kernel fwd+bwd ms": cuda_graph_ms(k_fb)}
            print(json.dumps(row), flush=True)
            result["rows"].append(row)

    q, k, v, do, kp = inputs(torch.full((B,), L, device="cuda"))
    sweeps = {} if args.no_sweep else {
        "fwd": [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
                for bm, bn, w, s in ((64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3),
                                     (128, 128, 8, 2), (128, 32, 4, 4))],
        "dkdv": [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
                 for bm, bn, w, s in ((64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
                                      (32, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2), (32, 128, 8, 3))],
        "dq": [dict(dq_block_m=bm, dq_block_n=bn, dq_num_warps=w, dq_num_stages=s)
               for bm, bn, w, s in ((64, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3),
                                    (64, 64, 4, 2), (32, 64, 4, 3), (128, 64, 4, 2))],
    }
    for which, cfgs in sweeps.items():
        for cfg in cfgs:
            try:
                if which == "fwd":
                    fn = kernel_steps(q, k, v, do, kp, fwd_cfg=cfg)[0]
                else:
                    fn = kernel_steps(q, k, v, do, kp, bwd_cfg=cfg)[1]
                entry = {"kernel": which, **cfg, "ms": cuda_graph_ms(fn)}
            except Exception as e:  # a launch that does not fit (shared memory)
                entry = {"kernel": which, **cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(json.dumps(entry), flush=True)
            result["sweep"].append(entry)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
