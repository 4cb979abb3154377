"""The swiglu_mlp fusion: the SwiGLU MLP (gate/up projections, activation, product, down projection)."""
