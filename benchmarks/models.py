"""Whole-model benchmarks on the GPU: HF models built from configs (random weights), plain
torch.compile against fusionpass, side by side (interleaved) in one process.

    python benchmarks/models.py [--model llama|gpt2|bert|bloom|falcon] [--layers 8] [--batch 4] [--seq 2048]
                                [--mask] [--attn sdpa|eager] [--eager] [--steps train,inference]
                                [--fusions ...] [--without FUSION]
                                [--json out.json]

llama: h2048, GQA 16/4, head_dim 128, intermediate 8192 (the baseline survey's config, docs/architecture.md); gpt2: GPT-2 small
with `loss_type="ForCausalLM"` (else its loss lands in a second graph); bert: BERT-base MLM;
bloom: BLOOM-style h1024 with 16 heads (ALiBi; transformers has only eager attention for it);
falcon: Falcon with `alibi=True` at the same size (sdpa: ALiBi folded into the mask; or eager).
`--mask` passes an all-ones attention_mask, as training loops do. `--attn` also applies to llama.
`--without FUSION` adds a third column, fusionpass without that fusion, timed interleaved with the
other two (what one fusion adds, in one run).

Reports, for a training step (forward + loss + backward) and an inference forward: milliseconds,
tokens/s, peak memory above the weights, compile time (first call), match counts, and whether the
losses agree.
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

import fusionpass
from fusionpass import config as fp_config
from fusionpass.bench import environment, peak_memory, time_interleaved

try:
    from tabulate import tabulate
except ImportError:  # pragma: no cover
    tabulate = None

DEVICE = "cuda"
# Match counts are only recorded when our pass runs, i.e. not on an FX-graph-cache hit.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


def build_llama(layers: int, vocab: int, hidden: int = 2048, intermediate: int = 8192, attn: str = "sdpa"):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=hidden // 16,
        vocab_size=vocab,
        max_position_embeddings=8192,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.bfloat16)


def build_gpt2(attn: str = "sdpa"):
    import transformers

    config = transformers.GPT2Config()
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.bfloat16)
    model.loss_type = "ForCausalLM"
    return model


def build_bloom(layers: int):
    import transformers

    # the baseline survey's BLOOM-style model (docs/architecture.md): h1024, 16 heads (head dim 64), ALiBi, eager attention only
    config = transformers.BloomConfig(hidden_size=1024, n_layer=layers, n_head=16)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.bfloat16)


def build_falcon(layers: int, attn: str = "sdpa"):
    import transformers

    # Falcon-ALiBi at BLOOM-style size: h1024, 16 heads (head dim 64), ALiBi folded into the
    # SDPA mask (sdpa) or added to the scores (eager)
    config = transformers.FalconConfig(hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                                       alibi=True, new_decoder_architecture=False, multi_query=False,
                                       parallel_attn=False, bias=True)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(DEVICE, torch.bfloat16)


def build_bert(attn: str = "sdpa"):
    import transformers

    config = transformers.BertConfig()
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForMaskedLM.from_config(config).to(DEVICE, torch.bfloat16)


def train_step(model, ids, **kwargs):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, **kwargs)
        out.loss.backward()
        return out.loss

    return step


def infer_step(model, ids, **kwargs):
    def step():
        with torch.no_grad():
            return model(ids, **kwargs).logits

    return step


def first_call_seconds(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def warm_up_compiler() -> None:
    """Compile something small first, so neither side's compile time pays for importing and
    initializing Inductor and Triton."""
    f = torch.compile(lambda t: torch.nn.functional.silu(t) * 2)
    f(torch.randn(64, device=DEVICE))


def run(args) -> list[dict]:
    fusions = args.fusions.split(",") if args.fusions else None
    warm_up_compiler()
    if args.model == "llama":
        base = build_llama(args.layers, args.vocab, attn=args.attn)
        name = f"llama {args.layers}L h2048" + (f" attn={args.attn}" if args.attn != "sdpa" else "")
    elif args.model == "bloom":
        base = build_bloom(args.layers)
        name = f"bloom-style {args.layers}L h1024"
    elif args.model == "falcon":
        base = build_falcon(args.layers, args.attn)
        name = f"falcon-alibi {args.layers}L h1024 attn={args.attn}"
    else:
        base = build_gpt2(args.attn) if args.model == "gpt2" else build_bert(args.attn)
        name = {"gpt2": "gpt2-small", "bert": "bert-base MLM"}[args.model]
        if args.attn != "sdpa":
            name += f" attn={args.attn}"
    vocab = base.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=DEVICE)
    kwargs = {}
    if args.mask:
        kwargs["attention_mask"] = torch.ones_like(ids)
        name += " all-ones mask"
    rows = []
    for mode in args.steps.split(","):
        plain_model = copy.deepcopy(base).train(mode == "train")
        fused_model = copy.deepcopy(base).train(mode == "train")
        torch._dynamo.reset()
        fusionpass.reset_stats()
        plain = torch.compile(plain_model)
        fused = torch.compile(fused_model, backend=fusionpass.backend(fusions=fusions))
        make = train_step if mode == "train" else infer_step
        steps = {"torch.compile": make(plain, ids, **kwargs), "fusionpass": make(fused, ids, **kwargs)}
        if args.without:
            names = set(fusions) if fusions is not None else set(fp_config.make().fusions)
            without = torch.compile(copy.deepcopy(base).train(mode == "train"),
                                    backend=fusionpass.backend(fusions=sorted(names - {args.without})))
            steps[f"fusionpass -{args.without}"] = make(without, ids, **kwargs)
        eager_model = copy.deepcopy(base).train(mode == "train")
        if args.eager:
            steps["eager"] = make(eager_model, ids, **kwargs)
        compile_s = {}
        for k, s in steps.items():
            compile_s[k] = first_call_seconds(s)
            if k == "fusionpass":
                matches = fusionpass.stats()  # before the --without compile adds its own
        # numerics: one more step each from identical weights, and eager as the yardstick of
        # what bf16 rounding alone moves
        outs = {k: s().float() for k, s in steps.items()}
        if "eager" not in outs:
            outs["eager"] = make(eager_model, ids, **kwargs)().float()

        def diff(a, b):
            return ((a - b).norm() / b.norm()).item() if b.dim() else abs((a - b).item())

        fused_diff = diff(outs["fusionpass"], outs["torch.compile"])
        eager_diff = diff(outs["eager"], outs["torch.compile"])
        ms = time_interleaved(steps, DEVICE, rounds=args.rounds, iters=args.iters, warmup=2)
        mem = {k: peak_memory(s) for k, s in steps.items()}
        tokens = args.batch * args.seq
        for k in steps:
            rows.append(
                {
                    "model": f"{name} B{args.batch} S{args.seq}",
                    "step": mode,
                    "impl": k,
                    "ms": round(ms[k], 2),
                    "tokens/s": round(tokens / ms[k] * 1e3),
                    "vs torch.compile": round(ms["torch.compile"] / ms[k], 3),
                    "peak GiB": round(mem[k] / 2**30, 2),
                    "compile s": round(compile_s[k], 1),
                    "matches": json.dumps(matches) if k == "fusionpass" else "",
                    "diff vs torch.compile": {
                        "torch.compile": f"eager: {eager_diff:.2e}",
                        "fusionpass": f"{fused_diff:.2e}",
                    }.get(k, ""),
                }
            )
        del plain, fused, plain_model, fused_model, eager_model, steps, outs
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama", choices=["llama", "gpt2", "bert", "bloom", "falcon"])
    parser.add_argument("--mask", action="store_true", help="pass an all-ones attention_mask")
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="gpt2/bert attention")
    parser.add_argument("--eager", action="store_true", help="also time eager PyTorch")
    parser.add_argument("--steps", default="train,inference")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--fusions", default=None)
    parser.add_argument("--without", default=None, help="also time fusionpass without this fusion")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    env = environment()
    rows = run(args)
    print(env)
    print(tabulate(rows, headers="keys", tablefmt="github") if tabulate else rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
