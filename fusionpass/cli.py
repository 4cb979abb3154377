"""`fusionpass explain | bench | list`."""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _device(name: str | None) -> str:
    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def _model_and_inputs(args):
    from fusionpass.demo import build

    device = _device(args.device)
    model = build(args.model, layers=args.layers, width=args.width)
    model = model.to(device=device, dtype=_dtype(args.dtype))
    model.train(args.train)
    vocab = model.config.vocab_size if hasattr(model, "config") else model.lm_head.out_features
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=device)
    return model, ids


def cmd_list(args) -> int:
    from fusionpass import reference
    from fusionpass.registry import registered

    if args.markdown or args.reference:
        print(reference.readme_section() if args.markdown else reference.reference_page())
        return 0
    by_fusion = reference.settings_by_fusion()
    rows = []
    for name, fusion in registered().items():  # in run order
        rows.append(
            {
                "fusion": name,
                "status": "available",
                "matches": fusion.matches,
                "variants": [v.name for v in fusion.variants],
                "selected_when": fusion.selection(),
                "guards": [gd.name for gd in fusion.guards],
                "after": list(fusion.after),
                "settings": [{"name": s.name, "env": s.env, "default": s.default, "doc": s.doc}
                             for s in by_fusion.get(name, [])],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['fusion']}: {row['status']}")
        print(f"  matches:       {row['matches']}")
        print(f"  variants:      {', '.join(row['variants'])}")
        print(f"  selected when: {row['selected_when']}")
        print(f"  guards:        {', '.join(row['guards'])}")
        if row["after"]:
            print(f"  runs after:    {', '.join(row['after'])}")
        for s in row["settings"]:
            print(f"  setting {s['name']} = {s['default']!r} ({s['env']}): {s['doc']}")
    return 0


def cmd_explain(args) -> int:
    import fusionpass

    model, ids = _model_and_inputs(args)
    fusions = args.fusions.split(",") if args.fusions else None
    kwargs = {} if args.model == "demo" else {"labels": ids} if args.train else {}
    report = fusionpass.explain(model, ids, fusions=fusions, train=args.train, **kwargs)
    print(report.to_json() if args.json else report)
    return 0


def _subject(args, device, dtype):
    """The model `fusionpass bench` times: the built-in demo or a transformers model."""
    from fusionpass.bench import Subject
    from fusionpass.demo import build_hf

    if args.model == "demo":
        return Subject.demo(args.layers or 2, args.width or 2048, device, dtype)
    positions = args.seq + (args.new_tokens if "generate" in args.steps else 0)
    built = build_hf(args.model, task=args.task, attn=args.attn, device=device, dtype=dtype,
                            layers=args.layers, width=args.width, heads=args.heads, kv_heads=args.kv_heads,
                            intermediate=args.intermediate, vocab=args.vocab, positions=positions)
    return Subject.from_hf(built)


def _settings(args) -> dict:
    """fusionpass.backend(**settings) from --set NAME=VALUE."""
    from fusionpass import config as config_mod

    known = config_mod.settings()
    settings = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in known or not value:
            raise SystemExit(f"--set {item}: expected NAME=VALUE with NAME one of {', '.join(known)}")
        settings[name] = config_mod._parse(value, known[name].default)
    return settings


def cmd_bench(args) -> int:
    import shlex

    from fusionpass import bench, bench_report

    if args.list_models:
        from fusionpass.demo import model_types

        print("\n".join(model_types()))
        return 0
    try:
        if args.png:
            bench_report.require_matplotlib()  # before the long run, not after it
        args.steps = ("train",) if args.train else bench.parse_steps(args.step)  # --train: the older spelling
        ablation = () if args.ablation is None else (
            args.steps if args.ablation == "all" else bench.parse_steps(args.ablation))
        device = _device(args.device)
        dtype = _dtype(args.dtype or ("bf16" if device == "cuda" else "fp32"))
        torch.manual_seed(0)
        subject = _subject(args, device, dtype)
    except (ValueError, FileNotFoundError, ImportError) as e:  # the user's arguments: a message, no traceback
        raise SystemExit(f"fusionpass bench: {e}") from e
    opts = bench.BenchOptions(
        steps=args.steps, batch=args.batch, seq=args.seq, new_tokens=args.new_tokens, cache=args.cache,
        mode=args.mode, device=device, rounds=args.rounds, iters=args.iters, warmup=args.warmup,
        ablation=ablation, open_cost_rules=args.open_cost_rules, settings=_settings(args),
    )
    result = bench.bench_model(subject, opts)
    command = "fusionpass " + shlex.join(args.argv)
    table = bench_report.bench_markdown(result, command)
    print(table, end="")
    if args.out:
        pathlib.Path(args.out).write_text(table)
    if args.json:
        pathlib.Path(args.json).write_text(bench_report.bench_json(result, command))
    if args.png:
        bench_report.write_bench_png(result, args.png)
    return 0


# ---------------------------------------------------------------------------------------------
# what `fusionpass bench` writes: a markdown table (stdout, --out), JSON (--json), a chart (--png,
# with matplotlib: the bench extra) of a fusionpass.bench.BenchResult

def bench_args(p) -> None:
    from fusionpass.bench import MODES_OF_COMPILE, STEPS

    what = p.add_argument_group("model")
    what.add_argument("--model", default="demo", help="a transformers model type (llama, mistral, qwen2, gpt2, "
                      "bert, bloom, falcon, gemma, ...: --list-models), a config.json (or its folder), or demo "
                      "(built in)")
    what.add_argument("--list-models", action="store_true", help="the model types transformers knows, and exit")
    what.add_argument("--task", default=None, choices=["causal-lm", "masked-lm", "seq-cls"],
                      help="the head (default: masked-lm for encoders, causal-lm for decoders, else seq-cls)")
    what.add_argument("--attn", default=None, help="attention implementation (sdpa, eager; default: transformers')")
    sizes = p.add_argument_group("sizes (default: the config's; what each changes: fusionpass/demo.py, build_hf)")
    sizes.add_argument("--layers", type=int, default=None, help="num_hidden_layers (and per-layer lists)")
    sizes.add_argument("--width", type=int, default=None,
                       help="hidden_size; heads follow it at the config's head_dim, kv heads keep their "
                       "ratio, feed-forward sizes scale with it")
    sizes.add_argument("--heads", type=int, default=None, help="query heads (head_dim = width / heads)")
    sizes.add_argument("--kv-heads", type=int, default=None, help="key/value heads")
    sizes.add_argument("--intermediate", type=int, default=None, help="feed-forward size")
    sizes.add_argument("--vocab", type=int, default=None, help="vocab_size")
    sizes.add_argument("--batch", type=int, default=4)
    sizes.add_argument("--seq", type=int, default=512, help="tokens per sequence (generate: the prompt)")
    run = p.add_argument_group("steps and timing")
    run.add_argument("--step", default="train,infer", help=f"comma-separated, of {', '.join(STEPS)}; or all "
                     "(generate: causal LMs only)")
    run.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # = --step train
    run.add_argument("--new-tokens", type=int, default=32, help="generate: greedy tokens per sequence")
    run.add_argument("--cache", default="static", choices=["static", "dynamic"], help="generate's KV cache")
    run.add_argument("--mode", default=None, choices=MODES_OF_COMPILE,
                     help="torch.compile mode, the same for plain and fusionpass")
    run.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                     help="default: bf16 on CUDA, fp32 on CPU")
    run.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    run.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median)")
    run.add_argument("--iters", type=int, default=10, help="calls per round (generate: 1)")
    run.add_argument("--warmup", type=int, default=2, help="untimed calls of each version first")
    run.add_argument("--ablation", nargs="?", const="all", default=None, metavar="STEPS",
                     help="also time each fusion that matched alone (with the matched fusions it runs after), "
                     "in every step or in the comma-separated STEPS (each is a compile per matched fusion)")
    fp = p.add_argument_group("fusionpass")
    fp.add_argument("--open-cost-rules", action="store_true",
                    help="open every cost-rule bound (tiny CPU runs; the rules are GPU measurements)")
    fp.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a fusionpass setting (fusionpass list), repeatable")
    out = p.add_argument_group("output (the markdown table always goes to stdout, progress to stderr)")
    out.add_argument("--out", default=None, metavar="FILE.md")
    out.add_argument("--json", default=None, metavar="FILE")
    out.add_argument("--png", default=None, metavar="FILE", help="a chart (needs matplotlib: the bench extra)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fusionpass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p, batch, seq):
        from fusionpass.demo import HF_FAMILIES

        p.add_argument("--model", default="demo", help="demo (built in) or an HF family: "
                       + ", ".join(HF_FAMILIES))
        p.add_argument("--layers", type=int, default=2)
        p.add_argument("--width", type=int, default=2048, help="hidden size")
        p.add_argument("--train", action="store_true", help="trace a training step")
        p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
        p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
        p.add_argument("--batch", type=int, default=batch)
        p.add_argument("--seq", type=int, default=seq)

    p = sub.add_parser("explain", help="which fusions matched where, and why others did not")
    model_args(p, 2, 16)
    p.add_argument("--fusions", default=None, help="comma-separated fusion names to enable")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("bench", help="time plain torch.compile against fusionpass on a model: training, "
                       "inference, generate (the full suite: benchmarks/suite.py)")
    bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("list", help="the fusions, what each matches and when it is selected")
    p.add_argument("--json", action="store_true")
    p.add_argument("--markdown", action="store_true", help="the README's fusion and settings tables")
    p.add_argument("--reference", action="store_true", help="docs/fusions.md")
    p.set_defaults(func=cmd_list)

    sub.add_parser("check", add_help=False,
                   help="the GPU conformance suite (fusionpass check --help); writes benchmarks/results/conformance.json")

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check"]:
        from fusionpass.conformance.__main__ import main as check

        return check(argv[1:])
    args = parser.parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
