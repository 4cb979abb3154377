"""The probe's handle on cuDNN's padding-mask attention: the route's own graphs
(fusionpass.kernels.cudnn_attention) under an autograd Function, so that the probe measures exactly
the code fusionpass::padded_attention calls."""
from __future__ import annotations

import torch

from fusionpass.kernels.cudnn_attention import padded_bwd, padded_fwd, zero_past_keys


class PaddedAttention(torch.autograd.Function):
    """Forward and backward of the padded call, for the probe's checks and timings."""

    @staticmethod
    def forward(ctx, q, k, v, seq_len_kv, scale, causal):
        out, lse = padded_fwd(q, k, v, seq_len_kv, scale=scale, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse, seq_len_kv)
        ctx.scale, ctx.causal = scale, causal
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, seq_len_kv = ctx.saved_tensors
        dq, dk, dv = padded_bwd(do, q, k, v, out, lse, seq_len_kv, scale=ctx.scale, causal=ctx.causal)
        dk, dv = zero_past_keys(dk, dv, seq_len_kv)  # as the route does: cuDNN need not write those rows
        return dq, dk, dv, None, None, None
