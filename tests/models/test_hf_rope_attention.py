"""rope_attention on tiny HF models whose eager attention goes to fusionpass::flash_attention: the
q rotation moves into the kernel (inference by default; training with rope_attention_training),
with exact match counts and outputs (and gradients) equal to plain torch.compile; the forms the
kernel's fast rotation does not take (partial rotary) and the training default are near misses
with their reasons; with rope_kernel on, the fusionpass::rope call is left rotating k alone."""
from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_outcomes_close,
    compile_and_count,
    compiling,
    fused_graph,
    near_misses,
    plain_compiled,
    run,
)

from fusionpass.fusions.flash_attention import op as fa_ops

transformers = pytest.importorskip("transformers")

FUSIONS = ["flash_attention", "rope_attention"]
ROPE = torch.ops.fusionpass.rope.default
FLASH = torch.ops.fusionpass.flash_attention.default
WIDTH, HEADS, LAYERS = 128, 2, 2  # head dim 64, the kernel's smallest


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(fa_ops, "CPU_BLOCKS", {"block_m": 16, "block_n": 16, "dq_block_m": 16, "dq_block_n": 16})


def build(family):
    common = dict(vocab_size=96, hidden_size=WIDTH, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
                  intermediate_size=WIDTH, max_position_embeddings=32)
    if family == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=1, **common)
    elif family == "qwen2":
        config = transformers.Qwen2Config(num_key_value_heads=1, **common)
    elif family == "phi3":
        config = transformers.Phi3Config(num_key_value_heads=1, pad_token_id=0, **common)
    elif family == "phi3_partial":
        config = transformers.Phi3Config(num_key_value_heads=1, pad_token_id=0, partial_rotary_factor=0.5, **common)
    elif family == "gpt_neox":
        config = transformers.GPTNeoXConfig(rotary_pct=0.25, attention_dropout=0.0, hidden_dropout=0.0, **common)
    else:  # GPT-J: interleaved, rotated in [B, S, H, D] and permuted after; rotary_dim 64 = the whole head
        config = transformers.GPTJConfig(vocab_size=96, n_embd=WIDTH, n_head=HEADS, n_layer=LAYERS, n_positions=32,
                                         rotary_dim=64 if family == "gptj" else 16, attn_pdrop=0.0, resid_pdrop=0.0,
                                         embd_pdrop=0.0)
    config._attn_implementation = "eager"
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def ids():
    torch.manual_seed(1)
    return torch.randint(1, 96, (2, 9))


def compare(model, train, fusions=FUSIONS, **config):
    x = ids()
    kwargs = {"use_cache": False, **({"labels": x} if train else {})}
    model.train(train)
    got, stats = compile_and_count(model, x, fusions=fusions, train=train, kwargs=kwargs, **config)
    misses = near_misses()
    with compiling():
        want = run(plain_compiled(model), model, (x,), train, kwargs=kwargs)
    assert_outcomes_close(got, want, rtol=2e-4)
    return stats, misses


# Phi-3 and GPT-J slice and re-cat even when every channel rotates (the pass-through is empty);
# GPT-J's interleaved form (rotated in [B, S, H, D], permuted after) only where opted in
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gptj"])
def test_inference(family):
    stats, misses = compare(build(family), train=False, rope_attention_interleaved=True)
    assert stats == {("flash_attention", "eager_kernel"): LAYERS, ("rope_attention", "graph_rotation"): LAYERS}
    assert misses == []


@pytest.mark.parametrize("family", ["llama", "gptj"])
def test_training_opted_in(family):
    stats, misses = compare(build(family), train=True, rope_attention_training=True, rope_attention_interleaved=True)
    assert stats == {("flash_attention", "eager_kernel"): LAYERS, ("rope_attention", "graph_rotation"): LAYERS}
    assert misses == []


def test_interleaved_is_a_near_miss_by_default():
    model = build("gptj").eval()
    with torch.no_grad():
        _, _, record = fused_graph(model, ids(), fusions=FUSIONS)
    assert record.matches == {("flash_attention", "eager_kernel"): LAYERS}
    reasons = [r for f, _, r in record.near_misses if f == "rope_attention"]
    assert len(reasons) == LAYERS and all(r.startswith("form: interleaved (GPT-J)") for r in reasons)


def test_training_is_a_near_miss_by_default():
    stats, misses = compare(build("llama"), train=True)
    assert stats == {("flash_attention", "eager_kernel"): LAYERS}
    assert len(misses) == LAYERS and all(f == "rope_attention" and r.startswith("cost: training") for f, _, r in misses)


@pytest.mark.parametrize("family", ["gpt_neox", "phi3_partial", "gptj_partial"])
def test_partial_rotary_is_a_near_miss(family):
    model = build(family).eval()
    with torch.no_grad():
        _, _, record = fused_graph(model, ids(), fusions=FUSIONS)
    assert record.matches == {("flash_attention", "eager_kernel"): LAYERS}
    reasons = [r for f, _, r in record.near_misses if f == "rope_attention"]
    assert len(reasons) == LAYERS and all(r.startswith("layout: partial rotary") for r in reasons)


def test_rope_kernel_call_keeps_k(monkeypatch):
    # with rope_kernel on, fusionpass::rope rotated q and k together; q's rotation moves into the
    # attention, and a call rotating k alone is left
    monkeypatch.setenv("FUSIONPASS_ROPE_KERNEL", "1")
    model = build("llama").eval()
    with torch.no_grad():  # inference: nothing differentiates q
        gm, _, record = fused_graph(model, ids(), fusions=["rope", *FUSIONS])
    assert record.matches == {("rope", "rotate_half"): LAYERS, ("flash_attention", "eager_kernel"): LAYERS,
                              ("rope_attention", "rope_kernel"): LAYERS}
    ropes = [n for n in gm.graph.nodes if n.target is ROPE]
    flashes = [n for n in gm.graph.nodes if n.target is FLASH]
    assert len(ropes) == LAYERS and all(n.args[1] is None for n in ropes)
    assert all(n.kwargs["rope_form"] == "rotate_half" and n.args[0] not in ropes for n in flashes)
    stats, misses = compare(model, train=False, fusions=["rope", *FUSIONS])
    assert stats[("rope_attention", "rope_kernel")] == LAYERS and misses == []


def _llama_graph():
    """The Dynamo graph of a tiny Llama (inference) after flash_attention, its flash calls, the config."""
    from fusionpass import config as config_mod

    with torch.no_grad():
        gm, _, _ = fused_graph(build("llama").eval(), ids(), fusions=["flash_attention"])
    calls = [n for n in gm.graph.nodes if n.target is FLASH]
    assert len(calls) == LAYERS
    return gm, calls, config_mod.make(cpu=True)


def _apply_rope_attention(gm, cfg):
    from fusionpass import registry
    from fusionpass.fusions.rope_attention.pattern import ROPE_ATTENTION

    record = registry.Record()
    registry.apply(ROPE_ATTENTION, gm.graph, cfg, record)
    return record


def test_rotated_q_read_elsewhere_is_a_near_miss():
    gm, calls, cfg = _llama_graph()
    q_rot = calls[0].args[0]
    with gm.graph.inserting_after(q_rot):
        gm.graph.call_function(torch.neg, (q_rot,))  # another reader of the rotated q
    record = _apply_rope_attention(gm, cfg)
    assert record.matches == {("rope_attention", "graph_rotation"): LAYERS - 1}
    ((_, _, reason),) = record.near_misses
    assert reason.startswith("private:") and "also read outside the attention" in reason


def test_dtype_changing_cast_is_a_near_miss():
    # only the pattern's view of the graph: a cast between the rotation and the attention that
    # changes the dtype (the graph is not run)
    gm, calls, cfg = _llama_graph()
    q_rot = calls[0].args[0]
    with gm.graph.inserting_before(calls[0]):
        cast = gm.graph.call_method("to", (q_rot, torch.float64))
    cast.meta["example_value"] = q_rot.meta["example_value"].to(torch.float64)
    calls[0].args = (cast, *calls[0].args[1:])
    record = _apply_rope_attention(gm, cfg)
    assert record.matches == {("rope_attention", "graph_rotation"): LAYERS - 1}
    ((_, _, reason),) = record.near_misses
    assert "q is cast from torch.float32 to torch.float64" in reason


def test_autocast_rounding_of_an_fp32_rotation_matches():
    # bf16 autocast over fp32 weights (Trainer(bf16=True)): q leaves q_proj in bf16, the fp32 cos/sin
    # rotate it in fp32, and the attention's cast rounds it to bf16 once, which is what the
    # kernel's rotation on load computes: the rotation moves into the kernel
    from fusionpass.conformance.cases_autocast import Autocast

    model = Autocast(build("llama")).eval()
    x = ids()
    got, stats = compile_and_count(model, x, fusions=FUSIONS, kwargs={"use_cache": False})
    assert stats == {("flash_attention", "eager_kernel"): LAYERS, ("rope_attention", "graph_rotation"): LAYERS}
    with compiling():
        want = run(torch.compile(model, backend="inductor", fullgraph=True), model, (x,), False,
                   kwargs={"use_cache": False})
    assert_outcomes_close(got, want, dtype=torch.bfloat16)
