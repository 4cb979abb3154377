"""Test session setup.

Triton must see TRITON_INTERPRET before any @triton.jit runs, so it is set here, before the package
is imported; the tests then run every Triton kernel on CPU tensors.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# rms_norm_residual's GPU cost rules take only the widths its measured table found faster than
# plain compile (fusions/rms_norm_residual/cost_table.py); the tests check the kernels wherever a
# setting may select them, so that rule is open here (test_measured_rule_selects_where_the_table_
# says_faster checks it).
os.environ.setdefault("FUSIONPASS_RMS_NORM_MIN_SPEEDUP", "0")
# layer_norm_dropout_residual's width bounds (default 768): tiny HF models are 64-128 wide.
os.environ.setdefault("FUSIONPASS_LAYER_NORM_MIN_WIDTH", "64")
os.environ.setdefault("FUSIONPASS_LAYER_NORM_INFERENCE_MIN_WIDTH", "64")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
