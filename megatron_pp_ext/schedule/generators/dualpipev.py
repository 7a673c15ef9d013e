"""DualPipeV (placeholder until its generator lands)."""
