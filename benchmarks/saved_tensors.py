"""Where the saved bytes of a compiled training step go: the tensors that AOTAutograd's partition
keeps from the forward for the backward, per layer, per module and per producing op, for plain
torch.compile and for fusionpass.

    python benchmarks/saved_tensors.py [--model llama] [--layers 2] [--width 4096] [--heads 32]
        [--kv-heads 8] [--intermediate 14336] [--vocab 128256] [--batch 1] [--seq 256]
        [--device cpu|cuda] [--out benchmarks/results/memory/saved_tensors.md]

The saved tensors are read from Inductor's own partition (its `partition_fn`, wrapped; the
compile stops there): the backward graph's inputs that are not tangents. Saved parameters and graph inputs are listed
apart: they exist anyway. The sizes are those of the fake tensors, so a saved view is counted as
a tensor of its own. The bytes scale with batch x sequence; the report gives them per token.

The partition does not depend on the device, so a CPU run (fusionpass with cpu=True, the Triton
kernels under the interpreter) finds what the GPU's step saves. What the allocator does with them
(the peak) is the GPU's: `fusionpass bench --step train` measures that.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import re
import sys
from collections import Counter

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "memory" / "saved_tensors.md"


@dataclasses.dataclass
class Saved:
    name: str
    op: str  # the forward node that produces it ("input" for a graph input)
    where: str  # module path of that node ("" when unknown)
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    is_input: bool  # a parameter or graph input: saved, but alive anyway


def _module_path(node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # Dynamo's names: L['self'].model.layers[0].mlp, or L__self___model_layers_0_mlp
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path


def _op_name(node) -> str:
    if node.op == "placeholder":
        return "input"
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    if hasattr(target, "_schema"):
        name = str(target._schema.name)
        overload = getattr(target, "_overloadname", "default")
        name = name if overload == "default" else f"{name}.{overload}"
    return name


def saved_tensors(fw, bw) -> list[Saved]:
    """The backward's non-tangent inputs, described by the forward nodes that produce them."""
    produced = {n.name: n for n in fw.graph.nodes}
    out = []
    for node in bw.graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents"):
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue  # a saved SymInt
        source = produced.get(node.name, node)
        nbytes = value.numel() * value.element_size()
        out.append(Saved(node.name, _op_name(source), _module_path(source),
                         tuple(int(s) for s in value.shape), str(value.dtype).replace("torch.", ""),
                         int(nbytes), source.op == "placeholder"))
    return out


class Partitioned(Exception):
    """Raised once the partition is recorded: the compile stops there, nothing runs."""


@contextlib.contextmanager
def recording_partitions():
    """The (forward, backward) pair Inductor's partitioner returns inside the block; the compile
    then stops (`Partitioned`), so neither Inductor's code generation nor the step itself runs (a
    CPU run would otherwise execute our kernels in the interpreter at full model size)."""
    from torch._inductor import compile_fx

    original = compile_fx.partition_fn
    found: list = []

    def partition_fn(gm, joint_inputs, **kwargs):
        fw, bw = original(gm, joint_inputs, **kwargs)
        found.append((fw, bw))
        raise Partitioned()

    compile_fx.partition_fn = partition_fn
    try:
        yield found
    finally:
        compile_fx.partition_fn = original


def compiled_saves(model, ids, labels, backend) -> list[Saved]:
    """The saved tensors of the training step's compiled graph, from one fresh compile."""
    from fusionpass.explain import fresh_compile_caches

    torch._dynamo.reset()
    with fresh_compile_caches(), recording_partitions() as found:
        # one graph (fullgraph): the step's partition is the only one
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        try:
            compiled(input_ids=ids, labels=labels, use_cache=False)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if not isinstance(e.inner_exception, Partitioned):
                raise
    torch._dynamo.reset()
    if len(found) != 1:
        raise RuntimeError(f"expected one partitioned graph, got {len(found)}")
    fw, bw = found[0]
    return saved_tensors(fw, bw)


OUTSIDE = "outside the layers"


def layer_of(where: str) -> str:
    m = re.search(r"layers\.(\d+)", where)
    return f"layer {m.group(1)}" if m else OUTSIDE


def part_of(where: str) -> str:
    """The module inside a layer (self_attn, mlp, input_layernorm, ...), or the path itself."""
    m = re.search(r"layers\.\d+\.(\w+)", where)
    return m.group(1) if m else (where or "(unknown)")


def summarize(saved: list[Saved], tokens: int) -> dict:
    acts = [(layer_of(s.where), s) for s in saved if not s.is_input]
    by_layer = Counter()
    for layer, s in acts:
        by_layer[layer] += s.bytes
    layers = sorted((k for k in by_layer if k != OUTSIDE), key=lambda k: int(k.split()[1]))
    first = layers[0] if layers else None
    return {
        "activation_bytes": sum(s.bytes for _, s in acts),
        "input_bytes": sum(s.bytes for s in saved if s.is_input),
        "per_layer_bytes": {k: by_layer[k] for k in layers},
        "outside_layers_bytes": by_layer.get(OUTSIDE, 0),
        "per_token_per_layer_bytes": (sum(by_layer[k] for k in layers) / len(layers) / tokens) if layers else 0,
        # one layer's saves (the first), each tensor once: what a layer keeps for its backward
        "first_layer": [dataclasses.asdict(s) for layer, s in acts if layer == first],
        "outside": [dataclasses.asdict(s) for layer, s in acts if layer == OUTSIDE],
    }


def versions(device: str) -> dict:
    import fusionpass

    cpu = device == "cpu"
    return {
        "plain torch.compile": "inductor",
        # the default recomputes the SwiGLU product in training (swiglu_mlp_recompute_product)
        "fusionpass": fusionpass.backend(cpu=cpu),
        "fusionpass, swiglu_mlp_recompute_product=False": fusionpass.backend(
            cpu=cpu, swiglu_mlp_recompute_product=False),
        "fusionpass, swiglu_mlp_recompute_product=False + swiglu_mlp_kernel": fusionpass.backend(
            cpu=cpu, swiglu_mlp_recompute_product=False, swiglu_mlp_kernel=True),
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def report(args, results: dict, env: dict, matches: dict) -> str:
    tokens = args.batch * args.seq
    lines = [
        "# Saved tensors of a compiled training step",
        "",
        f"- date: {env['date']}; device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}",
        f"- command: `{env['command']}`",
        f"- model: {env['model']}; batch {args.batch} x seq {args.seq} = {tokens} tokens",
        "- saved tensors: the backward graph's non-tangent inputs in Inductor's partition "
        "(benchmarks/saved_tensors.py); parameters and graph inputs apart (alive anyway)",
        "",
        "| version | matched | saved activations, MiB | per layer, MiB | outside the layers, MiB | per token per layer, KiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        per_layer = ", ".join(_mib(v) for v in r["per_layer_bytes"].values())
        lines.append(f"| {name} | {matches[name] or '-'} | {_mib(r['activation_bytes'])} | {per_layer} | "
                     f"{_mib(r['outside_layers_bytes'])} | {r['per_token_per_layer_bytes'] / 1024:.1f} |")
    for name, r in results.items():
        lines += ["", f"## {name}: what one layer saves", "",
                  "| module | producing op | shape | dtype | KiB per token |", "|---|---|---|---|---|"]
        for s in sorted(r["first_layer"], key=lambda s: (-s["bytes"], s["where"])):
            lines.append(f"| {part_of(s['where'])} | `{s['op']}` | {tuple(s['shape'])} | {s['dtype']} | "
                         f"{s['bytes'] / tokens / 1024:.2f} |")
        if r["outside"]:
            lines += ["", "Outside the layers:", "", "| module | producing op | shape | dtype | MiB |",
                      "|---|---|---|---|---|"]
            for s in sorted(r["outside"], key=lambda s: -s["bytes"]):
                lines.append(f"| {s['where'] or '(unknown)'} | `{s['op']}` | {tuple(s['shape'])} | {s['dtype']} | "
                             f"{_mib(s['bytes'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import transformers

    import fusionpass
    from fusionpass.demo import build_hf

    built = build_hf(args.model, device=args.device, dtype=torch.bfloat16, layers=args.layers,
                     width=args.width, heads=args.heads, kv_heads=args.kv_heads,
                     intermediate=args.intermediate, vocab=args.vocab)
    model = built.model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
    results, matches = {}, {}
    for name, backend in versions(args.device).items():
        print(f"{name}: compiling", file=sys.stderr, flush=True)
        fusionpass.reset_stats()
        saved = compiled_saves(model, ids, ids, backend)
        results[name] = summarize(saved, args.batch * args.seq)
        stats = fusionpass.stats() if backend != "inductor" else {}
        matches[name] = ", ".join(f"{k} {v}" for k, v in sorted(stats.items()))
        print(f"{name}: {_mib(results[name]['activation_bytes'])} MiB saved", file=sys.stderr, flush=True)
    env = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "CPU (the partition only)",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "command": "python benchmarks/saved_tensors.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": built.describe(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(args, results, env, matches))
    args.out.with_suffix(".json").write_text(json.dumps(
        {"env": env, "matches": matches, "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
