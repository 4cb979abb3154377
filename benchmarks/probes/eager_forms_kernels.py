"""Issue 43 probe: the attention kernel's soft-capping (Gemma-2) and sinks (gpt-oss) flags on the
GPU against the float64 reference of tests/kernel_tests/test_attention_kernel.py, at real head dims
and lengths that are no multiple of a block (kernels on CUDA, the reference on the CPU), under
NaN-filled memory. Prints one row per case (errors relative to each tensor's largest reference
value, and whether the outputs are finite) and writes them to $OUT/gpu_check.json (or ./).

    python benchmarks/probes/eager_forms_kernels.py
"""
import json, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "kernels"))
import torch
torch.utils.deterministic.fill_uninitialized_memory = True
torch.use_deterministic_algorithms(True, warn_only=True)
from fusionpass.kernels.attention import attention_fwd, attention_bwd, attention_sinks_grad
import test_attention_kernel as t
rows = []
for name, (B, Hq, Hkv, L, D, dt, opts) in {
    "softcap50-causal-bf16-d256": (2, 8, 4, 1000, 256, torch.bfloat16, {"causal": True, "softcap": 50.0}),
    "softcap2-window-fp16-d64": (2, 16, 4, 777, 64, torch.float16, {"causal": True, "window": 100, "softcap": 2.0, "scale": 0.3}),
    "softcap5-full-bf16-d128": (2, 8, 8, 513, 128, torch.bfloat16, {"softcap": 5.0, "scale": 0.25}),
    "sinks-causal-bf16-d64": (2, 16, 2, 1000, 64, torch.bfloat16, {"causal": True, "sinks": True}),
    "sinks-window-fp16-d64": (2, 8, 1, 777, 64, torch.float16, {"causal": True, "window": 128, "sinks": True}),
}.items():
    torch.manual_seed(0)
    opts = dict(opts)
    sinks = torch.randn(Hq) if opts.pop("sinks", False) else None
    q, k, v = (torch.randn(s, dtype=torch.float64).to(dt) for s in ((B, Hq, L, D), (B, Hkv, L, D), (B, Hkv, L, D)))
    do = torch.randn(B, Hq, L, D, dtype=torch.float64).to(dt)
    cu = lambda x: None if x is None else x.cuda()
    out, lse = attention_fwd(cu(q), cu(k), cu(v), sinks=cu(sinks), **opts)
    dq, dk, dv = attention_bwd(cu(do), cu(q), cu(k), cu(v), out, lse, **opts)
    ref = t.reference(q, k, v, do, sinks=sinks, **opts)
    err = {n: ((x.double().cpu() - ref[n]).abs().max() / ref[n].abs().max()).item()
           for n, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
    if sinks is not None:
        ds = attention_sinks_grad(cu(do), out, lse, cu(sinks)).double().cpu()
        err["dsinks"] = ((ds - ref["dsinks"]).abs().max() / ref["dsinks"].abs().max()).item()
    err["finite"] = bool(torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all())
    rows.append({"case": name, **err}); print(rows[-1], flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "gpu_check.json"), "w"), indent=1)
