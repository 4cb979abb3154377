"""`fusionpass check`'s runner: cases that failed for want of GPU resources in the shared pool run
again in a smaller one, and the result file says which; a budget stops the run with a result that
`--rerun-failed` completes. The worker pool is replaced by a stand-in here (the real one starts
processes that share a GPU)."""
import json
import time

import pytest

from fusionpass.conformance import __main__ as runner


def _result(name, passed, reason=""):
    fusion, variant = name.split("/")[:2]
    return {"name": name, "fusion": fusion, "variant": variant, "passed": passed, "reason": reason}


def _two_cases():
    return [c.name for c in runner._selected(["rms_norm_residual"], "cpu")[:2]]


def _run(monkeypatch, tmp_path, first_reasons, jobs, extra=()):
    """The runner over two cases whose first pool fails them with `first_reasons` ("" passes; None
    leaves the case unrun, as a worker past the deadline does) and whose retry pool passes them."""
    names = _two_cases()
    pools = []

    def pool(args, only, n, tmp, tag):
        pools.append((list(only), n, tag))
        if not tag:
            return [_result(name, not why, why) for name, why in zip(names, first_reasons)
                    if why is not None and name in only], [0] * n
        return [_result(name, True) for name in only], [0] * n

    monkeypatch.setattr(runner, "_pool", pool)
    out = tmp_path / "result.json"
    code = runner.main(["--device", "cpu", "--jobs", str(jobs), "--out", str(out), "--only", *names, *extra])
    return code, json.loads(out.read_text()), pools, names


def test_a_case_out_of_gpu_memory_runs_again_in_a_quarter_of_the_pool(monkeypatch, tmp_path):
    oom = "raised OutOfMemoryError: CUDA out of memory. Tried to allocate 500.00 MiB."
    code, report, pools, names = _run(monkeypatch, tmp_path, [oom, ""], jobs=8)
    assert code == 0
    assert pools[1] == ([names[0]], 1, "retry-")
    assert report["rerun_after_resource_errors"] == [names[0]]
    assert all(r["passed"] for r in report["cases"]) and len(report["cases"]) == 2


def test_other_failures_are_not_run_again(monkeypatch, tmp_path):
    code, report, pools, names = _run(monkeypatch, tmp_path, ["max error 3.2 > bound 0.1", ""], jobs=8)
    assert code == 1
    assert len(pools) == 1 and report["rerun_after_resource_errors"] == []
    assert [r["passed"] for r in report["cases"] if r["name"] == names[0]] == [False]


def test_one_worker_has_nothing_smaller_to_retry_in(monkeypatch, tmp_path):
    code, report, pools, _ = _run(monkeypatch, tmp_path, ["AcceleratorError: CUDA error: out of memory", ""], jobs=1)
    assert code == 1 and len(pools) == 1


@pytest.mark.parametrize("reason", [
    "raised RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm(...)`",
    "raised RuntimeError: cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
    "raised AcceleratorError: CUDA error: unknown error",
])
def test_library_errors_of_a_full_gpu_run_again_too(monkeypatch, tmp_path, reason):
    code, report, pools, names = _run(monkeypatch, tmp_path, ["", reason], jobs=8)
    assert code == 0 and pools[1] == ([names[1]], 1, "retry-")
    assert report["rerun_after_resource_errors"] == [names[1]]


def test_a_run_out_of_budget_writes_its_result_and_a_rerun_completes_it(monkeypatch, tmp_path):
    # the first call: its deadline has passed once the first case ran, so the second stays unrun
    code, report, _, names = _run(monkeypatch, tmp_path, ["", None], jobs=2, extra=["--budget", "-1"])
    assert code == 1
    unrun = [r for r in report["cases"] if not r["passed"]]
    assert [r["name"] for r in unrun] == [names[1]] and unrun[0]["reason"].startswith(runner.NOT_RUN)
    assert "budget" in unrun[0]["reason"]
    first = tmp_path / "first.json"
    (tmp_path / "result.json").rename(first)
    # the second call runs only the unrun case and keeps the first call's pass
    code, report, pools, _ = _run(monkeypatch, tmp_path, ["", ""], jobs=2, extra=["--rerun-failed", str(first)])
    assert code == 0 and pools[0][0] == [names[1]]
    assert sorted(r["name"] for r in report["cases"]) == sorted(names)


def test_rerun_failed_refuses_a_result_of_other_code(monkeypatch, tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"source_digest": "0" * 64, "cases": []}))
    with pytest.raises(SystemExit, match="another source digest"):
        _run(monkeypatch, tmp_path, ["", ""], jobs=2, extra=["--rerun-failed", str(other)])


def test_workers_stop_claiming_cases_at_the_deadline(tmp_path):
    args = runner.argparse.Namespace(only=["rms_norm_residual"], device="cpu", timings=str(tmp_path / "none.json"),
                                     claims=str(tmp_path), deadline=time.time() - 1, worker=0,
                                     out=str(tmp_path / "part.json"), reuse_plain=None)
    assert runner._worker(args) == 0
    assert not list(tmp_path.glob("case*"))


def test_default_jobs_on_the_cpu_is_bounded_by_cpus():
    assert 1 <= runner.default_jobs("cpu") <= 8


def test_past_the_deadline_a_resource_failure_stays_failed_for_the_next_call(monkeypatch, tmp_path):
    oom = "raised OutOfMemoryError: CUDA out of memory."
    code, report, pools, names = _run(monkeypatch, tmp_path, [oom, ""], jobs=8, extra=["--budget", "-1"])
    assert code == 1 and len(pools) == 1 and report["rerun_after_resource_errors"] == []
    assert [r["passed"] for r in report["cases"] if r["name"] == names[0]] == [False]
