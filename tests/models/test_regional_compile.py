"""Regional compilation (torchtitan's per-block `block.compile()`, accelerate's regional
compilation): each TransformerBlock is its own graph, and the loss is compiled as a region of its
own or not at all.

A block's graph is `h = x + attention(attention_norm(x)); out = h + feed_forward(ffn_norm(h))`:
its first norm reads a graph input (no residual add in the graph: the *_no_residual variant), the
second one the residual sum. Every block has the same code and, with Dynamo's inlined nn modules,
the same guards, so the blocks share one compiled graph: the pass runs once, on one block, and
every block runs its output (one record, one block's matches, for any number of layers).

The loss region must hold the lm_head projection for linear_cross_entropy to match: (h, weight,
labels) -> loss, or the final norm + output + loss. torchtitan's own loss function, compiled alone,
gets the logits as an input: a near miss says so.

Numerics are compared with plain torch.compile of the same regions (float32, CPU).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torchtitan_model as tt
from helpers import assert_outcomes_close, compiling, make_backend, near_misses, run

import fusionpass
from fusionpass.passes import STATISTICS
from fusionpass.fusions.linear_cross_entropy.pattern import ANOTHER_GRAPH

RMS, ROPE, SWIGLU, LCE = "rms_norm_residual", "rope", "swiglu_mlp", "linear_cross_entropy"
RTOL_FP32 = 1e-4  # as the HF model tests: whole blocks, reductions in another order
LAYERS = 3
BATCH, SEQ = 2, 16
# the tiny model's shapes are outside the GPU cost rules: open the ones the block can match
# (rms_norm_min_width is opened to the model's width 512 by conftest)
SETTINGS = dict(rope_min_tokens=1, linear_cross_entropy_min_vocab=1)
NORM_VARIANT = {"torch": "torch_rms_norm", "llama": "llama"}


def block_counts(norm: str, rope: str) -> dict:
    """What one block's graph matches: both norms (the first without a residual add), the real
    rotation (torchtitan's complex rotation is outside the rope patterns), and SwiGLU (in
    training with the down projection in the op, the default swiglu_mlp_recompute_product)."""
    form = NORM_VARIANT[norm]
    counts = {(RMS, f"{form}_no_residual"): 1, (RMS, form): 1, (SWIGLU, "silu"): 1}
    if rope == "rotate_half":
        counts[(ROPE, "rotate_half")] = 1
    return counts


def model_and_ids(norm="torch", rope="rotate_half", train=True, layers=LAYERS):
    model = tt.make(norm=norm, rope=rope, n_layers=layers)
    model.train(train)
    return model, torch.randint(0, model.args.vocab_size, (BATCH, SEQ))


def compile_blocks_plain(model):
    tt.compile_regions(model, backend="inductor")


def compile_blocks_enabled(model):
    # the user's own block.compile() inside fusionpass.enabled(): the compile happens at the
    # first call, after the block, and keeps our pass (FusionpassBackend)
    with fusionpass.enabled(cpu=True, **SETTINGS):
        tt.compile_regions(model)


def compile_blocks_backend(model):
    backend = make_backend(**SETTINGS)
    for block in model.layers.values():
        block.compile(backend=backend, fullgraph=True)


def regional(model, ids, train, compile_blocks):
    """Compile the model's blocks with `compile_blocks`, run a step; (Outcome, stats, records)."""
    with compiling():
        compile_blocks(model)
        outcome = run(model, model, (ids,), train)
        return outcome, fusionpass.stats(variants=True), len(STATISTICS.records)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("norm", list(NORM_VARIANT))
@pytest.mark.parametrize("rope", ["rotate_half", "complex"])
def test_per_block_compile_matches_every_norm(norm, rope, train):
    model, ids = model_and_ids(norm, rope, train)
    expected, _, _ = regional(copy.deepcopy(model), ids, train, compile_blocks_plain)
    got, stats, graphs = regional(model, ids, train, compile_blocks_backend)
    assert graphs == 1  # one graph for every block
    assert stats == block_counts(norm, rope)
    assert near_misses() == []
    assert_outcomes_close(got, expected, rtol=RTOL_FP32)


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_block_compile_inside_enabled(train):
    model, ids = model_and_ids(train=train)
    expected, _, _ = regional(copy.deepcopy(model), ids, train, compile_blocks_plain)
    got, stats, graphs = regional(model, ids, train, compile_blocks_enabled)
    assert graphs == 1
    assert stats == block_counts("torch", "rotate_half")
    assert_outcomes_close(got, expected, rtol=RTOL_FP32)


# ---------------------------------------------------------------------------------------------
# the loss region: h, lm_head weight, labels -> loss (odd shapes: 3 x 7 tokens, 96 wide, 251 classes)

B, S, D, V = 3, 7, 96, 251


def matmul_loss(h, weight, labels):
    return F.cross_entropy((h @ weight.t()).float().view(-1, V), labels.view(-1))


def linear_loss(h, weight, labels):
    return F.cross_entropy(F.linear(h, weight).float().view(-1, V), labels.view(-1))


def torchtitan_loss(h, weight, labels):
    return tt.cross_entropy_loss(F.linear(h, weight), labels)


LOSS_FORMS = {"matmul": (matmul_loss, "matmul"), "linear": (linear_loss, "float_logits"),
              "torchtitan": (torchtitan_loss, "float_logits")}


class LossRegion(torch.nn.Module):
    """loss_fn(h, weight, labels) as a module, so `run` collects the weight's gradient."""

    def __init__(self, loss_fn):
        super().__init__()
        self.loss_fn = loss_fn
        self.weight = torch.nn.Parameter(torch.randn(V, D) * D ** -0.5)

    def forward(self, h, labels):
        return self.loss_fn(h, self.weight, labels)


def loss_inputs():
    h = torch.randn(B, S, D)
    labels = torch.randint(0, V, (B, S))
    return h, labels


def compiled_step(module, inputs, backend):
    with compiling():
        compiled = torch.compile(module, backend=backend, fullgraph=True)
        outcome = run(compiled, module, inputs, train=True)
        return outcome, fusionpass.stats(variants=True)


@pytest.mark.parametrize("form", list(LOSS_FORMS))
def test_loss_region_matches_linear_cross_entropy(form):
    loss_fn, variant = LOSS_FORMS[form]
    module, inputs = LossRegion(loss_fn), loss_inputs()
    expected, plain_stats = compiled_step(module, inputs, "inductor")
    assert plain_stats == {}
    # the default vocabulary rule keeps a tiny vocabulary out: matched only once it is opened
    _, default_stats = compiled_step(module, inputs, make_backend())
    assert default_stats == {}
    assert [m[0] for m in near_misses()] == [LCE]
    got, stats = compiled_step(module, inputs, make_backend(**SETTINGS))
    assert stats == {(LCE, variant): 1}
    assert_outcomes_close(got, expected, rtol=RTOL_FP32)
    assert set(got.grads) == {"input0", "weight"}


def test_norm_output_loss_region():
    """The region after the blocks: final norm + output + loss, one graph: the norm (its input is
    a graph input) and the projection with its loss both fuse."""
    model = tt.make(dim=D, vocab_size=V, n_heads=2, n_kv_heads=1)
    region = tt.NormOutputLoss(model)
    inputs = loss_inputs()
    expected, _ = compiled_step(region, inputs, "inductor")
    got, stats = compiled_step(region, inputs, make_backend(rms_norm_min_width=1, **SETTINGS))
    assert stats == {(RMS, "torch_rms_norm_no_residual"): 1, (LCE, "float_logits"): 1}
    assert_outcomes_close(got, expected, rtol=RTOL_FP32)
    assert set(got.grads) == {"input0", "norm.weight", "output.weight"}


def test_torchtitan_loss_alone_is_a_near_miss():
    """torchtitan's loss compiled by itself: the logits come from the (uncompiled or separately
    compiled) output projection, an input of this graph."""
    logits = torch.randn(B, S, V)
    labels = torch.randint(0, V, (B, S))
    with compiling():
        torch.compile(tt.cross_entropy_loss, backend=make_backend(**SETTINGS), fullgraph=True)(logits, labels)
        assert fusionpass.stats() == {}
        assert [(m[0], m[2]) for m in near_misses()] == [(LCE, ANOTHER_GRAPH)]


# ---------------------------------------------------------------------------------------------
# a torchtitan training step: every block compiled, the norm + output + loss region compiled


@pytest.mark.parametrize("rope", ["rotate_half", "complex"])
def test_regional_training_step(rope):
    model, ids = model_and_ids(rope=rope, train=True, layers=2)
    labels = torch.roll(ids, -1, dims=1)

    with compiling():
        plain = copy.deepcopy(model)
        expected = run(tt.RegionalTraining(plain, backend="inductor", fullgraph=True), plain, (ids, labels), train=True)
    with compiling():
        step = tt.RegionalTraining(model, backend=make_backend(**SETTINGS), fullgraph=True)
        got = run(step, model, (ids, labels), train=True)
        stats, graphs = fusionpass.stats(variants=True), len(STATISTICS.records)
    assert graphs == 2  # the blocks' graph and the loss region's
    expected_counts = block_counts("torch", rope)
    expected_counts[(RMS, "torch_rms_norm_no_residual")] += 1  # the final norm
    expected_counts[(LCE, "float_logits")] = 1
    assert stats == expected_counts
    assert_outcomes_close(got, expected, rtol=RTOL_FP32)
