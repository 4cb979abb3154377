"""The two wrong results of issue 16 on the GPU, before and after the fix (run once with the old
package on PYTHONPATH, once with the new): LayerNorm without a bias through
layer_norm_dropout_residual in training (dweight), and HF Llama eager-attention inference through
rope_attention (logits). Prints relative errors against float64 eager and plain torch.compile's.

    python benchmarks/probes/aliased_outputs.py
"""
import copy
import json
import sys

import torch

import fusionpass

torch.utils.deterministic.fill_uninitialized_memory = True
torch.use_deterministic_algorithms(True, warn_only=True)
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


def rel(a, b):
    a, b = a.double(), b.double()
    return float("nan") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()


class PreLN(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ln = torch.nn.LayerNorm(n, bias=False)

    def forward(self, x, r):
        h = r + x
        return self.ln(h), h


def layer_norm_no_bias(rows, n):
    torch.manual_seed(0)
    m = PreLN(n).cuda().bfloat16()
    with torch.no_grad():
        m.ln.weight.normal_()
    x, r = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16), torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(rows, n, device="cuda", dtype=torch.float64)
    out = {}
    for name, backend in (("ref", None), ("plain", "inductor"), ("fusionpass", fusionpass.backend())):
        mm = copy.deepcopy(m)
        args = (x, r)
        if name == "ref":
            mm = mm.double()
            args = (x.double(), r.double())
        else:
            torch._dynamo.reset()
            mm = torch.compile(mm, backend=backend)
        y, h = mm(*args)
        (y * dy.to(y.dtype)).sum().backward()
        out[name] = mm.ln.weight.grad if name == "ref" else mm._orig_mod.ln.weight.grad
    return {"shape": [rows, n], "dweight_plain": rel(out["plain"], out["ref"]), "dweight_fusionpass": rel(out["fusionpass"], out["ref"])}


def llama_eager_inference():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=128)
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).cuda().bfloat16().eval()
    ids = torch.randint(0, 32000, (4, 512), device="cuda")
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(ids).logits
        torch._dynamo.reset()
        plain = torch.compile(copy.deepcopy(model))(ids).logits
        torch._dynamo.reset()
        fusionpass.reset_stats()
        fused = torch.compile(copy.deepcopy(model), backend=fusionpass.backend())(ids).logits
    return {"logits_plain": rel(plain, ref), "logits_fusionpass": rel(fused, ref), "matches": fusionpass.stats()}


if __name__ == "__main__":
    res = {"ln": [layer_norm_no_bias(*s) for s in ((1000, 768), (4097, 1000), (16384, 1024))],
           "llama_eager": llama_eager_inference()}
    print(json.dumps(res, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f, indent=1)
