"""Process groups created by their members only: start-up that grows with the pipeline, not the world.

``torch.distributed.new_group`` wants every process of the job to call it for every group, in
one order (it numbers groups with a job-wide counter), so creating the pipeline's channel
communicators that way costs every process one call per channel of *every* pipeline, after an
all-gather over the world to agree on them. Its ``use_local_synchronization=True`` lets only the
members call, but names the group by a hash of its ranks and of the number of groups the
calling process belongs to (torch 2.2 to 2.13): two members that belong to different numbers of
groups (the first and last stages, Megatron's embedding groups) get different names, hence
different store prefixes, and wait for each other forever; and the four channels of a pair of
ranks share one rank set. ``split_group`` needs communicators initialised eagerly (``device_id``
given to ``init_process_group``), which our launcher, the worker pool and Megatron-LM do not do.

:func:`create` therefore builds the group the way ``new_group`` does (torch's
``_new_process_group_helper`` and its rank map) under a name both members compute alone --
the label the caller gives plus how many times this process created that label before (each
job creates it once on each member) -- and only the members call it. What it costs: the
group's own store keys (gloo: each member's address; NCCL: nothing until its first op, when
the two exchange NCCL's unique id), nothing for any other process. Members must create their
groups in one global order (sorted labels: the lowest group not yet created always has every
member at it), as with ``new_group``.

When this torch lacks the helper (or its signature changed), :func:`supported` is False and
the caller creates groups the world-wide way.
"""

from __future__ import annotations

import inspect
from typing import Sequence

__all__ = ["supported", "create"]

_REQUIRED = ("group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name", "timeout")
#: label -> how many times this process created it (each job creates a label once on each member)
_GENERATION: dict[str, int] = {}


def _helper():
    import torch.distributed.distributed_c10d as c10d
    fn = getattr(c10d, "_new_process_group_helper", None)
    if fn is None or not hasattr(c10d, "_world"):
        return None, ()
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None, ()
    if params[:6] != _REQUIRED[:6] or "timeout" not in params:
        return None, ()
    return fn, params


def supported() -> bool:
    """Whether this torch can create a group with its members only (see the module doc)."""
    return _helper()[0] is not None


def create(ranks: Sequence[int], label: str, *, backend: str, timeout=None, desc: str | None = None):
    """The process group of global ``ranks``, called by its members only (the caller is one),
    named ``mppx-{label}-{n}`` (``label``: the same on every member, unique among the groups of
    a job)."""
    import torch.distributed.distributed_c10d as c10d
    fn, params = _helper()
    if fn is None:
        raise RuntimeError("this torch cannot create a process group with its members only "
                           "(torch.distributed.distributed_c10d._new_process_group_helper is missing or changed)")
    default = c10d._get_default_group()
    me = default.rank()
    ranks = sorted(int(r) for r in ranks)
    if me not in ranks:
        raise ValueError(f"rank {me} creates group {label!r} of ranks {ranks} without being a member")
    gen = _GENERATION.get(label, 0)
    _GENERATION[label] = gen + 1
    be = c10d.Backend(backend)
    if timeout is None:
        timeout = c10d._get_default_timeout(be)
    store = c10d._world.pg_map[default][1]
    kw = {"timeout": timeout}
    if "group_desc" in params:
        kw["group_desc"] = desc or f"mppx-{label}"
    pg, _ = fn(len(ranks), ranks.index(me), ranks, be, store, c10d.GroupName(f"mppx-{label}-{gen}")
               if hasattr(c10d, "GroupName") else f"mppx-{label}-{gen}", **kw)
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg
