"""fusionpass: handwritten fused Triton kernels for the subgraphs that matter in transformer
models, installed into torch.compile's Inductor as graph rewrites.

    model = torch.compile(model, backend="fusionpass")
    model = torch.compile(model, backend=fusionpass.backend(fusions=["rms_norm_residual"]))
    with fusionpass.enabled():
        model = torch.compile(model, mode="max-autotune")
    fusionpass.install()        # every Inductor compile in the process, until fusionpass.uninstall()
    print(fusionpass.explain(model, input_ids))
    step = torch.compile(fusionpass.loss_only(hf_model), backend="fusionpass")  # loss, no logits
"""
from fusionpass import ops as _ops  # noqa: F401  (registers the custom ops)
from fusionpass.backend import backend, enabled, install, register as _register_backend, uninstall
from fusionpass.causal_lm import loss_only
from fusionpass import config as _config
from fusionpass.config import Config
from fusionpass.explain import Report, explain
from fusionpass.passes import STATISTICS as _STATISTICS

__version__ = "0.1.0"
__all__ = ["backend", "enabled", "install", "uninstall", "explain", "stats", "reset_stats", "Report", "Config", "FUSION_NAMES", "loss_only"]

_register_backend()


def __getattr__(name: str):
    if name == "FUSION_NAMES":  # every declared fusion in run order, read from the declarations
        return _config.fusion_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def stats(variants: bool = False) -> dict:
    """Matches per fusion since the last reset (`variants=True`: per (fusion, variant))."""
    return dict(_STATISTICS.variants) if variants else _STATISTICS.per_fusion()


def reset_stats() -> None:
    _STATISTICS.reset()
