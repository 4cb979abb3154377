"""swiglu_mlp: the gated MLPs of HF Llama/Qwen2 (SiLU), Gemma (GELU-tanh) and Phi-3 (fused gate_up
+ chunk) are matched when opted in (FUSIONPASS_SWIGLU_MLP_KERNEL=1), counted per variant, and
compute what eager / plain torch.compile compute, forward and backward; off by default, mixed
dtypes (a cast between the pieces) and a product used elsewhere are near misses; autocast over
fp32 weights matches."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    assert_outcomes_close,
    compile_and_count,
    compiling,
    eager,
    near_misses,
    run,
)
from torch import nn

FUSION = "swiglu_mlp"
K, N = 40, 24  # hidden, intermediate: not multiples of the kernel blocks
FP32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def _opt_in(monkeypatch):
    monkeypatch.setenv("FUSIONPASS_SWIGLU_MLP_KERNEL", "1")


class GatedMLP(nn.Module):
    """HF Llama/Qwen2 (`silu`) and Gemma (`gelu_tanh`) spelling."""

    def __init__(self, act="silu", bias=False, leak=False):
        super().__init__()
        self.gate_proj = nn.Linear(K, N, bias=bias)
        self.up_proj = nn.Linear(K, N, bias=bias)
        self.down_proj = nn.Linear(N, K, bias=False)
        self.act, self.leak = act, leak

    def forward(self, x):
        g = self.gate_proj(x)
        a = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")
        h = a * self.up_proj(x)
        out = self.down_proj(h)
        return (out, h.sum(-1)) if self.leak else out


class Phi3MLP(nn.Module):
    """HF Phi-3: `gate_up_proj` then chunk, `up * act(gate)`."""

    def __init__(self, bias=False):
        super().__init__()
        self.gate_up_proj = nn.Linear(K, 2 * N, bias=bias)
        self.down_proj = nn.Linear(N, K, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


CASES = {
    "silu": (lambda b: GatedMLP("silu", b), "silu"),
    "gelu_tanh": (lambda b: GatedMLP("gelu_tanh", b), "gelu_tanh"),
    "phi3": (lambda b: Phi3MLP(b), "silu_gate_up"),
}


# training: the default puts the down projection in the op (swiglu_down); without recompute the op
# returns h for the library down projection (fusionpass::swiglu's training path)
@pytest.mark.parametrize("train,recompute", [(False, True), (True, True), (True, False)],
                         ids=["inference", "training", "training_keep_h"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("case", list(CASES))
def test_forms_match_and_agree(case, bias, train, recompute):
    make, variant = CASES[case]
    mlp = make(bias)
    x = torch.randn(2, 5, K)
    got, stats = compile_and_count(mlp, x, fusions=[FUSION], train=train,
                                   swiglu_mlp_recompute_product=recompute)
    assert stats == {(FUSION, variant): 1}
    assert near_misses() == []
    assert_outcomes_close(got, eager(mlp, x, train=train), rtol=1e-4)


def test_large_m_regime_training():
    """More than 64 rows: library GEMMs + the fused act*mul kernel; gradients agree."""
    mlp = GatedMLP("gelu_tanh", bias=True)
    x = torch.randn(3, 30, K)
    got, stats = compile_and_count(mlp, x, fusions=[FUSION], train=True)
    assert stats == {(FUSION, "gelu_tanh"): 1}
    assert_outcomes_close(got, eager(mlp, x, train=True), rtol=1e-4)


def test_bf16_agrees_with_plain_compile():
    mlp = GatedMLP("silu").to(BF16)
    x = torch.randn(1, 4, K, dtype=BF16)
    got, stats = compile_and_count(mlp, x, fusions=[FUSION], train=True)
    assert stats == {(FUSION, "silu"): 1}
    with compiling():
        expected = run(torch.compile(mlp, backend="inductor", fullgraph=True), mlp, (x,), train=True)
    assert_outcomes_close(got, expected, BF16)


@pytest.mark.parametrize("rows,train,settings,why", [
    (6, False, {}, None),  # decode-sized inference: selected by default
    (65, True, {}, None),  # training: selected by default, with the down projection (recompute)
    (6, True, {"swiglu_mlp_recompute_product": False}, "cost: not selected in training; swiglu_mlp_kernel=True"),
    (65, False, {}, "cost: rows 65 > 64 in inference; swiglu_mlp_kernel=True"),
])
def test_default_cost_rule(monkeypatch, rows, train, settings, why):
    monkeypatch.delenv("FUSIONPASS_SWIGLU_MLP_KERNEL")
    mlp = GatedMLP().train(train)
    x = torch.randn(rows, K)
    with torch.set_grad_enabled(train):
        got, stats = compile_and_count(mlp, x, fusions=[FUSION], train=train, **settings)
        want = eager(mlp, x, train=train)
    if why is None:
        assert stats == {(FUSION, "silu"): 1} and near_misses() == []
    else:
        assert stats == {}
        [(fusion, _, reason)] = near_misses()
        assert fusion == FUSION and reason.startswith(why), reason
    assert_outcomes_close(got, want)


@pytest.mark.parametrize("rows", [6, 65])
def test_inference_rows_under_dynamic_shapes(monkeypatch, rows):
    # symbolic rows (2.., unbounded) may be decode-sized, and above that size the op runs the library
    # GEMMs itself: selected whatever the hint, and exact at every row count the graph then takes
    monkeypatch.delenv("FUSIONPASS_SWIGLU_MLP_KERNEL")
    mlp = GatedMLP().eval()
    x = torch.randn(rows, K)
    torch._dynamo.mark_dynamic(x, 0)
    with torch.no_grad():
        got, stats = compile_and_count(mlp, x, fusions=[FUSION])
        assert stats == {(FUSION, "silu"): 1} and near_misses() == []
        assert_outcomes_close(got, eager(mlp, x))


def test_autocast_over_fp32_weights_matches():
    """Under autocast the linears read fp32 x and weights and return bf16; the autocast casts
    written before matching (patterns/autocast.py) make every input of the MLP bf16, so it fuses
    and computes what eager computes under autocast, gradients in the fp32 weights' dtype."""

    class Autocast(GatedMLP):
        def forward(self, x):
            with torch.autocast("cpu", dtype=BF16):
                return super().forward(x)

    mlp = Autocast()
    x = torch.randn(2, 3, K)
    got, stats = compile_and_count(mlp, x, fusions=[FUSION])
    assert stats == {(FUSION, "silu"): 1}
    assert near_misses() == []
    expected = eager(mlp, x)
    assert got.outputs[0].dtype == expected.outputs[0].dtype == BF16
    assert all(g.dtype == FP32 for g in got.grads.values() if g is not None)
    assert_outcomes_close(got, expected, BF16)


def test_cast_between_pieces_near_miss():
    class Cast(GatedMLP):
        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x).float()) * self.up_proj(x))

    _, stats = compile_and_count(Cast(), torch.randn(2, 3, K), fusions=[FUSION])
    assert stats == {}
    assert len(near_misses()) == 1


def test_product_used_elsewhere_near_miss():
    mlp = GatedMLP(leak=True)
    x = torch.randn(2, 3, K)
    got, stats = compile_and_count(mlp, x, fusions=[FUSION])
    assert stats == {}
    [(_, _, why)] = near_misses()
    assert why.startswith("down_projection:")
    assert_outcomes_close(got, eager(mlp, x))


def test_exact_gelu_near_miss():
    class ExactGelu(GatedMLP):
        def forward(self, x):
            return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))

    _, stats = compile_and_count(ExactGelu(), torch.randn(2, 3, K), fusions=[FUSION])
    assert stats == {}
    [(_, _, why)] = near_misses()
    assert why.startswith("activation:")


# ---------------------------------------------------------------------------------------------
# tiny Hugging Face models (transformers' own MLP modules)

HF_VARIANTS = {"llama": "silu", "qwen2": "silu", "gemma": "gelu_tanh", "phi3": "silu_gate_up"}


def _tiny_hf(name, layers=1):
    pytest.importorskip("transformers")
    from fusionpass.demo import tiny_hf

    return tiny_hf(name, layers=layers, width=64, num_key_value_heads=1, intermediate_size=96)


@pytest.mark.parametrize("name", list(HF_VARIANTS))
def test_tiny_hf_mlp(name):
    mlp = _tiny_hf(name).model.layers[0].mlp
    x = torch.randn(2, 3, 64)
    got, stats = compile_and_count(mlp, x, fusions=[FUSION], train=True)
    assert stats == {(FUSION, HF_VARIANTS[name]): 1}
    assert near_misses() == []
    assert_outcomes_close(got, eager(mlp, x, train=True), rtol=1e-4)


def test_tiny_hf_llama_one_match_per_layer():
    model = _tiny_hf("llama", layers=2).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    kwargs = {"use_cache": False}
    got, stats = compile_and_count(model, ids, fusions=[FUSION], kwargs=kwargs)
    assert stats == {(FUSION, "silu"): 2}
    assert near_misses() == []
    assert_outcomes_close(got, eager(model, ids, kwargs=kwargs), rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# swiglu_mlp_recompute_product (the training default): the down projection in the op


def _saved_shapes(fn, x) -> list[tuple[int, ...]]:
    """The shapes autograd keeps for the backward of one call of `fn` (compiled already)."""
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(tuple(t.shape)) or t, lambda t: t):
        fn(x)
    return seen


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("case,bias", [("silu", True), ("gelu_tanh", False), ("phi3", False)])
def test_recompute_product_training(monkeypatch, case, bias, dtype):
    """The down projection joins the op, gradients equal plain compile's, and no [rows, N]
    tensor beyond g and u is kept for the backward (plain compile keeps h too)."""
    monkeypatch.delenv("FUSIONPASS_SWIGLU_MLP_KERNEL")
    make, variant = CASES[case]
    torch.manual_seed(0)
    mlp = make(bias).to(dtype)
    if bias:
        mlp.down_proj.bias = nn.Parameter(torch.randn(K, dtype=dtype))
    x = torch.randn(3, 29, K, dtype=dtype)  # 87 rows: the library-GEMM regime
    got, stats = compile_and_count(mlp, x, fusions=[FUSION], train=True)
    assert stats == {(FUSION, variant): 1}
    assert near_misses() == []
    with compiling():
        expected = run(torch.compile(mlp, backend="inductor", fullgraph=True), mlp, (x,), train=True)
        plain_saved = _saved_shapes(torch.compile(mlp, backend="inductor", fullgraph=True), x.requires_grad_())
    assert_outcomes_close(got, expected, dtype, rtol=1e-4 if dtype == FP32 else None)
    import fusionpass
    from helpers import make_backend

    with compiling():
        ours = torch.compile(mlp, backend=make_backend([FUSION]), fullgraph=True)
        ours(x)
        ours_saved = _saved_shapes(ours, x)
    assert fusionpass.stats()
    rows = x.numel() // K

    def ffn_wide(shapes):  # elements of the kept [rows, N] activations (Phi-3's g, u: one [rows, 2N])
        return sum(torch.Size(s).numel() for s in shapes
                   if s[-1] in (N, 2 * N) and torch.Size(s[:-1]).numel() == rows)

    assert ffn_wide(plain_saved) >= 3 * rows * N and ffn_wide(ours_saved) == 2 * rows * N, (
        plain_saved, ours_saved)


def test_recompute_product_not_in_inference(monkeypatch):
    """Inference keeps the default cost rule (the setting is about what training keeps)."""
    monkeypatch.delenv("FUSIONPASS_SWIGLU_MLP_KERNEL")
    mlp = GatedMLP("silu")
    x = torch.randn(3, 29, K)
    _, stats = compile_and_count(mlp, x, fusions=[FUSION], train=False)
    assert stats == {}
    assert [m[2].split(";")[0] for m in near_misses()] == ["cost: rows 87 > 64 in inference"]


def test_only_a_factor_of_2_31_stays_with_inductor():
    # torch 2.11's Inductor cannot compile a Triton launch given a static integer >= 2^31; the
    # act·mul kernels take rows and width, so a product of more elements than that still matches
    # (8B widths at S=180224 were failing when the kernels took the count)
    from types import SimpleNamespace

    from fusionpass.fusions.swiglu_mlp import pattern as swiglu

    graph = torch.fx.Graph()
    h = graph.placeholder("h")
    for shape, fits in (((180224, 14336), True), ((1, 2**31, 1), False), ((2, 2**31), False)):
        h.meta["val"] = torch.empty(shape, device="meta", dtype=torch.bfloat16)
        why = swiglu.factors_fit_int32(SimpleNamespace(bindings={"h": h}), None)
        assert (why is None) == fits, (shape, why)
    assert "width 2147483648 over 2^31 - 1" in why
