"""fusionpass.ops.write_analysis: torch's analysis of which tensors a user Triton kernel writes is
asked once per our kernel and kind of arguments; any other kernel, or an argument it cannot key,
goes to torch every time; each caller gets its own copy of the answer."""
import torch
import triton
import triton.language as tl
from torch._higher_order_ops import triton_kernel_wrap

from fusionpass.kernels.attention import backward, forward
from fusionpass.ops import write_analysis


@triton.jit
def _not_ours(X, BLOCK: tl.constexpr):
    tl.store(X + tl.arange(0, BLOCK), 0.0)


def _counting():
    calls = []

    def analysis(kernel, kwargs, tma):
        calls.append(kernel)
        return {"writes": [n for n, v in kwargs.items() if isinstance(v, torch.Tensor)]}

    return write_analysis.Memo(analysis), calls


def _args(**over):
    return {"O": torch.empty(4, dtype=torch.bfloat16), "Lq": 77, "scale": 0.125, "CAUSAL": True, **over}


def test_installed_on_this_torch():
    names = write_analysis.install()
    assert names and all(isinstance(getattr(triton_kernel_wrap, n), write_analysis.Memo) for n in names)
    assert write_analysis.install() == names  # once: not wrapped twice


def test_asked_once_per_kernel_and_kind_of_arguments():
    memo, calls = _counting()
    first = memo(forward._fwd_kernel, _args(), {})
    again = memo(forward._fwd_kernel, _args(O=torch.empty(9, dtype=torch.bfloat16)), {})
    assert len(calls) == 1 and first == again and first is not again
    memo(forward._fwd_kernel, _args(Lq=93), {})  # an int of the same specialization: the same TTIR
    assert len(calls) == 1
    memo(forward._fwd_kernel, _args(Lq=96), {})  # a multiple of 16: another
    assert len(calls) == 2
    memo(forward._fwd_kernel, _args(CAUSAL=False), {})  # another code path
    memo(forward._fwd_kernel, _args(O=torch.empty(4, dtype=torch.float16)), {})  # another dtype
    memo(backward._bwd_dq_kernel, _args(), {})  # another kernel
    assert len(calls) == 5 and memo.asked == 5


def test_other_kernels_symbolic_arguments_and_tma_go_to_torch():
    memo, calls = _counting()
    for _ in range(2):
        memo(_not_ours, {"X": torch.empty(4), "BLOCK": 4}, {})
        memo(forward._fwd_kernel, _args(Lq=object()), {})  # not keyable (as a symbolic size)
        memo(forward._fwd_kernel, _args(), {"O": ("stable", ())})
    assert len(calls) == 6 and memo.asked == 0


def test_kernels_of_the_fusion_folders_are_ours():
    """The memo keys every kernel of ours, the shared ones and those in a fusion's folder alike (a
    kernel it does not know goes to torch each time: slower compiles, and under the interpreter the
    launch check then reads torch's answer for the wrong function)."""
    from fusionpass.fusions.rms_norm_residual import kernels as rms_norm_kernels
    from fusionpass.fusions.swiglu_mlp import kernels as swiglu_kernels

    for kernel in (forward._fwd_kernel, swiglu_kernels._decode_kernel, rms_norm_kernels._fwd_kernel):
        assert write_analysis.key(kernel, {}, None) is not None, kernel
