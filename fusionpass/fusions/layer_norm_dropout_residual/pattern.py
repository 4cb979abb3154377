"""layer_norm_dropout_residual: "dropout, add the residual, LayerNorm" as model families write it.

The match starts at the LayerNorm (`F.layer_norm` / `torch.layer_norm`) and reads its input h:
    dropout_residual   h = dropout(x) + r   (either order; BERT/RoBERTa/ELECTRA output blocks,
                                             GPT-2/GPT-NeoX/OPT pre-LN blocks, BLOOM/Falcon's
                                             inlined `dropout_add(x, residual, p, training)`)
    residual           h = x + r            (the same blocks in eval(), or with dropout p == 0)
    dropout            h = dropout(x)       (GPT-2/GPT-NeoX: the dropped embeddings read by the first
                                             layer's LayerNorm and kept as the first residual)
Where h has other users (pre-LN blocks: the next residual; GPT-NeoX/Falcon: a second LayerNorm) the
kernel returns it; where h is private (BERT's post-LN) it is never written in inference. h may
reach the LayerNorm through views that keep the last dimension (OPT flattens to [B*S, W] and back);
the same views are replayed on y.

What the Dynamo graph looks like (transformers 5.17, torch 2.13): dropout stays in eval graphs as
`F.dropout(x, p, False, False)` (Falcon/BLOOM pass `p=`/`training=` as keywords); such dropouts,
and those with a constant p == 0, are identities and are read through. Under `dynamic=True` p and
eps arrive as SymFloats from `.item()`: they are passed to the op, whose float arguments make Dynamo
specialize them (one restart of the analysis, as for rms_norm's eps). An active dropout gets a seed
node `torch.randint(0, 2**62, (1,))` of its own (a fresh draw per call and per LayerNorm, lowered
by Inductor onto its RNG), which the backward reuses to regenerate the mask.

Left alone, silently: a LayerNorm of anything else (embedding sums with a broadcast position
embedding, outputs of another LayerNorm, graph inputs): with nothing to add or drop the kernel is
a plain LayerNorm, which Inductor already generates.

Parallel residual blocks (GPT-NeoX with use_parallel_residual, GPT-J, Falcon): the residual stream
is h = (attn + mlp) + r, or h = r + dropout(attn + mlp) (Falcon), and GPT-NeoX reads h with two
LayerNorms. The kernel adds one tensor to the residual, so fusing the outer add would make Inductor
write the inner sum attn + mlp to memory and the kernel read it back -- two full passes that
Inductor's own norm kernel, which fuses the whole sum, does not pay. Re-associating to
attn + (mlp + r) would change the bf16/fp16 rounding. These are near misses
("parallel_residual: ..."). The first GPT-NeoX layer's LayerNorms read dropout(embeddings): the
first one fuses it (`dropout`, h returned), the second reads that h.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.nn.functional as F
from torch import fx

from fusionpass import registry
from fusionpass.cost import Range, fields, mode
from fusionpass.patterns import dropout as dp
from fusionpass.patterns import graph as g
from fusionpass.registry import Fusion, Guard, Match, NearMiss, Variant, option

_LAYER_NORMS = (F.layer_norm, torch.layer_norm)

# ---------------------------------------------------------------------------------------------
# reading the graph


def _layer_norm_args(node) -> dict | None:
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _LAYER_NORMS):
        return None
    names = ("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable")
    return g.call_args(node, names, {"weight": None, "bias": None, "eps": 1e-5})


def _identity_source(node):
    """The tensor an inactive dropout passes through, else None."""
    d = dp.dropout_of(node)
    return d.x if d is not None and not d.active else None


def _view_source(node):
    """The tensor a view/reshape regroups into rows of the same width, else None."""
    if not isinstance(node, fx.Node):
        return None
    is_view = (node.op == "call_method" and node.target in ("view", "reshape")) or (
        node.op == "call_function" and node.target is torch.reshape
    )
    if not is_view:
        return None
    src, out = g.tensor(g.first_arg(node)), g.tensor(node)
    if src is None or out is None or src.dim() == 0 or out.dim() == 0:
        return None
    if src.shape[-1] != out.shape[-1] or not src.is_contiguous():
        return None
    return g.first_arg(node)


def _walk_back(node):
    """(h, chain): h is where the LayerNorm's input comes from through views and inactive dropouts
    (the chain, from h towards the LayerNorm)."""
    chain = []
    while True:
        src = _view_source(node)
        if src is None:
            src = _identity_source(node)
        if src is None:
            return node, chain
        chain.insert(0, node)
        node = src


def _strip_identities(node):
    """(tensor, inactive dropouts read through)."""
    skipped = []
    while (src := _identity_source(node)) is not None:
        skipped.append(node)
        node = src
    return node, skipped


def _is_private_sum(node) -> bool:
    """node = a + b (or a += b) of two same-shape tensors, read only by the residual add."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return False
    if node.op == "call_function" and node.target is operator.iadd:
        pair = node.args if len(node.args) == 2 else None
    elif node.op == "call_method" and node.target == "add_":
        pair = g.binary_operands(node)
    else:
        pair = g.same_shape_add_operands(node)
    if not pair:
        return False
    shapes = [getattr(g.tensor(t), "shape", None) for t in (*pair, node)]
    return shapes[0] is not None and shapes[0] == shapes[1] == shapes[2]


# ---------------------------------------------------------------------------------------------
# variants: each returns a Match or None


def _match(ln: fx.Node, variant: str, h, chain, x, residual, dropout: dp.Dropout | None, skipped):
    args = _layer_norm_args(ln)
    ok, eps = g.scalar(args["eps"])
    if not ok:
        raise NearMiss("eps is a tensor, not a constant or a scalar graph input")
    dropped = [dropout.node] if dropout is not None else []
    return Match(
        variant=variant,
        anchor=ln,
        # erased once unused, latest first
        nodes=list(dict.fromkeys([ln, *reversed(chain), *dropped, h, *skipped])),
        bindings={
            "h": h,
            "chain": chain,
            "x": x,
            "residual": residual,
            "dropout": dropout,
            "weight": args["weight"],
            "bias": args["bias"],
            "eps": eps,
            "normalized_shape": args["normalized_shape"],
            # the sum in front of the residual add, when x is one (parallel residual blocks)
            "inner_sum": _is_private_sum(x),
        },
    )


def dropout_residual_form(ln: fx.Node) -> Match | None:
    """LayerNorm(dropout(x) + r) or LayerNorm(r + dropout(x)), the dropout active and read only
    by the add."""
    h, chain = _walk_back(_layer_norm_args(ln)["input"])
    pair = g.same_shape_add_operands(h)
    if pair is None:
        return None
    for a, b in g.commuted(h):
        d = dp.dropout_of(a)
        # (b is a: the same dropped tensor added twice keeps one mask, drawn outside the kernel)
        if d is not None and d.active and list(d.node.users) == [h] and b is not a:
            r, skipped = _strip_identities(b)
            return _match(ln, "dropout_residual", h, chain, d.x, r, d, skipped)
    return None


def residual_form(ln: fx.Node) -> Match | None:
    """LayerNorm(x + r): inference (dropouts inactive), dropout p == 0, or a dropout output that
    other ops also read (it stays, as a plain operand)."""
    h, chain = _walk_back(_layer_norm_args(ln)["input"])
    pair = g.same_shape_add_operands(h)
    if pair is None:
        return None
    x, skipped_x = _strip_identities(pair[0])
    r, skipped_r = _strip_identities(pair[1])
    if _is_private_sum(r) and not _is_private_sum(x):
        x, r = r, x  # the operand that is a sum is the one that would be materialized
    return _match(ln, "residual", h, chain, x, r, None, [*skipped_x, *skipped_r])


def dropout_form(ln: fx.Node) -> Match | None:
    """LayerNorm(dropout(x)), no residual add; the dropped tensor is often the next residual."""
    h, chain = _walk_back(_layer_norm_args(ln)["input"])
    d = dp.dropout_of(h)
    if d is None or not d.active:
        return None
    return _match(ln, "dropout", h, chain, d.x, None, d, [])


VARIANTS = (
    ("dropout_residual", dropout_residual_form),
    ("residual", residual_form),
    ("dropout", dropout_form),
)


def is_candidate(node: fx.Node) -> bool:
    """The anchor: a LayerNorm with something to fuse in front of it. A plain LayerNorm is not
    this fusion's business (and not a near miss)."""
    if _layer_norm_args(node) is None:
        return False
    try:
        return any(search(node) is not None for _, search in VARIANTS)
    except NearMiss:
        return True  # recognised; the pass reports why it is left alone


# ---------------------------------------------------------------------------------------------
# guards


def _width(m: Match):
    return g.tensor(m.bindings["h"]).shape[-1]


device_supported = g.device_supported(lambda b: b["h"])


def dtypes_agree(m: Match, cfg) -> str | None:
    """x and the residual in one dtype, or one of them fp32 and the other 16-bit: the sum is then
    fp32, as under autocast, where the residual stream stays fp32 while each block's output is bf16
    and the LayerNorm computes in fp32. The kernel adds them in that promotion."""
    b = m.bindings
    dtype = g.dtype(b["x"])
    if dtype not in g.FLOAT_DTYPES:
        return f"input dtype {dtype} is not float32/float16/bfloat16"
    h_dtype = dtype
    if b["residual"] is not None and (r_dtype := g.dtype(b["residual"])) != dtype:
        if r_dtype not in g.FLOAT_DTYPES or torch.float32 not in (dtype, r_dtype):
            return f"mixed dtypes: residual {r_dtype}, input {dtype} (the kernel adds one dtype, or 16-bit to fp32)"
        h_dtype = torch.float32
    if g.dtype(m.anchor) != h_dtype:
        return f"LayerNorm output dtype {g.dtype(m.anchor)} differs from its input's {h_dtype}"
    for name in ("weight", "bias"):
        p = b[name]
        if p is None:
            continue
        pt = g.tensor(p)
        if pt is None:
            return f"{name} is not a tensor"
        if pt.dtype not in (h_dtype, torch.float32):
            return f"mixed dtypes: {name} {pt.dtype}, input {h_dtype} (the kernel takes {h_dtype} or float32)"
    return None


def normalizes_last_dim(m: Match, cfg) -> str | None:
    shape = m.bindings["normalized_shape"]
    if isinstance(shape, (list, tuple, torch.Size)) and len(shape) == 1:
        width = g.static_int(g.value(shape[0]))
        if width is not None and width == g.static_int(_width(m)):
            return None
    if isinstance(shape, (list, tuple, torch.Size)) and len(shape) > 1:
        return f"LayerNorm over more than the last dimension (normalized_shape of {len(shape)} dims)"
    return f"normalized_shape {shape!r} is not the static last dimension"


@dataclasses.dataclass(frozen=True)
class Options:
    """The bounds of layer_norm_dropout_residual's cost rule (`WIDTH`)."""

    min_width: int = option(768, "narrowest row fused in training")
    max_width: int = option(8192, "widest row fused in training")
    inference_min_width: int = option(2048, "narrowest row fused in inference")
    inference_max_width: int = option(4096, "widest row fused in inference")


FIELDS = fields(Options)


# The cost rule: training (a dropout or a gradient) is fused over a wider band of row widths than
# inference (why: benchmarks/results/latest/layer_norm_dropout_residual.md).
WIDTH = Range(
    "row width",
    training=(FIELDS.min_width, FIELDS.max_width),
    inference=(FIELDS.inference_min_width, FIELDS.inference_max_width),
)


def cost_rule(width: int, training: bool, cfg) -> str | None:
    """A reason to leave the LayerNorm to Inductor (`WIDTH`), or None. `training`: the match drops
    or is differentiated."""
    return WIDTH.check(width, mode(training), cfg)


def _training(m: Match) -> bool:
    """An active dropout, or a LayerNorm output autograd records (not under no_grad)."""
    return m.bindings["dropout"] is not None or bool(getattr(g.tensor(m.anchor), "requires_grad", False))


def width_in_range(m: Match, cfg) -> str | None:
    width = g.static_int(_width(m))
    if width is None:
        return "row width is symbolic (the kernel is specialized on it)"
    return cost_rule(width, _training(m), cfg)


def rows_contiguous(m: Match, cfg) -> str | None:
    b = m.bindings
    for node in (b["x"], b["residual"]):
        if node is not None and not g.last_dim_contiguous(g.tensor(node)):
            return f"{node.name} is not contiguous in its last dimension"
    return None


def intermediates_private(m: Match, cfg) -> str | None:
    d = m.bindings["dropout"]
    h = m.bindings["h"]
    if d is not None and d.node is not h and set(d.node.users) != {h}:
        return f"the dropout output {d.node.name} is used elsewhere"
    return None


def _sums_embeddings(node, depth: int = 3) -> bool:
    """Whether a term of the sum `node` (through nested sums) is an embedding lookup: the
    embeddings' LayerNorm of BERT-likes (word + token type + position), not a residual block."""
    if not isinstance(node, fx.Node) or depth == 0:
        return False
    if node.op == "call_function" and node.target is F.embedding:
        return True
    pair = g.same_shape_add_operands(node) if _is_private_sum(node) else None
    return bool(pair) and any(_sums_embeddings(t, depth - 1) for t in pair)


def not_parallel_residual(m: Match, cfg) -> str | None:
    x = m.bindings["x"]
    if not m.bindings["inner_sum"]:
        return None
    what = ("a sum of embeddings (word, token type, position)" if _sums_embeddings(x) or
            _sums_embeddings(m.bindings["residual"]) else
            "a sum of two branches added to the residual (parallel attention + MLP)")
    return (f"{x.name} is {what}: fusing would write that sum to memory for the kernel to read back, "
            "where Inductor fuses the whole sum into its own norm")


# ---------------------------------------------------------------------------------------------
# replacement


def _replay(graph: fx.Graph, view: fx.Node, source: fx.Node, before: fx.Node) -> fx.Node:
    """`view` applied to `source` instead of its own input (same sizes, symbolic ones included)."""
    args = (source, *view.args[1:])
    with graph.inserting_before(before):
        new = graph.create_node(view.op, view.target, args, dict(view.kwargs))
    mode = g.fake_mode_of([source])
    if mode is not None:
        fake_args = fx.node.map_arg(args, g.value)
        fake_kwargs = fx.node.map_arg(dict(view.kwargs), g.value)
        with mode:
            if view.op == "call_method":
                value = getattr(fake_args[0], view.target)(*fake_args[1:], **fake_kwargs)
            else:
                value = view.target(*fake_args, **fake_kwargs)
        new.meta["example_value"] = value
    g.copy_provenance(new, view)
    return new


def _h_escapes(m: Match) -> bool:
    """Whether h (or a view of it) is read by anything but the path to the LayerNorm."""
    b = m.bindings
    path = {*b["chain"], m.anchor}
    return any(u not in path for n in (b["h"], *b["chain"]) for u in n.users)


def replace(graph: fx.Graph, m: Match, cfg) -> None:
    b = m.bindings
    ln = m.anchor
    dropout = b["dropout"]
    seed, p = None, 0.0
    if dropout is not None:
        seed, p = dp.insert_seed(graph, ln, ln), dropout.p
    escapes = _h_escapes(m)
    # The backward needs h: store it whenever the LayerNorm is differentiated, not only when it
    # is read elsewhere.
    store_h = escapes or bool(getattr(g.tensor(ln), "requires_grad", False))
    fused = g.insert_call(
        graph,
        ln,
        torch.ops.fusionpass.layer_norm_dropout_residual.default,
        (b["x"], b["residual"], b["weight"], b["bias"], seed, b["eps"], p, store_h),
        ln,
    )
    y, h, _, _ = g.insert_getitems(graph, fused, 4)
    if escapes:
        # the views of h towards the LayerNorm now read the kernel's h; other readers too
        b["h"].replace_all_uses_with(h)
    for view in b["chain"]:
        if _view_source(view) is not None:
            y = _replay(graph, view, y, ln)
    ln.replace_all_uses_with(y)
    g.erase_unused(graph, m.nodes)


LAYER_NORM_DROPOUT_RESIDUAL = registry.register(
    Fusion(
        name="layer_norm_dropout_residual",
        summary='LayerNorm of `dropout(x) + residual` (BERT, GPT-2, GPT-NeoX, OPT, BLOOM, Falcon), dropout in the kernel',
        options=Options,
        cost=(WIDTH,),
        settings_prefix="layer_norm",
        matches=(
            "LayerNorm of dropout(x) + residual (BERT post-LN, GPT-2/GPT-NeoX/OPT pre-LN with the "
            "sum returned for the next residual, BLOOM/Falcon dropout_add), of x + residual "
            "(inference, p = 0) and of dropout(x); with or without weight and bias"
        ),
        selected_when=(
            "CUDA tensors, float32/float16/bfloat16 (x and residual in one dtype, or one fp32 and "
            "the other 16-bit as under autocast; weight and bias in the sum's dtype or float32), LayerNorm over the last dimension only, constant dropout p in [0, 1), "
            "not a parallel-residual (three-term) sum; training: an active dropout or a gradient"
        ),
        anchor=is_candidate,
        variants=tuple(Variant(name, search) for name, search in VARIANTS),
        guards=(
            Guard("device", device_supported),
            Guard("dtype", dtypes_agree),
            Guard("normalized_shape", normalizes_last_dim),
            Guard("width", width_in_range),
            Guard("strides", rows_contiguous),
            Guard("intermediates", intermediates_private),
            Guard("parallel_residual", not_parallel_residual),
        ),
        replace=replace,
        unmatched="LayerNorm found, but not of a dropout or a residual sum",
    )
)
