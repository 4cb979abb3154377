"""`fusionpass bench` on real model configs, in-process on the CPU: a tiny Llama by family name
(train, generate), a tiny BERT (masked LM: train, infer), a Llama config.json with --ablation
(infer); the overrides, the errors and the chart without running a model.

The runs use one narrow layer, a 256-token vocabulary, every cost-rule bound opened (the GPU rules
would keep most fusions out at width 64) and one timing call per version: compiling under the
Triton interpreter is what they spend their time on.
"""
from __future__ import annotations

import json
import re
import sys
import types

import pytest

transformers = pytest.importorskip("transformers")

from fusionpass import bench, bench_report, cli, demo  # noqa: E402

TINY = ["--layers", "1", "--width", "64", "--seq", "16", "--batch", "2", "--vocab", "256", "--device", "cpu",
        "--rounds", "1", "--iters", "1", "--warmup", "0", "--open-cost-rules"]


def run_bench(capsys, *args) -> str:
    assert cli.main(["bench", *args]) == 0
    captured = capsys.readouterr()
    assert "[fusionpass bench] done in" in captured.err  # progress goes to stderr
    return captured.out


def table_rows(out: str) -> list[list[str]]:
    """The cells of the markdown table's body rows."""
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r] for r in rows[1:]]  # without the header row


def test_llama_train_generate(capsys, tmp_path):
    out = run_bench(capsys, "--model", "llama", *TINY, "--step", "train,generate", "--new-tokens", "2",
                    "--json", str(tmp_path / "bench.json"), "--out", str(tmp_path / "bench.md"))
    # the header: date, device, versions, the command
    assert re.match(r"fusionpass bench, \d{4}-\d\d-\d\d, cpu .*torch .*triton .*transformers 5\.", out), out
    assert "`fusionpass bench --model llama --layers 1" in out
    assert "LlamaForCausalLM (AutoModelForCausalLM)" in out
    assert "peak memory is measured on CUDA only" in out
    rows = table_rows(out)
    assert [(r[0], r[1]) for r in rows] == [(step, version) for step in ("train", "generate")
                                            for version in ("torch.compile", "fusionpass")]
    assert all(r[5] == "-" for r in rows)  # peak memory: CUDA only
    assert (tmp_path / "bench.md").read_text() == out

    data = json.loads((tmp_path / "bench.json").read_text())
    assert {"date", "device", "torch", "triton", "transformers", "command"} <= set(data["environment"])
    assert data["model"]["class"] == "LlamaForCausalLM" and data["model"]["task"] == "causal-lm"
    assert data["options"]["steps"] == ["train", "generate"]
    for row in data["rows"]:
        assert {"step", "version", "fusions", "ms", "tokens_per_s", "speedup", "peak_mib", "first_call_s",
                "graph_breaks"} <= set(row)
        assert row["ms"] > 0 and row["peak_mib"] is None
    matches = {r["step"]: r["matches"] for r in data["rows"] if r["version"] == "fusionpass"}
    # the model returns logits that require grad: the loss stays with Inductor (loss_only fuses it)
    assert matches["train"] == {"rms_norm_residual": 3, "rope": 1, "sdpa_mask": 1, "swiglu_mlp": 1}
    assert matches["generate"].get("decode_attention")  # the decode step's attention
    # the match counts are in the table too
    train_fused = rows[1]
    assert train_fused[7] == "rms_norm_residual 3, rope 1, sdpa_mask 1, swiglu_mlp 1"
    # generate's tokens/s counts the new tokens: batch 2 x 2 tokens
    gen = next(r for r in data["rows"] if r["step"] == "generate")
    assert gen["tokens_per_s"] == pytest.approx(4 / gen["ms"] * 1e3, abs=0.1)


def test_bert_masked_lm(capsys):
    out = run_bench(capsys, "--model", "bert", *TINY, "--step", "train,infer,generate")
    assert "BertForMaskedLM (AutoModelForMaskedLM)" in out
    assert "generate skipped: masked-lm models do not generate" in out
    rows = table_rows(out)
    assert [(r[0], r[1]) for r in rows] == [("train", "torch.compile"), ("train", "fusionpass"),
                                            ("infer", "torch.compile"), ("infer", "fusionpass")]
    assert "layer_norm_dropout_residual 2" in rows[1][7] and "sdpa_mask 1" in rows[1][7]
    assert "layer_norm_dropout_residual 2" in rows[3][7]


def test_config_json_with_overrides_and_ablation(capsys, tmp_path):
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256)
    config.to_json_file(tmp_path / "config.json")
    args = ["--model", str(tmp_path / "config.json"), *TINY, "--step", "infer", "--ablation",
            "--json", str(tmp_path / "bench.json")]
    run_bench(capsys, *args)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["model"]["config"] == str(tmp_path / "config.json")
    # --layers 1 --width 64 on a 2-layer, 128-wide config with head_dim 32 and 2 query heads per kv head
    assert data["model"]["changes"] == ["num_hidden_layers 2 -> 1", "hidden_size 128 -> 64",
                                        "num_attention_heads 4 -> 2", "num_key_value_heads 2 -> 1",
                                        "intermediate_size 256 -> 128"]
    rows = data["rows"]
    full = rows[1]["matches"]
    assert full == {"rms_norm_residual": 3, "rope": 1, "sdpa_mask": 1, "swiglu_mlp": 1}
    assert [r["version"] for r in rows] == ["torch.compile", "fusionpass", *(f"only {f}" for f in full)]
    for row in rows[2:]:  # each matched fusion alone matches as it did with every fusion on
        (fusion,) = row["fusions"]
        assert row["matches"] == {fusion: full[fusion]}


def test_resize():
    llama = demo.base_config("llama")[0]
    cls = transformers.LlamaConfig
    resized = demo.resize(llama, cls, layers=8, width=2048)
    c = resized.config
    # head_dim kept, heads follow the width, the kv ratio (1:1 in Llama's defaults) kept
    assert (c["num_hidden_layers"], c["hidden_size"], c["head_dim"]) == (8, 2048, 128)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]) == (16, 16, 5504)
    c = demo.resize(llama, cls, width=2048, kv_heads=4, intermediate=8192).config
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]) == (16, 4, 8192)
    mistral = demo.base_config("mistral")[0]  # 32 query heads, 8 kv heads
    c = demo.resize(mistral, transformers.MistralConfig, width=1024).config
    assert (c["num_attention_heads"], c["num_key_value_heads"]) == (8, 2)
    # GPT-2 keeps them under its own names; head_dim is derived (width / heads)
    gpt2 = demo.base_config("gpt2")[0]
    resized = demo.resize(gpt2, transformers.GPT2Config, layers=2, width=256, vocab=1000, positions=2048)
    assert [resized.config[k] for k in ("n_layer", "n_embd", "n_head", "n_positions", "bos_token_id")] == \
        [2, 256, 4, 2048, 0]  # head_dim 64 kept; positions grown; a token id beyond the vocabulary -> 0
    # per-layer lists follow the layer count
    qwen2 = demo.base_config("qwen2")[0]
    assert len(demo.resize(qwen2, transformers.Qwen2Config, layers=3).config["layer_types"]) == 3
    with pytest.raises(ValueError, match="does not divide"):
        demo.resize(llama, cls, width=2048, kv_heads=3)
    # the override reaches the model
    built = demo.build_hf("gpt2", layers=1, width=64, vocab=256)
    assert (built.config.n_layer, built.config.n_embd, built.task) == (1, 64, "causal-lm")
    assert demo.task_of("bert") == "masked-lm" and demo.task_of("llama") == "causal-lm"


def test_unknown_family(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["bench", "--model", "lama", "--device", "cpu"])
    message = str(err.value)
    assert "unknown model 'lama'" in message and "did you mean llama" in message
    assert "--list-models" in message
    with pytest.raises(SystemExit, match="no config file"):
        cli.main(["bench", "--model", "missing/config.json", "--device", "cpu"])
    with pytest.raises(SystemExit, match="unknown step"):
        cli.main(["bench", "--model", "llama", "--step", "train,decode", "--device", "cpu"])
    assert cli.main(["bench", "--list-models"]) == 0
    assert {"llama", "bert", "falcon"} <= set(capsys.readouterr().out.split())


def test_png_needs_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match=r"--png needs matplotlib: pip install 'fusionpass\[bench\]'"):
        cli.main(["bench", "--model", "llama", *TINY, "--png", str(tmp_path / "chart.png")])
    assert not (tmp_path / "chart.png").exists()


def test_png_chart(tmp_path):
    pytest.importorskip("matplotlib")
    subject = bench.Subject(model=None, task="causal-lm", vocab=256, can_generate=True,
                                  description="a model", source="test")
    rows = [{"step": "train", "version": v, "speedup": s, "peak_mib": m}
            for v, s, m in (("torch.compile", 1.0, 100.0), ("fusionpass", 1.2, 80.0), ("only rope", 0.9, 100.0))]
    result = bench.BenchResult(subject, bench.BenchOptions(), rows, [])
    bench_report.write_bench_png(result, tmp_path / "chart.png")
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_short_steps_get_longer_samples(monkeypatch):
    # min_sample_ms: a 2 ms call timed in samples of at least 30 ms (15 calls), not of `iters` (3).
    # The 2 ms are a fake clock's: a slept 2 ms is longer on a busy machine, and the count with it.
    clock = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        clock[0] += 0.002

    bench.time_interleaved({"fast": fast, "slow": slow}, "cpu", rounds=2, iters=3, warmup=1, min_sample_ms=30)
    # one warm-up, one measuring call, two rounds of 15 calls (the slowest fn sets them)
    assert calls["fast"] == calls["slow"] == 2 + 2 * 15
    bench.time_interleaved({"slow": slow}, "cpu", rounds=2, iters=3, warmup=1)
    assert calls["slow"] - calls["fast"] == 1 + 2 * 3
