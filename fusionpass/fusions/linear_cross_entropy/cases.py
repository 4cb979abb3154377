"""Conformance cases of linear_cross_entropy: a matrix of loss forms x dtypes x shapes x training
and inference (`fusionpass.conformance.builders`), and an LLM-sized vocabulary at the default cost
rule.

The modules are written the way transformers 5.x writes the loss: through ForCausalLMLoss's
`.float()`/pad/shift, and the older and plain-training forms beside it.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from fusionpass.conformance.builders import BF16, case, maker, rotating
from fusionpass.fusions.linear_cross_entropy.pattern import RETURNED_WITH_GRAD


def _fixed_cross_entropy(source, target, num_items_in_batch=None, ignore_index=-100):
    """transformers 5.x loss_utils.fixed_cross_entropy: mean, or sum / num_items_in_batch (the
    Trainer's gradient-accumulation form)."""
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(source, target, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        loss = loss / num_items_in_batch.to(loss.device)
    return loss


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100):
    """transformers 5.x ForCausalLMLoss: upcast, pad the labels with one ignored position, shift."""
    logits = logits.float()
    labels = F.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1).to(logits.device)
    return _fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index)


class CausalLMHead(nn.Module):
    """HF *ForCausalLM: `logits = lm_head(hidden_states[:, slice_indices, :])`, Gemma-2's
    final_logit_softcapping when set, then ForCausalLMLoss. Training returns the loss only, as
    fusionpass.loss_only does (returned logits that require grad keep the loss out of the op:
    fusions/linear_cross_entropy/pattern.py); inference returns (loss, logits) as the model does."""

    def __init__(self, hidden, vocab, softcap=None, logits_in_training=False):
        super().__init__()
        self.vocab, self.softcap, self.logits_in_training = vocab, softcap, logits_in_training
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden_states, labels, num_items_in_batch=None):
        logits = self.lm_head(hidden_states[:, slice(0, None), :])
        if self.softcap is not None:
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        loss = causal_lm_loss(logits, labels, self.vocab, num_items_in_batch)
        return (loss, logits) if self.logits_in_training or not self.training else loss


class ShiftLogitsHead(nn.Module):
    """Older HF causal LMs (GPT-2/GPT-NeoX before the loss refactor): shift the logits against
    labels[..., 1:], CrossEntropyLoss on the model-dtype scores."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.vocab = vocab
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden_states, labels):
        lm_logits = self.lm_head(hidden_states)
        shift_logits = lm_logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = nn.CrossEntropyLoss()(shift_logits.view(-1, self.vocab), shift_labels.view(-1))
        return (loss, lm_logits) if not self.training else loss


class TiedMatmulHead(nn.Module):
    """Plain training code with tied embeddings: `h @ embedding.weight.T`, label smoothing."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)

    def forward(self, h, labels):
        logits = h.reshape(-1, h.shape[-1]) @ self.embed.weight.T
        return F.cross_entropy(logits, labels.reshape(-1), label_smoothing=0.1)


class MaskedLMHead(nn.Module):
    """BERT's MLM loss: CrossEntropyLoss on the model-dtype scores of a biased decoder."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.vocab = vocab
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, sequence_output, labels):
        prediction_scores = self.decoder(sequence_output)
        loss = nn.CrossEntropyLoss()(prediction_scores.view(-1, self.vocab), labels.view(-1))
        return (loss, prediction_scores) if not self.training else loss


def causal_labels(b, s, vocab):
    """Next-token labels: a prompt of -100 on the first sequence, right padding (-100) on the last."""
    labels = torch.randint(0, vocab, (b, s))
    labels[0, : s // 3] = -100
    labels[-1, s - 5 :] = -100
    return labels


def _mlm_labels(b, s, vocab):
    """About 15% of the positions carry a label, the rest -100."""
    labels = torch.randint(0, vocab, (b, s))
    return torch.where(torch.rand(b, s) < 0.15, labels, -100)


def _trained_scale(weight):
    """Logits of standard deviation 2 for unit hidden states (a trained LM's spread, not the
    near-uniform softmax of nn.Linear's init): peaked rows, and soft-cap tails that bend."""
    nn.init.normal_(weight, std=2.0 * weight.shape[1] ** -0.5)


def _ce_hf(shape, num_items=False, softcap=None, logits_in_training=False):
    b, s, hidden, vocab = shape
    head = CausalLMHead(hidden, vocab, softcap, logits_in_training)
    _trained_scale(head.lm_head.weight)
    labels = causal_labels(b, s, vocab)
    inputs = (torch.randn(b, s, hidden), labels)
    if num_items:  # what the Trainer passes: the number of labelled tokens after the shift
        inputs += (torch.tensor(int((labels[:, 1:] != -100).sum())),)
    return head, inputs


def _ce_shift(shape):
    b, s, hidden, vocab = shape
    head = ShiftLogitsHead(hidden, vocab)
    _trained_scale(head.lm_head.weight)
    return head, (torch.randn(b, s, hidden), causal_labels(b, s, vocab))


def _ce_matmul(shape):
    b, s, hidden, vocab = shape
    head = TiedMatmulHead(hidden, vocab)
    _trained_scale(head.embed.weight)
    return head, (torch.randn(b, s, hidden), causal_labels(b, s, vocab))


def _ce_mlm(shape):
    b, s, hidden, vocab = shape
    head = MaskedLMHead(hidden, vocab)
    _trained_scale(head.decoder.weight)
    return head, (torch.randn(b, s, hidden), _mlm_labels(b, s, vocab))


# form -> (builder, the variant it matches). Dealt out in this order, the first three land on
# fp32 and bf16, the last three on fp16: label smoothing stays off fp16, where torch's own loss
# overflows (the smoothing term sums log-probabilities over the vocabulary in fp16: inf, eager and
# compiled), which would leave the case nothing to compare against.
CE_FORMS = {
    "hf_causal_mean": (_ce_hf, "float_logits"),
    "gemma2_softcap": (lambda shape: _ce_hf(shape, softcap=5.0), "softcap"),
    "tied_matmul_smoothing": (_ce_matmul, "matmul"),
    "shift_logits": (_ce_shift, "shift_logits"),
    "hf_causal_num_items": (lambda shape: _ce_hf(shape, num_items=True), "float_logits"),
    "bert_mlm": (_ce_mlm, "model_dtype_logits"),  # BERT-style fp16 training: a model-dtype loss
}
# (batch, seq, hidden, vocab): odd token counts and vocabularies; logits of at most ~4.3M
# entries. The soft-cap (5.0, Gemma-2 has 30 for larger logits) is within the logits' tails, so
# that the tanh bends them.
CE_SHAPES = ((2, 37, 64, 5003), (1, 131, 96, 12347), (2, 67, 80, 32001))
CE_MIN_VOCAB = {"linear_cross_entropy_min_vocab": 5000}  # the default (100000) is LLM-sized


def _ce_case(form, dtype, shape, train, config=CE_MIN_VOCAB):
    b, s, hidden, vocab = shape
    return case("linear_cross_entropy", CE_FORMS[form][1], form, dtype, f"b{b}-s{s}-d{hidden}-v{vocab}",
                train, maker(CE_FORMS[form][0], shape), {"linear_cross_entropy": 1}, config)


def _ce_cases():
    cases = rotating(CE_FORMS, CE_SHAPES, _ce_case)
    # an LLM-sized vocabulary at the default cost rule (min vocab 100000)
    cases.append(_ce_case("hf_causal_mean", BF16, (2, 19, 48, 100003), True, config={}))
    # the model's own training output, logits included, both differentiated (a second loss on the
    # logits): the op's logits carry no gradient, so this is a near miss, and plain compile's result
    b, s, hidden, vocab = shape = (2, 19, 48, 100003)
    returned = case("linear_cross_entropy", "float_logits", "hf_causal_logits_returned", BF16,
                    f"b{b}-s{s}-d{hidden}-v{vocab}", True,
                    maker(lambda sh: _ce_hf(sh, logits_in_training=True), shape), {})
    cases.append(dataclasses.replace(returned, near_miss=RETURNED_WITH_GRAD))
    return cases


CASES = _ce_cases()
