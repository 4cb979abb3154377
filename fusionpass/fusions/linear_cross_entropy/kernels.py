"""Triton kernel and chunked driver for linear + cross-entropy (`linear_cross_entropy`).

    z    = h @ W^T (+ b)                     GEMM per chunk of tokens, model dtype (what the model computes)
    zc   = round(c * tanh(z / c))            optional logit soft-capping (Gemma-2), rounded to the
                                             model dtype when the model caps before its upcast
    loss = lse(zc) - (1 - eps) * zc[y] - eps * mean(zc)        per token, fp32; 0 where y == ignore_index
    dz   = scale * (softmax(zc) - (1 - eps) * onehot(y) - eps / V) * (1 - tanh^2)   (0 where ignored)

`eps` is the label smoothing exactly as `F.cross_entropy` defines it; `scale` is 1 / (number of
non-ignored tokens) for reduction "mean" (a device scalar: no host sync) and 1 for "sum" (the model
divides by num_items_in_batch after the op, and autograd brings that factor back as grad_output).

Design (Liger-Kernel's order, our own code): the forward walks chunks of tokens; for each chunk one
GEMM writes the [rows, V] logits block in the model dtype, one Triton program per row makes two
passes over it (online log-sum-exp in fp32, then the gradient of the logits written back in place),
and two more GEMMs turn that block into the chunk's rows of dh and a contribution to dW (and db).
That is the three GEMMs a training step needs and no more (recomputing the logits in the backward,
as cut-cross-entropy does, costs a fourth GEMM; benchmarks/results/latest/linear_cross_entropy.md), while the
only extra memory is one logits block (`chunk_bytes`) and the fp32 per-token losses: the fp32
[N, V] logits, the probabilities and a separate logits gradient never exist. The backward of the op
only scales dh/dW/db by grad_output (fusions/linear_cross_entropy/op.py).

dW accumulates over token chunks in the weight dtype (addmm with beta=1; each GEMM accumulates in
fp32), so a bf16 dW sees one rounding per chunk instead of one in all: with the default chunk at
N8192 V128256 that is 8 roundings. Larger chunks mean fewer.

The GEMMs are torch.matmul (cuBLAS on CUDA). On CPU tensors the same driver runs the Triton kernel
under TRITON_INTERPRET=1, or any `step` with the kernel's contract (fusions/linear_cross_entropy/op.py passes a
torch reference when there is no interpreter).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from fusionpass.kernels.common import _FLOAT_DTYPES, _device_guard, _for_store, _round
from fusionpass.kernels.tanh import tanh

__all__ = ["Tiling", "ce_chunk", "chunk_rows_for", "linear_cross_entropy_fwd", "tiling"]


# --------------------------------------------------------------------------------------------------
# Tiling defaults: the one place they live. Every entry point takes keyword overrides.
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tiling:
    # Bytes of one [rows, V] logits block in the model dtype: the extra memory of the op.
    # 256 MiB is 1024 tokens at V=128256 in bf16 (rows are rounded down to a power of two).
    chunk_bytes: int
    # Columns a row program handles per step of its two passes over the vocabulary.
    block_v: int
    num_warps: int


# Larger logits blocks trade extra memory for fewer, larger GEMMs: this block was the fastest
# measured and still far under the full logits' memory; block_v and num_warps barely matter
# (benchmarks/results/latest/linear_cross_entropy.md).
CUDA_TILING = Tiling(chunk_bytes=512 << 20, block_v=4096, num_warps=8)
# The interpreter runs programs one by one in numpy: small blocks keep odd vocab sizes covered by
# several blocks and a masked tail.
CPU_TILING = Tiling(chunk_bytes=64 << 20, block_v=128, num_warps=1)


def tiling(device: torch.device) -> Tiling:
    return CUDA_TILING if device.type == "cuda" else CPU_TILING


def chunk_rows_for(n_rows: int, vocab: int, dtype: torch.dtype, chunk_bytes: int) -> int:
    """Tokens per chunk: the largest power of two whose logits block fits `chunk_bytes` (at least 1,
    at most the number of rows)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = max(1, chunk_bytes // max(1, vocab * itemsize))
    rows = 1 << (rows.bit_length() - 1)
    return max(1, min(rows, n_rows))


# --------------------------------------------------------------------------------------------------
# Kernel: one program per row of a [rows, V] logits block
# --------------------------------------------------------------------------------------------------
@triton.jit
def _capped(z, softcap, SOFTCAP: tl.constexpr, ROUND_CAPPED: tl.constexpr, DT: tl.constexpr,
            ROUND_BITS: tl.constexpr):
    """(zc, t): the logits the loss sees and tanh(z / c) (t is z itself without capping)."""
    if SOFTCAP:
        t = tanh(z / softcap)
        zc = t * softcap
        if ROUND_CAPPED:
            zc = _round(zc, DT, ROUND_BITS)
    else:
        t = z
        zc = z
    return zc, t


@triton.jit
def _ce_row_kernel(
    Z, G, L, Y, LOSS, SCALE,
    V, stride_z, stride_g, stride_l,
    ignore_index, label_smoothing, softcap,
    SOFTCAP: tl.constexpr, ROUND_CAPPED: tl.constexpr, SMOOTHING: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, WRITE_CAPPED: tl.constexpr, ROUND_BITS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # torch.compile passes Python floats as fp64 scalars; the math is fp32.
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    DT: tl.constexpr = Z.dtype.element_ty
    G_DT: tl.constexpr = G.dtype.element_ty
    L_DT: tl.constexpr = L.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    y = tl.load(Y + row).to(tl.int32)
    valid = y != ignore_index
    in_range = (y >= 0) & (y < V)

    # Pass 1: online log-sum-exp over the row (and the row sum for label smoothing). Ignored rows
    # skip it unless their capped logits are written (then pass 2 still needs nothing from here).
    m = tl.full([], -float("inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    zsum = tl.zeros([], tl.float32)
    lse = tl.zeros([], tl.float32)
    loss = tl.zeros([], tl.float32)
    if valid:
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            mask = c < V
            z = tl.load(z_row + c, mask=mask, other=0.0).to(tl.float32)
            zc, _t = _capped(z, softcap, SOFTCAP, ROUND_CAPPED, DT, ROUND_BITS)
            zm = tl.where(mask, zc, -float("inf"))
            m_new = tl.maximum(m, tl.max(zm, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(zm - m_new), axis=0)
            m = m_new
            if SMOOTHING:
                zsum += tl.sum(tl.where(mask, zc, 0.0), axis=0)
        lse = m + tl.log(s)
        # The label's logit, through the same capping (the driver asserts labels are in range;
        # the clamp only keeps a failing run from reading out of bounds).
        zy = tl.load(z_row + tl.where(in_range, y, 0)).to(tl.float32)
        zyc, _ty = _capped(zy, softcap, SOFTCAP, ROUND_CAPPED, DT, ROUND_BITS)
        loss = lse - (1.0 - label_smoothing) * zyc
        if SMOOTHING:
            loss -= label_smoothing * (zsum / V)
    tl.store(LOSS + row, loss)

    # Pass 2: the gradient of the logits (in place when G is Z) and/or the capped logits.
    if COMPUTE_GRAD or WRITE_CAPPED:
        scale = tl.load(SCALE).to(tl.float32)
        g_row = G + row * stride_g
        l_row = L + row * stride_l
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols
            mask = c < V
            z = tl.load(z_row + c, mask=mask, other=0.0).to(tl.float32)
            zc, t = _capped(z, softcap, SOFTCAP, ROUND_CAPPED, DT, ROUND_BITS)
            if WRITE_CAPPED:
                tl.store(l_row + c, _for_store(zc, L_DT, ROUND_BITS), mask=mask)
            if COMPUTE_GRAD:
                g = tl.exp(zc - lse) - tl.where(c == y, 1.0 - label_smoothing, 0.0)
                if SMOOTHING:
                    g -= label_smoothing / V
                g = g * scale
                if SOFTCAP:
                    g = g * (1.0 - t * t)
                # ignored rows: exact zeros (also when scale is inf, all tokens ignored in "mean")
                g = tl.where(valid, g, 0.0)
                tl.store(g_row + c, _for_store(g, G_DT, ROUND_BITS), mask=mask)


def ce_chunk(
    z: torch.Tensor,
    labels: torch.Tensor,
    loss_out: torch.Tensor,
    scale: torch.Tensor,
    *,
    grad_out: torch.Tensor | None = None,
    capped_out: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float = 0.0,
    softcap_rounded: bool = True,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> None:
    """The per-chunk step on a [rows, V] block of raw logits `z` (model dtype, unit column stride).

    Writes the per-row fp32 losses into `loss_out` [rows]; with `grad_out` ([rows, V], may be `z`
    itself) the gradient of sum(per-row loss) * scale; with `capped_out` (may be `z`) the capped
    logits. `scale` is a one-element fp32 tensor on z's device. softcap 0 means no capping.
    """
    rows, vocab = z.shape
    if rows == 0:
        return
    for t in (z, grad_out, capped_out):
        if t is not None and t.stride(-1) != 1:
            raise ValueError("logits blocks need unit column stride")
    t = tiling(z.device)
    block_v = t.block_v if block_v is None else block_v
    block_v = min(triton.next_power_of_2(block_v), triton.next_power_of_2(vocab))
    num_warps = t.num_warps if num_warps is None else num_warps
    g = grad_out if grad_out is not None else z
    lo = capped_out if capped_out is not None else z
    with _device_guard(z.device):
        # A plain launch even on CUDA: the op calling this is opaque to torch.compile (see
        # fusions/linear_cross_entropy/op.py), so there is no graph for wrap_triton to trace into.
        _ce_row_kernel[(rows,)](
            z, g, lo, labels, loss_out, scale,
            vocab, z.stride(0), g.stride(0), lo.stride(0),
            int(ignore_index), float(label_smoothing), float(softcap),
            SOFTCAP=softcap != 0.0, ROUND_CAPPED=bool(softcap_rounded),
            SMOOTHING=label_smoothing != 0.0,
            COMPUTE_GRAD=grad_out is not None, WRITE_CAPPED=capped_out is not None,
            ROUND_BITS=z.device.type != "cuda", BLOCK_V=block_v, num_warps=num_warps,
        )


# --------------------------------------------------------------------------------------------------
# Driver: chunks of tokens, three GEMMs per chunk around the row kernel
# --------------------------------------------------------------------------------------------------
def linear_cross_entropy_fwd(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    softcap: float = 0.0,
    softcap_rounded: bool = True,
    reduction: str = "mean",
    return_logits: bool = False,
    need_dh: bool = True,
    need_dw: bool = True,
    need_db: bool = True,
    chunk_rows: int | None = None,
    chunk_bytes: int | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    step=None,
):
    """Loss of CE(h @ weight^T + bias, labels) and, in the same pass, its gradients.

    h: [N, D]; weight: [V, D]; bias: [V] or None; labels: [N] integer. Returns
    (loss fp32 0-dim, logits [N, V] in h's dtype or None, dh [N, D] or None, dw [V, D] or None,
    db [V] or None); the gradients are those of the returned loss. `reduction` is "mean" (over
    non-ignored tokens; nan when there are none, as F.cross_entropy) or "sum". `step` replaces the
    Triton row kernel (same contract as `ce_chunk`).
    """
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"h {tuple(h.shape)} and weight {tuple(weight.shape)} do not fit [N, D] x [V, D]")
    if h.dtype not in _FLOAT_DTYPES or weight.dtype != h.dtype:
        raise ValueError(f"h and weight must share a float dtype, got {h.dtype} and {weight.dtype}")
    if bias is not None and (bias.dtype != h.dtype or bias.shape != (weight.shape[0],)):
        raise ValueError("bias must be [V] in h's dtype")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction {reduction!r} is not 'mean' or 'sum'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing {label_smoothing} is not in [0, 1]")
    n, _ = h.shape
    vocab = weight.shape[0]
    if labels.shape != (n,):
        raise ValueError(f"labels {tuple(labels.shape)} do not match {n} rows")
    device, dtype = h.device, h.dtype
    step = ce_chunk if step is None else step
    t = tiling(device)
    if chunk_rows is None:
        chunk_rows = chunk_rows_for(n, vocab, dtype, t.chunk_bytes if chunk_bytes is None else chunk_bytes)
    need_db = need_db and bias is not None
    compute_grad = need_dh or need_dw or need_db
    h = h if h.stride(-1) == 1 else h.contiguous()
    labels = labels.contiguous()

    valid = labels != ignore_index
    # A label outside [0, V) that is not ignore_index is an error, as in F.cross_entropy; checked
    # without a host sync (on CUDA a device-side assert, as F.cross_entropy's own kernel raises).
    torch._assert_async(
        (~valid | ((labels >= 0) & (labels < vocab))).all(),
        "linear_cross_entropy: a label is outside [0, vocabulary) and not ignore_index",
    )
    if reduction == "mean":
        n_valid = valid.sum().to(torch.float32)
        scale = (1.0 / n_valid).reshape(1)  # inf when every token is ignored: rows are zeroed
    else:
        n_valid = None
        scale = torch.ones(1, dtype=torch.float32, device=device)

    logits = torch.empty((n, vocab), dtype=dtype, device=device) if return_logits else None
    dh = torch.empty_like(h, memory_format=torch.contiguous_format) if need_dh else None
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else None
    db_acc = torch.zeros(vocab, dtype=torch.float32, device=device) if need_db else None
    row_losses = torch.empty(n, dtype=torch.float32, device=device)
    # Returned logits are written by the GEMM itself only where their rows are 16-byte aligned:
    # cuBLAS falls back to slow unaligned ("align1") kernels otherwise (GPT-2's V=50257;
    # benchmarks/results/latest/linear_cross_entropy.md). Elsewhere the GEMM writes the padded block and the
    # row kernel copies the logits out on its second pass.
    direct = return_logits and (vocab * h.element_size()) % 16 == 0
    # One [chunk, V] block, rows padded to 64 columns: the raw logits when they are not written
    # directly, the logits gradient (in place over them, or apart from the returned logits).
    block = None
    if not direct or compute_grad:
        padded = -(-vocab // 64) * 64
        rows = min(chunk_rows, max(n, 1))
        block = torch.empty((rows, padded), dtype=dtype, device=device)[:, :vocab]
    wt = weight.t()
    softcap = float(softcap or 0.0)
    aligned = vocab - vocab % (16 // h.element_size())

    for start in range(0, n, chunk_rows):
        end = min(start + chunk_rows, n)
        hc = h[start:end]
        z = logits[start:end] if direct else block[: end - start]
        if bias is None:
            torch.mm(hc, wt, out=z)
        else:
            torch.addmm(bias, hc, wt, out=z)
        g = (block[: end - start] if direct else z) if compute_grad else None
        if direct:
            capped = z if softcap != 0.0 else None
        else:
            capped = logits[start:end] if return_logits else None
        step(
            z, labels[start:end], row_losses[start:end], scale,
            grad_out=g, capped_out=capped, ignore_index=ignore_index,
            label_smoothing=label_smoothing, softcap=softcap, softcap_rounded=softcap_rounded,
            block_v=block_v, num_warps=num_warps,
        )
        if not compute_grad:
            continue
        # Both gradient GEMMs run over the vocabulary in two parts: a multiple of 16 bytes, then
        # the few last columns. With an odd V (GPT-2's 50257, BERT's 30522 is not a multiple of
        # 8 either) cuBLAS otherwise takes unaligned kernels for the whole GEMM (benchmarks/results/latest/linear_cross_entropy.md).
        if need_dh:
            torch.mm(g[:, :aligned], weight[:aligned], out=dh[start:end])
            if aligned < vocab:
                dh[start:end].addmm_(g[:, aligned:], weight[aligned:])
        if need_dw:
            for lo, hi in ((0, aligned), (aligned, vocab)):
                if lo == hi:
                    continue
                if start == 0:
                    torch.mm(g[:, lo:hi].t(), hc, out=dw[lo:hi])
                else:
                    dw[lo:hi].addmm_(g[:, lo:hi].t(), hc)
        if need_db:
            db_acc += torch.sum(g, 0, dtype=torch.float32)

    total = row_losses.sum()
    loss = total / n_valid if reduction == "mean" else total
    if need_dw and n == 0:
        dw.zero_()
    db = db_acc.to(dtype) if need_db else None
    return loss, logits, dh, dw, db
