"""swiglu_mlp: the gated MLP `down(act(gate(x)) * up(x))`, without the down projection.

The match starts at the product h = act(g) * u (either operand order), where
    g = F.linear(x, W_gate, b_gate),  u = F.linear(x, W_up, b_up)           HF Llama/Mistral/Qwen2/Gemma
or  gu = F.linear(x, W, b);  g, u = gu.chunk(2, dim=-1)                     Phi-3 (`gate_up_proj`)
and act is F.silu or F.gelu(approximate="tanh") (Gemma's `gelu_pytorch_tanh`), as Dynamo records
them. h is replaced by fusionpass::swiglu(x, W_gate, b_gate, W_up, b_up, act)[0]; Phi-3's fused
weight is passed as two row slices (views). In inference the down projection stays a library GEMM
reading h; in training it joins the op (below).

Cost rule (ROWS; why: benchmarks/results/latest/swiglu_mlp.md): in inference, selected for
decode-sized rows, at most the decode kernel's rows (fusions/swiglu_mlp/kernels.py, DECODE_MAX_M) known
statically, where one kernel reads both weights once; for more rows the library GEMMs with
Inductor's fused act*mul are as fast. Config.swiglu_mlp_kernel (FUSIONPASS_SWIGLU_MLP_KERNEL=1)
selects it everywhere it matches.

In training (RECOMPUTE, Config.swiglu_mlp_recompute_product, on by default) the op replaces the
down projection too: fusionpass::swiglu_down(x, ..., W_down, b_down, act)[0] takes the down
linear's place, and its backward recomputes h from g and u instead of keeping it (fusions/swiglu_mlp/op.py):
one ffn-wide tensor per token fewer kept for the backward, for one elementwise pass
(benchmarks/results/memory/). Without it (=0), training keeps Inductor's code, whose partitioner
keeps h next to g and u.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
from torch import fx

from fusionpass import registry
from fusionpass.cost import NOT_AUTOTUNED_TRAINING, Range, Switch, fields, mode
from fusionpass.fusions.swiglu_mlp.kernels import DECODE_MAX_M
from fusionpass.patterns import graph as g
from fusionpass.registry import Fusion, Guard, Match, Variant, option

_LINEAR = (F.linear, torch._C._nn.linear)
_SILU = (F.silu,)
_GELU = (F.gelu, torch._C._nn.gelu)
SUPPORTED = ("silu", "gelu_tanh")

@dataclasses.dataclass(frozen=True)
class Options:
    """swiglu_mlp: by default decode-sized inference goes to fusionpass::swiglu (ROWS) and training
    to fusionpass::swiglu_down (RECOMPUTE)."""

    kernel: bool = option(False, "route every match (prefill, training) to fusionpass::swiglu")
    recompute_product: bool = option(
        True, "training: fuse the down projection too and recompute act(g) * u in the backward "
        "(one ffn-wide tensor per token fewer kept for the backward)")


FIELDS = fields(Options)


# The cost rules (module docstring): decode-sized inference, and training with the down projection
ANY_SIZE = Switch(FIELDS.kernel)
# training with the down projection in the op (module docstring)
RECOMPUTE = Switch(FIELDS.recompute_product, "training matches, with the down projection")
ROWS = Range("rows", training=None, inference=(None, DECODE_MAX_M))
ANYWAY = "swiglu_mlp_kernel=True / FUSIONPASS_SWIGLU_MLP_KERNEL=1 selects it anyway"


def _call(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def activation(node) -> str | None:
    """The activation a node applies to its first argument: "silu", "gelu_tanh", or the name of
    a variant without a kernel (exact GELU, in-place SiLU); None if it is none of these."""
    if _call(node, _SILU):
        if len(node.args) != 1 or node.kwargs.get("inplace", False) or set(node.kwargs) - {"inplace"}:
            return "silu(inplace)"
        return "silu"
    if _call(node, _GELU):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return "gelu_tanh" if approximate == "tanh" else f"gelu(approximate={approximate!r})"
    return None


def _linear_parts(node):
    """(x, weight, bias) of `F.linear(x, weight, bias)` with a 2-D weight, else None."""
    if not _call(node, _LINEAR):
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    x = node.kwargs.get("input", args[0])
    w = node.kwargs.get("weight", args[1])
    b = node.kwargs.get("bias", args[2])
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node):
        return None
    if b is not None and not isinstance(b, fx.Node):
        return None
    wt = g.tensor(w)
    if wt is None or wt.dim() != 2:
        return None
    return x, w, b


def anchor(node) -> bool:
    """A product with an activation on one side."""
    if not g.is_op(node, "mul"):
        return False
    return any(activation(a) is not None for a, _ in g.commuted(node))


def _operands(mul: fx.Node):
    """(act node, act name, up) of act(gate) * up, else None."""
    for a, up in g.commuted(mul):
        name = activation(a)
        if name is not None and isinstance(up, fx.Node):
            return a, name, up
    return None


# ---------------------------------------------------------------------------------------------
# forms


def _separate(mul: fx.Node, act: fx.Node, up: fx.Node):
    """gate(x), up(x): two linears of one x."""
    gate = g.first_arg(act)
    gp, upp = _linear_parts(gate), _linear_parts(up)
    if gp is None or upp is None or gp[0] is not upp[0]:
        return None
    x, w_gate, b_gate = gp
    _, w_up, b_up = upp
    return {"x": x, "w_gate": w_gate, "b_gate": b_gate, "w_up": w_up, "b_up": b_up, "split": None}, [gate, up]


def _chunk_parts(item):
    """(linear node, index) if item = linear(...).chunk(2, dim=-1)[index]."""
    if not _call(item, (operator.getitem,)) or not isinstance(item.args[1], int):
        return None
    chunk = item.args[0]
    is_method = isinstance(chunk, fx.Node) and chunk.op == "call_method" and chunk.target == "chunk"
    if not (is_method or _call(chunk, (torch.chunk,))):
        return None
    args = list(chunk.args[1:])
    kwargs = dict(chunk.kwargs)
    chunks = kwargs.pop("chunks", args.pop(0) if args else None)
    dim = kwargs.pop("dim", args.pop(0) if args else 0)
    if args or kwargs or chunks != 2:
        return None
    t = g.tensor(chunk.args[0])
    if t is None or dim not in (-1, t.dim() - 1):
        return None
    width = g.static_int(t.shape[-1])
    if width is None or width % 2:
        return None
    return chunk.args[0], chunk, item.args[1] % 2, width // 2


def _gate_up(mul: fx.Node, act: fx.Node, up: fx.Node):
    """Phi-3: gate, up = gate_up_proj(x).chunk(2, dim=-1)."""
    gp, upp = _chunk_parts(g.first_arg(act)), _chunk_parts(up)
    if gp is None or upp is None or gp[1] is not upp[1] or gp[2] == upp[2]:
        return None
    linear, chunk, gate_index, half = gp
    parts = _linear_parts(linear)
    if parts is None:
        return None
    x, w, b = parts
    return (
        {"x": x, "w_gate": w, "b_gate": b, "w_up": w, "b_up": b, "split": (gate_index, half)},
        [linear, chunk, g.first_arg(act), up],
    )


FORMS = {"": _separate, "_gate_up": _gate_up}


def _search(suffix: str, acts):
    form = FORMS[suffix]

    def search(mul: fx.Node) -> Match | None:
        operands = _operands(mul)
        if operands is None:
            return None
        act, name, up = operands
        if (name in SUPPORTED) if acts is None else (name not in acts):
            return None
        found = form(mul, act, up)
        if found is None:
            return None
        bindings, nodes = found
        bindings.update(activation=name, h=mul)
        variant = f"{name if name in SUPPORTED else 'other_activation'}{suffix}"
        return Match(variant=variant, anchor=mul, nodes=[mul, act, *nodes], bindings=bindings)

    return search


# ---------------------------------------------------------------------------------------------
# guards


device_supported = g.device_supported(lambda b: b["x"])


def decode_rows(m: Match, cfg) -> str | None:
    """ROWS: decode-sized inference, rows known statically; unless swiglu_mlp_kernel."""
    if ANY_SIZE.on(cfg):
        return None
    x = g.tensor(m.bindings["x"])
    k = g.static_int(x.shape[-1])
    rows = g.sizes(x.numel() // k) if k else None
    training = mode(g.tensor(m.bindings["h"]).requires_grad)
    if training == "training" and RECOMPUTE.on(cfg):
        return None
    if training == "training":
        why = ROWS.check(1, training, cfg)
    elif rows is None:
        why = "rows the cost rule cannot read"
    else:
        # the op itself takes the decode kernel only up to DECODE_MAX_M rows and the library GEMMs
        # above (fusions/swiglu_mlp/op.py), as fast as Inductor's there: symbolic rows that may be
        # decode-sized are selected, a run-time choice at every size the graph takes
        why = ROWS.check(rows.lo, training, cfg)
        if why is not None and rows.lo != rows.hi:
            why = f"{why} (symbolic rows {rows.show()})"
    return None if why is None else f"{why}; {ANYWAY}"


def activation_supported(m: Match, cfg) -> str | None:
    name = m.bindings["activation"]
    if name not in SUPPORTED:
        return f"activation {name} has no kernel variant (silu, gelu_tanh)"
    return None


def dtypes_agree(m: Match, cfg) -> str | None:
    b = m.bindings
    dtype = g.dtype(b["x"])
    if dtype not in g.FLOAT_DTYPES:
        return f"input dtype {dtype} is not float32/float16/bfloat16"
    for key in ("w_gate", "b_gate", "w_up", "b_up", "h"):
        node = b[key]
        if node is not None and g.dtype(node) != dtype:
            return f"{key} dtype {g.dtype(node)} differs from input dtype {dtype} (mixed-dtype math)"
    return None


def shapes_supported(m: Match, cfg) -> str | None:
    b = m.bindings
    k = g.static_int(g.tensor(b["x"]).shape[-1])
    wg, wu = g.tensor(b["w_gate"]), g.tensor(b["w_up"])
    if k is None:
        return "input width is symbolic"
    if b["split"] is None and (wg.shape != wu.shape or (b["b_gate"] is None) != (b["b_up"] is None)):
        return "gate and up projections differ in shape or in having a bias"
    for w in (wg, wu):
        if g.static_int(w.shape[1]) != k or g.static_int(w.shape[0]) is None:
            return f"weight of shape {tuple(w.shape)} does not take {k} inputs"
    return None


# torch 2.11's Inductor fails to compile a user-defined Triton kernel given a static integer of
# 2^31 or more (signature_of -> has_hint on a plain int: AttributeError 'xreplace'). The act·mul
# kernels take the product's rows and width, not its element count (seen failing at 8B widths when
# they took the count: benchmarks/results/memory/training.md), so only a factor that large stays
# with Inductor's MLP.
MAX_FACTOR = 2**31 - 1


def factors_fit_int32(m: Match, cfg) -> str | None:
    shape = g.tensor(m.bindings["h"]).shape
    width = g.static_int(shape[-1]) if len(shape) else 1
    numel = g.static_int(g.tensor(m.bindings["h"]).numel())
    rows = numel // width if numel is not None and width else None
    big = [f"{what} {n}" for what, n in (("rows", rows), ("width", width)) if n is not None and n > MAX_FACTOR]
    if big:
        return (f"the product's {' and '.join(big)} over 2^31 - 1: Inductor (torch 2.11) cannot pass "
                "an integer that large to a Triton kernel")
    return None


def intermediates_private(m: Match, cfg) -> str | None:
    leaked = g.escaping(m.nodes, keep=[m.bindings["h"]])
    if leaked:
        return f"intermediate {', '.join(sorted(n.name for n in leaked))} is used elsewhere"
    return None


def feeds_down_projection(m: Match, cfg) -> str | None:
    """The product is read by one linear (the down projection) and nothing else."""
    h = m.bindings["h"]
    users = list(h.users)
    if len(users) != 1 or (parts := _linear_parts(users[0])) is None or parts[0] is not h:
        return "the product is used elsewhere than as the input of one down projection"
    return None


# ---------------------------------------------------------------------------------------------
# replacement


def _row_slice(graph, weight, start, length, like):
    if weight is None:
        return None
    return g.insert_call(graph, like, torch.narrow, (weight, 0, start, length), like)


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    b = m.bindings
    h = b["h"]
    w_gate, b_gate, w_up, b_up = b["w_gate"], b["b_gate"], b["w_up"], b["b_up"]
    if b["split"] is not None:
        gate_index, half = b["split"]
        up_index = 1 - gate_index
        w_gate = _row_slice(graph, b["w_gate"], gate_index * half, half, h)
        b_gate = _row_slice(graph, b["b_gate"], gate_index * half, half, h)
        w_up = _row_slice(graph, b["w_up"], up_index * half, half, h)
        b_up = _row_slice(graph, b["b_up"], up_index * half, half, h)
    if _with_down_projection(m, cfg):
        down = next(iter(h.users))  # the one down linear (guard down_projection)
        _, w_down, b_down = _linear_parts(down)
        fused = g.insert_call(
            graph, down, torch.ops.fusionpass.swiglu_down.default,
            (b["x"], w_gate, b_gate, w_up, b_up, w_down, b_down, b["activation"]), down,
        )
        y, _, _ = g.insert_getitems(graph, fused, 3)
        down.replace_all_uses_with(y)
        g.erase_unused(graph, [down, *m.nodes])
        return
    fused = g.insert_call(
        graph, h, torch.ops.fusionpass.swiglu.default,
        (b["x"], w_gate, b_gate, w_up, b_up, b["activation"]), h,
    )
    new_h, _, _ = g.insert_getitems(graph, fused, 3)
    h.replace_all_uses_with(new_h)
    g.erase_unused(graph, m.nodes)


def _with_down_projection(m: Match, cfg) -> bool:
    """Training with swiglu_mlp_recompute_product: the down projection goes into the op."""
    return RECOMPUTE.on(cfg) and g.tensor(m.bindings["h"]).requires_grad


VARIANTS = (
    Variant("silu", _search("", ("silu",))),
    Variant("gelu_tanh", _search("", ("gelu_tanh",))),
    Variant("silu_gate_up", _search("_gate_up", ("silu",))),
    Variant("gelu_tanh_gate_up", _search("_gate_up", ("gelu_tanh",))),
    # recognised MLPs with an activation the kernels lack: reported by the activation guard
    Variant("other_activation", _search("", None), reports_only=True),
    Variant("other_activation_gate_up", _search("_gate_up", None), reports_only=True),
)


SWIGLU_MLP = registry.register(
    Fusion(
        name="swiglu_mlp",
        summary="`act(gate(x)) * up(x)` into the down projection (SiLU, GELU-tanh, Phi-3's fused gate_up)",
        options=Options,
        cost=(ANY_SIZE, RECOMPUTE, ROWS, NOT_AUTOTUNED_TRAINING),
        matches=(
            "the gated MLP act(gate(x)) * up(x) (HF Llama/Mistral/Qwen2 SiLU, Gemma GELU-tanh, "
            "Phi-3's fused gate_up_proj + chunk), with or without biases; the down projection "
            "joins the op in training and stays a library GEMM in inference"
        ),
        selected_when=(
            "rows known statically, CUDA tensors, one float dtype for x, weights and biases, SiLU or "
            "GELU-tanh"
        ),
        anchor=anchor,
        variants=VARIANTS,
        guards=(
            Guard("device", device_supported),
            Guard("cost", decode_rows),
            Guard("activation", activation_supported),
            Guard("dtype", dtypes_agree),
            Guard("shape", shapes_supported),
            Guard("size", factors_fit_int32),
            Guard("intermediates", intermediates_private),
            Guard("down_projection", feeds_down_projection),
        ),
        replace=replace,
        unmatched="a product with an activation on one side, but not act(gate(x)) * up(x) of "
        "linears of one x (or of one linear's two chunks)",
    )
)
