"""Issue 40 probe: which attention kernel can serve the mask every HF data collator passes (all ones,
or right/left padding) at the speed of cuDNN's own causal kernel, with the lengths on the device
(no host sync, no shape that depends on data). Its results are in
benchmarks/results/kernel/collator_attention_routes.md (and the JSON files it names).

Calls, each checked against float64 (forward and the three gradients, NaN-filled memory) before it
is timed:
- "cudnn causal, no mask": SDPA's cuDNN kernel with is_causal and no mask. It ignores the padding:
  the anchor the issue's bar is set against, timed on the all-ones batch only.
- "cudnn ragged": aten's cuDNN entry with cumulative lengths, over the padded batch seen as packed
  [B * S, H, D] tokens. Each batch row becomes two sequences: all S queries with the row's first
  L_b keys, then no query with the rest of its keys, so the offsets of the packed layout stay those
  of the padded one and only the lengths come from the mask. Exact for right padding (and all ones);
  left padding is computed too, to record that it is not (the route would send such rows elsewhere).
- "cudnn + broadcast bias": the key padding as a [B, 1, 1, S] additive bias seen as [B, 1, S, S]
  (what results/kernel/cudnn_key_padding.md measured at head dim 128).
- "fusionpass kernel": torch.ops.fusionpass.flash_attention with the key-padding vector (today's
  route), at its launch defaults, then a sweep of its forward, dK/dV and dQ launches on the
  all-ones batch, to see what a launch table per head dim leaves on the table.
- "cudnn-frontend padded" (only where the nvidia-cudnn-frontend wheel imports): cuDNN's own padding
  mask, per-row key lengths on the device over the padded layout, forward and backward through its
  graph API (cudnn_padded.py beside this file). Exact for right padding and all ones; rows of
  length 0 are given length 1 (cuDNN before 9.25 returns NaN there), so "empty-row" and "left"
  record what a route must send elsewhere.
- "cudnn-frontend padded + fixup" (checks only): the route's whole design on every mask: cuDNN
  for all rows, our kernel for the rows whose mask is not a prefix of keys, picked per row on the
  device. Here our kernel still runs on every row, so it is not timed.
- "cudnn-frontend padded fwd" (forward only): the wheel's own torch.ops.cudnn.sdpa_fwd with
  seq_len_q/seq_len_kv (its autograd does not take the padded layout).
- "flash-attn-4, no mask" and "flash-attn-4 lengths" (only where the flash-attn-4 wheel imports,
  --fa4): FA4's CuTe DSL kernels for sm90, anchors. Without the mask, its causal (or bidirectional)
  kernel over [B, S, H, D] views, on the all-ones batch; with the mask, its varlen entry over the
  padded layout with per-row lengths on the device (seqused_k, and seqused_q as well when causal:
  FA aligns a causal mask of unequal lengths bottom-right, so the rows past a row's length are not
  computed and are left out of its check, forward and backward).
  The wheels it needs beside torch (none on the GPU machine): flash-attn-4, quack-kernels,
  apache-tvm-ffi, torch-c-dlpack-ext, nvidia-cutlass-dsl and its libs-base, libs-core (the `cutlass`
  Python package: without it `cutlass.cute` does not import) and libs-cu13; the libs' `dsl_packages`
  folder goes on PYTHONPATH when they are unpacked rather than installed (the .pth that adds it is
  not read from a --target folder).
Also timed: the device-side checks a route needs to find the rows it can send to cuDNN (lengths,
"is the row's mask a prefix").

    python benchmarks/probes/collator_attention_routes.py [--out FILE.json] [--no-sweep]
"""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F

import fusionpass  # noqa: F401  (registers fusionpass::flash_attention)
from fusionpass.bench import cuda_graph_ms
from fusionpass.kernels import attention as attention_kernel
# the float64 reference and the broadcast-bias call are issue 19's probe's
from cudnn_key_padding import cudnn_call, reference

BF16 = torch.bfloat16
# (name, B, Hq, Hkv, S, D, causal): the Llama-3.2-1B shape (head dim 64), Llama-3-8B-like
# heads at 128, Gemma's 256, and a BERT-base encoder (bidirectional); the encoder's mask at head dims
# 128 and 256 too, so that every head dim is measured both causal and bidirectional.
SHAPES = [("llama-1b d64", 4, 32, 8, 2048, 64, True), ("llama d128", 4, 32, 8, 2048, 128, True),
          ("gemma d256", 4, 8, 4, 2048, 256, True), ("bert d64", 32, 12, 12, 512, 64, False),
          ("encoder d128", 16, 16, 16, 512, 128, False), ("encoder d256", 16, 8, 8, 512, 256, False)]
# Calls that are exact for right padding and all ones only: on left padding they are checked (to
# record that they are wrong there) but not timed. The others are timed on left padding too.
PREFIX_ONLY = ("cudnn ragged", "cudnn ragged, aten's autograd", "cudnn-frontend padded", "cudnn-frontend padded fwd",
               "flash-attn-4 lengths")


def key_padding(kind, B, S, device="cuda"):
    """[B, S] bool, True = a real token. Right/left: lengths spread over S/4..S as a collator's
    batch of uneven documents; row 0 stays full (the longest document sets S). "empty-row": right
    padding with one row that has no token at all."""
    kp = torch.ones(B, S, dtype=torch.bool, device=device)
    if kind == "ones":
        return kp
    for r in range(1, B):
        length = S - (r * (3 * S // 4)) // (B - 1) if B > 1 else S
        if kind == "empty-row" and r == B - 1:
            length = 0
        if kind == "left":
            kp[r, :S - length] = False
        else:
            kp[r, length:] = False
    return kp


# --- the calls ----------------------------------------------------------------------------------
def _repeat_kv(q, k, v):
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    return k, v


def cudnn_causal(q, k, v, kp, causal):
    k, v = _repeat_kv(q, k, v)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def ragged_lengths(kp):
    """cum_seq_q, cum_seq_k (int32, 2B + 1 entries) of the two-sequences-per-row layout above."""
    B, S = kp.shape
    base = torch.arange(B, dtype=torch.int32, device=kp.device) * S
    lengths = kp.sum(-1, dtype=torch.int32)
    end = torch.full((1,), B * S, dtype=torch.int32, device=kp.device)
    cum_q = torch.cat([torch.stack([base, base + S], 1).flatten(), end])
    cum_k = torch.cat([torch.stack([base, base + lengths], 1).flatten(), end])
    return cum_q, cum_k


class _CudnnRagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cum_q, cum_k, S, causal, scale):
        out, lse, *_rest = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cum_q, cum_k, S, S, True, 0.0, causal, False, scale=scale)
        seed, offset = _rest[4], _rest[5]
        ctx.save_for_backward(q, k, v, out, lse, cum_q, cum_k, seed, offset)
        ctx.S, ctx.causal, ctx.scale = S, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cum_q, cum_k, seed, offset = ctx.saved_tensors
        no_bias = torch.empty(0, dtype=q.dtype, device=q.device)
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            dout.contiguous(), q, k, v, out, lse, seed, offset, no_bias, cum_q, cum_k, ctx.S, ctx.S, 0.0,
            ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def cudnn_ragged(q, k, v, kp, causal):
    B, Hq, S, D = q.shape
    cum_q, cum_k = ragged_lengths(kp)
    packed = [t.transpose(1, 2).reshape(B * S, t.shape[1], D) for t in (q, k, v)]
    out = _CudnnRagged.apply(*packed, cum_q, cum_k, S, causal, D ** -0.5)
    return out.view(B, S, Hq, D).transpose(1, 2)


def cudnn_ragged_aten_autograd(q, k, v, kp, causal):
    """The same call with aten's own derivative of _cudnn_attention_forward in place of ours."""
    B, Hq, S, D = q.shape
    cum_q, cum_k = ragged_lengths(kp)
    packed = [t.transpose(1, 2).reshape(B * S, t.shape[1], D) for t in (q, k, v)]
    out = torch.ops.aten._cudnn_attention_forward(*packed, None, cum_q, cum_k, S, S, True, 0.0, causal, False,
                                                  scale=D ** -0.5)[0]
    return out.view(B, S, Hq, D).transpose(1, 2)


def fusionpass_kernel(q, k, v, kp, causal):
    return torch.ops.fusionpass.flash_attention(q, k, v, kp, scale=q.shape[-1] ** -0.5, causal=causal)[0]


def cudnn_frontend_padded(q, k, v, kp, causal):
    import cudnn_padded

    lengths = kp.sum(-1, dtype=torch.int32).clamp_min(1)
    return cudnn_padded.PaddedAttention.apply(q, k, v, lengths, q.shape[-1] ** -0.5, causal)


def cudnn_frontend_padded_fixup(q, k, v, kp, causal):
    lengths, prefix = prefix_rows(kp)
    import cudnn_padded

    full = torch.where(prefix, lengths, kp.shape[1])
    ours = fusionpass_kernel(q, k, v, kp, causal)
    theirs = cudnn_padded.PaddedAttention.apply(q, k, v, full, q.shape[-1] ** -0.5, causal)
    return torch.where(prefix[:, None, None, None], theirs, ours)


def padded_attention_route(q, k, v, kp, causal):
    """The route as built: fusionpass::padded_attention (cuDNN for prefix rows, our kernel for the
    others, inside one op)."""
    return torch.ops.fusionpass.padded_attention(q, k, v, kp, scale=q.shape[-1] ** -0.5, causal=causal)[0]


def cudnn_frontend_padded_fwd(q, k, v, kp, causal):
    import cudnn.sdpa.fwd.torch_op  # noqa: F401  (registers torch.ops.cudnn.sdpa_fwd)

    B, S = kp.shape
    seq_q = torch.full((B,), S, dtype=torch.int32, device=q.device)
    seq_kv = kp.sum(-1, dtype=torch.int32)
    return torch.ops.cudnn.sdpa_fwd(q, k, v, q.shape[-1] ** -0.5, is_causal=causal, seq_len_q=seq_q,
                                    seq_len_kv=seq_kv, return_lse=True)[0]


def _fa4():
    from flash_attn.cute import interface

    return interface


def fa4_no_mask(q, k, v, kp, causal):
    """FA4's causal (or bidirectional) kernel without the mask: the anchor on the all-ones batch."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return _fa4().flash_attn_func(q, k, v, softmax_scale=q.shape[-1] ** -0.5, causal=causal)[0].transpose(1, 2)


def fa4_lengths(q, k, v, kp, causal):
    """FA4's varlen entry over the padded layout, each row's length from the mask on the device."""
    S, D = q.shape[2], q.shape[3]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    lengths = kp.sum(-1, dtype=torch.int32)
    used_q = lengths if causal else torch.full_like(lengths, S)
    out = _fa4().flash_attn_varlen_func(q, k, v, max_seqlen_q=S, max_seqlen_k=S, seqused_q=used_q,
                                        seqused_k=lengths, softmax_scale=D ** -0.5, causal=causal)[0]
    return out.transpose(1, 2)


# calls that leave the query rows past each row's length out (checked on the other rows only)
REAL_ROWS_ONLY = ("flash-attn-4 lengths",)
# calls that ignore the padding: checked and timed on the all-ones batch only
NO_MASK = ("cudnn causal, no mask", "flash-attn-4, no mask")

CALLS = {"cudnn causal, no mask": cudnn_causal, "cudnn ragged": cudnn_ragged,
         "cudnn ragged, aten's autograd": cudnn_ragged_aten_autograd, "cudnn + broadcast bias": cudnn_call,
         "fusionpass kernel": fusionpass_kernel}
FORWARD_ONLY = {"cudnn-frontend padded fwd": cudnn_frontend_padded_fwd}
FRONTEND_CALLS = {"cudnn-frontend padded": cudnn_frontend_padded, "fusionpass padded_attention": padded_attention_route,
                  "cudnn-frontend padded + fixup": cudnn_frontend_padded_fixup, **FORWARD_ONLY}
CHECK_ONLY = ("cudnn-frontend padded + fixup",)


def prefix_rows(kp):
    """What a route checks on the device: each row's length, and whether its mask is that many
    leading ones (right padding, all ones) with at least one key."""
    lengths = kp.sum(-1, dtype=torch.int32)
    prefix = (kp == (torch.arange(kp.shape[1], device=kp.device) < lengths[:, None])).all(-1)
    return lengths, prefix & (lengths > 0)


# --- checks and timing --------------------------------------------------------------------------
def errors(fn, q, k, v, do, kp, causal, ref, backward=True, real_rows=False):
    """Max abs error against float64 of out, dq, dk, dv. real_rows: only the query and key rows
    within each row's length count, and the backward gets no gradient from the others (their dout
    is zero on both sides); whether the rows left out read NaN is recorded apart."""
    if real_rows:
        keep = kp[:, None, :, None]
        do = do * keep
        ref = [r * keep for r in reference(q, k, v, do, kp, causal)]
    torch.utils.deterministic.fill_uninitialized_memory = True  # what a call leaves unwritten reads NaN
    qg, kg, vg = (t.detach().clone().requires_grad_(backward) for t in (q, k, v))
    out = fn(qg, kg, vg, kp, causal)
    got = (out, *torch.autograd.grad(out, (qg, kg, vg), do)) if backward else (out,)
    row = {}
    if real_rows:
        row["nan outside the rows"] = any(bool(g.isnan().any()) for g in got)
        got = [torch.where(keep, g, 0) for g in got]
    row.update({n: (g.double() - r).abs().max().item() for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)})
    row["nan"] = any(bool(g.isnan().any()) for g in got)
    torch.utils.deterministic.fill_uninitialized_memory = False  # no fill kernels in the timings
    return row


def timings(fn, q, k, v, do, kp, causal, backward=True):
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    times = {"fwd ms": cuda_graph_ms(lambda: fn(q, k, v, kp, causal))}
    if backward:
        times["fwd+bwd ms"] = cuda_graph_ms(lambda: torch.autograd.grad(fn(qg, kg, vg, kp, causal), (qg, kg, vg), do))
    return times


# Launch grids of the sweep: (block_m, block_n, num_warps, num_stages) of each kernel (see
# attention_fwd / attention_bwd for what block_m and block_n mean in each).
SWEEP_GRIDS = {
    "fwd": list(itertools.product((64, 128), (64, 128), (4, 8), (2, 3))),
    "dkdv": list(itertools.product((32, 64), (64, 128), (4, 8), (2, 3))),
    "dq": list(itertools.product((64, 128), (32, 64), (4, 8), (2, 3))),
}
SWEEP_SHAPES = ("llama-1b d64", "llama d128")


def sweep(q, k, v, do, kp, causal):
    """Each launch of our three kernels in turn, the other two at their defaults; the fastest of
    each (CUDA-graph medians, ms: the dK/dV and dQ rows time the whole backward) and the defaults'."""
    scale = q.shape[-1] ** -0.5
    opts = dict(causal=causal, scale=scale, key_padding=kp)
    out, lse = attention_kernel.attention_fwd(q, k, v, **opts)
    launches = {
        "fwd": lambda c: attention_kernel.attention_fwd(q, k, v, **opts, block_m=c[0], block_n=c[1], num_warps=c[2],
                                                        num_stages=c[3]),
        "dkdv": lambda c: attention_kernel.attention_bwd(do, q, k, v, out, lse, **opts, block_m=c[0], block_n=c[1],
                                                         num_warps=c[2], num_stages=c[3]),
        "dq": lambda c: attention_kernel.attention_bwd(do, q, k, v, out, lse, **opts, dq_block_m=c[0],
                                                       dq_block_n=c[1], dq_num_warps=c[2], dq_num_stages=c[3]),
    }
    found = {"defaults fwd ms": cuda_graph_ms(lambda: attention_kernel.attention_fwd(q, k, v, **opts)),
             "defaults bwd ms": cuda_graph_ms(lambda: attention_kernel.attention_bwd(do, q, k, v, out, lse, **opts))}
    for name, launch in launches.items():
        best, refused = None, []
        for cfg in SWEEP_GRIDS[name]:
            try:
                ms = cuda_graph_ms(lambda cfg=cfg: launch(cfg))
            except Exception as e:  # out of shared memory or registers: not a candidate
                refused.append(f"{cfg}: {type(e).__name__}")
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        found[name] = best
        if refused:
            found[f"{name} refused"] = refused
    return found


def at_lengths(names) -> list[tuple]:
    """Shapes named "<shape> S<length>": the named shape at another sequence length, its batch scaled
    so that the tokens per step stay those of the shape (the Trainer's B x S budget)."""
    out = []
    for wanted in names:
        base, _, length = wanted.rpartition(" S")
        for name, B, Hq, Hkv, S, D, causal in SHAPES:
            if name == base and length.isdigit():
                out.append((wanted, max(1, B * S // int(length)), Hq, Hkv, int(length), D, causal))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    parser.add_argument("--fa4", action="store_true", help="add flash-attn-4's calls (the wheel must import)")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True, warn_only=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "rows": [], "sweeps": []}
    try:
        import cudnn

        result["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        calls_fwd = FRONTEND_CALLS
    except Exception as e:
        result["cudnn_frontend"] = f"not importable: {type(e).__name__}: {e}"[:200]
        calls_fwd = {}
    if calls_fwd:
        try:
            result["cudnn_backend_seen_by_frontend"] = cudnn.backend_version()
        except Exception as e:  # only a record: the calls say whether it runs
            result["cudnn_backend_seen_by_frontend"] = f"{type(e).__name__}: {e}"[:200]
    if args.fa4:
        try:
            import flash_attn.cute  # noqa: F401
            from importlib.metadata import version

            result["flash_attn_4"] = version("flash-attn-4")
            calls_fwd = {**calls_fwd, "flash-attn-4, no mask": fa4_no_mask, "flash-attn-4 lengths": fa4_lengths}
        except Exception as e:
            result["flash_attn_4"] = f"not importable: {type(e).__name__}: {e}"[:200]
    wanted = set(args.shapes.split(",")) if args.shapes else None
    shapes = SHAPES if wanted is None else [*SHAPES, *at_lengths(wanted)]

    def record(key, row):
        # written after every row: a run stopped at the device's time limit still leaves its rows
        print(json.dumps(row), flush=True)
        result[key].append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    for name, B, Hq, Hkv, S, D, causal in shapes:
        if wanted and name not in wanted:
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, S, D, device="cuda", dtype=BF16, generator=gen)
        k, v = (torch.randn(B, Hkv, S, D, device="cuda", dtype=BF16, generator=gen) for _ in range(2))
        do = torch.randn(B, Hq, S, D, device="cuda", dtype=BF16, generator=gen)
        for kind in ("ones", "right", "left", "empty-row"):
            kp = key_padding(kind, B, S)
            ref = reference(q, k, v, do, kp, causal)
            for call, fn in [*CALLS.items(), *calls_fwd.items()]:
                backward = call not in FORWARD_ONLY
                row = {"shape": name, "padding": kind, "call": call}
                if call in NO_MASK and kind != "ones":
                    continue
                try:
                    row["error"] = errors(fn, q, k, v, do, kp, causal, ref, backward, call in REAL_ROWS_ONLY)
                    timed = kind in ("ones", "right") or (kind == "left" and call not in PREFIX_ONLY)
                    if timed and call not in CHECK_ONLY:
                        row.update(timings(fn, q, k, v, do, kp, causal, backward))
                except Exception as e:  # the call refused this layout: that is the finding
                    row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
                record("rows", row)
            if kind == "right":
                row = {"shape": name, "padding": kind, "call": "device-side prefix check",
                       "fwd ms": cuda_graph_ms(lambda: prefix_rows(kp)),
                       "prefix rows": prefix_rows(kp)[1].tolist()}
                record("rows", row)
        if not args.no_sweep and name in SWEEP_SHAPES:
            found = {"shape": name, **sweep(q, k, v, do, key_padding("ones", B, S), causal)}
            record("sweeps", found)


if __name__ == "__main__":
    main()
