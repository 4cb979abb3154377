"""One rank of the parallel-training tests (tests/models/test_parallel_compile.py): two processes on
the gloo backend, each building the same tiny model, putting it under one parallelism, and running
one training step with plain torch.compile and one with fusionpass, from the same weights and data.

Each rank saves what it saw (loss, full gradients, our statistics) to `<out>.<rank>`; the test
compares the two compiles there, so an exception on a rank reaches the test as the spawn's error.

Parallelisms, as their frameworks apply them:
- "ddp": DistributedDataParallel around model + loss, compiled whole. A 1 MB bucket cap (the
  smallest DDP's first bucket allows) makes Dynamo's DDPOptimizer cut the graph inside each block.
- "ddp_python_reducer": the same under compiled autograd's DDP (`optimize_ddp="python_reducer"`),
  which traces DDP's gradient hooks instead of splitting the forward graph.
- "fsdp": torchtitan's FSDP2 order: `fully_shard` on every block and on the root, then each block
  compiled on its own (regional compile; the loss stays eager).
- "tp": colwise q/k/v and gate/up, rowwise o and down (the issue's plain plan), compiled whole with
  the loss; the activations between blocks are plain tensors.
- "tp_sp": torchtitan's plan: the norms sequence-parallel (`SequenceParallel`, so they see
  Shard(1) DTensors), the embedding rowwise, the output colwise to vocab-sharded logits and the loss
  under `loss_parallel()`.
- "tp_sp_loss": the same plan with the loss compiled in the model's graph, inside `loss_parallel()`
  (the region `linear_cross_entropy` would fuse: output projection to vocab-sharded logits, then
  the loss).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

WORLD = 2
DATA_PARALLEL = ("ddp", "ddp_python_reducer", "fsdp")


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # "llama" (tests/torchtitan_model.py) or "gpt2" (transformers' GPT-2)
    parallelism: str  # "ddp", "ddp_python_reducer", "fsdp", "tp", "tp_sp", "tp_sp_loss"


# the tiny models' shapes are below the GPU cost rules: open those the blocks can meet
SETTINGS = dict(cpu=True, rope_min_tokens=1, linear_cross_entropy_min_vocab=1, rms_norm_min_width=1,
                rms_norm_min_speedup=0.0)
VOCAB, BATCH, SEQ = 128, 2, 24


def build(model: str):
    """The model (same weights on every rank) and the loss of its output."""
    torch.manual_seed(0)
    if model == "llama":
        import torchtitan_model as tt

        # 256 wide: a block's parameters exceed DDP's 1 MB bucket, so DDPOptimizer splits blocks
        net = tt.make(norm="torch", rope="rotate_half", n_layers=2, dim=256, n_heads=4,
                      n_kv_heads=2, ffn_dim=512, vocab_size=VOCAB)
        return net, tt.cross_entropy_loss
    if model == "gpt2":
        import transformers

        config = transformers.GPT2Config(n_embd=256, n_head=4, n_positions=64, n_layer=2,
                                         vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        config._attn_implementation = "sdpa"
        net = transformers.GPT2LMHeadModel(config)

        def loss(logits, labels):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

        return _Logits(net), loss
    raise ValueError(model)


class _Logits(torch.nn.Module):
    """transformers' model as ids -> logits, with its blocks where the parallelisms look for them."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.layers = {str(i): b for i, b in enumerate(net.transformer.h)}

    def forward(self, ids):
        return self.net(ids, use_cache=False).logits


class WithLoss(torch.nn.Module):
    """(ids, labels) -> loss: the compiled region of the whole-model parallelisms."""

    def __init__(self, net, loss_fn):
        super().__init__()
        self.net, self.loss_fn = net, loss_fn

    def forward(self, ids, labels):
        return self.loss_fn(self.net(ids), labels)


def blocks(net) -> list[torch.nn.Module]:
    return list(net.layers.values())


def tensor_parallel_plan(sequence_parallel: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    out = Shard(1) if sequence_parallel else Replicate()
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=out),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=out)}
    if sequence_parallel:
        plan.update({
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
        })
    return plan


def _step(forward, context=contextlib.nullcontext):
    """A training step (ids, labels) -> loss: `forward`, then the loss's backward, both inside
    `context` (loss_parallel's backward must run inside it too)."""
    def step(ids, labels):
        with context():
            loss = forward(ids, labels)
            loss.backward()
        return loss.detach()

    return step


def parallelize(net, loss_fn, parallelism: str, mesh, backend):
    """The training step (`_step`) under `parallelism`, compiled with `backend` where that
    parallelism's framework compiles."""
    if parallelism in ("ddp", "ddp_python_reducer"):
        from torch.nn.parallel import DistributedDataParallel

        compiled = torch.compile(DistributedDataParallel(WithLoss(net, loss_fn), bucket_cap_mb=1),
                                 backend=backend)
        if parallelism == "ddp":
            return _step(compiled)
        # DDP's gradient hooks traced by compiled autograd: one forward graph, no split
        return _step(compiled, lambda: torch._dynamo.config.patch(optimize_ddp="python_reducer",
                                                                  compiled_autograd=True))
    if parallelism == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in blocks(net):
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        for block in blocks(net):
            block.compile(backend=backend)
        return _step(lambda ids, labels: loss_fn(net(ids), labels))
    if parallelism in ("tp", "tp_sp", "tp_sp_loss"):
        from torch.distributed.tensor.parallel import parallelize_module

        if not hasattr(net, "tok_embeddings"):
            raise ValueError("tensor parallelism: the Llama only (GPT-2's Conv1D has no TP style)")
        sp = parallelism in ("tp_sp", "tp_sp_loss")
        for block in blocks(net):
            parallelize_module(block, mesh, tensor_parallel_plan(sp))
            block.attention.n_heads //= WORLD
            block.attention.n_kv_heads //= WORLD
        if not sp:
            return _step(torch.compile(WithLoss(net, loss_fn), backend=backend))
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       SequenceParallel, loss_parallel)

        parallelize_module(net, mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                      use_local_output=False),
        })
        if parallelism == "tp_sp_loss":
            return _step(torch.compile(WithLoss(net, loss_fn), backend=backend), loss_parallel)
        compiled = torch.compile(net, backend=backend)
        return _step(lambda ids, labels: loss_fn(compiled(ids), labels), loss_parallel)
    raise ValueError(parallelism)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_step(case: Case, mesh, backend, ids, labels) -> dict:
    import fusionpass
    from fusionpass.passes import STATISTICS
    from helpers import compiling

    net, loss_fn = build(case.model)
    net.train()
    with compiling():
        loss = parallelize(net, loss_fn, case.parallelism, mesh, backend)(ids, labels)
        grads = {name: full(p.grad).detach().clone() for name, p in net.named_parameters()
                 if p.grad is not None}
        return {"loss": full(loss).detach(), "grads": grads,
                "stats": fusionpass.stats(variants=True),
                "near_misses": STATISTICS.near_misses, "graphs": len(STATISTICS.records)}


def run_rank(rank: int, case: Case, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        import fusionpass
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        # data parallelism: a batch of its own per rank; tensor parallelism: the same batch
        seed = rank if case.parallelism in DATA_PARALLEL else 0
        gen = torch.Generator().manual_seed(100 + seed)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        result = {
            "plain": train_step(case, mesh, "inductor", ids, labels),
            "fusionpass": train_step(case, mesh, fusionpass.backend(**SETTINGS), ids, labels),
        }
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def single_process_counts(model: str, per_block: bool) -> dict:
    """What fusionpass matches in the same model's training step without any parallelism:
    compiled whole with the loss, or (per_block) each block on its own."""
    import fusionpass
    from helpers import compiling

    net, loss_fn = build(model)
    net.train()
    gen = torch.Generator().manual_seed(100)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    with compiling():
        backend = fusionpass.backend(**SETTINGS)
        if per_block:
            for block in blocks(net):
                block.compile(backend=backend)
            loss = loss_fn(net(ids), ids)
        else:
            loss = torch.compile(WithLoss(net, loss_fn), backend=backend)(ids, ids)
        loss.backward()
        return fusionpass.stats(variants=True)
