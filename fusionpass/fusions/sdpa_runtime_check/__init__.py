"""The sdpa_runtime_check fusion: the CPU-only run-time check of an all-true attention mask."""
