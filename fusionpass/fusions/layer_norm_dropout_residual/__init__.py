"""The layer_norm_dropout_residual fusion: BERT's and GPT-2's dropout + residual add + LayerNorm."""
