"""fusionpass.conformance.plain_side: a case's plain-compile errors are taken from an earlier result
only where everything plain compile sees is the same (graphs, values, settings, versions)."""
import dataclasses
import functools
import json

import pytest
import torch

from fusionpass import conformance
from fusionpass.conformance import __main__ as runner
from fusionpass.conformance import plain_side

NAME = "rms_norm_residual/no_weight/no-weight-prenorm/fp16/8x125x2048/train"


def _case(name=NAME):
    case = next(c for c in conformance.all_cases() if c.name == name)
    return dataclasses.replace(case, config={**case.config, "cpu": True})


class _Doubled(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        out = self.inner(*args)
        return tuple(2 * o for o in out) if isinstance(out, tuple) else 2 * out


REFERENCE = conformance._Run([torch.ones(2, dtype=torch.float64)], {"w": None})


def _key(case, shift=0.0):
    """The case's key as the runner computes it (cotangents of ones, its path for a compiled side)."""
    torch.manual_seed(0)
    module, inputs = case.make(case.dtype, "cpu")
    inputs = (inputs[0] + shift, *inputs[1:])
    with torch.no_grad():
        cotangents = [torch.ones_like(o) for o in conformance._flatten(module(*inputs))]
    run_with = functools.partial(conformance.run_compiled, case, module, inputs, cotangents)
    return plain_side.key(case, inputs, cotangents, REFERENCE, "cpu", run_with)


def test_the_key_is_the_same_for_the_same_case_and_changes_with_what_plain_sees():
    case = _case()
    assert _key(case) == _key(case)
    assert _key(case, shift=1e-3) != _key(case)
    assert _key(dataclasses.replace(case, train=False)) != _key(case)
    assert _key(dataclasses.replace(case, dynamic_dims=(0,))) != _key(case)


def test_the_key_sees_values_outside_the_state_dict():
    # a non-persistent buffer (HF's rotary inv_freq) and a plain tensor attribute are graph inputs
    case = _case()

    class _Scaled(_Doubled):
        def forward(self, *args):
            out = self.inner(*args)
            return tuple(o * self.scale[0] for o in out) if isinstance(out, tuple) else out * self.scale[0]

    def scaled(dtype, device, value=1.0):
        module, inputs = case.make(dtype, device)
        wrapped = _Scaled(module)
        wrapped.register_buffer("scale", torch.full((3,), value), persistent=False)
        return wrapped, inputs

    assert _key(dataclasses.replace(case, make=scaled)) != _key(dataclasses.replace(
        case, make=lambda dtype, device: scaled(dtype, device, 2.0)))


def test_the_fingerprint_is_exact_for_every_value():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert plain_side._fingerprint(a) != plain_side._fingerprint(torch.tensor([1.0, float("nan"), 3.5]))
    big = torch.tensor([torch.finfo(torch.float32).min, 1.0])
    assert plain_side._fingerprint(big) != plain_side._fingerprint(torch.tensor([torch.finfo(torch.float32).min, 1.5]))
    x = torch.randn(4, 6)
    assert plain_side._fingerprint(x) != plain_side._fingerprint(x.t().contiguous().t())  # strides
    assert plain_side._fingerprint(x) == plain_side._fingerprint(x.clone())


def test_a_reference_made_from_the_judged_run_has_no_key():
    case = dataclasses.replace(_case(), reference_kwargs=lambda outputs, inputs: {})
    assert _key(case) is None


def test_the_key_changes_with_the_module_code():
    case = _case()

    def doubled(dtype, device):  # the same parameters and inputs, another graph
        module, inputs = case.make(dtype, device)
        return _Doubled(module), inputs

    assert _key(dataclasses.replace(case, make=doubled)) != _key(case)


def test_a_known_key_skips_plain_compile_and_keeps_its_errors(tmp_path):
    case = _case()
    first = conformance.run_case(case, "cpu")
    assert first["passed"], first["reason"]
    assert first["plain_key"] and "plain" in first["phase_seconds"] and "plain_reused" not in first
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"cases": [first]}))
    known = plain_side.known_errors([str(path)])
    assert known == {first["plain_key"]: first["errors"]["plain"]}
    second = conformance.run_case(case, "cpu", known_plain=known)
    assert second["passed"], second["reason"]
    assert second["plain_reused"] and "plain" not in second["phase_seconds"]
    assert second["plain_key"] == first["plain_key"]
    assert second["errors"]["plain"] == first["errors"]["plain"]
    # an unknown key: plain compile runs as always
    third = conformance.run_case(case, "cpu", known_plain={"0" * 64: {"out0": 0.0}})
    assert "plain_reused" not in third and third["errors"]["plain"] == first["errors"]["plain"]


def test_a_file_that_is_no_result_stops_the_run(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit, match="--reuse-plain"):
        runner.main(["--device", "cpu", "--only", "(none)", "--out", str(tmp_path / "o.json"), "--reuse-plain", str(bad)])


def test_the_runner_passes_its_files_to_the_workers(monkeypatch, tmp_path):
    seen = []

    def pool(args, only, jobs, tmp, tag):
        seen.append(args.reuse_plain)
        return [], [0]

    monkeypatch.setattr(runner, "_pool", pool)
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"cases": []}))
    out = tmp_path / "out.json"
    runner.main(["--device", "cpu", "--only", "(none)", "--out", str(out), "--reuse-plain", str(earlier)])
    assert seen == [[str(earlier)]]
    assert json.loads(out.read_text())["plain_reused"] == 0
