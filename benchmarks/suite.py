"""The benchmark suite: every fusion at kernel level and HF model steps, plain torch.compile against
fusionpass, interleaved in one process. Its output is the only place current numbers live.

    python benchmarks/suite.py [--only TOPIC,...] [--device cuda|cpu] [--smoke]
                               [--out-dir benchmarks/results/latest] [--case "TEXT;..."] [--budget-s S]
    python benchmarks/suite.py --readme     # README.md's performance table from the latest files

Topics: the kernel-level ones, each declared in its fusion's folder (fusionpass/fusions/<fusion>/
bench.py; KERNEL_TOPICS collects them, fusionpass.bench_cases says how), `models` (training and
inference steps of HF models built from configs, random weights), `compile-time` (the first step
of those same model runs, plain against fusionpass: no extra compiles) and `regional` (a
torchtitan-style Llama training step under regional compilation: every block compiled on its own,
the final norm + output + loss as one more compiled region; `python benchmarks/suite.py --only
regional`). Each writes <out-dir>/<topic>.md and <topic>.json: date,
GPU, versions, the command, then one row per case: plain ms, fusionpass ms, plain/fusionpass,
peak memory where it matters, the match count of the topic's fusion, and whether the default cost
rule selects the case. A case outside the rule is timed with the rule opened through the fusion's
settings (the row names them), to show why it is kept out. A fusionpass row whose fusion did not
match says so, with the first near miss. An error becomes a row with its text.

On the H200 the suite runs in two calls: `--only kernels` (every kernel topic) and
`--only models,compile-time`.
`--smoke --device cpu` runs every code path at tiny shapes (TRITON_INTERPRET=1; fusionpass with
cpu=True), for tests/test_benchmark_suite.py.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch

import fusionpass
import fusionpass.fusions
from fusionpass.bench import (environment, first_call_seconds, inference_step, peak_memory, time_interleaved,
                              training_step, warm_up_compiler)
from fusionpass.bench_cases import BF16, Case, on_device
from fusionpass.causal_lm import loss_only_where_standard, why_not_standard
from fusionpass.passes import STATISTICS

ROOT = pathlib.Path(__file__).resolve().parents[1]
LATEST = ROOT / "benchmarks" / "results" / "latest"


def registered(name: str) -> str | None:
    """`name` where it is a registered fusion, else None (the case is skipped with a note)."""
    return name if name in fusionpass.FUSION_NAMES else None


def say(*parts) -> None:
    print(*parts, flush=True)


# =============================================================================================
# kernel-level topics: each fusion folder's bench.py (fusionpass/fusions/<fusion>/bench.py) declares
# its own, so a fusion's benchmark needs no edit here (fusionpass.bench_cases says how)


def kernel_topics() -> dict[str, Callable[[bool], list[Case]]]:
    """{topic: cases(smoke)} of every fusion folder's bench.py, the folders by their ORDER."""
    topics = {}
    for module in sorted(fusionpass.fusions.modules("bench"), key=lambda m: m.ORDER):
        taken = set(topics) & set(module.TOPICS)
        if taken:
            raise ValueError(f"{module.__name__} declares topic(s) {sorted(taken)} that another fusion declares")
        topics.update(module.TOPICS)
    return topics


KERNEL_TOPICS = kernel_topics()


# =============================================================================================
# HF models (random weights, from configs)


def hf_model(config_name, model_class, attn, smoke, **config):
    def build(device, dtype):
        import transformers

        if smoke:  # one narrow layer of the same family
            config.update(SMOKE_CONFIG.get(config_name, {}))
        cfg = getattr(transformers, config_name)(**config)
        cfg._attn_implementation = attn
        torch.manual_seed(0)
        model = on_device(device, lambda: getattr(transformers, model_class).from_config(cfg)).to(dtype)
        if model_class == "AutoModelForCausalLM":
            model.loss_type = "ForCausalLM"  # GPT-2's default loss otherwise lands in a second graph
        return model, ()

    return build


SMOKE_CONFIG = {
    "LlamaConfig": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64, vocab_size=256),
    "GPT2Config": dict(n_embd=128, n_layer=1, n_head=2, vocab_size=256),
    "BertConfig": dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, intermediate_size=256,
                       vocab_size=256),
    "BloomConfig": dict(hidden_size=128, n_layer=1, n_head=2, vocab_size=256),
    "FalconConfig": dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, vocab_size=256),
    "XLMRobertaConfig": dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, intermediate_size=256,
                             vocab_size=256),
    "ModernBertConfig": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                             vocab_size=256, pad_token_id=0, local_attention=8,
                             layer_types=["full_attention", "sliding_attention"]),
    "MistralConfig": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64, vocab_size=256, sliding_window=5),
    "Gemma3TextConfig": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, head_dim=64, vocab_size=256, sliding_window=5,
                             layer_types=["sliding_attention", "full_attention"]),
}


@dataclasses.dataclass
class ModelCase:
    name: str
    build: Callable
    train: bool
    batch: int
    seq: int
    all_ones_mask: bool = False
    # this many sequences packed into each row: position ids restarting at each, no attention_mask
    # (DataCollatorWithFlattening's batch)
    packed: int = 0
    # also time fusionpass without this fusion (what that one fusion gives the whole step)
    without: str | None = None
    # right padding: each row's length uniform in [lo, hi] (a padding collator's batch), the
    # collator's attention_mask passed
    lengths: tuple[int, int] | None = None
    # sequence classification: a class label per row, from this many classes (else token labels)
    classes: int = 0
    # also time the model uncompiled
    eager: bool = False
    # fusionpass settings beyond the defaults (an opt-in route measured beside the default one)
    settings: dict = dataclasses.field(default_factory=dict)
    # fp32 weights under bf16 autocast (the HF Trainer's bf16=True) instead of bf16 weights
    autocast: bool = False
    # a speech encoder-decoder (Whisper): log-mel input_features in (the config's num_mel_bins over
    # 2 x max_source_positions frames), `seq` decoder labels, no attention_mask
    input_features: bool = False
    # each side's loss as the HF Trainer computes it: the plain Trainer's model returns its logits
    # beside the loss; under fusionpass.install() a model of the standard causal-LM forward runs
    # through loss_only (fusionpass/hf_trainer.py), no logits returned
    trainer_loss: bool = False

    @property
    def mode(self) -> str:
        return "train" if self.train else "inference"


def model_cases(smoke):
    """About six model steps of the baseline survey's families (docs/architecture.md). Layer counts
    are cut where a full model's two compiles (tens of seconds each on the H200) would not fit
    the topic in one device call: the shapes per layer are the models' own."""
    def llama(layers):
        return dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=128, vocab_size=32000, max_position_embeddings=8192)

    causal_lm, mlm = "AutoModelForCausalLM", "AutoModelForMaskedLM"
    # Llama-3.2-1B's widths (head dim 64, tied 128256 vocabulary), 8 of its 16 layers
    llama_1b = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096,
                    tie_word_embeddings=True)
    alibi = dict(hidden_size=1024)
    falcon = dict(alibi, num_hidden_layers=4, num_attention_heads=16, alibi=True, new_decoder_architecture=False,
                  multi_query=False, parallel_attn=False, bias=True)

    xlmr = dict(vocab_size=250002, max_position_embeddings=514, type_vocab_size=1, pad_token_id=1)
    seq_cls = "AutoModelForSequenceClassification"
    gemma3 = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=256, vocab_size=32000, max_position_embeddings=8192,
                  sliding_window=512)

    def shape(batch, seq):
        return (1, 16) if smoke else (batch, seq)

    return [
        # rope's kernel-level case loses to plain compile's rotation (rope.md): the step says whether
        # the default rule's selection pays in the model
        ModelCase("HF Llama 8L h2048 GQA 16/4", hf_model("LlamaConfig", causal_lm, "sdpa", smoke, **llama(8)),
                  True, *shape(4, 2048), without="rope"),
        ModelCase("HF Llama 8L h2048 GQA 16/4", hf_model("LlamaConfig", causal_lm, "sdpa", smoke, **llama(8)),
                  False, *shape(4, 2048)),
        # the attention_mask a data collator passes (all ones): causal padding's kernel route
        ModelCase("HF Llama 8L h2048 GQA 16/4, all-ones attention_mask",
                  hf_model("LlamaConfig", causal_lm, "sdpa", smoke, **llama(8)), True, *shape(4, 2048), True),
        # packed sequences (issue 19's bar: against the same tokens as a B8 S1024 batch with the
        # collator's attention_mask under plain compile, the row after it)
        ModelCase("HF Llama 8L h2048 GQA 16/4, 8 packed sequences (position_ids)",
                  hf_model("LlamaConfig", causal_lm, "sdpa", smoke, **llama(8)), True, *shape(1, 8192), packed=8),
        ModelCase("HF Llama 8L h2048 GQA 16/4, all-ones attention_mask",
                  hf_model("LlamaConfig", causal_lm, "sdpa", smoke, **llama(8)), True, *shape(8, 1024), True),
        # issue 40: the collator's masks on Llama-3.2-1B's shape (head dim 64), the cuDNN padding
        # route (fusionpass::padded_attention, the default at this length) and our kernel alone
        *(ModelCase(f"Llama-3.2-1B shape, {mask}{route}",
                    hf_model("LlamaConfig", causal_lm, "sdpa", smoke, **llama_1b), True, *shape(4, 2048),
                    all_ones_mask=mask == "all-ones attention_mask",
                    lengths=None if mask == "all-ones attention_mask" else ((4, 16) if smoke else (512, 2048)),  # uniform
                    settings=settings)
          for mask in ("all-ones attention_mask", "right padding")
          for route, settings in (("", {}), (", our kernel alone", {"attention_cudnn_padding": False}))),
        ModelCase("GPT-2 small widths 6L, eager attention",
                  hf_model("GPT2Config", causal_lm, "eager", smoke, n_layer=6), True, *shape(16, 1024)),
        ModelCase("BERT-base MLM widths 6L, sdpa", hf_model("BertConfig", mlm, "sdpa", smoke, num_hidden_layers=6),
                  True, *shape(32, 512)),
        # encoders fine-tuned with a padding collator (issue 19's bar): lengths uniform in 64..512,
        # and the same model with no row padded (the kernel route cannot tell at compile time)
        ModelCase("XLM-RoBERTa-base widths 6L, sequence classification, right padding 64..512",
                  hf_model("XLMRobertaConfig", seq_cls, "sdpa", smoke, **xlmr, num_hidden_layers=6), True,
                  *shape(32, 512), lengths=(4, 16) if smoke else (64, 512), classes=2, eager=True),
        ModelCase("XLM-RoBERTa-base widths 6L, sequence classification, all-ones attention_mask",
                  hf_model("XLMRobertaConfig", seq_cls, "sdpa", smoke, **xlmr, num_hidden_layers=6), True,
                  *shape(32, 512), True, classes=2, eager=True),
        ModelCase("BERT-base 12L, sequence classification, right padding 64..512",
                  hf_model("BertConfig", seq_cls, "sdpa", smoke), True, *shape(32, 512),
                  lengths=(4, 16) if smoke else (64, 512), classes=2, eager=True),
        # a band |i - j| <= 64 in two layers of three (local_attention 128), the others global
        ModelCase("ModernBERT-base MLM widths 8L, sdpa",
                  hf_model("ModernBertConfig", mlm, "sdpa", smoke, num_hidden_layers=8), True, *shape(32, 512)),
        ModelCase("BLOOM-style 4L h1024 16 heads, ALiBi (eager attention)",
                  hf_model("BloomConfig", causal_lm, "eager", smoke, **alibi, n_layer=4, n_head=16),
                  True, *shape(8, 2048)),
        ModelCase("Falcon-ALiBi 4L h1024 16 heads (sdpa, ALiBi in the mask)",
                  hf_model("FalconConfig", causal_lm, "sdpa", smoke, **falcon), False, *shape(8, 2048)),
        # sliding windows shorter than the sequence: every Mistral layer, Gemma-3's five local of six
        ModelCase("Mistral 4L h2048 GQA 16/4, sliding window 1024",
                  hf_model("MistralConfig", causal_lm, "sdpa", smoke, **llama(4), sliding_window=1024),
                  True, *shape(2, 4096)),
        ModelCase("Gemma-3 text 6L h2048 8/4 heads of 256, sliding window 512",
                  hf_model("Gemma3TextConfig", causal_lm, "sdpa", smoke, **gemma3), True, *shape(2, 4096)),
    ]


# =============================================================================================
# the census's families at their published widths (issue 43)

# Each census family (fusionpass/conformance/families.py) at the widths of one checkpoint users
# train (from its published config), two layers; the census's tiny config in a smoke run. The
# label names the checkpoint the widths come from.
FAMILY_WIDTHS = {
    "llama": ("Llama-3.2-1B", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)),
    "mistral": ("Mistral-7B-v0.3", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                        num_key_value_heads=8, head_dim=128, vocab_size=32768)),
    "qwen2": ("Qwen2.5-1.5B", dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                   num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
    "qwen3": ("Qwen3-1.7B", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
    "smollm3": ("SmolLM3-3B", dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16,
                                   num_key_value_heads=4, head_dim=128, vocab_size=128256, tie_word_embeddings=True)),
    "gemma": ("Gemma-2B", dict(hidden_size=2048, intermediate_size=16384, num_attention_heads=8, num_key_value_heads=1,
                               head_dim=256, vocab_size=256000)),
    "gemma2": ("Gemma-2-2B", dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, vocab_size=256000,
                                  sliding_window=4096)),
    "gemma3": ("Gemma-3-1B", dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512)),
    "phi3": ("Phi-3-mini", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
                                num_key_value_heads=32, head_dim=96, vocab_size=32064)),
    "olmo": ("OLMo-1B", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16,
                             head_dim=128, vocab_size=50304)),
    "olmo2": ("OLMo-2-1124-7B", dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                                     num_key_value_heads=32, head_dim=128, vocab_size=100352)),
    "granite": ("Granite-3.0-2B", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                                       num_key_value_heads=8, head_dim=64, vocab_size=49155)),
    "cohere": ("Aya-Expanse-8B", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                      num_key_value_heads=8, head_dim=128, vocab_size=256000)),
    "starcoder2": ("StarCoder2-3B", dict(hidden_size=3072, intermediate_size=12288, num_attention_heads=24,
                                         num_key_value_heads=2, head_dim=128, vocab_size=49152)),
    "stablelm": ("StableLM-2-1.6B", dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
                                         num_key_value_heads=32, head_dim=64, vocab_size=100352)),
    "gpt_neox": ("Pythia-1.4B", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                                     num_key_value_heads=16, head_dim=128, vocab_size=50304)),
    "phi": ("Phi-2", dict(hidden_size=2560, intermediate_size=10240, num_attention_heads=32, num_key_value_heads=32,
                          head_dim=80, vocab_size=51200, partial_rotary_factor=0.4)),
    # (GPT2Config maps hidden_size and num_attention_heads, which the census's tiny config sets, onto
    # n_embd and n_head: both names get the width)
    "gpt2": ("GPT-2 small", dict(n_embd=768, hidden_size=768, n_head=12, num_attention_heads=12, vocab_size=50257)),
    "mixtral": ("Mixtral-8x7B", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=128, vocab_size=32000, num_local_experts=8)),
    "gpt_oss": ("gpt-oss-20b, 8 of its 32 experts", dict(
        hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        vocab_size=201088, num_local_experts=8, num_experts_per_tok=4, sliding_window=128)),
    "bert": ("BERT-base", dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, vocab_size=30522)),
    "roberta": ("RoBERTa-base", dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, vocab_size=50265)),
    # (DistilBertConfig maps hidden_size and num_attention_heads onto dim and n_heads)
    "distilbert": ("DistilBERT-base", dict(hidden_size=768, hidden_dim=3072, num_attention_heads=12, vocab_size=30522)),
    # (T5Config maps hidden_size and num_attention_heads onto d_model and num_heads)
    "t5": ("T5-base", dict(hidden_size=768, d_ff=3072, num_attention_heads=12, head_dim=64, vocab_size=32128)),
    # (MLA: q/k heads of 128 + a rotated 64, v 128; the census's first dense layer, then routed experts)
    "deepseek_v3": ("DeepSeek-V3, 16 of its 256 experts", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, vocab_size=129280, n_routed_experts=16, num_experts_per_tok=8)),
    "qwen3_moe": ("Qwen3-30B-A3B, 16 of its 128 experts", dict(
        hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, num_experts=16, num_experts_per_tok=8)),
    # (WhisperConfig maps hidden_size and num_attention_heads onto d_model and the encoder's heads;
    # 30 s of audio: 1500 encoder positions; labels up to 448 tokens)
    "whisper": ("Whisper-small", dict(hidden_size=768, num_attention_heads=12, decoder_attention_heads=12,
                                      encoder_ffn_dim=3072, decoder_ffn_dim=3072, vocab_size=51865, num_mel_bins=80,
                                      max_source_positions=1500, max_target_positions=448)),
}
FAMILY_LAYERS = 2


def family_config(name: str, smoke: bool) -> dict:
    """The config of census family `name`: the census's tiny config, and at the published widths of
    FAMILY_WIDTHS with FAMILY_LAYERS layers unless `smoke`."""
    from fusionpass.conformance import families

    family = families.FAMILIES[name]
    config = {k: v for k, v in {**families.TINY, **family.overrides}.items() if k not in family.drop}
    # the census's eager expert loop is for its float64 reference, which has no grouped_mm; here each
    # MoE family runs what its users get, transformers' default (grouped_mm where it dispatches,
    # no recompile per routing pattern)
    config.pop("experts_implementation", None)
    if not smoke:
        config.update(FAMILY_WIDTHS[name][1])
        # (both spellings where a config maps one onto the other, GPT-2's n_layer and n_positions)
        config.update(num_hidden_layers=FAMILY_LAYERS, max_position_embeddings=4096)
        config.update({k: v for k, v in (("n_layer", FAMILY_LAYERS), ("n_positions", 4096)) if k in config})
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:FAMILY_LAYERS]
    return config


def family_cases(smoke):
    """Two training steps per census family, bf16 weights and fp32 weights under bf16 autocast (the
    census's two modes), each with the collator's all-ones attention_mask, two layers at the
    published widths of FAMILY_WIDTHS (smoke: the census's tiny config)."""
    from fusionpass.conformance import families

    cases = []
    batch, seq = (2, 16) if smoke else (2, 1024)
    for name, family in families.FAMILIES.items():
        title = (f"{name}: the census's tiny config" if smoke else
                 f"{name}: {FAMILY_WIDTHS[name][0]} widths, {FAMILY_LAYERS}L")
        # (hf_model's smoke configs are not the census's: the config is built here either way)
        config = family_config(name, smoke)
        build = hf_model(family.config, family.model_class, family.attention, False, **config)
        # (a speech model's labels stay within its decoder's positions; its collator passes no mask)
        labels = min(seq, config.get("max_target_positions", seq))
        for amp in (False, True):
            cases.append(ModelCase(title + (", Trainer autocast (fp32 weights)" if amp else ", bf16 weights"), build,
                                   True, batch, labels, all_ones_mask=not family.input_features, autocast=amp,
                                   input_features=family.input_features, trainer_loss=True))
    return cases


# =============================================================================================
# regional compilation: a torchtitan-style Llama (tests/torchtitan_model.py), block by block


def torchtitan_model():
    """tests/torchtitan_model.py: the model the regional-compilation tests use (tests/ is no
    package: imported by path)."""
    tests = str(ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import torchtitan_model

    return torchtitan_model


@dataclasses.dataclass
class RegionalCase:
    name: str
    rope: str  # "complex" (torchtitan's view_as_complex) or "rotate_half" (the real form)
    batch: int
    seq: int
    args: dict  # torchtitan_model.ModelArgs fields

    @property
    def mode(self) -> str:
        return "train"


def regional_cases(smoke):
    """torchtitan's Llama 3 layout at the Llama model steps' widths (8 layers of h2048, ffn 8192,
    16 heads of 128 over 8 KV heads) with Llama 3's vocabulary, trained block by block."""
    if smoke:  # one narrow layer
        args = dict(dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=256, max_seq_len=16)
        batch, seq = 1, 16
    else:
        args = dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                    max_seq_len=2048, norm_eps=1e-5, rope_theta=500000.0)
        batch, seq = 4, 2048
    name = "torchtitan Llama 8L h2048 GQA 16/8 V128256, per-block compile + norm/output/loss region"
    return [RegionalCase(f"{name}, {rope} RoPE", rope, batch, seq, args) for rope in ("complex", "rotate_half")]


# the tiny smoke shapes are outside the GPU cost rules: open them so every code path runs
REGIONAL_SMOKE_SETTINGS = dict(rms_norm_min_width=1, linear_cross_entropy_min_vocab=1, rope_min_tokens=1)


def regional_rows(run: Run, cases: list[RegionalCase], budget_s: float | None) -> list[dict]:
    """Plain torch.compile against fusionpass (every fusion, default settings), each applied to
    the same regions: every TransformerBlock and the norm + output + loss region."""
    tt = torchtitan_model()
    rows, t0 = [], time.perf_counter()
    warm_up_compiler(run.device)
    dtype = torch.float32 if run.device == "cpu" else BF16
    settings = REGIONAL_SMOKE_SETTINGS if run.smoke else {}
    for i, case in enumerate(cases):
        name = f"{case.name} B{case.batch} S{case.seq}" + (" (smoke: one narrow layer)" if run.smoke else "")
        head = {"case": name, "mode": case.mode, "dtype": str(dtype).removeprefix("torch."),
                "fusions": ["every fusion (default settings)"], "default_rule": "selects"}
        say(f"  [regional {i + 1}/{len(cases)}] {name}, {case.mode}")
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            rows.append({**head, "skipped": f"the topic's budget of {budget_s:.0f} s was spent"})
            say(f"    -> {_summary(rows[-1])}")
            continue

        def one(case=case, i=i):
            torch.manual_seed(0)
            model = tt.cast_parameters(on_device(run.device, lambda: tt.make(rope=case.rope, **case.args)), dtype)
            ids = torch.randint(0, case.args["vocab_size"], (case.batch, case.seq), device=run.device)
            labels = torch.roll(ids, -1, dims=1)
            return measure_regional(run, i, tt, model, ids, labels, settings)

        rows.append(guarded(one, head))
    return rows


def measure_regional(run: Run, order: int, tt, model, ids, labels, settings) -> dict:
    """measure() for a regionally compiled training step: each side compiles its own copy's
    blocks and loss region (tt.RegionalTraining), timed interleaved. The blocks share one graph
    (one compile, one block's matches), so `matched` counts per compiled graph, not per layer."""
    copies = {"plain": model, "fusionpass": copy.deepcopy(model)}
    backends = {"plain": "inductor", "fusionpass": run.backend(sorted(fusionpass.FUSION_NAMES), settings)}
    torch._dynamo.reset()
    steps = {}
    for side, m in copies.items():
        m.train(True)
        step = tt.RegionalTraining(m, backend=backends[side], dynamic=False, fullgraph=True)
        steps[side] = training_step(step, ids, labels, leaves=list(m.parameters()))
    first_s, matched, pass_s = {}, {}, 0.0
    sides = ["plain", "fusionpass"] if order % 2 == 0 else ["fusionpass", "plain"]
    for side in sides:
        fusionpass.reset_stats()
        first_s[side] = first_call_seconds(steps[side], run.device)
        if side == "fusionpass":
            matched = fusionpass.stats()
            graphs = len(STATISTICS.records)
            pass_s = sum(STATISTICS.seconds.values())
    say(f"    compiled ({', '.join(f'{k} {v:.1f} s' for k, v in first_s.items())}); matches {matched} "
        f"in {graphs} graphs")
    ms = time_interleaved(steps, run.device, **run.model_timing)
    row = {
        "plain_ms": round(ms["plain"], 4), "fusionpass_ms": round(ms["fusionpass"], 4),
        "ratio": round(ms["plain"] / ms["fusionpass"], 3),
        "matched": {f: n for f, n in matched.items() if n}, "graphs": graphs, "note": "",
        "first_call_s": {k: round(v, 2) for k, v in first_s.items()}, "compiled_first": sides[0],
        "pass_s": round(pass_s, 3),
        "tokens_per_s": round(ids.numel() / ms["fusionpass"] * 1e3),
    }
    if run.device == "cuda":
        row["plain_peak_mib"] = round(peak_memory(steps["plain"]) / 2**20, 1)
        row["fusionpass_peak_mib"] = round(peak_memory(steps["fusionpass"]) / 2**20, 1)
    return row


# =============================================================================================
# measuring


@dataclasses.dataclass
class Run:
    device: str
    smoke: bool

    @property
    def timing(self) -> dict:
        return dict(rounds=1, iters=1, warmup=0) if self.smoke else dict(rounds=5, iters=10, warmup=2)

    @property
    def model_timing(self) -> dict:
        # short steps (an encoder's ~15 ms) get more calls per sample: samples of at least 300 ms
        return dict(rounds=1, iters=1, warmup=0) if self.smoke else dict(rounds=5, iters=3, warmup=1,
                                                                          min_sample_ms=300.0)

    def backend(self, fusions, settings):
        return fusionpass.backend(fusions=fusions, cpu=self.device == "cpu", **settings)


def _leaves(module, inputs, train):
    """Inputs as they enter a step: floating ones become leaves in training."""
    out = []
    for t in inputs:
        if train and isinstance(t, torch.Tensor) and t.is_floating_point():
            t = t.detach().requires_grad_()
        out.append(t)
    return out


def _step(fn, inputs, train, leaves, kwargs):
    return (training_step(fn, *inputs, leaves=leaves, **kwargs) if train else inference_step(fn, *inputs, **kwargs))


def _under_autocast(step, device):
    def autocast_step():
        with torch.autocast(device, dtype=BF16):
            return step()

    return autocast_step


def _near_miss(fusion):
    misses = [reason for f, _, reason in STATISTICS.near_misses if f == fusion]
    return misses[0] if misses else "no anchor found"


def measure(run: Run, order: int, case_name, module, inputs, kwargs, train, fusions, settings, without, timing,
            eager=False, autocast=False, trainer_loss=False):
    """Time plain torch.compile, fusionpass (and fusionpass without one fusion, and the model
    uncompiled) side by side; with `autocast`, every step (its compile included) runs under bf16
    autocast, as the HF Trainer's bf16=True runs the forward. With `trainer_loss`, the fusionpass
    sides call the model as install()'s Trainer does (through loss_only where its forward is the
    standard causal-LM one) and the plain side as the plain Trainer does (logits returned; the
    row's `trainer_loss` says which).
    `order` alternates which side compiles first, so neither always pays the process's colder
    first compile."""
    wanted = [registered(f) for f in fusions]
    missing = [f for f, r in zip(fusions, wanted) if r is None]
    if missing:
        raise LookupError(f"fusion(s) {missing} not registered here")
    on = sorted(set(wanted))
    routed = None if not trainer_loss else why_not_standard(module) or "loss_only"

    def fused_copy():
        return loss_only_where_standard(copy.deepcopy(module)) if trainer_loss else copy.deepcopy(module)

    copies = {"plain": module}
    copies["fusionpass"] = fused_copy()
    backends = {"plain": "inductor", "fusionpass": run.backend(on, settings)}
    if without:
        copies["without"] = fused_copy()
        backends["without"] = run.backend(sorted(set(on) - {registered(without)}), settings)
    if eager:
        copies["eager"] = copy.deepcopy(module)
        backends["eager"] = None  # not compiled
    torch._dynamo.reset()
    steps = {}
    for name, m in copies.items():
        m.train(train)
        ins = _leaves(m, inputs, train)
        leaves = [t for t in ins if isinstance(t, torch.Tensor) and t.requires_grad] + list(m.parameters())
        fn = m if backends[name] is None else torch.compile(m, backend=backends[name], dynamic=False)
        steps[name] = _step(fn, ins, train, leaves if train else (), kwargs)
        if autocast:
            steps[name] = _under_autocast(steps[name], run.device)
    first_s, matched, variants, pass_s, note, misses = {}, {}, {}, 0.0, "", ""
    sides = ["plain", "fusionpass"] if order % 2 == 0 else ["fusionpass", "plain"]
    for name in sides + (["without"] if without else []):
        fusionpass.reset_stats()
        first_s[name] = first_call_seconds(steps[name], run.device)
        if name == "fusionpass":
            matched = fusionpass.stats()
            variants = {f"{f}/{v}": n for (f, v), n in sorted(fusionpass.stats(variants=True).items())}
            pass_s = sum(STATISTICS.seconds.values())
            misses = "; ".join(sorted({f"{f}: {reason[:160]}" for f, _, reason in STATISTICS.near_misses}))
            unmatched = [f for f, r in zip(fusions, wanted) if not matched.get(r)]
            if unmatched:
                note = "; ".join(f"NOT MATCHED {f}: {_near_miss(registered(f))}" for f in unmatched)
    say(f"    compiled ({', '.join(f'{k} {v:.1f} s' for k, v in first_s.items())}); matches {matched}")
    ms = time_interleaved(steps, run.device, **timing)
    row = {
        "plain_ms": round(ms["plain"], 4), "fusionpass_ms": round(ms["fusionpass"], 4),
        "ratio": round(ms["plain"] / ms["fusionpass"], 3),
        "matched": {f: matched.get(registered(f), 0) for f in fusions},
        # by variant: which route matched (a stand-in fusion's count alone would not say)
        "variants": variants,
        "note": note,
        "first_call_s": {k: round(v, 2) for k, v in first_s.items()}, "compiled_first": sides[0],
        "pass_s": round(pass_s, 3),
        "near_misses": misses,
    }
    if routed is not None:
        row["trainer_loss"] = routed
    if eager:
        row["eager_ms"] = round(ms["eager"], 4)
    if without:
        row["without"] = without
        row["without_ms"] = round(ms["without"], 4)
        row["ratio_to_without"] = round(ms["without"] / ms["fusionpass"], 3)
    if run.device == "cuda":
        row["plain_peak_mib"] = round(peak_memory(steps["plain"]) / 2**20, 1)
        row["fusionpass_peak_mib"] = round(peak_memory(steps["fusionpass"]) / 2**20, 1)
    return row


def guarded(fn, head: dict) -> dict:
    """fn() -> the row's measurements; an error becomes the row's text and the suite goes on."""
    t0 = time.perf_counter()
    try:
        row = {**head, **fn()}
    except Exception as e:  # noqa: BLE001 (every case: the suite must go on)
        traceback.print_exc()
        row = {**head, "error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row["case_s"] = round(time.perf_counter() - t0, 1)
    say(f"    -> {_summary(row)}")
    return row


def _summary(row):
    if "error" in row:
        return f"ERROR {row['error'][:200]}"
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    return f"plain {row['plain_ms']} ms, fusionpass {row['fusionpass_ms']} ms ({row['ratio']}x) {row.get('note', '')}"


def _rule(case) -> str:
    if case.selected:
        return "selects" + (f" (with {_settings(case.settings)})" if case.settings else "")
    return f"keeps out (timed with {_settings(case.settings)})"


def _settings(settings) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def kernel_topic(run: Run, topic: str, cases: list[Case], budget_s: float | None) -> list[dict]:
    rows, t0 = [], time.perf_counter()
    for i, case in enumerate(cases):
        dtype = torch.float32 if run.device == "cpu" else case.dtype
        head = {"case": case.name, "mode": case.mode, "dtype": str(dtype).removeprefix("torch."),
                "fusions": list(case.fusions), "default_rule": _rule(case)}
        if case.shape_class is not None:
            head["shape_class"] = case.shape_class
        say(f"  [{topic} {i + 1}/{len(cases)}] {case.name}, {case.mode}")
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            rows.append({**head, "skipped": f"the topic's budget of {budget_s:.0f} s was spent"})
            say(f"    -> {_summary(rows[-1])}")
            continue

        def one(case=case, dtype=dtype, i=i):
            torch.manual_seed(0)
            module, inputs = case.build(run.device, dtype)
            return measure(run, i, case.name, module, inputs, case.kwargs, case.train, case.fusions,
                           case.settings, case.without, run.timing)

        rows.append(guarded(one, head))
    return rows


def model_rows(run: Run, cases: list[ModelCase], budget_s: float | None, near_misses: bool = False) -> list[dict]:
    """Every fusion on (the default config), plain against fusionpass, one row per model step
    (`near_misses`: with the pass's near misses of the step, each fusion's reasons once)."""
    rows, t0 = [], time.perf_counter()
    warm_up_compiler(run.device)
    dtype = torch.float32 if run.device == "cpu" else BF16
    every = tuple(fusionpass.FUSION_NAMES)
    for i, case in enumerate(cases):
        # (a smoke run's models are narrow: one layer of each model, the census's tiny configs)
        name = f"{case.name} B{case.batch} S{case.seq}" + (" (smoke)" if run.smoke else "")
        head = {"case": name, "mode": case.mode,
                "dtype": "bf16 autocast" if case.autocast else str(dtype).removeprefix("torch."),
                "fusions": ["every fusion (default settings)"],
                "default_rule": "selects"}
        say(f"  [models {i + 1}/{len(cases)}] {head['case']}, {case.mode}")
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            rows.append({**head, "skipped": f"the topic's budget of {budget_s:.0f} s was spent"})
            say(f"    -> {_summary(rows[-1])}")
            continue

        def one(case=case, i=i):
            model, _ = case.build(run.device, torch.float32 if case.autocast else dtype)
            ids = torch.randint(0, model.config.vocab_size, (case.batch, case.seq), device=run.device)
            kwargs = {"labels": ids} if case.train else {}
            inputs = (ids,)
            if case.input_features:
                from fusionpass.conformance.model_steps import log_mel_features

                inputs = (log_mel_features(model.config, case.batch, run.device, model.dtype),)
            if case.train and case.classes:
                kwargs["labels"] = torch.randint(0, case.classes, (case.batch,), device=run.device)
            if case.all_ones_mask:
                kwargs["attention_mask"] = torch.ones_like(ids)
            if case.lengths:
                gen = torch.Generator().manual_seed(0)
                lengths = torch.randint(case.lengths[0], case.lengths[1] + 1, (case.batch, 1), generator=gen)
                kwargs["attention_mask"] = (torch.arange(case.seq) < lengths).long().to(run.device)
            if case.packed:
                per = case.seq // case.packed
                kwargs["position_ids"] = (torch.arange(case.seq, device=run.device) % per)[None].expand(case.batch, -1)
                # transformers looks for packed sequences only without a cache (LlamaModel makes
                # one when use_cache is on, and then masks the row as one sequence)
                kwargs["use_cache"] = False
            row = measure(run, i, case.name, model, inputs, kwargs, case.train, every, case.settings, case.without,
                          run.model_timing, case.eager, case.autocast, case.trainer_loss)
            # every fusion is on; which ones matched is the model's business, not a failure
            row["matched"] = {f: n for f, n in row["matched"].items() if n}
            row.pop("variants")
            row["note"] = ""
            if not near_misses:
                row.pop("near_misses")
            row["tokens_per_s"] = round(case.batch * case.seq / row["fusionpass_ms"] * 1e3)
            return row

        rows.append(guarded(one, head))
    return rows


def compile_time_rows(model_rows_: list[dict]) -> list[dict]:
    """The first step of each model run above: compile plus one step, caches off."""
    rows = []
    for r in model_rows_:
        if "first_call_s" not in r:
            rows.append({k: r[k] for k in ("case", "mode", "dtype") if k in r}
                        | {"error": r.get("error") or r.get("skipped", "not measured")})
            continue
        plain, fused = r["first_call_s"]["plain"], r["first_call_s"]["fusionpass"]
        rows.append({"case": r["case"], "mode": r["mode"], "dtype": r["dtype"], "plain_s": plain,
                     "fusionpass_s": fused, "added": round(fused / plain - 1, 3), "pass_s": r["pass_s"],
                     "compiled_first": r["compiled_first"]})
    return rows


# =============================================================================================
# output


KERNEL_COLUMNS = [("case", "case"), ("mode", "mode"), ("dtype", "dtype"), ("plain_ms", "plain torch.compile ms"),
                  ("fusionpass_ms", "fusionpass ms"), ("ratio", "plain / fusionpass"),
                  ("without_ms", "fusionpass without the fusion ms"), ("ratio_to_without", "without / with"),
                  ("plain_peak_mib", "plain peak MiB"), ("fusionpass_peak_mib", "fusionpass peak MiB"),
                  ("matched", "matched"), ("variants", "matched variants"), ("default_rule", "default cost rule"), ("first_call_s", "first call s"),
                  ("note", "note")]
MODEL_COLUMNS = [c for c in KERNEL_COLUMNS if c[0] not in ("default_rule", "first_call_s")]
MODEL_COLUMNS.insert(6, ("tokens_per_s", "fusionpass tokens/s"))
MODEL_COLUMNS.insert(7, ("eager_ms", "eager ms"))
REGIONAL_COLUMNS = [*MODEL_COLUMNS[:-1], ("graphs", "fusionpass graphs compiled"), MODEL_COLUMNS[-1]]
COMPILE_COLUMNS = [("case", "model"), ("mode", "mode"), ("plain_s", "plain first step s"),
                   ("fusionpass_s", "fusionpass first step s"), ("added", "added (fusionpass / plain - 1)"),
                   ("pass_s", "fusionpass's own pass s"), ("compiled_first", "compiled first")]


def _cell(value) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, dict):
        value = ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value).replace("|", "\\|")


def markdown_table(rows: list[dict], columns) -> list[str]:
    used = [(key, title) for key, title in columns if any(r.get(key) not in (None, "") for r in rows)]
    lines = ["| " + " | ".join(t for _, t in used) + " |", "|" + "---|" * len(used)]
    for r in rows:
        if "error" in r or "skipped" in r:
            cells = [_cell(r.get(k)) for k, _ in used[:3]]
            text = f"ERROR: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append("| " + " | ".join(cells + [_cell(text)] + [""] * (len(used) - 4)) + " |")
        else:
            lines.append("| " + " | ".join(_cell(r.get(k)) for k, _ in used) + " |")
    return lines


def suite_environment() -> dict:
    import transformers

    env = environment()
    env["transformers"] = transformers.__version__
    env["fusionpass source digest"] = fusionpass.passes.source_digest()
    env["cudnn-frontend"] = _cudnn_frontend()
    return env


def _cudnn_frontend() -> str:
    """The `cudnn` extra's version, which decides whether flash_attention's cuDNN padding route can run."""
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


TITLES = {"models": "model steps (every fusion, default settings)",
          "trainer": "the HF Trainer with bf16=True and torch_compile=True (benchmarks/trainer.py)",
          "trainer-compile-time": "first-step compile time on the HF Trainer path, cold and warm caches "
                                  "(benchmarks/trainer.py --compile-time)",
          "regional": "regional compilation: torchtitan-style training steps, every block and the loss region "
                      "compiled on their own (every fusion, default settings)",
          "compile-time": "first-step compile time of the model steps (plain torch.compile against fusionpass)",
          "families": "the census's model families at their published widths, two layers, a training step in "
                      "bf16 and under the Trainer's autocast (every fusion, default settings)"}


TIMED_INTERLEAVED = ("Generated by benchmarks/suite.py; timed interleaved in one process (medians), compile caches off. "
                     "plain / fusionpass > 1 means fusionpass is faster.")


def write_topic(out_dir: pathlib.Path, topic: str, env: dict, rows: list[dict], columns, extra=(),
                footer: str = TIMED_INTERLEAVED) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{topic}.json").write_text(json.dumps({"topic": topic, "environment": env, "rows": rows}, indent=1) + "\n")
    lines = [f"# {topic}: {TITLES.get(topic, 'kernel-level cases, plain torch.compile against fusionpass')}", ""]
    lines += [f"- {k}: `{v}`" if k == "command" else f"- {k}: {v}" for k, v in env.items()]
    lines += ["", *markdown_table(rows, columns), "", *extra, footer, ""]
    (out_dir / f"{topic}.md").write_text("\n".join(lines))
    say(f"  wrote {out_dir / topic}.md and .json")


FAMILY_COLUMNS = [*MODEL_COLUMNS, ("trainer_loss", "fusionpass's Trainer loss"), ("near_misses", "near misses")]


def families_summary(rows) -> list[str]:
    """Issue 43's census bars over the measured training rows: none below 1.00x, the median at
    least 1.15x over at least 20 families."""
    train = [r for r in rows if r.get("mode") == "train" and isinstance(r.get("ratio"), (int, float))]
    if not train:
        return ["No family was measured.", ""]
    lines = []
    for dtype in sorted({r["dtype"] for r in train}):
        measured = [r for r in train if r["dtype"] == dtype]
        ratios = [r["ratio"] for r in measured]
        below = sorted((r["case"].split(":")[0], r["ratio"]) for r in measured if r["ratio"] < 1.0)
        lines.append(f"Training, {dtype}: {len(ratios)} families, median plain / fusionpass "
                     f"{statistics.median(ratios):.3f}x, lowest {min(ratios):.3f}x; below 1.00x: "
                     + (", ".join(f"{n} {x:.3f}x" for n, x in below) or "none") + ".")
    older = sorted({r["case"].split(":")[0] for r in train if "trainer_loss" not in r})
    if older:
        lines.append(f"Rows of {', '.join(older)} were measured before the topic called each side as its Trainer "
                     "does: both sides returned the logits, which keeps linear_cross_entropy out of the standard "
                     "causal LMs too (its near miss says so), and the MoE families ran the census's eager expert "
                     "loop, not transformers' default.")
    return [*lines, ""]


def write_families(out_dir: pathlib.Path, env: dict, rows: list[dict]) -> None:
    write_topic(out_dir, "families", env, rows, FAMILY_COLUMNS, extra=families_summary(rows))


def merge_topic(out_dir: pathlib.Path, topic: str, parts: list[pathlib.Path]) -> None:
    """One topic from the runs in `parts` (each a folder with <topic>.json), in that order: the
    environment is the first run's; a row of another run carries that run's environment (as a
    row merged by hand does), and a row skipped in one run gives way to the same case measured
    in another."""
    runs = [json.loads((part / f"{topic}.json").read_text()) for part in parts]
    env, rows, where = runs[0]["environment"], [], {}
    for run in runs:
        for row in run["rows"]:
            if run is not runs[0]:
                row = {**row, "environment": run["environment"]}
            key = (row["case"], row["mode"], row["dtype"])
            if key not in where:
                where[key] = len(rows)
                rows.append(row)
            elif "skipped" in rows[where[key]]:
                rows[where[key]] = row
    rows = [r for r in rows if "skipped" not in r] + [r for r in rows if "skipped" in r]
    env = {**env, "seconds": sum(r["environment"].get("seconds", 0) for r in runs),
           "command": "; ".join(dict.fromkeys(r["environment"]["command"] for r in runs))}
    if topic == "families":
        write_families(out_dir, env, rows)
    else:
        write_topic(out_dir, topic, env, rows, MODEL_COLUMNS)


def compile_time_summary(rows) -> list[str]:
    added = [r["added"] for r in rows if "added" in r]
    if not added:
        return ["No model step was measured.", ""]
    # The side compiled second reuses what the first compiled in this process (Triton's kernel
    # cache, Inductor's loaded modules), so each order is summarized alone, and the order-free
    # figure is the mean of the two (the rows alternate which side goes first).
    by_order = {side: [r["added"] for r in rows if r.get("compiled_first") == side] for side in ("plain", "fusionpass")}
    if not all(by_order.values()):
        return [f"Median added first-step time: {statistics.median(added):+.1%} (one compile order only: "
                "biased by the order).", ""]
    plain_first, fused_first = (statistics.median(by_order[s]) for s in ("plain", "fusionpass"))
    both = (plain_first + fused_first) / 2
    return [f"Added first-step time, median over rows with plain compiled first: {plain_first:+.1%}; with "
            f"fusionpass first: {fused_first:+.1%}; their mean, the order-free estimate: {both:+.1%} "
            f"(the bar, at most +10%: {'met' if both <= 0.10 else 'NOT met'} on these models).", ""]


# =============================================================================================
# the README's table

README_BEGIN = "<!-- performance table: generated by `python benchmarks/suite.py --readme` from benchmarks/results/latest -->"
README_END = "<!-- end of performance table -->"
# the topics whose rows a fusion's cost_table.py is generated from: shape-class tables, named under
# the README's table rather than spread through it
COST_TABLE_TOPICS = tuple(t for m in fusionpass.fusions.modules("bench")
                          if (t := getattr(m, "COST_TABLE_TOPIC", None)))
README_TOPICS = ("trainer", *(t for t in KERNEL_TOPICS if t not in COST_TABLE_TOPICS), "models", "regional")


def readme_section(latest: pathlib.Path = LATEST) -> str:
    topics = {p.stem: json.loads(p.read_text()) for p in sorted(latest.glob("*.json"))}
    topics = {k: t for k, t in topics.items() if isinstance(t, dict) and "environment" in t}  # not trainer_runs
    # the environments and dates of this table's topics (the Trainer topics have their own section)
    dates_by_env: dict[tuple, set] = {}
    for name, t in topics.items():
        if name in README_TOPICS or name == "compile-time":
            # a row that ran apart from its topic's run (merged into latest/ by hand) carries its own
            for e in [t["environment"], *(r["environment"] for r in t["rows"] if "environment" in r)]:
                dates_by_env.setdefault((e["gpu"], e["torch"], e["triton"], e.get("transformers")), set()).add(e["date"])
    lines = [README_BEGIN, ""]
    if not topics:
        return "\n".join(lines + ["No results yet: `python benchmarks/suite.py` on a GPU writes them.", "", README_END])
    for (gpu, torch_v, triton_v, tf_v), dates in sorted(dates_by_env.items(), key=str):
        lines.append(f"Measured on {gpu} (torch {torch_v}, triton {triton_v}, transformers {tf_v}), "
                     f"{', '.join(sorted(dates))}; per-topic tables with commands: `benchmarks/results/latest/<topic>.md`.")
    lines += ["", "| topic | case | mode | plain torch.compile ms | fusionpass ms | plain / fusionpass | "
              "peak MiB plain → fusionpass | matched | default cost rule |", "|---|---|---|---|---|---|---|---|---|"]
    for topic in README_TOPICS:
        for r in topics.get(topic, {}).get("rows", []):
            if "error" in r or "skipped" in r:
                status = "error" if "error" in r else "skipped"
                lines.append(f"| {topic} | {_cell(r['case'])} | {r['mode']} | {status} (see latest/{topic}.md) "
                             "| | | | | |")
                continue
            mem = (f"{r['plain_peak_mib']} → {r['fusionpass_peak_mib']}" if "plain_peak_mib" in r else
                   f"{1024 * r['plain_peak_gib']:.0f} → {1024 * r['fusionpass_peak_gib']:.0f}" if r.get("plain_peak_gib") else "")
            matched = _cell(r["matched"]) + (" (NOT MATCHED)" if r.get("note") else "")
            case = r["case"] + (f" ({r['environment']['gpu']})" if "environment" in r else "")
            lines.append(f"| {topic} | {_cell(case)} | {r['mode']} | {r['plain_ms']} | {r['fusionpass_ms']} | "
                         f"{r['ratio']}× | {mem} | {matched} | {_cell(r.get('default_rule', ''))} |")
    if "compile-time" in topics:
        lines += ["", "First-step compile time of the model steps above (`latest/compile-time.md`): "
                  + compile_time_summary(topics["compile-time"]["rows"])[0]]
    if "families" in topics:
        lines += ["", "The census of model families at their published widths (`latest/families.md`, "
                  "issue 43's bars): " + " ".join(families_summary(topics["families"]["rows"])).strip()]
    measured = [t for t in COST_TABLE_TOPICS if t in topics]
    if measured:
        lines += ["", "The cost rules' shape-class tables: "
                  + ", ".join(f"`latest/{t}.md`" for t in measured) + "."]
    lines += ["", README_END]
    return "\n".join(lines)


TRAINER_BEGIN = "<!-- trainer table: generated by `python benchmarks/suite.py --readme` from benchmarks/results/latest/trainer.json -->"
TRAINER_END = "<!-- end of trainer table -->"


def _logging_cadence(env: dict) -> str:
    """How often the measured runs logged: each log reads the loss and gradient norm on the host (a sync)."""
    steps = env.get("logging_steps", 1)
    return "logging every step" if steps == 1 else f"logging every {steps} steps" + (
        " (the Trainer's default)" if steps == 500 else "")


def trainer_section(latest: pathlib.Path = LATEST) -> str:
    """What a Trainer user gets: the `trainer` topic's rows (benchmarks/trainer.py)."""
    path = latest / "trainer.json"
    lines = [TRAINER_BEGIN, ""]
    if not path.exists():
        return "\n".join(lines + ["No Trainer results yet: `python benchmarks/trainer.py` on a GPU writes them.", "",
                                  TRAINER_END])
    topic = json.loads(path.read_text())
    env = topic["environment"]
    lines += [f"`Trainer(args=TrainingArguments(bf16=True, torch_compile=True))` after `fusionpass.install()`, "
              f"{env['model']}, a collator's all-ones attention_mask; {env['gpu']}, torch {env['torch']}, "
              f"transformers {env.get('transformers')}, cudnn-frontend {env.get('cudnn-frontend', 'not recorded')}, "
              f"{env['date']}, {_logging_cadence(env)} (`benchmarks/results/latest/trainer.md`).", "",
              "| case | plain torch.compile ms | fusionpass ms | plain / fusionpass | peak GiB plain → fusionpass |",
              "|---|---|---|---|---|"]
    for r in topic["rows"]:
        if "error" in r:
            lines.append(f"| {r['case']} | error (see latest/trainer.md) | | | |")
            continue
        lines.append(f"| {r['case']} | {r['plain_ms']} | {r['fusionpass_ms']} | {r['ratio']}× | "
                     f"{r['plain_peak_gib']} → {r['fusionpass_peak_gib']} |")
    return "\n".join(lines + trainer_compile_time_lines(latest) + ["", TRAINER_END])


def trainer_compile_time_lines(latest: pathlib.Path = LATEST) -> list[str]:
    """The Trainer path's first steps, cold and warm (benchmarks/trainer.py --compile-time), where measured."""
    topic_name = "trainer-compile-time"
    path = latest / f"{topic_name}.json"
    if not path.exists():
        return ["", "First step on this path, cold and warm: not measured yet (`python benchmarks/trainer.py "
                    "--compile-time` on a GPU)."]
    topic = json.loads(path.read_text())
    env = topic["environment"]
    lines = ["", f"First step (compile + one step) on this path, {env['gpu']} "
                 f"(`benchmarks/results/latest/{topic_name}.md`; a row measured apart from the others carries "
                 "its own environment there):", "",
             "| case | caches | plain torch.compile s | fusionpass s | added | measured |", "|---|---|---|---|---|---|"]
    for r in topic["rows"]:
        e = r.get("environment", env)
        measured = f"{e['date']}, source {str(e.get('fusionpass source digest', '?'))[:8]}"
        if "error" in r:
            lines.append(f"| {r['case']} | {r['cache']} | error (see latest/{topic_name}.md) | | | {measured} |")
        elif r["cache"] in ("cold", "warm"):
            lines.append(f"| {r['case']} | {r['cache']} | {r['plain_s']} | {r['fusionpass_s']} | {r['added']:+.1%} "
                         f"| {measured} |")
    return lines


def cost_table_source(topic: str, rows: list[dict], env: dict) -> str | None:
    """The text of a fusion folder's cost_table.py from its COST_TABLE_TOPIC's rows: plain /
    fusionpass per mode and shape class
    (fusionpass.cost.Measured reads it); None without a measured row."""
    speedups: dict[str, dict[int, float]] = {}
    for row in rows:
        if row.get("shape_class") is not None and isinstance(row.get("ratio"), (int, float)):
            mode = "training" if row["mode"] == "train" else "inference"
            speedups.setdefault(mode, {})[int(row["shape_class"])] = float(row["ratio"])
    if not speedups:
        return None
    table = "".join(f"    {mode!r}: {{{', '.join(f'{c}: {r}' for c, r in sorted(by_class.items()))}}},\n"
                    for mode, by_class in sorted(speedups.items()))
    return (f'"""Generated by `python benchmarks/suite.py --cost-tables` from benchmarks/results/latest/{topic}.json\n'
            f'({env.get("gpu")}, {env.get("date")}, source digest {str(env.get("fusionpass source digest"))[:8]}): '
            f'plain / fusionpass\nper mode and shape class. Do not edit; rerun the topic and regenerate."""\n\n'
            f'SOURCE = "benchmarks/results/latest/{topic}.md"\nSPEEDUPS = {{\n{table}}}\n')


def write_cost_tables(latest: pathlib.Path = LATEST) -> list[pathlib.Path]:
    """Each fusion folder whose bench.py names a COST_TABLE_TOPIC: its cost_table.py from that
    topic's latest result (folders whose topic has not run are left as they are)."""
    written = []
    for module in fusionpass.fusions.modules("bench"):
        topic = getattr(module, "COST_TABLE_TOPIC", None)
        result = latest / f"{topic}.json"
        if topic is None or not result.exists():
            continue
        data = json.loads(result.read_text())
        text = cost_table_source(topic, data["rows"], data["environment"])
        if text is not None:
            path = pathlib.Path(module.__file__).with_name("cost_table.py")
            path.write_text(text)
            written.append(path)
    return written


def rewrite_readme(readme: pathlib.Path = ROOT / "README.md") -> None:
    text = readme.read_text()
    begin, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    text = text[:begin] + readme_section() + text[end:]
    begin, end = text.index(TRAINER_BEGIN), text.index(TRAINER_END) + len(TRAINER_END)
    readme.write_text(text[:begin] + trainer_section() + text[end:])
    say(f"rewrote the performance and Trainer tables of {readme}")


# =============================================================================================


def main(argv=None) -> int:
    topics = [*KERNEL_TOPICS, "models", "compile-time", "regional", "families"]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma-separated topics (kernels: every kernel topic): " + ", ".join(topics))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one round (with --device cpu: a CPU test)")
    p.add_argument("--out-dir", default=str(LATEST))
    p.add_argument("--case", default=None, help="texts separated by ';': only cases whose '<name>, <train|inference>' contains one")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds per topic; cases after it is spent become 'skipped' rows")
    p.add_argument("--readme", action="store_true", help="rewrite README.md's performance table and exit")
    p.add_argument("--merge", default=None, metavar="DIR,DIR...",
                   help="write each --only topic (models or families) into --out-dir from these runs' results and exit")
    p.add_argument("--cost-tables", action="store_true",
                   help="write each fusion folder's cost_table.py from its measured topic in --out-dir and exit")
    args = p.parse_args(argv)
    if args.readme:
        rewrite_readme()
        return 0
    if args.merge:
        merged = (args.only or "families").split(",")
        if set(merged) - {"models", "families"}:
            p.error("--merge writes the models and families topics only")
        for topic in merged:
            merge_topic(pathlib.Path(args.out_dir), topic, [pathlib.Path(d) for d in args.merge.split(",")])
        return 0
    if args.cost_tables:
        for path in write_cost_tables(pathlib.Path(args.out_dir)):
            say(f"wrote {path}")
        return 0
    chosen = args.only.split(",") if args.only else topics
    if "kernels" in chosen:  # every kernel topic: the first of the two GPU calls
        chosen = [t for t in chosen if t != "kernels"] + list(KERNEL_TOPICS)
    unknown = set(chosen) - set(topics)
    if unknown:
        p.error(f"unknown topic(s) {sorted(unknown)}")
    # The pass runs only when Inductor compiles: a cache hit would time the cached code and match nothing.
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device (use --device cpu --smoke for a CPU run)")
    run = Run(args.device, args.smoke)
    out_dir = pathlib.Path(args.out_dir)
    env = suite_environment()
    say(f"benchmark suite: {', '.join(chosen)} on {env['gpu']} ({args.device}){' smoke' if args.smoke else ''}")
    wanted = args.case.split(";") if args.case else None

    def keep(cases):
        return [c for c in cases if wanted is None or any(w in f"{c.name}, {c.mode}" for w in wanted)]

    t_start = time.perf_counter()
    for topic in chosen:
        if topic not in KERNEL_TOPICS:
            continue
        t0 = time.perf_counter()
        say(f"topic {topic}")
        cases = keep(KERNEL_TOPICS[topic](args.smoke))
        rows = kernel_topic(run, topic, cases, args.budget_s)
        write_topic(out_dir, topic, {**env, "seconds": round(time.perf_counter() - t0)}, rows, KERNEL_COLUMNS)
    if "models" in chosen or "compile-time" in chosen:
        t0 = time.perf_counter()
        say("topic models" + (" (for compile-time)" if "models" not in chosen else ""))
        rows = model_rows(run, keep(model_cases(args.smoke)), args.budget_s)
        env_models = {**env, "seconds": round(time.perf_counter() - t0)}
        if "models" in chosen:
            write_topic(out_dir, "models", env_models, rows, MODEL_COLUMNS)
        if "compile-time" in chosen:
            ct = compile_time_rows(rows)
            write_topic(out_dir, "compile-time", env_models, ct, COMPILE_COLUMNS,
                        extra=[*compile_time_summary(ct),
                               "Each first step is compile plus one step with the FX graph and AOT autograd caches "
                               "off, after a small warm-up compile; the side compiled first alternates by row. "
                               "fusionpass's own pass is its pattern matching, guards and rewrites.", ""])
    if "families" in chosen:
        t0 = time.perf_counter()
        say("topic families")
        rows = model_rows(run, keep(family_cases(args.smoke)), args.budget_s, near_misses=True)
        write_families(out_dir, {**env, "seconds": round(time.perf_counter() - t0)}, rows)
    if "regional" in chosen:
        t0 = time.perf_counter()
        say("topic regional")
        rows = regional_rows(run, keep(regional_cases(args.smoke)), args.budget_s)
        write_topic(out_dir, "regional", {**env, "seconds": round(time.perf_counter() - t0)}, rows, REGIONAL_COLUMNS)
    say(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
