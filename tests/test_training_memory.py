"""benchmarks/training_memory.py: the largest-S search on made-up peaks, and a CPU smoke run of one
row (plain compile, fusionpass and fusionpass on the loss-only wrapper in one child process, the
table and JSON written)."""
import json
import pathlib
import subprocess
import sys

import pytest
from helpers import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
tool = load_script("training_memory", ROOT / "benchmarks" / "training_memory.py")


def test_prediction_from_two_peaks():
    # 10 GiB at S=16k, 18 GiB at S=32k: 0.5 GiB per 1k tokens, 2 GiB at S=0; 50 GiB fit S=96k
    assert tool.predict_limit([(16384, 10.0), (32768, 18.0)], 50.0, 4096) == 98304
    with pytest.raises(ValueError):
        tool.predict_limit([(16384, 10.0), (32768, 9.0)], 50.0, 4096)


@pytest.mark.parametrize("guess", [40960, 61440, 81920])
def test_largest_fitting_finds_the_boundary(guess):
    limit = 61440 + 1000  # what really fits: S <= 62440
    found = tool.largest_fitting(lambda s: s <= limit, guess, 4096, max_probes=10)
    assert found["largest_fits"] == 61440 and found["smallest_fails"] == 65536, found


def test_largest_fitting_reports_what_it_could_not_find():
    found = tool.largest_fitting(lambda s: True, 8192, 4096, max_probes=3)
    assert found["largest_fits"] == 16384 and found["smallest_fails"] is None
    assert list(found["probed"]) == [8192, 12288, 16384]


def test_children_keep_plain_and_fusionpass_together():
    assert tool.children(["plain", "fusionpass", "fusionpass-loss-only", "liger", "liger+compile"]) == [
        ("plain", "fusionpass", "fusionpass-loss-only"), ("liger",), ("liger+compile",)]


def test_smoke_row(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "training_memory.py"), "--smoke", "--device", "cpu",
           "--rows", "llama8l-b4-s2048", "--versions", "plain,fusionpass,fusionpass-loss-only", "--out-dir", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    data = json.loads((tmp_path / "training_memory.json").read_text())
    row = data["rows"]["llama8l-b4-s2048"]
    assert set(row) == {"plain", "fusionpass", "fusionpass-loss-only"}
    assert all(r["ms"] > 0 and r["peak_gib"] is None for r in row.values()), row
    assert row["fusionpass"]["matches"].get("swiglu_mlp"), row  # the training default matched
    assert row["fusionpass-loss-only"]["matches"] == row["fusionpass"]["matches"], row
    assert "| llama8l-b4-s2048 | fusionpass |" in (tmp_path / "training_memory.md").read_text()
