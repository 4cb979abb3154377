"""`fusionpass explain | bench | list`."""
from __future__ import annotations

import argparse
import json
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


def cmd_bench(args) -> int:
    import fusionpass
    from fusionpass.bench import inference_step, time_interleaved, training_step
    from fusionpass.explain import fresh_compile_caches

    model, ids = _model_and_inputs(args)
    device = _device(args.device)
    fusionpass.reset_stats()
    torch._dynamo.reset()
    plain = torch.compile(model)
    fused = torch.compile(model, backend=fusionpass.backend(cpu=device == "cpu"))
    leaves = [p for p in model.parameters() if p.requires_grad]
    if args.train:
        steps = {name: training_step(fn, ids, labels=ids, leaves=leaves)
                 for name, fn in (("torch.compile", plain), ("fusionpass", fused))}
    else:
        steps = {"torch.compile": inference_step(plain, ids), "fusionpass": inference_step(fused, ids)}
    with fresh_compile_caches():  # compile for real, so the match counts below are this model's
        for run in steps.values():
            run()
    ms = time_interleaved(steps, device, rounds=args.rounds, iters=args.iters)
    tokens = args.batch * args.seq
    what = "training step" if args.train else "forward"
    print(f"{args.model} {what}, batch {args.batch} x seq {args.seq}, {args.dtype}, {device}")
    for name, t in ms.items():
        print(f"  {name:<14} {t:9.3f} ms  {tokens / t * 1e3:12.0f} tokens/s")
    print(f"  speedup {ms['torch.compile'] / ms['fusionpass']:.3f}x")
    print(f"  matches {fusionpass.stats()}")
    return 0


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

    p = sub.add_parser("bench", help="time plain torch.compile against fusionpass on a model (the full suite: benchmarks/suite.py)")
    model_args(p, 4, 512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
