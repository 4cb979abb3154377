"""One module per fusion family, plus shared matching helpers; importing a module declares its
fusion in the registry (`fusionpass.registry` imports every module here)."""
