"""Test session setup.

Triton must see TRITON_INTERPRET before any @triton.jit runs, so it is set here, before the package
is imported; the tests then run every Triton kernel on CPU tensors.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests build narrow models (width 512) to stay fast on two cores; rms_norm_residual's GPU
# cost rule starts at width 2048, so lower it here (test_width_cost_rule checks the default).
os.environ.setdefault("FUSIONPASS_RMS_NORM_MIN_WIDTH", "512")
# Likewise layer_norm_dropout_residual's (default 512): tiny HF models are 64-128 wide.
os.environ.setdefault("FUSIONPASS_LAYER_NORM_MIN_WIDTH", "64")
os.environ.setdefault("FUSIONPASS_LAYER_NORM_INFERENCE_MIN_WIDTH", "64")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
