"""rms_norm_residual: every way model families write RMSNorm (and the residual add before it) is
matched, counted per variant, and computes what the eager module computes, forward and backward;
what must not be matched is left alone with a near-miss reason.

The modules are written the way each family writes its norm (transformers 5.x modeling files) and
sit in a pre-norm block: the first norm has no residual add before it (first layer), the second
one's sum feeds the next residual, the last one's sum has no other use. The two residual adds are
written in both operand orders.
"""
from __future__ import annotations

import expecttest
import pytest
import torch
from helpers import (
    FUSION,
    RTOL,
    assert_outcomes_close,
    compile_and_count,
    compiling,
    counts,
    eager,
    fused_graph,
    graph_code,
    make_backend,
    near_misses,
    run,
)
from torch import nn

import fusionpass

WIDTH = 512  # Config.rms_norm_min_width: narrower rows are left to Inductor
EPS = 1e-6
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def _weight(width, offset=1.0):
    return nn.Parameter(torch.randn(width) * 0.1 + offset)


# ---------------------------------------------------------------------------------------------
# norms, written as the model families write them


class LlamaRMSNorm(nn.Module):
    """HF Llama/Mistral/Qwen2/Qwen3/Phi-3 (spelling variants: x*x, torch.mean, .float())."""

    def __init__(self, width=WIDTH, eps=EPS, square="pow", mean="method", upcast="to"):
        super().__init__()
        self.weight = _weight(width)
        self.variance_epsilon = eps
        self.square, self.mean, self.upcast = square, mean, upcast

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        if self.upcast == "to":
            hidden_states = hidden_states.to(torch.float32)
        else:
            hidden_states = hidden_states.float()
        if self.square == "pow":
            squared = hidden_states.pow(2)
        else:
            squared = hidden_states * hidden_states
        if self.mean == "method":
            variance = squared.mean(-1, keepdim=True)
        else:
            variance = torch.mean(squared, dim=-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """HF Gemma 1/2/3: `(1 + w.float())` applied in fp32, before the downcast."""

    def __init__(self, width=WIDTH, eps=EPS):
        super().__init__()
        self.eps = eps
        self.weight = _weight(width, offset=0.0)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class PlainRMSNorm(nn.Module):
    """fp32 models: no casts at all."""

    def __init__(self, width=WIDTH, eps=EPS):
        super().__init__()
        self.weight = _weight(width)
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class T5LayerNorm(nn.Module):
    """HF T5: no upcast of h (bf16 h times fp32 rstd), downcast only when the weight is half."""

    def __init__(self, width=WIDTH, eps=EPS):
        super().__init__()
        self.weight = _weight(width)
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


class NoWeightRMSNorm(nn.Module):
    """A norm without an affine weight (e.g. OLMo's non-parametric norm)."""

    def __init__(self, width=WIDTH, eps=EPS):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype)


class OnePlusWeightAfterCast(nn.Module):
    """`(1 + w)` applied after the downcast: a Llama-form norm whose weight is computed in the
    graph (the add stays outside the fused op, its gradient flows back into w)."""

    def __init__(self, width=WIDTH, eps=EPS):
        super().__init__()
        self.weight = _weight(width, offset=0.0)
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * (1 + self.weight)


def torch_rms_norm(width=WIDTH, eps=EPS, affine=True):
    """`torch.nn.RMSNorm` (torchtitan's norm): one torch.rms_norm call in the Dynamo graph."""
    norm = nn.RMSNorm(width, eps=eps, elementwise_affine=affine)
    if affine:
        norm.weight = _weight(width)
    return norm


class FunctionalRMSNorm(nn.Module):
    """`F.rms_norm(x, (width,), weight, eps)` with keyword arguments."""

    def __init__(self, width=WIDTH, eps=EPS):
        super().__init__()
        self.weight = _weight(width)
        self.eps = eps

    def forward(self, x):
        return nn.functional.rms_norm(x, (x.shape[-1],), weight=self.weight, eps=self.eps)


class PreNormBlock(nn.Module):
    """A pre-norm layer and the final norm:

        residual = h; h = proj1(norm1(h)); h = residual + h        norm1: no residual add
        residual = h; h = proj2(norm2(h)); h = h + residual        norm2: sum feeds the next residual
        return norm3(h)                                            norm3: sum has no other use
    """

    def __init__(self, make_norm, width=WIDTH, add=None):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = make_norm(), make_norm(), make_norm()
        self.proj1 = nn.Linear(width, width)
        self.proj2 = nn.Linear(width, width)
        self.add = add

    def forward(self, h):
        residual = h
        h = self.proj1(self.norm1(h))
        h = residual + h if self.add is None else self.add(residual, h)
        residual = h
        h = self.proj2(self.norm2(h))
        h = h + residual if self.add is None else self.add(h, residual)
        return self.norm3(h)


class ResidualNorm(nn.Module):
    """norm(x + r), returning the sum as well (the next residual)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, r):
        h = x + r
        return self.norm(h), h


def block(make_norm, dtype, **kw):
    return PreNormBlock(make_norm, **kw).to(dtype)


def inputs(dtype, batch=2, seq=8, width=WIDTH):
    return torch.randn(batch, seq, width).to(dtype)


def block_counts(variant):
    return counts(**{variant: 2, f"{variant}_no_residual": 1})


# ---------------------------------------------------------------------------------------------
# every form matches, with exact counts per variant, and computes what eager computes

CASES = [
    # (id, norm factory, dtype, variant)
    ("llama-fp32", LlamaRMSNorm, FP32, "llama"),
    ("llama-bf16", LlamaRMSNorm, BF16, "llama"),
    ("llama-fp16", LlamaRMSNorm, FP16, "llama"),
    ("llama-x*x-bf16", lambda: LlamaRMSNorm(square="mul"), BF16, "llama"),
    ("llama-torch.mean-bf16", lambda: LlamaRMSNorm(mean="function"), BF16, "llama"),
    ("llama-.float()-bf16", lambda: LlamaRMSNorm(upcast="float"), BF16, "llama"),
    ("llama-x*x-torch.mean-.float()-fp32",
     lambda: LlamaRMSNorm(square="mul", mean="function", upcast="float"), FP32, "llama"),
    ("gemma-fp32", GemmaRMSNorm, FP32, "gemma"),
    ("gemma-bf16", GemmaRMSNorm, BF16, "gemma"),
    ("plain-fp32", PlainRMSNorm, FP32, "weight_in_fp32"),
    ("t5-fp32", T5LayerNorm, FP32, "weight_in_fp32"),
    ("t5-bf16", T5LayerNorm, BF16, "llama"),
    ("one-plus-w-after-downcast-bf16", OnePlusWeightAfterCast, BF16, "llama"),
    ("no-weight-fp32", NoWeightRMSNorm, FP32, "no_weight"),
    ("no-weight-bf16", NoWeightRMSNorm, BF16, "no_weight"),
    ("nn.RMSNorm-fp32", torch_rms_norm, FP32, "torch_rms_norm"),
    ("nn.RMSNorm-bf16", torch_rms_norm, BF16, "torch_rms_norm"),
    ("nn.RMSNorm-fp16", torch_rms_norm, FP16, "torch_rms_norm"),
    ("nn.RMSNorm-eps-None-bf16", lambda: torch_rms_norm(eps=None), BF16, "torch_rms_norm"),
    ("nn.RMSNorm-no-affine-fp32", lambda: torch_rms_norm(affine=False), FP32, "torch_rms_norm"),
    ("F.rms_norm-kwargs-bf16", FunctionalRMSNorm, BF16, "torch_rms_norm"),
]


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("make_norm, dtype, variant", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_block_matches_and_is_exact(make_norm, dtype, variant, train):
    model = block(make_norm, dtype)
    x = inputs(dtype)
    expected = eager(model, x, train=train)
    got, stats = compile_and_count(model, x, train=train)
    assert stats == block_counts(variant)
    assert fusionpass.stats() == {FUSION: 3}
    assert near_misses() == []
    assert_outcomes_close(got, expected, dtype)
    if train:
        # the input and every parameter (norm weights included) got a gradient
        assert set(got.grads) == {"input0", *(name for name, _ in model.named_parameters())}


@pytest.mark.parametrize("add", [torch.add, lambda a, b: a.add(b)], ids=["torch.add", "Tensor.add"])
def test_residual_add_spellings(add):
    model = block(LlamaRMSNorm, FP32, add=add)
    x = inputs(FP32)
    got, stats = compile_and_count(model, x, train=True)
    assert stats == block_counts("llama")
    assert_outcomes_close(got, eager(model, x, train=True), FP32)


class Autocast(nn.Module):
    """`inner` under bf16 autocast: the HF Trainer's bf16=True over fp32 weights."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        with torch.autocast("cpu", dtype=BF16):
            return self.inner(*args)


@pytest.mark.parametrize("make_norm, variant", [(LlamaRMSNorm, "llama"), (torch_rms_norm, "torch_rms_norm")],
                         ids=["llama", "nn.RMSNorm"])
def test_autocast_residual_stream_fuses_the_add(make_norm, variant):
    """Under autocast each projection's output is bf16 and the residual stream fp32: their fp32
    sum is fused as in an fp32 model, in both operand orders, and every gradient keeps its dtype."""
    model = Autocast(block(make_norm, FP32))
    x = inputs(FP32)
    got, stats = compile_and_count(model, x, train=True)
    assert stats == block_counts(variant), near_misses()
    assert near_misses() == []
    assert got.outputs[0].dtype == FP32
    assert_outcomes_close(got, eager(model, x, train=True), BF16)


def test_norm_without_residual_alone():
    """The first layer's norm (its input is not an add) is fused without the add."""
    norm = LlamaRMSNorm().to(BF16)
    x = inputs(BF16)
    got, stats = compile_and_count(norm, x, train=True)
    assert stats == counts(llama_no_residual=1)
    assert_outcomes_close(got, eager(norm, x, train=True), BF16)


def test_torch_rms_norm_weight_in_fp32_with_half_input():
    """nn.RMSNorm kept in fp32 under a bf16 input (mixed precision without casting the norm):
    torch multiplies the fp32 statistics by the fp32 weight and casts once, as the kernel does."""
    model = ResidualNorm(torch_rms_norm())
    x, r = inputs(BF16), inputs(BF16)
    expected = eager(model, x, r, train=True)
    got, stats = compile_and_count(model, x, r, train=True)
    assert stats == counts(torch_rms_norm=1)
    assert_outcomes_close(got, expected, BF16)


def test_torch_rms_norm_over_two_dims_is_a_near_miss():
    """normalized_shape of two dimensions: the kernel normalizes rows, so the call stays."""
    norm = nn.RMSNorm((8, WIDTH), eps=EPS)
    x = inputs(FP32)
    got, stats = compile_and_count(norm, x, train=True)
    assert stats == {}
    assert [m[2] for m in near_misses()] == [
        "torch.rms_norm over more than the last dimension (the kernel normalizes rows)"
    ]
    assert_outcomes_close(got, eager(norm, x, train=True), FP32)


def test_torch_rms_norm_order_read_from_torch():
    """This torch applies rms_norm's weight before the downcast (its _fused_rms_norm
    decomposition); the variant reads the order from torch rather than assuming it."""
    from fusionpass.fusions.rms_norm_residual import pattern as rms_norm

    assert rms_norm.torch_rms_norm_weight_after_cast() is False


def test_sum_returned_for_next_residual():
    """norm(x + r) and the sum x + r itself, both outputs of the graph: one fused op, both
    gradients flow into x and r."""
    model = ResidualNorm(LlamaRMSNorm()).to(BF16)
    x, r = inputs(BF16), inputs(BF16)
    got, stats = compile_and_count(model, x, r, train=True)
    assert stats == counts(llama=1)
    assert_outcomes_close(got, eager(model, x, r, train=True), BF16)


def test_inputs_of_odd_shape():
    """2-D input, 5 rows, another eps."""
    norm = LlamaRMSNorm(eps=1e-5)
    model = ResidualNorm(norm)
    x, r = torch.randn(5, WIDTH), torch.randn(5, WIDTH)
    got, stats = compile_and_count(model, x, r, train=True)
    assert stats == counts(llama=1)
    assert_outcomes_close(got, eager(model, x, r, train=True), FP32)


def test_broadcast_add_is_not_a_residual():
    """norm(h + bias): the add is not a residual of two rows (the bias broadcasts); the norm is
    fused without it and the add stays in the graph."""

    class BiasNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = nn.Parameter(torch.randn(WIDTH))
            self.norm = LlamaRMSNorm()

        def forward(self, x):
            return self.norm(x + self.bias)

    model = BiasNorm().to(BF16)
    x = inputs(BF16)
    got, stats = compile_and_count(model, x, train=True)
    assert stats == counts(llama_no_residual=1)
    assert_outcomes_close(got, eager(model, x, train=True), BF16)


def test_two_norms_of_one_sum():
    """Parallel blocks read one residual sum with two norms: the first fuses the add and hands
    the sum to the second."""

    class Parallel(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm_a, self.norm_b = LlamaRMSNorm(), LlamaRMSNorm()

        def forward(self, x, r):
            h = x + r
            return self.norm_a(h), self.norm_b(h), h

    model = Parallel().to(BF16)
    x, r = inputs(BF16), inputs(BF16)
    got, stats = compile_and_count(model, x, r, train=True)
    assert stats == counts(llama=1, llama_no_residual=1)
    assert_outcomes_close(got, eager(model, x, r, train=True), BF16)


# ---------------------------------------------------------------------------------------------
# dynamic shapes


class EmbeddedBlock(nn.Module):
    """Token ids -> embedding -> PreNormBlock: the row width comes from a parameter, as in real
    models, so it stays static under dynamic=True."""

    def __init__(self, make_norm, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.block = PreNormBlock(make_norm)

    def forward(self, ids):
        return self.block(self.embed(ids))


def ids(batch=2, seq=8, vocab=64):
    return torch.randint(0, vocab, (batch, seq))


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_dynamic_true(train):
    """dynamic=True: eps becomes a graph input (a SymFloat) and Dynamo restarts analysis once; the
    counts are still one graph's, and other batch/sequence sizes reuse the compiled graph."""
    model = EmbeddedBlock(LlamaRMSNorm)
    x = ids(seq=8)
    with compiling():
        compiled = torch.compile(model, backend=make_backend(), dynamic=True, fullgraph=True)
        got = run(compiled, model, (x,), train)
        assert fusionpass.stats(variants=True) == block_counts("llama")
        assert near_misses() == []
        assert_outcomes_close(got, eager(model, x, train=train), FP32)
        for batch, seq in [(2, 12), (3, 5)]:
            y = ids(batch=batch, seq=seq)
            assert_outcomes_close(run(compiled, model, (y,), train), eager(model, y, train=train))
        # no recompile: our pass would have run (and counted) again
        assert fusionpass.stats(variants=True) == block_counts("llama")


def test_dynamic_true_width_of_a_graph_input():
    """dynamic=True makes every dim of a float graph input symbolic, the width too; the linear
    with its (512, 512) weight then specializes it to 512. norm1, which reads the input directly,
    should still match."""
    model = block(LlamaRMSNorm, FP32)
    x = inputs(FP32, seq=8)
    got, stats = compile_and_count(model, x, dynamic=True)
    assert_outcomes_close(got, eager(model, x), FP32)
    assert near_misses() == []
    assert stats == block_counts("llama")


def test_mark_dynamic_batch_and_sequence():
    model = block(GemmaRMSNorm, BF16)
    x = inputs(BF16, seq=8)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    with compiling():
        compiled = torch.compile(model, backend=make_backend(), fullgraph=True)
        got = run(compiled, model, (x,), True)
        assert fusionpass.stats(variants=True) == block_counts("gemma")
        assert_outcomes_close(got, eager(model, x, train=True), BF16)
        y = inputs(BF16, batch=3, seq=13)
        assert_outcomes_close(run(compiled, model, (y,), True), eager(model, y, train=True), BF16)
        # batch and sequence were dynamic: no recompile, no second count
        assert fusionpass.stats(variants=True) == block_counts("gemma")


# ---------------------------------------------------------------------------------------------
# near misses: recognised, not safe, left alone with a reason


class EpsTensorRMSNorm(LlamaRMSNorm):
    def __init__(self):
        super().__init__()
        self.register_buffer("eps_tensor", torch.tensor(EPS))

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps_tensor)
        return self.weight * hidden_states.to(input_dtype)


class ReturnsRstd(LlamaRMSNorm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        rstd = torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * (hidden_states * rstd).to(input_dtype), rstd


class ReturnsVariance(LlamaRMSNorm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype), variance


class ReturnsNormalized(LlamaRMSNorm):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        normalized = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * normalized.to(input_dtype), normalized


class Transposed(nn.Module):
    """The norm reads a tensor whose last dimension is not contiguous."""

    def __init__(self):
        super().__init__()
        self.norm = LlamaRMSNorm()

    def forward(self, x):
        return self.norm(x.transpose(1, 2))


def _fp32_weight_bf16_input():
    norm = LlamaRMSNorm().to(BF16)
    norm.weight = nn.Parameter(norm.weight.detach().float())  # output would be fp32
    return ResidualNorm(norm), (inputs(BF16), inputs(BF16))


def _broadcast_weight():
    norm = LlamaRMSNorm()
    norm.weight = nn.Parameter(norm.weight.detach().reshape(1, WIDTH))
    return ResidualNorm(norm), (inputs(FP32), inputs(FP32))


NEAR_MISSES = [
    # (id, model and inputs, reason contains)
    ("weight-dtype", _fp32_weight_bf16_input,
     "dtype: output dtype torch.float32 differs from input dtype torch.bfloat16"),
    ("eps-tensor", lambda: (ResidualNorm(EpsTensorRMSNorm()), (inputs(FP32), inputs(FP32))),
     "eps is a tensor"),
    ("weight-shape-1xW", _broadcast_weight,
     f"weight_shape: weight of shape (1, {WIDTH}) is not one value per channel ({WIDTH},)"),
    ("width-256", lambda: (ResidualNorm(LlamaRMSNorm(width=256)), (inputs(FP32, width=256),) * 2),
     "width: row width 256 outside 512.."),
    ("rstd-returned", lambda: (ReturnsRstd(), (inputs(FP32),)), "rstd has other users"),
    ("variance-returned", lambda: (ReturnsVariance(), (inputs(FP32),)),
     "intermediates: intermediate variance is used elsewhere"),
    # n (fp32) also returned: only the no-weight form could take n as its output, and n's dtype
    # is not the input's
    ("normalized-returned-bf16", lambda: (ReturnsNormalized().to(BF16), (inputs(BF16),)),
     "dtype: output dtype torch.float32 differs from input dtype torch.bfloat16"),
    ("last-dim-strided", lambda: (Transposed(), (torch.randn(2, WIDTH, 8),)),
     "strides: transpose is not contiguous in its last dimension"),
]


@pytest.mark.parametrize(
    "build, reason", [c[1:] for c in NEAR_MISSES], ids=[c[0] for c in NEAR_MISSES]
)
def test_near_miss(build, reason):
    model, args = build()
    expected = eager(model, *args)
    got, stats = compile_and_count(model, *args)
    assert stats == {}
    misses = near_misses()
    assert len(misses) == 1, misses
    fusion, where, why = misses[0]
    assert fusion == FUSION
    assert reason in why, why
    assert where  # a module path or a node name
    dtype = args[0].dtype
    assert_outcomes_close(got, expected, dtype)


def test_normalized_returned_fp32_fuses_the_norm_without_weight():
    """In fp32, n = x * rstd is itself a valid no-weight RMSNorm output: it is fused as such and
    the weight multiply stays in the graph, reading the fused op's output."""
    model = ReturnsNormalized()
    x = inputs(FP32)
    gm, _, record = fused_graph(model, x)
    assert record.matches == {(FUSION, "no_weight_no_residual"): 1}
    # the weight multiply reads the fused op's output
    (fused,) = [n for n in gm.graph.nodes if n.target is torch.ops.fusionpass.rms_norm.default]
    (y,) = [u for u in fused.users if u.args[1] == 0]
    assert {str(u.target) for u in y.users} >= {"to"}
    got, stats = compile_and_count(model, x, train=True)
    assert stats == counts(no_weight_no_residual=1)
    assert_outcomes_close(got, eager(model, x, train=True), FP32)


def test_near_miss_reports_module_path():
    _, _, record = fused_graph(block(LlamaRMSNorm, FP32), inputs(FP32), rms_norm_min_width=1024)
    assert sorted(w for _, w, _ in record.near_misses) == ["norm1", "norm2", "norm3"]
    assert all("row width 512 outside 1024.." in why for _, _, why in record.near_misses)


def test_width_threshold_is_configurable():
    model = block(lambda: LlamaRMSNorm(width=256), FP32, width=256)
    x = inputs(FP32, width=256)
    _, stats = compile_and_count(model, x)
    assert stats == {}
    assert len(near_misses("width: row width 256 outside 512..")) == 3
    got, stats = compile_and_count(model, x, train=True, rms_norm_min_width=64)
    assert stats == block_counts("llama")
    assert near_misses() == []
    assert_outcomes_close(got, eager(model, x, train=True), FP32)


def test_cpu_graph_left_alone_by_default(monkeypatch):
    monkeypatch.delenv("FUSIONPASS_CPU", raising=False)
    model = block(LlamaRMSNorm, FP32)
    x = inputs(FP32)
    got, stats = compile_and_count(model, x, backend=fusionpass.backend())
    assert stats == {}
    misses = near_misses()
    assert len(misses) == 3
    assert all(why.startswith("device: device cpu") for _, _, why in misses), misses
    assert_outcomes_close(got, eager(model, x), FP32)


def test_unmatched_rsqrt_is_reported():
    """An rsqrt that is not an RMSNorm (here: of a mean over the first dimension)."""

    class NotANorm(nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + EPS)

    x = inputs(FP32)
    got, stats = compile_and_count(NotANorm(), x)
    assert stats == {}
    assert [why for _, _, why in near_misses()] == [fusionpass.registry.registered()[FUSION].unmatched]
    assert_outcomes_close(got, eager(NotANorm(), x))


def test_disabled_fusion_is_not_tried():
    model = block(LlamaRMSNorm, FP32)
    _, stats = compile_and_count(model, inputs(FP32), fusions=[])
    assert stats == {} and near_misses() == []


# ---------------------------------------------------------------------------------------------
# the rewritten graph


class TestRewrittenGraph(expecttest.TestCase):
    def test_llama_block(self):
        model = block(LlamaRMSNorm, BF16)
        x = inputs(BF16)
        gm, out, record = fused_graph(model, x)
        self.assertEqual(record.matches, {(FUSION, "llama"): 2, (FUSION, "llama_no_residual"): 1})
        self.assertExpectedInline(graph_code(gm), """\
def forward(self, L_h_, L_self_modules_norm1_parameters_weight_, L_self_modules_proj1_parameters_weight_, L_self_modules_proj1_parameters_bias_, L_self_modules_norm2_parameters_weight_, L_self_modules_proj2_parameters_weight_, L_self_modules_proj2_parameters_bias_, L_self_modules_norm3_parameters_weight_):
    rms_norm_default = torch.ops.fusionpass.rms_norm.default(l_h_, l_self_modules_norm1_parameters_weight_, 1e-06, 0.0, True)
    getitem_1 = rms_norm_default[0]
    getitem = rms_norm_default[1]
    h = torch._C._nn.linear(getitem_1, l_self_modules_proj1_parameters_weight_, l_self_modules_proj1_parameters_bias_)
    rms_norm_residual_default = torch.ops.fusionpass.rms_norm_residual.default(l_h_, h, l_self_modules_norm2_parameters_weight_, 1e-06, 0.0, True)
    getitem_4 = rms_norm_residual_default[0]
    getitem_3 = rms_norm_residual_default[1]
    getitem_2 = rms_norm_residual_default[2]
    h_2 = torch._C._nn.linear(getitem_4, l_self_modules_proj2_parameters_weight_, l_self_modules_proj2_parameters_bias_)
    rms_norm_residual_default_1 = torch.ops.fusionpass.rms_norm_residual.default(h_2, getitem_3, l_self_modules_norm3_parameters_weight_, 1e-06, 0.0, True)
    getitem_7 = rms_norm_residual_default_1[0]
    getitem_6 = rms_norm_residual_default_1[1]
    getitem_5 = rms_norm_residual_default_1[2]
    return (getitem_7,)""")
        torch.testing.assert_close(out, model(x), rtol=RTOL[BF16], atol=RTOL[BF16])

    def test_gemma_residual_norm(self):
        model = ResidualNorm(GemmaRMSNorm())
        x, r = inputs(FP32), inputs(FP32)
        gm, out, record = fused_graph(model, x, r)
        self.assertEqual(record.matches, {(FUSION, "gemma"): 1})
        self.assertExpectedInline(graph_code(gm), """\
def forward(self, L_x_, L_r_, L_self_modules_norm_parameters_weight_):
    rms_norm_residual_default = torch.ops.fusionpass.rms_norm_residual.default(l_x_, l_r_, l_self_modules_norm_parameters_weight_, 1e-06, 1.0, False)
    getitem_2 = rms_norm_residual_default[0]
    getitem_1 = rms_norm_residual_default[1]
    getitem = rms_norm_residual_default[2]
    return (getitem_2, getitem_1)""")
        for a, e in zip(out, model(x, r)):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "width,train,reason",
    [
        (8192, True, None),
        (8192, False, None),
        (16384, True, "row width 16384 outside 2048..8192 in training"),
        (16384, False, "row width 16384 outside 2048..8192 in inference"),
        (3072, True, None),
        (3072, False, "row width 3072 in 2049..4095 in inference (the forward's second chunk is partial)"),
    ],
)
def test_width_rule_by_mode(width, train, reason):
    """Both modes take rows up to 8192, inference not 2049..4095 (fusions/rms_norm_residual/
    pattern.py WIDTH and PARTIAL_CHUNK; the measured rule opened, as conftest.py does). The rule is
    read from the graph: no_grad makes it inference."""

    class AddNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = LlamaRMSNorm(width)

        def forward(self, x, r):
            h = x + r
            return self.norm(h), h

    x, r = inputs(FP32, batch=1, seq=2, width=width), inputs(FP32, batch=1, seq=2, width=width)
    with torch.set_grad_enabled(train):
        _, _, record = fused_graph(AddNorm(), x, r, fusions=[FUSION], rms_norm_min_width=2048)
    if reason is None:
        assert record.near_misses == [] and sum(record.matches.values()) == 1
    else:
        assert record.matches == {}
        assert record.near_misses and all(reason in why for _, _, why in record.near_misses)


@pytest.mark.parametrize("width", [1024, 2048, 4096, 8192])
@pytest.mark.parametrize("train", [True, False])
def test_measured_rule_selects_where_the_table_says_faster(width, train):
    """At the default min_speedup (1), a width is fused where its nearest measured class in the
    fusion's cost_table.py was faster than plain compile, and the near miss cites the table."""
    from fusionpass.cost import mode
    from fusionpass.fusions.rms_norm_residual.pattern import MEASURED

    (_, speedup) = MEASURED.nearest(width, mode(train))
    x = inputs(FP32, batch=1, seq=2, width=width)
    with torch.set_grad_enabled(train):
        _, _, record = fused_graph(block(lambda: LlamaRMSNorm(width=width), FP32, width=width), x,
                                   fusions=[FUSION], rms_norm_min_width=1, rms_norm_min_speedup=1.0)
    assert (sum(record.matches.values()) > 0) == (speedup >= 1.0)
    if speedup < 1.0:
        assert all("the nearest measured" in why and "rms_norm_widths.md" in why for _, _, why in record.near_misses)


def test_not_selected_in_training_while_inductor_autotunes():
    # the cost rule NotAutotuned (fusionpass.cost): read from Inductor's config, which
    # torch.compile's max-autotune modes set while the pass runs
    model = block(LlamaRMSNorm, FP32)
    x = inputs(FP32)
    with torch._inductor.config.patch(max_autotune=True, max_autotune_gemm_backends="ATEN"):
        got, stats = compile_and_count(model, x, train=True)
        assert stats == {}
        assert {m[0] for m in near_misses()} == {FUSION}
        assert all("cost: Inductor autotunes (max-autotune) in training" in m[2] for m in near_misses())
        assert_outcomes_close(got, eager(model, x, train=True), FP32)
        compile_and_count(model, x, train=False)  # inference is not under the rule
        assert fusionpass.stats() == {FUSION: 3}
