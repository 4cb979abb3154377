"""Side-by-side timing: versions run interleaved (A B A B ...) in one process, medians reported.

Used by `fusionpass bench` and by the benchmark suite (benchmarks/suite.py).
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(
    fns: dict[str, Callable[[], object]], device: str, rounds: int = 5, iters: int = 10, warmup: int = 3,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Median milliseconds per call of each fn; each round times every fn once, in turn.
    `on_round(i)` is called before round i (0-based) starts: progress for long runs."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds):
        if on_round is not None:
            on_round(i)
        for name, fn in fns.items():
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                end.synchronize()
                samples[name].append(start.elapsed_time(end) / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                samples[name].append((time.perf_counter() - t0) * 1e3 / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def spread(fns: dict[str, Callable[[], object]], device: str, **kw) -> dict[str, tuple[float, float]]:
    """(median, max/min - 1) per fn over rounds: how much to trust a difference."""
    raw = {name: [] for name in fns}
    for _ in range(kw.pop("repeats", 3)):
        for name, ms in time_interleaved(fns, device, **kw).items():
            raw[name].append(ms)
    return {n: (statistics.median(v), max(v) / min(v) - 1) for n, v in raw.items()}


def peak_memory(fn: Callable[[], object]) -> int:
    """Peak bytes allocated on the GPU above what was allocated before the call."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def kernel_time(fn: Callable[[], object], iters: int = 10) -> float:
    """GPU kernel milliseconds per call: the profiler's summed device self time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    # Only the kernels themselves: an op's entry also carries the device time of the kernels it
    # launched, so summing every entry would count each kernel twice.
    total_us = sum(
        e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    return total_us / 1e3 / iters


def floating_outputs(out) -> list[torch.Tensor]:
    """The floating tensors of a module's output (a tensor, a tuple of them, or an HF ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in floating_outputs(o)]
    return []


def training_step(fn: Callable, *args, leaves=(), **kwargs) -> Callable[[], object]:
    """One forward and backward of `fn(*args, **kwargs)`: the `loss` of an HF output, else every
    floating output against fixed random cotangents (made on the first call, so the timed calls
    do not draw them). `leaves` (inputs and parameters) get their .grad set to None first: assigned,
    not accumulated, so the step has no extra add kernels."""
    cotangents: list[torch.Tensor] = []

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*args, **kwargs)
        loss = getattr(out, "loss", None)
        if loss is not None:
            loss.backward()
            return out
        outs = [o for o in floating_outputs(out) if o.requires_grad]
        if not cotangents:
            gen = torch.Generator(device=outs[0].device).manual_seed(0)
            cotangents.extend(torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outs)
        torch.autograd.backward(outs, cotangents)
        return out

    return step


def inference_step(fn: Callable, *args, **kwargs) -> Callable[[], object]:
    def step():
        with torch.no_grad():
            return fn(*args, **kwargs)

    return step


def first_call_seconds(fn: Callable[[], object], device: str) -> float:
    """Wall seconds of one call (the first call of a compiled step is its compile)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def warm_up_compiler(device: str) -> None:
    """Compile something small first, so neither side's compile time pays for importing and
    initializing Inductor and Triton."""
    f = torch.compile(lambda t: torch.nn.functional.silu(t) * 2)
    f(torch.randn(64, device=device))


def environment() -> dict:
    """What a committed result table must say about where it was measured."""
    import triton

    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
    }
