"""`fusionpass bench`'s reports of a BenchResult: the markdown table, the JSON and the PNG chart."""
from __future__ import annotations

import json
import os
import platform

import torch

BENCH_COLUMNS = (
    ("step", "step"),
    ("version", "compiled with"),
    ("ms", "ms"),
    ("tokens_per_s", "tokens/s"),
    ("speedup", "vs torch.compile"),
    ("peak_mib", "peak MiB"),
    ("first_call_s", "first call s"),
    ("matches", "matches"),
)


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{device} ({platform.machine()}, {os.cpu_count()} cores)"


def _bench_header(result, command: str) -> dict:
    """Where and how it was measured: date, device, versions, the command."""
    from fusionpass.bench import environment

    env = environment()
    env.pop("gpu", None)  # `device` names it, CPU runs too
    env["device"] = _device_name(result.options.device)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - the built-in demo model needs no transformers
        pass
    env["command"] = command
    return env


def _bench_cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "matches":
        return ", ".join(f"{f} {n}" for f, n in value.items()) or "none"
    if key == "speedup":
        return f"{value:.3f}x"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    return str(value).replace("|", "\\|")


def _bench_cells(row: dict) -> list[str]:
    return ["" if row["version"] == "torch.compile" and key == "matches" else _bench_cell(key, row.get(key))
            for key, _ in BENCH_COLUMNS]


def bench_markdown(result, command: str) -> str:
    env = _bench_header(result, command)
    opts = result.options
    versions = ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("date", "device", "command"))
    lines = [
        f"fusionpass bench, {env['date']}, {env['device']}, {versions}: `{command}`",
        "",
        f"- model: {result.subject.description}; config: {result.subject.source}",
    ]
    if result.subject.changes:
        lines.append(f"- overrides changed: {'; '.join(result.subject.changes)}")
    dtype = str(next(result.subject.model.parameters()).dtype).removeprefix("torch.")
    shape = f"batch {opts.batch} x seq {opts.seq}"
    if any(r["step"] == "generate" for r in result.rows):
        shape += f"; generate: {opts.new_tokens} greedy tokens after the seq-long prompt, {opts.cache} cache"
    lines.append(f"- {shape}; {dtype}; torch.compile mode {opts.mode or 'default'} on every version; "
                 f"{opts.warmup} warm-up + {opts.rounds} interleaved rounds x {opts.iters} calls "
                 "(generate: 1 call), median")
    settings = (["every cost-rule bound opened (--open-cost-rules)"] if opts.open_cost_rules else []) + [
        f"{k}={v}" for k, v in opts.settings.items()]
    if settings:
        lines.append("- fusionpass settings: " + ", ".join(settings))
    lines += [f"- {note}" for note in result.notes]
    lines += ["", "| " + " | ".join(title for _, title in BENCH_COLUMNS) + " |", "|" + "---|" * len(BENCH_COLUMNS)]
    lines += ["| " + " | ".join(_bench_cells(row)) + " |" for row in result.rows]
    lines += ["", "train: forward + loss + backward (no optimizer); infer: forward without grad; generate: "
              "tokens/s counts the new tokens. vs torch.compile: plain ms / this ms (above 1x: faster). "
              "first call s: its compile and one step, caches off, in the table's order. "
              "matches: the fusions fusionpass made in this version's compile."
              + (" only X: fusionpass with fusion X alone (+ the matched fusions it runs after, whose "
                 "rewrites it reads)." if any(r["version"].startswith("only ") for r in result.rows) else "")]
    return "\n".join(lines) + "\n"


def bench_json(result, command: str) -> str:
    opts = result.options
    return json.dumps({
        "environment": _bench_header(result, command),
        "model": {"description": result.subject.description, "task": result.subject.task,
                  "class": type(result.subject.model).__name__, "config": result.subject.source,
                  "changes": result.subject.changes},
        "options": {"steps": list(opts.steps), "batch": opts.batch, "seq": opts.seq,
                    "new_tokens": opts.new_tokens, "cache": opts.cache, "mode": opts.mode or "default",
                    "device": opts.device, "rounds": opts.rounds, "iters": opts.iters, "warmup": opts.warmup,
                    "ablation": list(opts.ablation), "open_cost_rules": opts.open_cost_rules,
                    "settings": opts.backend_settings()},
        "notes": result.notes,
        "rows": result.rows,
    }, indent=1) + "\n"


def require_matplotlib():
    """matplotlib's pyplot (Agg), or an error that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--png needs matplotlib: pip install 'fusionpass[bench]' (or pip install matplotlib)") from e
    return plt


def write_bench_png(result, path) -> None:
    """Speed against plain torch.compile and peak memory, one bar per row."""
    plt = require_matplotlib()
    rows = result.rows
    labels = [f"{r['step']}: {r['version']}" for r in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.8), sharey=True)
    colors = ["tab:gray" if r["version"] == "torch.compile" else "tab:blue" for r in rows]
    y = range(len(rows))
    speed.barh(y, [r["speedup"] for r in rows], color=colors)
    speed.axvline(1.0, color="black", linewidth=0.8)
    speed.set_yticks(list(y), labels)
    speed.invert_yaxis()
    speed.set_xlabel("plain torch.compile ms / this ms (above 1: faster)")
    if any(r["peak_mib"] is not None for r in rows):
        memory.barh(y, [r["peak_mib"] or 0 for r in rows], color=colors)
        memory.set_xlabel("peak MiB above the step's start (CUDA)")
    else:
        memory.text(0.5, 0.5, "peak memory: CUDA only", ha="center", va="center", transform=memory.transAxes)
        memory.set_xticks([])
    fig.suptitle(f"fusionpass bench: {result.subject.description}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
