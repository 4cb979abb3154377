"""Issue 42 probe: does a refactor of our Triton kernels leave the generated code as it was?

A refactor of kernel source (a helper shared by two kernels, say) must not change what runs on the
GPU. This probe answers that on a machine without a GPU, in two steps:

1. capture: run kernel tests under the Triton interpreter with this module as a pytest plugin; it
   records each launch through `fusionpass.kernels.launch` (kernel, argument kinds and constexprs),
   so every flag combination the tests exercise is covered;
2. compare: compile each recorded launch for sm_90 (Triton's own compiler and ptxas, no GPU needed)
   from the working tree and from a git revision, and compare the PTX without its debug info
   (source lines, file names and debug labels change with any edit).

    TRITON_INTERPRET=1 PYTHONPATH=benchmarks/probes python -m pytest -p ptx_identity \\
        tests/kernel_tests/test_attention_kernel.py            # writes $PTX_LAUNCHES (launches.json)
    python benchmarks/probes/ptx_identity.py compare --base HEAD [--launches launches.json] [--match attention]

Integer arguments are compiled without Triton's divisibility specialization and constexprs as
recorded, with INTERP off: both trees get the same signature, so the comparison is fair, though the
code is not byte for byte what a launch on a GPU compiles.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
LAUNCHES = os.environ.get("PTX_LAUNCHES", "launches.json")
_RECORDS: dict = {}


# --- step 1: the pytest plugin -------------------------------------------------------------------
def _kind(v):
    import torch

    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype).removeprefix("torch.")]
    for kind, t in (("bool", bool), ("int", int), ("float", float)):
        if isinstance(v, t):
            return [kind, v]
    return ["none", None] if v is None else ["literal", repr(v)]


def pytest_configure(config):
    from fusionpass.kernels import launch

    getitem = launch._Launch.__getitem__

    def recording(self, grid):
        run = getitem(self, grid)

        def record(*args, **kwargs):
            fn = getattr(self.kernel, "fn", self.kernel)
            bound = {**dict(zip(self.kernel.arg_names, args)), **kwargs}
            entry = {"module": fn.__module__, "name": fn.__name__, "args": {n: _kind(v) for n, v in bound.items()}}
            _RECORDS[json.dumps(entry, sort_keys=True)] = entry
            return run(*args, **kwargs)

        return record

    launch._Launch.__getitem__ = recording


def pytest_sessionfinish(session, exitstatus):
    # one file per process (pytest-xdist workers each write theirs)
    path = pathlib.Path(LAUNCHES)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        path = path.with_name(f"{path.stem}.{worker}{path.suffix}")
    path.write_text(json.dumps(list(_RECORDS.values())))


# --- step 2: compile both trees ------------------------------------------------------------------
_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32", "int64": "i64", "bool": "i1",
           "uint8": "u8", "int8": "i8", "int16": "i16"}


def normalized_ptx(ptx: str) -> str:
    """PTX without what changes with source positions: .file/.loc lines, comments, the debug
    sections, and the labels that mark inlined scopes for them."""
    ptx = re.sub(r"\.section\s+\.debug.*", "", ptx, flags=re.S)
    ptx = re.sub(r"^\s*\.(file|loc)\b.*$", "", ptx, flags=re.M)
    ptx = re.sub(r"^\$L__tmp\d+:$", "", ptx, flags=re.M)
    ptx = re.sub(r"//.*", "", ptx)
    return "\n".join(line.rstrip() for line in ptx.splitlines() if line.strip())


def compile_launch(entry: dict) -> str:
    """The hash of one recorded launch's normalized PTX for sm_90, from the fusionpass on sys.path."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(entry["module"]), entry["name"])
    signature, constexprs = {}, {}
    for p in fn.params:
        kind, value = entry["args"].get(p.name, ["none", None])
        if kind == "literal":
            value = ast.literal_eval(value)
        if p.is_constexpr or kind in ("none", "literal"):
            signature[p.name] = "constexpr"
            constexprs[p.name] = False if p.name == "INTERP" else value
        elif kind == "tensor":
            signature[p.name] = "*" + _DTYPES[value]
        elif kind in ("int", "bool"):
            signature[p.name] = "i64" if abs(int(value)) >= 2**31 else "i32"
        else:
            signature[p.name] = "fp32"
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    return hashlib.sha1(normalized_ptx(compiled.asm["ptx"]).encode()).hexdigest()[:16]


def _hashes(root: pathlib.Path, launches: list[dict]) -> list[str]:
    """Each launch's hash, compiled in a child process whose fusionpass is the one under `root`."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(launches, f)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[3]); "
            "import ptx_identity as p; ls = json.load(open(sys.argv[2])); "
            "print(json.dumps([p.compile_launch(e) for e in ls]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code, str(root), f.name, str(pathlib.Path(__file__).parent)],
                         check=True, capture_output=True, text=True, env=env)
    os.unlink(f.name)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(base: str, launches_file: str, match: str) -> dict:
    paths = sorted(pathlib.Path(launches_file).parent.glob(pathlib.Path(launches_file).stem + "*.json"))
    entries = {json.dumps(e, sort_keys=True): e for p in paths for e in json.loads(p.read_text())}
    launches = [e for _, e in sorted(entries.items()) if match in e["module"]]
    with tempfile.TemporaryDirectory() as tmp:
        archive = pathlib.Path(tmp) / "base.tar"
        subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), base, "fusionpass"], check=True)
        with tarfile.open(archive) as t:
            t.extractall(tmp, filter="data")
        before = _hashes(pathlib.Path(tmp), launches)
    after = _hashes(ROOT, launches)
    per_kernel: dict = {}
    for e, b, a in zip(launches, before, after):
        row = per_kernel.setdefault(f"{e['module']}.{e['name']}", {"same": 0, "different": 0})
        row["same" if a == b else "different"] += 1
    return {"base": base, "launches": len(launches), "per_kernel": per_kernel}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare")
    c.add_argument("--base", default="HEAD", help="the git revision to compare the working tree with")
    c.add_argument("--launches", default=LAUNCHES, help="the capture's file (its per-worker siblings too)")
    c.add_argument("--match", default="", help="only kernels whose module contains this")
    args = p.parse_args(argv)
    result = compare(args.base, args.launches, args.match)
    print(json.dumps(result, indent=1))
    return 0 if all(r["different"] == 0 for r in result["per_kernel"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
