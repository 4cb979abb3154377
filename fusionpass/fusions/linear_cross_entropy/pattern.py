"""linear_cross_entropy: the lm_head projection and the cross-entropy loss over its logits.

The match starts at `F.cross_entropy(input, target, ...)` and walks back from `input` to the
projection through the ops models put between them, in any order:
    z  = linear(h, W[, b])            lm_head / F.linear / nn.Linear        (or h @ W.t(), W.T)
    z  = tanh(z / c) * c              logit soft-capping (Gemma-2 `final_logit_softcapping`)
    z  = z[..., :-1, :]               the older shift-logits form
    z  = z.float() / z.to(float32)    exact upcasts (HF ForCausalLMLoss) and no-op casts
    z  = z.view(-1, V) / reshape / flatten / contiguous     (row order is kept)
transformers 5.17 writes (ForCausalLMLoss): `logits = lm_head(h[:, slice]); logits.float()`,
labels padded with -100 and shifted, `view(-1, V)`, `cross_entropy(ignore_index=-100,
reduction="mean")`, or `reduction="sum"` followed by `/ num_items_in_batch` (the division stays in
the graph: autograd hands it to the op's backward as grad_output). The older shift-logits form
(`logits[..., :-1, :]` against `labels[..., 1:]`) becomes the same computation over every row of h
with the labels padded by one ignored position at the end of each sequence (exact for "mean" and
"sum": the same tokens count).

The logits of the model dtype (after the soft-cap when there is one) may also be returned by the
graph, as HF models do, also as an fp32 copy (accelerate's `convert_outputs_to_fp32` under the
Trainer's mixed precision), where they need no gradient (evaluation): the op then writes them once,
in the model dtype. The op's logits are non-differentiable (their gradient would be the [N, V]
tensor the op avoids), so returned logits that require grad are a near miss: a caller may add a
second loss on them (distillation, a z-loss), whose gradient would otherwise be dropped without an
error. A training loop that reads only the loss compiles `fusionpass.loss_only(model)`, as the
Trainer integration does (fusionpass/hf_trainer.py). Any other use of the logits or of the fp32
copy is a near miss: the op never materializes them otherwise.

When the logits reach the loss as an input of the graph, the projection happened in another graph
(a graph break; GPT-2 without `model.loss_type = "ForCausalLM"` computes its loss outside the
model's graph): a near miss says so.
"""
from __future__ import annotations

import builtins
import dataclasses
import inspect
import operator

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fusionpass import registry
from fusionpass.causal_lm import why_not_standard
from fusionpass.cost import Either, Measured, Range, fields, mode
from fusionpass.fusions.linear_cross_entropy import cost_table
from fusionpass.patterns import graph as g
from fusionpass.patterns.softcap import literal, softcap_of
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant, option

_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_LINEAR = (torch._C._nn.linear,)  # F.linear is the same builtin
_MATMUL = (operator.matmul, torch.matmul, torch.mm)
_RESHAPE_METHODS = ("view", "reshape", "flatten", "contiguous")
_RESHAPE_FUNCTIONS = (torch.reshape, torch.flatten)
ANOTHER_GRAPH = (
    "logits come from another graph (they are an input of this one, e.g. after a graph break); "
    "set model.loss_type = 'ForCausalLM' for GPT-2"
)


def is_cross_entropy(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is F.cross_entropy


def cross_entropy_arguments(node: fx.Node) -> dict:
    bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


# ---------------------------------------------------------------------------------------------
# the ops between the projection and the loss


def _same_shape(a, b) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    return all(statically_known_true(x == y) for x, y in zip(a, b))


def _is_reshape(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _RESHAPE_METHODS) or (
        node.op == "call_function" and node.target in _RESHAPE_FUNCTIONS
    )


def _keeps_rows(node: fx.Node) -> fx.Node | None:
    """The input of a view/reshape/flatten/contiguous that keeps the last dimension (so the
    row-major order of the rows), else None."""
    if not _is_reshape(node):
        return None
    src = g.first_arg(node)
    src_t, out_t = g.tensor(src), g.tensor(node)
    if src_t is None or out_t is None or src_t.dim() == 0 or out_t.dim() == 0:
        return None
    if node.target == "contiguous":
        return src
    if not statically_known_true(src_t.shape[-1] == out_t.shape[-1]):
        return None
    return src


def _exact_cast(node: fx.Node) -> fx.Node | None:
    """The input of a cast that changes no value: an upcast to fp32 or a same-dtype/device move."""
    src = g.cast_source(node)
    if src is None:
        return None
    if g.dtype(node) == g.dtype(src):
        return src
    if g.dtype(node) == torch.float32 and g.dtype(src) in g.FLOAT_DTYPES:
        return src
    raise NearMiss(f"logits are cast from {g.dtype(src)} to {g.dtype(node)} before the loss")


def _is_shift(node: fx.Node) -> fx.Node | None:
    """The input of `x[..., :-1, :]` (all of every dim but the second-to-last, which drops its
    last position), else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    src, index = node.args
    t = g.tensor(src)
    if t is None or t.dim() < 2:
        return None
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = (slice(None),) * (t.dim() - len(index) + 1)
        index = index[:at] + fill + index[at + 1:]
    index = index + (slice(None),) * (t.dim() - len(index))
    if len(index) != t.dim() or not all(isinstance(i, slice) for i in index):
        return None
    full = slice(None)
    for dim, s in enumerate(index):
        if dim == t.dim() - 2:
            if not (s.start in (None, 0) and s.stop == -1 and s.step in (None, 1)):
                return None
        elif not (s.start in (None, 0) and s.stop is None and s.step in (None, 1)) and s != full:
            return None
    return src


def _transposed_weight(node) -> fx.Node | None:
    """W of `W.t()`, `W.T`, `W.mT`, `W.transpose(0, 1)`, `torch.t(W)` for a 2-D W."""
    if not isinstance(node, fx.Node):
        return None
    method, function, args = node.op == "call_method", node.op == "call_function", node.args
    transposes = (
        (method and node.target == "t" and len(args) == 1)
        or (function and node.target is torch.t and len(args) == 1)
        or (function and node.target is builtins.getattr and args[1] in ("T", "mT"))
        or (method and node.target == "transpose" and len(args) == 3
            and all(isinstance(d, int) for d in args[1:]) and {args[1] % 2, args[2] % 2} == {0, 1})
    )
    src = args[0] if transposes else None
    t = g.tensor(src)
    return src if t is not None and t.dim() == 2 else None


def _head(node: fx.Node):
    """(kind, h, W, b) when node is the vocabulary projection, else None."""
    if node.op == "call_function" and node.target in _LINEAR:
        args = list(node.args) + [None] * (3 - len(node.args))
        h = node.kwargs.get("input", args[0])
        w = node.kwargs.get("weight", args[1])
        b = node.kwargs.get("bias", args[2])
        return "linear", h, w, b
    is_mm = (node.op == "call_function" and node.target in _MATMUL) or (
        node.op == "call_method" and node.target == "matmul"
    )
    if is_mm and len(node.args) == 2 and not node.kwargs:
        w = _transposed_weight(node.args[1])
        if w is not None:
            return "matmul", node.args[0], w, None
    return None


@dataclasses.dataclass
class _Chain:
    kind: str  # "linear" | "matmul"
    head: fx.Node
    h: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    nodes: list  # head .. CE input
    logits: fx.Node | None  # the node whose value the op's logits output can stand for
    softcap: float
    softcap_rounded: bool
    shift: fx.Node | None
    upcast: bool  # a cast to fp32 sits between projection and loss


def _walk(node: fx.Node) -> _Chain | None:
    """From the CE input back to the projection."""
    nodes = []
    softcap = None
    shift = None
    upcast = False
    while True:
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            raise NearMiss(ANOTHER_GRAPH)
        head = _head(node)
        if head is not None:
            break
        nodes.append(node)
        src = _keeps_rows(node)
        if src is None:
            src = _exact_cast(node)
            if src is not None and g.dtype(node) == torch.float32:
                upcast = True
        if src is None:
            src = _is_shift(node)
            if src is not None:
                if shift is not None:
                    return None
                shift = node
        if src is None:
            capped = softcap_of(node)
            if capped is not None:
                if softcap is not None:
                    return None
                src, c, cap_nodes = capped
                softcap = (c, node)
                nodes.extend(cap_nodes[1:])
        if src is None:
            return None
        node = src
    kind, h, w, b = head
    nodes.append(node)
    if softcap is None:
        logits, c, rounded = node, 0.0, False
    else:
        c, mul = softcap
        rounded = g.dtype(mul) != torch.float32
        # the capped logits stand for the op's output when they are in the model dtype
        logits = mul if g.dtype(mul) == g.dtype(node) else None
    return _Chain(kind, node, h, w, b, list(dict.fromkeys(reversed(nodes))), logits, c, rounded,
                  shift, upcast)


def _shift_labels(target: fx.Node, shift: fx.Node):
    """(labels, nodes): the labels of the shifted rows with their sequence dimension back (through
    view/reshape/flatten/contiguous and no-op casts), so that padding one ignored position at the
    end of each sequence aligns them with every row of h."""
    want = tuple(g.tensor(shift).shape[:-1])
    node, nodes = target, []
    while isinstance(node, fx.Node):
        t = g.tensor(node)
        if t is not None and _same_shape(tuple(t.shape), want):
            return node, nodes
        nodes.append(node)
        if _is_reshape(node):
            src = g.first_arg(node)
        else:
            src = g.cast_source(node)
            if src is not None and g.dtype(src) != g.dtype(node):
                src = None
        node = src
    raise NearMiss("shift-logits form: the labels of the shifted rows cannot be traced back to "
                   "their [..., seq - 1] shape")


def _search(variant: str, accepts):
    def search(ce: fx.Node) -> Match | None:
        args = cross_entropy_arguments(ce)
        chain = _walk(args["input"])
        if chain is None or not accepts(chain):
            return None
        labels, label_nodes = args["target"], []
        if chain.shift is not None:
            labels, label_nodes = _shift_labels(args["target"], chain.shift)
        logits_t = g.tensor(chain.head)
        grad = logits_t is not None and logits_t.requires_grad

        def needs(node):
            t = g.tensor(node)
            return bool(grad and t is not None and t.requires_grad)

        return Match(
            variant=variant,
            anchor=ce,
            nodes=[*chain.nodes, ce],
            bindings={
                "chain": chain,
                "ce_args": args,
                "labels": labels,
                "label_nodes": label_nodes,
                "training": bool(grad),  # the logits require grad: a differentiated graph
                "return_logits": chain.logits is not None
                and any(_returned(u, chain.logits) for u in chain.logits.users),
                "need_dh": needs(chain.h),
                "need_dw": needs(chain.weight),
                "need_db": chain.bias is not None and needs(chain.bias),
            },
        )

    return search


# variant name -> which walked chains it claims (the first that accepts a chain counts it)
VARIANTS = (
    ("softcap", lambda c: c.softcap != 0.0),  # Gemma-2 final_logit_softcapping
    ("shift_logits", lambda c: c.shift is not None),  # logits[..., :-1, :] vs labels[..., 1:]
    ("matmul", lambda c: c.kind == "matmul"),  # h @ W.t()
    ("float_logits", lambda c: c.upcast),  # HF ForCausalLMLoss: logits.float()
    ("model_dtype_logits", lambda c: True),  # BERT/T5 CrossEntropyLoss, plain code
)


# ---------------------------------------------------------------------------------------------
# guards


device_supported = g.device_supported(lambda b: b["chain"].h)


def dtypes_agree(m: Match, cfg) -> str | None:
    chain = m.bindings["chain"]
    dtype = g.dtype(chain.h)
    if dtype not in g.FLOAT_DTYPES:
        return f"hidden states dtype {dtype} is not float32/float16/bfloat16"
    for name, node in (("weight", chain.weight), ("bias", chain.bias)):
        if node is not None and g.dtype(node) != dtype:
            return f"{name} dtype {g.dtype(node)} differs from hidden states dtype {dtype}"
    if g.dtype(chain.head) != dtype:
        return f"the projection computes {g.dtype(chain.head)} logits from {dtype} inputs (autocast)"
    loss_in = g.dtype(m.bindings["ce_args"]["input"])
    if loss_in not in (dtype, torch.float32):
        return f"the loss reads logits of dtype {loss_in} (model dtype {dtype})"
    labels = g.dtype(m.bindings["ce_args"]["target"])
    if labels not in (torch.int64, torch.int32):
        return f"target dtype {labels}: class indices (int64) only, not probabilities"
    return None


def no_class_weight(m: Match, cfg) -> str | None:
    args = m.bindings["ce_args"]
    if args["weight"] is not None:
        return "per-class weights are not supported"
    return None


def reduction_known(m: Match, cfg) -> str | None:
    args = m.bindings["ce_args"]
    if args["size_average"] is not None or args["reduce"] is not None:
        return "legacy size_average/reduce arguments"
    if args["reduction"] not in ("mean", "sum"):
        return f"reduction {args['reduction']!r}: only 'mean' and 'sum' (per-token losses stay with Inductor)"
    return None


def ignore_index_constant(m: Match, cfg) -> str | None:
    value = m.bindings["ce_args"]["ignore_index"]
    if not isinstance(value, int) or isinstance(value, bool):
        return f"ignore_index {value!r} is not an integer constant"
    return None


def label_smoothing_constant(m: Match, cfg) -> str | None:
    value = m.bindings["ce_args"]["label_smoothing"]
    if literal(value) is None:
        return f"label_smoothing {value!r} is not a constant"
    if not 0.0 <= value <= 1.0:
        return f"label_smoothing {value} is outside [0, 1]"
    return None


def shapes_supported(m: Match, cfg) -> str | None:
    chain = m.bindings["chain"]
    w = g.tensor(chain.weight)
    h = g.tensor(chain.h)
    x = g.tensor(m.bindings["ce_args"]["input"])
    if w is None or h is None or x is None or w.dim() != 2 or h.dim() < 1:
        return "projection weight is not 2-D"
    vocab, width = (g.static_int(s) for s in w.shape)
    if vocab is None or width is None:
        return "vocabulary or hidden size is symbolic"
    if not statically_known_true(h.shape[-1] == width):
        return f"hidden states of width {h.shape[-1]} do not fit a [{vocab}, {width}] weight"
    if x.dim() != 2 or not statically_known_true(x.shape[1] == vocab):
        return f"the loss input has shape {tuple(x.shape)}, not [tokens, {vocab}]"
    if chain.bias is not None and tuple(g.tensor(chain.bias).shape) != (vocab,):
        return "bias is not one value per class"
    return None


@dataclasses.dataclass(frozen=True)
class Options:
    """The bounds of linear_cross_entropy's cost rule (`VOCAB`)."""

    min_vocab: int = option(100_000, "smallest vocabulary fused for its memory, faster or not")
    min_speedup: float = option(
        1.0, "below min_vocab: least plain / fusionpass, at the nearest measured vocabulary, to fuse (0: any)")


FIELDS = fields(Options)


# The cost rule. From min_vocab classes the logits the op never writes are most of the loss's
# peak memory, so it is selected there even where it is a little slower (LEANER); below, only
# where the nearest measured vocabulary was faster (FASTER: cost_table.py, generated from
# benchmarks/results/latest/linear_cross_entropy_vocabs.md, measured in training). Training is
# read from the logits: a graph under no_grad is inference, whatever its parameters require.
LEANER = Range.always("classes", FIELDS.min_vocab, None)
FASTER = Measured("classes", cost_table.SPEEDUPS, cost_table.SOURCE, FIELDS.min_speedup)
VOCAB = Either(LEANER, FASTER)


def vocab_large_enough(m: Match, cfg) -> str | None:
    chain = m.bindings["chain"]
    vocab = g.static_int(g.tensor(chain.weight).shape[0])
    return VOCAB.check(vocab, mode(m.bindings["training"]), cfg)


def _returned(user: fx.Node, logits: fx.Node) -> bool:
    """`user` returns the logits: the graph's output, or an exact upcast only the output reads
    (accelerate's `convert_outputs_to_fp32` around the forward under mixed precision)."""
    if user.op == "output":
        return True
    return (g.strip_upcasts(user) is logits and user is not logits
            and bool(user.users) and all(u.op == "output" for u in user.users))


RETURNED_WITH_GRAD = "returned with requires_grad"


def logits_private(m: Match, cfg) -> str | None:
    """Nodes of the chain are read only by the chain, except the model-dtype logits, which the
    graph may return where no gradient can reach them (then the op writes them). The op's logits
    are non-differentiable: a caller may build a second loss on returned logits that require
    grad (distillation, z-loss), and its gradient would be dropped without a word."""
    chain = m.bindings["chain"]
    inside = set(m.nodes)
    for node in chain.nodes:
        outside = [u for u in node.users if u not in inside]
        if not outside:
            continue
        if node is chain.logits and all(_returned(u, node) for u in outside):
            if m.bindings["training"]:
                return (f"logits ({node.name}) {RETURNED_WITH_GRAD}: the fused op's logits carry no "
                        "gradient; fusionpass.loss_only(model) drops them from the output")
            continue
        users = ", ".join(sorted(u.name for u in outside))
        what = "logits" if node is chain.logits or node is chain.head else "an intermediate of the logits"
        return f"{what} ({node.name}) also used by {users}: the fused op does not materialize them"
    return None


# ---------------------------------------------------------------------------------------------
# replacement


UNMATCHED = ("cross_entropy found, but its input is not a vocabulary projection's logits through "
             "known ops (soft-cap, [..., :-1, :], .float(), view/reshape)")


def unmatched(ce: fx.Node) -> str:
    """The near miss of a loss no variant matched. Logits that are a DTensor (loss_parallel's
    vocab-sharded Shard(-1)) reach the loss through DTensor's own ops, so no chain gets as far as
    the tensor-subclass rule; name the sharding here (docs/parallelism.md)."""
    subclass = g.tensor_subclass([ce])
    if subclass is not None:
        return (f"tensor subclass: {subclass}; a vocab-sharded loss (loss_parallel) needs the "
                "log-sum-exp across ranks, which linear_cross_entropy does not compute")
    return UNMATCHED


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    b = m.bindings
    chain, args = b["chain"], b["ce_args"]
    ce = m.anchor
    labels = b["labels"]
    if chain.shift is not None:
        labels = g.insert_call(
            graph, ce, torch._C._nn.pad, (labels, (0, 1), "constant", args["ignore_index"]), ce
        )
    op_args = (
        chain.h,
        chain.weight,
        chain.bias,
        labels,
        int(args["ignore_index"]),
        float(args["label_smoothing"]),
        float(chain.softcap),
        bool(chain.softcap_rounded),
        args["reduction"],
        # the loss's own dtype, not its input's: under autocast cross_entropy upcasts 16-bit logits
        # (an op of autocast's fp32 list) and returns an fp32 loss
        g.dtype(ce) == torch.float32,
        bool(b["return_logits"]),
        b["need_dh"],
        b["need_dw"],
        b["need_db"],
    )
    fused = g.insert_call(graph, ce, torch.ops.fusionpass.linear_cross_entropy.default, op_args, ce)
    loss, logits = g.insert_getitems(graph, fused, 2)
    ce.replace_all_uses_with(loss)
    if b["return_logits"]:
        chain.logits.replace_all_uses_with(logits, delete_user_cb=lambda u: _returned(u, chain.logits))
    g.erase_unused(graph, [ce, *reversed(chain.nodes), *b["label_nodes"]])


def loss_only_hint(model, out, near_misses, train: bool) -> str | None:
    """A training graph that returns the logits keeps its loss out of this fusion (the op's logits
    carry no gradient); a loop that reads only the loss can drop them (docs/training-memory.md)."""
    logits = getattr(out, "logits", None)
    kept_out = any(fusion == "linear_cross_entropy" and RETURNED_WITH_GRAD in reason
                   for fusion, _, reason in near_misses)
    if train and kept_out and isinstance(logits, torch.Tensor) \
            and hasattr(model, "get_output_embeddings") and why_not_standard(model) is None:
        return (f"linear_cross_entropy is kept out because the model returns the logits {tuple(logits.shape)} "
                "with their gradient; a training loop that reads only the loss can compile "
                "fusionpass.loss_only(model), whose graph returns the loss alone (docs/training-memory.md)")
    return None


LINEAR_CROSS_ENTROPY = registry.register(
    Fusion(
        name="linear_cross_entropy",
        summary='lm_head projection and cross-entropy loss, chunked over tokens (no full logits tensor)',
        options=Options,
        cost=(VOCAB,),
        matches=(
            "F.cross_entropy over the logits of a vocabulary projection (lm_head, F.linear, "
            "h @ W.t()) as HF ForCausalLMLoss writes it (.float(), view(-1, V), ignore_index, "
            "mean or sum / num_items_in_batch), with Gemma-2 soft-capping, the older "
            "shift-logits form, or BERT-style loss on model-dtype logits; logits the model "
            "returns without a gradient (evaluation) are written once in the model dtype"
        ),
        selected_when=(
            "CUDA tensors, float32/float16/bfloat16 h and weight of one dtype, class-index "
            "targets, constant ignore_index and label_smoothing, reduction mean or sum, no "
            "class weights, logits used "
            "by nothing but the loss and the graph's outputs, and returned only where they need no "
            "gradient (a training loop compiles fusionpass.loss_only(model))"
        ),
        anchor=is_cross_entropy,
        variants=tuple(Variant(name, _search(name, accepts)) for name, accepts in VARIANTS),
        guards=(
            Guard("device", device_supported),
            Guard("dtype", dtypes_agree),
            Guard("class_weight", no_class_weight),
            Guard("reduction", reduction_known),
            Guard("ignore_index", ignore_index_constant),
            Guard("label_smoothing", label_smoothing_constant),
            Guard("shapes", shapes_supported),
            Guard("vocab", vocab_large_enough),
            Guard("logits_use", logits_private),
        ),
        replace=replace,
        unmatched=unmatched,
        hint=loss_only_hint,
    )
)
