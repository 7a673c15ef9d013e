"""Event simulation of a schedule under a cost model.

One simulator serves the generators, the validator, the tests, the planner and the
reports. Each rank executes its op list in order. Ops run on per-rank streams named by
their kind's category ("compute", or a feature's stream such as "d2h"); an op starts when
its stream is free, the op before it in the list has started, and the data keys it needs
are available on its rank.

Two models of communication:
- *Compute-only schedules* (no comm ops): a key produced on another rank arrives
  ``comm`` time units after its producer ends (recvs are assumed to be posted early).
- *Schedules with send/recv ops*, two models:
  ``comm_model="eager"`` (timing, the default): a send is posted and the rank goes on; a
  receive's data arrives ``comm`` after both it and its send are posted, and only the op
  that consumes it waits. This is how the runtime runs (receives posted early, sends waited
  for lazily).
  ``comm_model="blocking"`` (the validator's deadlock proof): consecutive comm ops of a rank
  on one channel form one batch (as ``batch_isend_irecv`` issues them) that blocks the rank
  until every op in it is matched by its partner *posted* on the peer rank. A schedule that
  runs under this model runs under the eager one (gloo's tagged point-to-point), which only
  ever waits less. It proves nothing for NCCL's stream models (``comm_model="nccl-..."``,
  :mod:`.commmodel`): there an op also waits behind the ops issued before it on its stream,
  and ``nccl-pairwise`` (both directions between two ranks on one stream) deadlocks orders
  this model accepts (v-min at p=4, m=4, costs 1,1,0,0; ``tests/test_comm_models.py``).
  :func:`.validate.validate_comm_model` checks a schedule under the model that will run it.
A rank that can never proceed is a deadlock, reported with what every rank waits for.
Comm kinds a feature registers with a duration and a memory effect (BPipe's transfers to a
partner rank) take ``comm`` + their duration once both sides are posted, one at a time per
direction of a channel, and are charged on both ranks: a receive holds its buffer once both
sides are posted, a send frees its data when the transfer ends.

The semantics live in one place: :mod:`.engine` compiles the schedule from the op-kind registry
and runs the one event loop of each model; this module checks the inputs and calls it.
"""

from __future__ import annotations

from .commmodel import comm_model as comm_model_of
from .costs import CostModel
from .ir import Schedule, ScheduleError
from .simresult import DeadlockError, SimResult

__all__ = ["simulate", "DeadlockError", "SimResult"]


def simulate(schedule: Schedule, cost: CostModel, *, comm_model: str = "eager", check: bool = True) -> SimResult:
    """Run ``schedule`` under ``cost``. Raises DeadlockError / ScheduleError when it cannot run.

    ``check`` (default): first refuse, with a ValidationError, a schedule the validator would
    refuse for its structure or completeness (an op missing or duplicated, no microbatch, a
    placement that does not match the ops), and costs the arithmetic cannot carry
    (:meth:`CostModel.check_scale`). Generators simulating their own orders pass False."""
    from . import checks, engine, eventloop
    comm_model_of(comm_model)  # refuses unknown names
    if cost.num_stages != schedule.num_stages:
        raise ScheduleError(f"cost model has {cost.num_stages} stages, schedule has {schedule.num_stages}")
    if check:
        prep = checks.prepare_checked(schedule, cost, comm=False)
        cost.check_scale(schedule.num_microbatches, "cost model")
    else:
        prep = engine.prepare(schedule, cost)
    return eventloop.simulate(prep, comm_model)
