"""The model families users train, as data: which fusions apply to each and how often, per layer
and once (the final norm, the loss), from which every model case's expected match counts are
derived (`model_steps.expected`). So a fusion that starts or stops matching on a family fails its
cases until its declaration here says so. Two case sets read it:

- `MODELS`: small real Hugging Face models, 2 layers at real widths, bf16, against the float64
  eager model on the GPU (`conformance/cases_models.py` builds their cases);
- `FAMILIES`, the census (issue 43): the transformers families users train (causal LMs, an
  encoder, an encoder-decoder), each as a tiny config that every fusion's guards can see at work on
  the CPU (the cost rules' width and vocabulary bounds opened), run through the conformance runner
  in bf16 and the way the HF Trainer runs it with bf16=True (autocast over fp32 weights, a
  collator's all-ones attention_mask, fp32 logits returned). What does not match yet is written
  next to the family, with the near miss that explains it: those are the census's findings, and
  the issues' work list.

The GPU half of the census reads this table: `python benchmarks/suite.py --only families` times one
training step of each family at the published widths of one of its checkpoints, two layers, plain
compile against fusionpass, with what matched and the near misses (benchmarks/results/latest/
families.md once it has run on a GPU).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from fusionpass.conformance import FLOOR, Case
from fusionpass.conformance.model_steps import (INFER_ONLY, TRAIN_ONLY, TrainerLM, TrainerSpeechSeq2Seq, expected,
                                               log_mel_features)

LAYERS = 2
_NO_DROPOUT = dict(attention_dropout=0.0, hidden_dropout=0.0)


# ---- Small real models at real widths (conformance/cases_models.py builds their cases) ----

# What fusionpass matches in a model's graph, derived from its layers: per layer, the fusions that
# apply there and how often (an int, or (training, inference) where the modes differ), then what
# matches once, outside the layers (the final norm). A change here is a change of what fusionpass
# compiles; the counts were read off the H200 runs (torch 2.11, transformers 5.17, default config;
# bert's on CPU, torch 2.13).
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


def _llama_like(hidden=2048, heads=16, kv_heads=4, head_dim=128, ffn=5632):
    return dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=LAYERS, num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=1024, pad_token_id=0,
                attention_dropout=0.0)


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
                        dict(n_embd=768, n_layer=LAYERS, n_head=12, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                        **_alike({**KERNEL_ATTENTION, **TRAINING_LAYER_NORMS})),
    "gpt2-sdpa": Model("GPT2Config", "AutoModelForCausalLM", "sdpa", 4, 513, 32000, False,
                       dict(n_embd=768, n_layer=LAYERS, n_head=12, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
                       **_alike({"sdpa_mask": 1, **TRAINING_LAYER_NORMS})),
    "bert": Model("BertConfig", "AutoModelForMaskedLM", "sdpa", 4, 509, 30522, True,
                  dict(hidden_size=768, num_hidden_layers=LAYERS, num_attention_heads=12, intermediate_size=3072,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                  **_alike({"sdpa_mask": 1, **TRAINING_LAYER_NORMS})),
    # ModernBERT's global then local layer: the global one's all-true mask proven, the local band in
    # the kernel
    "modernbert": Model("ModernBertConfig", "AutoModelForMaskedLM", "sdpa", 4, 509, 32000, True,
                        dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=LAYERS, num_attention_heads=12,
                             attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0, pad_token_id=0,
                             max_position_embeddings=1024),
                        layers=({"sdpa_mask": 1, **TRAINING_LAYER_NORMS}, {**KERNEL_ATTENTION, **TRAINING_LAYER_NORMS})),
    "bloom": Model("BloomConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                   dict(hidden_size=1024, n_layer=LAYERS, n_head=16, **_NO_DROPOUT),
                   **_alike({**KERNEL_ATTENTION, **TRAINING_LAYER_NORMS})),
    "falcon-alibi": Model("FalconConfig", "AutoModelForCausalLM", "sdpa", 2, 301, 32000, False,
                          dict(hidden_size=1024, num_hidden_layers=LAYERS, num_attention_heads=16, alibi=True,
                               new_decoder_architecture=False, multi_query=False, **_NO_DROPOUT),
                          **_alike(KERNEL_ATTENTION)),
    "gpt-neox": Model("GPTNeoXConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                      dict(hidden_size=1024, num_hidden_layers=LAYERS, num_attention_heads=16, intermediate_size=4096,
                           rotary_pct=0.25, max_position_embeddings=1024, **_NO_DROPOUT),
                      **_alike({"rope": 1, **KERNEL_ATTENTION})),
    # GPT-J's eager attention has no route: in a bf16 model its _attn upcasts q and k but not v (mixed
    # dtypes, a near miss), and fp32 attention stays out of the kernels on CUDA
    "gptj": Model("GPTJConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                  dict(n_embd=1024, n_layer=LAYERS, n_head=16, rotary_dim=64, n_positions=1024, resid_pdrop=0,
                       embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0),
                  **_alike({"rope": 1})),
    # OPT: its eager attention in the kernel in inference only; in training one LayerNorm a layer
    "opt": Model("OPTConfig", "AutoModelForCausalLM", "eager", 2, 301, 32000, False,
                 dict(hidden_size=1024, num_hidden_layers=LAYERS, ffn_dim=4096, num_attention_heads=16, dropout=0.0,
                      attention_dropout=0.0, layerdrop=0.0, max_position_embeddings=1024, word_embed_proj_dim=1024),
                 **_alike({"flash_attention": INFER_ONLY, "attention_out_proj": INFER_ONLY,
                           "layer_norm_dropout_residual": TRAIN_ONLY})),
}


# A training loop's loss through fusionpass.loss_only: the loss fuses (its vocabulary bound opened
# by the case), the model's own counts otherwise
LOSS_ONLY_ONCE = {"linear_cross_entropy": 1}
# The Trainer's path (bf16=True): every fusion of the layer matched (the collator's mask puts
# attention in the kernel), the final norm and the loss
TRAINER_EXPECT = expected((KERNEL_DECODER,) * LAYERS, {**FINAL_NORM, **LOSS_ONLY_ONCE}, train=True)


# ---- The census: tiny configs of every family ----

# Shared by every tiny config: 2 layers, 4 query and 2 key/value heads of 64 channels, a 256-token
# vocabulary, no dropout (a float64 reference cannot draw the compiled graph's masks).
TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=128, attention_dropout=0.0, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
# The cost rules' bounds are measured at real widths (2048 and up) and vocabularies; the census asks
# which forms each family's graph has, so they are opened here, as on the CPU they mean nothing.
OPEN = dict(cpu=True, rms_norm_min_width=1, rms_norm_min_speedup=0.0, rope_min_tokens=1,
            linear_cross_entropy_min_vocab=1, layer_norm_min_width=1, layer_norm_inference_min_width=1)
BATCH, SEQ = 2, 37  # an odd length on purpose
MODES = ("bf16", "trainer-amp")

# The fusions of a Llama-style decoder layer: two RMSNorms (the second fuses the attention's
# residual add), RoPE, the attention kernel and its output projection, the SwiGLU MLP.
LLAMA_LAYER = {"rms_norm_residual": 2, "rope": 1, "flash_attention": 1, "attention_out_proj": 1, "swiglu_mlp": 1}
LLAMA_ONCE = {"rms_norm_residual": 1, "linear_cross_entropy": 1}
# A forward other than transformers' standard causal-LM forward (soft-capped or scaled logits, a
# router's auxiliary loss) is not routed through loss_only (fusionpass/hf_trainer.py): the step
# returns logits that require grad, which keeps the loss out of linear_cross_entropy
LOGITS_RETURNED_ONCE = {"rms_norm_residual": 1}
RETURNED_LOGITS = ("linear_cross_entropy: not the standard causal-LM forward, so the Trainer's step returns "
                   "logits that require grad (the op's logits carry none)")
# Pre-LN families with LayerNorm (GPT-NeoX, Phi, StarCoder2, StableLM): attention, rope, loss
ATTENTION_LAYER = {"rope": 1, "flash_attention": 1, "attention_out_proj": 1}
# Post-LN encoders (BERT and the BERT-likes): attention with its output projection, and both
# dropout + residual + LayerNorm blocks
ENCODER_LAYER = {"flash_attention": 1, "attention_out_proj": 1, "layer_norm_dropout_residual": 2}


@dataclasses.dataclass(frozen=True)
class Family:
    config: str                                   # the transformers config class
    per_layer: Mapping[str, int]                  # fusion -> matches in each decoder layer
    once: Mapping[str, int] = dataclasses.field(default_factory=dict)  # outside the layers
    overrides: Mapping[str, object] = dataclasses.field(default_factory=dict)  # beyond TINY
    drop: tuple[str, ...] = ()                    # TINY keys the config does not take
    # mode -> fusion -> matches that differ from per_layer/once in that mode (0: none)
    mode_counts: Mapping[str, Mapping[str, int]] = dataclasses.field(default_factory=dict)
    modes: tuple[str, ...] = MODES
    gaps: str = ""                                # what does not match yet, and the near miss that says why
    model_class: str = "AutoModelForCausalLM"     # encoders: AutoModelForMaskedLM; T5: AutoModelForSeq2SeqLM
    attention: str = "sdpa"                       # the attn_implementation its users run
    # a speech encoder-decoder (Whisper): its input is log-mel features (the config's num_mel_bins
    # over 2 x max_source_positions frames), not token ids
    input_features: bool = False

    def expected(self, mode: str) -> dict[str, int]:
        counts = expected((self.per_layer,) * LAYERS, self.once, train=True)
        counts.update(self.mode_counts.get(mode, {}))
        return {name: n for name, n in counts.items() if n}


_MOE = dict(experts_implementation="eager")  # the float64 reference has no grouped_mm

FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", LLAMA_LAYER, LLAMA_ONCE),
    "mistral": Family("MistralConfig", LLAMA_LAYER, LLAMA_ONCE),
    "qwen2": Family("Qwen2Config", LLAMA_LAYER, LLAMA_ONCE),
    "qwen3": Family("Qwen3Config", {**LLAMA_LAYER, "rms_norm_residual": 4}, LLAMA_ONCE,  # + q/k norms
                    mode_counts={"trainer-amp": {"rms_norm_residual": 2 * LAYERS + 1}},
                    gaps="under the Trainer's autocast the per-head q/k RMSNorms (fp32 weight over the bf16 "
                         "projection) are not matched"),
    "smollm3": Family("SmolLM3Config", LLAMA_LAYER, LLAMA_ONCE),
    # eager, as Gemma-2 runs: SDPA cannot soft-cap the scores. Four norms per layer (pre and post
    # attention and MLP); the loss soft-caps its logits too
    "gemma2": Family("Gemma2Config", {"rms_norm_residual": 4, "rope": 1, "swiglu_mlp": 1}, LOGITS_RETURNED_ONCE,
                     dict(hidden_activation="gelu_pytorch_tanh", sliding_window=8, query_pre_attn_scalar=64,
                          layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0,
                          final_logit_softcapping=30.0),
                     attention="eager",
                     gaps=RETURNED_LOGITS + "; attention in training: soft-capped scores take the kernel only "
                          "with attention_softcap_training=True (slower than plain compile there, leaner), and "
                          "under the collator's attention_mask a query row that sees no key differentiates a "
                          "uniform softmax, which the kernel does not (in inference both take the kernel)"),
    "gemma": Family("GemmaConfig", LLAMA_LAYER, LLAMA_ONCE, dict(hidden_activation="gelu_pytorch_tanh")),
    "gemma3": Family("Gemma3TextConfig", {**LLAMA_LAYER, "rms_norm_residual": 6}, LOGITS_RETURNED_ONCE,
                     dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
                     gaps=RETURNED_LOGITS),
    "phi3": Family("Phi3Config", LLAMA_LAYER, LLAMA_ONCE, dict(resid_pdrop=0.0, embd_pdrop=0.0)),
    "olmo": Family("OlmoConfig", {**ATTENTION_LAYER, "swiglu_mlp": 1}, {"linear_cross_entropy": 1},
                   gaps="OLMo's LayerNorm (no weight or bias) normalizes the residual sum cast to fp32 and "
                        "casts back: the fusion does not read through the casts, and says nothing"),
    # OLMo-2: norms after attention and MLP (post-norm residuals) and q/k norms over the projections'
    # full width, four RMSNorms per layer
    "olmo2": Family("Olmo2Config", {**LLAMA_LAYER, "rms_norm_residual": 4}, LLAMA_ONCE),
    "granite": Family("GraniteConfig", LLAMA_LAYER, {"rms_norm_residual": 1},
                      gaps="linear_cross_entropy: the logits are divided by logits_scaling before the loss "
                           "(not a known op between projection and loss)"),
    "cohere": Family("CohereConfig", {"flash_attention": 1, "attention_out_proj": 1, "swiglu_mlp": 1},
                     mode_counts={"trainer-amp": {"rope": LAYERS}},
                     gaps="Cohere's LayerNorm (mean-subtracted, no bias) is not an RMSNorm form; the loss "
                          "scales logits by logit_scale; in bf16 its rope computes cos/sin in bf16 for fp32 "
                          "q (a dtype near miss)"),
    # (the first layer's input LayerNorm reads the embeddings: nothing to add, not this fusion's)
    "starcoder2": Family("Starcoder2Config", {**ATTENTION_LAYER, "layer_norm_dropout_residual": 2},
                         {"linear_cross_entropy": 1}, dict(residual_dropout=0.0, embedding_dropout=0.0)),
    "stablelm": Family("StableLmConfig", {**ATTENTION_LAYER, "swiglu_mlp": 1, "layer_norm_dropout_residual": 2},
                       gaps=RETURNED_LOGITS),
    "gpt_neox": Family("GPTNeoXConfig", ATTENTION_LAYER, {},
                       dict(rotary_pct=0.25, hidden_dropout=0.0), modes=("trainer-amp",),
                       gaps=RETURNED_LOGITS + "; parallel residual LayerNorms (near miss by design); bf16 is not "
                            "run on the CPU: plain Inductor's C++ code for its bf16 graph does not compile (torch "
                            "2.13 CPU)"),
    "phi": Family("PhiConfig", ATTENTION_LAYER, {"linear_cross_entropy": 1},
                  dict(resid_pdrop=0.0, embd_pdrop=0.0, partial_rotary_factor=0.5), modes=("trainer-amp",),
                  gaps="the parallel block's LayerNorm under autocast: mixed dtypes; bf16 is not run on the "
                       "CPU: plain Inductor's C++ code for its bf16 graph does not compile (torch 2.13 CPU)"),
    "gpt2": Family("GPT2Config", {"flash_attention": 1, "attention_out_proj": 1, "layer_norm_dropout_residual": 2},
                   overrides=dict(n_embd=256, n_layer=LAYERS, n_head=4, n_positions=128, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0),
                   gaps="linear_cross_entropy: GPT-2's loss reads logits from another graph unless "
                        "model.loss_type = 'ForCausalLM'"),
    # The eager expert loop (the float64 reference has no grouped_mm) breaks the graph: the layers
    # after a break get the causal mask as a graph input, which sdpa_mask cannot prove ("the mask
    # is an input of this graph, built in another graph"), so their attention stays unfused.
    "mixtral": Family("MixtralConfig", {"rms_norm_residual": 2, "rope": 1}, LOGITS_RETURNED_ONCE,
                      dict(num_local_experts=4, num_experts_per_tok=2, **_MOE),
                      gaps=RETURNED_LOGITS + "; attention: the mask comes from another graph (the expert loop's "
                           "graph breaks); the experts' SwiGLU inside the loop is not matched (issue 43, MoE)"),
    # gpt-oss: attention sinks (a sliding-window layer and a full one) and the experts' eager loop
    "gpt_oss": Family("GptOssConfig", {"rms_norm_residual": 2, "rope": 1}, LOGITS_RETURNED_ONCE,
                      dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"], **_MOE),
                      attention="eager",
                      gaps=RETURNED_LOGITS + "; attention: as Mixtral, the mask comes from another graph after the "
                           "expert loop's graph breaks (\"scores plus a tensor that is neither transformers' "
                           "additive mask nor a per-key bias\"; its layers alone take the kernel, "
                           "fusionpass/fusions/flash_attention/cases.py); the experts' gated MLP in the loop is not "
                           "matched"),
    # DeepSeek-V3: MLA (q/k head dim 48 = 32 + a rotated 16, v 32; every head its own k/v), the q and kv
    # latents' RMSNorms, a dense first layer and then routed experts beside a shared one (its SwiGLU)
    "deepseek_v3": Family("DeepseekV3Config", {"rms_norm_residual": 4, "swiglu_mlp": 1}, LLAMA_ONCE,
                          dict(num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
                               qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, **_MOE),
                          drop=("head_dim",), mode_counts={"trainer-amp": {"rms_norm_residual": 2 * LAYERS + 1}},
                          gaps="attention: as Mixtral, the mask comes from another graph after the expert loop's "
                               "graph breaks; rope: its interleaved form (q and k regrouped before rotate_half) is "
                               "not matched (\"add of two products found, but not x * cos + rotate_half(x) ... * "
                               "sin\"); under autocast the latents' RMSNorms are near misses (mixed-dtype math); "
                               "the routed experts' SwiGLU in the loop is not matched"),
    "qwen3_moe": Family("Qwen3MoeConfig", {"rms_norm_residual": 4, "rope": 1}, LOGITS_RETURNED_ONCE,
                        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **_MOE),
                        mode_counts={"trainer-amp": {"rms_norm_residual": 2 * LAYERS + 1}},
                        gaps=RETURNED_LOGITS + "; as Mixtral (attention after the expert loop's graph breaks, "
                             "experts' SwiGLU); under autocast, as Qwen3, its q/k norms"),
    # encoders: BERT's post-LN layers (attention with its output projection, two dropout + residual
    # + LayerNorms), its masked-LM loss
    "bert": Family("BertConfig", ENCODER_LAYER, {}, dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                   model_class="AutoModelForMaskedLM",
                   gaps=RETURNED_LOGITS + "; the embeddings' LayerNorm (nothing to add to it: left alone by "
                        "design)"),
    "roberta": Family("RobertaConfig", ENCODER_LAYER, {},
                      dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1),
                      model_class="AutoModelForMaskedLM",
                      gaps=RETURNED_LOGITS + "; the embeddings' LayerNorm over the sum of word, position and "
                           "token-type embeddings (left to Inductor, as a parallel block's: the near miss names the sum)"),
    "distilbert": Family("DistilBertConfig", ENCODER_LAYER, {}, dict(hidden_dim=256, dropout=0.0, attention_dropout=0.0),
                         drop=("num_key_value_heads", "head_dim"), model_class="AutoModelForMaskedLM",
                         gaps=RETURNED_LOGITS),
    # encoder-decoder: a "layer" here is one encoder layer (2 RMSNorms) and one decoder layer (3), the
    # encoder's and decoder's final norms once
    "t5": Family("T5Config", {"rms_norm_residual": 5}, {"rms_norm_residual": 2},
                 dict(d_ff=256, num_decoder_layers=LAYERS, dropout_rate=0.0, decoder_start_token_id=0),
                 mode_counts={"trainer-amp": {"rms_norm_residual": 2}},
                 model_class="AutoModelForSeq2SeqLM",
                 gaps=RETURNED_LOGITS + "; attention: the relative position bias (and the mask) arrive as one "
                      "additive bf16 tensor (\"attention mask of dtype torch.bfloat16 (an additive bias)\"), which "
                      "no kernel route takes yet; under the Trainer's autocast the layers' norms are near misses "
                      "(\"output dtype torch.bfloat16 differs from input dtype torch.float32 (mixed-dtype math)\")"),
    # speech encoder-decoder, pre-LN with LayerNorms: a "layer" is one encoder and one decoder layer
    # as for T5. In training on transformers 5.17 each layer is its own graph: the layer loop draws
    # its LayerDrop (torch.rand([]) < layerdrop, even at 0) and branches on it, a graph break. So what
    # fuses is the decoder layer's two norms after an attention block's residual add. (5.25 draws
    # only when layerdrop > 0: there the graph stays whole, and these counts are 5.17's.)
    "whisper": Family("WhisperConfig", {"layer_norm_dropout_residual": 2}, {},
                      dict(decoder_layers=LAYERS, decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256,
                           num_mel_bins=16, max_source_positions=24, max_target_positions=64, dropout=0.0,
                           activation_dropout=0.0, decoder_start_token_id=1),
                      drop=("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings"),
                      model_class="AutoModelForSpeechSeq2Seq", input_features=True,
                      gaps=RETURNED_LOGITS + "; on transformers 5.17, the graph break at each layer's LayerDrop draw "
                           "in training: the decoder's causal mask is an input of each layer's graph (sdpa_mask: "
                           "\"mask not provable: the mask is an input of this graph\"), and each layer's first norm "
                           "has its residual add in the graph before; the encoder's norms read the convolution "
                           "stem's output transposed (layer_norm_dropout_residual: \"strides: ... not contiguous in "
                           "its last dimension\"); the encoder's self-attention and the cross-attention have no "
                           "mask: SDPA runs them as written"),
}


def _make(family: Family, autocast: bool):
    def make(dtype, device):
        import transformers

        kwargs = {k: v for k, v in {**TINY, **family.overrides}.items() if k not in family.drop}
        cfg = getattr(transformers, family.config)(**kwargs)
        cfg._attn_implementation = family.attention
        model = getattr(transformers, family.model_class).from_config(cfg).to(device, dtype)
        ids = torch.randint(3, TINY["vocab_size"], (BATCH, SEQ), device=device)
        if family.input_features:
            return TrainerSpeechSeq2Seq(model, autocast), (log_mel_features(cfg, BATCH, device, dtype), ids)
        return TrainerLM(model, autocast), (ids, ids.clone())

    return make


def case(name: str, mode: str) -> Case:
    """The conformance case of family `name` in `mode` ("bf16": bf16 weights; "trainer-amp": fp32
    weights under bf16 autocast). Both are judged at bf16's floor, against float64 eager."""
    return family_case(f"census/{name}/{mode}", name, FAMILIES[name], mode, FAMILIES[name].expected(mode))


def family_case(case_name: str, name: str, family: Family, mode: str, expect: dict[str, int]) -> Case:
    """`family`'s step in `mode`, judged as the census judges, expecting `expect` to match."""
    amp = mode == "trainer-amp"
    return Case(name=case_name, fusion="model", variant=name, make=_make(family, amp),
                dtype=torch.float32 if amp else torch.bfloat16, train=True, expect=expect,
                config=OPEN, eager_baseline=True, floor=FLOOR[torch.bfloat16], differentiated_outputs=1)


def cases() -> list[Case]:
    return [case(name, mode) for name, family in FAMILIES.items() for mode in family.modes]
