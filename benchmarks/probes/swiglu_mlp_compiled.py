"""swiglu_mlp through torch.compile: plain vs fusionpass (kernel on), wall and kernel time, decode
and prefill/training; CUDA graphs for decode."""
import json, os, sys
import torch, torch.nn.functional as F
import fusionpass
from fusionpass.bench import kernel_time, time_interleaved, peak_memory, environment
OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"
torch._inductor.config.fx_graph_cache = False
res = {"env": environment()}


class MLP(torch.nn.Module):
    def __init__(self, K=4096, N=14336):
        super().__init__()
        self.gate_proj = torch.nn.Linear(K, N, bias=False)
        self.up_proj = torch.nn.Linear(K, N, bias=False)
        self.down_proj = torch.nn.Linear(N, K, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


torch.manual_seed(0)
m = MLP().to(dev, torch.bfloat16)
import copy
m2 = copy.deepcopy(m)
for mode in ("default", "reduce-overhead"):
    for M in (1, 16, 64):
        torch._dynamo.reset(); fusionpass.reset_stats()
        x = torch.randn(M, 4096, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            plain = torch.compile(m, mode=None if mode == "default" else mode)
            if mode == "default":
                fused = torch.compile(m2, backend=fusionpass.backend(fusions=["swiglu_mlp"], swiglu_mlp_kernel=True))
            else:
                with fusionpass.enabled(fusions=["swiglu_mlp"], swiglu_mlp_kernel=True):
                    fused = torch.compile(m2, mode=mode)
                    for _ in range(3):
                        fused(x)
            for _ in range(3):
                plain(x); fused(x)
            stats = fusionpass.stats()
            err = ((fused(x).float() - plain(x).float()).norm() / plain(x).float().norm()).item()
            fns = {"plain": lambda: plain(x), "fused": lambda: fused(x)}
            r = {"wall": time_interleaved(fns, dev, rounds=5, iters=50), "matches": str(stats), "err": err}
            if mode == "default":
                r["kernel"] = {k: round(kernel_time(f, 20), 4) for k, f in fns.items()}
        res[f"{mode}-M{M}"] = r
        print(mode, M, r, flush=True)

# prefill inference and training at M=8192
x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
for train in (False, True):
    torch._dynamo.reset(); fusionpass.reset_stats()
    plain = torch.compile(m)
    fused = torch.compile(m2, backend=fusionpass.backend(fusions=["swiglu_mlp"], swiglu_mlp_kernel=True))
    xi = x.clone().requires_grad_(train)
    dy = torch.randn_like(x)

    def step(f):
        if not train:
            with torch.no_grad():
                return f(xi)
        y = f(xi)
        y.backward(dy)
        return y
    fns = {"plain": lambda: step(plain), "fused": lambda: step(fused)}
    for f in fns.values():
        f()
    r = {"wall": time_interleaved(fns, dev, rounds=5, iters=5), "kernel": {k: round(kernel_time(f, 5), 4) for k, f in fns.items()},
         "peak_GiB": {k: round(peak_memory(f) / 2**30, 3) for k, f in fns.items()}, "matches": str(fusionpass.stats())}
    res[f"M8192-{'train' if train else 'infer'}"] = r
    print(train, r, flush=True)
json.dump(res, open(f"{OUT}/swiglu.json", "w"), indent=1, default=str)
