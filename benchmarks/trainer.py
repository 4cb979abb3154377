"""The path users train on: transformers' Trainer with `bf16=True` and `torch_compile=True`, plain
compile against `fusionpass.install()` (and Liger-Kernel's `use_liger_kernel=True`, eager, where its
wheel is installed), with fp32 weights (a model built from a config: autocast over fp32 weights)
and with bf16 weights (transformers 5's `from_pretrained` of a bf16 checkpoint).

Each run is a process of its own (peak memory is the process's, and no compile cache or Triton
kernel crosses runs); a run reports its step times (CUDA-synchronized, from a TrainerCallback), its
peak allocated memory, the seconds to its first step (compile included), the losses of every step
and what fusionpass matched. The model is Llama-3.2-1B-shaped with fewer layers; the data are fixed
random tokens with a collator's all-ones attention_mask, so the Trainer passes num_items_in_batch.

    python benchmarks/trainer.py                         # every row, writes benchmarks/results/latest/trainer.*
    python benchmarks/trainer.py --steps 200 --repeat-plain   # the loss-curve check: plain twice
    python benchmarks/trainer.py --smoke --device cpu    # the CPU test's tiny run
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WEIGHTS = ("fp32", "bf16")
SIDES = ("plain", "fusionpass", "liger")
# Llama-3.2-1B's widths (h2048, 32/8 heads of 64, ffn 8192, tied vocab 128256), 8 of its 16 layers
MODEL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
             num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
             tie_word_embeddings=True, rope_theta=500000.0)
SMOKE_MODEL = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=64)
SMOKE_SETTINGS = dict(cpu=True, rope_min_tokens=1, linear_cross_entropy_min_vocab=1, rms_norm_min_width=1)


def run_one(weights: str, side: str, steps: int, batch: int, seq: int, smoke: bool, device: str) -> dict:
    """One Trainer run in this process."""
    import torch
    import transformers

    cuda = device == "cuda"  # timing runs: correctness is the conformance suite's (NaN-filled memory there)
    matched = {}
    if side == "fusionpass":
        import fusionpass

        fusionpass.install(**(SMOKE_SETTINGS if smoke else {}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**(SMOKE_MODEL if smoke else MODEL))
    model = transformers.LlamaForCausalLM(config)
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch * steps, seq), generator=gen)
    data = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x} for x in ids]
    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-4,
            lr_scheduler_type="constant", logging_steps=1, report_to=[], bf16=True, save_strategy="no",
            torch_compile=side != "liger", use_liger_kernel=side == "liger", use_cpu=not cuda,
            dataloader_num_workers=0, disable_tqdm=True, seed=0, data_seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[Clock()])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.train()
    if side == "fusionpass":
        import fusionpass

        matched = fusionpass.stats()
    steps_ms = [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    timed = steps_ms[len(steps_ms) // 5:] or steps_ms  # past the first fifth (allocator and autotune warm-up)
    return {
        "weights": weights, "side": side, "steps": steps,
        "step_ms": round(statistics.median(timed), 2) if timed else None,
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "first_step_s": round(marks[0] - start, 1) if marks else None,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "matched": matched,
    }


def _spawn(weights, side, args) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--one", weights, side, "--json", f.name, "--steps", str(args.steps),
               "--batch", str(args.batch), "--seq", str(args.seq), "--device", args.device]
        if args.smoke:
            cmd.append("--smoke")
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return {"weights": weights, "side": side, "error": (done.stderr or done.stdout).strip().splitlines()[-1][:300]}
        return json.loads(pathlib.Path(f.name).read_text())


def _liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def spread(a: list[float], b: list[float]) -> float:
    """The largest difference of two loss curves, step by step (past the first step)."""
    return max((abs(x - y) for x, y in zip(a[1:], b[1:])), default=0.0)


def rows_of(runs: list[dict]) -> list[dict]:
    """One row per weight dtype: plain / fusionpass, memory, first steps, Liger beside them."""
    rows = []
    for weights in WEIGHTS:
        by = {}
        for r in runs:
            if r["weights"] == weights:
                by.setdefault(r["side"], []).append(r)
        plain, fused = by.get("plain", [None])[0], by.get("fusionpass", [None])[0]
        case = f"Trainer, {weights} weights"
        if not plain or not fused or "error" in plain or "error" in fused:
            errors = "; ".join(f"{r['side']}: {r['error']}" for rs in by.values() for r in rs if "error" in r)
            rows.append({"case": case, "mode": "training", "error": errors or "not run"})
            continue
        row = {"case": case, "mode": "training", "dtype": "bf16 autocast",
               "plain_ms": plain["step_ms"], "fusionpass_ms": fused["step_ms"],
               "ratio": round(plain["step_ms"] / fused["step_ms"], 3),
               "plain_peak_gib": plain["peak_gib"], "fusionpass_peak_gib": fused["peak_gib"],
               "plain_first_step_s": plain["first_step_s"], "fusionpass_first_step_s": fused["first_step_s"],
               "matched": fused["matched"],
               "loss_gap": round(spread(plain["losses"], fused["losses"]), 4)}
        if len(by["plain"]) > 1 and "error" not in by["plain"][1]:
            row["plain_loss_spread"] = round(spread(plain["losses"], by["plain"][1]["losses"]), 4)
        liger = by.get("liger", [None])[0]
        if liger:
            row.update({"liger_ms": liger.get("step_ms"), "liger_peak_gib": liger.get("peak_gib")}
                       if "error" not in liger else {"liger_error": liger["error"]})
        rows.append(row)
    return rows


COLUMNS = [("case", "case"), ("mode", "mode"), ("plain_ms", "plain torch.compile ms"), ("fusionpass_ms", "fusionpass ms"),
           ("ratio", "plain / fusionpass"), ("plain_peak_gib", "plain peak GiB"),
           ("fusionpass_peak_gib", "fusionpass peak GiB"), ("liger_ms", "Liger (eager) ms"),
           ("liger_peak_gib", "Liger peak GiB"), ("liger_error", "Liger"),
           ("plain_first_step_s", "plain first step s"), ("fusionpass_first_step_s", "fusionpass first step s"),
           ("loss_gap", "largest loss difference, plain vs fusionpass"),
           ("plain_loss_spread", "largest loss difference, plain vs plain"), ("matched", "matched")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", nargs=2, metavar=("WEIGHTS", "SIDE"), help="run one configuration in this process")
    p.add_argument("--json", help="with --one: where to write its result")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="the tiny model (a CPU test)")
    p.add_argument("--repeat-plain", action="store_true", help="plain compile twice: its own run-to-run spread")
    p.add_argument("--weights", default=",".join(WEIGHTS))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "latest"))
    p.add_argument("--rewrite", action="store_true",
                   help="write trainer.md/.json again from the runs and environment in --out-dir (no run)")
    args = p.parse_args(argv)
    if args.one:
        result = run_one(*args.one, args.steps, args.batch, args.seq, args.smoke, args.device)
        pathlib.Path(args.json).write_text(json.dumps(result))
        return 0
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import suite

    out_dir = pathlib.Path(args.out_dir)
    if args.rewrite:
        runs = json.loads((out_dir / "trainer_runs.json").read_text())
        env = json.loads((out_dir / "trainer.json").read_text())["environment"]
    else:
        sides = [s for s in SIDES if s != "liger" or _liger_installed()]
        runs = []
        for weights in args.weights.split(","):
            for side in sides + (["plain"] if args.repeat_plain else []):
                print(f"trainer: {weights} weights, {side}", flush=True)
                runs.append(_spawn(weights, side, args))
                print("  ", {k: v for k, v in runs[-1].items() if k != "losses"}, flush=True)
        env = suite.suite_environment()
        env["command"] = "python benchmarks/trainer.py " + " ".join(argv if argv is not None else sys.argv[1:])
        env["model"] = f"LlamaForCausalLM {SMOKE_MODEL if args.smoke else MODEL}, B{args.batch} S{args.seq}, AdamW"
        env["steps"] = args.steps
        (out_dir / "trainer_runs.json").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "trainer_runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    rows = rows_of(runs)
    steps = env.get("steps", runs[0].get("steps") if runs else None)
    suite.write_topic(out_dir, "trainer", env, rows, COLUMNS, footer=(
        f"Generated by benchmarks/trainer.py from trainer_runs.json: each run is its own process; step ms is "
        f"the median past the first fifth of {steps} steps; peak is torch.cuda.max_memory_allocated over the run; "
        "first step is the seconds to the first step's end, compile included, with whatever Inductor cache "
        "the machine had (a side run earlier on the same machine compiles from its cache). "
        "plain / fusionpass > 1 means fusionpass is faster."))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
