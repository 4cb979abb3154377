"""The HF Trainer's training loss without the logits, where the Trainer provably ignores them.

`Trainer.compute_loss` runs `model(**inputs)` and, in training with `return_outputs=False`, no
label smoother and no `compute_loss_func`, reads nothing of the outputs but the loss. Under
`torch_compile=True` the graph still returns the logits: in the model's dtype, and again in fp32
where accelerate's `convert_outputs_to_fp32` wraps the forward (mixed precision), so both are alive
at the end of the forward (docs/training-memory.md). `install()` wraps `Trainer.compute_loss`;
where every check of `why_not_routed` holds, the model it is given is replaced for that call by
`loss_only(model)` (fusionpass/causal_lm.py), compiled with the Trainer's own compile settings and
run under the Trainer's own autocast: the same modules, parameters and loss, and a graph with no
logits output. Everything else goes to the original `compute_loss` unchanged: evaluation,
`return_outputs=True` (TRL's SFTTrainer asks for it to count token accuracy), a label smoother or
custom loss (they read the logits), a model wrapped for DDP/FSDP/DeepSpeed or not compiled, hooks
on the model, and any forward other than the standard causal-LM forward.

Liger-Kernel skips the logits in training whenever labels are given, inside the model's forward, so
a caller that reads `outputs.logits` gets None (its users' report: a token-accuracy metric lost,
linkedin/Liger-Kernel#328; Liger later computed the accuracy inside its loss kernel for TRL). Here the model's own forward is never changed: only this
one call site, which is proven to drop them, stops receiving them.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import sys

from fusionpass.causal_lm import LossOnly, why_not_standard

_LOG = logging.getLogger("fusionpass")
_MODULE = "transformers.trainer"
_ATTRIBUTE = "_fusionpass_loss_only"  # on a Trainer: (compiled model, its compiled loss_only)


# ---------------------------------------------------------------------------------------------
# the checks: each returns why the call is not routed, or None


def _reads_outputs(trainer, return_outputs) -> str | None:
    if return_outputs:
        return "the caller reads the outputs (return_outputs=True)"
    if getattr(trainer, "label_smoother", None) is not None:
        return "a label smoother computes the loss from the logits"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func computes the loss from the outputs"
    return None


def _compiled_model(model) -> str | None:
    from torch._dynamo.eval_frame import OptimizedModule

    if type(model) is not OptimizedModule:
        return (f"the model is a {type(model).__name__}, not a torch.compile'd module (torch_compile=False, "
                "or wrapped for DDP, FSDP or DeepSpeed)")
    return None


def _trains(model, inputs) -> str | None:
    if not model.training:
        return "the model is in eval mode"
    if inputs.get("labels") is None:
        return "no labels: the model computes no loss"
    return None


def _forward_unchanged(model) -> str | None:
    """The instance's forward is its class's, or accelerate's autocast + fp32 wrapper of it (which
    the route replaces by running under `accelerator.autocast()`); no hooks on the model itself."""
    if model._forward_hooks or model._forward_pre_hooks or hasattr(model, "_hf_hook"):
        return "the model has forward hooks, which the loss-only call would skip"
    patched = model.__dict__.get("forward")
    if patched is None:
        return None
    original = model.__dict__.get("_original_forward")
    if getattr(original, "__func__", None) is not type(model).forward:
        return "the model's forward is patched by something other than accelerate's mixed precision"
    return None


def _mixed_precision(trainer) -> str | None:
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None:
        return "the Trainer has no accelerator"
    if str(getattr(accelerator, "mixed_precision", "no")) not in ("no", "bf16", "fp16"):
        return f"mixed precision {accelerator.mixed_precision} (only autocast's bf16 and fp16 are reproduced)"
    return None


def why_not_routed(trainer, model, inputs, return_outputs) -> str | None:
    """None if this compute_loss call provably reads only the loss of a standard causal LM that
    loss_only can compute; otherwise the first reason it does not."""
    for why in (_reads_outputs(trainer, return_outputs), _compiled_model(model)):
        if why is not None:
            return why
    inner = model._orig_mod
    for check in (lambda: _trains(inner, inputs), lambda: _forward_unchanged(inner),
                  lambda: _mixed_precision(trainer), lambda: why_not_standard(inner)):
        why = check()
        if why is not None:
            return why
    return None


# ---------------------------------------------------------------------------------------------
# the route


class _LossOnlyCall:
    """Called by compute_loss as `model(**inputs)`: the compiled loss_only under the Trainer's
    autocast (what accelerate's wrapper around the model's forward would have applied)."""

    def __init__(self, trainer, compiled):
        self.trainer, self.compiled = trainer, compiled

    def __call__(self, **inputs):
        autocast = self.trainer.accelerator.autocast() if self.trainer.accelerator.native_amp else contextlib.nullcontext()
        with autocast:
            return self.compiled(**inputs)


def loss_only_call(trainer, model) -> _LossOnlyCall:
    """loss_only(model's module), compiled as the model was (its dynamo context: backend, mode,
    dynamic), once per compiled model."""
    from torch._dynamo.eval_frame import OptimizedModule

    held = trainer.__dict__.get(_ATTRIBUTE)
    if held is None or held[0] is not model:
        held = (model, OptimizedModule(LossOnly(model._orig_mod), model.dynamo_ctx))
        trainer.__dict__[_ATTRIBUTE] = held
        _LOG.info("Trainer: the training loss runs through loss_only(%s): no logits output",
                  type(model._orig_mod).__name__)
    return _LossOnlyCall(trainer, held[1])


def _wrap(original):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        why = why_not_routed(self, model, inputs, return_outputs)
        if why is None:
            model = loss_only_call(self, model)
        else:
            _LOG.debug("Trainer.compute_loss keeps the model's outputs: %s", why)
        return original(self, model, inputs, return_outputs=return_outputs,
                        num_items_in_batch=num_items_in_batch, **kwargs)

    compute_loss.__wrapped__ = compute_loss.fusionpass_original = original
    compute_loss.__doc__ = original.__doc__
    return compute_loss


# ---------------------------------------------------------------------------------------------
# patching Trainer, now or when transformers.trainer is imported


def _patch(trainer_module) -> None:
    cls = trainer_module.Trainer
    if not hasattr(cls.compute_loss, "fusionpass_original"):
        cls.compute_loss = _wrap(cls.compute_loss)


def _unpatch(trainer_module) -> None:
    cls = trainer_module.Trainer
    original = getattr(cls.compute_loss, "fusionpass_original", None)
    if original is not None:
        cls.compute_loss = original


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches transformers.trainer right after it is first imported (install() may come first)."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def installed() -> bool:
    """Whether install() is in force (the patch made, or waiting for the import)."""
    module = sys.modules.get(_MODULE)
    if module is not None and hasattr(module.Trainer.compute_loss, "fusionpass_original"):
        return True
    return any(isinstance(f, _PatchOnImport) for f in sys.meta_path)


def install() -> None:
    """Route Trainer.compute_loss as the module says, from now on (idempotent)."""
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    if _MODULE in sys.modules:
        _unpatch(sys.modules[_MODULE])
