"""patterns/autocast.make_explicit: autocast's casts written into the pre-grad graph, counted before
and after on small graphs, and the graph's values unchanged (the pass runs it before every fusion)."""
import operator

import torch
import torch.nn.functional as F
from torch import fx

from fusionpass.patterns import autocast
from fusionpass.patterns import graph as g


def dynamo_graph(fn, *args, ambient: torch.dtype | None = None):
    """The graph Dynamo hands the pre-grad pass, with example values, and its inputs in its order."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    if ambient is None:
        compiled(*args)
    else:
        with torch.autocast("cpu", dtype=ambient):
            compiled(*args)
    return graphs[0]


def casts(graph: fx.Graph) -> list[tuple[str, torch.dtype]]:
    return [(n.args[0].name, n.args[1]) for n in graph.nodes if n.op == "call_method" and n.target == "to"
            and len(n.args) == 2 and isinstance(n.args[1], torch.dtype)]


def gated_mlp(x, w_gate, w_up):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)


def test_linear_inputs_cast_once_per_tensor():
    x, wg, wu = torch.randn(2, 8, 16), torch.randn(32, 16), torch.randn(32, 16)
    gm, ins = dynamo_graph(gated_mlp, x, wg, wu)
    want = gm(*ins)
    assert casts(gm.graph) == []
    assert autocast.make_explicit(gm.graph) == 3  # x once for both projections, and each weight
    gm.graph.lint()
    gm.recompile()
    linears = [n for n in gm.graph.nodes if g.is_call(n, (F.linear, torch._C._nn.linear))]
    assert linears[0].args[0] is linears[1].args[0]  # gate(x) and up(x) still read one x
    assert all(g.dtype(a) == torch.bfloat16 for n in linears for a in n.args[:2])
    torch.testing.assert_close(gm(*ins), want, rtol=0, atol=0)


def test_ambient_autocast_and_disabled_regions():
    """An autocast around the compiled call counts; a region with autocast off inside it does not;
    float64 inputs are not autocast's to cast."""

    def f(x, w, d):
        y = F.linear(x, w)
        with torch.autocast("cpu", enabled=False):
            z = F.linear(x, w)
        return y, z, d @ d

    x, w, d = torch.randn(4, 8), torch.randn(8, 8), torch.randn(3, 3, dtype=torch.float64)
    gm, ins = dynamo_graph(f, x, w, d, ambient=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = gm(*ins)
        assert autocast.make_explicit(gm.graph) == 2
        gm.recompile()
        got = gm(*ins)
    assert [dtype for _, dtype in casts(gm.graph)] == [torch.bfloat16, torch.bfloat16]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_autocast_no_change():
    x, wg, wu = torch.randn(2, 8, 16), torch.randn(32, 16), torch.randn(32, 16)
    gm, _ = dynamo_graph(lambda x, a, b: F.silu(F.linear(x, a)) * F.linear(x, b), x, wg, wu)
    before = [n.format_node() for n in gm.graph.nodes]
    assert autocast.make_explicit(gm.graph) == 0
    assert [n.format_node() for n in gm.graph.nodes] == before


def test_cast_moves_above_repeat_kv():
    """transformers' repeat_kv (getitem, expand, reshape) read only by SDPA: the cast goes on its
    source, so the copy is made in bf16 and the attention fusions see repeat_kv over the cast."""

    def attention(q, k):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            kv = k[:, :, None, :, :].expand(2, 2, 2, 16, 8).reshape(2, 4, 16, 8)
            return F.scaled_dot_product_attention(q, kv, kv)

    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8)
    gm, ins = dynamo_graph(attention, q, k)
    want = gm(*ins)
    autocast.make_explicit(gm.graph)
    gm.recompile()
    getitem = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    assert g.cast_source(getitem.args[0]) is not None and g.dtype(getitem) == torch.bfloat16
    torch.testing.assert_close(gm(*ins), want, rtol=0, atol=0)


def test_rounded_by_readers():
    def f(q, cos):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            r = q * cos
            return F.scaled_dot_product_attention(r, r, r)

    q, cos = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16), torch.randn(1, 1, 4, 8)
    gm, _ = dynamo_graph(f, q, cos)
    autocast.make_explicit(gm.graph)
    mul = next(n for n in gm.graph.nodes if g.is_op(n, "mul"))
    assert g.dtype(mul) == torch.float32 and autocast.rounded_by_readers(mul) == torch.bfloat16
