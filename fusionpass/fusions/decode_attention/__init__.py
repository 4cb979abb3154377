"""The decode_attention fusion: attention of decode steps over a KV cache (split-KV)."""
