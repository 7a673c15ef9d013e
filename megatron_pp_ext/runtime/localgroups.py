"""Process groups created by their members only: start-up that grows with the pipeline, not the world.

``torch.distributed.new_group`` wants every process of the job to call it for every group, in
one order (it numbers groups with a job-wide counter), so creating the pipeline's channel
communicators that way costs every process one call per channel of *every* pipeline, after an
all-gather over the world to agree on them. Its ``use_local_synchronization=True`` lets only the
members call, but names the group by a hash of its ranks and of the number of groups the
calling process belongs to (torch 2.13): two members that belong to different numbers of
groups (the first and last stages, Megatron's embedding groups) get different names, hence
different store prefixes, and wait for each other forever; and the four channels of a pair of
ranks share one rank set. ``split_group`` needs communicators initialised eagerly (``device_id``
given to ``init_process_group``), which our launcher, the worker pool and Megatron-LM do not do.

:func:`create` therefore builds the group the way ``new_group`` does (torch's
``_new_process_group_helper`` and its rank map) under a name both members compute alone --
the label the caller gives plus how many times this process created that label before in the
job (each job creates it once on each member) -- and only the members call it. What it costs: the
group's own store keys (gloo: each member's address; NCCL: nothing until its first op, when
the two exchange NCCL's unique id), nothing for any other process. Members must create their
groups in one global order (sorted labels: the lowest group not yet created always has every
member at it), as with ``new_group``.

This module is the one place that uses torch's private process-group API for that (why: no
public call creates a group by its members only under a name they choose; ``split_group`` comes
closest and needs eagerly initialised communicators). Every private name it uses is
feature-detected before first use (:func:`unsupported_reason`): the helper and the leading
parameters of its signature, the ``_world`` registry it fills, the default-group and
default-timeout getters, and a default process group that does not take over ``new_group``
itself (torch 2.13 delegates to a custom default group's ``new_group``), nor one bound to a device
(``init_process_group(device_id=...)``: torch then splits every new NCCL group off the world's
communicator, which every rank must join). Verified with torch 2.13 on gloo (the CPU suite,
``tests/runtime/test_localgroups.py``); the NCCL side (its unique-ID exchange through the store
under these names) runs only on a GPU (scripts/gpu_check.sh). When any of it is missing or changed,
:func:`supported` is False and ``runtime/p2p.py`` falls back to creating groups the world-wide
way (``new_group`` on every process after an all-gather of the labels): slower start-up at
scale, same groups.
"""

from __future__ import annotations

import functools
import inspect
from typing import Sequence

__all__ = ["supported", "unsupported_reason", "create"]

#: the leading parameters of ``_new_process_group_helper`` this module passes by position
_POSITIONAL = ("group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name")
#: label -> how many times this process created it in the current job (each job creates a label
#: once on each member); reset with the default group, so a worker that was restarted between
#: jobs and one that was not still agree on the names
_GENERATION: dict[str, int] = {}
_GENERATION_OF: list = [None]


@functools.lru_cache(maxsize=1)
def _helper():
    """(torch's helper, its parameter names), or (None, why not)."""
    try:
        import torch.distributed.distributed_c10d as c10d
    except ImportError as e:   # pragma: no cover - a torch without distributed
        return None, f"torch.distributed is unavailable ({e})"
    fn = getattr(c10d, "_new_process_group_helper", None)
    if fn is None:
        return None, "torch.distributed.distributed_c10d._new_process_group_helper is missing"
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None, "the signature of _new_process_group_helper cannot be read"
    if params[:len(_POSITIONAL)] != _POSITIONAL or "timeout" not in params:
        return None, f"_new_process_group_helper{params} changed (expected {_POSITIONAL} + timeout)"
    world = getattr(c10d, "_world", None)
    missing = [n for n in ("pg_map", "pg_group_ranks", "pg_names") if not hasattr(world, n)]
    missing += [n for n in ("_get_default_group", "_get_default_timeout") if not hasattr(c10d, n)]
    if missing:
        return None, f"torch.distributed.distributed_c10d lacks {', '.join(missing)}"
    return fn, params


def unsupported_reason() -> str | None:
    """Why this torch cannot create a group with its members only (None: it can), checked
    before any private name is used; see the module doc."""
    fn, why = _helper()
    if fn is None:
        return why
    import torch.distributed.distributed_c10d as c10d
    default = c10d._get_default_group()
    if callable(getattr(default, "new_group", None)):
        return f"the default process group ({type(default).__name__}) creates groups itself (new_group)"
    if getattr(default, "bound_device_id", None) is not None:
        # torch then splits every new NCCL group off the default communicator (ncclCommSplit),
        # a call every rank of the world takes part in: a group made by its members alone would hang
        return "the default process group is bound to a device (init_process_group(device_id=...))"
    return None


def supported() -> bool:
    """Whether this torch can create a group with its members only (see the module doc)."""
    return unsupported_reason() is None


def create(ranks: Sequence[int], label: str, *, backend: str, timeout=None, desc: str | None = None):
    """The process group of global ``ranks``, called by its members only (the caller is one),
    named ``mppx-{label}-{n}`` (``label``: the same on every member, unique among the groups of
    a job)."""
    why = unsupported_reason()
    if why is not None:
        raise RuntimeError(f"this torch cannot create a process group with its members only: {why}")
    import torch.distributed.distributed_c10d as c10d
    fn, params = _helper()
    default = c10d._get_default_group()
    if _GENERATION_OF[0] is not default:   # (a new job; kept alive here, so its identity is not reused)
        _GENERATION.clear()
        _GENERATION_OF[0] = default
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
    name = f"mppx-{label}-{gen}"
    pg, _ = fn(len(ranks), ranks.index(me), ranks, be, store,
               c10d.GroupName(name) if hasattr(c10d, "GroupName") else name, **kw)
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg
