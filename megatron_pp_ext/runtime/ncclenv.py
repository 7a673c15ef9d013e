"""The environment variables of the NCCL path, checked before any process starts (torch-free).

* ``MPPX_NCCL_TIMEOUT``: seconds an emulated NCCL wait may take before it is reported as a hang
  (:mod:`.nccl_rules`);
* ``MPPX_EMULATE_NCCL``: ``1`` / ``channels`` / ``batched`` / ``pairwise`` runs the executor's NCCL
  strategy on gloo with NCCL's rules (CPU processes only);
* ``CUDA_DEVICE_MAX_CONNECTIONS=1``: one hardware queue per GPU (what Megatron-LM advises for its
  tensor-parallel communication overlap); features that hang under it say so
  (``one_queue_hang`` of their trainer plug-in) and are refused with it;
* on a GPU, what the NCCL communicators' memory is computed from (:mod:`.ncclmem`):
  ``MPPX_NCCL_MEMORY`` (measured figures), ``MPPX_NCCL_P2P_LINK`` and NCCL's buffer variables.

Each bad value or combination is one line naming the variable and the fix (ValueError).
"""

from __future__ import annotations

import math
import os
from typing import Mapping

from .p2pstrategy import NCCL_STRATEGIES as _STRATEGIES

__all__ = ["DEFAULT_TIMEOUT", "hang_timeout", "emulated_strategy", "one_hardware_queue", "check_nccl_environment"]

#: seconds a wait may take before the emulation calls it a hang (MPPX_NCCL_TIMEOUT overrides)
DEFAULT_TIMEOUT = 60.0


def hang_timeout(value: str | float | None = None, env: Mapping[str, str] | None = None) -> float:
    """The hang timeout in seconds: ``value``, else ``$MPPX_NCCL_TIMEOUT``, else 60. A finite number
    from 0.1 s (below that a slow CPU step reads as a hang) to a day, or ValueError."""
    env = os.environ if env is None else env
    if value is None:
        value = env.get("MPPX_NCCL_TIMEOUT")
        if value is None or str(value).strip() == "":
            return DEFAULT_TIMEOUT
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = math.nan
    if not (math.isfinite(t) and 0.1 <= t <= 86400):
        raise ValueError(f"MPPX_NCCL_TIMEOUT={value!r}: the emulated NCCL hang timeout must be a number of seconds "
                         f"from 0.1 to 86400 (unset it for the default {DEFAULT_TIMEOUT:g})")
    return t


def emulated_strategy(env: Mapping[str, str] | None = None) -> str | None:
    """The NCCL strategy ``MPPX_EMULATE_NCCL`` asks to emulate (``1``: channels), None when unset or 0."""
    env = os.environ if env is None else env
    v = env.get("MPPX_EMULATE_NCCL", "").strip()
    if v in ("", "0"):
        return None
    if v == "1":
        return "channels"
    if v not in _STRATEGIES:
        raise ValueError(f"MPPX_EMULATE_NCCL={v!r}: use 1 (channels), {', '.join(_STRATEGIES)}, or 0 / unset (no "
                         "emulation)")
    return v


def one_hardware_queue(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set (one hardware queue per GPU)."""
    env = os.environ if env is None else env
    return env.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip() == "1"


def check_nccl_environment(*, gpu: bool, emulating: bool, one_queue_hangs: list[tuple[str, str]] = (),
                           env: Mapping[str, str] | None = None) -> None:
    """The NCCL environment of a run on a GPU (``gpu``) or emulating NCCL on CPU processes
    (``emulating``; also when MPPX_EMULATE_NCCL is set): valid values, no emulation on a GPU, and
    no feature that hangs under one hardware queue with ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    (``one_queue_hangs``: (flag, why) of the run's features)."""
    env = os.environ if env is None else env
    hang_timeout(env=env)
    strategy = emulated_strategy(env)
    if gpu and strategy is not None:
        raise ValueError(f"MPPX_EMULATE_NCCL={env.get('MPPX_EMULATE_NCCL')}: the NCCL emulation runs on CPU processes "
                         "(gloo); on a GPU NCCL itself runs: unset MPPX_EMULATE_NCCL")
    if gpu:
        from .ncclmem import nccl_memory
        nccl_memory(env)
    if (gpu or emulating or strategy is not None) and one_hardware_queue(env):
        for flag, why in one_queue_hangs:
            raise ValueError(f"CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue) with {flag} hangs: {why}; unset "
                             f"CUDA_DEVICE_MAX_CONNECTIONS for this run or drop {flag} (docs/gpu.md#what-a-green-cpu-"
                             "run-proves-nccls-rules-on-gloo)")
