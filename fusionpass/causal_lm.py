"""A causal LM's training loss without its logits output: `loss_only(model)`.

A transformers `*ForCausalLM` returns the logits next to the loss, so under torch.compile they are
an output of the graph and `linear_cross_entropy` has to write all of them ([tokens, vocabulary]
in the model dtype: 16 GiB at 64k tokens and a 128k vocabulary), even when the caller reads only
the loss, as a trainer does. Liger-Kernel's patched forwards skip them in training; this is the
same contract without patching anything: wrap the model, compile the wrapper, and the graph's only
output is the loss, so the fused loss never materializes the logits
(benchmarks/results/memory/training.md).

    step_model = torch.compile(fusionpass.loss_only(model), backend="fusionpass")
    loss = step_model(input_ids=ids, attention_mask=mask, labels=labels).loss

The wrapper calls the model's own base model, lm_head and loss_function, so it accepts only a
model whose forward is transformers' standard causal-LM forward (the one LlamaForCausalLM has,
compared as source): any model that does more between lm_head and the loss (Gemma-2's logit
soft-capping, Cohere's logit scale) is refused with the reason, never given a different loss.
"""
from __future__ import annotations

import functools
import inspect

import torch

__all__ = ["LossOnly", "loss_only"]


@functools.lru_cache(maxsize=None)  # a class's source does not change; the Trainer asks every step
def _forward_body(cls) -> str | None:
    """The source of cls.forward without its signature and docstring, or None if unreadable."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None
    body = source.split('"""')[-1] if source.count('"""') >= 2 else source.split(":\n", 1)[-1]
    return "\n".join(line.strip() for line in body.splitlines() if line.strip())


def why_not_standard(model) -> str | None:
    """None if `model`'s forward is the standard causal-LM forward; otherwise why it is refused."""
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return "transformers is not installed"
    if not hasattr(model, "loss_function") or model.get_output_embeddings() is None:
        return f"{type(model).__name__} has no lm_head and loss_function"
    if getattr(model, "base_model", model) is model:
        return f"{type(model).__name__} has no separate base model"
    reference, body = _forward_body(LlamaForCausalLM), _forward_body(type(model))
    if reference is None or body is None:
        return f"the source of {type(model).__name__}.forward cannot be read"
    if body != reference:
        return (f"{type(model).__name__}.forward is not the standard causal-LM forward (base model, "
                "lm_head, loss_function): it may change the logits before the loss")
    return None


class LossOnly(torch.nn.Module):
    """model(...) with `loss` only (logits None); the same parameters, modules and loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        reason = why_not_standard(model)
        if reason is not None:
            raise ValueError(f"fusionpass.loss_only: {reason}")
        self.model = model

    def forward(self, input_ids=None, labels=None, attention_mask=None, position_ids=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if labels is None:
            raise ValueError("fusionpass.loss_only: a loss needs labels")
        model = self.model  # no cache: a training step has no use for one (use_cache is ignored)
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, inputs_embeds=inputs_embeds,
                                  use_cache=False, **kwargs).last_hidden_state
        logits = model.get_output_embeddings()(hidden)
        loss = model.loss_function(logits=logits, labels=labels, vocab_size=model.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss)


def loss_only(model: torch.nn.Module) -> LossOnly:
    """Wrap a transformers causal LM so its output holds the loss and no logits (see the module)."""
    return LossOnly(model)


def loss_only_where_standard(model: torch.nn.Module) -> torch.nn.Module:
    """`model` as install()'s Trainer calls it: through LossOnly where its forward is the standard
    causal-LM one, else unchanged (it returns its logits)."""
    return LossOnly(model) if why_not_standard(model) is None else model
