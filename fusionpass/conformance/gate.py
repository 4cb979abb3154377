"""The gate the CPU test suite applies to the committed conformance result
(benchmarks/results/conformance.json): no change to what fusionpass compiles lands without a
passing GPU run of exactly that code."""
from __future__ import annotations

import json
import pathlib

RESULT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "conformance.json"


def registered_variants() -> dict[str, list[str]]:
    """Every registered fusion and its variants that can replace a subgraph on CUDA (what needs a
    case)."""
    from fusionpass import registry

    return {name: [v.name for v in f.variants if v.cuda and not v.reports_only] for name, f in registry.registered().items()}


def problems(report: dict, digest: str, variants: dict[str, list[str]]) -> list[str]:
    """Why `report` does not vouch for the code whose source digest is `digest` (empty: it does)."""
    out = []
    if report.get("source_digest") != digest:
        out.append(f"stale: the result is of source digest {report.get('source_digest')}, the code is {digest}; "
                   "run `fusionpass check` on a GPU and commit its result")
    if report.get("device") != "cuda":
        out.append(f"the result was not measured on CUDA (device {report.get('device')!r})")
    cases = report.get("cases", [])
    out.extend(f"failed: {c['name']}: {c.get('reason', '')}" for c in cases if not c.get("passed"))
    # coverage by the declared searches that found the passing cases' matches
    passed = {tuple(key.split("/", 1)) for c in cases if c.get("passed") for key in c.get("searches", {})}
    for fusion, names in variants.items():
        out.extend(f"no passing case for {fusion}/{v}" for v in names if (fusion, v) not in passed)
    return out


def committed_problems() -> list[str]:
    from fusionpass.passes import source_digest

    if not RESULT.exists():
        return [f"{RESULT} is missing"]
    return problems(json.loads(RESULT.read_text()), source_digest(), registered_variants())
