"""A fusion is one folder: its declaration, op, kernel, conformance and benchmark cases. Everything
central (run order, Config settings, environment overrides, `fusionpass list`, the pass, the ops,
`fusionpass check`, the benchmark suite) finds it there. The toy fusion of
tests/toy_fusions/toy_double/ is added with no other edit: its folder joins the fusions package's
search path, as a new folder under fusionpass/fusions/ would be found."""
import json
import pathlib
import sys

import pytest
import torch
from helpers import load_script

import fusionpass
from fusionpass import cli, conformance, fusions, registry
from fusionpass import config as config_mod
from fusionpass.explain import fresh_compile_caches

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOY_FOLDERS = str(ROOT / "tests" / "toy_fusions")
TOY = "toy_double"


@pytest.fixture
def toy():
    fusions.__path__.append(TOY_FOLDERS)
    try:
        yield registry.registered()[TOY]
    finally:
        fusions.__path__.remove(TOY_FOLDERS)
        registry.unregister(TOY)
        # its pattern module declares it when imported: the next test imports it again (its op
        # stays registered, as torch.library ops do for the process)
        sys.modules.pop(f"fusionpass.fusions.{TOY}.pattern", None)
        registry.registered()  # the registry sees the search path without the toy folder again


def test_the_toy_fusion_needs_no_central_edit(toy, capsys):
    from fusionpass.fusions.toy_double import pattern

    names = fusionpass.FUSION_NAMES
    assert TOY in names and names.index(TOY) > names.index("rms_norm_residual")
    # its option is a Config setting with an environment override
    assert config_mod.Config().toy_double_min_rank == 1
    assert config_mod.Config(toy_double_min_rank=3).options(TOY) == pattern.Options(min_rank=3)
    assert config_mod.from_env(environ={"FUSIONPASS_TOY_DOUBLE_MIN_RANK": "2"}).toy_double_min_rank == 2
    # `fusionpass list` shows it with its setting
    assert cli.main(["list", "--json"]) == 0
    rows = {r["fusion"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[TOY]["after"] == ["rms_norm_residual"]
    assert rows[TOY]["settings"] == [
        {"name": "toy_double_min_rank", "env": "FUSIONPASS_TOY_DOUBLE_MIN_RANK", "default": 1,
         "doc": "fewest dimensions of x rewritten"}]

    def double(x):
        return torch.sin(x) * 2

    x = torch.randn(5, 3)
    for min_rank, matched in ((1, 1), (3, 0)):  # its cost rule reads its own option
        fusionpass.reset_stats()
        torch._dynamo.reset()
        backend = fusionpass.backend(fusions=[TOY], cpu=True, toy_double_min_rank=min_rank)
        with fresh_compile_caches():  # a cache hit would skip the pass
            torch.testing.assert_close(torch.compile(double, backend=backend)(x), double(x))
        assert fusionpass.stats().get(TOY, 0) == matched


def test_the_toy_fusion_brings_its_op_kernel_conformance_and_benchmark_cases(toy):
    # its op (and through it its kernel) is registered from its folder
    assert f"fusionpass.fusions.{TOY}.op" in {m.__name__ for m in fusions.modules("op")}
    x = torch.randn(7)
    torch.testing.assert_close(torch.ops.fusionpass.toy_double(x), x + x)
    # and autocast-neutral like every fusionpass op, though its folder came after fusionpass.ops
    assert torch.ops.fusionpass.toy_double.default.has_kernel_for_dispatch_key(torch._C.DispatchKey.AutocastCPU)
    # `fusionpass check` finds its case and passes it on the CPU
    case = next(c for c in conformance.all_cases() if c.fusion == TOY)
    result = conformance.run_case(case, "cpu")
    assert result["passed"], result
    # the benchmark suite finds its topic, after every real fusion's (its ORDER)
    suite = load_script("benchmark_suite", ROOT / "benchmarks" / "suite.py")
    topics = suite.kernel_topics()
    assert list(topics)[-1] == TOY and [c.name for c in topics[TOY](smoke=True)] == ["sin(x) * 2, 64x64"]


def test_the_toy_fusion_brings_its_explain_hint(toy, monkeypatch):
    # explain asks each enabled fusion for its hint (Fusion.hint); the toy's speaks of its near miss
    monkeypatch.setenv("FUSIONPASS_TOY_DOUBLE_MIN_RANK", "3")

    def double(x):
        return torch.sin(x) * 2

    report = fusionpass.explain(double, torch.randn(5, 3), fusions=[TOY])
    assert report.matches.get(TOY, 0) == 0
    assert report.hints == ["toy_double: lower FUSIONPASS_TOY_DOUBLE_MIN_RANK to rewrite x * 2 of fewer dimensions"]
    monkeypatch.setenv("FUSIONPASS_TOY_DOUBLE_MIN_RANK", "1")
    assert fusionpass.explain(double, torch.randn(5, 3), fusions=[TOY]).hints == []


def test_run_order_follows_after():
    names = fusionpass.FUSION_NAMES
    for name, fusion in registry.registered().items():
        for before in fusion.after:
            assert names.index(before) < names.index(name), (before, name)


def test_unknown_setting_and_cycles_are_errors(toy):
    with pytest.raises(TypeError, match="unknown setting"):
        config_mod.Config(toy_double_max_rank=3)
    cyclic = registry.Fusion(name="toy_cycle", after=("toy_cycle",), matches="", selected_when="",
                             anchor=lambda n: False, variants=(), guards=(), replace=lambda *a: None)
    registry.register(cyclic)
    try:
        with pytest.raises(ValueError, match="cycle"):
            registry.fusion_names()
    finally:
        registry.unregister("toy_cycle")


def test_settings_come_from_the_declarations():
    from fusionpass.config import settings

    declared = {key for f in registry.registered().values() for key in f.settings()}
    assert set(settings()) == declared
    # the variables that were missing from the hand-kept list work like every other
    env = {"FUSIONPASS_ROPE_MIN_TOKENS": "7", "FUSIONPASS_ROPE_MAX_BYTES": "1024",
           "FUSIONPASS_RMS_NORM_RESIDUAL_TRAIN_MAX_WIDTH": "4096"}  # the long form FUSION_OPTION too
    cfg = config_mod.from_env(environ=env)
    assert (cfg.rope_min_tokens, cfg.rope_max_bytes, cfg.rms_norm_train_max_width) == (7, 1024, 4096)
    assert cfg.options("rope").min_tokens == 7


def test_config_is_a_value():
    import copy
    import pickle

    cfg = config_mod.Config(cpu=True, rope_min_tokens=3)
    assert pickle.loads(pickle.dumps(cfg)) == cfg and copy.deepcopy(cfg) == cfg
    assert hash(cfg) == hash(config_mod.Config(cpu=True, rope_min_tokens=3))
    with pytest.raises(AttributeError):
        cfg.cpu = False
    assert cfg.replace(rope_min_tokens=64) == config_mod.Config(cpu=True)
