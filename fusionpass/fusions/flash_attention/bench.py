"""flash_attention's benchmark topics (benchmarks/suite.py; fusionpass.bench_cases says how topics
are found and ordered): its default and opt-in routes, then two topics of their own, sliding
windows, head dims other than 64/128/256 (the latter with decode_attention's padded head dims)
and the opt-in eager forms (soft-capped scores, attention sinks)."""
from __future__ import annotations

from fusionpass.bench_cases import Case, attention_layers, decode_step_case
from fusionpass.conformance.attention_layers import Bert, Bloom, DeepseekMLA, Gemma2, GPT2, GptOss, Llama, Shape

ORDER = 70

# The opt-in setting that sends SDPA calls (windows, run-time padding) to the flash kernel.
FLASH_SDPA_SETTING = "attention_kernel"


def flash_attention_cases(smoke):

    fusion = ("flash_attention",)
    gpt2, bloom, llama = ((Shape(1, 2, 2, 64, 64),) * 2 + (Shape(1, 4, 2, 64, 64),)) if smoke else (
        Shape(16, 12, 12, 1024, 64), Shape(8, 16, 16, 2048, 64), Shape(4, 16, 4, 2048, 128))
    bert = Shape(2, 2, 2, 64, 64) if smoke else Shape(32, 12, 12, 512, 64)
    llama_right, llama_short = (Shape(2, 4, 2, 64, 64),) * 2 if smoke else (
        Shape(8, 16, 4, 1024, 128), Shape(32, 16, 4, 128, 64))
    return [
        Case(f"GPT-2 eager attention {gpt2}", attention_layers(GPT2, gpt2), True, fusion, True),
        # BLOOM's training step is in attention_out_proj's cases (with and without that fusion)
        Case(f"BLOOM eager ALiBi attention {bloom}", attention_layers(Bloom, bloom), False, fusion, True),
        # SDPA's own (cuDNN/flash) kernel is faster for a plain causal mask: opt-in only
        Case(f"Llama sdpa causal {llama}", attention_layers(Llama, llama, impl="sdpa"), True, fusion, False,
             {FLASH_SDPA_SETTING: True}),
        # causal AND the run-time attention_mask a collator passes (on by default): plain compile
        # runs SDPA with the materialized mask; all ones, right padding, and a short sequence
        *(Case(f"Llama sdpa causal + {pad} key padding {shape}",
               attention_layers(Llama, shape, pad, impl="sdpa"), train, fusion, True)
          for pad, shape, train in (("ones", llama, True), ("ones", llama, False), ("right", llama_right, True),
                                    ("ones", llama_short, True))),
        # an encoder's padding collator (all-true mask AND key padding, on by default): right
        # padding (row r of B loses r * L // (B + 1) tokens) and all ones
        *(Case(f"BERT sdpa + {pad} key padding {bert}", attention_layers(Bert, bert, pad), True, fusion, True)
          for pad in ("right", "ones")),
    ]


def attention_windows_cases(smoke):
    """flash_attention's sliding-window route (on by default), a topic of its own: plain compile
    runs SDPA with the materialized window mask over every key. Mistral's window, Gemma-3's (head
    dim 256), a window that cuts little, one with right key padding, and short sequences (S 512
    and 256), where the route also takes square scores."""

    if smoke:
        rows = [(17, None, Shape(1, 4, 2, 64, 64), True), (17, "right", Shape(2, 4, 2, 64, 64), True)]
    else:
        mistral, gemma, cuts_little, padded = (Shape(4, 32, 8, 4096, 128), Shape(2, 8, 4, 4096, 256),
                                               Shape(4, 16, 4, 2048, 128), Shape(8, 16, 4, 1024, 128))
        s512, s256 = Shape(32, 16, 4, 512, 128), Shape(64, 12, 12, 256, 64)
        rows = [(1024, None, mistral, True), (1024, None, mistral, False), (512, None, gemma, True),
                (1536, None, cuts_little, True), (256, "right", padded, True),
                (128, None, s512, True), (128, None, s512, False), (64, "right", s256, True)]
    return [Case(f"Mistral sdpa sliding window {window}{f' + {pad} key padding' if pad else ''} {shape}",
                 attention_layers(Llama, shape, pad, impl="sdpa", window=window), train, ("flash_attention",), True)
            for window, pad, shape, train in rows]


def attention_head_dims_cases(smoke):
    """Head dims other than 64/128/256, a topic of their own, each opt-in (its setting opened here):
    MLA (DeepSeek-V3's q/k 192, v 128, v padded to 192 for the kernel) with the collator's all-ones
    attention_mask, where plain compile runs SDPA with the materialized mask; decode steps at head
    dims 80 and 96 (Phi-2's and Phi-3's), padded to 128 in the decode kernel's registers."""

    mla, d80, d96 = (Shape(2, 2, 2, 64, 192), Shape(1, 4, 2, 128, 80, q=1), Shape(1, 4, 4, 128, 96, q=1)) if smoke \
        else (Shape(2, 16, 16, 4096, 192), Shape(8, 32, 32, 4096, 80, q=1), Shape(8, 32, 32, 4096, 96, q=1))
    return [
        *(Case(f"DeepSeek-V3 MLA sdpa causal + ones key padding {mla}", attention_layers(DeepseekMLA, mla, "ones"),
               train, ("flash_attention",), False, {"attention_mla": True}) for train in (True, False)),
        *(decode_step_case(s, False, {"decode_attention_padded_head_dims": True}) for s in (d80, d96)),
    ]


def attention_eager_forms_cases(smoke):
    """The eager forms that only fusionpass's kernel takes, with their default settings; plain
    compile materializes the S x S scores. Gemma-2's soft-capped scores at 2B's heads (8 query, 4 kv, head
    dim 256) and 9B's (16, 8); gpt-oss's attention sinks at 20B's (64, 8, head dim 64). Each model
    a sliding-window layer and a full one."""

    gemma = [Shape(1, 2, 1, 64, 256)] if smoke else [Shape(2, 8, 4, 4096, 256), Shape(4, 16, 8, 2048, 256)]
    gpt_oss = [Shape(1, 4, 2, 64, 64)] if smoke else [Shape(2, 64, 8, 4096, 64)]
    return [
        # in training the default keeps soft-capping out (slower, though leaner): timed opened
        *(Case(f"Gemma-2 eager soft-capped attention {shape}", attention_layers(Gemma2, shape), train,
               ("flash_attention",), not train, {"attention_softcap_training": True} if train else {})
          for shape in gemma for train in (True, False)),
        *(Case(f"gpt-oss eager attention with sinks {shape}", attention_layers(GptOss, shape), train,
               ("flash_attention",), True) for shape in gpt_oss for train in (True, False)),
    ]


TOPICS = {
    "flash_attention": flash_attention_cases,
    "attention_windows": attention_windows_cases,
    "attention_head_dims": attention_head_dims_cases,
    "attention_eager_forms": attention_eager_forms_cases,
}
