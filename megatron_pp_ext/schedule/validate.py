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
   waits until its partners are posted: stricter than gloo's path, but not a proof for
   NCCL's stream models, whose ops also wait behind their stream: check 6); a rank
   that can never proceed is reported;
5. memory: the peak activation of every rank is within ``memory_budget`` (units).
6. (:func:`validate_comm_model`, for the backend's strategy) NCCL's rules: on every stream the
   sends of one rank and the receives of the other name the same messages in the same order
   (tags are ignored), the schedule runs to the end under the strategy's stream model (a
   stream op or a batch that waits for a partner stuck behind it is a deadlock), and every
   feature collective runs on a communicator of its own, issued in the same order on every
   rank that takes part.

Checks 1-3 are :mod:`.checks` (one implementation each, on the simulator's compiled form);
4 and 5 read the simulations of that same form (:mod:`.engine`). Feature packages register
extra checks with :func:`register_check`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from .commmodel import check_matching_order, comm_model as _comm_model
from .costs import CostModel
from .ir import COMM_PAIRS, Schedule, comm_channel, op_kind
from . import checks, engine, eventloop
from .checks import ValidationError, comm_problems, completeness_problems, sizes_problems, structure_problems  # noqa: F401
from .checks import fail as _fail
from .simresult import SimResult
from .simulate import simulate

_EPS = 1e-9
_CHECKS: list[Callable[[Schedule, CostModel], None]] = []


def register_check(check: Callable[[Schedule, CostModel], None]) -> Callable:
    """Add a check run by every :func:`validate` call (raise ValidationError to refuse)."""
    _CHECKS.append(check)
    return check


def validate(schedule: Schedule, cost: CostModel | None = None, *,
             memory_budget: float | None = None, deadlock_proven: bool = False,
             prepared: "engine.Prepared | None" = None, want_result: bool = True) -> SimResult | None:
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
    # rules 1-3 (checks.py) and the simulations on one coded copy (engine.py)
    if prepared is not None and prepared.schedule is schedule and prepared.cost is cost:
        prep = prepared
        _fail(schedule, checks.problems(prep))
    else:
        prep = checks.prepare_checked(schedule, cost)
    if cost is None:
        cost = CostModel.uniform(schedule.num_stages, schedule.chunks_per_rank)
    cost.check_scale(schedule.num_microbatches, "cost model")
    for check in _CHECKS:
        check(schedule, cost)
    if prep.cost is not cost:
        prep = engine.prepare(schedule, cost)
    if prep.n_comm and not deadlock_proven:
        eventloop.simulate(prep, eager=False)  # the deadlock proof
    proof = prep.results.get(False)
    if not want_result and proof is not None and min(cost.t_f) > 0:
        _check_budget(schedule, proof.peak_memory, memory_budget)
        return None
    result = eventloop.simulate(prep, eager=True)
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


def validate_comm_model(schedule: Schedule, cost: CostModel, comm_model: str) -> SimResult | None:
    """Check 6 of the module doc for the strategy a runtime uses (``comm_model``: a name of
    :mod:`.commmodel`; eager and blocking need nothing more). Returns the simulation under
    that model (None for eager/blocking), or raises ValidationError / DeadlockError."""
    model = _comm_model(comm_model)
    if model is None or not schedule.has_comm():
        return None
    problems = check_matching_order(schedule, model)
    problems += check_communicators(schedule)
    recv_kinds = {rk for rk, _ in COMM_PAIRS.values()}
    for r, ops in enumerate(schedule.ops):
        for op in ops:
            if ((op.kind in COMM_PAIRS or op.kind in recv_kinds) and op.kind not in _BUILTIN_P2P
                    and comm_channel(op.kind) == "pp"):
                problems.append(f"rank {r}: {op}: a feature's transfers on the pipeline group's stream "
                                "(register its kinds on a channel of their own)")
                break
    _fail(schedule, problems)
    return simulate(schedule, cost, comm_model=comm_model, check=False)


_BUILTIN_P2P = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B"})


def check_communicators(schedule: Schedule) -> list[str]:
    """Every collective a feature op issues (``OpKind.communicators``) is on a group other than
    the pipeline group, and each group sees its ops in the same order on every rank that has
    them (NCCL needs one submission order per communicator). Returns the problems."""
    seqs: dict[str, dict[int, list]] = defaultdict(dict)
    problems = []
    for r, ops in enumerate(schedule.ops):
        for op in ops:
            for name in op_kind(op.kind).communicators:
                if name == "pp":
                    problems.append(f"rank {r}: {op} issues a collective on the pipeline group, whose NCCL "
                                    "stream carries the point-to-point transfers")
                seqs[name].setdefault(r, []).append(op.microbatch)
    for name, by_rank in sorted(seqs.items()):
        ranks = sorted(by_rank)
        first = by_rank[ranks[0]]
        for r in ranks[1:]:
            if by_rank[r] != first:
                i = next((i for i, (a, b) in enumerate(zip(first, by_rank[r])) if a != b), min(len(first), len(by_rank[r])))
                problems.append(f"communicator {name!r}: rank {ranks[0]} and rank {r} issue its collectives in "
                                f"different orders (position {i}: microbatch "
                                f"{first[i] if i < len(first) else None} vs {by_rank[r][i] if i < len(by_rank[r]) else None})")
                break
    return problems


# -- rules 1-3 one at a time, on a schedule (the validator runs them together: checks.prepare_checked)

def _prepared(schedule: Schedule):
    return engine.prepare(schedule, CostModel.uniform(schedule.num_stages, 1))


def check_structure(schedule: Schedule) -> None:
    """Raise ValidationError unless rule 1 holds."""
    _fail(schedule, sizes_problems(schedule))
    _fail(schedule, structure_problems(_prepared(schedule)))


def check_complete(schedule: Schedule) -> None:
    """Raise ValidationError unless rule 2 holds (on a schedule that passes rule 1)."""
    _fail(schedule, completeness_problems(_prepared(schedule)))


def check_comm(schedule: Schedule) -> None:
    """Raise ValidationError unless rule 3 holds (on a schedule that passes rules 1 and 2)."""
    _fail(schedule, comm_problems(_prepared(schedule)))
