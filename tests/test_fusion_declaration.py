"""A fusion declares its name, run order, options and cost rule in its own module; everything
central (run order, Config settings, environment overrides, `fusionpass list`, the pass) is
derived from the declarations. The toy fusion of tests/toy_fusion.py is added with no other edit."""
import json

import pytest
import torch
import toy_fusion

import fusionpass
from fusionpass import cli, registry
from fusionpass import config as config_mod
from fusionpass.explain import fresh_compile_caches


@pytest.fixture
def toy():
    fusion = toy_fusion.declare()
    try:
        yield fusion
    finally:
        registry.unregister(fusion.name)


def test_the_toy_fusion_needs_no_central_edit(toy, capsys):
    names = fusionpass.FUSION_NAMES
    assert "toy_double" in names and names.index("toy_double") > names.index("rms_norm_residual")
    # its option is a Config setting with an environment override
    assert config_mod.Config().toy_double_min_rank == 1
    assert config_mod.Config(toy_double_min_rank=3).options("toy_double") == toy_fusion.Options(min_rank=3)
    assert config_mod.from_env(environ={"FUSIONPASS_TOY_DOUBLE_MIN_RANK": "2"}).toy_double_min_rank == 2
    # `fusionpass list` shows it with its setting
    assert cli.main(["list", "--json"]) == 0
    rows = {r["fusion"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["toy_double"]["after"] == ["rms_norm_residual"]
    assert rows["toy_double"]["settings"] == [
        {"name": "toy_double_min_rank", "env": "FUSIONPASS_TOY_DOUBLE_MIN_RANK", "default": 1,
         "doc": "fewest dimensions of x rewritten"}]

    def double(x):
        return torch.sin(x) * 2

    x = torch.randn(5, 3)
    for min_rank, matched in ((1, 1), (3, 0)):  # its cost rule reads its own option
        fusionpass.reset_stats()
        torch._dynamo.reset()
        backend = fusionpass.backend(fusions=["toy_double"], cpu=True, toy_double_min_rank=min_rank)
        with fresh_compile_caches():  # a cache hit would skip the pass
            torch.testing.assert_close(torch.compile(double, backend=backend)(x), double(x))
        assert fusionpass.stats().get("toy_double", 0) == matched


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
