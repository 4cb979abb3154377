"""The rms_norm_residual fusion: HF Llama's residual add + RMSNorm."""
