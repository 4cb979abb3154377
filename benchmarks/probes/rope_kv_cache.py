"""Does plain Inductor write the rotated k into a static KV cache in the same kernel that rotates
it? HF's static-cache step, written out: rotate q and k (rotate_half), `index_copy_` k and v into
the caches, SDPA over the caches. Prints the generated kernels (Triton on CUDA, C++ on CPU) and
which ones hold both the rotation (`cat`, `neg`) and the cache write (`index_copy`).
    python benchmarks/probes/rope_kv_cache.py [cpu]         writes $OUT/rope_kv_cache.json on CUDA
"""
import json
import os
import re
import sys

import torch
from torch._inductor.utils import run_and_get_code

dev = "cpu" if sys.argv[1:] == ["cpu"] else "cuda"
dtype = torch.float32 if dev == "cpu" else torch.bfloat16


def rot(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def step(q, k, v, c, s, k_cache, v_cache, pos):
    c, s = c.unsqueeze(1), s.unsqueeze(1)
    q_rot = q * c + rot(q) * s
    k_rot = k * c + rot(k) * s
    k_cache.index_copy_(2, pos, k_rot)
    v_cache.index_copy_(2, pos, v)
    return torch.nn.functional.scaled_dot_product_attention(q_rot, k_cache, v_cache, enable_gqa=True)


B, H, Hk, D, L = 1, 32, 8, 128, 4096
t = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype)  # noqa: E731
args = (t(B, H, 1, D), t(B, Hk, 1, D), t(B, Hk, 1, D), t(B, 1, D), t(B, 1, D), torch.zeros(B, Hk, L, D, device=dev,
        dtype=dtype), torch.zeros(B, Hk, L, D, device=dev, dtype=dtype), torch.tensor([5], device=dev))
_, code = run_and_get_code(torch.compile(step, fullgraph=True), *args)
names = sorted(set(re.findall(r"(?:triton|cpp)_\w+_fused_\w+|cpp_fused_\w+", "\n".join(code))))
res = {"device": dev, "kernels": names,
       "rotation and cache write in one kernel": [n for n in names if "index_copy" in n and "neg" in n]}
print(json.dumps(res, indent=1))
if dev == "cuda":
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "rope_kv_cache.json"), "w") as f:
        json.dump(res, f, indent=1)
