"""Every fusionpass op is autocast-neutral: it computes in the dtypes of the tensors it is given.

A custom op without an autocast rule falls through autocast, and then the torch calls inside its
implementation are autocast's to change (in eager a `torch.mm` there came out bf16 under
`torch.autocast("cpu")`, under torch.compile it did not). The pass writes autocast's casts into the
graph before a replacement reads it (`fusionpass.patterns.autocast`), so an op's inputs already
carry the dtypes autocast would give them; here each op's autocast kernels only switch autocast off
for the op's own body, the way `torch.library.register_autocast` does, without its input casts.
"""
from __future__ import annotations

import torch

_KEYS = ("AutocastCPU", "AutocastCUDA")
_LIBRARIES: list = []  # registrations live as long as their Library object


def _autocast_off(op, key_name: str):
    key = getattr(torch._C.DispatchKey, key_name)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return op(*args, **kwargs)

    return key, kernel


def make_neutral(namespace: str = "fusionpass") -> None:
    """Autocast-off kernels for every op of `namespace` that has none yet."""
    lib = torch.library.Library(namespace, "IMPL")
    _LIBRARIES.append(lib)
    ops = getattr(torch.ops, namespace)
    for name in list(ops):
        packet = getattr(ops, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            for key_name in _KEYS:
                key, kernel = _autocast_off(op, key_name)
                if op.has_kernel_for_dispatch_key(key):
                    continue
                qualname = name if overload == "default" else f"{name}.{overload}"
                lib.impl(qualname, lambda _keyset, *a, _k=kernel, **kw: _k(*a, **kw), key_name, with_keyset=True)
                op.py_impl(key)(kernel)
