"""The act·mul kernels (fusionpass.kernels.swiglu) on the GPU against float64, eager and compiled, on
odd shapes down to one row and one column: Triton specializes an int argument of 1, which the CPU
interpreter never does. Writes $OUT/actmul_check.json; "bad" lists NaNs and errors past a loose bound."""
import json, os, sys, torch
torch.utils.deterministic.fill_uninitialized_memory = True
torch.use_deterministic_algorithms(True, warn_only=True)
import fusionpass  # registers ops
F = torch.nn.functional
out = {}
def bwd(dh, g, u):
    return torch.ops.fusionpass.swiglu_backward(dh, g, u, "silu")
def fwd(x, wg, wu):
    return torch.ops.fusionpass.swiglu(x, wg, None, wu, None, "silu")
cbwd, cfwd = torch.compile(bwd, dynamic=False), torch.compile(fwd, dynamic=False)
for dt in (torch.bfloat16, torch.float32):
    for shape in [(1, 37), (5, 1), (1,), (3, 7, 11), (1, 1, 14336)]:
        torch._dynamo.reset()
        g, u, dh = (torch.randn(shape, device="cuda", dtype=torch.float64) for _ in range(3))
        s = torch.sigmoid(g); ref_dg = dh * u * s * (1 + g * (1 - s)); ref_du = dh * g * s
        for name, fn in (("eager", bwd), ("compiled", cbwd)):
            dg, du = fn(dh.to(dt), g.to(dt), u.to(dt))
            err = max((dg.double() - ref_dg).abs().max().item(), (du.double() - ref_du).abs().max().item())
            out[f"bwd {dt} {shape} {name}"] = err
    for m, k, n in [(100, 33, 37), (129, 64, 1)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.float64); wg = torch.randn(n, k, device="cuda", dtype=torch.float64) / k**.5; wu = torch.randn(n, k, device="cuda", dtype=torch.float64) / k**.5
        ref = F.silu(x @ wg.T) * (x @ wu.T)
        for name, fn in (("eager", fwd), ("compiled", cfwd)):
            h = fn(x.to(dt), wg.to(dt), wu.to(dt))
            h = h[0] if isinstance(h, (tuple, list)) else h
            out[f"fwd {dt} {(m,k,n)} {name}"] = (h.double() - ref).abs().max().item()
bad = {k: v for k, v in out.items() if not (v == v) or v > (0.5 if "bfloat16" in k else 1e-3)}
print(json.dumps({"errors": out, "bad": bad}, indent=1))
json.dump({"errors": out, "bad": bad}, open(os.environ["OUT"] + "/actmul_check.json", "w"), indent=1)
