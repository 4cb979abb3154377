"""The conformance gate: the committed GPU result must be of this exact code, pass every case, and
cover every registered fusion and variant (fusionpass.conformance.gate)."""
import copy

import pytest

from fusionpass.conformance import gate
from fusionpass.passes import source_digest

VARIANTS = {"rope": ["rotate_half", "interleaved"]}
GOOD = {
    "source_digest": "abc",
    "device": "cuda",
    "cases": [
        {"name": "rope/rotate_half/x", "fusion": "rope", "variant": "rotate_half", "passed": True,
         "searches": {"rope/rotate_half": 1}},
        {"name": "rope/interleaved/x", "fusion": "rope", "variant": "interleaved_partial", "passed": True,
         "searches": {"rope/interleaved": 1}},
    ],
}


def test_committed_result_vouches_for_this_code():
    assert gate.committed_problems() == []


def test_gate_accepts_a_complete_current_result():
    assert gate.problems(GOOD, "abc", VARIANTS) == []


def test_gate_fails_on_a_stale_digest():
    found = gate.problems(GOOD, source_digest(), VARIANTS)
    assert len(found) == 1 and found[0].startswith("stale")


def test_gate_fails_on_a_failed_case_and_on_a_variant_without_a_case():
    report = copy.deepcopy(GOOD)
    report["cases"][1]["passed"] = False
    report["cases"][1]["reason"] = "grad:input0: nan"
    found = gate.problems(report, "abc", VARIANTS)
    assert any(p.startswith("failed: rope/interleaved/x") for p in found)
    assert "no passing case for rope/interleaved" in found
    assert gate.problems(GOOD, "abc", {**VARIANTS, "swiglu_mlp": ["silu"]}) == ["no passing case for swiglu_mlp/silu"]


def test_gate_fails_on_a_cpu_result():
    assert gate.problems({**GOOD, "device": "cpu"}, "abc", VARIANTS) == ["the result was not measured on CUDA (device 'cpu')"]


def test_model_cases_expect_what_the_gpu_matched():
    # the model cases' expected counts are derived from each model's layers
    # (conformance/cases_models.py); the committed GPU run saw exactly them, case by case
    import json

    from fusionpass.conformance import cases_models

    committed = json.loads(gate.RESULT.read_text())
    seen = {c["name"]: c.get("matches") for c in committed["cases"]}
    cases = [c for c in cases_models.CASES if c.name in seen]
    assert len(cases) == len(cases_models.CASES)
    assert {c.name: c.expect for c in cases} == {c.name: seen[c.name] for c in cases}
