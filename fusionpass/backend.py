"""The torch.compile backend "fusionpass", and `enabled()` for users who keep their own options.

The backend is Inductor with our pre-grad pass installed: `mode` and `options` mean exactly what
they mean for `torch.compile(backend="inductor")`, because they go through torch's own Inductor
wrapper.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from fusionpass import config as config_mod
from fusionpass import hf_trainer
from fusionpass.passes import PreGradFusionPass, chained


class FusionpassBackend:
    """A torch.compile backend: Inductor plus the enabled fusions."""

    def __init__(self, config=None, mode=None, options=None, dynamic=None):
        self.config = config if config is not None else config_mod.make()
        self.mode = mode
        self.options = dict(options or {})
        self.dynamic = dynamic
        self.__name__ = "fusionpass"

    def __call__(self, gm, example_inputs, mode=None, options=None):
        # torch.compile(backend=..., mode=..., options=...) passes its mode/options here.
        mode = mode if mode is not None else self.mode
        options = {**self.options, **(options or {})}
        from torch._inductor import config as inductor_config

        existing = options.pop("pre_grad_custom_pass", inductor_config.pre_grad_custom_pass)
        inductor = torch._TorchCompileInductorWrapper(mode, options, self.dynamic)
        inductor.config["pre_grad_custom_pass"] = chained(self.config, existing)
        return inductor(gm, example_inputs)

    def __eq__(self, other):
        return (
            isinstance(other, FusionpassBackend)
            and (self.config, self.mode, self.options, self.dynamic)
            == (other.config, other.mode, other.options, other.dynamic)
        )

    def __hash__(self):
        return hash((self.config, self.mode, self.dynamic))

    def __repr__(self):
        return f"fusionpass.backend(fusions={sorted(self.config.fusions)}, mode={self.mode!r})"


def backend(fusions=None, mode=None, options=None, dynamic=None, **config_overrides):
    """A backend for `torch.compile(model, backend=fusionpass.backend(...))`.

    fusions: names to enable (default: all, or FUSIONPASS_FUSIONS); mode/options: as for
    torch.compile's Inductor; config_overrides: fields of `fusionpass.config.Config`.
    """
    return FusionpassBackend(config_mod.make(fusions, **config_overrides), mode, options, dynamic)


def fusionpass(gm, example_inputs, mode=None, options=None):
    """The entry point behind `torch.compile(model, backend="fusionpass")`."""
    return FusionpassBackend()(gm, example_inputs, mode=mode, options=options)


def register() -> None:
    """Make backend="fusionpass" resolve even when the package runs from a source tree (the
    installed entry point does the same)."""
    from torch._dynamo.backends import registry as dynamo_registry

    if "fusionpass" not in dynamo_registry._COMPILER_FNS:
        dynamo_registry.register_backend(compiler_fn=fusionpass, name="fusionpass")


def install(fusions=None, *, trainer_loss_only: bool = True, **config_overrides):
    """Give every Inductor compile in this process the fusions, until `uninstall()`.

    The pass goes on Inductor's own hook, so it reaches compiles that fusionpass never sees being
    made: the default backend, accelerate/Trainer's `torch_compile=True`, Lightning, torchtitan's
    per-block `torch.compile`, transformers' `generate()` compile. Calling it again replaces the
    settings; a pass the user had on the hook keeps running after ours. Returns the Config.

    trainer_loss_only: where the HF Trainer's `compute_loss` provably reads only the loss of a
    compiled standard causal LM, it gets the loss without the logits (fusionpass/hf_trainer.py).
    """
    from torch._inductor import config as inductor_config

    cfg = config_mod.make(fusions, **config_overrides)
    inductor_config.pre_grad_custom_pass = chained(cfg, inductor_config.pre_grad_custom_pass)
    if trainer_loss_only:
        hf_trainer.install()
    else:
        hf_trainer.uninstall()
    return cfg


def uninstall() -> None:
    """Undo `install()`: the hook gets back what it held before (graphs compiled meanwhile keep
    their fused code)."""
    from torch._inductor import config as inductor_config

    hook = inductor_config.pre_grad_custom_pass
    if isinstance(hook, PreGradFusionPass):
        inductor_config.pre_grad_custom_pass = hook.replaced
    hf_trainer.uninstall()


@contextlib.contextmanager
def enabled(fusions=None, **config_overrides):
    """`install()` for the block only: fuse in the user's own `torch.compile(...)` calls.

    Compiles that happen in the block get our pass on Inductor's hook. torch.compile is lazy, so
    `torch.compile` calls made in the block that use Inductor (the default backend) are also given
    the fusionpass backend with the same mode/options: models compiled in the block keep fusing
    when first run after it.
    """
    from torch._inductor import config as inductor_config

    previous, trainer_routed = inductor_config.pre_grad_custom_pass, hf_trainer.installed()
    cfg = install(fusions, **config_overrides)
    original_compile = torch.compile

    @functools.wraps(original_compile)
    def compile_with_fusions(model=None, *args, backend="inductor", **kwargs):
        if backend == "inductor":
            backend = FusionpassBackend(cfg)
        return original_compile(model, *args, backend=backend, **kwargs)

    torch.compile = compile_with_fusions
    try:
        yield cfg
    finally:
        torch.compile = original_compile
        inductor_config.pre_grad_custom_pass = previous
        if not trainer_routed:
            hf_trainer.uninstall()
