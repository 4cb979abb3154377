"""The census of model families (issue 43): the transformers families users train, each as a tiny
config that every fusion's guards can see at work on the CPU (the cost rules' width and vocabulary
bounds opened), run through the conformance runner in bf16 and the way the HF Trainer runs it with
bf16=True (autocast over fp32 weights, a collator's all-ones attention_mask, fp32 logits returned).

Each family declares which fusions apply to it and how often: per decoder layer, and once (the
final norm, the loss). The expected match counts are derived from that, so a fusion that starts or
stops matching on a family fails `tests/models/test_family_census.py` until its declaration says so.
What does not match yet is written next to the family, with the near miss that explains it: those
are the census's findings, and the issues' work list.

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
from fusionpass.conformance.cases_models import TrainerLM, expected

# Shared by every tiny config: 2 layers, 4 query and 2 key/value heads of 64 channels, a 256-token
# vocabulary, no dropout (a float64 reference cannot draw the compiled graph's masks).
LAYERS = 2
TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=128, attention_dropout=0.0, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
# The cost rules' bounds are measured at real widths (2048 and up) and vocabularies; the census asks
# which forms each family's graph has, so they are opened here, as on the CPU they mean nothing.
OPEN = dict(cpu=True, rms_norm_min_width=1, rope_min_tokens=1, linear_cross_entropy_min_vocab=1,
            layer_norm_min_width=1, layer_norm_inference_min_width=1)
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
    attention: str = "sdpa"                       # the attn_implementation its users run

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
    "gpt_oss": Family("GptOssConfig", {"rms_norm_residual": 2}, LOGITS_RETURNED_ONCE,
                      dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"], **_MOE),
                      attention="eager",
                      gaps=RETURNED_LOGITS + "; attention: as Mixtral, the mask comes from another graph after the "
                           "expert loop's graph breaks (\"scores plus a tensor that is neither transformers' "
                           "additive mask nor a per-key bias\"; its layers alone take the kernel, "
                           "fusionpass/fusions/flash_attention/cases.py); rope: its rotation of halves (x1 cos - x2 "
                           "sin, x2 cos + x1 sin) is not a form rope reads, and says nothing; the experts' gated MLP "
                           "in the loop is not matched"),
    "qwen3_moe": Family("Qwen3MoeConfig", {"rms_norm_residual": 4, "rope": 1}, LOGITS_RETURNED_ONCE,
                        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **_MOE),
                        mode_counts={"trainer-amp": {"rms_norm_residual": 2 * LAYERS + 1}},
                        gaps=RETURNED_LOGITS + "; as Mixtral (attention after the expert loop's graph breaks, "
                             "experts' SwiGLU); under autocast, as Qwen3, its q/k norms"),
}


def _make(family: Family, autocast: bool):
    def make(dtype, device):
        import transformers

        kwargs = {k: v for k, v in {**TINY, **family.overrides}.items() if k not in family.drop}
        cfg = getattr(transformers, family.config)(**kwargs)
        cfg._attn_implementation = family.attention
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(device, dtype)
        ids = torch.randint(3, TINY["vocab_size"], (BATCH, SEQ), device=device)
        return TrainerLM(model, autocast), (ids, ids.clone())

    return make


def case(name: str, mode: str) -> Case:
    """The conformance case of family `name` in `mode` ("bf16": bf16 weights; "trainer-amp": fp32
    weights under bf16 autocast). Both are judged at bf16's floor, against float64 eager."""
    family = FAMILIES[name]
    amp = mode == "trainer-amp"
    return Case(name=f"census/{name}/{mode}", fusion="model", variant=name, make=_make(family, amp),
                dtype=torch.float32 if amp else torch.bfloat16, train=True, expect=family.expected(mode),
                config=OPEN, eager_baseline=True, floor=FLOOR[torch.bfloat16], differentiated_outputs=1)


def cases() -> list[Case]:
    return [case(name, mode) for name, family in FAMILIES.items() for mode in family.modes]
