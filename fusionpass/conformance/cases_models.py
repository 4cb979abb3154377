"""Conformance cases on small real Hugging Face models: 2 layers at real widths, random weights,
bf16, training (loss, logits and every parameter's gradient) and inference (logits), against the
float64 eager model. Each also pins its match counts, so a route that stops matching fails.

Dropout probabilities are 0 (a float64 reference cannot draw the compiled graph's masks; the
dropout paths have their own cases in cases_norms). Sequence lengths are odd on purpose.
"""
from __future__ import annotations

import torch
from torch import nn

from fusionpass.conformance import FLOOR, Case, dtype_name

_NO_DROPOUT = dict(attention_dropout=0.0, hidden_dropout=0.0)


class _LM(nn.Module):
    """model(input_ids, labels) -> (loss, logits), the way a training loop calls it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        out = self.model(input_ids=input_ids, labels=labels)
        return out.loss, out.logits


class _LossOnlyLM(nn.Module):
    """fusionpass.loss_only(model)(input_ids, labels) -> (loss,): the graph has no logits output."""

    def __init__(self, model):
        super().__init__()
        import fusionpass

        self.model = fusionpass.loss_only(model)

    def forward(self, input_ids, labels):
        return (self.model(input_ids=input_ids, labels=labels).loss,)


def _make(config_name, model_class, attn, batch, seq, vocab, masked_lm, config, wrap=_LM):
    def make(dtype, device):
        import transformers

        cfg = getattr(transformers, config_name)(vocab_size=vocab, **config)
        cfg._attn_implementation = attn
        model = getattr(transformers, model_class).from_config(cfg).to(device, dtype)  # Auto* classes
        ids = torch.randint(1, vocab, (batch, seq), device=device)
        labels = ids.clone()
        if masked_lm:  # score about 15% of the positions, as an MLM collator does
            labels[torch.rand(ids.shape, device=device) > 0.15] = -100
        return wrap(model), (ids, labels)

    return make


def _llama_like(hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632):
    return dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=1024, pad_token_id=0,
                attention_dropout=0.0)


# name -> (config class, model class, attention implementation, batch, seq, vocab, masked LM, config)
MODELS = {
    "llama": ("LlamaConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False, _llama_like()),
    # the model the rope_attention bug was seen on (eager attention, 16/4 heads, head dim 128)
    "llama-eager": ("LlamaConfig", "AutoModelForCausalLM", "eager", 4, 512, 32000, False, _llama_like()),
    "mistral": ("MistralConfig", "AutoModelForCausalLM", "sdpa", 2, 257, 32000, False,
                dict(_llama_like(), sliding_window=None)),
    # a sliding window shorter than the sequence in every layer (flash_attention's window route)
    "mistral-window": ("MistralConfig", "AutoModelForCausalLM", "sdpa", 2, 257, 32000, False,
                       dict(_llama_like(), sliding_window=129)),
    # Gemma-3's local then global layer (head dim 256, query_pre_attn_scalar's scale, q/k norms)
    "gemma3": ("Gemma3TextConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
               dict(_llama_like(heads=8, kv_heads=4, head_dim=256), sliding_window=129,
                    layer_types=["sliding_attention", "full_attention"])),
    "qwen2": ("Qwen2Config", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False, _llama_like()),
    "qwen3": ("Qwen3Config", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False, _llama_like()),
    "phi3": ("Phi3Config", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
             dict(_llama_like(kv_heads=16), resid_pdrop=0.0, embd_pdrop=0.0)),
    "gemma": ("GemmaConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
              dict(_llama_like(head_dim=128), hidden_activation="gelu_pytorch_tanh")),
    "gpt2-eager": ("GPT2Config", "AutoModelForCausalLM", "eager", 4, 513, 32000, False,
                   dict(n_embd=768, n_layer=2, n_head=12, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "gpt2-sdpa": ("GPT2Config", "AutoModelForCausalLM", "sdpa", 4, 513, 32000, False,
                  dict(n_embd=768, n_layer=2, n_head=12, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "bert": ("BertConfig", "AutoModelForMaskedLM", "sdpa", 4, 509, 30522, True,
             dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)),
    "modernbert": ("ModernBertConfig", "AutoModelForMaskedLM", "sdpa", 4, 509, 32000, True,
                   dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=2, num_attention_heads=12,
                        attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0, pad_token_id=0,
                        max_position_embeddings=1024)),
    "bloom": ("BloomConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
              dict(hidden_size=1024, n_layer=2, n_head=16, **_NO_DROPOUT)),
    "falcon-alibi": ("FalconConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
                     dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, alibi=True,
                          new_decoder_architecture=False, multi_query=False, **_NO_DROPOUT)),
    "gpt-neox": ("GPTNeoXConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                 dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, intermediate_size=4096,
                      rotary_pct=0.25, max_position_embeddings=1024, **_NO_DROPOUT)),
    "gptj": ("GPTJConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
             dict(n_embd=1024, n_layer=2, n_head=16, rotary_dim=64, n_positions=1024, resid_pdrop=0,
                  embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)),
    "opt": ("OPTConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
            dict(hidden_size=1024, num_hidden_layers=2, ffn_dim=4096, num_attention_heads=16, dropout=0.0,
                 attention_dropout=0.0, layerdrop=0.0, max_position_embeddings=1024, word_embed_proj_dim=1024)),
}

# Exact match counts per model and mode (fusionpass.stats()), read off the H200 runs (torch 2.11,
# transformers 5.17, default config; bert's on CPU, torch 2.13). A change here is a change of what
# fusionpass compiles. GPT-J's eager attention has no route: in a bf16 model its _attn upcasts q and
# k but not v (mixed dtypes, a near miss), and fp32 attention stays out of the kernels on CUDA.
EXPECT: dict[tuple[str, bool], dict[str, int]] = {
    ("bert", False): {'sdpa_mask': 2},
    ("bert", True): {'layer_norm_dropout_residual': 4, 'sdpa_mask': 2},
    ("modernbert", False): {'sdpa_mask': 1, 'flash_attention': 1, 'attention_out_proj': 1},
    ("modernbert", True): {'layer_norm_dropout_residual': 4, 'sdpa_mask': 1, 'flash_attention': 1, 'attention_out_proj': 1},
    ("bloom", False): {'flash_attention': 2, 'attention_out_proj': 2},
    ("bloom", True): {'layer_norm_dropout_residual': 4, 'flash_attention': 2, 'attention_out_proj': 2},
    ("falcon-alibi", False): {'flash_attention': 2, 'attention_out_proj': 2},
    ("falcon-alibi", True): {'flash_attention': 2, 'attention_out_proj': 2},
    ("gemma", False): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2},
    ("gemma", True): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2, 'swiglu_mlp': 2},
    ("gpt-neox", False): {'rope': 2, 'flash_attention': 2, 'attention_out_proj': 2},
    ("gpt-neox", True): {'rope': 2, 'flash_attention': 2, 'attention_out_proj': 2},
    ("gpt2-eager", False): {'flash_attention': 2, 'attention_out_proj': 2},
    ("gpt2-eager", True): {'layer_norm_dropout_residual': 4, 'flash_attention': 2, 'attention_out_proj': 2},
    ("gpt2-sdpa", False): {'sdpa_mask': 2},
    ("gpt2-sdpa", True): {'layer_norm_dropout_residual': 4, 'sdpa_mask': 2},
    ("gptj", False): {'rope': 2},
    ("gptj", True): {'rope': 2},
    ("llama-eager", False): {'rms_norm_residual': 5, 'rope': 2, 'flash_attention': 2, 'rope_attention': 2, 'attention_out_proj': 2},
    ("llama-eager", True): {'rms_norm_residual': 5, 'rope': 2, 'flash_attention': 2, 'attention_out_proj': 2, 'swiglu_mlp': 2},
    ("llama", False): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2},
    ("llama", True): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2, 'swiglu_mlp': 2},
    ("mistral-window", False): {'rms_norm_residual': 5, 'rope': 2, 'flash_attention': 2, 'rope_attention': 2, 'attention_out_proj': 2},
    ("mistral-window", True): {'rms_norm_residual': 5, 'rope': 2, 'flash_attention': 2, 'attention_out_proj': 2, 'swiglu_mlp': 2},
    ("gemma3", False): {'rms_norm_residual': 9, 'rope': 2, 'flash_attention': 1, 'rope_attention': 1, 'attention_out_proj': 1, 'sdpa_mask': 1},
    ("gemma3", True): {'rms_norm_residual': 9, 'rope': 2, 'flash_attention': 1, 'attention_out_proj': 1, 'sdpa_mask': 1, 'swiglu_mlp': 2},
    ("mistral", False): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2},
    ("mistral", True): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2, 'swiglu_mlp': 2},
    ("opt", False): {'flash_attention': 2, 'attention_out_proj': 2},
    ("opt", True): {'layer_norm_dropout_residual': 2},
    ("phi3", False): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2},
    ("phi3", True): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2, 'swiglu_mlp': 2},
    ("qwen2", False): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2},
    ("qwen2", True): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2, 'swiglu_mlp': 2},
    ("qwen3", False): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2},
    ("qwen3", True): {'rms_norm_residual': 5, 'rope': 2, 'sdpa_mask': 2, 'swiglu_mlp': 2},
}

CASES = []
for _name, (_cfg, _cls, _attn, _b, _s, _v, _mlm, _config) in MODELS.items():
    for _train in (True, False):
        _expect = EXPECT.get((_name, _train), {})
        CASES.append(Case(
            name=f"model/{_name}/{'train' if _train else 'infer'}/bf16/B{_b}xS{_s}",
            fusion="model", variant=_name,
            make=_make(_cfg, _cls, _attn, _b, _s, _v, _mlm, _config),
            dtype=torch.bfloat16, train=_train, expect=_expect, eager_baseline=True,
        ))

# A training loop's loss through fusionpass.loss_only: linear_cross_entropy writes no logits
# (the vocabulary bound opened so that this vocabulary fuses; llama's own counts otherwise).
for _name in ("llama", "qwen2"):
    _cfg, _cls, _attn, _b, _s, _v, _mlm, _config = MODELS[_name]
    CASES.append(Case(
        name=f"model/{_name}-loss-only/train/bf16/B{_b}xS{_s}", fusion="model", variant=f"{_name}-loss-only",
        make=_make(_cfg, _cls, _attn, _b, _s, _v, _mlm, _config, wrap=_LossOnlyLM),
        dtype=torch.bfloat16, train=True, expect={**EXPECT[(_name, True)], "linear_cross_entropy": 1},
        config={"linear_cross_entropy_min_vocab": 5000}, eager_baseline=True,
    ))


class TrainerLM(nn.Module):
    """A step as the HF Trainer with bf16=True runs it: accelerate's autocast around the forward, a
    collator's all-ones attention_mask, and the returned logits converted to fp32
    (`convert_outputs_to_fp32`). The float64 reference is unchanged by the autocast (float64 tensors
    are not autocast's to cast), so it is the exact function the bf16 computation approximates.
    `autocast=False`: the same step of a bf16 model without bf16=True (the census's bf16 mode)."""

    def __init__(self, model, autocast: bool = True):
        super().__init__()
        self.model, self.autocast = model, autocast

    def forward(self, input_ids, labels):
        with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
        return out.loss, out.logits.float()


class _CheckpointedTrainerLM(TrainerLM):
    """TrainerLM with gradient_checkpointing=True: each layer a checkpointed body the model's graph
    calls, its mask and autocast state proven there."""

    def __init__(self, model):
        super().__init__(model)
        model.gradient_checkpointing_enable()


# The Trainer's path (bf16=True): autocast over fp32 weights (a model built from a config) and over
# bf16 weights, every fusion of the layer matched (the vocabulary bound opened for the loss). The
# arithmetic is bf16 whatever the weights, so the floor is bf16's.
TRAINER_EXPECT = {"rms_norm_residual": 5, "rope": 2, "flash_attention": 2, "attention_out_proj": 2,
                  "swiglu_mlp": 2, "linear_cross_entropy": 1}
# (model, weights, the step's wrapper, the variant's suffix): with gradient_checkpointing=True too
for _name, _weights, _wrap, _suffix in (("llama", torch.float32, TrainerLM, ""), ("llama", torch.bfloat16, TrainerLM, ""),
                                        ("qwen2", torch.float32, TrainerLM, ""),
                                        ("llama", torch.float32, _CheckpointedTrainerLM, "-checkpointing")):
    _cfg, _cls, _attn, _b, _s, _v, _mlm, _config = MODELS[_name]
    _variant = f"{_name}-trainer-amp{_suffix}"
    CASES.append(Case(
        name=f"model/{_variant}/train/{dtype_name(_weights)}/B{_b}xS{_s}", fusion="model", variant=_variant,
        make=_make(_cfg, _cls, _attn, _b, _s, _v, _mlm, _config, wrap=_wrap),
        dtype=_weights, train=True, expect=TRAINER_EXPECT, config={"linear_cross_entropy_min_vocab": 5000},
        eager_baseline=True, floor=FLOOR[torch.bfloat16], differentiated_outputs=1,
    ))
