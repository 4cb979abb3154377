"""Gradient checkpointing (transformers' `gradient_checkpointing_enable()`, the Trainer's
`gradient_checkpointing=True`): under torch.compile each checkpointed layer is a body the model's
graph calls (`tag_activation_checkpoint`), and its attention mask and autocast state live in the
model's graph. The pass proves them there (passes.PreGradFusionPass._checkpointed_layers), so the
layers fuse as without checkpointing, and compute what eager computes: padded rows too, whose
key padding the kernel reads off a row of the layer's own mask. CPU, tiny Llama."""
import pytest
import torch
from helpers import compiling

import fusionpass
from fusionpass.passes import STATISTICS

transformers = pytest.importorskip("transformers")

SETTINGS = dict(cpu=True, rms_norm_min_width=1, rope_min_tokens=1, linear_cross_entropy_min_vocab=1)
LAYERS = 2


def _model(dtype):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.gradient_checkpointing_enable()
    model.train()
    return model


def _step(model, ids, mask, autocast, call=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = (model if call is None else call)(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padding", ["ones", "left"])
@pytest.mark.parametrize("weights, autocast", [(torch.float32, False), (torch.float32, True)],
                         ids=["fp32", "fp32-weights-autocast"])
def test_checkpointed_layers_fuse_their_attention(padding, weights, autocast):
    ids = torch.randint(3, 256, (2, 19), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[1, :7] = 0
    model = _model(weights)
    expected = _step(model, ids, mask, autocast)
    torch._dynamo.reset()
    with compiling():
        fusionpass.install(**SETTINGS)
        try:
            got = _step(model, ids, mask, autocast, call=torch.compile(model))
        finally:
            fusionpass.uninstall()
        stats = fusionpass.stats()
    for fusion in ("flash_attention", "attention_out_proj", "rope", "swiglu_mlp"):
        assert stats.get(fusion) == LAYERS, (fusion, stats, STATISTICS.near_misses)
    rtol = 2e-2 if autocast else 1e-4
    torch.testing.assert_close(got[0], expected[0], rtol=rtol, atol=0)
    for name, grad in expected[1].items():
        scale = grad.abs().max().clamp_min(1e-6)
        err = (got[1][name] - grad).abs().max() / scale
        assert err < (5e-2 if autocast else 1e-3), (name, err.item())
