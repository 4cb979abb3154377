"""fusionpass/conformance/cases_autocast.py: every fusion's bf16 training case has an AMP twin
(fp32 parameters and inputs under bf16 autocast, judged at bf16's floor), and a twin computes what
its module computes under autocast. One small twin also runs through the conformance runner on the
CPU (the GPU run is what vouches for CUDA)."""
import dataclasses

import torch

from fusionpass.conformance import FLOOR, all_cases, cases_autocast, run_case


def _twins():
    return {c.name: c for c in cases_autocast.CASES}


def test_every_bf16_training_case_of_a_fusion_has_a_twin():
    twins = _twins()
    originals = [c for c in all_cases() if c.fusion != "model" and c.train and c.dtype == torch.bfloat16
                 and c.near_miss is None]
    assert originals
    gaps = set()
    for case in originals:
        twin = twins[case.name.replace("/bf16/", "/amp/", 1)]
        gap = cases_autocast.GAPS.get(case.name.split("/bf16/", 1)[0])
        if gap is None:
            assert (twin.fusion, twin.variant, twin.expect, twin.near_miss) == (case.fusion, case.variant, case.expect, None)
        else:  # a declared gap: checked as a fallback, its near miss named
            gaps.add(case.name.split("/bf16/", 1)[0])
            assert (twin.near_miss, twin.expect) == gap and case.fusion not in twin.expect
        assert (twin.fusion, twin.variant, twin.config) == (case.fusion, case.variant, case.config)
        assert twin.dtype == torch.float32 and twin.floor == FLOOR[torch.bfloat16] and twin.train
    assert len(twins) == len(originals)
    assert gaps == set(cases_autocast.GAPS), "a gap names no bf16 training case"


def test_a_twin_runs_its_module_under_autocast_over_fp32_parameters():
    twin = next(c for c in cases_autocast.CASES if c.fusion == "swiglu_mlp")
    torch.manual_seed(0)
    module, inputs = twin.make(twin.dtype, "cpu")
    assert isinstance(module, cases_autocast.Autocast)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(t.dtype == torch.float32 for t in inputs if t.is_floating_point())
    with torch.no_grad():
        out = module(*inputs)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = module.inner(*inputs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_twin_passes_the_conformance_runner_on_the_cpu():
    twin = next(c for c in cases_autocast.CASES if c.name.startswith("rope/rotate_half/llama_gqa/"))
    result = run_case(dataclasses.replace(twin, config={**twin.config, "cpu": True}), "cpu")
    assert result["passed"], result["reason"]
    assert result["dtype"] == "fp32" and "/amp/" in result["name"]
