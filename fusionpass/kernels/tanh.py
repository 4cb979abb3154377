"""tanh for Triton kernels that also runs under the Triton interpreter (which has no libdevice):
logit soft-capping, `c * tanh(z / c)`, in the cross-entropy and attention kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # (1 - e) / (1 + e) with e = exp(-2|x|) cancels for small |x|: there the odd Taylor polynomial
    # (error < 3e-10 relative below 0.125) takes over.
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    x2 = a * a
    small = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    t = tl.where(a < 0.125, small, big)
    return tl.where(x < 0, -t, t)
