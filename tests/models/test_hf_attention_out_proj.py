"""attention_out_proj on tiny HF models whose eager attention goes to fusionpass::flash_attention
(GPT-2: transpose(1, 2).reshape(...).contiguous() into Conv1D's addmm; BLOOM: _merge_heads'
view/permute/reshape into `dense`; Mistral through the SDPA kernel route: transpose/contiguous/
reshape into o_proj), training and inference, under the Triton interpreter: exact
match counts, outputs and gradients equal to plain torch.compile, and in Inductor's generated
forward code the projection GEMM reads the attention output buffer itself (no copy kernel between
them)."""
from __future__ import annotations

import re

import pytest
import torch
from helpers import (
    assert_outcomes_close,
    compiling,
    fused_graph,
    make_backend,
    near_misses,
    plain_compiled,
    run,
)
from torch._inductor.utils import run_and_get_code

import fusionpass
from fusionpass.fusions.flash_attention import op as fa_ops

transformers = pytest.importorskip("transformers")

from models.test_hf_eager_attention import bloom, gpt2, ids  # noqa: E402  (after the importorskip)
from patterns.test_attention_kernel_patterns import _mistral  # noqa: E402

FUSIONS = ["flash_attention", "attention_out_proj"]
FLASH = torch.ops.fusionpass.flash_attention.default
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch):
    monkeypatch.setattr(fa_ops, "CPU_BLOCKS", {"block_m": 16, "block_n": 16, "dq_block_m": 16, "dq_block_n": 16})


def attention_output_readers(code: str) -> list[str]:
    """The lines of Inductor's generated code that read the attention output buffer (the op's
    item 0), leaving out asserts, `del`, the saved-tensor `return` and Inductor handing the memory on
    to a later buffer (`# reuse`)."""
    calls = re.findall(r"(buf\d+) = torch\.ops\.fusionpass\.flash_attention_forward_host\.default\(", code)
    assert calls, "no attention op in the generated code"
    readers = []
    for call in calls:
        (out,) = re.findall(rf"(buf\d+) = {call}\[0\]", code)
        for line in code.splitlines():
            line = line.strip()
            if re.search(rf"\b{out}\b", line) and not re.match(rf"({out} = |assert_|del |return |#)", line) and (
                    not line.endswith("# reuse")):
                readers.append(line)
    return readers


def check(model, attention_variant, out_proj_variant, train, layers=2, x=None, dynamic=None, **config):
    x = ids() if x is None else x
    kwargs = {"use_cache": False, **({"labels": x} if train else {})}
    model.train(train)
    with compiling():
        fused = torch.compile(model, backend=make_backend(FUSIONS, **config), fullgraph=True, dynamic=dynamic)
        got, codes = run_and_get_code(run, fused, model, (x,), train, kwargs=kwargs)
        stats = fusionpass.stats(variants=True)
    assert near_misses() == []
    assert stats == {("flash_attention", attention_variant): layers, ("attention_out_proj", out_proj_variant): layers}
    # codes[0] is the forward: each attention output goes straight into a projection GEMM
    readers = attention_output_readers(codes[0])
    assert len(readers) == layers, readers
    assert all(re.search(r"extern_kernels\.(addmm|mm)\(", r) for r in readers), readers
    with compiling():
        want = run(plain_compiled(model), model, (x,), train, kwargs=kwargs)
    assert_outcomes_close(got, want, rtol=2e-4)


@pytest.mark.parametrize("train", [True, False])
def test_gpt2(train):
    check(gpt2(), "eager_kernel", "transpose_reshape", train)


@pytest.mark.parametrize("train", [True, False])
def test_bloom(train):
    check(bloom(), "eager_alibi_kernel", "merge_heads", train)


def test_mistral_sdpa_kernel_route():
    # Llama family through the SDPA kernel route (attention_kernel=True): transpose(1, 2).contiguous()
    # .reshape(B, S, -1).contiguous() into o_proj, the residual add then RMSNorm after it
    torch.manual_seed(1)
    x = torch.randint(1, 128, (2, 8))
    check(_mistral(), "sliding_window_kernel", "transpose_reshape", True, x=x, attention_kernel=True)


def test_gpt2_copy_kernel_without_the_fusion():
    # the control: attention alone leaves a copy kernel between the op and the projection
    model = gpt2(layers=1).eval()
    with compiling():
        fused = torch.compile(model, backend=make_backend(["flash_attention"]), fullgraph=True)
        _, codes = run_and_get_code(run, fused, model, (ids(),), False, kwargs={"use_cache": False})
    (reader,) = attention_output_readers(codes[0])
    assert reader.startswith("cpp_fused_clone_transpose"), reader


def test_bloom_graph_has_no_round_trip_views():
    # the permute of _merge_heads reads the op's output; token-major is set on the op
    gm, _, record = fused_graph(bloom(layers=1).train(), ids(), fusions=FUSIONS)
    assert record.matches == {("flash_attention", "eager_alibi_kernel"): 1, ("attention_out_proj", "merge_heads"): 1}
    (call,) = [n for n in gm.graph.nodes if n.target is FLASH]
    assert call.kwargs["token_major"] is True
    (out,) = [u for u in call.users if u.args[1] == 0]
    assert [u.target for u in out.users] == ["permute"]


class NotProjected(torch.nn.Module):
    """Merged heads summed, not projected: a near miss, and the op keeps its layout."""

    def forward(self, q, k, v):
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.125, dim=-1)
        o = torch.matmul(p, v)
        return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1).sum(-1)


def test_not_projected_is_a_near_miss():
    q, k, v = (torch.randn(2, 2, 8, 64) for _ in range(3))
    gm, _, record = fused_graph(NotProjected(), q, k, v, fusions=FUSIONS)
    assert record.matches == {("flash_attention", "eager_kernel"): 1}
    ((fusion, _, reason),) = record.near_misses
    assert fusion == "attention_out_proj" and "not an output projection" in reason
    (call,) = [n for n in gm.graph.nodes if n.target is FLASH]
    assert len(call.args) == 3 and "token_major" not in call.kwargs


class ReshapedBeforeMerge(torch.nn.Module):
    """transformers 5.24's SDPA path reshapes the attention output to its own shape before the
    head merge (`out.reshape(out.shape[0], -1, q_len, D)`); `scramble` reshapes it to [B, S, H, D]
    instead, which is no head merge (the heads and tokens of a [B, H, S, D] tensor reinterpreted)."""

    def __init__(self, scramble=False):
        super().__init__()
        self.scramble = scramble
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(128, 128)

    def forward(self, q, k, v):
        b, h, s, d = q.shape
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.125, dim=-1)
        o = torch.matmul(p, v)
        o = o.reshape(b, s, h, d).transpose(1, 2) if self.scramble else o.reshape(o.shape[0], -1, s, d)
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("scramble", [False, True])
def test_reshape_to_its_own_shape_before_the_merge(scramble):
    q, k, v = (torch.randn(2, 2, 8, 64) for _ in range(3))
    module = ReshapedBeforeMerge(scramble)
    gm, out, record = fused_graph(module, q, k, v, fusions=FUSIONS)
    (call,) = [n for n in gm.graph.nodes if n.target is FLASH]
    if scramble:
        assert record.matches == {("flash_attention", "eager_kernel"): 1}
        ((fusion, _, reason),) = record.near_misses
        assert fusion == "attention_out_proj" and "not merged into [B, S, H*D]" in reason
        assert "token_major" not in call.kwargs
    else:
        assert record.matches == {("flash_attention", "eager_kernel"): 1,
                                  ("attention_out_proj", "transpose_reshape"): 1}
        assert call.kwargs["token_major"] is True
    torch.testing.assert_close(out, module(q, k, v), rtol=2e-4, atol=2e-4)
