"""The CUDA path end to end (CI has no GPU): tiny HF models at width 2048 in bf16, compiled with
the fusionpass backend and with plain torch.compile, training and inference, static and dynamic
shapes. Checks match counts and that losses, logits and gradients agree.

    python benchmarks/check_cuda.py
"""
from __future__ import annotations

import copy
import sys

import torch

import fusionpass
from fusionpass.demo import tiny_hf

torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
LAYERS = 2


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run(model, backend, ids, train: bool, dynamic):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        out = compiled(ids, labels=ids)
        if train:
            out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return out.loss.detach(), out.logits.detach(), grads


def check(name: str, train: bool, dynamic) -> tuple[bool, str]:
    torch.manual_seed(0)
    base = tiny_hf(name, layers=LAYERS, width=2048).to("cuda", torch.bfloat16).train(train)
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    ref = run(copy.deepcopy(base), "inductor", ids, train, dynamic)
    fusionpass.reset_stats()
    got = run(copy.deepcopy(base), fusionpass.backend(), ids, train, dynamic)
    matches = fusionpass.stats().get("rms_norm_residual", 0)
    errs = [rel(got[0], ref[0]), rel(got[1], ref[1])]
    if train:
        errs.append(max(rel(g, r) for g, r in zip(got[2], ref[2])))
    ok = matches == 2 * LAYERS + 1 and all(e < 3e-2 for e in errs) and len(got[2]) == len(ref[2])
    line = (
        f"{name:8s} {'train' if train else 'infer'} dynamic={dynamic}: matches {matches} "
        f"(expect {2 * LAYERS + 1}), rel err loss {errs[0]:.1e} logits {errs[1]:.1e}"
        + (f" worst grad {errs[2]:.1e}" if train else "")
        + ("  OK" if ok else "  FAIL")
    )
    return ok, line


def main() -> int:
    from fusionpass.bench import environment

    print(environment())
    cases = [
        ("llama", True, None),
        ("llama", False, None),
        ("gemma", True, None),
        ("qwen2", False, None),
        ("llama", True, True),
    ]
    results = [check(*c) for c in cases]
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
