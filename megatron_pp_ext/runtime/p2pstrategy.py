"""The executor's point-to-point strategies: their names, models and deadlock proofs (torch-free).

``--p2p-strategy`` (``mppx train``, the Megatron-LM integration) picks how the executor runs a
schedule's sends and receives on NCCL (:mod:`.p2p`); each strategy realises one communication
model of the simulator (:mod:`megatron_pp_ext.schedule.commmodel`), under which the schedule is
checked -- matching order, no deadlock -- before any process starts (:func:`check_strategy`):

* ``channels`` (the default): one two-rank communicator per sender, receiver and message kind;
  a schedule keeps its eager time. Four communicators per inner rank (two per neighbour).
* ``pairwise``: plain ``isend``/``irecv`` on the pipeline group, one communicator per pair of
  neighbours (torch's); the fallback when a cluster hangs with several communicators of one GPU
  in use at once. Some orders deadlock under it (they are refused).
* ``batched``: one ``batch_isend_irecv`` per run of comm ops on the pipeline group's communicator,
  waited for at its end (Megatron-Core's way); one communicator, the slowest.

On CPU processes (gloo) the executor runs gloo's tagged point-to-point; the NCCL strategies run
there only under NCCL's rules emulated (``--emulate-nccl``): gloo has no streams for
``channels``/``pairwise`` to mean anything, and its ``batch_isend_irecv`` hangs on the
executor's batches (torch 2.13: 1f1b and zbv at pp=2).
"""

from __future__ import annotations

__all__ = ["NCCL_STRATEGIES", "DEFAULT_STRATEGY", "comm_model_of", "check_strategy", "StrategyError"]

#: the strategies ``--p2p-strategy`` takes (the executor's NCCL strategies)
NCCL_STRATEGIES = ("channels", "pairwise", "batched")
DEFAULT_STRATEGY = "channels"
_MODELS = {"channels": "nccl-channels", "pairwise": "nccl-pairwise", "batched": "nccl-batched", "tagged": "eager"}


class StrategyError(ValueError):
    """A strategy that cannot run this schedule here; the message names the flag and the fix."""


def comm_model_of(strategy: str, *, sync_after_batch: bool = False) -> str:
    """The simulator's communication model a strategy realises (``tagged``: gloo's, eager)."""
    if strategy not in _MODELS:
        raise StrategyError(f"unknown p2p strategy {strategy!r}; one of {', '.join(_MODELS)}")
    if strategy == "batched" and sync_after_batch:
        return "nccl-batched-sync"
    return _MODELS[strategy]


def check_strategy(strategy: str, schedule=None, cost=None, *, gpu: bool, emulate: bool = False,
                   flag: str = "--p2p-strategy") -> None:
    """Refuse, in one line naming ``flag`` and the fix, a strategy that is unknown, that the
    backend cannot run (an NCCL strategy on gloo without the emulation), or under which
    ``schedule`` (with its comm ops) deadlocks or mismatches its messages
    (:func:`~megatron_pp_ext.schedule.validate.validate_comm_model`: its proof)."""
    if strategy not in NCCL_STRATEGIES:
        raise StrategyError(f"{flag} {strategy!r}: unknown strategy; use one of {', '.join(NCCL_STRATEGIES)} "
                            f"(default {DEFAULT_STRATEGY})")
    if not gpu and not emulate:
        why = ("gloo's batch_isend_irecv hangs on the executor's batches" if strategy == "batched" else
               "it is NCCL's (untagged, one stream per communicator), which gloo does not have")
        raise StrategyError(f"{flag} {strategy} on CPU processes (gloo): {why}; add --emulate-nccl to run it under "
                            f"NCCL's rules emulated, or drop {flag} (gloo's tagged point-to-point)")
    if schedule is None or not schedule.has_comm():
        return
    from ..schedule import CostModel, ScheduleError
    from ..schedule.validate import validate_comm_model
    if cost is None:
        cost = CostModel.uniform(schedule.num_stages, 1)
    try:
        validate_comm_model(schedule, cost, comm_model_of(strategy))
    except ScheduleError as e:
        brief = getattr(e, "brief", None)
        first = " ".join((brief() if callable(brief) else str(e)).split())[:300]
        fix = ("use --p2p-strategy channels (the default)" if strategy != "channels" else
               "use another schedule")
        raise StrategyError(f"{flag} {strategy}: schedule {schedule.name!r} at pp={schedule.num_ranks} with "
                            f"{schedule.num_microbatches} microbatches cannot run under it ({first}); {fix}") from None
