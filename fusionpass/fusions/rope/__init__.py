"""The rope fusion: rotary position embedding of q and k."""
