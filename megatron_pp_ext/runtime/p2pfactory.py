"""The strategy the executor uses for a call: the real ones (:mod:`.p2p`) or their NCCL emulation
on gloo (:mod:`.nccl_emulation`, which builds on :mod:`.p2p`). This module sits above both, so
neither imports the other's caller: ``p2p`` <- ``nccl_emulation`` <- ``p2pfactory``."""

from __future__ import annotations

import torch.distributed as dist

from .nccl_emulation import EmulatedNCCL
from .p2p import P2P, BatchedP2P, ChannelP2P, PairwiseP2P, TaggedP2P

__all__ = ["STRATEGIES", "make_p2p"]

#: strategy name -> its class on a real backend
STRATEGIES = {"tagged": TaggedP2P, "batched": BatchedP2P, "pairwise": PairwiseP2P, "channels": ChannelP2P}


def make_p2p(pp_group, strategy: str | None, *, num_stages: int, num_microbatches: int,
             emulate_nccl: bool = False, defer_recvs: bool = True, sync_after_batch: bool = False,
             timeout: float | None = None) -> P2P:
    """The strategy for a call: ``None`` picks ``channels`` on NCCL (and when emulating NCCL on
    gloo) and ``tagged`` elsewhere."""
    backend = dist.get_backend(pp_group)
    if strategy is None:
        strategy = "channels" if backend == "nccl" or emulate_nccl else "tagged"
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown p2p strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    kw = dict(num_stages=num_stages, num_microbatches=num_microbatches)
    bound = _bound_device(pp_group)
    if strategy == "pairwise" and bound is not None:
        # (torch then runs every unbatched send and receive of the group on the group's one
        # communicator and stream, so pairwise's one stream per pair of neighbours does not hold)
        raise ValueError(f"--p2p-strategy pairwise needs a communicator per pair of ranks, but the process group is "
                         f"bound to {bound} (init_process_group(device_id=...)): use --p2p-strategy channels")
    if backend == "nccl" and (emulate_nccl or strategy == "tagged"):
        # (threads issuing NCCL ops with tags NCCL ignores: messages matched in the wrong order)
        raise ValueError("the NCCL emulation (MPPX_EMULATE_NCCL, --emulate-nccl) and the tagged p2p strategy are "
                         "for gloo; on NCCL use an NCCL strategy (channels, batched or pairwise) and unset "
                         "MPPX_EMULATE_NCCL")
    if emulate_nccl:
        if strategy == "tagged":
            raise ValueError("--emulate-nccl emulates an NCCL strategy (channels, batched or pairwise), not 'tagged'")
        return EmulatedNCCL(pp_group, strategy, sync_after_batch=sync_after_batch, timeout=timeout, **kw)
    if strategy == "tagged":
        return TaggedP2P(pp_group, defer_recvs=defer_recvs, **kw)
    if strategy == "batched":
        return BatchedP2P(pp_group, sync_after_batch=sync_after_batch, **kw)
    if backend != "nccl":
        raise ValueError(f"p2p strategy {strategy!r} is NCCL's (untagged, matched in issue order); on "
                         f"{backend} use 'tagged', or emulate NCCL (--emulate-nccl)")
    return STRATEGIES[strategy](pp_group, **kw)


def _bound_device(group) -> object | None:
    """The device ``group`` (or the default group it came from) is bound to, or None."""
    found = getattr(group, "bound_device_id", None)
    if found is None and dist.is_initialized():
        found = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    return found
