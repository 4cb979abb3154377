"""decode_attention: tiny HF Llama / Qwen2 decoding with a StaticCache under the fusionpass backend.
Each layer's SDPA over the cache (a decode step, Lq = 1, or a verification step, Lq = 4) becomes
fusionpass::decode_attention (the split-KV kernel under the Triton interpreter): exact counts, logits
equal to plain torch.compile's, and greedy tokens identical over several steps. Training and
non-decode shapes are left alone."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_tensors_close, compiling, near_misses

import fusionpass
from fusionpass.fusions.decode_attention import op as decode_ops

transformers = pytest.importorskip("transformers")

FUSION = "decode_attention"
LAYERS, CACHE, PROMPT, BATCH = 2, 40, 9, 2


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(decode_ops, "CPU_LAUNCH", {"block_n": 16})


def model(family, attn="sdpa"):
    """llama (head dim 64), llama-d80, qwen2 (64), or deepseek_v3: MLA's q/k head dim 192 with v's 128."""
    kw = dict(hidden_size=256, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    if family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **{**kw, "num_attention_heads": 2, "num_key_value_heads": 2}, kv_lora_rank=32, q_lora_rank=None,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=LAYERS)
    elif family.startswith("llama"):
        config = transformers.LlamaConfig(head_dim=80 if family == "llama-d80" else 64, **kw)
    else:
        config = transformers.Qwen2Config(**kw)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def prefilled(m):
    """A StaticCache holding a prompt (run eagerly) and the prompt's ids."""
    torch.manual_seed(1)
    ids = torch.randint(1, 96, (BATCH, PROMPT))
    cache = transformers.StaticCache(config=m.config, max_cache_len=CACHE)
    with torch.no_grad():
        logits = m(ids, past_key_values=cache, use_cache=True).logits
    return cache, logits[:, -1:].argmax(-1)


def compiled(m, fused, **settings):
    backend = fusionpass.backend(fusions=[FUSION], cpu=True, **settings) if fused else "inductor"
    return torch.compile(m, backend=backend, fullgraph=True)


@pytest.mark.parametrize("family, attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager"),
                                          ("llama-d80", "sdpa"), ("deepseek_v3", "sdpa")])
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_step_matches(family, attn, q_len):
    # eager: matmul(q, repeat_kv(k)^T) * scale + where(decode mask, 0, min), fp32 softmax, matmul
    # with repeat_kv(v), the same mask machinery under the additive form
    m = model(family, attn)
    cache, _ = prefilled(m)
    torch.manual_seed(2)
    step = torch.randint(1, 96, (BATCH, q_len))
    outs = {}
    with compiling(), torch.no_grad():
        for fused in (True, False):
            c = copy.deepcopy(cache)
            # head dims 80 and 192 / 128 (MLA) are opt-in
            opt_in = fused and family in ("llama-d80", "deepseek_v3")
            padded = {"decode_attention_padded_head_dims": True} if opt_in else {}
            outs[fused] = compiled(m, fused, **padded)(step, past_key_values=c, use_cache=True).logits
            if fused:
                assert fusionpass.stats(variants=True) == {(FUSION, "static_cache"): LAYERS}
                assert near_misses() == []
    assert_tensors_close(outs[True], outs[False], 1e-4, "logits")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_greedy_tokens_identical(attn):
    m = model("llama", attn)
    tokens = {}
    for fused in (True, False):
        cache, token = prefilled(m)
        with compiling(), torch.no_grad():
            fn = compiled(m, fused)
            seq = [token]
            for _ in range(5):
                token = fn(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                seq.append(token)
        tokens[fused] = torch.cat(seq, 1)
    assert torch.equal(tokens[True], tokens[False]), (tokens[True], tokens[False])


def test_padded_cache_mask():
    # an attention_mask over the cache (left padding in row 1) adds a key-padding lookup: it goes
    # to the kernel as the [B, L] padding vector transformers builds
    m = model("llama")
    cache, token = prefilled(m)
    mask = torch.ones(BATCH, PROMPT + 1, dtype=torch.long)
    mask[1, :2] = 0
    outs = {}
    with compiling(), torch.no_grad():
        for fused in (True, False):
            c = copy.deepcopy(cache)
            outs[fused] = compiled(m, fused)(token, past_key_values=c, attention_mask=mask, use_cache=True).logits
            if fused:
                assert fusionpass.stats(variants=True) == {(FUSION, "static_cache"): LAYERS}
                assert near_misses() == []
    assert_tensors_close(outs[True], outs[False], 1e-4, "logits")


def test_generate_static_cache_left_padded():
    # transformers' generate() with a static cache and a left-padded batch, the forward compiled:
    # the same greedy tokens as plain torch.compile, the decode steps' attention on the kernel
    m = model("llama")
    torch.manual_seed(4)
    ids = torch.randint(1, 96, (BATCH, PROMPT))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    tokens = {}
    for fused in (True, False):
        mm = copy.deepcopy(m)
        backend = fusionpass.backend(fusions=[FUSION], cpu=True) if fused else "inductor"
        with compiling():
            mm.forward = torch.compile(mm.forward, backend=backend, dynamic=False)
            tokens[fused] = mm.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                        cache_implementation="static", pad_token_id=0)
            if fused:
                # the decode graph (compiled once, run for every new token); generate() builds the
                # mask outside the graph, a [B, 1, 1, L] input that one query reads as key padding.
                # The prompt step's mask (9 queries) is an opaque input too: a near miss.
                assert fusionpass.stats(variants=True) == {(FUSION, "one_query_any_mask"): LAYERS}
                reasons = {r for _, _, r in near_misses()}
                assert len(near_misses()) == LAYERS and reasons == {
                    "decode mask without the term `kv_idx <= arange(Lq) + cache length`"}
    assert torch.equal(tokens[True], tokens[False]), (tokens[True], tokens[False])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_prefill_and_training_are_not_decode(attn):
    m = model("llama", attn).train()
    torch.manual_seed(3)
    ids = torch.randint(1, 96, (BATCH, 8))
    with compiling():
        compiled(m, True)(ids, labels=ids).loss.backward()
        assert FUSION not in fusionpass.stats()
    assert [f for f, _, _ in near_misses()] == []


def test_head_dim_guard():
    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    cache, token = prefilled(m)
    with compiling(), torch.no_grad():
        compiled(m, True)(token, past_key_values=cache, use_cache=True)
        assert fusionpass.stats() == {}
    ((fusion, _, reason),) = near_misses()
    assert fusion == FUSION and reason == "head_dim: head dim 32 not in the decode kernel's (64, 80, 96, 128, 192, 256)"


def test_padded_head_dims_are_opt_in():
    m = model("llama-d80")
    cache, token = prefilled(m)
    with compiling(), torch.no_grad():
        compiled(m, True)(token, past_key_values=cache, use_cache=True)
        assert fusionpass.stats() == {}
    reasons = [r for f, _, r in near_misses() if f == FUSION]
    assert len(reasons) == LAYERS and all("head dim 80" in r and "padded_head_dims=True" in r for r in reasons)
