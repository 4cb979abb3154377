"""The benchmark suite (benchmarks/suite.py): a CPU smoke run of some of its topics writes tables
with their header and rows, and README.md's performance table is what the suite generates from the
committed benchmarks/results/latest files."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ("date", "gpu", "torch", "triton", "transformers", "command")


def _suite():
    return load_script("benchmark_suite", ROOT / "benchmarks" / "suite.py")


def test_smoke_run_writes_each_topic(tmp_path):
    # A kernel case, one through HF attention layers, and one model step (which also makes the
    # compile-time topic): each kind of code path, in a subprocess as the GPU runs it, at the
    # cheapest cases (the whole smoke takes minutes on two cores).
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--smoke", "--device", "cpu",
           "--only", "rms_norm_residual,sdpa_mask,models,compile-time", "--out-dir", str(tmp_path),
           "--case", "8x4096, train;Llama sdpa;GQA 16/4, inference"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    expected_rows = {"rms_norm_residual": 1, "sdpa_mask": 1, "models": 1, "compile-time": 1}
    for topic, n in expected_rows.items():
        data = json.loads((tmp_path / f"{topic}.json").read_text())
        md = (tmp_path / f"{topic}.md").read_text()
        for key in HEADER:
            assert data["environment"][key], (topic, key)
            assert f"- {key}: " in md, (topic, key)
        assert "--smoke" in data["environment"]["command"]
        rows = data["rows"]
        assert len(rows) == n, (topic, rows)
        for row in rows:
            assert "error" not in row and "skipped" not in row, (topic, row)
            assert row["case"] in md
            if topic == "compile-time":
                assert row["plain_s"] > 0 and row["fusionpass_s"] > 0
                continue
            assert row["plain_ms"] > 0 and row["fusionpass_ms"] > 0
            if topic != "models":  # a kernel case's fusion must match, or the row says it did not
                assert all(row["matched"].values()) and not row["note"], row


def test_regional_smoke_run(tmp_path):
    # the regional topic's cases (torchtitan-style, every block and the loss region compiled on
    # their own) at one narrow layer: each row is measured, and the fusionpass side's blocks and
    # loss region are two graphs that match the norms and the loss
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--smoke", "--device", "cpu",
           "--only", "regional", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "regional.json").read_text())
    assert "--only regional" in " ".join(data["environment"]["command"].split())
    rows = data["rows"]
    assert [r["case"].split(", ")[-1].split(" ")[0] for r in rows] == ["complex", "rotate_half"], rows
    for row in rows:
        assert "error" not in row and "skipped" not in row, row
        assert row["plain_ms"] > 0 and row["fusionpass_ms"] > 0
        assert row["graphs"] == 2, row
        # both norms of the block and the final norm; the loss; the real rotation only
        assert row["matched"]["rms_norm_residual"] == 3 and row["matched"]["linear_cross_entropy"] == 1, row
        assert row["matched"].get("rope", 0) == (1 if "rotate_half" in row["case"] else 0), row


def test_families_smoke_run(tmp_path):
    # the census families topic (issue 43) on the census's tiny Llama: a measured row with what
    # matched and the near misses of the cost rules the tiny widths fall outside
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--smoke", "--device", "cpu",
           "--only", "families", "--case", "llama:", "--out-dir", str(tmp_path)]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bf16, amp = json.loads((tmp_path / "families.json").read_text())["rows"]
    assert bf16["case"].startswith("llama: the census's tiny config, bf16 weights") and bf16["dtype"] == "float32"
    assert amp["case"].startswith("llama: the census's tiny config, Trainer autocast") and amp["dtype"] == "bf16 autocast"
    for row in (bf16, amp):
        assert "error" not in row and row["plain_ms"] > 0 and row["fusionpass_ms"] > 0, row
        assert row["matched"]["flash_attention"] == 2 and row["matched"]["swiglu_mlp"] == 2, row
        assert "rms_norm_residual: width: row width 256 outside" in row["near_misses"], row
        # install()'s Trainer runs Llama's loss through loss_only: the logits are no output to keep
        assert row["trainer_loss"] == "loss_only" and "returned with requires_grad" not in row["near_misses"], row
    # every census family has the widths of a checkpoint to be measured at, and its config takes
    # them (a config that maps one name onto another, as GPT-2's, must not fall back to the tiny one)
    import transformers

    from fusionpass.conformance import families

    suite = _suite()
    assert set(suite.FAMILY_WIDTHS) == set(families.FAMILIES)
    for name, family in families.FAMILIES.items():
        widths = suite.FAMILY_WIDTHS[name][1]
        cfg = getattr(transformers, family.config)(**suite.family_config(name, smoke=False))
        assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (
            widths.get("hidden_size", widths.get("n_embd")), suite.FAMILY_LAYERS, widths["vocab_size"]), name
        assert cfg.max_position_embeddings >= 1024, name


def test_an_error_becomes_a_row():
    suite = _suite()

    def broken():
        raise RuntimeError("no such kernel")

    row = suite.guarded(broken, {"case": "x", "mode": "train"})
    assert row["error"] == "RuntimeError: no such kernel"
    assert "ERROR: RuntimeError: no such kernel" in "\n".join(suite.markdown_table([row], suite.KERNEL_COLUMNS))


def test_an_unregistered_fusion_is_skipped():
    suite = _suite()
    assert suite.registered("rms_norm_residual") == "rms_norm_residual"
    assert suite.registered("no_such_fusion") is None
    for name in ("sdpa_mask", "flash_attention"):
        assert suite.registered(name) is not None


def test_a_fusion_folder_brings_its_own_topics(tmp_path, monkeypatch):
    # a fusion's bench.py is found without a central edit and its topics stand at its ORDER; a
    # topic that another folder declares is refused
    import fusionpass.fusions

    suite = _suite()
    folders = {"toy_bench": "ORDER = 55\nTOPICS = {'toy': list}\n",
               "toy_bench_again": "ORDER = 56\nTOPICS = {'rope': list}\n"}
    for name, text in folders.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "bench.py").write_text(text)
    monkeypatch.setattr(fusionpass.fusions, "__path__", [*fusionpass.fusions.__path__, str(tmp_path)])
    imported = [f"fusionpass.fusions.{name}{module}" for name in folders for module in ("", ".bench")]
    try:
        with pytest.raises(ValueError, match="toy_bench_again.bench declares topic.*rope"):
            suite.kernel_topics()
        (tmp_path / "toy_bench_again" / "bench.py").write_text("ORDER = 56\nTOPICS = {}\n")
        sys.modules.pop("fusionpass.fusions.toy_bench_again.bench")
        topics = list(suite.kernel_topics())
        assert topics[topics.index("decode_attention") + 1:][:2] == ["toy", "sdpa_mask"], topics
    finally:
        for module in imported:
            sys.modules.pop(module, None)


def test_readme_table_is_generated_from_the_latest_results():
    suite = _suite()
    if not any(suite.LATEST.glob("*.json")):
        pytest.skip("benchmarks/results/latest/ has no results yet")
    text = (ROOT / "README.md").read_text()
    begin, end = text.index(suite.README_BEGIN), text.index(suite.README_END) + len(suite.README_END)
    assert text[begin:end] == suite.readme_section(), (
        "README.md's performance table is out of date: python benchmarks/suite.py --readme")


def test_a_row_that_ran_apart_names_its_gpu(tmp_path):
    """A row merged into latest/ from another run keeps that run's environment: the README's table
    names its GPU in the case cell and lists its environment among the ones measured on."""
    suite = _suite()
    env = {"date": "2026-12-01", "gpu": "GPU A", "torch": "2.11", "triton": "3.6", "transformers": "5.17"}
    row = {"case": "m", "mode": "train", "plain_ms": 2.0, "fusionpass_ms": 1.0, "ratio": 2.0, "matched": {}}
    apart = {**row, "case": "n", "environment": {**env, "gpu": "GPU B", "date": "2026-12-06"}}
    (tmp_path / "models.json").write_text(json.dumps({"topic": "models", "environment": env, "rows": [row, apart]}))
    text = suite.readme_section(tmp_path)
    assert "| models | m | train |" in text and "| models | n (GPU B) | train |" in text
    assert "Measured on GPU A (" in text and "Measured on GPU B (" in text and "2026-12-06;" in text


def test_families_from_two_runs(tmp_path):
    """--merge: the census's rows from two runs in one table; a case skipped in the first run (its
    budget spent) is the second run's row, which keeps that run's environment; the summary states
    issue 43's bars (the median, the families below 1.00x) per dtype, over the training rows."""
    suite = _suite()
    env = {"date": "2026-12-07", "gpu": "GPU A", "torch": "2.11", "triton": "3.6", "command": "first", "seconds": 5}

    def row(name, ratio=None, dtype="bfloat16"):
        head = {"case": f"{name}: W widths, 2L", "mode": "train", "dtype": dtype}
        return {**head, "skipped": "budget"} if ratio is None else {**head, "plain_ms": 1.0, "fusionpass_ms": 1.0,
                                                                    "ratio": ratio}

    runs = []
    for i, rows in enumerate(([row("t5", 1.02), row("gemma2")], [row("gemma2", 0.97), row("llama", 1.2),
                                                                  row("llama", 1.1, "bf16 autocast")])):
        runs.append(tmp_path / f"run{i}")
        runs[-1].mkdir()
        (runs[-1] / "families.json").write_text(json.dumps(
            {"topic": "families", "environment": {**env, "command": f"run {i}"}, "rows": rows}))
    suite.main(["--merge", ",".join(map(str, runs)), "--only", "families", "--out-dir", str(tmp_path / "out")])
    merged = json.loads((tmp_path / "out" / "families.json").read_text())
    assert [(r["case"].split(":")[0], r.get("ratio")) for r in merged["rows"]] == [
        ("t5", 1.02), ("gemma2", 0.97), ("llama", 1.2), ("llama", 1.1)]
    assert "environment" not in merged["rows"][0] and merged["rows"][1]["environment"]["command"] == "run 1"
    assert merged["environment"]["command"] == "run 0; run 1" and merged["environment"]["seconds"] == 10
    text = (tmp_path / "out" / "families.md").read_text()
    assert ("Training, bfloat16: 3 families, median plain / fusionpass 1.020x, lowest 0.970x; below 1.00x: "
            "gemma2 0.970x.") in text
    assert "Training, bf16 autocast: 1 families" in text and "below 1.00x: none." in text


def test_readme_trainer_table_is_generated_from_its_result():
    """README's first table (what a Trainer user gets) is benchmarks/results/latest/trainer.json's."""
    suite = _suite()
    text = (ROOT / "README.md").read_text()
    begin, end = text.index(suite.TRAINER_BEGIN), text.index(suite.TRAINER_END) + len(suite.TRAINER_END)
    assert text[begin:end] == suite.trainer_section(), (
        "README.md's Trainer table is out of date: python benchmarks/suite.py --readme")
    assert text.index(suite.TRAINER_BEGIN) < text.index("\n|"), "the Trainer table must be README's first"


def test_trainer_first_steps_say_where_each_row_was_measured(tmp_path):
    """The README's first-step rows name each row's date and source: a row merged from another run
    carries its own environment."""
    suite = _suite()
    env = {"date": "2026-12-01", "gpu": "GPU A", "fusionpass source digest": "aaaaaaaa11"}
    row = {"case": "Trainer, bf16 weights", "cache": "cold", "plain_s": 10.0, "fusionpass_s": 11.0, "added": 0.1}
    apart = {**row, "case": "Trainer, fp32 weights", "environment": {**env, "fusionpass source digest": "bbbbbbbb22"}}
    (tmp_path / "trainer-compile-time.json").write_text(json.dumps({"environment": env, "rows": [row, apart]}))
    lines = suite.trainer_compile_time_lines(tmp_path)
    assert "| Trainer, bf16 weights | cold | 10.0 | 11.0 | +10.0% | 2026-12-01, source aaaaaaaa |" in lines
    assert "| Trainer, fp32 weights | cold | 10.0 | 11.0 | +10.0% | 2026-12-01, source bbbbbbbb |" in lines


def _trainer_script():
    return load_script("trainer_bench", ROOT / "benchmarks" / "trainer.py")


def test_trainer_compile_time_rows_from_runs():
    """--compile-time's rows: per weight dtype, cold and warm (and the in-process breakdown run),
    plain's and fusionpass's first steps and the added share; the breakdown's lines name where the
    seconds went."""
    trainer = _trainer_script()
    breakdown = {"phases_s": {"compile_fx_inner": 20.0}, "unique_graphs": 1, "graph_breaks": 0, "caches": {},
                 "triton": {"total_s": 9.0, "kernels": 30, "inductor_generated_s": 5.0, "ttir_s": 3.0,
                            "ttir_calls": {"_bwd_dq_kernel": [16, 2.0]}, "user_kernels_s": {"_fwd_kernel": 1.5}}}
    runs = [{"weights": "fp32", "side": "plain", "cache": "cold", "first_step_s": 20.0},
            {"weights": "fp32", "side": "plain", "cache": "warm", "first_step_s": 8.0},
            {"weights": "fp32", "side": "fusionpass", "cache": "cold", "first_step_s": 25.0, "pass_s": 0.4},
            {"weights": "fp32", "side": "fusionpass", "cache": "warm", "first_step_s": 8.4, "pass_s": 0.4},
            {"weights": "fp32", "side": "fusionpass", "cache": "cold, in-process compile", "first_step_s": 40.0,
             "breakdown": breakdown},
            {"weights": "bf16", "side": "plain", "cache": "cold", "error": "boom"},
            {"weights": "bf16", "side": "fusionpass", "cache": "cold", "first_step_s": 1.0}]
    rows = trainer.compile_time_rows(runs)
    cold, warm, inproc, bf16 = rows
    assert (cold["case"], cold["cache"], cold["added"], cold["pass_s"]) == ("Trainer, fp32 weights", "cold", 0.25, 0.4)
    assert (warm["cache"], warm["added"]) == ("warm", 0.05)
    assert inproc["cache"] == "cold, in-process compile" and "not run" in inproc["error"]
    assert bf16["case"] == "Trainer, bf16 weights" and "boom" in bf16["error"]
    (line,) = [x for x in trainer.breakdown_lines(runs) if x.startswith("- ")]
    assert "30 kernels in 9.0 s" in line and "_bwd_dq_kernel 16x 2.0 s" in line and "_fwd_kernel 1.5" in line


def test_trainer_breakdown_run_on_the_cpu(tmp_path):
    """One --breakdown run of the tiny model (in its own process, as --compile-time spawns it):
    first step, Dynamo's phases and cache counters, and the Triton clocks are reported."""
    out = tmp_path / "run.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trainer.py"), "--one", "fp32", "fusionpass", "--json", str(out),
           "--smoke", "--device", "cpu", "--steps", "2", "--batch", "2", "--seq", "32", "--breakdown"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["first_step_s"] > 0 and run["pass_s"] > 0 and run["matched"]
    # each attention match names its kernel
    assert sum(run["kernels"].values()) == run["matched"].get("flash_attention", 0) > 0, run
    b = run["breakdown"]
    assert b["unique_graphs"] >= 1 and b["phases_s"] and any(k.startswith("inductor.fxgraph_cache") for k in b["caches"])
    assert set(b["triton"]) >= {"total_s", "kernels", "ttir_s", "ttir_calls", "user_kernels_s"}


def test_trainer_at_its_own_logging_cadence(tmp_path):
    """--logging-steps N: the Trainer logs every N steps (its losses are those), and step ms is the mean
    between two synchronized marks rather than a median of synchronized steps."""
    out = tmp_path / "run.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "trainer.py"), "--one", "bf16", "plain", "--json", str(out),
           "--smoke", "--device", "cpu", "--steps", "6", "--batch", "2", "--seq", "32", "--logging-steps", "3"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["logging_steps"] == 3 and len(run["losses"]) == 2 and run["step_ms"] > 0
    # one logged loss per side: no loss curve to compare, rather than a gap of zero
    trainer = _trainer_script()
    assert trainer.spread([1.0], [2.0]) is None
    (row, _) = trainer.rows_of([{**run, "weights": "fp32", "side": s, "losses": [1.0]} for s in ("plain", "fusionpass")])
    assert row["loss_gap"] is None and row["ratio"] == 1.0


def test_trainer_runs_are_written_as_they_finish(tmp_path):
    """A run stopped by the GPU machine's time limit keeps the runs it finished (and --rewrite reads them)."""
    trainer = _trainer_script()
    path = tmp_path / "trainer_runs.json"
    runs = trainer._Runs(path)
    runs.append({"weights": "bf16", "side": "plain"})
    assert json.loads(path.read_text()) == [{"weights": "bf16", "side": "plain"}]
    runs.append({"weights": "bf16", "side": "fusionpass"})
    assert [r["side"] for r in json.loads(path.read_text())] == ["plain", "fusionpass"]


def test_fusionpass_cache_keys_hold_across_processes_on_the_cpu(tmp_path):
    """benchmarks/probes/cache_keys.py on the tiny Trainer run: a second process computes the same FX
    graph keys as the first and hits the cache (on torch 2.11 keys hang on the pass's pickle: test_api's
    test_pass_pickles_the_same_in_every_process)."""
    probe = load_script("cache_keys_probe", ROOT / "benchmarks" / "probes" / "cache_keys.py")
    out = tmp_path / "keys.json"
    assert probe.main(["--smoke", "--device", "cpu", "--seq", "32", "--batch", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    fx = result["differences"]["fx_graph"]
    assert fx and all(row["same key"] for row in fx), fx
    assert result["processes"]["warm"]["caches"].get("inductor.fxgraph_cache_hit") == len(fx)


def test_trainer_profile_families():
    """benchmarks/probes/trainer_profile.py: kernel names to families (first match wins: an Inductor
    kernel named after SDPA stays Inductor's), and ms per step summed over the profiled steps."""
    probe = load_script("trainer_profile_probe", ROOT / "benchmarks" / "probes" / "trainer_profile.py")
    assert probe.family("triton_per_fused__scaled_dot_product_attention_0") == "Inductor-generated Triton"
    assert probe.family("_bwd_dkdv_kernel") == "fusionpass Triton"
    assert probe.family("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "SDPA library attention (cuDNN, flash)"
    assert probe.family("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "GEMM (cuBLAS, CUTLASS)"
    assert probe.family("void at::native::multi_tensor_apply_kernel<FusedAdam>") == "optimizer"
    assert probe.family("ncclDevKernel") == probe.OTHER
    s = probe.summary([("_fwd_kernel", 3000.0, 6), ("triton_poi_0", 1500.0, 3), ("ncclDevKernel", 300.0, 3)], steps=3)
    assert s["ms_per_step"] == {"fusionpass Triton": 1.0, "Inductor-generated Triton": 0.5, probe.OTHER: 0.1}
    assert s["total_ms_per_step"] == 1.6 and s["largest"][0] == {
        "name": "_fwd_kernel", "ms_per_step": 1.0, "calls_per_step": 2.0, "family": "fusionpass Triton"}


def test_trainer_profile_host_syncs():
    """The host side of a CUDA profile: its largest ops per step, and the ops that wait for the GPU."""
    probe = load_script("trainer_profile_probe", ROOT / "benchmarks" / "probes" / "trainer_profile.py")
    host = [("aten::mm", 600.0, 30), ("aten::_local_scalar_dense", 9000.0, 3), ("cudaStreamSynchronize", 30.0, 3)]
    h = probe.host_summary(host, steps=3)
    assert h["largest"][0] == {"name": "aten::_local_scalar_dense", "ms_per_step": 3.0, "calls_per_step": 1.0}
    assert [r["name"] for r in h["syncs"]] == ["aten::_local_scalar_dense", "cudaStreamSynchronize"]


def test_trainer_gaps_from_a_timeline():
    """benchmarks/probes/trainer_gaps.py: the GPU's idle gaps in a Chrome trace, each with the host ops
    around the launch that ended it and the host call that preceded it, summed by launching op."""
    probe = load_script("trainer_gaps_probe", ROOT / "benchmarks" / "probes" / "trainer_gaps.py")
    ev = [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 0, "dur": 100, "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 50, "dur": 52, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "fusionpass::op", "ts": 110, "dur": 200, "tid": 7},
        {"ph": "X", "cat": "cpu_op", "name": "## Call CompiledFxGraph x ##", "ts": 105, "dur": 400, "tid": 7},
        {"ph": "X", "cat": "cuda_runtime", "name": "cuLaunchKernel", "ts": 300, "dur": 5, "tid": 7,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 310, "dur": 50, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "k3", "ts": 365, "dur": 50, "args": {"correlation": 3}},
    ]
    rows = probe.gaps(ev, min_gap_us=20)
    assert rows == [{"gap_us": 210.0, "next": "k2", "after": "cudaStreamSynchronize", "launch_after_idle_us": 200.0,
                     "launched_by": ["## Call CompiledFxGraph x ##", "fusionpass::op"]}]
    s = probe.summary(rows, steps=2)
    assert s["idle_ms_per_step"] == 0.105 and s["by_launching_op_ms_per_step"] == {"fusionpass::op": 0.105}
    # past the largest `attributed` gaps the rest are counted, not read
    (row,) = probe.gaps(ev, min_gap_us=20, attributed=0)
    assert row == {"gap_us": 210.0, "next": "k2"}
    assert probe.summary([row], steps=2)["by_launching_op_ms_per_step"] == {"(not attributed)": 0.105}


def test_trainer_rows_from_runs():
    """benchmarks/trainer.py's rows: plain / fusionpass per weight dtype, and an error row where a side failed."""
    trainer = _trainer_script()
    run = dict(step_ms=90.0, peak_gib=20.0, first_step_s=30.0, losses=[10.0, 9.0, 8.5], matched={})
    runs = [{**run, "weights": "fp32", "side": "plain"},
            {**run, "weights": "fp32", "side": "fusionpass", "step_ms": 75.0, "losses": [10.0, 9.1, 8.4]},
            {"weights": "bf16", "side": "fusionpass", "error": "boom"}]
    fp32, bf16 = trainer.rows_of(runs)
    assert fp32["case"] == "Trainer, fp32 weights" and fp32["ratio"] == 1.2 and fp32["loss_gap"] == 0.1
    assert bf16["case"] == "Trainer, bf16 weights" and "boom" in bf16["error"]


def test_a_measured_topic_becomes_a_cost_table(tmp_path):
    # rms_norm_widths' rows carry their shape class (the row width); --cost-tables turns them into
    # the table fusionpass.cost.Measured reads (here from the text, not written into the package)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "suite.py"), "--smoke", "--device", "cpu",
           "--only", "rms_norm_widths", "--out-dir", str(tmp_path), "--case", "8x1024, train"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "rms_norm_widths.json").read_text())
    [row] = data["rows"]
    assert row["shape_class"] == 1024 and row["ratio"] > 0
    namespace = {}
    exec(_suite().cost_table_source("rms_norm_widths", data["rows"], data["environment"]), namespace)
    assert namespace["SPEEDUPS"] == {"training": {1024: row["ratio"]}}
    assert namespace["SOURCE"] == "benchmarks/results/latest/rms_norm_widths.md"
