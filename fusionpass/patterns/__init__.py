"""One module per fusion family; importing a module declares its fusion in the registry."""

# The modules `fusionpass.registry.registered()` imports, in no particular order (the pass runs
# fusions in the order of `fusionpass.config.FUSION_NAMES`).
MODULES = (
    "fusionpass.patterns.rms_norm",
    "fusionpass.patterns.layer_norm",
    "fusionpass.patterns.attention",
    "fusionpass.patterns.attention_out_proj",
    "fusionpass.patterns.decode_attention",
    "fusionpass.patterns.cross_entropy",
    "fusionpass.patterns.swiglu",
    "fusionpass.patterns.rope",
    "fusionpass.patterns.rope_attention",
)
