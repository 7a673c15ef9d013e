"""megatron_pp_ext: zero-bubble and controllable-memory pipeline schedules, vocabulary
parallelism, activation offload and BPipe for stock Megatron-Core / Megatron-LM.

Layers (each a sub-package): ``schedule`` (pure-Python core: IR, generators, passes,
validator, simulator, export, plots), ``runtime`` (torch executor on Megatron-Core
chunks), ``features`` (vocab / offload / bpipe), ``megatron_lm`` (integration),
``planner``, and the ``mppx`` command line in ``cli``.
"""

__version__ = "0.1.0"

# Megatron-Core 0.18+ imports triton, and Megatron-LM 0.18+ typing.override (Python 3.12): let
# them import on a CPU-only Python 3.11 (megatron_pp_ext.compat; no-ops where not needed)
from .compat import install_import_shims as _install_import_shims

_install_import_shims()
