"""fusionpass::linear_cross_entropy: the lm_head GEMM and the cross-entropy loss in one op, with
the gradients computed in its forward (fusions/linear_cross_entropy/kernels.py) and scaled in its backward.

    loss, logits, dh, dw, db = linear_cross_entropy(h, weight, bias, labels, ignore_index,
        label_smoothing, softcap, softcap_rounded, reduction, upcast, return_logits,
        need_dh, need_dw, need_db)

computes F.cross_entropy(cap(h @ weight^T + bias), labels.reshape(-1), ignore_index=...,
reduction=..., label_smoothing=...) where cap is `softcap * tanh(z / softcap)` (softcap 0: none),
rounded to the model dtype when `softcap_rounded` (the model caps before its upcast, Gemma-2).
h is [..., D], weight [V, D], bias [V] or None, labels have h.shape[:-1].numel() elements.
The loss is fp32 when `upcast` (the model calls `.float()` on the logits, or autocast computes the
loss in fp32) and h's dtype otherwise.
`logits` ([..., V], h's dtype: the capped logits, as the model returns them) is written only when
`return_logits`; dh/dw/db are the gradients of the loss (empty unless asked for, and db only with a
bias). They are outputs only so that autograd can save them: they, and the logits, are
non-differentiable. The backward is `grad_loss * (dh, dw, db)`: traced by AOTAutograd into the
backward graph, where Inductor writes it in place over the saved (donated) buffers, so a bf16 dW
of V x D exists once.

Why a custom_op on CUDA too, not a triton_op like the norms: the forward loops over chunks of
tokens whose count depends on the (possibly symbolic) number of tokens, and accumulates into dW
with in-place GEMMs (`addmm_`). Traced by torch.compile, the loop would specialize on the sequence
length and the in-place accumulation would be functionalized into copies whose memory Inductor
plans; run opaquely it keeps exactly one logits block of extra memory. Its dispatch cost is
negligible next to the op at the sizes where it is selected (benchmarks/results/latest/linear_cross_entropy.md).
On CPU the op runs the same driver with the Triton kernel under TRITON_INTERPRET=1 (the tests),
else with a torch reference of the row step (`fusionpass explain` on a machine without a GPU).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fusionpass.ops import host

# reduction names the op accepts (F.cross_entropy's "none" is left to Inductor)
REDUCTIONS = ("mean", "sum")


def _reference_step(
    z, labels, loss_out, scale, *, grad_out=None, capped_out=None, ignore_index=-100,
    label_smoothing=0.0, softcap=0.0, softcap_rounded=True, block_v=None, num_warps=None,
):
    """The row step of kernels.ce_chunk (this folder) in torch (fp32 temporaries of the block)."""
    vocab = z.shape[1]
    zf = z.float()
    t = None
    if softcap:
        t = torch.tanh(zf / softcap)
        zf = t * softcap
        if softcap_rounded:
            zf = zf.to(z.dtype).float()
    valid = labels != ignore_index
    y = torch.where(valid & (labels >= 0) & (labels < vocab), labels, 0).long()
    lse = torch.logsumexp(zf, dim=-1)
    zy = zf.gather(1, y[:, None])[:, 0]
    loss = lse - (1.0 - label_smoothing) * zy
    if label_smoothing:
        loss = loss - label_smoothing * zf.mean(-1)
    loss_out.copy_(torch.where(valid, loss, 0.0))
    grad = None
    if grad_out is not None:
        grad = torch.exp(zf - lse[:, None])
        if label_smoothing:
            grad -= label_smoothing / vocab
        grad[torch.arange(len(y), device=z.device), y] -= 1.0 - label_smoothing
        grad *= scale
        if t is not None:
            grad *= 1.0 - t * t
        grad = torch.where(valid[:, None], grad, 0.0)
    if capped_out is not None:
        capped_out.copy_(zf)
    if grad is not None:
        grad_out.copy_(grad)


def _forward(h, weight, bias, labels, ignore_index, label_smoothing, softcap, softcap_rounded,
             reduction, return_logits, need_dh, need_dw, need_db):
    from fusionpass.fusions.linear_cross_entropy.kernels import linear_cross_entropy_fwd

    step = None if h.device.type == "cuda" or host.interpreting() else _reference_step
    lead = h.shape[:-1]
    loss, logits, dh, dw, db = linear_cross_entropy_fwd(
        h.reshape(-1, h.shape[-1]),
        weight,
        bias,
        labels.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        softcap=softcap,
        softcap_rounded=softcap_rounded,
        reduction=reduction,
        return_logits=return_logits,
        need_dh=need_dh,
        need_dw=need_dw,
        need_db=need_db,
        step=step,
    )
    if logits is not None:
        logits = logits.view(*lead, weight.shape[0])
    if dh is not None:
        dh = dh.view(h.shape)
    return loss, logits, dh, dw, db


@torch.library.custom_op("fusionpass::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    softcap_rounded: bool,
    reduction: str,
    upcast: bool,
    return_logits: bool,
    need_dh: bool,
    need_dw: bool,
    need_db: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    need_db = need_db and bias is not None
    loss, logits, dh, dw, db = _forward(
        h, weight, bias, labels, ignore_index, label_smoothing, softcap, softcap_rounded,
        reduction, return_logits, need_dh, need_dw, need_db,
    )
    loss = loss if upcast else loss.to(h.dtype)
    return (
        loss,
        host.none(h) if logits is None else logits,
        host.none(h) if dh is None else dh,
        host.none(h) if dw is None else dw,
        host.none(h) if db is None else db,
    )


@linear_cross_entropy.register_fake
def _(h, weight, bias, labels, ignore_index, label_smoothing, softcap, softcap_rounded,
      reduction, upcast, return_logits, need_dh, need_dw, need_db):
    vocab = weight.shape[0]
    loss = h.new_empty((), dtype=torch.float32 if upcast else h.dtype)
    logits = h.new_empty((*h.shape[:-1], vocab)) if return_logits else host.none(h)
    dh = torch.empty_like(h, memory_format=torch.contiguous_format) if need_dh else host.none(h)
    dw = weight.new_empty(weight.shape) if need_dw else host.none(h)
    db = bias.new_empty(bias.shape) if need_db and bias is not None else host.none(h)
    return loss, logits, dh, dw, db


_GRAD_INPUTS = ((0, "need_dh", "h"), (1, "need_dw", "weight"), (2, "need_db", "bias"))


def _setup_context(ctx, inputs, output):
    _, logits, dh, dw, db = output
    ctx.mark_non_differentiable(logits, dh, dw, db)
    ctx.save_for_backward(dh, dw, db)
    need_db = inputs[13] and inputs[2] is not None
    ctx.computed = (inputs[11], inputs[12], need_db)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_loss, _logits, _dh, _dw, _db):
    saved = ctx.saved_tensors
    grads = [None, None, None]
    for (index, flag, name), computed, grad in zip(_GRAD_INPUTS, ctx.computed, saved):
        if not ctx.needs_input_grad[index]:
            continue
        if not computed:
            raise RuntimeError(
                f"fusionpass::linear_cross_entropy was called with {flag}=False but autograd "
                f"needs the gradient of {name}"
            )
        if grad_loss is not None:
            grads[index] = grad_loss * grad
    return (*grads, *([None] * 11))


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
