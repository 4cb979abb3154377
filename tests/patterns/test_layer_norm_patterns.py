"""layer_norm_dropout_residual: every way model families write "dropout, add the residual,
LayerNorm" is matched, counted per variant, and computes what eager and plain torch.compile
compute (exactly with p = 0; with p > 0 the dropout is checked through its mask: keep rate, fresh
masks per call and per layer, and gradients against a reference built from the seed the graph
drew); what must not be matched is left alone with a near-miss reason.

The blocks below are written the way each family writes them (transformers 5.x modeling files),
with the dropout probability as a module attribute.
"""
from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    RTOL,
    assert_outcomes_close,
    compile_and_count,
    compiling,
    eager,
    fused_graph,
    graph_code,
    make_backend,
    near_misses,
    run,
)
from torch import nn

import fusionpass
from fusionpass import config as config_mod
from fusionpass.fusions.layer_norm_dropout_residual.kernels import dropout_mask
from fusionpass.passes import STATISTICS, PreGradFusionPass

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

FUSION = "layer_norm_dropout_residual"
WIDTH = 64  # FUSIONPASS_LAYER_NORM_MIN_WIDTH in conftest.py
P = 0.1
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


def counts(**variants) -> dict:
    return {(FUSION, v): n for v, n in variants.items() if n}


def compile_ln(module, *inputs, **kw):
    return compile_and_count(module, *inputs, fusions=[FUSION], **kw)


# ---------------------------------------------------------------------------------------------
# blocks, written as the model families write them


class BertOutput(nn.Module):
    """BERT/RoBERTa/ELECTRA SelfOutput and Output: post-LN, the sum is private."""

    def __init__(self, p=P, width=WIDTH, **ln):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.LayerNorm = nn.LayerNorm(width, eps=1e-12, **ln)
        self.dropout = nn.Dropout(p)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class Bert(nn.Module):
    """Two post-LN blocks in a row: the second one's residual is the first one's output."""

    def __init__(self, p=P, width=WIDTH):
        super().__init__()
        self.attention_output = BertOutput(p, width)
        self.output = BertOutput(p, width)

    def forward(self, x):
        h = self.attention_output(x, x)
        return self.output(h, h)


class GPT2(nn.Module):
    """GPT-2: dropped embeddings, pre-LN blocks (`attn + residual`, then `residual + mlp`) and
    ln_f."""

    def __init__(self, p=P, width=WIDTH):
        super().__init__()
        self.drop = nn.Dropout(p)
        self.ln_1, self.ln_2, self.ln_f = (nn.LayerNorm(width) for _ in range(3))
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Linear(width, width)
        self.resid_dropout = nn.Dropout(p)

    def forward(self, x):
        hidden_states = self.drop(x)
        residual = hidden_states
        attn_output = self.resid_dropout(self.attn(self.ln_1(hidden_states)))
        hidden_states = attn_output + residual
        residual = hidden_states
        feed_forward = self.resid_dropout(self.mlp(self.ln_2(hidden_states)))
        hidden_states = residual + feed_forward
        return self.ln_f(hidden_states)


def dropout_add(x, residual, prob: float, training: bool):
    """BLOOM/Falcon's helper: keyword dropout, residual first."""
    out = F.dropout(x, p=prob, training=training)
    return residual + out


class Bloom(nn.Module):
    """BLOOM: input_layernorm reads the (plain) input; dropout_add feeds the next LayerNorm."""

    def __init__(self, p=P, width=WIDTH):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm, self.ln_f = (
            nn.LayerNorm(width) for _ in range(3)
        )
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Linear(width, width)
        self.hidden_dropout = p

    def forward(self, hidden_states):
        residual = hidden_states
        attn = self.attn(self.input_layernorm(hidden_states))
        out = dropout_add(attn, residual, self.hidden_dropout, self.training)
        mlp = self.mlp(self.post_attention_layernorm(out))
        out = dropout_add(mlp, out, self.hidden_dropout, self.training)
        return self.ln_f(out)


class OPT(nn.Module):
    """OPT's decoder layer: the MLP runs on [B*S, W] (reshape before final_layer_norm), the sum
    is viewed back to [B, S, W] before the decoder's final LayerNorm."""

    def __init__(self, p=P, width=WIDTH):
        super().__init__()
        self.self_attn_layer_norm, self.final_layer_norm, self.decoder_norm = (
            nn.LayerNorm(width) for _ in range(3)
        )
        self.attn = nn.Linear(width, width)
        self.fc = nn.Linear(width, width)
        self.dropout = p

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.attn(self.self_attn_layer_norm(hidden_states))
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        residual = hidden_states
        hidden_states = self.fc(self.final_layer_norm(hidden_states))
        hidden_states = F.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = (residual + hidden_states).view(shape)
        return self.decoder_norm(hidden_states)


class Parallel(nn.Module):
    """GPT-NeoX with use_parallel_residual: two LayerNorms of one input, h = mlp + attn + h."""

    def __init__(self, p=P, width=WIDTH, layers=2):
        super().__init__()
        self.emb_dropout = nn.Dropout(p)
        self.ln1 = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.attn = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.final = nn.LayerNorm(width)
        self.p = p

    def forward(self, x):
        h = self.emb_dropout(x)
        for ln1, ln2, attn, mlp in zip(self.ln1, self.ln2, self.attn, self.mlp):
            a = F.dropout(attn(ln1(h)), self.p, self.training)
            m = F.dropout(mlp(ln2(h)), self.p, self.training)
            h = m + a + h
        return self.final(h)


def inputs(dtype=FP32, batch=2, seq=8, width=WIDTH):
    return torch.randn(batch, seq, width).to(dtype)


def _init(model):
    torch.manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm) and m.weight is not None:
            nn.init.normal_(m.weight, 1.0, 0.2)
            if m.bias is not None:
                nn.init.normal_(m.bias, 0.0, 0.2)
    return model


# (id, model factory(p), train counts with p > 0, eval counts, near misses (train and eval))
FAMILIES = [
    ("bert", Bert, counts(dropout_residual=2), counts(residual=2), 0),
    ("gpt2", GPT2, counts(dropout=1, dropout_residual=2), counts(residual=2), 0),
    ("bloom", Bloom, counts(dropout_residual=2), counts(residual=2), 0),
    ("opt", OPT, counts(dropout_residual=2), counts(residual=2), 0),
    # layer 0's ln1 fuses the embedding dropout; the three-term sums stay with Inductor
    ("gpt-neox-parallel", Parallel, counts(dropout=1), {}, 3),
]


class Embeddings(nn.Module):
    """RoBERTa's embeddings: LayerNorm((word + token type) + position), each a lookup."""

    def __init__(self, width=WIDTH, vocab=32, positions=16):
        super().__init__()
        self.word, self.token_type = nn.Embedding(vocab, width), nn.Embedding(2, width)
        self.position = nn.Embedding(positions, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, ids):
        token_types = torch.zeros_like(ids)
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        return self.norm(self.word(ids) + self.token_type(token_types) + self.position(positions))


def test_a_sum_of_embeddings_is_named_as_one():
    """The embeddings' LayerNorm is left to Inductor for the reason a parallel block's is (the inner
    sum would be written for the kernel), and its near miss says what the sum is; a parallel
    block's says parallel attention + MLP."""
    compile_ln(Embeddings().eval(), torch.randint(0, 32, (2, 8)))
    (miss,) = [why for _, _, why in near_misses()]
    assert miss.startswith("parallel_residual:") and "a sum of embeddings" in miss, miss
    compile_ln(_init(Parallel(0.0)).eval(), inputs())
    assert near_misses() and all("parallel attention + MLP" in why for _, _, why in near_misses())


@pytest.mark.parametrize(
    "make, train_counts, eval_counts, misses", [f[1:] for f in FAMILIES], ids=[f[0] for f in FAMILIES]
)
def test_family_forms(make, train_counts, eval_counts, misses):
    """Training with p > 0: exact counts, every gradient present; inference: exact counts and
    eager's outputs (its dropouts are identities)."""
    model = _init(make(P)).train()
    x = inputs()
    got, stats = compile_ln(model, x, train=True)
    assert stats == train_counts
    assert len(near_misses()) == misses
    assert all("parallel_residual:" in why for _, _, why in near_misses())
    assert set(got.grads) == {"input0", *(n for n, _ in model.named_parameters())}
    assert all(torch.isfinite(g).all() for g in got.grads.values())

    model.eval()
    got, stats = compile_ln(model, x)
    assert stats == eval_counts
    assert len(near_misses()) == misses
    assert_outcomes_close(got, eager(model, x), FP32)


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
def test_p0_equals_plain_compile(dtype, train):
    """With p = 0 (dropout an identity) outputs and every gradient equal plain torch.compile's
    (GPT-2 and BERT forms: residual returned and private, both operand orders)."""

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2, self.bert = GPT2(0.0), BertOutput(0.0)

        def forward(self, x):
            h = self.gpt2(x)
            return self.bert(h, x)

    model = _init(Both()).to(dtype).train(train)
    x = inputs(dtype)
    got, stats = compile_ln(model, x, train=train)
    assert stats == counts(residual=3)
    assert near_misses() == []
    with compiling():
        plain = run(torch.compile(model, backend="inductor", fullgraph=True), model, (x,), train)
    assert_outcomes_close(got, plain, dtype)
    assert_outcomes_close(got, eager(model, x, train=train), dtype)


class Spellings(nn.Module):
    """torch.add / Tensor.add / torch.dropout / torch.layer_norm, LayerNorms without bias and
    without affine parameters, 2-D rows, an odd width."""

    def __init__(self, p=P, width=100):
        super().__init__()
        self.ln_a = nn.LayerNorm(width, bias=False)
        self.ln_b = nn.LayerNorm(width, elementwise_affine=False)
        self.ln_c = nn.LayerNorm(width)
        self.p = p

    def forward(self, x, r):
        h = torch.add(torch.dropout(x, self.p, self.training), r)
        a = self.ln_a(h)
        h = h.add(F.dropout(a, self.p, self.training))
        b = self.ln_b(h)
        c = torch.layer_norm(r + F.dropout(b, self.p, self.training), (100,), self.ln_c.weight,
                             self.ln_c.bias, 1e-6)
        return c, h


@pytest.mark.parametrize("train", [True, False], ids=["training", "inference"])
def test_spellings(train):
    model = _init(Spellings()).train(train)
    x, r = torch.randn(5, 100), torch.randn(5, 100)
    got, stats = compile_ln(model, x, r, train=train)
    assert stats == (counts(dropout_residual=3) if train else counts(residual=3))
    assert near_misses() == []
    if not train:
        assert_outcomes_close(got, eager(model, x, r), FP32)
    model.p = 0.0
    got, stats = compile_ln(model, x, r, train=True)
    assert stats == counts(residual=3)
    assert_outcomes_close(got, eager(model, x, r, train=True), FP32)


# ---------------------------------------------------------------------------------------------
# p > 0: the mask


class DropAddNorm(nn.Module):
    """LayerNorm(dropout(x) + r), the sum returned (so the mask can be read from it)."""

    def __init__(self, p, width=WIDTH):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.p = p

    def forward(self, x, r):
        h = F.dropout(x, self.p, self.training) + r
        return self.ln(h), h


class TwoLayers(nn.Module):
    """Two LayerNorms dropping the same x: each must draw its own mask."""

    def __init__(self, p, width=WIDTH):
        super().__init__()
        self.one, self.two = DropAddNorm(p, width), DropAddNorm(p, width)

    def forward(self, x, r):
        return (*self.one(x, r), *self.two(x, r))


def _keep_rate_ok(keep: torch.Tensor, p: float) -> bool:
    n = keep.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    return abs(keep.float().mean().item() - (1 - p)) < 5 * sigma


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_masks_keep_rate_fresh_per_call_and_per_layer(p):
    """Compiled with Inductor: 1 - p of the elements kept (5 sigma), scaled by 1 / (1 - p); every
    call and every layer draws a new mask; dx is zero exactly where dropped and dresidual scaled
    by the keep scale where kept."""
    model = TwoLayers(p).train()
    x = torch.randn(8, 32, WIDTH, requires_grad=True)
    r = torch.randn(8, 32, WIDTH, requires_grad=True)
    with compiling():
        compiled = torch.compile(model, backend=make_backend([FUSION]), fullgraph=True)
        y1, h1, _, h2 = compiled(x, r)
        assert fusionpass.stats(variants=True) == counts(dropout_residual=2)
        _, h1_again, _, _ = compiled(x, r)
    k1, k2, k1_again = (h != r for h in (h1, h2, h1_again))
    for k in (k1, k2, k1_again):
        assert _keep_rate_ok(k, p)
    scale = 1 / torch.tensor(1 - p, dtype=torch.float32).item()
    torch.testing.assert_close(h1[k1], (x * scale + r)[k1])
    for a, b in ((k1, k2), (k1, k1_again)):
        # independent masks agree on p^2 + (1 - p)^2 of the elements, not on all
        agree = (a == b).float().mean().item()
        assert abs(agree - (p * p + (1 - p) ** 2)) < 0.03, agree
    torch.autograd.backward([y1], [torch.randn_like(y1)])
    assert not x.grad[~k1].any()
    torch.testing.assert_close(x.grad[k1], r.grad[k1] * scale)


class _SeedRecorder(torch.fx.Interpreter):
    def __init__(self, gm, seeds):
        super().__init__(gm)
        self.seeds = seeds

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        if target is torch.randint:
            self.seeds.append(out)
        return out


def _run_recording_seeds(module, *inputs):
    """Run `module` through our pass without Inductor (the rewritten graph, eagerly): the outputs
    and the seed every fused op drew."""
    cfg = config_mod.make([FUSION], cpu=True)
    seeds = []

    def backend(gm, example_inputs):
        STATISTICS.reset()
        PreGradFusionPass(cfg)(gm.graph)
        gm.recompile()
        return lambda *args: _SeedRecorder(gm, seeds).run(*args)

    torch._dynamo.reset()
    try:
        out = torch.compile(module, backend=backend, fullgraph=True)(*inputs)
    finally:
        torch._dynamo.reset()
    return out, seeds, STATISTICS.records[-1]


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_gradients_against_reference_with_the_seeds_mask(dtype):
    """The rewritten graph run eagerly: its outputs and gradients equal float64 autograd of the
    model's formula with the mask `dropout_mask` regenerates from each recorded seed."""
    p = 0.3
    model = _init(TwoLayers(p)).to(dtype).train()
    x = inputs(dtype).requires_grad_()
    r = inputs(dtype).requires_grad_()
    outs, seeds, record = _run_recording_seeds(model, x, r)
    assert record.matches == counts(dropout_residual=2)
    assert len(seeds) == 2 and seeds[0].item() != seeds[1].item()
    gen = torch.Generator().manual_seed(3)
    cotangents = [torch.randn(o.shape, generator=gen).to(dtype) for o in outs]
    torch.autograd.backward(outs, cotangents)

    leaves = {n: t.detach().double().requires_grad_() for n, t in model.named_parameters()}
    xd, rd = x.detach().double().requires_grad_(), r.detach().double().requires_grad_()
    want = []
    for name, seed in zip(("one", "two"), seeds):
        keep = dropout_mask(x.shape, p, seed)
        h = torch.where(keep, xd / (1 - p), 0) + rd
        y = F.layer_norm(h, (WIDTH,), leaves[f"{name}.ln.weight"], leaves[f"{name}.ln.bias"])
        want += [y, h]
    torch.autograd.backward(want, [c.double() for c in cotangents])
    tol = RTOL[dtype] * 2
    for got, expected in zip(outs, want):
        torch.testing.assert_close(got.double(), expected.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=tol, atol=tol * 4)
    torch.testing.assert_close(r.grad.double(), rd.grad, rtol=tol, atol=tol * 4)
    for n, prm in model.named_parameters():
        torch.testing.assert_close(prm.grad.double(), leaves[n].grad, rtol=tol, atol=tol * 4, msg=n)


def test_dynamic_true_specializes_p():
    """dynamic=True: p and eps arrive as SymFloats; the op specializes p, so another p compiles
    again (and drops at its own rate) instead of reusing the first."""
    model = DropAddNorm(0.5).train()
    x, r = inputs(batch=4, seq=16), inputs(batch=4, seq=16)
    with compiling():
        compiled = torch.compile(model, backend=make_backend([FUSION]), fullgraph=True, dynamic=True)
        for p in (0.5, 0.2):
            model.p = p
            _, h = compiled(x, r)
            assert _keep_rate_ok(h != r, p)
        assert fusionpass.stats(variants=True) == counts(dropout_residual=2)
        assert near_misses() == []
        model.eval()
        compiled(inputs(batch=3, seq=5), inputs(batch=3, seq=5))
        assert fusionpass.stats(variants=True) == counts(dropout_residual=2, residual=1)


# ---------------------------------------------------------------------------------------------
# near misses: recognised, not safe (or not faster), left alone with a reason


class TwoDimNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm((8, WIDTH))

    def forward(self, x, r):
        return self.ln(F.dropout(x, P, self.training) + r)


def _two_16_bit_dtypes():
    return DropAddNorm(P), (inputs(FP16), inputs(BF16))


def _strided():
    return torch.randn(2, WIDTH, 8).transpose(1, 2)


NEAR_MISSES = [
    # (id, model and inputs, train, reason contains)
    ("ln-over-two-dims", lambda: (TwoDimNorm(), (inputs(), inputs())), True,
     "normalized_shape: LayerNorm over more than the last dimension"),
    ("two-16-bit-dtypes", _two_16_bit_dtypes, True,
     "dtype: mixed dtypes: residual torch.bfloat16, input torch.float16"),
    ("width-32", lambda: (DropAddNorm(P, 32), (inputs(width=32), inputs(width=32))), True,
     "width: row width 32 outside 64..8192"),
    ("last-dim-strided", lambda: (DropAddNorm(P), (_strided(), _strided())), True,
     "strides: l_x_ is not contiguous in its last dimension"),
]


@pytest.mark.parametrize(
    "build, train, reason", [c[1:] for c in NEAR_MISSES], ids=[c[0] for c in NEAR_MISSES]
)
def test_near_miss(build, train, reason):
    model, args = build()
    model.train(train)
    _, stats = compile_ln(model, *args, train=train)
    assert stats == {}
    misses = near_misses()
    assert len(misses) == 1, misses
    fusion, where, why = misses[0]
    assert fusion == FUSION and where
    assert reason in why, why


def test_autocast_over_fp32_weights_matches():
    """The HF Trainer's bf16=True: fp32 weights under autocast. Each block's output (a Linear) is
    bf16 and the residual stream fp32; the sum is fp32 and the LayerNorm computes in fp32. The
    pre-LN blocks fuse as in a bf16 model, and compute what eager computes under autocast."""
    model = _init(GPT2(0.0)).train()
    x = inputs(FP32)

    def under_autocast(module, *args, **kw):
        with torch.autocast("cpu", dtype=BF16):
            return module(*args, **kw)

    class Autocast(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return under_autocast(self.inner, x)

    wrapped = Autocast(model)
    got, stats = compile_ln(wrapped, x, train=True)
    assert stats == counts(residual=2), near_misses()
    assert near_misses() == []
    assert got.outputs[0].dtype == FP32
    assert_outcomes_close(got, eager(wrapped, x, train=True), BF16)


def test_fp32_weight_with_bf16_input_is_fused():
    """F.layer_norm takes float32 parameters with half inputs; so does the kernel."""
    model = _init(DropAddNorm(0.0))
    x, r = inputs(BF16), inputs(BF16)
    got, stats = compile_ln(model, x, r, train=True)
    assert stats == counts(residual=1)
    assert_outcomes_close(got, eager(model, x, r, train=True), BF16)


def test_non_constant_p_is_a_near_miss():
    """A dropout probability that is a tensor (Dynamo never writes one: F.dropout checks p in
    Python; built here by editing the captured graph) is recognised and left alone."""
    model = DropAddNorm(P).train()
    cfg = config_mod.make([FUSION], cpu=True)
    records = []

    def backend(gm, example_inputs):
        (dropout,) = [n for n in gm.graph.nodes if n.target is F.dropout]
        with gm.graph.inserting_before(dropout):
            p = gm.graph.call_function(torch.full, ((), P))
        p.meta["example_value"] = torch.full((), P)
        dropout.args = (dropout.args[0], p, *dropout.args[2:])
        STATISTICS.reset()
        PreGradFusionPass(cfg)(gm.graph)
        records.append(STATISTICS.records[-1])
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend, fullgraph=True)(inputs(), inputs())
    finally:
        torch._dynamo.reset()
    (record,) = records
    assert record.matches == {}
    assert [why for _, _, why in record.near_misses] == ["dropout probability is not a constant (a tensor)"]


def test_plain_layer_norms_are_not_candidates():
    """LayerNorms of a graph input, of another LayerNorm, of a broadcast bias add, of an inactive
    dropout of those: nothing to fuse, and no near miss either."""

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.LayerNorm(WIDTH) for _ in range(3))
            self.bias = nn.Parameter(torch.randn(WIDTH))

        def forward(self, x):
            return self.c(F.dropout(self.b(self.a(x)) + self.bias, P, False))

    _, stats = compile_ln(Plain(), inputs())
    assert stats == {} and near_misses() == []


def test_cpu_graph_left_alone_by_default(monkeypatch):
    monkeypatch.delenv("FUSIONPASS_CPU", raising=False)
    model = Bert().eval()
    x = inputs()
    got, stats = compile_and_count(model, x, backend=fusionpass.backend())
    assert stats == {}
    assert [why.split(":")[0] for fusion, _, why in near_misses() if fusion == FUSION] == ["device"] * 2
    assert_outcomes_close(got, eager(model, x), FP32)


def test_width_cost_rule_default(monkeypatch):
    """The default rule: training 768..8192, inference 2048..4096 (fusions/layer_norm_dropout_residual/pattern.py WIDTH); the
    environment overrides each bound."""
    monkeypatch.delenv("FUSIONPASS_LAYER_NORM_MIN_WIDTH")
    monkeypatch.delenv("FUSIONPASS_LAYER_NORM_INFERENCE_MIN_WIDTH")
    monkeypatch.setenv("FUSIONPASS_LAYER_NORM_MAX_WIDTH", "4096")
    cfg = config_mod.from_env()
    assert (cfg.layer_norm_min_width, cfg.layer_norm_max_width) == (768, 4096)
    assert (cfg.layer_norm_inference_min_width, cfg.layer_norm_inference_max_width) == (2048, 4096)
    assert config_mod.Config().layer_norm_max_width == 8192
    _, _, record = fused_graph(Bert(), inputs(), fusions=[FUSION])
    assert [why for _, _, why in record.near_misses] == [
        "width: row width 64 outside 768..4096 in training"
    ] * 2
    with torch.no_grad():
        _, _, record = fused_graph(Bert().eval(), inputs(), fusions=[FUSION])
    assert [why for _, _, why in record.near_misses] == [
        "width: row width 64 outside 2048..4096 in inference"
    ] * 2