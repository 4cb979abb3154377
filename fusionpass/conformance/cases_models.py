"""Conformance cases on small real Hugging Face models (`families.MODELS`): 2 layers at real
widths, random weights, bf16, training (loss, logits and every parameter's gradient) and inference
(logits), against the float64 eager model. Each also pins its match counts, derived from its
family's declaration, so a route that stops matching fails.

Dropout probabilities are 0 (a float64 reference cannot draw the compiled graph's masks; the
dropout paths have their own cases in their fusion's folder). Sequence lengths are odd on purpose.
"""
from __future__ import annotations

import torch

from fusionpass.conformance import FLOOR, Case, dtype_name
from fusionpass.conformance.families import LOSS_ONLY_ONCE, MODELS, TRAINER_EXPECT, Model
from fusionpass.conformance.model_steps import LM, CheckpointedTrainerLM, LossOnlyLM, TrainerLM


def _make(config_name, model_class, attn, batch, seq, vocab, masked_lm, config, wrap=LM):
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

# A training loop's loss through fusionpass.loss_only (the vocabulary bound opened so that this
# vocabulary fuses)
for _name in ("llama", "qwen2"):
    _m = MODELS[_name]
    CASES.append(Case(
        name=f"model/{_name}-loss-only/train/bf16/B{_m.batch}xS{_m.seq}", fusion="model", variant=f"{_name}-loss-only",
        make=_make_model(_m, LossOnlyLM),
        dtype=torch.bfloat16, train=True, expect={**_m.expected(True), **LOSS_ONLY_ONCE},
        config={"linear_cross_entropy_min_vocab": 5000}, eager_baseline=True,
    ))


# The Trainer's path (bf16=True): autocast over fp32 weights (a model built from a config) and over
# bf16 weights (the vocabulary bound opened for the loss). The arithmetic is bf16 whatever the
# weights, so the floor is bf16's.
# (model, weights, the step's wrapper, the variant's suffix): with gradient_checkpointing=True too
for _name, _weights, _wrap, _suffix in (("llama", torch.float32, TrainerLM, ""), ("llama", torch.bfloat16, TrainerLM, ""),
                                        ("qwen2", torch.float32, TrainerLM, ""),
                                        ("llama", torch.float32, CheckpointedTrainerLM, "-checkpointing")):
    _m = MODELS[_name]
    _variant = f"{_name}-trainer-amp{_suffix}"
    CASES.append(Case(
        name=f"model/{_variant}/train/{dtype_name(_weights)}/B{_m.batch}xS{_m.seq}", fusion="model", variant=_variant,
        make=_make_model(_m, _wrap),
        dtype=_weights, train=True, expect=TRAINER_EXPECT, config={"linear_cross_entropy_min_vocab": 5000},
        eager_baseline=True, floor=FLOOR[torch.bfloat16], differentiated_outputs=1,
    ))
