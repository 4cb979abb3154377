"""What the Trainer-path probes share (cache_keys.py, trainer_profile.py, trainer_gaps.py):
benchmarks/trainer.py loaded by path (benchmarks/ is no package), the arguments of one Trainer run,
a callback that profiles some of its steps, a child process that runs one configuration on its own
(the probe's own `--run OUT` mode) and the result written and printed."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_trainer():
    spec = importlib.util.spec_from_file_location("trainer_bench", ROOT / "benchmarks" / "trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One Trainer run's model and batch (benchmarks/trainer.py's run_one)."""
    p.add_argument("--weights", default="bf16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--smoke", action="store_true", help="the tiny model")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])


def forwarded(args: argparse.Namespace) -> list[str]:
    """add_arguments' values as command-line arguments for a child process."""
    return (["--weights", args.weights, "--batch", str(args.batch), "--seq", str(args.seq), "--device", args.device]
            + (["--smoke"] if args.smoke else []))


def add_profile_arguments(p: argparse.ArgumentParser, sides: str, profile_steps: int) -> None:
    """A profiling probe's arguments: which sides, which steps, where the result goes, and the
    internal ones of its child processes (one side each)."""
    p.add_argument("--sides", default=sides)
    p.add_argument("--first", type=int, default=3, help="steps before the profiled ones (compile, warm-up)")
    p.add_argument("--profile-steps", type=int, default=profile_steps)
    p.add_argument("--out", default=None)
    p.add_argument("--run", default=None, help="(internal) one side in this process: write its result here")
    p.add_argument("--side", default=None, help="(internal) with --run")


def each_side(script: str, args: argparse.Namespace, extra=lambda side: []) -> dict[str, dict] | None:
    """What `script --run` wrote for each of args.sides, each side in a child process of its own
    (with `extra(side)` arguments), or None where one failed."""
    sides = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side in args.sides.split(","):
            raw = child(script, pathlib.Path(tmp) / f"{side}.json",
                        ["--side", side, "--first", str(args.first), "--profile-steps", str(args.profile_steps),
                         *extra(side), *forwarded(args)])
            if raw is None:
                return None
            sides[side] = raw
    return sides


def profiled_steps(first: int, count: int, cuda: bool, done):
    """A TrainerCallback that profiles steps [first, first + count) (host ops, and on CUDA its
    kernels too) and then calls done(profiler), the GPU synchronized."""
    import torch
    import transformers

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])

    class Profile(transformers.TrainerCallback):
        prof = None

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == first:
                self.prof = torch.profiler.profile(activities=activities)
                self.prof.start()

        def on_step_end(self, args, state, control, **kw):
            if self.prof is not None and state.global_step == first + count:
                if cuda:
                    torch.cuda.synchronize()
                self.prof.stop()
                done(self.prof)
                self.prof = None

    return Profile()


def child(script: str, out: pathlib.Path, arguments: list[str], env: dict | None = None) -> dict | None:
    """`script --run out *arguments` in a process of its own: what it wrote to `out`, or None after
    printing the end of its output where it failed."""
    done = subprocess.run([sys.executable, script, "--run", str(out), *arguments], cwd=ROOT,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if done.returncode != 0:
        print((done.stderr or done.stdout)[-3000:], file=sys.stderr)
        return None
    return json.loads(out.read_text())


def report(result: dict, out: str | None) -> int:
    """The probe's result as JSON: written to `out` where given, and printed."""
    text = json.dumps(result, indent=1)
    if out:
        pathlib.Path(out).write_text(text + "\n")
    print(text)
    return 0
