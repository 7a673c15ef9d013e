"""Validator: proves a schedule is complete, causal, deadlock-free and within its budget.

Every generated schedule passes through :func:`validate` before anything runs. Checks:
1. structure: op ranks agree with the placement; stages and microbatches in range; no
   duplicates;
2. completeness: each (stage, microbatch) has one F and either one BW or one B and one W
   (forward-only schedules: F alone);
3. communication (when send/recv ops are present): each send has exactly one matching
   receive on the right peer, every cross-rank input of a compute op is received earlier on
   its rank, and sends and receives between two ranks come in the same order (NCCL matches
   them in order);
4. deadlock: the schedule is executed by the simulator with blocking batches (each batch
   waits until its partners are posted: the strictest way a runtime can block); a rank
   that can never proceed is reported;
5. memory: the peak activation of every rank is within ``memory_budget`` (units).

Feature packages register extra checks with :func:`register_check`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from .costs import CostModel
from .ir import COMM_PAIRS, PEER_ROUTED, Schedule, comm_channel, matching_recv, op_kind
from . import fastsim
from .checks import ValidationError, check_complete, check_structure
from .checks import fail as _fail
from .simresult import SimResult
from .simulate import simulate

_EPS = 1e-9
_CHECKS: list[Callable[[Schedule, CostModel], None]] = []


def register_check(check: Callable[[Schedule, CostModel], None]) -> Callable:
    """Add a check run by every :func:`validate` call (raise ValidationError to refuse)."""
    _CHECKS.append(check)
    return check


def check_comm(schedule: Schedule) -> None:
    if not schedule.has_comm():
        return
    problems: list[str] = []
    placement = schedule.placement
    sends: dict[tuple, list] = defaultdict(list)     # (src, dst, channel) -> [(kind, stage, mb) of recv]
    recvs: dict[tuple, list] = defaultdict(list)
    recv_set = set()
    for r, rank_ops in enumerate(schedule.ops):
        received = set()
        for op in rank_ops:
            spec = op_kind(op.kind)
            if spec.category == "comm":
                if op.kind in COMM_PAIRS:
                    rk, rs, rm = matching_recv(op)
                    if not 0 <= rs < schedule.num_stages:
                        problems.append(f"rank {r}: {op} sends to a stage that does not exist")
                        continue
                    if op.kind not in PEER_ROUTED and op.peer != placement[rs]:
                        problems.append(f"rank {r}: {op} must go to rank {placement[rs]} (stage {rs})")
                    sends[(r, op.peer, comm_channel(op.kind))].append((rk, rs, rm))
                else:
                    recvs[(op.peer, r, comm_channel(op.kind))].append((op.kind, op.stage, op.microbatch))
                    recv_set.add((op.kind, op.stage, op.microbatch, r))
                    received.update(spec.produces(op, schedule))
            elif spec.category == "compute":
                for key in spec.requires(op, schedule):
                    tag, ks, _ = key
                    if 0 <= ks < schedule.num_stages and placement[ks] != r and key not in received:
                        problems.append(f"rank {r}: {op} needs {key} from rank {placement[ks]} "
                                        "but no receive for it comes earlier on this rank")
    for chan in set(sends) | set(recvs):
        if sends[chan] != recvs[chan]:
            s, d = chan[:2]
            extra_s = set(sends[chan]) - set(recvs[chan])
            extra_r = set(recvs[chan]) - set(sends[chan])
            if extra_s or extra_r:
                problems.append(f"ranks {s}->{d}: unmatched sends {sorted(extra_s)[:3]} / "
                                f"unmatched receives {sorted(extra_r)[:3]}")
            else:
                problems.append(f"ranks {s}->{d}: sends and receives are in different orders "
                                "(point-to-point matches in order)")
    _fail(schedule, problems)


def validate(schedule: Schedule, cost: CostModel | None = None, *,
             memory_budget: float | None = None, deadlock_proven: bool = False,
             prepared: "fastsim.Prepared | None" = None, want_result: bool = True) -> SimResult | None:
    """Run every check; return the (eager-communication) simulation under ``cost``, default uniform.

    ``deadlock_proven``: the caller has just run the blocking-batch simulation of this very
    schedule (insert_comm does), so it is not repeated. ``prepared``: that run's coded copy of
    this very schedule and cost (:func:`..passes.comm.insert_comm_proven`), reused as is.
    ``want_result=False``: the caller only needs the verdict; with a proven ``prepared`` the
    memory check then reads the peaks of the proof's own run instead of simulating again
    (the same peaks: a rank's memory follows its op order, whatever the waits, as long as
    no forward takes zero time), and None is returned."""
    if cost is None and schedule.num_ranks and schedule.num_stages \
            and schedule.num_stages % schedule.num_ranks == 0:
        cost = CostModel.uniform(schedule.num_stages, schedule.chunks_per_rank)
    # built-in kinds: checks and simulations on one coded copy (fastsim.py), same verdicts
    if prepared is not None and prepared.schedule is schedule and prepared.cost is cost:
        prep = prepared
    else:
        prep = fastsim.prepare(schedule, cost) if cost is not None else None
    if prep is None or not prep.check():
        prep = None
        check_structure(schedule)
        check_complete(schedule)
        check_comm(schedule)
    if cost is None:
        cost = CostModel.uniform(schedule.num_stages, schedule.chunks_per_rank)
    cost.check_scale(schedule.num_microbatches, "cost model")
    for check in _CHECKS:
        check(schedule, cost)
    result = None
    if prep is not None:
        if prep.n_comm and not deadlock_proven:
            prep.simulate(eager=False)  # the deadlock proof
        proof = prep.results.get(False)
        if not want_result and proof is not None and min(cost.t_f) > 0:
            _check_budget(schedule, proof.peak_memory, memory_budget)
            return None
        result = prep.simulate(eager=True)
    elif schedule.has_comm() and not deadlock_proven:
        simulate(schedule, cost, comm_model="blocking", check=False)  # the deadlock proof
    if result is None:
        result = simulate(schedule, cost, check=False)
    _check_budget(schedule, result.peak_memory, memory_budget)
    return result


def _check_budget(schedule: Schedule, peaks: list[float], memory_budget: float | None) -> None:
    if memory_budget is None:
        return
    over = [(r, pk) for r, pk in enumerate(peaks) if pk > memory_budget + _EPS]
    if over:
        r, pk = max(over, key=lambda x: x[1])
        raise ValidationError(
            f"schedule {schedule.name!r} needs {pk:g} activation units on rank {r}, over the memory "
            f"budget of {memory_budget:g} (--memory-budget); raise the budget or pick a schedule with "
            "less memory (v-half, v-min, v-budget)")
