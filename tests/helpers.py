"""Shared utilities of the pattern, model and API tests.

Match counts are only right when our pass really runs on every compile: an FX-graph-cache or
AOTAutograd-cache hit serves compiled code without running the pre-grad pass (and so without
counting). `compiling()` therefore resets Dynamo and our statistics and disables those caches for
the duration of a compile *and its first call* (torch.compile compiles lazily, on the first call).

It also sets `cpp.max_horizontal_fusion_size = 1`: Inductor's CPU backend miscompiles some bf16
training graphs otherwise (`conflicting declaration ... tmp_acc0_vec`), with or without our pass.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile

import torch
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config

import fusionpass
from fusionpass import config as config_mod
from fusionpass.passes import STATISTICS, PreGradFusionPass

FUSION = "rms_norm_residual"

# relative tolerances per dtype (compared with eager or with plain torch.compile)
# the fusions of the attention rewrites (`fusions=ATTENTION`), and the one that reports each variant
ATTENTION = ["flash_attention", "sdpa_mask", "sdpa_runtime_check"]


def attention_key(variant: str) -> tuple[str, str]:
    """(fusion, variant) as stats() counts an attention variant."""
    if variant.endswith("_if_unpadded"):
        return "sdpa_runtime_check", variant
    if variant in ("causal_mask", "none_mask"):
        return "sdpa_mask", variant
    return "flash_attention", variant


RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@contextlib.contextmanager
def compiling(fresh_cache_dir: bool = False):
    """Every compile inside runs our pass: Dynamo reset, statistics reset, FX-graph and autograd
    caches off (and, with `fresh_cache_dir`, an empty Inductor cache directory)."""
    with contextlib.ExitStack() as stack:
        if fresh_cache_dir:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="fusionpass-inductor-"))
            old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
            stack.callback(
                lambda: os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
                if old is None
                else os.environ.__setitem__("TORCHINDUCTOR_CACHE_DIR", old)
            )
        stack.enter_context(
            inductor_config.patch({"fx_graph_cache": False, "cpp.max_horizontal_fusion_size": 1})
        )
        if hasattr(functorch_config, "enable_autograd_cache"):
            stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        torch._dynamo.reset()
        fusionpass.reset_stats()
        yield
    torch._dynamo.reset()


@dataclasses.dataclass
class Outcome:
    """What one forward (and, in training, one backward) produced."""

    outputs: tuple[torch.Tensor, ...]
    grads: dict[str, torch.Tensor]


def flatten(out) -> tuple[torch.Tensor, ...]:
    """The tensors of a (nested) output: tensors, tuples, lists, dicts, HF ModelOutputs."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, dict):  # also transformers' ModelOutput
        out = [v for v in out.values() if v is not None]
    if isinstance(out, (tuple, list)):
        return tuple(t for o in out for t in flatten(o))
    return ()  # caches and other objects


def prepare_inputs(inputs, train: bool, input_grad: bool = True) -> tuple:
    """Fresh leaf copies (keeping `mark_dynamic` marks); in training, floating-point inputs require
    grad (unless `input_grad` is False)."""
    out = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            dims = getattr(x, "_dynamo_dynamic_indices", ())
            x = x.detach().clone()
            for d in sorted(dims):  # keep torch._dynamo.mark_dynamic on the copy
                torch._dynamo.mark_dynamic(x, d)
            if train and input_grad and x.is_floating_point():
                x.requires_grad_(True)
        out.append(x)
    return tuple(out)


def run(fn, module, inputs, train: bool = False, input_grad: bool = True, kwargs=None) -> Outcome:
    """Call `fn` (the module or a compiled version of it) once. In training, backpropagate the HF
    loss when the output has one, else a fixed random cotangent of every floating output, and
    collect the gradients of the inputs and of every parameter that requires grad."""
    kwargs = kwargs or {}
    inputs = prepare_inputs(inputs, train, input_grad)
    if train:
        module.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        out = fn(*inputs, **kwargs)
    outs = flatten(out)
    grads: dict[str, torch.Tensor] = {}
    if train:
        loss = getattr(out, "loss", None)
        if loss is None:
            gen = torch.Generator().manual_seed(1234)
            loss = sum(
                (o.float() * torch.randn(o.shape, generator=gen)).sum()
                for o in outs
                if o.requires_grad
            )
        loss.backward()
        for i, x in enumerate(inputs):
            if isinstance(x, torch.Tensor) and x.requires_grad:
                grads[f"input{i}"] = x.grad
        for name, p in module.named_parameters():
            if p.requires_grad:
                grads[name] = p.grad
    return Outcome(tuple(o.detach() for o in outs), grads)


def eager(module, *inputs, train: bool = False, input_grad: bool = True, kwargs=None) -> Outcome:
    return run(module, module, inputs, train, input_grad, kwargs)


def make_backend(fusions=None, **config):
    """`fusionpass.backend(cpu=True, ...)`: CPU graphs are only fused when asked to."""
    config.setdefault("cpu", True)
    return fusionpass.backend(fusions=fusions, **config)


# The plain-compile side of the model tests: Dynamo and AOT autograd as torch.compile runs them,
# with eager kernels (aot_eager). Inductor's CPU code generation and C++ builds were most of the
# CPU suite's time, and CI has a time limit; on these fp32 models eager kernels give Inductor's
# results within the tests' tolerances. A side that must be Inductor's (its RNG, what its
# partitioner saves, bitwise equality, bf16 rounding) names backend="inductor" itself; GPU
# conformance always compares against Inductor.
PLAIN_BACKEND = "aot_eager"


def plain_compiled(module):
    """`module` compiled as the model tests' plain reference (PLAIN_BACKEND), whole graph."""
    return torch.compile(module, backend=PLAIN_BACKEND, fullgraph=True)


def compile_and_count(
    module,
    *inputs,
    fusions=None,
    dynamic=None,
    train: bool = False,
    input_grad: bool = True,
    kwargs=None,
    backend=None,
    fullgraph: bool = True,
    **config,
) -> tuple[Outcome, dict]:
    """Compile `module` with the fusionpass backend (CPU fusion on; `config` overrides Config
    fields), run it once (forward, and backward in training) with every cache off, and return
    (Outcome, fusionpass.stats(variants=True))."""
    if backend is None:
        backend = make_backend(fusions, **config)
    with compiling():
        compiled = torch.compile(module, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
        outcome = run(compiled, module, inputs, train, input_grad, kwargs)
        return outcome, fusionpass.stats(variants=True)


def near_misses(reason_contains: str | None = None) -> list[tuple[str, str, str]]:
    """Near misses of the last compiles, optionally only those whose reason contains a text."""
    return [m for m in STATISTICS.near_misses if reason_contains is None or reason_contains in m[2]]


def already_fast() -> list[tuple[str, str, str]]:
    """(fusion, where, note) of the last compiles' calls already in a fusion's fast form (an SDPA
    call transformers made without a mask; explain's "already fast")."""
    return [n for r in STATISTICS.records for n in r.already_fast]


def counts(**variants) -> dict:
    """{(FUSION, variant): n} from keyword arguments: counts(llama=1, llama_no_residual=1)."""
    return {(FUSION, v): n for v, n in variants.items() if n}


def assert_tensors_close(actual, expected, rtol: float, what: str = "") -> None:
    """Elementwise |a - e| <= rtol * max(|e|) + rtol * |e|: relative to the tensor's scale, so
    that values near zero do not demand more than the dtype can give."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.double(), expected.double()
    scale = e.abs().max().item() if e.numel() else 0.0
    torch.testing.assert_close(
        a, e, rtol=rtol, atol=rtol * max(scale, 1e-6), msg=lambda m: f"{what}: {m}"
    )


def assert_outcomes_close(actual: Outcome, expected: Outcome, dtype=torch.float32, rtol=None):
    rtol = RTOL[dtype] if rtol is None else rtol
    assert len(actual.outputs) == len(expected.outputs)
    for i, (a, e) in enumerate(zip(actual.outputs, expected.outputs)):
        assert_tensors_close(a, e, rtol, f"output {i}")
    assert actual.grads.keys() == expected.grads.keys(), (
        f"gradients of {sorted(actual.grads)} != {sorted(expected.grads)}"
    )
    for name, e in expected.grads.items():
        a = actual.grads[name]
        assert (a is None) == (e is None), f"gradient of {name}: {a} vs {e}"
        if e is not None:
            assert_tensors_close(a, e, rtol, f"gradient of {name}")


def fused_graph(module, *inputs, **config):
    """(GraphModule, outputs, Record): the Dynamo graph of `module` after our pre-grad pass, what
    it computes when run eagerly (our custom ops, nothing of Inductor's), and the pass's record."""
    cfg = config_mod.make(**{"cpu": True, **config})
    graphs = []

    def capture(gm, example_inputs):
        STATISTICS.reset()
        PreGradFusionPass(cfg)(gm.graph)
        records.append(STATISTICS.records[-1])
        gm.recompile()
        graphs.append(gm)
        return gm.forward

    records = []
    torch._dynamo.reset()
    try:
        out = torch.compile(module, backend=capture, fullgraph=True)(*inputs)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1 and len(records) == 1
    return graphs[0], out, records[0]


def graph_code(gm) -> str:
    """gm.code, shortened for inline expectations: no annotations, no placeholder aliases
    (`l_x_ = L_x_`), no `; x = None` cleanups, no blank lines."""
    out = []
    for line in gm.code.strip().splitlines():
        line = re.sub(r";  [\w, =]* = None$", "", line.rstrip())
        line = re.sub(r" : [\w.]+", "", line)
        if not line.strip() or re.fullmatch(r"\s+l_\w+ = L_\w+", line):
            continue
        out.append(line)
    return "\n".join(out)


class KnownBug(Exception):
    """Raised by `known_bug` when a reported package bug shows itself with its own message, so
    that `xfail(strict=True, raises=KnownBug)` fails for any other error and passes once fixed."""


@contextlib.contextmanager
def known_bug(exc_type, text: str):
    try:
        yield
    except exc_type as e:
        if text in str(e):
            raise KnownBug(text) from e
        raise


def load_script(module_name: str, path) -> object:
    """A script that is no package's module (benchmarks/*.py) as a module, registered in
    sys.modules (dataclasses need that) and loaded once."""
    import importlib.util
    import sys

    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]
