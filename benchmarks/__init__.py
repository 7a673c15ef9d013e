"""Benchmarks of megatron_pp_ext (run as scripts, e.g. ``python benchmarks/schedules.py``)."""
