"""Which fusions are on, the thresholds of their cost rules, and FUSIONPASS_* environment overrides.

A `Config` is immutable and hashable: it is part of every pass's `uuid()`, so two compiles with
different settings never share an FX-graph-cache entry.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

# Stable names, used in config, statistics, the CLI and tests. Only some have an implementation
# yet; `fusionpass list` says which.
FUSION_NAMES = (
    "rms_norm_residual",
    "layer_norm_dropout_residual",
    "rope",
    # before attention: a decode SDPA call is this fusion's, not a mask attention cannot prove
    "decode_attention",
    "attention",
    # after attention: q's rotary embedding moves into the fusionpass::flash_attention calls
    # attention made (patterns/rope_attention.py)
    "rope_attention",
    # after attention: it sets the token-major output layout on the fusionpass::flash_attention
    # calls attention made (patterns/attention_out_proj.py); nothing to configure, on when listed
    "attention_out_proj",
    "swiglu_mlp",
    "linear_cross_entropy",
)



@dataclasses.dataclass(frozen=True)
class Config:
    fusions: frozenset[str] = frozenset(FUSION_NAMES)
    # Match graphs whose tensors live on the CPU. The kernels are Triton kernels for CUDA; on CPU
    # Inductor's own C++ code beats an opaque op, so by default CPU graphs are left alone (near
    # miss "device cpu"). When on, the fused ops run their Triton kernels under the interpreter if
    # TRITON_INTERPRET=1 (the tests), else a torch reference (`fusionpass explain` without a GPU).
    cpu: bool = False
    # rms_norm_residual cost rule: the row widths where the kernel measured at least as fast as
    # Inductor on the H200 (benchmarks/results/2026-11-30-h200-rms_norm_residual.md: forward
    # 0.92-1.04x at 2048 across runs, 1.06-1.07x at 4096). Narrower rows (per-head QK-norm,
    # widths <= 1024) measured 3-19% slower, forward and backward, so they stay with Inductor;
    # inference also leaves widths above 4096 (and 2049..4095, see patterns/rms_norm.py) to it.
    # attention: masks that are causal/all-true AND key padding from a run-time attention_mask
    # become a torch.cond on one "all true?" check per forward. Off by default: Inductor's cond
    # lowering crashed Llama-family inference graphs (a stride assertion in the branch when the
    # query comes from RoPE's cat) and refuses q/k/v that alias one tensor (GPT-2's split), both
    # seen on CPU with torch 2.13 (tests/patterns/test_attention_masks.py). On CUDA it is never
    # selected: the cond's lowering failed there in every conformance case (patterns/attention.py).
    attention_runtime_check: bool = False
    # attention: route SDPA calls whose mask is proven sliding-window, or causal/all-true AND key
    # padding from the run-time attention_mask, to fusionpass::flash_attention (the FA2-style
    # kernel of fusionpass/kernels/attention.py; where on, it is preferred over the torch.cond
    # check above: no branch, no host sync). Off by default: against SDPA's own kernels it
    # measured 1.10x on Llama 8L with an all-ones mask but 0.93x on BERT-base (H200,
    # benchmarks/results/2026-11-30-h200-attention-kernel.md). Eager-math attention goes to the
    # kernel regardless (patterns/eager_attention.py).
    attention_kernel: bool = False
    rms_norm_min_width: int = 2048
    rms_norm_max_width: int = 4096
    # Differentiated norms measured faster up to 8192 (fwd+bwd kernel time at 8192: 1.20x, at
    # 3072: 1.14x; 16384: 0.84x), benchmarks/results/2026-11-30-h200-rms_norm_residual.md.
    rms_norm_train_max_width: int = 8192
    # layer_norm_dropout_residual cost rule (patterns/layer_norm.py `cost_rule`), from the H200
    # (benchmarks/results/2026-11-30-h200-layer_norm_dropout_residual.md, 16384 rows, bf16, kernel
    # time): training (a dropout or a gradient) won at every width measured, 768..8192
    # (1.39-1.74x); inference only at 2048..4096 (1.25x, 1.16x; 0.98-0.99x at 768/1024, 0.95x at
    # 8192).
    layer_norm_min_width: int = 768
    layer_norm_max_width: int = 8192
    layer_norm_inference_min_width: int = 2048
    layer_norm_inference_max_width: int = 4096
    # linear_cross_entropy cost rule: the smallest vocabulary fused. On the H200
    # (benchmarks/results/2026-11-30-h200-linear_cross_entropy.md) the op won at V=128256 (D4096:
    # 1.05x and half the extra memory; HF Llama 4L step 1.01x at 55% of the peak memory), while
    # training steps with it at GPT-2's V=50257 and BERT's V=30522 (D768) were slower than plain
    # torch.compile (0.95x, 0.89x with layer_norm_dropout_residual also on).
    linear_cross_entropy_min_vocab: int = 100_000
    # rope cost rule: fusionpass::rope (one launch for q and k) where q and k together hold at most
    # rope_max_bytes and the rotation covers at least rope_min_tokens positions. On the H200
    # (benchmarks/results/2026-12-01-h200-rope_attention.md) the kernel was 1.01-1.54x of plain
    # torch.compile's code up to 84 MB of q+k and 0.91-0.98x from 168 MB (q (4,32,4096,128) +
    # k (4,8,4096,128): 0.965x), and HF Llama 8L B4 S2048 (42 MB per layer) stepped 1.03x faster
    # with it (training and inference). Decode-sized rotations stay with Inductor, which writes the
    # rotated k into a static KV cache in the same kernel. rope_kernel=True routes every match.
    rope_kernel: bool = False
    rope_max_bytes: int = 96 * 2**20
    # the interleaved form with every channel rotated: 1.44x at 42 MB and 1.23x at 84 MB (GQA 32/8)
    # but 0.99x at 67 MB (MHA 16/16), so a lower limit (partial interleaved rotary, GPT-J's own form,
    # measured 1.48-2.21x up to 168 MB and keeps rope_max_bytes)
    rope_interleaved_max_bytes: int = 48 * 2**20
    rope_min_tokens: int = 64
    # rope_attention in training: the backward rotates q again for the backward kernels and dq
    # back, spending the bytes the forward saved (see patterns/rope_attention.py).
    rope_attention_training: bool = False
    # rope_attention for the interleaved (GPT-J) form: rotating q on load measured 1.014x of
    # rotating it first at B4 H16 S2048 and 0.958x at B4 H32 S4096 (D128, H200), against 1.03-1.09x
    # for rotate_half; so only with this on.
    rope_attention_interleaved: bool = False
    # swiglu_mlp: by default only decode-sized inference (<= 64 rows) goes to fusionpass::swiglu,
    # where it measured faster (patterns/swiglu.py); True routes every match (prefill, training).
    swiglu_mlp_kernel: bool = False

    def __post_init__(self):
        unknown = set(self.fusions) - set(FUSION_NAMES)
        if unknown:
            raise ValueError(
                f"unknown fusion(s) {sorted(unknown)}; known: {', '.join(FUSION_NAMES)}"
            )

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def key(self) -> str:
        """A stable text form for cache keys."""
        fields = dataclasses.asdict(self)
        fields["fusions"] = sorted(self.fusions)
        return repr(sorted(fields.items()))


def _split(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


# Config fields with an environment override FUSIONPASS_<FIELD> (booleans: 1/true/on/yes, else off;
# the others ints)
_ENV_FIELDS = (
    "cpu", "attention_runtime_check", "attention_kernel", "rms_norm_min_width", "rms_norm_max_width",
    "rms_norm_train_max_width", "layer_norm_min_width", "layer_norm_max_width", "layer_norm_inference_min_width",
    "layer_norm_inference_max_width", "linear_cross_entropy_min_vocab", "rope_kernel", "rope_attention_training",
    "rope_attention_interleaved", "swiglu_mlp_kernel",
)


def from_env(base: Config | None = None, environ=os.environ) -> Config:
    """Apply FUSIONPASS_FUSIONS (comma list, replaces the set), FUSIONPASS_DISABLE (comma list,
    removed from it) and FUSIONPASS_<FIELD> for the fields of _ENV_FIELDS (FUSIONPASS_CPU,
    FUSIONPASS_ATTENTION_KERNEL, FUSIONPASS_RMS_NORM_MIN_WIDTH, ...) over `base`."""
    cfg = base or Config()
    if "FUSIONPASS_FUSIONS" in environ:
        cfg = cfg.replace(fusions=frozenset(_split(environ["FUSIONPASS_FUSIONS"])))
    if "FUSIONPASS_DISABLE" in environ:
        cfg = cfg.replace(fusions=cfg.fusions - frozenset(_split(environ["FUSIONPASS_DISABLE"])))
    for name in _ENV_FIELDS:
        value = environ.get(f"FUSIONPASS_{name.upper()}")
        if value is None:
            continue
        if isinstance(getattr(cfg, name), bool):
            cfg = cfg.replace(**{name: value.lower() in ("1", "true", "on", "yes")})
        else:
            cfg = cfg.replace(**{name: int(value)})
    return cfg


def make(fusions: Iterable[str] | None = None, **overrides) -> Config:
    """The config for one backend: environment overrides first, then the caller's arguments."""
    cfg = from_env()
    if fusions is not None:
        cfg = cfg.replace(fusions=frozenset(fusions))
    return cfg.replace(**overrides) if overrides else cfg
