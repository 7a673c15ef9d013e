"""Export/import: our JSON, PyTorch pipelining's compute-only CSV, and torch's own schedules.

torch is imported only inside the tests that compare with torch.distributed.pipelining.
"""

import subprocess
import sys

import pytest

from megatron_pp_ext.schedule import (CostModel, Op, Schedule, ScheduleError, ValidationError, build_schedule,
                                      insert_comm, schedule_info, schedule_names, simulate, validate)
from megatron_pp_ext.schedule.export import (dumps_json, from_torch_csv, from_torch_rows, load, load_with_cost,
                                             loads_json, loads_json_with_cost, save, to_torch_csv, to_torch_rows)


def build(name, p=4, m=8, **kw):
    info = schedule_info(name)
    chunks = 2 if "interleaved" in name and info.chunks is None else 1
    budget = p / 2 + 1 if info.uses_budget else None
    return build_schedule(name, p, m, chunks=chunks, memory_budget=budget, **kw)


# --- JSON ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("with_comm", [False, True])
def test_json_round_trip_every_schedule(name, with_comm):
    s, c = build(name, costs=(1, 1.8, 0.4, 0.1), with_comm=with_comm)
    assert loads_json(dumps_json(s)) == s
    back, cost = loads_json_with_cost(dumps_json(s, c))
    assert back == s and cost == c
    assert loads_json_with_cost(dumps_json(s))[1] is None


def test_json_round_trip_exact_meta_and_cost_extra():
    s, c = build("1f1b", 3, 4)
    s.meta.update(pairs=[(0, 1), (2, 3)], by_stage={0: "a", (1, 2): [1.5, None]}, flag=True,
                  nested={"__tuple__": 1}, x=0.1 + 0.2)
    c = CostModel(t_f=(0.1, 1 / 3, 2.0), t_b=(1.0, 1.0, 3e-9), t_w=(0.0, 0.5, 0.25), comm=0.07,
                  act=(1.0, 0.5, 0.25), w_fraction=0.9, bytes_per_unit=3.5e9, bytes_per_message=1 << 20,
                  extra={"profile": (1, 2), 3: "int key"})
    back, cost = loads_json_with_cost(dumps_json(s, c, indent=2))
    assert back == s and back.meta["pairs"][0] == (0, 1) and back.meta["by_stage"][(1, 2)] == [1.5, None]
    assert cost == c and cost.extra == c.extra


def test_json_refuses_unserialisable_meta_and_wrong_cost():
    s, c = build("1f1b", 2, 2)
    s.meta["obj"] = object()
    with pytest.raises(ScheduleError, match="JSON"):
        dumps_json(s)
    s2, _ = build("1f1b", 3, 2)
    with pytest.raises(ScheduleError, match="stages"):
        dumps_json(s2, c)


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "object"),
    ('{"name": "x"}', "format"),
    ('{"format": "megatron_pp_ext.schedule/9", "name": "x"}', "not supported"),
    ('{"format": "megatron_pp_ext.schedule/1", "name": "x", "placement": [0], "ops": [[]]}', "num_microbatches"),
    ('{"format": "megatron_pp_ext.schedule/1", "name": "x", "num_microbatches": "2", "placement": [0], '
     '"ops": [[]]}', "num_microbatches"),
    ('{"format": "megatron_pp_ext.schedule/1", "name": "x", "num_microbatches": 2, "placement": [0], '
     '"ops": [[{"kind": "F", "stage": 0}]]}', "op 0 of rank 0"),
    ('{"format": "megatron_pp_ext.schedule/1", "name": "x", "num_microbatches": 2, "placement": [0], '
     '"ops": [[]], "cost": {"t_f": [1]}}', "cost model"),
])
def test_json_malformed_input(text, match):
    with pytest.raises(ScheduleError, match=match):
        loads_json_with_cost(text)


@pytest.mark.parametrize("where,value,match", [
    ("placement", [0.7, 1], "'placement' must be a list of rank numbers"),
    ("stage", "0", "stage must be an integer"), ("stage", 0.0, "stage must be an integer"),
    ("stage", False, "stage must be an integer"), ("microbatch", 1.5, "microbatch must be an integer"),
    ("microbatch", True, "microbatch must be an integer"), ("rank", "0", "rank must be an integer"),
    ("peer", 1.0, "peer must be an integer or null"),
    ("comm", "0", "field 'comm' must be a number"), ("t_f", [1, "1"], "field 't_f' must be a list of numbers"),
])
def test_json_indices_and_times_must_be_json_numbers(where, value, match):
    """A wrongly typed index or time is refused, never converted: placement [0.7, 1] was read as
    [0, 1], microbatch 1.5 as 1, a comm time "0" as 0."""
    import json
    d = json.loads(dumps_json(build_schedule("1f1b", 2, 2, with_comm=True)[0], CostModel.uniform(2)))
    if where == "placement":
        d["placement"] = value
    elif where in ("comm", "t_f"):
        d["cost"][where] = value
    else:
        d["ops"][0][0][where] = value
    with pytest.raises(ScheduleError, match=match):
        loads_json_with_cost(json.dumps(d))


# --- torch CSV -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", schedule_names())
def test_csv_round_trip_every_schedule(name):
    s, c = build(name, with_comm=True)
    text = to_torch_csv(s)
    assert "SEND" not in text and "RECV" not in text
    back = from_torch_csv(text)
    compute = s.without(["comm"])
    assert back.ops == compute.ops
    assert back.placement == s.placement and back.num_microbatches == s.num_microbatches
    assert back.meta.get("overlap_pairs") == s.meta.get("overlap_pairs")
    assert to_torch_csv(back) == text
    res = validate(back, c)
    assert res.makespan == pytest.approx(simulate(compute, c).makespan)


def test_csv_cells_use_torch_letters():
    s, _ = build("zb-h1", 2, 2)
    rows = to_torch_rows(s)
    cells = {c for r in rows for c in r}
    assert {"0F0", "1I0", "1W0"} <= cells and all(c[-2] in "FIW" for c in cells)
    s1, _ = build("1f1b", 2, 2)
    assert to_torch_csv(s1).splitlines()[1] == "1F0,1B0,1F1,1B1"


def test_csv_dualpipev_overlap_cells_and_flat_export():
    s, _ = build("dualpipev", 2, 4)
    text = to_torch_csv(s)
    assert "(0F3;3B1)OVERLAP_F_B" in text
    flat = to_torch_csv(s, overlap=False)
    assert "OVERLAP" not in flat
    back = from_torch_csv(flat)
    assert back.ops == s.ops and "overlap_pairs" not in back.meta


def test_csv_import_skips_idle_cells_and_torch_lowering_actions():
    text = "0F0,,0UNSHARD,0SEND_F0,0F1,None,1RECV_B0,0B0,0B1,0REDUCE_GRAD\n1RECV_F0,1F0,1SEND_B0,1F1,1B0,1B1\n"
    s = from_torch_csv(text)
    assert [str(o) for o in s.ops[0]] == ["0F0", "0F1", "0BW0", "0BW1"]
    assert s.placement == (0, 1) and s.num_microbatches == 2
    validate(s)


def test_csv_placement_and_microbatches_given():
    s, _ = build("1f1b", 2, 3)
    text = to_torch_csv(s)
    back = from_torch_csv(text, num_microbatches=3, placement=(0, 1))
    assert back.ops == s.ops
    with pytest.raises(ScheduleError, match="num_microbatches=2"):
        from_torch_csv(text, num_microbatches=2)
    with pytest.raises(ScheduleError, match="placed on rank"):
        from_torch_csv(text, placement=(1, 0))
    with pytest.raises(ScheduleError, match="rows"):
        from_torch_csv(text, placement=(0, 1, 2))


@pytest.mark.parametrize("text,match", [
    ("", "empty"),
    ("0F0,0X0\n", "cannot read action '0X0'"),
    ("0F0,F1\n", "cannot read action 'F1'"),
    ("0F0,0B0\n0F1\n", "stage 0 appears on rank 0 and on rank 1"),
    ("0F0,0B0\n2F0,2B0\n", r"stages \[1\] appear on no rank"),
    ("0F0,0B0,0B0\n", "appears 2 times"),
    ("0F0,0I0\n", "B=1 W=0"),
    ("0F0,(0F1;0F2)OVERLAP_F_B\n", "one forward and one backward"),
])
def test_csv_malformed_input(text, match):
    with pytest.raises(ScheduleError, match=match):
        from_torch_csv(text)


def test_csv_incomplete_schedule_is_a_validation_error_unless_unchecked():
    with pytest.raises(ValidationError):
        from_torch_csv("0F0,0I0\n")
    s = from_torch_csv("0F0,0I0\n", check=False)
    assert [o.kind for o in s.ops[0]] == ["F", "B"]


def test_csv_refuses_kinds_torch_cannot_express():
    from megatron_pp_ext.schedule.ir import OpKind, register_op_kind, unregister_op_kind
    s = Schedule("x", 1, (0,), [[Op("F", 0, 0, 0), Op("TEST_ONLY_X", 0, 0, 0)]])
    register_op_kind(OpKind("TEST_ONLY_X", "compute", "test-only compute kind"))
    try:
        with pytest.raises(ScheduleError, match="no PyTorch pipelining equivalent"):
            to_torch_csv(s)
    finally:
        unregister_op_kind("TEST_ONLY_X")


# --- files -----------------------------------------------------------------------------------

def test_save_load_by_extension_and_fmt(tmp_path):
    s, c = build("zbv", 3, 6, with_comm=True)
    save(s, tmp_path / "a.json", cost=c)
    back, cost = load_with_cost(tmp_path / "a.json")
    assert back == s and cost == c
    save(s, tmp_path / "a.csv")
    back = load(tmp_path / "a.csv")
    assert back.ops == s.without(["comm"]).ops and back.name == "a"
    save(s, tmp_path / "plain.txt", fmt="csv")
    assert load(tmp_path / "plain.txt", fmt="torch").ops == back.ops
    save(s, tmp_path / "b.sched", fmt="JSON")
    assert load(tmp_path / "b.sched", fmt="json") == s
    with pytest.raises(ScheduleError, match="extension"):
        save(s, tmp_path / "a.yaml")
    with pytest.raises(ScheduleError, match="unknown schedule file format"):
        load(tmp_path / "a.csv", fmt="xml")
    with pytest.raises(ScheduleError, match="CSV files only"):
        load(tmp_path / "a.json", placement=(0, 1, 2))


def test_export_imports_no_torch():
    code = ("import sys, megatron_pp_ext.schedule.export as e; "
            "e.from_torch_csv(e.to_torch_csv(e.loads_json(e.dumps_json("
            "__import__('megatron_pp_ext.schedule', fromlist=['x']).build_schedule('dualpipev', 2, 4)[0])))); "
            "bad=[m for m in ('torch','numpy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- PyTorch pipelining ------------------------------------------------------------------------

def _torch_runtime(p, num_stages, m):
    """torch's schedule runtime on mocked stages (no process group, no GPU), as
    torch.distributed.pipelining._schedule_visualizer does."""
    from unittest import mock

    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining.stage import PipelineStage
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, num_stages
    return ts, ts._PipelineScheduleRuntime([stage] * (num_stages // p), m)


def _torch_dry_run(ts, runtime):
    """torch's own comm/compute dry run over the lowered schedule; raises on a deadlock."""
    keep = {"F", "I", "W", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"}
    order = {}
    for r, acts in runtime.pipeline_order_with_comms.items():
        order[r] = [a for act in acts for a in (act.sub_actions or (act,)) if a.computation_type.value in keep]
    n = sum(len(v) for v in order.values())
    out = ts._simulate_comms_compute(order, lambda s: runtime.stage_index_to_group_rank[s], runtime._num_stages)
    assert sum(a is not None for v in out.values() for a in v) == n


@pytest.mark.parametrize("name", schedule_names())
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 9)])
def test_exported_csv_loads_and_validates_in_torch(name, p, m, tmp_path):
    s, _ = build(name, p, m, costs=(1, 2, 1, 0.1), with_comm=True)
    path = tmp_path / f"{name}.csv"
    save(s, path)
    ts, runtime = _torch_runtime(p, s.num_stages, m)
    runtime._load_csv(str(path))  # torch's loader: _validate_schedule + lowering with send/recv
    assert runtime.stage_index_to_group_rank == dict(enumerate(s.placement))
    order = {r: [a for a in acts if a is not None] for r, acts in runtime.pipeline_order.items()}
    assert [[str(a) for a in order[r]] for r in range(p)] == to_torch_rows(s)
    ts._validate_schedule(order, p, s.num_stages, m)
    _torch_dry_run(ts, runtime)
    # torch's formatter accepts it too
    assert "Rank 0" in ts._format_pipeline_order(order)


# torch's Schedule1F1B is left out: its informational pipeline_order (torch 2.13) numbers the last
# rank's forwards from 1, skipping microbatch 0, so it is not a complete schedule.
TORCH_SCHEDULES = [("Interleaved1F1B", 2, "loop"), ("InterleavedZeroBubble", 2, "loop"),
                   ("ZBVZeroBubble", 2, "v"), ("DualPipeV", 2, "v")]


@pytest.mark.parametrize("torch_name,v,placement", TORCH_SCHEDULES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_torch_schedules_convert_and_run_in_our_simulator(torch_name, v, placement, p, m):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from megatron_pp_ext.schedule import loop_placement, v_placement
    rows = get_schedule_ops(torch_name, p, m, num_stages_per_rank=v)
    s = from_torch_rows(rows, name=torch_name)
    S = p * (v or 1)
    assert s.placement == (v_placement(p) if placement == "v" else loop_placement(p, v or 1))
    assert s.num_microbatches == m and s.num_stages == S
    cost = CostModel.from_spec("1,2,1,0.1", S, v or 1)
    res = validate(s, cost)
    assert 0 <= res.bubble_rate < 1
    validate(insert_comm(s, cost), cost)  # our blocking-comm runtime model runs it too
    # same text both ways
    assert from_torch_csv(to_torch_csv(s)).ops == s.ops
    if torch_name == "DualPipeV":
        assert s.meta["overlap_pairs"]


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 16), (5, 13)])
def test_torch_dualpipev_equals_ours(p, m):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    ours, _ = build("dualpipev", p, m)
    theirs = from_torch_rows(get_schedule_ops("DualPipeV", p, m))
    assert theirs.ops == ours.ops and theirs.meta["overlap_pairs"] == ours.meta["overlap_pairs"]
