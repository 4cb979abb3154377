"""The public API: the "fusionpass" backend name, fusionpass.backend(), enabled(), chaining with a
user's own pre-grad pass and its cache identity, stats()/reset_stats(), explain(), the CLI, the
environment overrides, and training with frozen weights or inputs without grad."""
from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import (
    FUSION,
    assert_outcomes_close,
    compile_and_count,
    compiling,
    counts,
    eager,
    make_backend,
    near_misses,
    run,
)
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import fusionpass
from fusionpass import cli
from fusionpass import config as config_mod
from fusionpass.demo import DemoLlama, RMSNorm
from fusionpass.passes import STATISTICS, PreGradFusionPass, chained

WIDTH = 512
BLOCK_COUNTS = counts(llama=1, llama_no_residual=1)
FUSED_OPS = {"fusionpass.rms_norm.default", "fusionpass.rms_norm_residual.default"}


class Block(nn.Module):
    """HF-Llama-style norms: norm1 reads the input (no residual), norm2 reads the residual sum."""

    def __init__(self, width=WIDTH):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        for norm in (self.norm1, self.norm2):
            nn.init.normal_(norm.weight, 1.0, 0.1)
        self.proj = nn.Linear(width, width)

    def forward(self, h):
        residual = h
        h = self.proj(self.norm1(h))
        return self.norm2(residual + h)


@pytest.fixture
def model():
    return Block()


@pytest.fixture
def x():
    return torch.randn(2, 8, WIDTH)


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch):
    for var in ("FUSIONPASS_FUSIONS", "FUSIONPASS_DISABLE", "FUSIONPASS_CPU",
                "FUSIONPASS_RMS_NORM_MAX_WIDTH"):
        monkeypatch.delenv(var, raising=False)
    # narrow test models (see conftest.py); test_width_cost_rule_default checks the default
    monkeypatch.setenv("FUSIONPASS_RMS_NORM_MIN_WIDTH", "512")


def test_width_cost_rule_default(monkeypatch, model, x):
    # The GPU cost rules by default: widths 512..8192, and of those the ones whose nearest measured
    # class was faster than plain compile (fusions/rms_norm_residual/cost_table.py).
    from fusionpass.fusions.rms_norm_residual.pattern import MEASURED

    monkeypatch.delenv("FUSIONPASS_RMS_NORM_MIN_WIDTH")
    monkeypatch.delenv("FUSIONPASS_RMS_NORM_MIN_SPEEDUP")
    cfg = config_mod.Config()
    assert (cfg.rms_norm_min_width, cfg.rms_norm_max_width, cfg.rms_norm_min_speedup) == (512, 8192, 1.0)
    with compiling():
        torch.compile(model, backend=fusionpass.backend(cpu=True))(x)  # the parameters require grad
    faster = MEASURED.nearest(WIDTH, "training")[1] >= 1.0
    assert bool(fusionpass.stats()) == faster
    reasons = [why for _, _, why in STATISTICS.near_misses]
    assert faster or (reasons and all("the nearest measured" in why for why in reasons))


def fused_ops(graph) -> set[str]:
    return {str(n.target) for n in graph.nodes if str(n.target).startswith("fusionpass.")}


class RecordingPass(CustomGraphPass):
    """A user's own pre-grad pass: records the fused ops it saw in each graph."""

    def __init__(self, key="user-pass-v1"):
        self.key = key
        self.seen: list[set[str]] = []

    def __call__(self, graph):
        self.seen.append(fused_ops(graph))

    def uuid(self):
        return self.key


# ---------------------------------------------------------------------------------------------
# backend="fusionpass"


def test_backend_name_resolves():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert "fusionpass.backend:fusionpass" in {e.value for e in eps if e.name == "fusionpass"}
    assert "fusionpass" in torch._dynamo.list_backends()


def test_backend_name_on_cpu_leaves_graphs_alone(model, x):
    got, stats = compile_and_count(model, x, backend="fusionpass")
    assert stats == {}
    assert {why.split(":")[0] for _, _, why in near_misses()} == {"device"}
    assert_outcomes_close(got, eager(model, x))


def test_backend_name_with_fusionpass_cpu_env(model, x, monkeypatch):
    monkeypatch.setenv("FUSIONPASS_CPU", "1")
    got, stats = compile_and_count(model, x, backend="fusionpass", train=True)
    assert stats == BLOCK_COUNTS
    assert_outcomes_close(got, eager(model, x, train=True))


@pytest.mark.parametrize(
    "how", [{"mode": "max-autotune-no-cudagraphs"}, {"options": {"epilogue_fusion": False}}],
    ids=["mode", "options"],
)
def test_backend_name_with_mode_or_options(model, x, monkeypatch, how):
    monkeypatch.setenv("FUSIONPASS_CPU", "1")
    with compiling():
        compiled = torch.compile(model, backend="fusionpass", **how)
        assert_outcomes_close(run(compiled, model, (x,)), eager(model, x))
        assert fusionpass.stats(variants=True) == BLOCK_COUNTS


# ---------------------------------------------------------------------------------------------
# fusionpass.backend(...)


def test_backend_with_named_fusions(model, x):
    backend = fusionpass.backend(fusions=["rms_norm_residual"], mode=None, cpu=True)
    got, stats = compile_and_count(model, x, backend=backend)
    assert stats == BLOCK_COUNTS
    assert fusionpass.stats() == {FUSION: 2}
    assert_outcomes_close(got, eager(model, x))


def test_backend_with_no_fusions(model, x):
    got, stats = compile_and_count(model, x, backend=fusionpass.backend(fusions=[], cpu=True))
    assert stats == {}
    assert near_misses() == []
    assert_outcomes_close(got, eager(model, x))


def test_backend_with_mode_and_options(model, x):
    """fusionpass.backend() takes both (torch.compile itself refuses mode= with options=)."""
    backend = fusionpass.backend(
        cpu=True, mode="max-autotune-no-cudagraphs", options={"epilogue_fusion": False}
    )
    got, stats = compile_and_count(model, x, backend=backend)
    assert stats == BLOCK_COUNTS
    assert_outcomes_close(got, eager(model, x))


def test_unknown_fusion_name():
    with pytest.raises(ValueError) as err:
        fusionpass.backend(fusions=["rms_norm_residual", "no_such_fusion"])
    message = str(err.value)
    assert "no_such_fusion" in message
    for name in fusionpass.FUSION_NAMES:
        assert name in message


def test_backend_value_semantics():
    a = fusionpass.backend(cpu=True)
    assert a == fusionpass.backend(cpu=True)
    assert hash(a) == hash(fusionpass.backend(cpu=True))
    assert a != fusionpass.backend(cpu=False)
    assert a != fusionpass.backend(cpu=True, mode="max-autotune")
    assert "rms_norm_residual" in repr(a)


# ---------------------------------------------------------------------------------------------
# enabled()


@pytest.mark.parametrize(
    "how",
    [{}, {"mode": "max-autotune-no-cudagraphs"}, {"options": {"epilogue_fusion": False}}],
    ids=["plain", "mode", "options"],
)
def test_enabled_compiled_in_block_fuses_after_it(model, x, how):
    original_compile = torch.compile
    previous_hook = inductor_config.pre_grad_custom_pass
    with compiling():
        with fusionpass.enabled(cpu=True) as cfg:
            assert cfg.cpu
            compiled = torch.compile(model, **how)
        assert torch.compile is original_compile
        assert inductor_config.pre_grad_custom_pass is previous_hook
        got = run(compiled, model, (x,), train=True)  # first call (and compile) after the block
        if "mode" in how:
            # the mode reaches the pass: training under max-autotune is not selected (fusionpass.cost)
            assert fusionpass.stats(variants=True) == {}
            assert near_misses() and all("Inductor autotunes" in why for _, _, why in near_misses())
        else:
            assert fusionpass.stats(variants=True) == BLOCK_COUNTS
    assert_outcomes_close(got, eager(model, x, train=True))


def test_enabled_fuses_compiles_that_run_in_the_block(model, x):
    """A model compiled before the block with the default backend, first run inside it, and a
    model compiled and run inside it."""
    with compiling():
        compiled_before = torch.compile(model)
        with fusionpass.enabled(cpu=True):
            got = run(compiled_before, model, (x,))
            assert fusionpass.stats(variants=True) == BLOCK_COUNTS
            torch._dynamo.reset()
            fusionpass.reset_stats()
            got_inside = run(torch.compile(model), model, (x,))
            assert fusionpass.stats(variants=True) == BLOCK_COUNTS  # counted once, not twice
    expected = eager(model, x)
    assert_outcomes_close(got, expected)
    assert_outcomes_close(got_inside, expected)


def test_enabled_leaves_other_backends_alone(model, x):
    with compiling(), fusionpass.enabled(cpu=True):
        out = torch.compile(model, backend="eager")(x)
        assert fusionpass.stats() == {}
    torch.testing.assert_close(out, model(x))


def test_enabled_restores_on_error():
    original_compile = torch.compile
    previous_hook = inductor_config.pre_grad_custom_pass
    with pytest.raises(RuntimeError), fusionpass.enabled(cpu=True):
        raise RuntimeError("boom")
    assert torch.compile is original_compile
    assert inductor_config.pre_grad_custom_pass is previous_hook


# install() / uninstall()


def test_install_fuses_every_inductor_compile_until_uninstall(model, x):
    """The default backend, a module's own .compile() (torchtitan's per-block form) and a backend
    fusionpass never sees being made, all through Inductor's hook; nothing after uninstall()."""
    original_compile = torch.compile
    previous_hook = inductor_config.pre_grad_custom_pass
    cfg = fusionpass.install(cpu=True)
    try:
        assert cfg.cpu and torch.compile is original_compile  # the hook alone, no wrapper
        for compile_it in (torch.compile, lambda m: (m.compile(), m)[1]):
            copied = copy.deepcopy(model)
            with compiling():
                got = run(compile_it(copied), copied, (x,), train=True)
                assert fusionpass.stats(variants=True) == BLOCK_COUNTS
            assert_outcomes_close(got, eager(model, x, train=True))
        with compiling():
            run(torch.compile(model, mode="max-autotune-no-cudagraphs"), model, (x,))
            assert fusionpass.stats(variants=True) == BLOCK_COUNTS
    finally:
        fusionpass.uninstall()
    assert inductor_config.pre_grad_custom_pass is previous_hook
    with compiling():
        run(torch.compile(model), model, (x,))
        assert fusionpass.stats() == {}


def test_install_twice_replaces_and_keeps_the_users_pass(model, x):
    user = RecordingPass()
    with inductor_config.patch(pre_grad_custom_pass=user):
        fusionpass.install(cpu=True, fusions=[])
        fusionpass.install(cpu=True)  # replaces the first: one pass of ours, then the user's
        try:
            with compiling():
                run(torch.compile(model), model, (x,))
                assert fusionpass.stats(variants=True) == BLOCK_COUNTS
        finally:
            fusionpass.uninstall()
        assert inductor_config.pre_grad_custom_pass is user
    assert user.seen == [FUSED_OPS]


def test_enabled_inside_install_restores_the_install(model, x):
    installed = fusionpass.install(cpu=True, fusions=[])
    try:
        with fusionpass.enabled(cpu=True):
            pass
        assert inductor_config.pre_grad_custom_pass.config == installed
    finally:
        fusionpass.uninstall()


def test_uninstall_without_install_changes_nothing():
    user = RecordingPass()
    with inductor_config.patch(pre_grad_custom_pass=user):
        fusionpass.uninstall()
        assert inductor_config.pre_grad_custom_pass is user


def test_torch_logs_shows_matches_and_near_misses():
    """TORCH_LOGS="fusionpass" in a fresh process: a line per graph with its matches, and the near
    misses with their reasons."""
    script = textwrap.dedent('''
        import torch, fusionpass
        from fusionpass.demo import RMSNorm
        class Norms(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.wide, self.narrow = RMSNorm(512), RMSNorm(64)
            def forward(self, x, y):
                return self.wide(x), self.narrow(y)
        torch.compile(Norms(), backend=fusionpass.backend(cpu=True))(torch.randn(2, 512), torch.randn(2, 64))
    ''')
    env = {**os.environ, "TORCH_LOGS": "fusionpass", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "FUSIONPASS_RMS_NORM_MIN_WIDTH": "512"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"matched rms_norm_residual/\w+ x1", done.stderr), done.stderr[-3000:]
    assert re.search(r"near miss: rms_norm_residual at narrow: .*64", done.stderr), done.stderr[-3000:]


class EmbeddedBlock(nn.Module):
    """ids -> embedding -> Block: the row width is static even under dynamic=True."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, WIDTH)
        self.block = Block()

    def forward(self, ids):
        return self.block(self.embed(ids))


def test_enabled_dynamic_true_compiled_in_block():
    model = EmbeddedBlock()
    ids = torch.randint(0, 64, (2, 8))
    with compiling(), fusionpass.enabled(cpu=True):
        out = torch.compile(model, dynamic=True)(ids)
        assert fusionpass.stats(variants=True) == BLOCK_COUNTS
    torch.testing.assert_close(out, model(ids))


def test_enabled_dynamic_true_compiled_before_block():
    model = EmbeddedBlock()
    ids = torch.randint(0, 64, (2, 8))
    with compiling():
        compiled = torch.compile(model, dynamic=True)  # default backend, outside the block
        with fusionpass.enabled(cpu=True):
            out = compiled(ids)
        torch.testing.assert_close(out, model(ids))
        assert fusionpass.stats(variants=True) == BLOCK_COUNTS


# ---------------------------------------------------------------------------------------------
# a user's own pre-grad pass


def test_user_pre_grad_pass_still_runs(model, x):
    user = RecordingPass()
    with inductor_config.patch(pre_grad_custom_pass=user):
        got, stats = compile_and_count(model, x)
        assert inductor_config.pre_grad_custom_pass is user
    assert stats == BLOCK_COUNTS
    assert user.seen == [FUSED_OPS]  # ran once, after ours
    assert_outcomes_close(got, eager(model, x))


def test_user_pre_grad_pass_given_as_option(model, x):
    user = RecordingPass()
    backend = fusionpass.backend(cpu=True, options={"pre_grad_custom_pass": user})
    _, stats = compile_and_count(model, x, backend=backend)
    assert stats == BLOCK_COUNTS
    assert user.seen == [FUSED_OPS]


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="torch < 2.13 takes one pass per hook",
)
def test_user_pre_grad_pass_list(model, x):
    """torch >= 2.13 takes a list of passes on the hook: all of them still run."""
    first, second = RecordingPass("a"), RecordingPass("b")
    with inductor_config.patch(pre_grad_custom_pass=[first, second]):
        _, stats = compile_and_count(model, x)
    assert stats == BLOCK_COUNTS
    assert first.seen == second.seen == [FUSED_OPS]


def test_user_pre_grad_pass_inside_enabled(model, x):
    user = RecordingPass()
    with inductor_config.patch(pre_grad_custom_pass=user), compiling():
        with fusionpass.enabled(cpu=True):
            compiled = torch.compile(model)
            run(compiled, model, (x,))
        assert inductor_config.pre_grad_custom_pass is user
        assert fusionpass.stats(variants=True) == BLOCK_COUNTS
    assert user.seen == [FUSED_OPS]


def test_uuid():
    cfg = config_mod.Config(cpu=True)
    base = PreGradFusionPass(cfg).uuid()
    assert isinstance(base, str) and base
    assert PreGradFusionPass(config_mod.Config(cpu=True)).uuid() == base  # deterministic
    # the config is part of it
    assert PreGradFusionPass(cfg.replace(cpu=False)).uuid() != base
    assert PreGradFusionPass(cfg.replace(rms_norm_min_width=64)).uuid() != base
    assert PreGradFusionPass(cfg.replace(fusions=frozenset())).uuid() != base
    # so is the inner pass's uuid
    with_a = chained(cfg, RecordingPass("a")).uuid()
    with_b = chained(cfg, RecordingPass("b")).uuid()
    assert len({base, with_a, with_b}) == 3
    assert chained(cfg, RecordingPass("a")).uuid() == with_a
    # an inner pass without a uuid cannot be keyed: neither can we
    assert chained(cfg, lambda graph: None).uuid() is None
    assert chained(cfg, [RecordingPass("a"), lambda graph: None]).uuid() is None
    assert chained(cfg, [RecordingPass("a"), RecordingPass("b")]).uuid() not in (None, with_a)
    assert chained(cfg, []).inner is None
    assert chained(cfg, None).uuid() == base


def test_compile_caches_are_keyed_by_config(model, x):
    """With Inductor's caches on (as users run): an identical compile is a cache hit (our pass
    does not run, the cached code still computes the fused result); another config is a miss."""

    def compile_once(backend):
        torch._dynamo.reset()
        fusionpass.reset_stats()
        with torch.no_grad():
            out = torch.compile(model, backend=backend)(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return len(STATISTICS.records), fusionpass.stats()

    expected = model(x).detach()
    with (
        compiling(fresh_cache_dir=True),
        inductor_config.patch(fx_graph_cache=True),
        functorch_config.patch(enable_autograd_cache=True),
    ):
        assert compile_once(make_backend()) == (1, {FUSION: 2})  # miss: compiled, counted
        assert compile_once(make_backend()) == (0, {})  # hit: pass not run
        assert compile_once(fusionpass.backend()) == (1, {})  # cpu=False: miss, near misses
        assert compile_once(make_backend(rms_norm_min_width=64)) == (1, {FUSION: 2})
        assert compile_once(make_backend(fusions=[])) == (1, {})
        # a user pass without a uuid: our uuid is None, Inductor bypasses its caches
        with inductor_config.patch(pre_grad_custom_pass=lambda graph: None):
            assert compile_once(make_backend()) == (1, {FUSION: 2})
            assert compile_once(make_backend()) == (1, {FUSION: 2})


def test_chained_never_wraps_itself():
    cfg = config_mod.Config(cpu=True)
    user = RecordingPass()
    once = chained(cfg, user)
    twice = chained(cfg.replace(cpu=False), once)
    assert twice.inner is user
    assert twice.config.cpu is False


# ---------------------------------------------------------------------------------------------
# statistics and explain()


def test_stats_and_reset(model, x):
    _, stats = compile_and_count(model, x)
    assert stats == fusionpass.stats(variants=True) == BLOCK_COUNTS
    assert fusionpass.stats() == {FUSION: 2}
    fusionpass.reset_stats()
    assert fusionpass.stats() == {} and fusionpass.stats(variants=True) == {}
    assert fusionpass.passes.STATISTICS.near_misses == []


def test_explain_demo_llama():
    torch.manual_seed(0)
    demo = DemoLlama(layers=2).eval()
    ids = torch.randint(0, 256, (2, 16))
    report = fusionpass.explain(demo, ids)
    assert isinstance(report, fusionpass.Report)
    assert report.matches == {FUSION: 5, "sdpa_mask": 2, "swiglu_mlp": 2}
    assert report.variants == {
        (FUSION, "llama"): 4,
        (FUSION, "llama_no_residual"): 1,
        ("sdpa_mask", "causal_mask"): 2,
        ("swiglu_mlp", "silu"): 2,  # inference with 32 rows: the decode regime
    }
    # the demo's 2-d cos/sin ([S, D], broadcast) are outside the rope pattern's shapes (q and k
    # each report)
    rope_shape = "shape: cos is not 4-d (broadcast as the rotation needs)"
    assert sorted(report.near_misses) == sorted(
        [("rope", f"layers.{i}.self_attn", rope_shape) for i in range(2) for _ in range(2)]
    )
    assert report.graphs == 1
    assert report.graph_breaks == 0
    assert report.device == "cpu"
    text = str(report)
    assert re.search(r"^fusion +matches +variants *$", text, re.MULTILINE), text
    assert re.search(r"^rms_norm_residual +5 +llama: 4, llama_no_residual: 1$", text, re.MULTILINE), text
    data = json.loads(report.to_json())
    assert data["matches"] == {FUSION: 5, "sdpa_mask": 2, "swiglu_mlp": 2}
    assert data["variants"] == {
        f"{FUSION}/llama": 4,
        f"{FUSION}/llama_no_residual": 1,
        "sdpa_mask/causal_mask": 2,
        "swiglu_mlp/silu": 2,
    }
    assert sorted(m["fusion"] for m in data["near_misses"]) == ["rope"] * 4
    assert data["graphs"] == 1
    assert set(data["enabled"]) == set(fusionpass.FUSION_NAMES)


def test_explain_reports_the_pass_time_per_fusion(caplog):
    import logging

    torch.manual_seed(0)
    demo = DemoLlama(layers=1).eval()
    with caplog.at_level(logging.DEBUG, logger="fusionpass"):
        report = fusionpass.explain(demo, torch.randint(0, 256, (2, 16)))
    assert set(fusionpass.FUSION_NAMES) <= set(report.pass_seconds)  # every enabled fusion ran
    assert all(s >= 0 for s in report.pass_seconds.values()) and sum(report.pass_seconds.values()) > 0
    assert "pass time:" in str(report) and "pass_seconds" in report.to_dict()
    assert any("fusionpass pass over" in r.getMessage() for r in caplog.records)


def test_explain_near_misses_and_training():
    narrow = Block(width=256)
    x = torch.randn(2, 8, 256, requires_grad=True)
    report = fusionpass.explain(narrow, x, train=True)
    assert report.matches == {}
    assert sorted(w for _, w, _ in report.near_misses) == ["norm1", "norm2"]
    assert all("row width 256 outside 512.." in why for _, _, why in report.near_misses)
    text = str(report)
    assert "near misses (left to Inductor):" in text
    assert re.search(r"^fusion +where +reason *$", text, re.MULTILINE), text
    data = json.loads(report.to_json())
    assert {m["where"] for m in data["near_misses"]} == {"norm1", "norm2"}


class CausalSdpa(torch.nn.Module):
    """Attention as transformers >= 5.2x calls SDPA without an attention_mask: is_causal=True, no mask."""

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_explain_says_attention_is_already_fast():
    q, k, v = (torch.randn(2, 2, 16, 64) for _ in range(3))
    report = fusionpass.explain(CausalSdpa(), q, k, v)
    assert report.matches == {} and report.near_misses == []
    note = "attention already in the fast form (is_causal=True, no mask)"
    assert [(f, n) for f, _, n in report.already_fast] == [("sdpa_mask", note)]
    text = str(report)
    assert "already fast (nothing to rewrite):" in text
    assert f"  sdpa_mask: {note} in 1 call(s)" in text
    assert "near misses" not in text
    data = json.loads(report.to_json())
    assert [m["note"] for m in data["already_fast"]] == [note]


@pytest.mark.parametrize("source, path", [
    ("L['self'].model.layers[0].self_attn", "model.layers.0.self_attn"),
    ("L['args'][0].model.layers.0.self_attn", "model.layers.0.self_attn"),  # a wrapped forward
    ("L['self']._modules['norm1']", "norm1"),
    ("L['model'].norm", "norm"),
    ("L['kwargs']['model'].layers[1].norm", "layers.1.norm"),
    ("L['self']", ""),
])
def test_where_is_the_module_path(source, path):
    from fusionpass.patterns.graph import module_path

    assert module_path(source) == path


def test_explain_with_fusions_disabled(model, x):
    report = fusionpass.explain(model, x, fusions=[])
    assert report.matches == {} and report.enabled == ()
    assert re.search(r"^rms_norm_residual +0 +disabled$", str(report), re.MULTILINE), str(report)


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_list_json(capsys):
    assert cli.main(["list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["fusion"] for r in rows] == list(fusionpass.FUSION_NAMES)
    assert {r["status"] for r in rows} <= {"available", "not implemented yet"}
    (rms,) = [r for r in rows if r["fusion"] == FUSION]
    assert rms["status"] == "available"
    # the names stats() counts matches under (each form with and without the residual add)
    assert rms["variants"] == [f"{form}{suffix}" for form in ("llama", "gemma", "weight_in_fp32", "no_weight", "torch_rms_norm")
                               for suffix in ("", "_no_residual")]
    assert rms["guards"] == ["device", "dtype", "weight_shape", "width", "strides", "intermediates"]
    assert rms["matches"] and rms["selected_when"]


def test_cli_list_text(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert f"{FUSION}: available" in out
    assert "guards:        device, dtype, weight_shape, width, strides, intermediates" in out


def test_cli_explain_json(capsys):
    assert cli.main(["explain", "--json", "--device", "cpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["matches"] == {FUSION: 5, "sdpa_mask": 2, "swiglu_mlp": 2}
    assert data["variants"] == {
        f"{FUSION}/llama": 4,
        f"{FUSION}/llama_no_residual": 1,
        "sdpa_mask/causal_mask": 2,
        "swiglu_mlp/silu": 2,
    }
    assert data["device"] == "cpu"


def test_cli_explain_bloom(capsys):
    # a tiny BLOOM (eager attention with ALiBi): its attention goes to the kernel, its residual
    # LayerNorms fuse, its head merge reads the kernel's token-major output; the tiny vocabulary's
    # loss is reported as left to Inductor
    pytest.importorskip("transformers")
    argv = ["explain", "--model", "bloom", "--train", "--width", "128", "--layers", "1", "--json", "--device", "cpu"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["variants"] == {"flash_attention/eager_alibi_kernel": 1, "attention_out_proj/merge_heads": 1,
                                "layer_norm_dropout_residual/residual": 2}
    assert [m["fusion"] for m in data["near_misses"]] == ["linear_cross_entropy"]


def test_cli_unknown_command():
    with pytest.raises(SystemExit):
        cli.main(["no-such-command"])


def test_console_script():
    # the script of the environment running the tests first, else whatever is on PATH
    script = pathlib.Path(sys.executable).parent / "fusionpass"
    script = str(script) if script.exists() else shutil.which("fusionpass")
    if script is None:
        pytest.skip("the fusionpass console script is not installed")
    proc = subprocess.run(
        [script, "list", "--json"], check=False, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["fusion"]: r["status"] for r in rows}[FUSION] == "available"


# ---------------------------------------------------------------------------------------------
# configuration from the environment


def test_config_from_env():
    env = {
        "FUSIONPASS_FUSIONS": "rms_norm_residual, rope",
        "FUSIONPASS_DISABLE": "rope",
        "FUSIONPASS_CPU": "yes",
        "FUSIONPASS_RMS_NORM_MIN_WIDTH": "128",
    }
    cfg = config_mod.from_env(environ=env)
    assert cfg.fusions == frozenset({FUSION})
    assert cfg.cpu is True
    assert cfg.rms_norm_min_width == 128
    assert config_mod.from_env(environ={"FUSIONPASS_CPU": "0"}).cpu is False
    assert config_mod.from_env(environ={}) == config_mod.Config()
    with pytest.raises(ValueError, match="unknown fusion"):
        config_mod.from_env(environ={"FUSIONPASS_FUSIONS": "nope"})


def test_backend_arguments_override_env(monkeypatch):
    monkeypatch.setenv("FUSIONPASS_DISABLE", FUSION)
    monkeypatch.setenv("FUSIONPASS_CPU", "1")
    assert FUSION not in fusionpass.backend().config.fusions
    assert fusionpass.backend().config.cpu is True
    cfg = fusionpass.backend(fusions=[FUSION], cpu=False).config
    assert cfg.fusions == frozenset({FUSION}) and cfg.cpu is False


def test_config_key_is_stable():
    a = config_mod.Config(fusions=frozenset(["rope", FUSION]))
    b = config_mod.Config(fusions=frozenset([FUSION, "rope"]))
    assert a.key() == b.key() and hash(a) == hash(b)
    assert a.key() != a.replace(cpu=True).key()


def test_pass_pickles_the_same_in_every_process():
    """torch 2.11 keys Inductor's and AOTAutograd's caches on the pickle of pre_grad_custom_pass
    (2.13 asks its uuid() instead): that pickle must not follow the string hash seed, or a second
    process misses both caches (benchmarks/results/trainer/2026-12-05-h100-cache-keys.json)."""
    code = ("import hashlib, pickle; from fusionpass import config; from fusionpass.passes import PreGradFusionPass;"
            "print(hashlib.sha256(pickle.dumps(PreGradFusionPass(config.Config()))).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                              capture_output=True, text=True, check=True).stdout for seed in (1, 2, 3, 4)}
    assert len(digests) == 1, digests
    assert pickle.loads(pickle.dumps(config_mod.Config())) == config_mod.Config()


# ---------------------------------------------------------------------------------------------
# training: frozen weights, inputs without grad


def test_frozen_weights(model, x):
    for p in model.parameters():
        p.requires_grad_(False)
    got, stats = compile_and_count(model, x, train=True)
    assert stats == BLOCK_COUNTS
    assert set(got.grads) == {"input0"}
    assert_outcomes_close(got, eager(model, x, train=True))


def test_inputs_without_grad(model, x):
    got, stats = compile_and_count(model, x, train=True, input_grad=False)
    assert stats == BLOCK_COUNTS
    assert set(got.grads) == {name for name, _ in model.named_parameters()}
    assert_outcomes_close(got, eager(model, x, train=True, input_grad=False))


def test_only_norm_weights_frozen(model, x):
    model.norm1.weight.requires_grad_(False)
    model.norm2.weight.requires_grad_(False)
    got, stats = compile_and_count(model, x, train=True, input_grad=False)
    assert stats == BLOCK_COUNTS
    assert set(got.grads) == {"proj.weight", "proj.bias"}
    assert_outcomes_close(got, eager(model, x, train=True, input_grad=False))


def test_bf16_training_through_backend_name(model, x, monkeypatch):
    monkeypatch.setenv("FUSIONPASS_CPU", "1")
    model = model.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    got, stats = compile_and_count(model, xb, backend="fusionpass", train=True)
    assert stats == BLOCK_COUNTS
    assert_outcomes_close(got, eager(model, xb, train=True), torch.bfloat16)


def test_cli_bench_runs_both_sides(capsys):
    # the built-in demo model (tests/test_bench_cli.py: transformers models)
    args = ["bench", "--device", "cpu", "--batch", "1", "--seq", "8", "--width", "512", "--step", "infer",
            "--rounds", "1", "--iters", "1"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\| infer \| torch\.compile \| [\d.]+ \|", out, re.MULTILINE), out
    assert re.search(r"^\| infer \| fusionpass \| [\d.]+ \|.*\| rms_norm_residual 5, sdpa_mask 2, swiglu_mlp 2 \|$",
                     out, re.MULTILINE), out


@pytest.mark.parametrize("head_dim", [64, 256])
def test_explain_names_the_kernel_of_each_attention_call(head_dim):
    # a collator's padded batch through a tiny HF Llama: each layer's SDPA goes to our kernel
    # (causal + key padding; fp32, not the cuDNN route's); at head dim 256 the cost rule keeps
    # plain compile's call, and explain says so with the rule as the reason
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=2 * head_dim, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=head_dim, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 64, (2, 24))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    report = fusionpass.explain(model, ids, attention_mask=mask, use_cache=False)
    calls = {w: (k, why) for w, k, why in report.attention}
    assert sorted(calls) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for kernel, why in calls.values():
        if head_dim == 64:
            # and says why not the cuDNN route (here: fp32; the length rule's reason is
            # tests/models/test_hf_padded_attention.py's)
            assert kernel.startswith("fusionpass flash (causal_kernel_padded); not cuDNN's padding route: ")
            assert why.startswith("flash_attention matched")
        else:
            assert kernel.startswith("as written") and "head dim of a causal mask with key padding 256" in why
    assert "attention calls (which kernel runs, and why):" in str(report)
    assert json.loads(report.to_json())["attention"][0]["kernel"] == calls["model.layers.0.self_attn"][0]


def test_explain_names_the_kernel_of_an_sdpa_call_already_fast():
    q, k, v = (torch.randn(2, 2, 16, 64) for _ in range(3))
    ((_, kernel, why),) = fusionpass.explain(CausalSdpa(), q, k, v).attention
    assert kernel == "SDPA as written (torch picks its kernel)" and "already in the fast form" in why
