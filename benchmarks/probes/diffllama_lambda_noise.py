"""Is DiffLlama's lambda gradient error (unnamed_families.py: bf16 and fp32 above twice plain
compile's) fusionpass's attention, or noise of a sum with heavy cancellation? One fp32 training step
of the tiny DiffLlama against its float64 copy, eager, plain compile and fusionpass with only
flash_attention on: the relative error of each layer's attention output (o_proj's input), of
lambda_q1's gradient and of the logits. If the attention outputs agree to the same few 1e-7 on every
side while the lambda gradients' errors change order from side to side, the gradient is the noise.

    TRITON_INTERPRET=1 python benchmarks/probes/diffllama_lambda_noise.py [--seed N]
"""
import argparse
import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import fusionpass  # noqa: E402
from fusionpass.conformance.families import OPEN, TINY  # noqa: E402


def step(model, backend, ids):
    model = copy.deepcopy(model)
    attention_outputs = []
    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(lambda mod, inp, out: attention_outputs.append(inp[0].detach()))
    torch._dynamo.reset()
    run = torch.compile(model, backend=backend) if backend else model
    out = run(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    out.loss.backward()
    lambdas = [layer.self_attn.lambda_q1.grad.double() for layer in model.model.layers]
    return attention_outputs, lambdas, out.logits.detach().double()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    seed = p.parse_args().seed
    # a cache hit would skip the pass, and its match count with it
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    torch.manual_seed(seed)
    cfg = transformers.DiffLlamaConfig(**TINY)
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg).double()
    ids = torch.randint(3, TINY["vocab_size"], (2, 37))
    reference = step(model, None, ids)

    def rel(x, ref):
        return f"{((x.double() - ref).norm() / ref.norm()).item():.2e}"

    sides = (("eager", None), ("plain", "inductor"),
             ("fusionpass", fusionpass.backend(**{**OPEN, "fusions": ["flash_attention"]})))
    for name, backend in sides:
        fusionpass.reset_stats()
        outs, lambdas, logits = step(copy.deepcopy(model).float(), backend, ids)
        print(f"seed {seed} {name}: attention outputs {[rel(a, b) for a, b in zip(outs, reference[0])]}, "
              f"lambda_q1 grads {[rel(a, b) for a, b in zip(lambdas, reference[1])]}, logits {rel(logits, reference[2])}"
              + (f", matched {fusionpass.stats()}" if backend not in (None, "inductor") else ""), flush=True)


if __name__ == "__main__":
    main()
