"""A toy fusion in a folder of its own, laid out as every fusion in fusionpass/fusions is: adding
this folder to the fusions package's search path is all it takes for the registry, the ops, the
conformance suite and the benchmark suite to find it (tests/test_fusion_declaration.py). It
rewrites `x * 2` into its op, whose Triton kernel computes `x + x`."""
