"""HF Llama 8L h2048 (GQA 16/4, D128, bf16) greedy generation with a StaticCache, prompt P (default
32768): per-token latency of the decode step compiled with mode="reduce-overhead", plain
torch.compile vs the fusionpass backend (decode_attention), side by side in one process.

The prompt is prefilled eagerly (logits_to_keep=1) into one cache per side; the decode step
(model + argmax, the cache advancing its own cumulative_length as transformers 5 does) is compiled
fullgraph with CUDA graphs. Rounds alternate between the sides; each round rewinds the caches to
P and generates N tokens. Writes $OUT/decode_generation.json.
    python benchmarks/probes/decode_generation.py [P] [N]
"""
import copy
import json
import os
import sys
import time
import traceback

import torch

import fusionpass
from fusionpass.bench import environment, kernel_time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from models import build_llama  # noqa: E402

import transformers  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
torch._inductor.config.fx_graph_cache = False
P = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
N = int(sys.argv[2]) if len(sys.argv) > 2 else 64
ROUNDS = 3
res = {"env": environment(), "prompt": P, "new_tokens": N,
       "model": "llama 8L h2048 GQA 16/4 D128 intermediate 8192 vocab 32000, bf16, B1"}


def save():
    json.dump(res, open(f"{OUT}/decode_generation.json", "w"), indent=1, default=str)


base = build_llama(8, 32000).eval()
torch.manual_seed(1)
prompt = torch.randint(0, 32000, (1, P), device="cuda")
sides = {}
for name in ("torch.compile", "fusionpass"):
    m = copy.deepcopy(base)
    cache = transformers.StaticCache(config=m.config, max_cache_len=P + N + 64)
    t0 = time.perf_counter()
    with torch.no_grad():
        first = m(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    res.setdefault("prefill_eager_s", {})[name] = round(time.perf_counter() - t0, 2)

    def step(tok, m=m, cache=cache):
        return m(tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)

    backend = fusionpass.backend(fusions=["decode_attention"]) if name == "fusionpass" else "inductor"
    sides[name] = dict(m=m, cache=cache, first=first,
                       fn=torch.compile(step, backend=backend, mode="reduce-overhead", fullgraph=True))


def rewind(cache):
    for layer in cache.layers:
        layer.cumulative_length.fill_(P)


def generate(side, n):
    rewind(side["cache"])
    tok, seq = side["first"], []
    with torch.no_grad():
        for _ in range(n):
            torch.compiler.cudagraph_mark_step_begin()
            tok = side["fn"](tok).clone()
            seq.append(tok)
    return torch.cat(seq, 1)


try:
    fusionpass.reset_stats()
    for name, side in sides.items():
        t0 = time.perf_counter()
        generate(side, 3)  # compile, warm up, record the graph
        torch.cuda.synchronize()
        res.setdefault("compile_s", {})[name] = round(time.perf_counter() - t0, 1)
    res["matches"] = {"/".join(k): n for k, n in fusionpass.stats(variants=True).items()}
    from fusionpass.passes import STATISTICS
    res["near_misses"] = list(STATISTICS.near_misses)[:20]
    toks = {name: generate(side, N) for name, side in sides.items()}
    a, b = toks["torch.compile"][0], toks["fusionpass"][0]
    diverge = (a != b).nonzero()
    res["tokens_identical"] = bool(torch.equal(a, b))
    res["first_divergence"] = int(diverge[0]) if len(diverge) else None
    ms = {name: [] for name in sides}
    for _ in range(ROUNDS):
        for name, side in sides.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            generate(side, N)
            torch.cuda.synchronize()
            ms[name].append((time.perf_counter() - t0) * 1e3 / N)
    res["per_token_ms_rounds"] = ms
    res["per_token_ms"] = {k: round(min(v), 4) for k, v in ms.items()}
    res["speedup"] = round(res["per_token_ms"]["torch.compile"] / res["per_token_ms"]["fusionpass"], 3)
    save()
    # GPU kernel time of one step (the replayed graph's kernels, from the profiler)
    for name, side in sides.items():
        rewind(side["cache"])

        def one(side=side):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                return side["fn"](side["first"]).clone()
        try:
            res.setdefault("kernel_ms_per_step", {})[name] = round(kernel_time(one, iters=10), 4)
        except Exception as e:
            res.setdefault("kernel_ms_per_step", {})[name] = repr(e)[:200]
except Exception:
    res["error"] = traceback.format_exc()[-3000:]
save()
print(json.dumps({k: v for k, v in res.items() if k != "env"}, indent=1, default=str))
