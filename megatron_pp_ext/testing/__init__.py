"""Test support: parity runs against a plain reference and the features' checks, used by tests/,
benchmarks/ and scripts/gpu_check.sh. The library never imports it (tests/test_layers.py)."""
