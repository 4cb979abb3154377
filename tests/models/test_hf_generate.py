"""transformers' own `generate()` compile (a static cache; CompileConfig): fusionpass fuses there
both as `CompileConfig(backend=...)` and through `fusionpass.install()` with transformers' default
Inductor backend, and greedy decoding gives the tokens eager decoding gives. CPU, a tiny Llama."""
import pytest
import torch
from helpers import compiling

import fusionpass

transformers = pytest.importorskip("transformers")

# generate() compiles the decode step (prefill runs eagerly), a graph of 2 layers
LAYERS = 2


def _model_and_inputs():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 128, (2, 7))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _generate(model, inputs, compile_config=None):
    if compile_config is not None:
        compile_config._compile_all_devices = True  # transformers compiles generate() on CUDA only otherwise
    return model.generate(**inputs, max_new_tokens=5, do_sample=False, cache_implementation="static",
                          compile_config=compile_config)


@pytest.mark.parametrize("how", ["compile_config", "install"])
def test_generate_compile_fuses_decode(how):
    model, inputs = _model_and_inputs()
    expected = _generate(model, inputs)  # no compile_config: eager on CPU
    settings = {"cpu": True, "rms_norm_min_width": 1}
    with compiling():
        if how == "compile_config":
            got = _generate(model, inputs, transformers.CompileConfig(backend=fusionpass.backend(**settings),
                                                                      mode="default"))
        else:
            fusionpass.install(**settings)
            try:
                got = _generate(model, inputs, transformers.CompileConfig(mode="default"))  # backend "inductor"
            finally:
                fusionpass.uninstall()
        stats = fusionpass.stats()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # the decode graph (prefill runs eagerly): every layer's attention to the split-KV kernel
    assert stats.get("decode_attention") == LAYERS, stats
    assert stats.get("rms_norm_residual", 0) >= 2 * LAYERS, stats
