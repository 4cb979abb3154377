"""Plain compile's side of a conformance case, told apart from fusionpass's, so that a run may take
its errors from an earlier run instead of compiling it again (`fusionpass check --reuse-plain`).

Plain torch.compile's errors on a case depend on what it compiles and runs: the graphs Dynamo
captures from the case's module, the values of its parameters, inputs and cotangents, the case's
settings, this runner, and the versions and GPU that compile and run it. `key` hashes exactly
those. Where an earlier result holds a case of the same key, its plain errors are what compiling
plain again would measure (up to the nondeterminism of a few kernels, which the 2x margin over
plain already absorbs); everywhere else plain compile runs as always. Plain compile is a large
share of a case's time (`phase_seconds` in the result files). A change to fusionpass's passes, ops
or kernels leaves every key as it was; one to code that a case's module runs (loss_only, say)
changes that case's graphs, and so its key.
"""
from __future__ import annotations

import copy
import hashlib
import json
import pathlib

import torch

# The runner's own sources: how a case is run and compared (NaN fill, cotangents, error measure).
_RUNNER = ("__init__.py", "__main__.py", "plain_side.py")


def _environment(device: str) -> list:
    import triton

    try:
        import transformers

        hf = transformers.__version__
    except ImportError:
        hf = None
    env = [torch.__version__, triton.__version__, hf, device]
    if device == "cuda":
        env += [torch.cuda.get_device_name(), torch.version.cuda, torch.backends.cudnn.version()]
    folder = pathlib.Path(__file__).parent
    env += [hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in _RUNNER]
    return env


def _fingerprint(t: torch.Tensor) -> list:
    """Shape, dtype and two sums of a tensor's values, the second weighted by position (a changed,
    moved or swapped value changes it)."""
    x = t.detach().flatten().to(torch.float64)
    weights = torch.arange(x.numel(), dtype=torch.float64, device=x.device).remainder_(251).add_(1)
    return [list(t.shape), str(t.dtype), float(x.sum()), float((x * weights).sum())]


def _graphs(module, inputs, train: bool, dynamic_dims) -> list[str]:
    """The code and input metadata of every graph Dynamo captures from one forward of a copy of
    `module` (its graph breaks included), as the runner's compiled sides see it."""
    captured = []

    def record(gm, example_inputs):
        metas = [(str(getattr(v, "shape", v)), str(getattr(v, "dtype", type(v).__name__)),
                  bool(getattr(v, "requires_grad", False))) for v in example_inputs]
        captured.append(gm.code + repr(metas))
        return gm.forward

    ins = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().clone().requires_grad_(train)
        for dim in dynamic_dims:
            if isinstance(t, torch.Tensor) and dim < t.dim() and t.shape[dim] > 1:
                torch._dynamo.mark_dynamic(t, dim)
        ins.append(t)
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(module), backend=record, dynamic=None if dynamic_dims else False)
    with torch.set_grad_enabled(train):
        compiled(*ins)
    torch._dynamo.reset()
    return captured


def key(case, module, inputs, cotangents, device: str) -> str | None:
    """What plain compile's errors on `case` depend on, as a sha256 hex digest; None where the
    graphs cannot be captured apart from the compiled sides (plain compile then runs as always).
    The capture runs the module once, with the random number generators put back afterwards."""
    try:
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
            graphs = _graphs(module, inputs, case.train, case.dynamic_dims)
    except Exception:  # noqa: BLE001 -- no key: nothing is reused
        torch._dynamo.reset()
        return None
    values = [[name, _fingerprint(t) if isinstance(t, torch.Tensor) else repr(t)]
              for name, t in module.state_dict().items()]
    values += [_fingerprint(t) if isinstance(t, torch.Tensor) else repr(t) for t in inputs]
    values += [_fingerprint(t) for t in cotangents]
    settings = [case.name, str(case.dtype), case.train, case.differentiated_outputs, list(case.dynamic_dims)]
    parts = [_environment(device), settings, values, graphs]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def known_errors(paths: list[str]) -> dict[str, dict]:
    """Plain compile's errors by key, from the cases of result files `paths` that have a key."""
    known = {}
    for path in paths:
        for r in json.loads(pathlib.Path(path).read_text())["cases"]:
            plain = (r.get("errors") or {}).get("plain")
            if r.get("plain_key") and plain:
                known[r["plain_key"]] = plain
    return known
