"""How every fusionpass Triton kernel is launched: traceable by torch.compile on CUDA, run by the
interpreter on CPU, and checked for the one thing that tracing gets silently wrong.

Under torch.compile a launch inside a triton_op becomes Inductor's `triton_kernel_wrapper_functional`:
each argument the kernel writes (found by torch's analysis of the kernel's TTIR,
`identify_accessed_tensors`) is cloned on its own, the kernel writes the clones, and every clone is
then put back in place of the tensor it came from, one after the other. A tensor passed in two
argument positions of which one is written therefore comes back as whichever clone is put back
last -- possibly one the kernel never wrote: uninitialized memory, with no error. Eager calls and
the CPU interpreter do not clone, so they cannot show it. (Seen on the H200: the LayerNorm backward
passed its one weight-gradient buffer as both outputs of the column-sum kernel when the LayerNorm
had no bias, and the rope kernel passed q's output as k's when rotating one tensor; both read back
stale memory.)

So `launcher` refuses such a launch everywhere, on CPU too: it runs the same analysis (with a
stand-in CUDA target where no GPU is present) and raises if a written argument shares memory with
any other tensor argument. Unused pointer arguments take `absent(...)` placeholders of their own.
"""
from __future__ import annotations

import contextlib
import sys

import torch


def absent(like: torch.Tensor) -> torch.Tensor:
    """A one-element stand-in for a pointer argument the kernel's flags leave unused: a tensor of
    its own (never another argument, see the module docstring), of `like`'s dtype and device."""
    return like.new_empty((1,))


@contextlib.contextmanager
def _cuda_target():
    """Triton's active driver, or a stand-in that names an sm_90 target where none is active (the CPU
    interpreter): TTIR generation needs a target, not a GPU."""
    from triton.runtime.driver import driver

    try:
        driver.active.get_current_target()
        active = True
    except RuntimeError:
        active = False
    if active:
        yield
        return
    from triton.backends.compiler import GPUTarget

    class _Target:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    saved = driver._active
    driver.set_active(_Target())
    try:
        yield
    finally:
        driver._active = saved


_JITTED: dict = {}
_JIT_MODULES = ("fusionpass.kernels", "fusionpass.fusions", "triton.language")
# What the interpreter patched into triton.language, with the values it replaced. It patches the
# language while it runs a kernel and, for jit helpers called from a kernel, never restores it
# (triton 3.6 InterpretedFunction.__call__): TTIR generation later in the same process would then
# run the interpreter's semantics. Recorded from the first patch on: this module is imported with
# the kernels, before any of them runs.
_ORIGINALS: dict = {}
_MISSING = object()


def _record_patches() -> None:
    try:
        from triton.runtime.interpreter import _LangPatchScope
    except ImportError:  # pragma: no cover -- another triton layout: nothing to restore
        return
    if getattr(_LangPatchScope.set_attr, "_fusionpass", False):
        return
    set_attr = _LangPatchScope.set_attr

    def recording(self, obj, name, value):
        _ORIGINALS.setdefault((id(obj), name), (obj, name, vars(obj).get(name, _MISSING)))
        set_attr(self, obj, name, value)

    recording._fusionpass = True
    _LangPatchScope.set_attr = recording


_record_patches()


@contextlib.contextmanager
def _pristine_language():
    """triton.language as it was before the interpreter patched it, for the duration."""
    current = [(obj, name, vars(obj).get(name, _MISSING)) for obj, name, _ in _ORIGINALS.values()]
    try:
        _set_all(_ORIGINALS.values())
        yield
    finally:
        _set_all(current)


def _set_all(values) -> None:
    for obj, name, value in values:
        if value is _MISSING:
            if name in vars(obj):
                delattr(obj, name)
        else:
            setattr(obj, name, value)


@contextlib.contextmanager
def _jit_functions(kernel):
    """`kernel` as the JITFunction the analysis reads. Under TRITON_INTERPRET=1, @triton.jit made
    InterpretedFunctions, which TTIR generation cannot read: for the analysis, the kernel and every
    jit function of fusionpass.kernels, the fusion folders and triton.language (tl.sum, tl.cdiv, tl.philox are jit
    functions too) are JITFunctions of the same Python functions."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, InterpretedFunction):
        yield kernel
        return

    def jitted(f):
        if f.fn not in _JITTED:
            _JITTED[f.fn] = JITFunction(f.fn)
        return _JITTED[f.fn]

    import triton

    swapped = []
    for name, module in list(sys.modules.items()):
        if name.startswith(_JIT_MODULES) and module is not None:
            for attr, value in list(vars(module).items()):
                if isinstance(value, InterpretedFunction):
                    swapped.append((module, attr, value))
                    setattr(module, attr, jitted(value))
    interpret = triton.knobs.runtime.interpret
    triton.knobs.runtime.interpret = False  # TTIR generation then insists on JITFunctions throughout
    try:
        with _pristine_language():
            yield jitted(kernel)
    finally:
        triton.knobs.runtime.interpret = interpret
        for module, attr, value in swapped:
            setattr(module, attr, value)


def _concrete(v):
    """A stand-in for one argument in the analysis: it reads dtypes, constexprs and whether an int
    is 1 or a multiple of 16, never data (symbolic sizes under dynamic shapes become plain ints)."""
    if isinstance(v, torch.Tensor):
        return torch.empty((16,), dtype=v.dtype)
    if isinstance(v, torch.SymInt):
        return 17
    if isinstance(v, torch.SymFloat):
        return 0.5
    return v


def argument_key(v):
    """What of one argument decides a kernel's TTIR: a tensor's dtype, whether an int is 1 or a
    multiple of 16 (Triton's specializations), other scalars as they are. Allocates nothing: it runs
    at every launch."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype)
    if isinstance(v, (torch.SymInt, torch.SymFloat)):
        v = _concrete(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return ("int", v == 1, v % 16 == 0)
    return v if isinstance(v, (bool, float, str, type(None))) else type(v).__name__


_WRITTEN: dict = {}
# The flags the launchers set for CPU tensors (rounding emulated in integer ops, upcasts before
# tl.dot) take their CUDA values in the analysis: they change arithmetic, not which stores exist,
# and the CUDA build is the one being checked.
_CUDA_FLAGS = {"ROUND_BITS": False, "INTERP": False, "UPCAST": False}


def _mutated(kernel, kwargs) -> list[str]:
    """The argument names Inductor's functionalization clones for this launch (torch >= 2.13:
    identify_accessed_tensors; torch 2.11/2.12: identify_mutated_tensors)."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_accessed_tensors"):
        accesses = wrap.identify_accessed_tensors(kernel, kwargs, {})
        return [d.name for d in accesses.read_writes.writes]
    return list(wrap.identify_mutated_tensors(kernel, kwargs, {}))


def written_arguments(kernel, kwargs: dict) -> frozenset[str]:
    """Names of the tensor arguments the kernel stores to with these arguments (constexpr flags
    decide which stores exist), by torch's own analysis; every tensor argument where the analysis
    fails (Inductor then clones them all)."""
    tensors = frozenset(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    # in the launch's own argument order (the kernel's), which is the same at every launch of a call site
    key = (kernel, tuple((k, argument_key(v)) for k, v in kwargs.items()))
    if key not in _WRITTEN:
        from torch.utils._python_dispatch import _disable_current_modes

        try:
            # concrete stand-ins even while torch.compile traces (fake and functional tensors have
            # no data pointer, and the analysis specializes on pointer alignment)
            with _disable_current_modes(), _cuda_target(), _jit_functions(kernel) as jitted:
                args = {k: _CUDA_FLAGS.get(k, _concrete(v)) for k, v in kwargs.items()}
                _WRITTEN[key] = frozenset(_mutated(jitted, args)) & tensors
        except Exception:  # noqa: BLE001 -- Inductor's own fallback: every tensor may be written
            _WRITTEN[key] = tensors
    return _WRITTEN[key]


def check_private_outputs(kernel, kwargs: dict) -> None:
    """RuntimeError if an argument the kernel writes shares memory with another tensor argument."""
    written = written_arguments(kernel, kwargs)
    tensors = [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    for name in written:
        out = kwargs[name]
        for other, t in tensors:
            if other != name and (t is out or torch._C._is_alias_of(t, out)):
                raise RuntimeError(
                    f"{getattr(kernel, 'fn', kernel).__name__}: argument {name}, which the kernel writes, shares memory "
                    f"with argument {other}; under torch.compile one of the two would come back unwritten "
                    "(fusionpass.kernels.launch)")


class _Launch:
    def __init__(self, kernel, traced):
        self.kernel, self.traced = kernel, traced

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            names = self.kernel.arg_names
            bound = dict(zip(names, args))
            bound.update((k, v) for k, v in kwargs.items() if k in names)
            check_private_outputs(self.kernel, bound)
            if self.traced is not self.kernel and not traced(bound.values()):
                # wrap_triton outside a trace runs its higher-order op's eager path, which costs more
                # host time than the kernel launch itself (benchmarks/probes/cudnn_host_time.py): a
                # custom op's body (linear_cross_entropy's) runs so at every step
                return self.kernel[grid](*args, **kwargs)
            return self.traced[grid](*args, **kwargs)

        return run


def traced(values) -> bool:
    """Whether a launch with these arguments is being traced rather than run: a torch dispatch or
    function mode is on (fake tensors, functionalization, proxies), Dynamo is compiling, or a tensor
    argument is of a subclass (fake, functional). Only a launch that is run may skip wrap_triton."""
    if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
        return True
    if torch.compiler.is_compiling():
        return True
    return any(isinstance(v, torch.Tensor) and type(v) is not torch.Tensor for v in values)


def launcher(kernel, t: torch.Tensor):
    """`kernel[grid](...)` as a CUDA launch that torch.compile can trace into (`wrap_triton`:
    Inductor then launches it from its generated code, without custom-op dispatch; a launch that is
    run, not traced, goes to the kernel directly), or as is on CPU tensors, where it runs under the
    Triton interpreter; either way checked by `check_private_outputs` first."""
    if t.device.type == "cuda":
        from torch.library import wrap_triton

        return _Launch(kernel, wrap_triton(kernel))
    return _Launch(kernel, kernel)
