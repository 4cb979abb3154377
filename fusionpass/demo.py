"""Models for `fusionpass explain` and `fusionpass bench`: a built-in tiny Llama-style model (no
download, no transformers), tiny configs of installed Hugging Face model families (explain), and
for bench any transformers model type or config.json, resized by the command line (`build_hf`)."""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import pathlib

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------------------------
# built-in demo: written the way HF Llama writes its blocks, so it shows the same matches


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, width, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, width, heads, kv_heads, hidden):
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = Attention(width, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(width)
        self.mlp = MLP(width, hidden)

    def forward(self, h, cos, sin, mask):
        residual = h
        h = self.self_attn(self.input_layernorm(h), cos, sin, mask)
        h = residual + h
        residual = h
        h = self.mlp(self.post_attention_layernorm(h))
        return residual + h


class DemoLlama(nn.Module):
    """A tiny Llama-style causal LM: pre-norm blocks, RoPE, GQA attention with a materialized
    causal mask (as HF models pass it under torch.compile), SwiGLU MLP."""

    def __init__(self, vocab=256, width=512, layers=2, heads=8, kv_heads=4, hidden=1024):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads, kv_heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        head_dim = width // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, input_ids, labels=None):
        h = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).float()
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        # a materialized causal mask, as transformers builds it under torch.compile
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = positions[None, None, None, :] <= positions[None, None, :, None]
        mask = mask.expand(input_ids.shape[0], -1, -1, -1)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        logits = self.lm_head(self.norm(h))
        if labels is None:
            return logits
        return F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
        )


# ---------------------------------------------------------------------------------------------
# tiny Hugging Face models, built from configs (random weights, nothing downloaded)

# name -> (config class, overrides). Every family gets the given width and a head_dim of 64.
HF_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma": ("GemmaConfig", {}),
    "gemma2": ("Gemma2Config", {}),
    "phi3": ("Phi3Config", {}),
    # LayerNorm families; BLOOM has only eager attention (ALiBi), routed to fusionpass's kernel
    "gpt2": ("GPT2Config", {"bos_token_id": 0, "eos_token_id": 0}),
    "bloom": ("BloomConfig", {"attn": "eager"}),
}


def tiny_hf(name: str, layers: int = 2, attn: str = "sdpa", width: int = 512, **overrides):
    """A tiny causal LM of an installed transformers model family (`width`: hidden size)."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("`--model` needs transformers: pip install 'fusionpass[test]'") from e
    if name not in HF_FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(HF_FAMILIES)}")
    config_name, family = HF_FAMILIES[name]
    family = dict(family)
    attn = family.pop("attn", attn)
    kwargs = dict(
        vocab_size=256,
        hidden_size=width,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 128,
        head_dim=64,
        max_position_embeddings=512,
        pad_token_id=0,  # some families default to an id beyond the tiny vocabulary
    )
    kwargs.update(family)
    kwargs.update(overrides)
    config = getattr(transformers, config_name)(**kwargs)
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    if attn == "sdpa" and not model_class._supports_sdpa:
        # transformers 5.2x refuses SDPA where it cannot compute the model's attention (Gemma-2's
        # logit softcapping); 5.17 took it, without the softcap. Eager is what the release runs.
        attn = "eager"
    config._attn_implementation = attn
    return transformers.AutoModelForCausalLM.from_config(config)


def build(name: str = "demo", layers: int = 2, width: int = 2048, **overrides):
    """The CLI's models. The default width 2048 lies inside rms_norm_residual's cost rule (see
    fusionpass.config), so the report shows what a real model of that width gets."""
    if name == "demo":
        return DemoLlama(layers=layers, width=width, heads=width // 64, kv_heads=width // 128, **overrides)
    return tiny_hf(name, layers=layers, width=width, **overrides)


# ---------------------------------------------------------------------------------------------
# transformers models for `fusionpass bench`: a model type (anything in transformers'
# CONFIG_MAPPING: llama, mistral, qwen2, gpt2, bert, bloom, falcon, gemma, ...) or a config.json,
# resized by the command line, built with random weights (nothing is downloaded) under the Auto
# class that fits it (`build_hf`).
#
# What each override changes (`resize`):
#   layers: num_hidden_layers, and every per-layer list of the config (e.g. `layer_types`), cut or
#           repeated to the new length.
#   width:  hidden_size; the attention heads follow so that head_dim stays the config's (where
#           the config stores head_dim, the heads scale with the width; where it derives head_dim
#           as width / heads, heads = width / head_dim, fewer where that does not divide the width;
#           at least one);
#           key/value heads keep the config's ratio of query heads per key/value head; every
#           feed-forward size (intermediate_size, n_inner, ffn_hidden_size, ...) scales with the
#           width, rounded to a multiple of 8.
#   heads:  the query heads (head_dim = width / heads), key/value heads as for width.
#   kv_heads: the key/value heads (must divide the query heads).
#   intermediate: the feed-forward size (the first of FEED_FORWARD_KEYS the config has).
#   vocab:  vocab_size; special token ids beyond the new vocabulary become 0.
#   and the position table grows where the config's is shorter than the positions a step uses.

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


def model_types() -> list[str]:
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
        close = difflib.get_close_matches(model.lower(), model_types(), n=5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"unknown model {model!r}: not a transformers model type (AutoConfig.for_model) nor a "
            f"config.json path{hint} (`fusionpass bench --list-models` lists the {len(model_types())} types)"
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


def build_hf(model: str, *, task=None, attn=None, device="cpu", dtype=None, **overrides) -> BuiltModel:
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
