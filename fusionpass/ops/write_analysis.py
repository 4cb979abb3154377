"""torch's analysis of which tensors a user Triton kernel writes, made once per kernel and kind of
arguments instead of at every call site it traces.

AOT autograd's functionalization and Inductor's lowering ask torch which tensor arguments each call
of a user-defined Triton kernel (our triton_ops' `wrap_triton` launches) writes. torch answers by
generating the kernel's TTIR and walking it, for every call site and again in each phase. A model
calls our kernels once per layer with arguments of the same kinds, so the same answer is made
many times over; on the Trainer path these analyses are a share of the compile time fusionpass
adds (`benchmarks/trainer.py --compile-time --breakdown` times them on the GPU;
benchmarks/results/kernel/write_analysis.json, from benchmarks/probes/write_analysis.py, with and without
the memo).

The answer depends only on the kernel's TTIR, which Triton makes from its constexpr and scalar
arguments (ints only through Triton's specializations: 1, a multiple of 16) and the tensors'
dtypes, and on which arguments are tensors of which kind (torch filters the answer by it). The
memo keys on exactly those (`launch.argument_key`, with the tensors' kinds), for fusionpass's own
kernels only, and defers to torch for any other kernel, for TMA descriptors and for any argument it
cannot key (a symbolic size). Each caller gets its own copy of the answer.
"""
from __future__ import annotations

import copy
import functools
import threading

import torch

from fusionpass.kernels import launch

# torch's entry points (torch 2.11: identify_mutated_tensors; later: identify_accessed_tensors),
# each called as fn(kernel, kwargs, tma_descriptor_metadata)
_ANALYSES = ("identify_mutated_tensors", "identify_accessed_tensors")
# Our kernels live in fusionpass.kernels (shared) and in the fusion folders (fusionpass.fusions).
_OUR_KERNELS = ("fusionpass.kernels.", "fusionpass.fusions.")


def _kind(value):
    """What of an argument decides the analysis: a tensor's kind and dtype, a scalar's
    specialization; None where that cannot be told (a symbolic value)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", type(value).__name__, value.dtype)
    get_dtype = getattr(value, "get_dtype", None)
    if get_dtype is not None:  # an Inductor IR node (TensorBox, a buffer)
        return ("ir", type(value).__name__, get_dtype())
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", type(value).__name__, launch.argument_key(value))
    return None


def key(kernel, kwargs: dict, tma_descriptor_metadata) -> tuple | None:
    """The memo's key of one call, or None where torch is asked instead."""
    fn = getattr(kernel, "fn", None)
    if tma_descriptor_metadata or not getattr(fn, "__module__", "").startswith(_OUR_KERNELS):
        return None
    parts = []
    for name in sorted(kwargs):
        kind = _kind(kwargs[name])
        if kind is None:
            return None
        parts.append((name, kind))
    return fn.__module__, fn.__qualname__, tuple(parts)


class Memo:
    """One analysis function of torch's, memoized for our kernels."""

    def __init__(self, analysis):
        self.analysis = analysis
        self.answers: dict = {}
        self.asked = 0  # calls that reached torch's analysis for one of our kernels (misses)
        self._lock = threading.Lock()

    def __call__(self, kernel, kwargs, tma_descriptor_metadata):
        k = key(kernel, kwargs, tma_descriptor_metadata)
        if k is None:
            return self.analysis(kernel, kwargs, tma_descriptor_metadata)
        with self._lock:
            found = self.answers.get(k)
        if found is None:
            found = self.analysis(kernel, kwargs, tma_descriptor_metadata)
            with self._lock:
                self.answers[k] = found
                self.asked += 1
        return copy.deepcopy(found)


def install() -> list[str]:
    """Memoize torch's analyses that exist in this torch (once): their names."""
    from torch._higher_order_ops import triton_kernel_wrap

    installed = []
    for name in _ANALYSES:
        analysis = getattr(triton_kernel_wrap, name, None)
        if analysis is None:
            continue
        if not isinstance(analysis, Memo):
            setattr(triton_kernel_wrap, name, functools.update_wrapper(Memo(analysis), analysis))
        installed.append(name)
    return installed


install()
