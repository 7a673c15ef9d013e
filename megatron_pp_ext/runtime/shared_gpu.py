"""Several NCCL ranks on one GPU: the environment that lets them share it.

NCCL refuses two ranks of one communicator on the same device ("Duplicate GPU detected", since
NCCL 2.5): it compares the host hash and the PCI bus id of every pair of ranks. Each rank with
an ``NCCL_HOSTID`` of its own looks like a separate host to NCCL, and with shared memory and
CUDA peer-to-peer off (``NCCL_SHM_DISABLE=1``, ``NCCL_P2P_DISABLE=1``) and the socket transport
over loopback (``NCCL_NET=Socket``, ``NCCL_SOCKET_IFNAME=lo``) the ranks talk as separate
hosts would; gloo's groups, which Megatron-Core creates next to NCCL's, use loopback too.
Timings are meaningless there (every message crosses the host twice and the ranks' kernels
time-slice the one GPU), but NCCL's matching, ordering, group completion, lazy communicator
creation and stream semantics are the real ones: the only real NCCL test a machine with one
GPU allows.

Who uses it: ``benchmarks/gpu_check`` (its NCCL worker pool), and ``mppx train --device
cuda|auto`` when ``MPPX_SHARE_GPU=1`` is set (more local processes than GPUs: every rank gets
device ``local_rank % device_count`` and this environment; without the variable the trainer
keeps refusing, so nobody shares a GPU by accident).
"""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["SHARE_GPU_ENV", "share_gpu_requested", "shared_gpu_env"]

#: the switch of ``mppx train``: several local ranks may share a GPU
SHARE_GPU_ENV = "MPPX_SHARE_GPU"


def share_gpu_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``MPPX_SHARE_GPU`` asks for ranks to share GPUs (anything but empty or 0)."""
    env = os.environ if env is None else env
    return env.get(SHARE_GPU_ENV, "").strip() not in ("", "0")


def shared_gpu_env(rank: int, *, tag: str = "mppx", env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The NCCL variables of rank ``rank`` among ranks that share a GPU. Settings the caller's
    environment already has (``env``, default ``os.environ``) for the transport are kept, the
    host id is always this rank's own."""
    env = os.environ if env is None else env
    out = {"NCCL_HOSTID": f"{tag}-rank{rank}"}
    for key, value in (("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1"), ("NCCL_NET", "Socket"),
                       ("NCCL_SOCKET_IFNAME", "lo"), ("NCCL_IB_DISABLE", "1"), ("NCCL_NVLS_ENABLE", "0"),
                       ("NCCL_MNNVL_ENABLE", "0"), ("GLOO_SOCKET_IFNAME", "lo")):
        out[key] = env.get(key, value)
    return out
