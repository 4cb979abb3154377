"""linear_cross_entropy: the ways models write "vocabulary projection, then cross-entropy" are
matched, counted per variant, and compute what the eager module computes (loss, returned logits,
gradients of the hidden states and of the projection); what must not be matched is left alone with
a near-miss reason.

The heads are written the way their sources write them: transformers 5.17's ForCausalLMLoss
(`logits.float()`, labels padded with -100 and shifted, `view(-1, V)`, mean, or sum divided by
num_items_in_batch), Gemma-2's soft-capping before it, the older shift-logits form, BERT's MLM loss
on model-dtype logits with a biased decoder, and plain code.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    RTOL,
    assert_tensors_close,
    compiling,
    fused_graph,
    make_backend,
    near_misses,
)
from torch import nn

import fusionpass
from fusionpass.fusions.linear_cross_entropy.pattern import RETURNED_WITH_GRAD

FUSION = "linear_cross_entropy"
WIDTH, VOCAB, BATCH, SEQ = 64, 257, 2, 8
FP32, BF16 = torch.float32, torch.bfloat16

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True)
def _small_vocabularies(monkeypatch):
    # tiny vocabularies (the cost rule's default, 4096, is checked in test_vocab_cost_rule)
    monkeypatch.setenv("FUSIONPASS_LINEAR_CROSS_ENTROPY_MIN_VOCAB", "128")


# ---------------------------------------------------------------------------------------------
# heads, written as their sources write them


def fixed_cross_entropy(source, target, num_items_in_batch=None, ignore_index=-100, **kwargs):
    """transformers 5.17 loss_utils.fixed_cross_entropy."""
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = nn.functional.cross_entropy(source, target, ignore_index=ignore_index, reduction=reduction)
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def for_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100):
    """transformers 5.17 loss_utils.ForCausalLMLoss."""
    logits = logits.float()
    labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    shift_labels = shift_labels.view(-1)
    shift_labels = shift_labels.to(logits.device)
    return fixed_cross_entropy(logits, shift_labels, num_items_in_batch, ignore_index)


class CausalLMHead(nn.Module):
    """HF *ForCausalLM: `logits = lm_head(h[:, slice])`, optional Gemma-2 soft-cap, ForCausalLMLoss;
    returns (loss, logits) like the model output (or the loss alone)."""

    def __init__(self, softcap=None, return_logits=True):
        super().__init__()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.softcap, self.return_logits = softcap, return_logits

    def forward(self, hidden_states, labels, num_items_in_batch=None):
        logits = self.lm_head(hidden_states[:, slice(0, None), :])
        if self.softcap is not None:
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        loss = for_causal_lm_loss(logits, labels, VOCAB, num_items_in_batch)
        return (loss, logits) if self.return_logits else loss


class ShiftLogitsHead(nn.Module):
    """Older HF causal LMs: shift the logits, not the labels (optionally after `.float()`)."""

    def __init__(self, upcast_first=False):
        super().__init__()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.upcast_first = upcast_first

    def forward(self, hidden_states, labels):
        logits = self.lm_head(hidden_states)
        scores = logits.float() if self.upcast_first else logits
        shift_logits = scores[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        loss = nn.CrossEntropyLoss()(shift_logits.view(-1, VOCAB), shift_labels.view(-1))
        return loss, logits


class MaskedLMHead(nn.Module):
    """BERT's MLM loss: CrossEntropyLoss on the model-dtype scores of a biased decoder."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(WIDTH, VOCAB)

    def forward(self, sequence_output, labels):
        prediction_scores = self.decoder(sequence_output)
        loss_fct = nn.CrossEntropyLoss()
        masked_lm_loss = loss_fct(prediction_scores.view(-1, VOCAB), labels.view(-1))
        return masked_lm_loss, prediction_scores


class PlainLinearCE(nn.Module):
    """Plain code: `F.cross_entropy(F.linear(h, W), y, ...)`, or `h @ W.t()`."""

    def __init__(self, matmul=False, **ce_kwargs):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH) * WIDTH**-0.5)
        self.matmul, self.ce_kwargs = matmul, ce_kwargs

    def forward(self, h, y):
        h = h.reshape(-1, WIDTH)
        logits = h @ self.weight.t() if self.matmul else F.linear(h, self.weight)
        return F.cross_entropy(logits, y.reshape(-1), **self.ce_kwargs)


class LossOf(nn.Module):
    """A training loop's graph: the head's loss alone, the logits not returned (returned logits
    that require grad keep the loss out of the op: test_returned_logits_with_grad)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, *args, **kwargs):
        out = self.head(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


# ---------------------------------------------------------------------------------------------
# running them


def inputs(dtype=FP32, seq=SEQ, ignored=True):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(BATCH, seq, WIDTH, generator=gen).to(dtype)
    labels = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    if ignored:
        labels[0, :3] = -100  # a prompt that is not trained on
    return h, labels


def step(fn, module, h, labels, train=True, **kwargs):
    """One forward (and backward of the loss): (outputs, gradients of h and every parameter)."""
    h = h.detach().clone().requires_grad_(train)
    module.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(train):
        out = fn(h, labels, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    grads = {}
    if train:
        outs[0].backward()
        grads = {"h": h.grad, **{n: p.grad for n, p in module.named_parameters()}}
    return tuple(o.detach() for o in outs), grads


def compile_step(module, h, labels, train=True, dynamic=None, backend=None, **kwargs):
    backend = backend or make_backend([FUSION])
    with compiling():
        compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)
        got = step(compiled, module, h, labels, train, **kwargs)
        return got, fusionpass.stats(variants=True)


def assert_same(got, want, dtype=FP32, rtol=None):
    rtol = rtol or {FP32: 1e-5, BF16: RTOL[BF16]}[dtype]
    (outs, grads), (want_outs, want_grads) = got, want
    assert len(outs) == len(want_outs)
    for i, (a, e) in enumerate(zip(outs, want_outs)):
        assert_tensors_close(a, e, rtol, f"output {i}")
    assert grads.keys() == want_grads.keys()
    for name, e in want_grads.items():
        assert grads[name] is not None, name
        assert_tensors_close(grads[name], e, rtol, f"gradient of {name}")


def counts(variant):
    return {(FUSION, variant): 1}


# ---------------------------------------------------------------------------------------------
# every form, matched once and equal to eager


@pytest.mark.parametrize(
    "module,variant,kwargs",
    [
        (CausalLMHead(), "float_logits", {}),
        (CausalLMHead(), "float_logits", {"num_items_in_batch": torch.tensor(11)}),
        (CausalLMHead(return_logits=False), "float_logits", {}),
        (CausalLMHead(softcap=3.0), "softcap", {"num_items_in_batch": torch.tensor(11)}),
        (ShiftLogitsHead(), "shift_logits", {}),
        (ShiftLogitsHead(upcast_first=True), "shift_logits", {}),
        (MaskedLMHead(), "model_dtype_logits", {}),
        (PlainLinearCE(label_smoothing=0.1, reduction="sum"), "model_dtype_logits", {}),
        (PlainLinearCE(matmul=True, ignore_index=5), "matmul", {}),
    ],
    ids=["hf_mean", "hf_num_items", "hf_loss_only", "gemma2_softcap", "shift_logits",
         "shift_logits_fp32", "bert_mlm", "plain_smoothing_sum", "matmul_ignore_5"],
)
def test_forms_train(module, variant, kwargs):
    torch.manual_seed(0)
    module.apply(lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)
    h, labels = inputs()
    ignore_index = getattr(module, "ce_kwargs", {}).get("ignore_index")
    module = LossOf(module)
    if ignore_index is not None:
        labels = torch.where(labels == -100, ignore_index, labels)
    got, stats = compile_step(module, h, labels, **kwargs)
    assert stats == counts(variant)
    assert near_misses() == []
    assert_same(got, step(module, module, h, labels, **kwargs))


def test_bf16_hf_form():
    module = CausalLMHead(softcap=30.0).to(BF16)
    h, labels = inputs(BF16)
    got, stats = compile_step(module, h, labels, train=False)
    assert stats == counts("softcap")
    outs, _ = got
    assert outs[0].dtype == FP32 and outs[1].dtype == BF16
    assert_same(got, step(module, module, h, labels, train=False), BF16)
    module = LossOf(module)
    got, stats = compile_step(module, h, labels)
    assert stats == counts("softcap")
    assert_same(got, step(module, module, h, labels), BF16)


def test_bf16_model_dtype_loss():
    """BERT-style loss on bf16 scores: the loss stays bf16, as F.cross_entropy returns it."""
    module = LossOf(MaskedLMHead().to(BF16))
    h, labels = inputs(BF16)
    got, stats = compile_step(module, h, labels)
    assert stats == counts("model_dtype_logits")
    assert got[0][0].dtype == BF16
    assert_same(got, step(module, module, h, labels), BF16)


def test_autocast_over_fp32_weights():
    """fp32 h and weight under autocast: the pass writes autocast's casts first (patterns/autocast.py),
    so the op reads bf16 h and W as the projection would, and the loss and gradients are eager's."""
    module = LossOf(Autocast())
    h, labels = inputs()
    got, stats = compile_step(module, h, labels)
    assert sum(stats.values()) == 1, (stats, near_misses())
    assert_same(got, step(module, module, h, labels), BF16)


class TiedMatmulAutocast(nn.Module):
    """Plain training code with tied embeddings under autocast over fp32 weights: `h @ E.T` (or
    `E.t()`); autocast casts E before the transpose, which the pass writes above it."""

    def __init__(self, attr):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attr = attr

    def forward(self, h, y):
        with torch.autocast("cpu", dtype=BF16):
            w = self.embed.weight.T if self.attr else self.embed.weight.t()
            logits = h.reshape(-1, WIDTH) @ w
            return F.cross_entropy(logits, y.reshape(-1), label_smoothing=0.1)


@pytest.mark.parametrize("attr", [True, False], ids=[".T", ".t()"])
def test_autocast_tied_matmul(attr):
    module = TiedMatmulAutocast(attr)
    with torch.no_grad():
        module.embed.weight.mul_(WIDTH**-0.5)
    h, labels = inputs()
    got, stats = compile_step(module, h, labels)
    assert stats == counts("matmul"), (stats, near_misses())
    assert_same(got, step(module, module, h, labels), BF16)


def test_inference_with_labels():
    """Evaluation (no grad): the op computes the loss only, nothing for a backward."""
    module = CausalLMHead()
    h, labels = inputs()
    got, stats = compile_step(module, h, labels, train=False)
    assert stats == counts("float_logits")
    assert_same(got, step(module, module, h, labels, train=False))
    with torch.no_grad():
        gm, _, _ = fused_graph(module, h, labels)
    call = next(n for n in gm.graph.nodes if n.target is torch.ops.fusionpass.linear_cross_entropy.default)
    assert call.args[-3:] == (False, False, False)


def test_fused_graph():
    """The loss and the logits come from the op; the projection and cross_entropy are gone, the
    labels' own padding and shift stay (they feed the op)."""
    module = CausalLMHead()
    h, labels = inputs()
    with torch.no_grad():
        gm, (loss, logits), record = fused_graph(module, h, labels)
    assert record.matches == counts("float_logits")
    code = gm.code
    assert "fusionpass.linear_cross_entropy.default" in code
    assert "cross_entropy(" not in code.replace("linear_cross_entropy", "")
    assert "_nn.linear" not in code and ".float()" not in code
    want_loss, want_logits = module(h, labels)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(logits, want_logits)


def test_dynamic_sequence_length():
    """Symbolic batch and sequence sizes: one match per compile, right numbers at each length."""
    module = LossOf(CausalLMHead())
    with compiling():
        compiled = torch.compile(module, backend=make_backend([FUSION]), fullgraph=True, dynamic=True)
        for seq in (8, 5):
            h, labels = inputs(seq=seq)
            assert_same(step(compiled, module, h, labels), step(module, module, h, labels))
        records = fusionpass.passes.STATISTICS.records
        assert [r.matches for r in records] == [counts("float_logits")] * len(records)
        assert near_misses() == []


# ---------------------------------------------------------------------------------------------
# near misses


class LogitsAlsoUsed(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.use = use

    def forward(self, h, labels):
        logits = self.lm_head(h)
        scores = logits.float()
        loss = F.cross_entropy(scores.view(-1, VOCAB), labels.view(-1))
        if self.use == "argmax":
            return loss, logits.argmax(-1)
        return loss, scores  # the fp32 copy returned


class LossOn(nn.Module):
    def __init__(self, soft_targets=False, **ce_kwargs):
        super().__init__()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.soft_targets, self.ce_kwargs = soft_targets, ce_kwargs

    def forward(self, h, labels):
        logits = self.lm_head(h).float().view(-1, VOCAB)
        target = labels.view(-1)
        if self.soft_targets:
            target = F.one_hot(target.clamp(min=0), VOCAB).float()
        return F.cross_entropy(logits, target, **self.ce_kwargs)


class Autocast(CausalLMHead):
    def forward(self, hidden_states, labels):
        with torch.autocast("cpu", dtype=BF16):
            return super().forward(hidden_states, labels)


def lm_loss_of_graph_input(logits, labels):
    return for_causal_lm_loss(logits, labels, VOCAB)


def not_a_projection(h, labels):
    return F.cross_entropy(torch.relu(h.reshape(-1, WIDTH)).float(), labels.reshape(-1) % WIDTH)


@pytest.mark.parametrize(
    "module,reason",
    [
        (LogitsAlsoUsed("argmax"), "logits_use: logits (logits) also used by argmax"),
        (LogitsAlsoUsed("fp32"), "logits_use: an intermediate of the logits (scores) also used by output"),
        (LossOn(reduction="none"), "reduction: reduction 'none'"),
        (LossOn(weight=torch.rand(VOCAB)), "class_weight: per-class weights"),
        (LossOn(soft_targets=True), "dtype: target dtype torch.float32"),
        (lm_loss_of_graph_input, "logits come from another graph"),
        (not_a_projection, "its input is not a vocabulary projection's logits"),
    ],
    ids=["argmax", "fp32_logits_returned", "reduction_none", "class_weight", "soft_targets",
         "another_graph", "not_a_projection"],
)
def test_near_misses(module, reason):
    h, labels = inputs()
    if module is lm_loss_of_graph_input:
        h = torch.randn(BATCH, SEQ, VOCAB)
    with compiling():
        compiled = torch.compile(module, backend=make_backend([FUSION]), fullgraph=True)
        compiled(h, labels)
        assert fusionpass.stats() == {}
        misses = near_misses()
    assert len(misses) == 1 and misses[0][0] == FUSION, misses
    assert reason in misses[0][2], misses


def test_returned_logits_with_grad():
    """Logits the graph returns while they require grad: a caller may build a second loss on them
    (distillation, z-loss). The op's logits carry no gradient, so the loss stays with Inductor and
    the gradient through both losses is eager's."""
    module = CausalLMHead()
    h, labels = inputs()

    def both_losses(fn):
        def run(h, labels):
            loss, logits = fn(h, labels)
            return (loss + 1e-2 * logits.float().logsumexp(-1).square().mean(),)
        return run

    with compiling():
        compiled = torch.compile(module, backend=make_backend([FUSION]), fullgraph=True)
        got = step(both_losses(compiled), module, h, labels)
        assert fusionpass.stats() == {}
        misses = near_misses()
    assert len(misses) == 1 and RETURNED_WITH_GRAD in misses[0][2], misses
    assert_same(got, step(both_losses(module), module, h, labels))


def test_cpu_graphs_left_alone_by_default():
    module = CausalLMHead()
    h, labels = inputs()
    _, stats = compile_step(module, h, labels, backend=make_backend([FUSION], cpu=False))
    assert stats == {}
    assert near_misses("device cpu") and len(near_misses()) == 1


def test_vocab_cost_rule(monkeypatch):
    """By default a loss over fewer than 100000 classes stays with Inductor unless its nearest
    measured vocabulary was faster (cost_table.py; a classifier head's 257 is below every measured
    one), and in inference, which the table has not measured, only the memory bound counts."""
    monkeypatch.delenv("FUSIONPASS_LINEAR_CROSS_ENTROPY_MIN_VOCAB")
    h, labels = inputs()
    _, stats = compile_step(MaskedLMHead(), h, labels, train=False)
    assert stats == {}
    [(_, _, why)] = near_misses()
    assert why == ("vocab: classes 257 < 100000; nor classes 257: not measured in inference "
                   "(benchmarks/results/latest/linear_cross_entropy_vocabs.md)"), why
    _, stats = compile_step(CausalLMHead(return_logits=False), h, labels)
    assert stats == {}
    [(_, _, why)] = near_misses()
    assert why.startswith("vocab: classes 257 < 100000; nor classes 257 outside the measured "), why


