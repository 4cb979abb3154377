import sys, torch
sys.path.insert(0, "benchmarks")
import models as M
import fusionpass
from torch.profiler import profile, ProfilerActivity
torch._inductor.config.fx_graph_cache = False
which = sys.argv[1]
base = M.build_gpt2() if which == "gpt2" else M.build_bert("eager")
B, S = (16, 1024) if which == "gpt2" else (32, 512)
ids = torch.randint(0, base.config.vocab_size, (B, S), device="cuda")
for name, backend in (("plain", "inductor"), ("fusionpass", fusionpass.backend())):
    torch._dynamo.reset()
    model = torch.compile(base.train(), backend=backend)
    step = M.train_step(model, ids)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    evs = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:90]
            evs[k] = evs.get(k, 0) + e.device_time_total
    tot = sum(evs.values())
    print(f"== {name} total {tot/1e3:.2f} ms")
    for k, v in sorted(evs.items(), key=lambda kv: -kv[1])[:22]:
        print(f"{v/1e3:8.3f} {k}")
