"""Families that no test or census row names, checked on the CPU the way the census checks its own
(`fusionpass/conformance/families.py`): each as a tiny config from transformers, one training step
through the Trainer's loss path in bf16 weights and under the Trainer's autocast over fp32 weights,
every fusion on with the cost rules' bounds opened, against the float64 eager model. Kernels run
under the Triton interpreter, so this says what the patterns match and whether what they replace
stays within the runner's bounds; it says nothing about CUDA speed.

A failure here names the tensor, fusionpass's error, plain compile's and eager's (with --plain) or
eager's alone. Gradients that are long sums with heavy cancellation (a router's, DiffLlama's
lambdas, xIELU's alphas) carry noise of the order of their own size on every side; compare the sides
at more than one seed before calling one a defect.

    TRITON_INTERPRET=1 python benchmarks/probes/unnamed_families.py [--only a,b] [--modes bf16,trainer-amp]
        [--plain] [--out results.jsonl]
"""
import argparse
import json
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import fusionpass.conformance as conformance  # noqa: E402
from fusionpass.conformance import families  # noqa: E402

_ENCODER = ("num_key_value_heads", "head_dim")
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# name: (config class, Auto* class, overrides of families.TINY, TINY keys the config does not take,
# attention implementation)
SPECS = {
    "qwen2_moe": ("Qwen2MoeConfig", "AutoModelForCausalLM",
                  dict(moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts=4,
                       num_experts_per_tok=2, experts_implementation="eager"), (), "sdpa"),
    "olmoe": ("OlmoeConfig", "AutoModelForCausalLM",
              dict(num_experts=4, num_experts_per_tok=2, experts_implementation="eager"), (), "sdpa"),
    "granitemoe": ("GraniteMoeConfig", "AutoModelForCausalLM",
                   dict(num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"), (), "sdpa"),
    "phimoe": ("PhimoeConfig", "AutoModelForCausalLM",
               dict(num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"), (), "sdpa"),
    "llama4": ("Llama4TextConfig", "AutoModelForCausalLM",
               dict(num_local_experts=2, intermediate_size_mlp=256, interleave_moe_layer_step=2), (), "sdpa"),
    "glm": ("GlmConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "glm4": ("Glm4Config", "AutoModelForCausalLM", {}, (), "sdpa"),
    "cohere2": ("Cohere2Config", "AutoModelForCausalLM", dict(sliding_window=16), (), "sdpa"),
    "exaone4": ("Exaone4Config", "AutoModelForCausalLM", dict(sliding_window=16), (), "sdpa"),
    "helium": ("HeliumConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "nemotron": ("NemotronConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "falcon": ("FalconConfig", "AutoModelForCausalLM", dict(num_kv_heads=2, new_decoder_architecture=True),
               ("num_key_value_heads", "head_dim", "intermediate_size"), "sdpa"),
    "gptj": ("GPTJConfig", "AutoModelForCausalLM", dict(n_embd=256, n_layer=2, n_head=4, rotary_dim=32,
                                                        n_positions=128), (), "eager"),
    "codegen": ("CodeGenConfig", "AutoModelForCausalLM", dict(n_embd=256, n_layer=2, n_head=4, rotary_dim=32,
                                                              n_positions=128), (), "eager"),
    "ministral": ("MinistralConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "seed_oss": ("SeedOssConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "arcee": ("ArceeConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "apertus": ("ApertusConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "ernie4_5": ("Ernie4_5Config", "AutoModelForCausalLM", {}, (), "sdpa"),
    "hunyuan": ("HunYuanDenseV1Config", "AutoModelForCausalLM", {}, (), "sdpa"),
    "diffllama": ("DiffLlamaConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "bitnet": ("BitNetConfig", "AutoModelForCausalLM", {}, (), "sdpa"),
    "xlm_roberta": ("XLMRobertaConfig", "AutoModelForMaskedLM", dict(_NO_DROPOUT, max_position_embeddings=130,
                                                                     pad_token_id=1), _ENCODER, "sdpa"),
    "electra": ("ElectraConfig", "AutoModelForMaskedLM", dict(_NO_DROPOUT, embedding_size=256), _ENCODER, "sdpa"),
    "albert": ("AlbertConfig", "AutoModelForMaskedLM", dict(embedding_size=128, hidden_dropout_prob=0.0,
                                                            attention_probs_dropout_prob=0.0), _ENCODER, "sdpa"),
    "deberta_v2": ("DebertaV2Config", "AutoModelForMaskedLM", _NO_DROPOUT, _ENCODER, "eager"),
    "bart": ("BartConfig", "AutoModelForSeq2SeqLM",
             dict(d_model=256, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=256, decoder_ffn_dim=256, dropout=0.0, decoder_start_token_id=1),
             ("num_key_value_heads", "head_dim", "intermediate_size", "hidden_size", "num_hidden_layers",
              "num_attention_heads"), "sdpa"),
    "mt5": ("MT5Config", "AutoModelForSeq2SeqLM",
            dict(d_model=256, d_kv=64, d_ff=256, num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0),
            ("num_key_value_heads", "head_dim", "intermediate_size", "hidden_size", "num_hidden_layers",
             "num_attention_heads", "max_position_embeddings"), "sdpa"),
}


def case(name: str, mode: str) -> conformance.Case:
    config, model_class, overrides, drop, attention = SPECS[name]
    family = families.Family(config, {}, {}, overrides, drop, model_class=model_class, attention=attention)
    return families.family_case(f"unnamed/{name}/{mode}", name, family, mode, expect={})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None, help="comma-separated names of SPECS (default: all)")
    p.add_argument("--modes", default=",".join(families.MODES))
    p.add_argument("--plain", action="store_true", help="compile plain too (its errors join the bound)")
    p.add_argument("--out", default=None, help="append one JSON line per case to this file")
    args = p.parse_args()
    for name in args.only.split(",") if args.only else SPECS:
        for mode in args.modes.split(","):
            start = time.perf_counter()
            result = conformance.run_case(case(name, mode), "cpu", plain=args.plain)
            # the match counts are what this probe reports, not a failure (expect is empty)
            numerics = [r for r in result.get("reason", "").split("; ") if r and not r.startswith("matches ")]
            row = {"case": result["name"], "seconds": round(time.perf_counter() - start),
                   "matches": result.get("matches"), "failures": numerics, "worst": result.get("worst")}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
