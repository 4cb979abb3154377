"""The fusions under data, fully-sharded and tensor parallelism (CPU, gloo, two processes).

Each case trains one step of a tiny model under one parallelism (tests/parallel_worker.py says how
each is applied) with plain torch.compile and with fusionpass, and checks:
- the same fusions match as in the same model without parallelism, compiled the same way (whole,
  or block by block as torchtitan does with FSDP2), except what a parallelism provably takes away
  (`LOST`), which must then be a near miss saying so, or no report at all where no graph holds the
  pattern whole;
- the loss and every gradient equal plain torch.compile's under the same parallelism, on each rank.
Under torchtitan's sequence parallelism the norms see DTensors: their ops' sharding rules let them
match, and the step still equals plain compile's (docs/parallelism.md).
"""
from __future__ import annotations

import socket
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp
from helpers import assert_tensors_close

import parallel_worker as pw

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")

RTOL_FP32 = 1e-4  # as the other whole-model tests: reductions in another order


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: pw.Case, tmp_path) -> list[dict]:
    out = str(tmp_path / "rank")
    mp.start_processes(pw.run_rank, args=(case, free_port(), out), nprocs=pw.WORLD,
                       start_method="spawn")
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(pw.WORLD)]


def per_fusion(stats: dict) -> Counter:
    out = Counter()
    for (fusion, _), n in stats.items():
        out[fusion] += n
    return out


def assert_same_step(result: dict) -> None:
    plain, ours = result["plain"], result["fusionpass"]
    assert_tensors_close(ours["loss"], plain["loss"], RTOL_FP32, "loss")
    assert ours["grads"].keys() == plain["grads"].keys()
    for name, g in plain["grads"].items():
        assert_tensors_close(ours["grads"][name], g, RTOL_FP32, f"gradient of {name}")


# What a parallelism takes away, per fusion: the near miss each lost match leaves, or None where
# no graph holds the pattern whole and nothing is reported (docs/parallelism.md).
# - DDP's graph split: transformers builds the causal mask once, before the blocks, so every
#   block's SDPA is in a later subgraph than the mask and cannot prove it causal; the split also
#   falls between the MLP's gate, up and down linears (each parameter use can end a bucket).
#   Compiled autograd's DDP (optimize_ddp="python_reducer") makes one graph, and the matches come
#   back.
# - TP: each linear's input hook makes its own DTensor of x, so gate and up no longer read one x.
LOST = {
    "ddp": {"sdpa_mask": "the mask is an input of this graph", "swiglu_mlp": None},
    "tp": {"swiglu_mlp": "but not act(gate(x)) * up(x) of linears of one x"},
}

CASES = [
    pw.Case("llama", "ddp"),
    pw.Case("gpt2", "ddp"),
    pw.Case("gpt2", "ddp_python_reducer"),
    pw.Case("llama", "ddp_python_reducer"),
    pw.Case("llama", "fsdp"),
    pw.Case("gpt2", "fsdp"),
    pw.Case("llama", "tp"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.model}-{c.parallelism}")
def test_parallel_training_step(case, tmp_path):
    results = run_case(case, tmp_path)
    for result in results:
        assert_same_step(result)
    expected = pw.single_process_counts(case.model, per_block=case.parallelism == "fsdp")
    assert expected, "the model matches nothing without parallelism: nothing is tested"
    expected = per_fusion(expected)
    why_lost = LOST.get(case.parallelism, {})
    lost = {f: expected.pop(f) for f in why_lost if f in expected}
    for rank, result in enumerate(results):
        got = per_fusion(result["fusionpass"]["stats"])
        assert got == expected, f"rank {rank}: {got} != {expected}"
        for fusion, n in lost.items():
            reasons = [m[2] for m in result["fusionpass"]["near_misses"] if m[0] == fusion]
            if why_lost[fusion] is None:
                assert reasons == [], reasons
            else:
                assert len(reasons) == n and all(why_lost[fusion] in r for r in reasons), reasons


def test_sequence_parallel_norms_match(tmp_path):
    """torchtitan's TP plan: norms on Shard(1) DTensors and vocab-sharded logits under
    loss_parallel. The norm ops' sharding rules (fusions/rms_norm_residual/op.py) let every norm match, each rank
    normalizing its own rows, and the step equals plain compile's, the norm weights' gradients
    (summed over the shards) included."""
    results = run_case(pw.Case("llama", "tp_sp"), tmp_path)
    norms = 2 * 2 + 1  # two per block, two blocks, and the final norm
    for result in results:
        assert_same_step(result)
        assert per_fusion(result["fusionpass"]["stats"])["rms_norm_residual"] == norms, result["fusionpass"]["stats"]
        assert not [m for m in result["fusionpass"]["near_misses"] if m[0] == "rms_norm_residual"]


def test_vocab_parallel_loss_is_a_near_miss(tmp_path):
    """torchtitan's loss_parallel with the loss compiled next to the output projection: the
    logits are a vocab-sharded DTensor, which linear_cross_entropy (a loss over the whole
    vocabulary, with no sharding rule) leaves to Inductor with a near miss that names the DTensor;
    the step equals plain compile's."""
    results = run_case(pw.Case("llama", "tp_sp_loss"), tmp_path)
    for result in results:
        assert_same_step(result)
        assert "linear_cross_entropy" not in per_fusion(result["fusionpass"]["stats"])
        reasons = [m[2] for m in result["fusionpass"]["near_misses"] if m[0] == "linear_cross_entropy"]
        assert reasons and all("is a DTensor" in r and "loss_parallel" in r for r in reasons), reasons
