"""`fusionpass check`'s runner: cases that ran out of GPU memory in the shared pool run again in a
smaller one, and the result file says which. The worker pool is replaced by a stand-in here (the
real one starts processes that share a GPU)."""
import json

from fusionpass.conformance import __main__ as runner


def _result(name, passed, reason=""):
    fusion, variant = name.split("/")[:2]
    return {"name": name, "fusion": fusion, "variant": variant, "passed": passed, "reason": reason}


def _two_cases():
    return [c.name for c in runner._selected(["rms_norm_residual"], "cpu")[:2]]


def _run(monkeypatch, tmp_path, first_reasons, jobs):
    names = _two_cases()
    pools = []

    def pool(args, only, n, tmp, tag):
        pools.append((list(only), n, tag))
        if not tag:
            return [_result(name, not why, why) for name, why in zip(names, first_reasons)], [0] * n
        return [_result(name, True) for name in only], [0] * n

    monkeypatch.setattr(runner, "_pool", pool)
    out = tmp_path / "result.json"
    code = runner.main(["--device", "cpu", "--jobs", str(jobs), "--out", str(out), "--only", *names])
    return code, json.loads(out.read_text()), pools, names


def test_a_case_out_of_gpu_memory_runs_again_in_a_quarter_of_the_pool(monkeypatch, tmp_path):
    oom = "raised OutOfMemoryError: CUDA out of memory. Tried to allocate 500.00 MiB."
    code, report, pools, names = _run(monkeypatch, tmp_path, [oom, ""], jobs=8)
    assert code == 0
    assert pools[1] == ([names[0]], 1, "oom-")
    assert report["rerun_out_of_memory"] == [names[0]]
    assert all(r["passed"] for r in report["cases"]) and len(report["cases"]) == 2


def test_other_failures_are_not_run_again(monkeypatch, tmp_path):
    code, report, pools, names = _run(monkeypatch, tmp_path, ["max error 3.2 > bound 0.1", ""], jobs=8)
    assert code == 1
    assert len(pools) == 1 and report["rerun_out_of_memory"] == []
    assert [r["passed"] for r in report["cases"] if r["name"] == names[0]] == [False]


def test_one_worker_has_nothing_smaller_to_retry_in(monkeypatch, tmp_path):
    code, report, pools, _ = _run(monkeypatch, tmp_path, ["AcceleratorError: CUDA error: out of memory", ""], jobs=1)
    assert code == 1 and len(pools) == 1
