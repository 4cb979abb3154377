"""Plain compile's side of a conformance case, told apart from fusionpass's, so that a run may take
its errors from an earlier run instead of compiling it again (`fusionpass check --reuse-plain`).

Plain torch.compile's errors on a case depend on what it compiles and runs and on what they are
measured against: the graphs Dynamo captures from the case's module with the values of every graph
input, the case's inputs and cotangents, its float64 reference's outputs and gradients, its
settings, this runner, the process's numerics settings and Inductor's config, and the versions and
GPU that compile and run it. `key` hashes exactly those. Where an earlier result holds a case of the same key, its plain errors are what compiling
plain again would measure (up to the nondeterminism of a few kernels, which the 2x margin over
plain already absorbs); everywhere else plain compile runs as always. Plain compile is a large
share of a case's time (`phase_seconds` in the result files). A change to fusionpass's passes, ops
or kernels leaves every key as it was; one to code that a case's module runs (loss_only, say)
changes that case's graphs, and so its key.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

import torch

# The runner's own sources: how a case is run and compared (NaN fill, cotangents, error measure).
_RUNNER = ("__init__.py", "__main__.py", "plain_side.py")
# Environment variables that change what torch compiles or how it computes (not where it keeps files:
# a cache folder may differ from run to run).
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_", "TRITON_", "NVIDIA_TF32", "CUBLAS_", "CUDNN_")
_ENV_PLACES = ("CACHE", "DIR", "HOME", "PATH")
# Same-size integer views of each dtype's bits: the fingerprint sums bits, exactly.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _environment(device: str) -> list:
    import triton
    from torch._inductor import config as inductor_config

    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = None
    env = [torch.__version__, triton.__version__, hf, device]
    if device == "cuda":
        env += [torch.cuda.get_device_name(), torch.version.cuda, torch.backends.cudnn.version()]
    # the numerics settings of this process and the compilers' configuration
    env += [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
            torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory,
            sorted((k, v) for k, v in os.environ.items()
                   if k.startswith(_ENV_PREFIXES) and not any(p in k for p in _ENV_PLACES)),
            sorted((k, repr(v)) for k, v in inductor_config.get_config_copy().items())]
    folder = pathlib.Path(__file__).parent
    env += [hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in _RUNNER]
    return env


def _fingerprint(t: torch.Tensor) -> list:
    """Shape, strides, dtype and two exact sums of a tensor's bits, the second weighted by position
    (a changed, moved or swapped value changes it; NaN and inf are values like any other)."""
    x = t.detach()
    bits = x.contiguous().view(_BITS[x.element_size()]) if x.dtype != torch.bool else x
    bits = bits.flatten().to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device).remainder_(65521).add_(1)
    return [list(t.shape), list(t.stride()), t.storage_offset(), str(t.dtype),
            int(bits.sum()), int((bits * weights).sum())]


def _graphs(run_with) -> list[list]:
    """The code of every graph Dynamo captures from the case's module (its graph breaks included),
    through the runner's own path for a compiled side (`run_with(backend)`), with the fingerprint of
    every graph input: parameters, buffers and tensors the module keeps are graph inputs too."""
    captured = []

    def record(gm, example_inputs):
        captured.append([gm.code, [_fingerprint(v) if isinstance(v, torch.Tensor) else repr(v)
                                   for v in example_inputs]])
        return gm.forward

    run_with(record)
    torch._dynamo.reset()
    return captured


def key(case, inputs, cotangents, reference, device: str, run_with) -> str | None:
    """What plain compile's errors on `case` depend on, as a sha256 hex digest, given the float64
    reference they are measured against (`reference`: its outputs and gradients) and the runner's
    path for a compiled side (`run_with(backend)`, run here once with a backend that records). None where that
    cannot be told (plain compile then runs as always): a case whose reference is made from the
    judged run's outputs (`reference_kwargs`, dropout), or graphs that cannot be captured apart from
    the compiled sides. The random number generators are put back after the capture."""
    if case.reference_kwargs is not None:
        return None
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
            graphs = _graphs(run_with)
        values = [_fingerprint(t) if isinstance(t, torch.Tensor) else repr(t) for t in inputs]
        values += [_fingerprint(t) for t in cotangents]
        values += [_fingerprint(t) for t in reference.outputs]
        values += [[name, None if g is None else _fingerprint(g)] for name, g in sorted(reference.grads.items())]
        settings = [case.name, str(case.dtype), case.train, case.differentiated_outputs, list(case.dynamic_dims)]
        parts = [_environment(device), settings, values, graphs]
    except Exception:  # noqa: BLE001 -- no key: nothing is reused
        torch._dynamo.reset()
        return None
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def known_errors(paths: list[str]) -> dict[str, dict]:
    """Plain compile's errors by key, from the cases of result files `paths` (a run's result, or one
    worker's part) that have a key. ValueError, naming the file, where one cannot be read."""
    known = {}
    for path in paths:
        try:
            data = json.loads(pathlib.Path(path).read_text())
            cases = data["cases"] if isinstance(data, dict) else data
            for r in cases:
                plain = (r.get("errors") or {}).get("plain")
                if r.get("plain_key") and plain:
                    known[r["plain_key"]] = plain
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"--reuse-plain {path}: not a conformance result ({type(e).__name__}: {e})") from e
    return known
