"""The attention_out_proj fusion: attention + head merge + output projection."""
