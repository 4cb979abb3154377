"""The linear_cross_entropy fusion: lm_head + the causal-LM cross-entropy, without materialized logits."""
