"""Inductor compiles a Triton kernel that torch.compile traced into (a triton_op launch) from the
kernel's source, emitting each jit function it calls under that function's own name: a kernel
calling a helper bound under another name (`from m import rng_key as _rng_key`) compiles under
the interpreter but fails on CUDA with NameError('_rng_key is not defined'), as it did on the H200.
So every jit function a kernel module holds must be bound under its own name: the shared kernels
(fusionpass.kernels and its packages) and each fusion folder's kernels."""
import importlib
import pkgutil

import fusionpass.kernels as package
from fusionpass import fusions


def _kernel_modules():
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        yield importlib.import_module(info.name)
    yield from fusions.modules("kernels")


def _jit_functions(module):
    for name, value in vars(module).items():
        fn = getattr(value, "fn", None)
        if callable(fn) and hasattr(value, "arg_names"):  # a JITFunction or InterpretedFunction
            yield name, fn


def test_jit_functions_are_bound_under_their_own_names():
    wrong, seen = [], 0
    for module in _kernel_modules():
        for name, fn in _jit_functions(module):
            seen += 1
            if name != fn.__name__:
                wrong.append(f"{module.__name__}.{name} is {fn.__module__}.{fn.__name__}")
    assert seen > 20  # the check sees the kernels at all
    assert wrong == []
