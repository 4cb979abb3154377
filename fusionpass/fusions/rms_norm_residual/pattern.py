"""rms_norm_residual: RMSNorm, optionally of a residual sum, as model families write it.

The match starts at the `rsqrt` of the statistics,
    rstd = rsqrt(mean(hf^2, dim=-1, keepdim=True) + eps)        (or hf * hf, or square(hf))
    n    = X * rstd                                              X, hf: exact upcasts of one h
and the *output forms* below say what follows n. If h itself is `a + b` of two tensors of its own
shape and dtype (or an fp32 h of an fp32 and a 16-bit operand: autocast over fp32 weights), the add
is fused too and h comes out of the kernel for its other users (the next residual). Casts to float32 from bf16/fp16 are exact, so `.float()` / `.to(float32)` / no cast at
all (T5 multiplies bf16 h by fp32 rstd) compute the same n.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx as fx

from fusionpass import registry
from fusionpass.cost import NOT_AUTOTUNED_TRAINING, Excluded, Measured, Range, fields, mode
from fusionpass.fusions.rms_norm_residual import cost_table
from fusionpass.kernels.common import TWO_PASS_FWD
from fusionpass.patterns import graph as g
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant, option

# ---------------------------------------------------------------------------------------------
# statistics: rsqrt(mean(hf^2) + eps), and n = X * rstd


def _squared(node):
    """hf if node is hf**2, hf*hf or square(hf)."""
    if g.is_op(node, "pow") and len(node.args) == 2 and g.is_literal(node.args[1], 2):
        return node.args[0]
    if g.is_op(node, "mul") and g.binary_operands(node) and node.args[0] is node.args[1]:
        return node.args[0]
    if g.is_op(node, "square") and len(node.args) == 1:
        return node.args[0]
    return None


def _statistics(rsqrt: fx.Node):
    """(hf, eps, nodes) of rsqrt(mean(hf^2, -1, keepdim=True) + eps), or None."""
    add = g.first_arg(rsqrt)
    if not g.is_op(add, "add") or len(rsqrt.args) != 1:
        return None
    for mean, eps in g.commuted(add):
        if not (g.is_op(mean, "mean") and g.reduces_last_dim(mean)):
            continue
        hf = _squared(g.first_arg(mean))
        if hf is None:
            return None
        is_scalar, eps_value = g.scalar(eps)
        if not is_scalar:
            raise NearMiss("eps is a tensor, not a constant or a scalar graph input")
        return hf, eps_value, [add, mean, g.first_arg(mean)]
    return None


def _normalized(rsqrt: fx.Node, h: fx.Node):
    """n = X * rstd where X is h or an exact upcast of it."""
    users = list(rsqrt.users)
    if len(users) != 1:
        raise NearMiss("rstd has other users")
    n = users[0]
    if g.is_op(n, "mul"):
        for x, r in g.commuted(n):
            if r is rsqrt and isinstance(x, fx.Node) and g.strip_upcasts(x) is h:
                return n, x
    return None


def _upcast_chain(node: fx.Node, base: fx.Node) -> list[fx.Node]:
    chain = []
    while node is not base:
        chain.append(node)
        node = g.first_arg(node)
    return chain


# ---------------------------------------------------------------------------------------------
# output forms: what follows n. Each returns (y, weight, weight_offset, weight_after_cast, nodes)
# or None; `dtype` is the input (h) dtype.


def _next(node):
    return g.single_user(node)


def _weight_operand(mul: fx.Node, operand: fx.Node):
    """The other operand of `mul`, or None."""
    for a, b in g.commuted(mul):
        if a is operand and isinstance(b, fx.Node):
            return b
    return None


def llama_form(n: fx.Node, dtype):
    """HF Llama/Mistral/Qwen2/Qwen3/Phi-3 and T5: `weight * n.to(input_dtype)`."""
    cast = _next(n)
    if g.cast_source(cast) is not n:
        return None
    mul = _next(cast)
    if not g.is_op(mul, "mul"):
        return None
    weight = _weight_operand(mul, cast)
    if weight is None:
        return None
    return mul, weight, 0.0, g.dtype(cast) != torch.float32, [cast, mul]


def _float_weight(node):
    """(weight, cast nodes) for `w`, `w.float()`, `w.to(float32)`."""
    base = g.strip_upcasts(node)
    return base, _upcast_chain(node, base)


def gemma_form(n: fx.Node, dtype):
    """Gemma 1/2/3: `(n * (1.0 + weight.float())).type_as(x)`."""
    mul = _next(n)
    if not g.is_op(mul, "mul"):
        return None
    scale = _weight_operand(mul, n)
    if scale is None or not g.is_op(scale, "add"):
        return None
    for one, w in g.commuted(scale):
        if g.is_literal(one, 1) and isinstance(w, fx.Node):
            weight, casts = _float_weight(w)
            y, tail = _optional_downcast(mul)
            return y, weight, 1.0, False, [mul, scale, *casts, *tail]
    return None


def weight_in_fp32_form(n: fx.Node, dtype):
    """Plain fp32 RMSNorm (`x * rsqrt(...) * w`), and weights applied before the downcast."""
    mul = _next(n)
    if not g.is_op(mul, "mul"):
        return None
    w = _weight_operand(mul, n)
    if w is None or g.is_op(w, "add"):
        return None
    weight, casts = _float_weight(w)
    y, tail = _optional_downcast(mul)
    # a bf16 n (no upcast anywhere) times a bf16 weight multiplies rounded values, like llama_form
    after_cast = g.dtype(n) != torch.float32
    return y, weight, 0.0, after_cast, [mul, *casts, *tail]


def no_weight_form(n: fx.Node, dtype):
    """Norms without an affine weight: `n.to(input_dtype)`, or n itself in fp32 models."""
    y, tail = _optional_downcast(n)
    return y, None, 0.0, False, tail


def _optional_downcast(node):
    cast = _next(node)
    if g.cast_source(cast) is node:
        return cast, [cast]
    return node, []


OUTPUT_FORMS = (
    ("llama", llama_form),
    ("gemma", gemma_form),
    ("weight_in_fp32", weight_in_fp32_form),
    ("no_weight", no_weight_form),
)


def _residual_operands(h: fx.Node):
    """(a, b) if h = a + b of two tensors shaped like h (a residual add), a typed like h. b is typed
    like h too, or, where h is float32, 16-bit: a sublayer's output under autocast added to the fp32
    residual stream of fp32 weights (the HF Trainer's bf16=True), which the kernel adds in fp32 as
    the model's type promotion does."""
    pair = g.same_shape_add_operands(h)
    if pair is None:
        return None
    ht = g.tensor(h)
    tensors = [g.tensor(t) for t in pair]
    same = [t.dtype == ht.dtype for t in tensors]
    if all(same):
        return pair
    narrow = tensors[same.index(False)].dtype
    if not any(same) or ht.dtype != torch.float32 or narrow not in (torch.float16, torch.bfloat16):
        return None
    return pair if same[0] else pair[::-1]


def _search(form_name, form, with_residual: bool):
    """The search of one output form, with the residual add before it fused or without one."""

    def search(rsqrt: fx.Node) -> Match | None:
        if not g.is_op(rsqrt, "rsqrt"):  # the anchor is also torch.rms_norm's call
            return None
        stats = _statistics(rsqrt)
        if stats is None:
            return None
        hf, eps, stat_nodes = stats
        h = g.strip_upcasts(hf)
        normalized = _normalized(rsqrt, h)
        if normalized is None:
            return None
        n, x = normalized
        out = form(n, g.dtype(h))
        if out is None:
            return None
        y, weight, offset, after_cast, out_nodes = out
        if offset and after_cast:
            raise NearMiss("1 + weight applied after the downcast: no kernel variant for it")
        residual = _residual_operands(h)
        if (residual is not None) != with_residual:
            return None
        nodes = [
            *_upcast_chain(hf, h),
            *_upcast_chain(x, h),
            *stat_nodes,
            rsqrt,
            n,
            *out_nodes,
        ]
        return Match(
            variant=form_name if residual else f"{form_name}_no_residual",
            anchor=rsqrt,
            nodes=[*dict.fromkeys(nodes), *([h] if residual else [])],
            bindings=dict(
                h=h,
                residual=residual,
                y=y,
                weight=weight,
                eps=eps,
                weight_offset=offset,
                weight_after_cast=after_cast,
            ),
        )

    return search


# ---------------------------------------------------------------------------------------------
# torch.rms_norm(input, normalized_shape, weight=None, eps=None): nn.RMSNorm, F.rms_norm

TORCH_FORM = "torch_rms_norm"
_TORCH_RMS_NORM_PARAMETERS = ("input", "normalized_shape", "weight", "eps")


def is_torch_rms_norm(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.rms_norm


@functools.cache
def torch_rms_norm_weight_after_cast() -> bool | None:
    """Where this torch's rms_norm applies the weight: False before the downcast to the input
    dtype (`cast(n * w)`, torch's `_fused_rms_norm` decomposition, which Inductor compiles with),
    True after it (`cast(n) * w`, older composites), None if neither. Half-precision inputs tell
    the two apart; it is read once from torch itself, on the CPU (every machine has one)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(256, generator=gen)).bfloat16()
    y = torch.rms_norm(x, (256,), w, 1e-6)
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    before, after = (n * w.float()).bfloat16(), n.bfloat16() * w
    if torch.equal(y, before) and not torch.equal(y, after):
        return False
    if torch.equal(y, after) and not torch.equal(y, before):
        return True
    return None


def _torch_rms_norm_arguments(node: fx.Node) -> dict:
    arguments = {"weight": None, "eps": None, **dict(zip(_TORCH_RMS_NORM_PARAMETERS, node.args))}
    arguments.update(node.kwargs)
    return arguments


def _last_dim_only(normalized_shape, h: fx.Node) -> bool:
    """normalized_shape is (width,) of h's last dimension (the kernel normalizes rows)."""
    if not isinstance(normalized_shape, (list, tuple)) or len(normalized_shape) != 1:
        return False
    width = g.static_int(g.tensor(h).shape[-1])
    return width is not None and normalized_shape[0] == width


def _torch_search(with_residual: bool):
    """torch.rms_norm's call, with the residual add before it fused or without one."""

    def search(node: fx.Node) -> Match | None:
        if not is_torch_rms_norm(node):
            return None
        arguments = _torch_rms_norm_arguments(node)
        h, weight, eps = arguments["input"], arguments["weight"], arguments["eps"]
        if g.tensor(h) is None or (weight is not None and not isinstance(weight, fx.Node)):
            return None
        residual = _residual_operands(h)
        if (residual is not None) != with_residual:
            return None
        if not _last_dim_only(arguments["normalized_shape"], h):
            raise NearMiss("torch.rms_norm over more than the last dimension (the kernel normalizes rows)")
        if eps is None:
            # torch's default for float32/float16/bfloat16 inputs: the eps of the fp32 statistics
            eps = torch.finfo(torch.float32).eps
        elif not g.scalar(eps)[0]:
            raise NearMiss("eps is a tensor, not a constant or a scalar graph input")
        after_cast = torch_rms_norm_weight_after_cast()
        if after_cast is None:
            raise NearMiss("this torch's rms_norm applies its weight in neither known order")
        return Match(
            variant=TORCH_FORM if residual else f"{TORCH_FORM}_no_residual",
            anchor=node,
            nodes=[node, *([h] if residual else [])],
            bindings=dict(
                h=h,
                residual=residual,
                y=node,
                weight=weight,
                eps=eps,
                weight_offset=0.0,
                # in float32 both orders compute the same; in half dtypes the rounding differs
                weight_after_cast=weight is not None and after_cast and g.dtype(h) != torch.float32,
            ),
        )

    return search


# ---------------------------------------------------------------------------------------------
# guards


device_supported = g.device_supported(lambda b: b["h"])


def dtypes_agree(m: Match, cfg) -> str | None:
    b = m.bindings
    dtype = g.dtype(b["h"])
    if dtype not in g.FLOAT_DTYPES:
        return f"input dtype {dtype} is not float32/float16/bfloat16"
    if g.dtype(b["y"]) != dtype:
        return f"output dtype {g.dtype(b['y'])} differs from input dtype {dtype} (mixed-dtype math)"
    weight = b["weight"]
    if weight is not None:
        wdtype = g.dtype(weight)
        if wdtype not in g.FLOAT_DTYPES:
            return f"weight dtype {wdtype} is not a float dtype"
        if b["weight_after_cast"] and wdtype != dtype:
            return f"weight dtype {wdtype} differs from input dtype {dtype}"
    return None


def weight_is_per_channel(m: Match, cfg) -> str | None:
    weight = m.bindings["weight"]
    if weight is None:
        return None
    wt = g.tensor(weight)
    width = g.tensor(m.bindings["h"]).shape[-1]
    if wt is None or wt.dim() != 1 or wt.shape[0] != width:
        shape = None if wt is None else tuple(wt.shape)
        return f"weight of shape {shape} is not one value per channel ({width},)"
    return None


@dataclasses.dataclass(frozen=True)
class Options:
    """The bounds of rms_norm_residual's cost rules (`WIDTH`, `MEASURED`)."""

    min_width: int = option(512, "narrowest row fused (per-head q/k norms are at most 256 wide)")
    max_width: int = option(8192, "widest row fused in inference")
    train_max_width: int = option(8192, "widest row fused where the norm is differentiated")
    min_speedup: float = option(1.0, "least plain / fusionpass, at the nearest measured row width, to fuse (0: any)")


FIELDS = fields(Options)


# The cost rules. Inside the widest and narrowest rows measured, each mode takes the row widths
# whose nearest measured class was faster than plain compile (cost_table.py, generated from
# benchmarks/results/latest/rms_norm_widths.md). Per-head q/k norms (rows of one head, narrower
# than min_width) stay with Inductor, which fuses them with the rotation after them: the measured
# class of such rows times the norm alone, not against that fused code. Rows the forward kernel
# runs in two chunks with a partial second one (kernels/common.py, TWO_PASS_FWD) stay with
# Inductor in inference.
WIDTH = Range(
    "row width",
    training=(FIELDS.min_width, FIELDS.train_max_width),
    inference=(FIELDS.min_width, FIELDS.max_width),
)
MEASURED = Measured("row width", cost_table.SPEEDUPS, cost_table.SOURCE, FIELDS.min_speedup)
PARTIAL_CHUNK = Excluded(
    "row width", TWO_PASS_FWD[0] + 1, TWO_PASS_FWD[1] - 1,
    "the forward's second chunk is partial", modes=("inference",),
)


def width_in_range(m: Match, cfg) -> str | None:
    width = g.static_int(g.tensor(m.bindings["h"]).shape[-1])
    if width is None:
        return "row width is symbolic (the kernel is specialized on it)"
    training = mode(bool(getattr(g.tensor(m.bindings["y"]), "requires_grad", False)))
    return width_rule(width, training, cfg)


def width_rule(width: int, mode: str, cfg=None) -> str | None:
    """Why rows of `width` are not fused in `mode` (None: they are), by the cost rules."""
    return WIDTH.check(width, mode, cfg) or MEASURED.check(width, mode, cfg) or PARTIAL_CHUNK.check(width, mode, cfg)


def rows_contiguous(m: Match, cfg) -> str | None:
    b = m.bindings
    tensors = [b["h"], *(b["residual"] or ())]
    for node in tensors:
        if not g.last_dim_contiguous(g.tensor(node)):
            return f"{node.name} is not contiguous in its last dimension"
    return None


def intermediates_private(m: Match, cfg) -> str | None:
    keep = [m.bindings["y"], m.bindings["h"]]
    leaked = g.escaping(m.nodes, keep=keep)
    if leaked:
        return f"intermediate {', '.join(sorted(n.name for n in leaked))} is used elsewhere"
    return None


# ---------------------------------------------------------------------------------------------
# replacement


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    b = m.bindings
    y = b["y"]
    flags = (b["eps"], b["weight_offset"], b["weight_after_cast"])
    if b["residual"]:
        a, r = b["residual"]
        fused = g.insert_call(
            graph, y, torch.ops.fusionpass.rms_norm_residual.default, (a, r, b["weight"], *flags), y
        )
        new_y, new_h, _ = g.insert_getitems(graph, fused, 3)
        b["h"].replace_all_uses_with(new_h)
    else:
        fused = g.insert_call(
            graph, y, torch.ops.fusionpass.rms_norm.default, (b["h"], b["weight"], *flags), y
        )
        new_y, _ = g.insert_getitems(graph, fused, 2)
    y.replace_all_uses_with(new_y)
    g.erase_unused(graph, m.nodes)


RMS_NORM_RESIDUAL = registry.register(
    Fusion(
        name="rms_norm_residual",
        summary="RMSNorm (Llama/Mistral/Qwen/Phi-3, Gemma's `1 + w`, T5, `nn.RMSNorm`) with the residual add before it",
        options=Options,
        settings_prefix="rms_norm",
        cost=(WIDTH, MEASURED, PARTIAL_CHUNK, NOT_AUTOTUNED_TRAINING),
        matches=(
            "RMSNorm (HF Llama/Mistral/Qwen2/Qwen3/Phi-3 `w * n.to(dtype)`, Gemma `1 + w` in fp32, "
            "T5, plain fp32; torch_rms_norm: `nn.RMSNorm` / `F.rms_norm`, torchtitan's), with the "
            "residual add before it fused when there is one (variants <form>; without one: "
            "<form>_no_residual); the sum is returned for the next residual"
        ),
        selected_when=(
            "CUDA tensors, float32/float16/bfloat16 without dtype mixing (but for autocast's residual "
            "stream: a 16-bit sublayer output added to an fp32 residual), constant eps, "
            "per-channel weight; training: the norm is differentiated"
        ),
        anchor=lambda node: g.is_op(node, "rsqrt") or is_torch_rms_norm(node),
        dtensor=True,  # sharding rules in fusions/rms_norm_residual/op.py (rows sharded, the weight replicated)
        variants=(
            *(
                Variant(f"{name}{suffix}", _search(name, form, residual))
                for name, form in OUTPUT_FORMS
                for suffix, residual in (("", True), ("_no_residual", False))
            ),
            Variant(TORCH_FORM, _torch_search(True)),
            Variant(f"{TORCH_FORM}_no_residual", _torch_search(False)),
        ),
        guards=(
            Guard("device", device_supported),
            Guard("dtype", dtypes_agree),
            Guard("weight_shape", weight_is_per_channel),
            Guard("width", width_in_range),
            Guard("strides", rows_contiguous),
            Guard("intermediates", intermediates_private),
        ),
        replace=replace,
        unmatched="rsqrt found, but not an RMSNorm form (mean of squares over the last dim, "
        "times its input, then a known weight form)",
    )
)
