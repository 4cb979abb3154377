"""The act·mul kernels (fusionpass.fusions.swiglu_mlp.kernels) on the GPU against float64, eager and compiled, on
odd shapes down to one row and one column: Triton specializes an int argument of 1, which the CPU
interpreter never does. Writes $OUT/actmul_check.json; "bad" lists NaNs and errors past a loose bound."""
import json
import os

import torch
import torch.nn.functional as F

import fusionpass  # noqa: F401 -- registers the ops

torch.utils.deterministic.fill_uninitialized_memory = True
torch.use_deterministic_algorithms(True, warn_only=True)


def bwd(dh, g, u):
    return torch.ops.fusionpass.swiglu_backward(dh, g, u, "silu")


def fwd(x, wg, wu):
    return torch.ops.fusionpass.swiglu(x, wg, None, wu, None, "silu")


def randn(*shape):
    return torch.randn(shape, device="cuda", dtype=torch.float64)


cbwd, cfwd = torch.compile(bwd, dynamic=False), torch.compile(fwd, dynamic=False)
out = {}
for dt in (torch.bfloat16, torch.float32):
    for shape in [(1, 37), (5, 1), (1,), (3, 7, 11), (1, 1, 14336)]:
        torch._dynamo.reset()
        g, u, dh = randn(*shape), randn(*shape), randn(*shape)
        s = torch.sigmoid(g)
        ref_dg, ref_du = dh * u * s * (1 + g * (1 - s)), dh * g * s
        for name, fn in (("eager", bwd), ("compiled", cbwd)):
            dg, du = fn(dh.to(dt), g.to(dt), u.to(dt))
            out[f"bwd {dt} {shape} {name}"] = max((dg.double() - ref_dg).abs().max().item(),
                                                   (du.double() - ref_du).abs().max().item())
    for m, k, n in [(100, 33, 37), (129, 64, 1)]:
        x, wg, wu = randn(m, k), randn(n, k) / k**0.5, randn(n, k) / k**0.5
        ref = F.silu(x @ wg.T) * (x @ wu.T)
        for name, fn in (("eager", fwd), ("compiled", cfwd)):
            h = fn(x.to(dt), wg.to(dt), wu.to(dt))
            h = h[0] if isinstance(h, (tuple, list)) else h
            out[f"fwd {dt} {(m, k, n)} {name}"] = (h.double() - ref).abs().max().item()
bad = {k: v for k, v in out.items() if not (v == v) or v > (0.5 if "bfloat16" in k else 1e-3)}
print(json.dumps({"errors": out, "bad": bad}, indent=1))
with open(os.path.join(os.environ["OUT"], "actmul_check.json"), "w") as f:
    json.dump({"errors": out, "bad": bad}, f, indent=1)
