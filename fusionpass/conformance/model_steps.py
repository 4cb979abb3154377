"""How the model cases call a Hugging Face model, and how their expected match counts add up.

The steps: `LM` as a training loop calls a model, `LossOnlyLM` through fusionpass.loss_only,
`TrainerLM` as the HF Trainer with bf16=True runs it (`CheckpointedTrainerLM` with
gradient_checkpointing=True, `TrainerSpeechSeq2Seq` for a speech encoder-decoder's batch). The
counts: `expected` sums per-layer and once-only declarations (conformance/families.py), where a
count is an int or (training, inference)."""
from __future__ import annotations

import torch
from torch import nn

from fusionpass.causal_lm import loss_only_where_standard

TRAIN_ONLY, INFER_ONLY = (1, 0), (0, 1)


def expected(layers, once, train: bool) -> dict[str, int]:
    """Matches per fusion in training or inference: the layers' and `once`'s, summed."""
    counts: dict[str, int] = {}
    for part in (*layers, once):
        for fusion, n in part.items():
            n = n if isinstance(n, int) else n[0 if train else 1]
            if n:
                counts[fusion] = counts.get(fusion, 0) + n
    return counts


class LM(nn.Module):
    """model(input_ids, labels) -> (loss, logits), the way a training loop calls it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        out = self.model(input_ids=input_ids, labels=labels)
        return out.loss, out.logits


class LossOnlyLM(nn.Module):
    """fusionpass.loss_only(model)(input_ids, labels) -> (loss,): the graph has no logits output."""

    def __init__(self, model):
        super().__init__()
        import fusionpass

        self.model = fusionpass.loss_only(model)

    def forward(self, input_ids, labels):
        return (self.model(input_ids=input_ids, labels=labels).loss,)


class TrainerLM(nn.Module):
    """A step as the HF Trainer with bf16=True runs it: accelerate's autocast around the forward, a
    collator's all-ones attention_mask, and the returned logits converted to fp32
    (`convert_outputs_to_fp32`). With fusionpass installed, the Trainer's compute_loss runs a model
    of the standard causal-LM forward through loss_only (fusionpass/hf_trainer.py): no logits are
    returned then, so the loss can fuse; other models return logits that require grad, which keeps
    the loss from fusing. The float64 reference is unchanged by the autocast (float64 tensors are
    not autocast's to cast), so it is the exact function the bf16 computation approximates.
    `autocast=False`: the same step of a bf16 model without bf16=True (the census's bf16 mode)."""

    def __init__(self, model, autocast: bool = True):
        super().__init__()
        self.autocast = autocast
        self.model = loss_only_where_standard(model)

    def forward(self, input_ids, labels):
        return self._step(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), labels=labels)

    def _step(self, **batch):
        """The model on the collator's `batch` under the Trainer's autocast: (loss,), or (loss, fp32
        logits) where the model returns logits."""
        device = next(iter(batch.values())).device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(**batch)
        return (out.loss,) if out.logits is None else (out.loss, out.logits.float())


class TrainerSpeechSeq2Seq(TrainerLM):
    """TrainerLM for a speech encoder-decoder (Whisper): its collator (transformers' speech
    fine-tuning recipe, DataCollatorSpeechSeq2SeqWithPadding) passes the log-mel `input_features`
    and the `labels`, and no attention_mask."""

    def forward(self, input_features, labels):
        return self._step(input_features=input_features, labels=labels)


def log_mel_features(config, batch: int, device, dtype) -> torch.Tensor:
    """A speech encoder-decoder's input as its collator passes it: [batch, num_mel_bins,
    2 x max_source_positions] (the encoder's convolution stem halves the frames)."""
    return torch.randn(batch, config.num_mel_bins, 2 * config.max_source_positions, device=device, dtype=dtype)


class CheckpointedTrainerLM(TrainerLM):
    """TrainerLM with gradient_checkpointing=True: each layer a checkpointed body the model's graph
    calls, its mask and autocast state proven there."""

    def __init__(self, model):
        super().__init__(model)
        model.gradient_checkpointing_enable()
