"""patterns.graph.tensor_subclass: which wrapper subclasses keep a match from going ahead. A DTensor
passes only for a fusion whose ops have sharding rules (Fusion.dtensor); any other subclass never."""
import os

import torch
import torch.distributed as dist
from torch import fx
from torch.testing._internal.two_tensor import TwoTensor

from fusionpass import registry
from fusionpass.patterns.graph import tensor_subclass


def _node(graph: fx.Graph, name: str, value) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = value
    return node


def test_plain_tensors_pass():
    graph = fx.Graph()
    assert tensor_subclass([_node(graph, "x", torch.randn(3, 5))]) is None


def test_other_subclasses_never_pass():
    graph = fx.Graph()
    x = _node(graph, "x", TwoTensor(torch.randn(3, 5), torch.randn(3, 5)))
    for ok in (False, True):
        why = tensor_subclass([x], dtensor_ok=ok)
        assert why is not None and "TwoTensor" in why, why


def test_dtensor_passes_only_with_sharding_rules(monkeypatch):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        graph = fx.Graph()
        x = _node(graph, "x", distribute_tensor(torch.randn(4, 6, 8), mesh, [Shard(1)]))
        why = tensor_subclass([x])
        assert why is not None and f"DTensor {Shard(1)}" in why and "no sharding rule" in why, why
        assert tensor_subclass([x], dtensor_ok=True) is None
    finally:
        dist.destroy_process_group()


def test_only_rms_norm_declares_sharding_rules():
    assert {f.name for f in registry.registered().values() if f.dtensor} == {"rms_norm_residual"}
