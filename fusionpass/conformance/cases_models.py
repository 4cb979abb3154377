"""Conformance cases on small real Hugging Face models: 2 layers at real widths, random weights,
bf16, training (loss, logits and every parameter's gradient) and inference (logits), against the
float64 eager model. Each also pins its match counts, so a route that stops matching fails.

Dropout probabilities are 0 (a float64 reference cannot draw the compiled graph's masks; the
dropout paths have their own cases in fusionpass/fusions/layer_norm_dropout_residual/cases.py).
Sequence lengths are odd on purpose.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from fusionpass.causal_lm import LossOnly, why_not_standard
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


# What fusionpass matches in a model's graph, derived from its layers: per layer, the fusions that
# apply there and how often (an int, or (training, inference) where the modes differ), then what
# matches once, outside the layers (the final norm). A change here is a change of what fusionpass
# compiles; the counts were read off the H200 runs (torch 2.11, transformers 5.17, default config;
# bert's on CPU, torch 2.13).
LAYERS = 2
TRAIN_ONLY, INFER_ONLY = (1, 0), (0, 1)
# Llama-style decoder layers: two RMSNorms in training (the second fuses the attention's residual
# add; in inference the norm measured slower than Inductor's at every width, its cost_table.py),
# RoPE, the SwiGLU MLP in training (its recompute-product route; inference at these row counts stays with
# Inductor, swiglu_mlp's cost rule); SDPA with transformers' causal mask proven causal ...
SDPA_DECODER = {"rms_norm_residual": (2, 0), "rope": 1, "sdpa_mask": 1, "swiglu_mlp": TRAIN_ONLY}
# ... or, in eager attention or under a sliding window, the attention kernel with its output
# projection, q's rotation inside it in inference.
KERNEL_DECODER = {"rms_norm_residual": (2, 0), "rope": 1, "flash_attention": 1, "rope_attention": INFER_ONLY,
                  "attention_out_proj": 1, "swiglu_mlp": TRAIN_ONLY}
FINAL_NORM = {"rms_norm_residual": (1, 0)}
# Attention in the kernel with its output projection (eager math, ALiBi); dropout + residual +
# LayerNorm fuses in training (in inference these widths are below its cost rule's).
KERNEL_ATTENTION = {"flash_attention": 1, "attention_out_proj": 1}
TRAINING_LAYER_NORMS = {"layer_norm_dropout_residual": (2, 0)}


@dataclasses.dataclass(frozen=True)
class Model:
    config_class: str
    model_class: str  # an Auto* class
    attention: str    # transformers' attention implementation
    batch: int
    seq: int
    vocab: int
    masked_lm: bool
    config: dict
    layers: tuple[Mapping[str, int | tuple[int, int]], ...]  # one per layer, LAYERS of them
    once: Mapping[str, int | tuple[int, int]] = dataclasses.field(default_factory=dict)

    def expected(self, train: bool) -> dict[str, int]:
        return expected(self.layers, self.once, train)


def expected(layers, once, train: bool) -> dict[str, int]:
    """Matches per fusion in training or inference: the layers' and `once`'s, summed."""
    counts: dict[str, int] = {}
    for part in (*layers, once):
        for fusion, n in part.items():
            n = n if isinstance(n, int) else n[0 if train else 1]
            if n:
                counts[fusion] = counts.get(fusion, 0) + n
    return counts


def _alike(layer, **kw):
    return dict(layers=(layer,) * LAYERS, **kw)


MODELS = {
    "llama": Model("LlamaConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False, _llama_like(),
                   **_alike(SDPA_DECODER, once=FINAL_NORM)),
    # the model the rope_attention bug was seen on (eager attention, 16/4 heads, head dim 128)
    "llama-eager": Model("LlamaConfig", "AutoModelForCausalLM", "eager", 4, 512, 32000, False, _llama_like(),
                         **_alike(KERNEL_DECODER, once=FINAL_NORM)),
    "mistral": Model("MistralConfig", "AutoModelForCausalLM", "sdpa", 2, 257, 32000, False,
                     dict(_llama_like(), sliding_window=None), **_alike(SDPA_DECODER, once=FINAL_NORM)),
    # a sliding window shorter than the sequence in every layer (flash_attention's window route)
    "mistral-window": Model("MistralConfig", "AutoModelForCausalLM", "sdpa", 2, 257, 32000, False,
                            dict(_llama_like(), sliding_window=129), **_alike(KERNEL_DECODER, once=FINAL_NORM)),
    # Gemma-3's local then global layer (head dim 256, query_pre_attn_scalar's scale, q/k norms): four
    # RMSNorms a layer (its q/k norms are narrower than the cost rule's width), the window in the kernel,
    # the global layer's causal mask proven
    "gemma3": Model("Gemma3TextConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
                    dict(_llama_like(heads=8, kv_heads=4, head_dim=256), sliding_window=129,
                         layer_types=["sliding_attention", "full_attention"]),
                    layers=({**KERNEL_DECODER, "rms_norm_residual": (4, 0)},
                            {**SDPA_DECODER, "rms_norm_residual": (4, 0)}),
                    once=FINAL_NORM),
    "qwen2": Model("Qwen2Config", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False, _llama_like(),
                   **_alike(SDPA_DECODER, once=FINAL_NORM)),
    "qwen3": Model("Qwen3Config", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False, _llama_like(),
                   **_alike(SDPA_DECODER, once=FINAL_NORM)),
    "phi3": Model("Phi3Config", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
                  dict(_llama_like(kv_heads=16), resid_pdrop=0.0, embd_pdrop=0.0), **_alike(SDPA_DECODER, once=FINAL_NORM)),
    "gemma": Model("GemmaConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
                   dict(_llama_like(head_dim=128), hidden_activation="gelu_pytorch_tanh"),
                   **_alike(SDPA_DECODER, once=FINAL_NORM)),
    "gpt2-eager": Model("GPT2Config", "AutoModelForCausalLM", "eager", 4, 513, 32000, False,
                        dict(n_embd=768, n_layer=2, n_head=12, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                        **_alike({**KERNEL_ATTENTION, **TRAINING_LAYER_NORMS})),
    "gpt2-sdpa": Model("GPT2Config", "AutoModelForCausalLM", "sdpa", 4, 513, 32000, False,
                       dict(n_embd=768, n_layer=2, n_head=12, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                       **_alike({"sdpa_mask": 1, **TRAINING_LAYER_NORMS})),
    "bert": Model("BertConfig", "AutoModelForMaskedLM", "sdpa", 4, 509, 30522, True,
                  dict(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                  **_alike({"sdpa_mask": 1, **TRAINING_LAYER_NORMS})),
    # ModernBERT's global then local layer: the global one's all-true mask proven, the local band in
    # the kernel
    "modernbert": Model("ModernBertConfig", "AutoModelForMaskedLM", "sdpa", 4, 509, 32000, True,
                        dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=2, num_attention_heads=12,
                             attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0, pad_token_id=0,
                             max_position_embeddings=1024),
                        layers=({"sdpa_mask": 1, **TRAINING_LAYER_NORMS}, {**KERNEL_ATTENTION, **TRAINING_LAYER_NORMS})),
    "bloom": Model("BloomConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                   dict(hidden_size=1024, n_layer=2, n_head=16, **_NO_DROPOUT),
                   **_alike({**KERNEL_ATTENTION, **TRAINING_LAYER_NORMS})),
    "falcon-alibi": Model("FalconConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
                          dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, alibi=True,
                               new_decoder_architecture=False, multi_query=False, **_NO_DROPOUT),
                          **_alike(KERNEL_ATTENTION)),
    "gpt-neox": Model("GPTNeoXConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                      dict(hidden_size=1024, num_hidden_layers=2, num_attention_heads=16, intermediate_size=4096,
                           rotary_pct=0.25, max_position_embeddings=1024, **_NO_DROPOUT),
                      **_alike({"rope": 1, **KERNEL_ATTENTION})),
    # GPT-J's eager attention has no route: in a bf16 model its _attn upcasts q and k but not v (mixed
    # dtypes, a near miss), and fp32 attention stays out of the kernels on CUDA
    "gptj": Model("GPTJConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                  dict(n_embd=1024, n_layer=2, n_head=16, rotary_dim=64, n_positions=1024, resid_pdrop=0,
                       embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0),
                  **_alike({"rope": 1})),
    # OPT: its eager attention in the kernel in inference only; in training one LayerNorm a layer
    "opt": Model("OPTConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                 dict(hidden_size=1024, num_hidden_layers=2, ffn_dim=4096, num_attention_heads=16, dropout=0.0,
                      attention_dropout=0.0, layerdrop=0.0, max_position_embeddings=1024, word_embed_proj_dim=1024),
                 **_alike({"flash_attention": INFER_ONLY, "attention_out_proj": INFER_ONLY,
                           "layer_norm_dropout_residual": TRAIN_ONLY})),
}

def _make_model(m: Model, wrap=None):
    return _make(m.config_class, m.model_class, m.attention, m.batch, m.seq, m.vocab, m.masked_lm, m.config,
                 **({} if wrap is None else {"wrap": wrap}))


CASES = []
for _name, _m in MODELS.items():
    for _train in (True, False):
        CASES.append(Case(
            name=f"model/{_name}/{'train' if _train else 'infer'}/bf16/B{_m.batch}xS{_m.seq}",
            fusion="model", variant=_name, make=_make_model(_m),
            dtype=torch.bfloat16, train=_train, expect=_m.expected(_train), eager_baseline=True,
        ))

# A training loop's loss through fusionpass.loss_only: linear_cross_entropy writes no logits
# (the vocabulary bound opened so that this vocabulary fuses; llama's own counts otherwise).
for _name in ("llama", "qwen2"):
    _m = MODELS[_name]
    CASES.append(Case(
        name=f"model/{_name}-loss-only/train/bf16/B{_m.batch}xS{_m.seq}", fusion="model", variant=f"{_name}-loss-only",
        make=_make_model(_m, _LossOnlyLM),
        dtype=torch.bfloat16, train=True, expect={**_m.expected(True), "linear_cross_entropy": 1},
        config={"linear_cross_entropy_min_vocab": 5000}, eager_baseline=True,
    ))


class TrainerLM(nn.Module):
    """A step as the HF Trainer with bf16=True runs it: accelerate's autocast around the forward, a
    collator's all-ones attention_mask, and the returned logits converted to fp32
    (`convert_outputs_to_fp32`). With fusionpass installed, the Trainer's compute_loss runs a model
    of the standard causal-LM forward through loss_only (fusionpass/hf_trainer.py): no logits are
    returned then, so the loss can fuse; other models return logits that require grad, which keeps
    the loss out of linear_cross_entropy. The float64 reference is unchanged by the autocast (float64
    tensors are not autocast's to cast), so it is the exact function the bf16 computation
    approximates. `autocast=False`: the same step of a bf16 model without bf16=True (the census's
    bf16 mode)."""

    def __init__(self, model, autocast: bool = True):
        super().__init__()
        self.autocast = autocast
        self.model = LossOnly(model) if why_not_standard(model) is None else model

    def forward(self, input_ids, labels):
        with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)
        return (out.loss,) if out.logits is None else (out.loss, out.logits.float())


class _CheckpointedTrainerLM(TrainerLM):
    """TrainerLM with gradient_checkpointing=True: each layer a checkpointed body the model's graph
    calls, its mask and autocast state proven there."""

    def __init__(self, model):
        super().__init__(model)
        model.gradient_checkpointing_enable()


# The Trainer's path (bf16=True): autocast over fp32 weights (a model built from a config) and over
# bf16 weights, every fusion of the layer matched (the collator's mask puts attention in the kernel;
# the vocabulary bound opened for the loss). The arithmetic is bf16 whatever the weights, so the
# floor is bf16's.
TRAINER_EXPECT = expected((KERNEL_DECODER,) * LAYERS, {**FINAL_NORM, "linear_cross_entropy": 1}, train=True)
# (model, weights, the step's wrapper, the variant's suffix): with gradient_checkpointing=True too
for _name, _weights, _wrap, _suffix in (("llama", torch.float32, TrainerLM, ""), ("llama", torch.bfloat16, TrainerLM, ""),
                                        ("qwen2", torch.float32, TrainerLM, ""),
                                        ("llama", torch.float32, _CheckpointedTrainerLM, "-checkpointing")):
    _m = MODELS[_name]
    _variant = f"{_name}-trainer-amp{_suffix}"
    CASES.append(Case(
        name=f"model/{_variant}/train/{dtype_name(_weights)}/B{_m.batch}xS{_m.seq}", fusion="model", variant=_variant,
        make=_make_model(_m, _wrap),
        dtype=_weights, train=True, expect=TRAINER_EXPECT, config={"linear_cross_entropy_min_vocab": 5000},
        eager_baseline=True, floor=FLOOR[torch.bfloat16], differentiated_outputs=1,
    ))
