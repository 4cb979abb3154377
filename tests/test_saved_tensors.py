"""benchmarks/saved_tensors.py: the saved tensors it reads from Inductor's partition are the ones
the compiled step really saves (autograd's saved-tensor hooks see each one at the compiled
forward), and its report adds them up per layer."""
import pathlib

import torch
from helpers import compiling, load_script

import fusionpass
from fusionpass.demo import build_hf

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool():
    return load_script("saved_tensors_tool", ROOT / "benchmarks" / "saved_tensors.py")


def _model():
    built = build_hf("llama", dtype=torch.bfloat16, layers=2, width=128, heads=4, kv_heads=2,
                     intermediate=352, vocab=509)
    return built.model.train()


def hooked_saves(model, ids, backend) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor autograd saves in a compiled forward (after the compile)."""
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype))
        return t

    with compiling():
        compiled = torch.compile(model, backend=backend)
        compiled(input_ids=ids, labels=ids, use_cache=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            compiled(input_ids=ids, labels=ids, use_cache=False)
    return seen


def test_saved_tensors_are_what_autograd_saves():
    tool = _tool()
    model = _model()
    ids = torch.randint(0, 509, (1, 37))
    for backend in ("inductor", fusionpass.backend(cpu=True, rope_min_tokens=1, rms_norm_min_width=1)):
        fusionpass.reset_stats()
        with compiling():
            saved = tool.compiled_saves(model, ids, ids, backend)
        if backend != "inductor":
            assert fusionpass.stats().get("rms_norm_residual"), fusionpass.stats()
        read = sorted((s.shape, s.dtype) for s in saved)
        hooked = sorted((shape, str(dtype).replace("torch.", "")) for shape, dtype in hooked_saves(model, ids, backend))
        assert read == hooked


def test_report_per_layer(tmp_path):
    tool = _tool()
    out = tmp_path / "saved.md"
    assert tool.main(["--layers", "2", "--width", "128", "--heads", "4", "--kv-heads", "2",
                      "--intermediate", "352", "--vocab", "509", "--seq", "37", "--device", "cpu",
                      "--out", str(out)]) == 0
    import json

    data = json.loads(out.with_suffix(".json").read_text())
    assert list(data["results"]) == list(tool.versions("cpu"))
    for name, r in data["results"].items():
        layers = list(r["per_layer_bytes"].values())
        # alike layers save alike, up to the residual stream at the boundary each is charged with
        assert len(layers) == 2 and min(layers) > 0.95 * max(layers), (name, r["per_layer_bytes"])
    assert "| plain torch.compile |" in out.read_text()
