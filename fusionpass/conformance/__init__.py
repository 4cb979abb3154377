"""The GPU conformance suite: every fusion, variant and route, checked on the device it runs on.

    fusionpass check                    # every case, on CUDA; writes benchmarks/results/conformance.json
    fusionpass check --only rope --jobs 1 --out /tmp/c.json

A case is a small module written the way models write a pattern (or a small real HF model), its
inputs, the dtype, whether to differentiate, and the matches it must produce. Each case runs three
times on one device, from the same parameters and inputs:
  - a float64 eager reference of the same module (parameters and inputs upcast from the case's
    dtype, so all three compute the same function);
  - plain torch.compile (Inductor without our pass);
  - torch.compile with the fusionpass backend (and the case's config).
Every output and, in training, the gradient of every floating input and parameter (through fixed
random cotangents) is compared with the reference by ||x - ref|| / max(||ref||, ||x||). A case fails where
fusionpass's error on some tensor exceeds max(2 x plain compile's on that tensor, a floor of about
the dtype's unit roundoff; for whole models also 2 x eager PyTorch's in the same dtype), where anything is not finite, or where the matches differ from the
expected ones (a route that silently stops matching is a failure too).

It runs with `torch.utils.deterministic.fill_uninitialized_memory = True` and deterministic
algorithms (warn only), so a buffer read or returned before anything wrote it shows up as NaN.

A fusion's cases live in its folder, `fusionpass/fusions/<fusion>/cases.py` (a `CASES` list), so
adding them edits nothing here; what several fusions' cases are built from is in
`fusionpass.conformance.builders` and `fusionpass.conformance.attention_layers`. Two modules here
hold the cases that belong to no one fusion: `cases_models` (small real HF models, per model family)
and `cases_autocast` (the AMP twins of every other module's cases). The gate that the CPU test
suite applies to the committed result file is `fusionpass.conformance.gate`.
This package is not part of `fusionpass.passes.source_digest()`: it decides no compiled code.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import math
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from fusionpass import fusions
from fusionpass.conformance import plain_side

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Below these relative errors a difference is rounding whatever plain compile's error is (about
# one unit roundoff of the dtype; fp32 at TF32-free float32 arithmetic).
FLOOR = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 2e-5}
# The cases in no fusion's folder: whole HF models (per model family, each matching several
# fusions) and the AMP twins of every other module's cases.
MODEL_CASES = "fusionpass.conformance.cases_models"
AUTOCAST_CASES = "fusionpass.conformance.cases_autocast"


@dataclasses.dataclass(frozen=True)
class Case:
    """One conformance case. `make(dtype, device)` returns (module, inputs) already in their final
    dtypes and on `device`; the runner seeds torch before calling it, so it may draw parameters and
    inputs at random (never zeros). Floating inputs require grad in training."""

    name: str  # unique, "<fusion>/<variant>/<what>/<dtype>/<shape>/<train|infer>"
    fusion: str
    # this case must produce at least one match of (fusion, variant); a whole-model case has the
    # fusion "model", its model's name as the variant, and only `expect` to meet
    variant: str
    make: Callable[[torch.dtype, str], tuple[nn.Module, tuple]]
    dtype: torch.dtype
    train: bool
    # exact match counts per fusion (fusionpass.stats()); fusions not listed must not match
    expect: dict[str, int]
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # fusionpass.backend(**config)
    # For modules with randomness (dropout): kwargs for the reference forward computed from the
    # outputs of the run being judged (e.g. the keep mask read off them), or None.
    reference_kwargs: Callable[[tuple[torch.Tensor, ...], tuple], dict] | None = None
    floor: float | None = None  # overrides FLOOR[dtype] (say why where used)
    # Also run the module eagerly in its dtype and allow fusionpass twice eager PyTorch's error
    # (whole models, which the issue asks to check against eager): a mask rewrite hands SDPA a
    # mask-free call, and PyTorch then picks another of its own kernels, whose bf16 dq/dk are those
    # of eager PyTorch without the mask but larger than plain compile's with it (BERT training;
    # benchmarks/results/2026-12-01-h200-conformance.md as of 67836ab).
    eager_baseline: bool = False
    # A case of a fallback: where set, (fusion, variant) must not match, and some near miss (of
    # this fusion or one it follows, e.g. attention for q's rotation inside it) must contain this text:
    # the cost rule or guard that keeps a route out on CUDA. `expect` then holds what matches
    # instead. CPU graphs may take such routes, so --device cpu skips these cases.
    near_miss: str | None = None
    # In training, the first this-many outputs get cotangents (None: every floating output): a
    # Trainer step backpropagates the loss alone, while the logits it returns go unread
    differentiated_outputs: int | None = None
    # Input dims (e.g. (0, 1): batch and sequence) marked dynamic on both sides, as serving and
    # varying lengths compile (dims of size 1 stay static, as Dynamo keeps them): the cost rules then
    # decide over the sizes' ranges (fusionpass.cost.Sizes)
    dynamic_dims: tuple[int, ...] = ()


def case_modules(twins: bool = True) -> list[ModuleType]:
    """Every module with a `CASES` list: each fusion folder's `cases.py`, the whole models' and,
    with `twins`, the AMP twins of all of those (which cases_autocast builds from the rest)."""
    central = [MODEL_CASES, *([AUTOCAST_CASES] if twins else [])]
    return [*fusions.modules("cases"), *map(importlib.import_module, central)]


def all_cases() -> list[Case]:
    cases = []
    for module in case_modules():
        cases.extend(module.CASES)
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate case names: {sorted(dup)}")
    return cases


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


# ---------------------------------------------------------------------------------------------
# running one case


def _flatten(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = [v for v in out.values() if v is not None]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flatten(o)]
    return []


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


@dataclasses.dataclass
class _Run:
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    matches: dict[str, int] | None = None
    variants: dict[str, int] | None = None
    searches: dict[str, int] | None = None


def _execute(module, inputs, train, cotangents, forward_kwargs=None, differentiated=None, dynamic_dims=()) -> _Run:
    ins = []
    for t in inputs:
        if _floating(t):
            t = t.detach().clone().requires_grad_(train)
        for dim in dynamic_dims:
            if isinstance(t, torch.Tensor) and dim < t.dim() and t.shape[dim] > 1:
                torch._dynamo.mark_dynamic(t, dim)
        ins.append(t)
    module.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        out = module(*ins, **(forward_kwargs or {}))
        outs = [o for o in _flatten(out) if _floating(o)]
        grads = {}
        if train:
            pairs = [(o, c) for o, c in zip(outs[:differentiated], cotangents) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [c.to(o.dtype) for o, c in pairs])
            grads = {f"input{i}": t.grad for i, t in enumerate(ins) if _floating(t)}
            # (a compiled module names its parameters "_orig_mod.<name>")
            grads.update({name.removeprefix("_orig_mod."): p.grad for name, p in module.named_parameters()
                          if p.requires_grad})
    return _Run([o.detach() for o in outs], grads)


def run_compiled(case: Case, module, inputs, cotangents, backend) -> _Run:
    """One compiled side of `case`: a copy of `module` under `backend`, run as the case says (the
    runner's plain and fusionpass sides, and plain_side's graph capture)."""
    return _execute(_compiled(copy.deepcopy(module), backend, bool(case.dynamic_dims)), inputs, case.train,
                    cotangents, differentiated=case.differentiated_outputs, dynamic_dims=case.dynamic_dims)


def _compiled(module, backend, marked_dynamic=False):
    torch._dynamo.reset()
    # dynamic=False would specialize the dims marked dynamic too; None honours the marks
    return torch.compile(module, backend=backend, dynamic=None if marked_dynamic else False)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / max(||ref||, ||x||): the relative error where ref is not negligible, and
    about 1 for noise around a reference that is mathematically 0 (e.g. the gradient of a key
    bias, which softmax cancels), for plain compile and fusionpass alike; within [0, 2]."""
    x, ref = x.double(), ref.double()
    if x.shape != ref.shape:
        return math.inf
    if not torch.isfinite(x).all():
        return math.nan
    scale = torch.maximum(ref.norm(), x.norm()).clamp_min(1e-300)
    return ((x - ref).norm() / scale).item()


def _compare(run: _Run, ref: _Run) -> dict[str, float]:
    errs = {f"out{i}": _rel(o, r) for i, (o, r) in enumerate(zip(run.outputs, ref.outputs))}
    if len(run.outputs) != len(ref.outputs):
        errs["outputs"] = math.inf
    for name, r in ref.grads.items():
        g = run.grads.get(name)
        if r is None and g is None:
            continue
        errs[f"grad:{name}"] = math.inf if (g is None or r is None) else _rel(g, r)
    return errs


def run_case(case: Case, device: str, plain: bool = True, known_plain: dict | None = None) -> dict:
    """Run one case; a JSON-able result (pass, reason, errors, matches). Whatever raises is a
    failed case, reported with its message.

    The result holds `plain_key` (fusionpass.conformance.plain_side). Where `known_plain` (plain
    compile's errors by key, from earlier results) has this case's key, those errors stand for plain
    compile's and it is not compiled again; the result says so (`plain_reused`).

    `plain=False` leaves plain compile's side out, for a case with an eager baseline: fusionpass
    is then held to float64 within twice eager's error (or the floor), and not also allowed twice
    plain compile's, so the check only gets stricter. The CPU census runs so, as plain compile was
    half its time; GPU conformance always runs both sides."""
    if not plain and not case.eager_baseline:
        raise ValueError(f"{case.name}: without plain compile a case needs its eager baseline")
    try:
        return _run_case(case, device, plain, known_plain or {})
    except Exception as e:  # noqa: BLE001
        return {**_header(case), "passed": False,
                "reason": f"raised {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    finally:
        torch._dynamo.reset()


def _header(case: Case) -> dict:
    return {"name": case.name, "fusion": case.fusion, "variant": case.variant, "dtype": dtype_name(case.dtype),
            "train": case.train, "expect": case.expect,
            **({"near_miss": case.near_miss} if case.near_miss is not None else {})}


def _run_case(case: Case, device: str, with_plain: bool, known_plain: dict) -> dict:
    import fusionpass
    from fusionpass.passes import STATISTICS
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    clock = [time.perf_counter()]

    def lap() -> float:  # seconds since the last lap (where a case's time goes: compiling, mostly)
        clock.append(time.perf_counter())
        return round(clock[-1] - clock[-2], 2)

    torch.manual_seed(0)
    module, inputs = case.make(case.dtype, device)
    module.train(case.train)
    ref_module = copy.deepcopy(module).to(torch.float64)
    ref_inputs = tuple(t.double() if _floating(t) else t for t in inputs)

    # cotangents: drawn once in float64 from the reference's output shapes
    with torch.no_grad():
        probe = [o for o in _flatten(ref_module(*ref_inputs)) if _floating(o)]
    gen = torch.Generator(device=device).manual_seed(1)
    cotangents = [torch.randn(o.shape, dtype=torch.float64, device=device, generator=gen) for o in probe]

    def reference(run: _Run | None) -> _Run:
        kwargs = case.reference_kwargs(tuple(run.outputs), inputs) if case.reference_kwargs and run else {}
        return _execute(copy.deepcopy(ref_module), ref_inputs, case.train, cotangents, kwargs,
                        case.differentiated_outputs)

    # without reference_kwargs the reference is one function of the case's values: made once
    fixed = reference(None) if case.reference_kwargs is None else None

    def reference_of(run: _Run) -> _Run:
        return fixed if fixed is not None else reference(run)

    run_with = functools.partial(run_compiled, case, module, inputs, cotangents)

    result = _header(case)
    plain_key = (plain_side.key(case, inputs, cotangents, fixed, device, run_with)
                 if with_plain and fixed is not None else None)
    reused = known_plain.get(plain_key)
    seconds = {"setup": lap()}
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        if with_plain and reused is None:
            plain = run_with("inductor")
            seconds["plain"] = lap()
        fusionpass.reset_stats()
        backend = fusionpass.backend(**case.config)
        fused = run_with(backend)
        fused.matches = fusionpass.stats()
        fused.variants = {f"{f}/{v}": n for (f, v), n in fusionpass.stats(variants=True).items()}
        fused.searches = {f"{f}/{v}": n for (f, v), n in STATISTICS.searches.items()}
        near_misses = sorted({f"{f}: {why}" for f, _, why in STATISTICS.near_misses})
        if device == "cuda":
            torch.cuda.synchronize()
        seconds["fusionpass"] = lap()

    plain_errs = reused if reused is not None else _compare(plain, reference_of(plain)) if with_plain else {}
    fused_errs = _compare(fused, reference_of(fused))
    eager_errs = {}
    if case.eager_baseline:
        eager = _execute(copy.deepcopy(module), inputs, case.train, cotangents,
                         differentiated=case.differentiated_outputs)
        eager_errs = _compare(eager, reference_of(eager))
    seconds["references"] = lap()
    floor = case.floor if case.floor is not None else FLOOR[case.dtype]
    worst, reasons = None, []
    for name, err in fused_errs.items():
        base = plain_errs.get(name, math.nan)
        bound = max(2 * base, floor) if math.isfinite(base) else floor
        if math.isfinite(eager_errs.get(name, math.nan)):
            bound = max(bound, 2 * eager_errs[name])
        ratio = err / bound if math.isfinite(err) else math.inf
        if worst is None or ratio > worst[3]:
            worst = (name, err, base, ratio)
        if not math.isfinite(err) or err > bound:
            eager_note = f", eager {eager_errs[name]:.2e}" if name in eager_errs else ""
            reasons.append(f"{name}: {err:.2e} vs plain {base:.2e}{eager_note}")
    matches = {k: v for k, v in fused.matches.items() if v}
    if matches != case.expect:
        reasons.append(f"matches {matches} != expected {case.expect}")
    if case.near_miss is not None:
        if fused.variants.get(f"{case.fusion}/{case.variant}"):
            reasons.append(f"{case.fusion}/{case.variant} matched where it must not")
        if not any(case.near_miss in m for m in near_misses):
            reasons.append(f"no near miss with {case.near_miss!r} (near misses: {near_misses})")
    elif case.fusion != "model" and not fused.variants.get(f"{case.fusion}/{case.variant}"):
        reasons.append(f"no {case.fusion}/{case.variant} match (variants: {fused.variants})")
    result.update(
        passed=not reasons, reason="; ".join(reasons),
        matches=matches, variants=fused.variants, searches=fused.searches, near_misses=near_misses,
        phase_seconds=seconds, **({"plain_key": plain_key} if plain_key else {}),
        **({"plain_reused": True} if reused is not None else {}),
        worst={"tensor": worst[0], "fusionpass": worst[1], "plain": worst[2]} if worst else None,
        errors={"fusionpass": fused_errs, "plain": plain_errs, **({"eager": eager_errs} if eager_errs else {})},
    )
    return result

