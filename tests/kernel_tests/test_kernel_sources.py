"""On CUDA, Inductor compiles each user Triton kernel from source that it assembles itself: the
kernel, every jit function it calls and every global they read, each emitted once under its name
(torch._inductor.codegen.wrapper's transitive closure). The interpreter runs the Python functions
instead and never builds that source, so a name the closure misses (a NameError on the GPU only, as
on the H200: a helper bound under another name, `from m import rng_key as _rng_key`) or a global
defined twice with different values (one silently wins on the GPU) shows up only there. These
tests read every kernel module of ours, the shared packages' and each fusion folder's."""
import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap

import triton
import triton.language as tl
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

import fusionpass.kernels as package
from fusionpass import fusions
from fusionpass.kernels import launch


def _kernel_modules():
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        yield importlib.import_module(info.name)
    yield from fusions.modules("kernels")


def _is_jit(value) -> bool:
    return callable(getattr(value, "fn", None)) and hasattr(value, "arg_names")


def _jit_functions(module):
    """(name, jit function) of every JITFunction or InterpretedFunction the module holds."""
    for name, value in vars(module).items():
        if _is_jit(value):
            yield name, value


def test_jit_functions_are_bound_under_their_own_names():
    wrong, seen = [], 0
    for module in _kernel_modules():
        for name, kernel in _jit_functions(module):
            seen += 1
            if name != kernel.fn.__name__:
                wrong.append(f"{module.__name__}.{name} is {kernel.fn.__module__}.{kernel.fn.__name__}")
    assert seen > 50  # the check sees the kernels at all
    assert wrong == []


def _unresolved(source: str, defined: dict) -> set[str]:
    """Names the closure's functions read that neither the closure nor Python defines."""
    missing = set()
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        args = node.args
        local = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        missing |= {name for name in read - local if name not in defined and not hasattr(builtins, name)}
    return missing


def _value(x):
    return getattr(x, "value", x)  # a tl.constexpr's value


def _numbers_read(kernel, seen=None):
    """(function, name, value) of every number or constexpr global that `kernel` and the jit
    functions it calls read, each from the module that defines the function."""
    seen = set() if seen is None else seen
    fn = kernel.fn
    if fn in seen:
        return
    seen.add(fn)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for name in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}:
        value = fn.__globals__.get(name)
        if _is_jit(value):
            yield from _numbers_read(value, seen)
        elif isinstance(value, (tl.constexpr, int, float)) and not isinstance(value, bool):
            yield f"{fn.__module__}.{fn.__name__}", name, _value(value)


def test_every_kernel_compiles_from_its_closure_as_inductor_builds_it():
    problems, kernels = [], 0
    for module in _kernel_modules():
        for name, kernel in _jit_functions(module):
            if kernel.fn.__module__ != module.__name__:
                continue  # each kernel once, in the module that defines it
            kernels += 1
            with launch._jit_functions(kernel) as jitted:  # JITFunctions where the interpreter made others
                source = user_defined_triton_kernel_transitive_closure_source_code(jitted)
            defined = {"triton": triton, "tl": tl}
            exec(compile("import triton\nimport triton.language as tl\n" + source, name, "exec"), defined)
            for missing in sorted(_unresolved(source, defined)):
                problems.append(f"{module.__name__}.{name}: {missing} is not in its source")
            for function, global_name, value in _numbers_read(kernel):
                if _value(defined.get(global_name)) != value:
                    problems.append(f"{module.__name__}.{name}: {function} reads {global_name} = {value}, "
                                    f"its source has {_value(defined.get(global_name))}")
    assert kernels > 50  # the check sees the kernels at all
    assert problems == []
