"""The NCCL communication models of the simulator (schedule/commmodel.py) and the validator's
checks of NCCL's rules: hand-built cases with known answers, and the promise of docs/schedules.md#communication-on-nccl -- the
executor's NCCL strategy (channels) keeps every registered schedule at its eager makespan."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedule import CostModel, build_schedule, simulate, validate
from megatron_pp_ext.schedule.commmodel import comm_model, comm_model_names
from megatron_pp_ext.schedule.ir import Op, Schedule, ScheduleError, loop_placement
from megatron_pp_ext.schedule.passes.megatron_comm import insert_comm_megatron
from megatron_pp_ext.schedule.registry import schedule_info, schedule_names
from megatron_pp_ext.schedule.simresult import DeadlockError
from megatron_pp_ext.schedule.validate import ValidationError, validate_comm_model

NCCL = ["nccl-batched", "nccl-batched-consumer", "nccl-batched-sync", "nccl-pairwise", "nccl-channels"]


def _two_ranks(rank0: list, rank1: list, m: int = 1) -> Schedule:
    return Schedule("t", m, loop_placement(2), [rank0, rank1])


def test_one_message_costs_its_latency_under_every_model():
    s = _two_ranks([Op("F", 0, 0, 0), Op("SEND_F", 0, 0, 0, 1), Op("RECV_B", 0, 0, 0, 1), Op("BW", 0, 0, 0)],
                   [Op("RECV_F", 1, 0, 1, 0), Op("F", 1, 0, 1), Op("BW", 1, 0, 1), Op("SEND_B", 1, 0, 1, 0)])
    c = CostModel.uniform(2, 1, f=1, b=2, w=0, comm=0.25)
    # F0 [0,1] -> act at 1.25 -> F1 [1.25,2.25], BW1 [2.25,4.25] -> grad at 4.5 -> BW0 [4.5,6.5]
    for name in ["eager", "blocking"] + NCCL:
        assert simulate(s, c, comm_model=name).makespan == 6.5, name


def test_comm_wait_counts_consumer_waits_as_batch_waits():
    """The JSON's comm_wait_per_rank under every model: rank 1's forward waits 1.25 for the
    activation, rank 0's backward 3.5 for the gradient (after its forward ends at 1) -- in a batch
    under the batch-end models (where rank 1's last batch, its send, holds it 0.25 more), right
    before the reader under the consumer-wait ones."""
    s = _two_ranks([Op("F", 0, 0, 0), Op("SEND_F", 0, 0, 0, 1), Op("RECV_B", 0, 0, 0, 1), Op("BW", 0, 0, 0)],
                   [Op("RECV_F", 1, 0, 1, 0), Op("F", 1, 0, 1), Op("BW", 1, 0, 1), Op("SEND_B", 1, 0, 1, 0)])
    c = CostModel.uniform(2, 1, f=1, b=2, w=0, comm=0.25)
    for name in ["eager"] + NCCL:   # (not the validator's blocking proof: its batches wait for every partner)
        batch_end = name != "eager" and comm_model(name).recv_wait == "batch-end"
        assert simulate(s, c, comm_model=name).to_dict()["comm_wait_per_rank"] == [3.5, 1.5 if batch_end else 1.25], name
    sched, cost = build_schedule("1f1b", 4, 8, costs=(1, 1, 1, 0.05), with_comm=True)
    for name in ("nccl-batched-consumer", "nccl-pairwise", "nccl-channels"):
        d = simulate(sched, cost, comm_model=name).to_dict()
        # at most the rank's idle time (1e-9: the simulator rounds its times to 9 decimals)
        assert all(0 < w <= d["makespan"] - b + 1e-9 for w, b in zip(d["comm_wait_per_rank"], d["busy_per_rank"])), name


def test_a_batch_holds_the_compute_until_every_transfer_ends():
    """Rank 0 posts its receive of the gradient early, in the same batch as its send: with waits
    at the batch end its next forward waits for rank 1's whole backward; at the consumer (or on a
    stream of its own) it does not."""
    r0 = [Op("F", 0, 0, 0), Op("SEND_F", 0, 0, 0, 1), Op("RECV_B", 0, 0, 0, 1), Op("F", 0, 1, 0),
          Op("SEND_F", 0, 1, 0, 1), Op("RECV_B", 0, 1, 0, 1), Op("BW", 0, 0, 0), Op("BW", 0, 1, 0)]
    r1 = [Op("RECV_F", 1, 0, 1, 0), Op("F", 1, 0, 1), Op("BW", 1, 0, 1), Op("SEND_B", 1, 0, 1, 0),
          Op("RECV_F", 1, 1, 1, 0), Op("F", 1, 1, 1), Op("BW", 1, 1, 1), Op("SEND_B", 1, 1, 1, 0)]
    s = _two_ranks(r0, r1, m=2)
    c = CostModel.uniform(2, 1, f=1, b=1, w=0, comm=0.0)
    eager = simulate(s, c).makespan
    assert eager == 6.0
    assert simulate(s, c, comm_model="nccl-channels").makespan == eager
    assert simulate(s, c, comm_model="nccl-batched-consumer").makespan == eager   # (its stream is free again in time)
    # rank 0 waits for its first batch (until rank 1 sends grad 0) before F(0, 1), and for its second
    # (until grad 1) before its first backward: 2 units later
    assert simulate(s, c, comm_model="nccl-batched").makespan == 8.0


def test_megatron_core_placement_unbatched_deadlocks_on_pair_streams():
    """Megatron-Core's 1F1B issues send_forward_recv_backward as one batch because, issued one
    op at a time on a stream per pair of ranks, the send of each rank waits for a receive that
    the other rank queued behind its own send."""
    base, cost = build_schedule("1f1b", 4, 8, costs=(1, 1, 1, 0.05), with_comm=False)
    mc = insert_comm_megatron(base)
    with pytest.raises(DeadlockError, match="NCCL streams \\(nccl-pairwise\\)"):
        simulate(mc, cost, comm_model="nccl-pairwise")
    for name in ("nccl-batched", "nccl-channels"):
        simulate(mc, cost, comm_model=name)


def test_megatron_core_1f1b_is_the_baseline_the_issue_measured():
    base, cost = build_schedule("1f1b", 4, 16, costs=(1, 1, 1, 0.05), with_comm=False)
    mc = insert_comm_megatron(base)
    validate(mc, cost)
    assert simulate(mc, cost).makespan == pytest.approx(58.75)
    assert simulate(mc, cost, comm_model="nccl-batched").makespan == pytest.approx(58.75)
    ours, c2 = build_schedule("1f1b", 4, 16, costs=(1, 1, 1, 0.05), with_comm=True)
    assert simulate(ours, c2).makespan == pytest.approx(58.4)
    assert simulate(ours, c2, comm_model="nccl").makespan == pytest.approx(58.4)
    # what batching with waits at the batch end did to ours (the executor before this issue)
    assert simulate(ours, c2, comm_model="nccl-batched").makespan > 1.5 * 58.4


def _args(name: str, p: int) -> dict:
    info = schedule_info(name)
    a = {"chunks": info.min_chunks}
    if info.uses_budget:
        a["memory_budget"] = 0.75 * p
    return a


@pytest.mark.parametrize("name", schedule_names())
def test_channels_keep_the_eager_makespan(name):
    """Issue 24's bound (1.02x of eager) for the executor's NCCL strategy; measured: equal."""
    for p, m, costs in [(2, 4, (1, 1, 1, 0.3)), (4, 8, (1, 2, 1, 0.1)), (4, 16, (1, 1.8, 0.4, 0.3))]:
        try:
            s, c = build_schedule(name, p, m, costs=costs, with_comm=True, **_args(name, p))
        except ScheduleError:
            continue
        eager = simulate(s, c).makespan
        nccl = validate_comm_model(s, c, "nccl")
        assert nccl.makespan <= 1.02 * eager, (name, p, m, costs, nccl.makespan, eager)


def test_swapped_order_is_refused_for_every_nccl_model():
    s, c = build_schedule("zb-h1", 2, 4, with_comm=True)
    ops = [list(r) for r in s.ops]
    sends = [i for i, op in enumerate(ops[0]) if op.kind == "SEND_F"]
    a, b = sends[0], sends[1]
    ops[0][a], ops[0][b] = ops[0][b], ops[0][a]
    bad = Schedule(s.name, s.num_microbatches, s.placement, ops, dict(s.meta))
    for name in NCCL:
        with pytest.raises(ValidationError, match="NCCL matches in issue order"):
            validate_comm_model(bad, c, name)


def test_unknown_model_names_are_refused():
    s, c = build_schedule("1f1b", 2, 2, with_comm=True)
    with pytest.raises(ScheduleError, match="unknown communication model 'nccl-magic'"):
        simulate(s, c, comm_model="nccl-magic")
    assert comm_model("nccl").name == "nccl-channels" and comm_model("eager") is None
    assert set(NCCL) <= set(comm_model_names())


def test_the_table_of_docs_schedules_is_what_the_simulator_says():
    """docs/schedules.md, *Communication on NCCL*: its table, recomputed."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "schedules.md").read_text()
    section = text.split("## Communication on NCCL", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (our [^|]+|Megatron-Core's 1F1B[^|]*) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", section, re.M)
    assert len(rows) == 5
    costs = (1, 1, 1, 0.05)
    for label, eager, channels, batched in rows:
        if label.startswith("Megatron"):
            base, cost = build_schedule("1f1b", 4, 16, costs=costs, with_comm=False)
            s = insert_comm_megatron(base)
        else:
            name = label.split()[1]
            s, cost = build_schedule(name, 4, 16, costs=costs, with_comm=True, **_args(name, 4))
        got = [simulate(s, cost, comm_model=m).makespan for m in ("eager", "nccl-channels", "nccl-batched")]
        assert [f"{x:.2f}" for x in got] == [eager, channels, batched], label


def test_the_blocking_proof_is_no_proof_for_nccl_pairwise():
    """schedule/simulate.py's header: a schedule that runs with blocking batches runs eagerly, but
    NCCL's stream models add waits of their own -- nccl-pairwise deadlocks this proven order."""
    s, c = build_schedule("v-min", 4, 4, costs=(1, 1, 0, 0), with_comm=True)   # validated: blocking run
    assert s.meta["comm_placement"] == "early, proven deadlock-free"
    assert simulate(s, c, comm_model="blocking").makespan >= simulate(s, c).makespan   # eager waits less
    validate_comm_model(s, c, "nccl-channels")                                          # the executor's runs it
    with pytest.raises(DeadlockError, match="deadlocks") as e:
        validate_comm_model(s, c, "nccl-pairwise")
    assert e.value.model == "nccl-pairwise" and "waits for its partner" in e.value.brief()


def test_docs_quote_the_comm_benchmark_and_its_worst_cases_are_what_the_simulator_says():
    """docs/schedules.md (and README, planner.md) quote docs/benchmarks/comm.md's sweep, generated by
    `python benchmarks/comm.py`: the figures are its table's, and its pairwise examples recompute."""
    import re
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    bench = (root / "docs" / "benchmarks" / "comm.md").read_text().split("## Every schedule", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in bench.splitlines()
            if ln.startswith("| ") and not ln.startswith("| schedule")]
    num = lambda cell: float(cell.split()[0])  # noqa: E731
    channels, low = max(num(r[2]) for r in rows), max(num(r[4]) for r in rows)
    pairwise, dead = max(num(r[5]) for r in rows), sum(int(r[7]) for r in rows)
    batched = [num(r[8]) for r in rows]
    doc = " ".join((root / "docs" / "schedules.md").read_text().split())
    assert f"takes up to {channels:.3f}x its eager time on that grid when the latency equals F" in doc
    # the point off the grid the docs quote, recomputed
    from megatron_pp_ext.schedule import build_schedule, simulate
    from megatron_pp_ext.schedule.costs import CostModel
    cost = CostModel.uniform(10, 2, 1, 1, 0.4, 1)
    off = (simulate(build_schedule("zbv", 5, 5, costs=cost, with_comm=True)[0], cost, comm_model="nccl").makespan
           / simulate(build_schedule("zbv", 5, 5, costs=cost, with_comm=True)[0], cost, comm_model="eager").makespan)
    assert f"takes {off:.4f}x" in doc and f"and {off:.4f}x at zbv p=5 m=5 outside it" in " ".join(
        (root / "docs" / "planner.md").read_text().split())
    assert low == 1.0 and "at most 0.3 F (worst ratio 1.000;" in doc
    assert f"took {min(batched):.2f}-{max(batched):.2f}x its eager time" in doc
    assert f"`nccl-pairwise` up to {pairwise:.2f}x" in doc and f"deadlocks there in {dead} of the configurations" in doc
    readme = " ".join((root / "README.md").read_text().split())
    assert f"up to {channels:.3f}x at a latency equal to F on the measured grid" in readme and f"{min(batched):.2f}-{max(batched):.2f}x" in readme
    assert f"up to {channels:.3f}x when it equals F on the measured grid" in " ".join(
        (root / "docs" / "planner.md").read_text().split())
    # the worst pairwise case, and a counterexample to "up to 1.03x" (no W, latency 0.3 F)
    for costs, ratio in [((1, 1, 1, 1), pairwise), ((1, 1, 0, 0.3), 1.06)]:
        s, c = build_schedule("interleaved-1f1b", 2, 8, chunks=2, costs=costs, with_comm=True)
        got = simulate(s, c, comm_model="nccl-pairwise").makespan / simulate(s, c).makespan
        assert f"{got:.2f}" == f"{ratio:.2f}", (costs, got)
    assert re.search(r"1\.06x already at latency 0\.3 F without W: p=2, m=8, costs 1,1,0,0\.3", doc)


def _pairwise_deadlocks(name: str, p: int, m: int, costs: tuple) -> bool | None:
    """Whether ``name`` deadlocks under nccl-pairwise (None: it does not build at this size)."""
    info = schedule_info(name)
    kw = {"chunks": info.min_chunks, **({"memory_budget": 0.75 * p} if info.uses_budget else {})}
    try:
        s, c = build_schedule(name, p, m, costs=costs, with_comm=True, **kw)
    except ScheduleError:
        return None
    try:
        simulate(s, c, comm_model="nccl-pairwise")
    except DeadlockError:
        return True
    return False


def test_pairwise_deadlocks_only_where_the_docs_say():
    """docs/schedules.md's pairwise row and its fallback advice: 1f1b, interleaved-1f1b, zb-h1, zb-h2,
    grouped-interleaved and dualpipev run under nccl-pairwise with or without W; zbv, v-half, v-min,
    v-budget and interleaved-zb deadlock in some configurations where W takes no time (zbv at p=2,
    m=6 with 1,1,0,0, the row's example) and in none here where it takes time."""
    assert _pairwise_deadlocks("zbv", 2, 6, (1, 1, 0, 0)) is True
    never = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "grouped-interleaved", "dualpipev")
    with_w = ("zbv", "v-half", "v-min", "v-budget", "interleaved-zb")
    found = []
    for p, m in ((2, 6), (4, 9)):   # (zbv deadlocks at the first without W, interleaved-zb at the second with 1,3,0,0)
        for name in never:
            if _pairwise_deadlocks(name, p, m, (1, 1, 0, 0)):
                found.append((name, p, m))
        for name in with_w:
            if _pairwise_deadlocks(name, p, m, (1, 2, 1, 0.3)):
                found.append((name, p, m, "W > 0"))
    assert not found, found
