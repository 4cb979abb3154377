"""Issue 19 item 5 probe: variants of fusionpass.kernels.attention built by source edits, checked
against fp64 and timed against SDPA cuDNN / flash / memory-efficient.

Variants:
  fma        forward: scores kept unscaled; the row max is scaled once and exp2(s * scale - m)
             is one FMA per score (today: s = dot * scale, then s - m).
  atomic_dq  backward: dQ accumulated by the dK/dV kernel with fp32 atomics (FA2's original
             form: 5 matmuls per block pair instead of 7); no dQ kernel.

Run: `python benchmarks/probes/attention_variants.py` on a GPU (writes $OUT/kernel_probe.json).
Only the first shape is GPU-bound. The others time the eager launch path (attention_fwd/bwd's
checks and wrap_triton's dispatch, which torch.compile does not take) more than the kernels, and
atomic_dq's backward launches its kernel directly: their rows do not compare kernels.
"""
import importlib.util
import json
import os
import re
import sys
import time

import torch
import triton

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "fusionpass", "kernels", "attention")
# The package's modules in import order, as one source the edits below apply to (the imports
# between them dropped: in one module the names are its own).
PARTS = ("blocks", "forward", "backward", "host")
_OWN_IMPORTS = r"^from fusionpass\.kernels\.attention\.\w+ import (\([^)]*\)|[^\n]*)\n"


def source() -> str:
    src = "".join(open(os.path.join(PACKAGE, f"{part}.py")).read() for part in PARTS)
    src = re.sub(_OWN_IMPORTS, "", src, flags=re.M)
    return "from __future__ import annotations\n" + src.replace("from __future__ import annotations\n", "")


def build(name, edits):
    src = source()
    for pattern, repl, count in edits:
        new, n = re.subn(pattern, repl, src, flags=re.S)
        assert n == count, (name, pattern[:60], n)
        src = new
    path = f"/tmp/attention_{name}.py"
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"attention_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _fwd_steps_only(pattern):
    # restrict a pattern to the body of _fwd_steps (up to the next @triton.jit)
    return r"(def _fwd_steps\(.*?)" + pattern


FMA = [
    (_fwd_steps_only(r"s = tl\.dot\(q, tl\.trans\(k\), input_precision=PREC\) \* qk_scale"),
     r"\1s = tl.dot(q, tl.trans(k), input_precision=PREC)", 1),
    (_fwd_steps_only(r"p, alpha, l_i, m_new = _softmax_step\(s, m_i, l_i, MASKED or HAS_KPM or HAS_SEG\)"),
     r"""\1m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)""", 1),
]

ATOMIC = [
    (r"def _dkdv_steps\(dk, dv, k, v, q_base", "def _dkdv_steps(dk, dv, k, v, dqa_base, q_base", 1),
    (r"_dkdv_steps\(\s*dk, dv, k, v, q_base", "_dkdv_steps(dk, dv, k, v, dqa_base, q_base", 3),
    (r"(        dk \+= tl\.dot\(_mm_operand\(dsT, DT, INTERP\), q, input_precision=PREC\)\n)",
     r"""\1        dq_part = tl.dot(tl.trans(_mm_operand(dsT, DT, INTERP)), k, input_precision=PREC)
        tl.atomic_add(dqa_base + rows[:, None] * offs_d.shape[0] + offs_d[None, :], dq_part, mask=mask, sem="relaxed")
""", 1),
    (r"Q, K, V, DO, LSE, DELTA, DK, DV, SLOPES", "Q, K, V, DO, LSE, DELTA, DK, DV, DQA, SLOPES", 1),
    (r"(        delta_base = DELTA \+ bh\.to\(tl\.int64\) \* Lq\n)",
     r"\1        dqa_base = DQA + bh.to(tl.int64) * Lq * BLOCK_D\n", 1),
]


def bwd_atomic(A, do, q, k, v, out, lse, cfg=None, **kw):
    o = A.check_options(q, k, v, causal=kw.get("causal", False), key_padding=kw.get("key_padding"))
    B, Hq, Hkv, Lq, Lk, D = o.B, o.Hq, o.Hkv, o.Lq, o.Lk, o.D
    pad_d = triton.next_power_of_2(D)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dqa = torch.zeros((B, Hq, Lq, pad_d), dtype=torch.float32, device=q.device)
    flags = A._flags(o)
    ptrs, aux_strides = A._aux(o, q)
    _, lo, hi, olo, ohi, thr, drop_scale = o.rng
    delta = torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device)
    num_m = triton.cdiv(Lq, A._PRE_BLOCK_M)
    A._bwd_pre_kernel[(num_m * B * Hq,)](out, do, delta, *out.stride(), *do.stride(), Hq, Lq, num_m,
                                         D=D, BLOCK_D=pad_d, BLOCK_M=A._PRE_BLOCK_M, num_warps=4)
    bm, bn, warps, stages = cfg or A._DKDV_CFG[pad_d]
    num_n = triton.cdiv(Lk, bn)
    A._bwd_dkdv_kernel[(num_n * B * Hkv,)](
        q, k, v, do, lse, delta, dk, dv, dqa, *ptrs,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), *aux_strides,
        Hq, Hkv, Lq, Lk, o.group, num_n, o.scale, 0, 0, float(drop_scale), lo, hi, olo, ohi, thr,
        **flags, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    dq = (dqa[..., :D] * o.scale).to(q.dtype)
    return dq, dk, dv


def reference(q, k, v, causal, key_padding):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    kk, vv = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = q64 @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    L, S = s.shape[-2:]
    vis = torch.ones(L, S, dtype=torch.bool, device=q.device)
    if causal:
        vis = vis.tril()
    vis = vis[None, None]
    if key_padding is not None:
        vis = vis & key_padding[:, None, None, :]
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ vv, (q64, k64, v64)


def check(mods, results):
    torch.manual_seed(0)
    for (B, Hq, Hkv, L, D, causal, padded) in ((2, 4, 2, 1000, 128, True, False), (3, 4, 4, 333, 64, False, True),
                                               (2, 4, 1, 517, 128, True, True)):
        q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16)
        kp = None
        if padded:
            lens = torch.randint(1, L + 1, (B,), device="cuda")
            kp = torch.arange(L, device="cuda")[None] < lens[:, None]
        ref, leaves = reference(q, k, v, causal, kp)
        ref.backward(do.double())
        refs = [ref.detach()] + [t.grad for t in leaves]
        rows = {}
        for name, A in mods.items():
            o, lse = A.attention_fwd(q, k, v, causal=causal, key_padding=kp)
            if name == "atomic_dq":
                grads = bwd_atomic(A, do, q, k, v, o, lse, causal=causal, key_padding=kp)
            else:
                grads = A.attention_bwd(do, q, k, v, o, lse, causal=causal, key_padding=kp)
            rows[name] = [float((a.double() - b).abs().max()) for a, b in zip([o, *grads], refs)]
        results["check"].append({"shape": [B, Hq, Hkv, L, D, causal, padded], "max_abs_err out,dq,dk,dv": rows})
        print("check", B, Hq, Hkv, L, D, causal, padded, rows, flush=True)


def bench(fn, ms=None):
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def time_all(mods, results):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    shapes = [("bar B4 H32 S4096 D128 causal", 4, 32, 32, 4096, 128, True, False),
              ("Llama B4 H16/4 S2048 D128 causal", 4, 16, 4, 2048, 128, True, False),
              ("BERT B32 H12 S512 D64 padded", 32, 12, 12, 512, 64, False, True)]
    for label, B, Hq, Hkv, L, D, causal, padded in shapes:
        torch.manual_seed(1)
        q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16)
        do = torch.randn_like(q)
        kp = None
        mask = None
        if padded:
            lens = torch.randint(64, L + 1, (B,), device="cuda")
            kp = torch.arange(L, device="cuda")[None] < lens[:, None]
            mask = kp[:, None, None, :]
        flops_f = 4 * B * Hq * L * L * D * (0.5 if causal else 1.0)
        row = {"shape": label}
        backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                    "efficient": SDPBackend.EFFICIENT_ATTENTION}
        for bname, be in backends.items():
            if padded and bname != "efficient":
                continue
            try:
                qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                kw = dict(is_causal=causal, attn_mask=mask, enable_gqa=Hq != Hkv)
                with sdpa_kernel(be):
                    F.scaled_dot_product_attention(qq, kk, vv, **kw)
                    tf = bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, **kw))
                    tfb = bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, **kw).backward(do))
                row[bname] = {"fwd_ms": round(tf, 4), "fwdbwd_ms": round(tfb, 4),
                              "fwd_tflops": round(flops_f / tf / 1e9, 1), "fwdbwd_tflops": round(3.5 * flops_f / tfb / 1e9, 1)}
            except Exception as e:  # noqa: BLE001
                row[bname] = f"error: {type(e).__name__}: {str(e)[:120]}"
        for name, A in mods.items():
            o, lse = A.attention_fwd(q, k, v, causal=causal, key_padding=kp)
            tf = bench(lambda: A.attention_fwd(q, k, v, causal=causal, key_padding=kp))
            if name == "atomic_dq":
                cfgs = {"default": None, "m32": (32, 128, 8, 2), "m64s3": (64, 128, 8, 3), "n64": (64, 64, 4, 3)}
                if D == 64:
                    cfgs = {"default": None, "m32": (32, 128, 8, 2), "n64": (64, 64, 4, 3), "n64w8": (64, 64, 8, 2)}
                tb = {}
                for cn, cfg in cfgs.items():
                    try:
                        bwd_atomic(A, do, q, k, v, o, lse, cfg, causal=causal, key_padding=kp)
                        tb[cn] = round(bench(lambda: bwd_atomic(A, do, q, k, v, o, lse, cfg, causal=causal,
                                                                key_padding=kp)), 4)
                    except Exception as e:  # noqa: BLE001
                        tb[cn] = f"error: {type(e).__name__}: {str(e)[:120]}"
            else:
                tb = {"default": round(bench(lambda: A.attention_bwd(do, q, k, v, o, lse, causal=causal,
                                                                     key_padding=kp)), 4)}
            best_b = min(x for x in tb.values() if isinstance(x, float))
            row[name] = {"fwd_ms": round(tf, 4), "bwd_ms": tb, "fwdbwd_ms": round(tf + best_b, 4),
                         "fwd_tflops": round(flops_f / tf / 1e9, 1),
                         "fwdbwd_tflops": round(3.5 * flops_f / (tf + best_b) / 1e9, 1)}
        results["timing"].append(row)
        print(json.dumps(row), flush=True)


def main():
    torch.utils.deterministic.fill_uninitialized_memory = True
    out = os.environ.get("OUT", "/tmp")
    results = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%d"), "check": [], "timing": []}
    from fusionpass.kernels import attention as base
    mods = {"base": base, "fma": build("fma", FMA), "atomic_dq": build("atomic_dq", ATOMIC)}
    try:
        check(mods, results)
        time_all(mods, results)
    finally:
        json.dump(results, open(os.path.join(out, "kernel_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
