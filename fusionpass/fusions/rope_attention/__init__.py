"""The rope_attention fusion: q's rotation inside the attention kernel."""
