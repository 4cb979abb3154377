"""Hugging Face models for `fusionpass bench`: a transformers family name (anything in
transformers' CONFIG_MAPPING: llama, mistral, qwen2, gpt2, bert, bloom, falcon, gemma, ...) or a
config.json, resized by the command line's overrides, built with random weights (nothing is
downloaded) under the Auto class that fits it.

What each override changes (`resize`):
  layers: num_hidden_layers, and every per-layer list of the config (e.g. `layer_types`), cut or
          repeated to the new length.
  width:  hidden_size; the attention heads follow so that head_dim stays the config's (where
          the config stores head_dim, the heads scale with the width; where it derives head_dim
          as width / heads, heads = width / head_dim, fewer where that does not divide the width;
          at least one);
          key/value heads keep the config's ratio of query heads per key/value head; every
          feed-forward size (intermediate_size, n_inner, ffn_hidden_size, ...) scales with the
          width, rounded to a multiple of 8.
  heads:  the query heads (head_dim = width / heads), key/value heads as for width.
  kv_heads: the key/value heads (must divide the query heads).
  intermediate: the feed-forward size (the first of FEED_FORWARD_KEYS the config has).
  vocab:  vocab_size; special token ids beyond the new vocabulary become 0.
  and the position table grows where the config's is shorter than the positions a step uses.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import pathlib

import torch

# Where families keep the sizes `resize` changes, in the canonical names (a config's
# attribute_map translates them: GPT-2's n_embd is its hidden_size).
KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads")
FEED_FORWARD_KEYS = ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim",
                     "moe_intermediate_size", "shared_expert_intermediate_size")
POSITION_KEYS = ("max_position_embeddings",)
TOKEN_ID_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")

# The heads of each task, tried in this order: an encoder family has a masked-LM head (BERT also
# has a causal-LM one, for decoding experiments, which is not how it is trained); a decoder has a
# causal-LM head; anything else with a classification head gets that.
TASKS = {
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "seq-cls": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
}


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("a transformers model needs transformers: pip install transformers") from e
    return transformers


def families() -> list[str]:
    """Every model type the installed transformers can build a config for."""
    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def base_config(model: str) -> tuple[dict, str]:
    """(config dict, where it came from) of a family name or a config.json (or its folder)."""
    path = pathlib.Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" or "/" in model or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"no config file {path}")
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise ValueError(f"{path} has no model_type: not a transformers config.json")
        return data, str(path)
    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model not in CONFIG_MAPPING:
        close = difflib.get_close_matches(model.lower(), families(), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"unknown model {model!r}: not a transformers model type (AutoConfig.for_model) nor a "
            f"config.json path{hint} (`fusionpass bench --list-models` lists the {len(families())} types)"
        )
    return CONFIG_MAPPING[model]().to_dict(), f"{model} defaults (transformers {_transformers().__version__})"


@dataclasses.dataclass
class Resized:
    config: dict
    changes: list[str]  # "hidden_size 4096 -> 2048", in the order made


def _round8(n: float) -> int:
    return max(8, int(round(n / 8)) * 8)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    d = max(1, min(n, limit))
    while n % d:
        d -= 1
    return d


def _feed_forward_key(config: dict) -> str | None:
    """The config's (first) feed-forward size: the one --intermediate sets."""
    return next((k for k in FEED_FORWARD_KEYS if k in config), None)


def resize(config: dict, config_class, *, layers=None, width=None, heads=None, kv_heads=None,
           intermediate=None, vocab=None, positions=None) -> Resized:
    """The config with the overrides applied (module docstring), and what changed."""
    d = dict(config)
    names = getattr(config_class, "attribute_map", {}) or {}
    changes: list[str] = []

    def key(name):  # the name this family stores a canonical attribute under
        return names.get(name, name)

    def get(name):
        return d.get(key(name))

    def put(name, value):
        k = key(name)
        if d.get(k) != value:
            changes.append(f"{k} {d.get(k)} -> {value}")
            d[k] = value

    if layers is not None:
        old = get("num_hidden_layers")
        put("num_hidden_layers", layers)
        for k, v in list(d.items()):  # per-layer lists (layer_types, ...) follow the layer count
            if isinstance(v, list) and old and len(v) == old and old != layers:
                d[k] = [v[i % old] for i in range(layers)]
                changes.append(f"{k} cut/repeated to {layers} entries")

    old_width, old_heads = get("hidden_size"), get("num_attention_heads")
    new_width = width if width is not None else old_width
    if width is not None:
        put("hidden_size", width)
    if (width is not None or heads is not None or kv_heads is not None) and old_width and old_heads:
        # Llama, Gemma, Qwen3 store head_dim (it may differ from width / heads); the others derive it
        explicit_head_dim = bool(d.get("head_dim"))
        if heads is not None:
            if new_width % heads:
                raise ValueError(f"--heads {heads} does not divide the width {new_width}")
            if explicit_head_dim:
                put("head_dim", new_width // heads)
        elif explicit_head_dim:  # head_dim kept: the heads scale with the width
            heads = max(1, round(old_heads * new_width / old_width))
        else:  # head_dim kept where it divides the width, else the nearest one that does
            heads = _largest_divisor_at_most(new_width, max(1, new_width // (old_width // old_heads)))
        kv_key = next((k for k in KV_HEAD_KEYS if d.get(k)), None)
        old_kv = d[kv_key] if kv_key else old_heads
        group = max(1, old_heads // old_kv)  # query heads per key/value head, kept
        put("num_attention_heads", heads)
        if kv_heads is not None:
            if heads % kv_heads:
                raise ValueError(f"--kv-heads {kv_heads} does not divide the {heads} query heads")
            if not kv_key:
                raise ValueError(f"{config.get('model_type')} has no key/value head count to set "
                                 f"({', '.join(KV_HEAD_KEYS)})")
            put(kv_key, kv_heads)
        elif kv_key:
            put(kv_key, _largest_divisor_at_most(heads, max(1, heads // group)))
    if width is not None and old_width:
        for k in FEED_FORWARD_KEYS:
            if isinstance(d.get(k), int) and not (intermediate is not None and k == _feed_forward_key(d)):
                put(k, _round8(d[k] * new_width / old_width))

    if intermediate is not None:
        k = _feed_forward_key(d)
        if k is None:
            raise ValueError(f"{config.get('model_type')} has no feed-forward size to set "
                             f"({', '.join(FEED_FORWARD_KEYS)})")
        put(k, intermediate)
    if vocab is not None:
        put("vocab_size", vocab)
        for k in TOKEN_ID_KEYS:
            if isinstance(d.get(k), int) and d[k] >= vocab:
                put(k, 0)
    if positions is not None:
        for name in POSITION_KEYS:
            if isinstance(get(name), int) and get(name) < positions:
                put(name, positions)
    return Resized(d, changes)


def task_of(model_type: str) -> str:
    """The first task in TASKS whose Auto class knows the model type."""
    from transformers.models.auto import modeling_auto

    for task, (_, mapping) in TASKS.items():
        if model_type in getattr(modeling_auto, mapping):
            return task
    raise ValueError(f"model type {model_type!r} has no masked-LM, causal-LM or sequence-classification "
                     "head in transformers: fusionpass bench cannot time it")


@dataclasses.dataclass
class BuiltModel:
    model: object  # a transformers PreTrainedModel
    task: str  # a key of TASKS
    auto_class: str
    source: str
    changes: list[str]

    @property
    def config(self):
        return self.model.config

    @property
    def can_generate(self) -> bool:
        return self.task == "causal-lm" and self.model.can_generate()

    def describe(self) -> str:
        c = self.config
        heads = getattr(c, "num_attention_heads", None)
        sizes = [f"layers {getattr(c, 'num_hidden_layers', '?')}", f"hidden {getattr(c, 'hidden_size', '?')}"]
        if heads:
            kv = next((getattr(c, k) for k in KV_HEAD_KEYS if getattr(c, k, None)), heads)
            head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
            sizes.append(f"heads {heads}/{kv} (q/kv), head_dim {head_dim}")
        params = sum(p.numel() for p in self.model.parameters())
        return (f"{type(self.model).__name__} ({self.auto_class}), {', '.join(sizes)}, vocab {c.vocab_size}, "
                f"{params / 1e6:.1f}M parameters, attention {c._attn_implementation}")


def build(model: str, *, task=None, attn=None, device="cpu", dtype=None, **overrides) -> BuiltModel:
    """A transformers model of `model` (family name or config.json), resized, random weights."""
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data, source = base_config(model)
    model_type = data["model_type"]
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{source}: model_type {model_type!r} unknown to transformers {transformers.__version__}")
    config_class = CONFIG_MAPPING[model_type]
    resized = resize(data, config_class, **overrides)
    config = config_class.from_dict(resized.config)
    if config.pad_token_id is None:  # sequence classification and batched generate need one
        config.pad_token_id = 0
    task = task or task_of(model_type)
    auto_class = TASKS[task][0]
    kwargs = {"attn_implementation": attn} if attn else {}
    with torch.device(device):  # parameters made where they run (no multi-GiB init on the host)
        built = getattr(transformers, auto_class).from_config(config, **kwargs)
    if dtype is not None:
        built = built.to(dtype)
    if task == "causal-lm":
        # GPT-2-style class names are not in transformers' loss table: its fallback warns, and the
        # warning breaks the graph before the loss
        built.loss_type = "ForCausalLM"
    return BuiltModel(built, task, auto_class, source, resized.changes)
