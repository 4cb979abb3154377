"""The sdpa_mask fusion: SDPA over a materialized mask proven causal or all-true: the mask dropped."""
