"""megatron_pp_ext: zero-bubble and controllable-memory pipeline schedules, vocabulary
parallelism, activation offload and BPipe for stock Megatron-Core / Megatron-LM.

Layers (each a sub-package): ``schedule`` (pure-Python core: IR, generators, passes,
validator, simulator, export, plots), ``runtime`` (torch executor on Megatron-Core
chunks), ``features`` (vocab / offload / bpipe), ``megatron_lm`` (integration),
``planner``, and the ``mppx`` command line in ``cli``.
"""

__version__ = "0.1.0"
