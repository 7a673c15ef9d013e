"""Bad input refused where it enters the library (ScheduleError, never a bare ValueError or a
wrong number), and by the CLI as one line with exit status 2 (docs/cli.md)."""

import json

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedule import (CostModel, Schedule, ScheduleError, ValidationError, build_schedule,
                                      parse_memory_budget, simulate, validate)
from megatron_pp_ext.schedule.export import dumps_json, load, loads_json, loads_json_with_cost, save

NAN, INF = float("nan"), float("inf")


def one_line_error(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mppx: error: ") and "Traceback" not in err, err
    return lines[0]


# --- cost model -------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("t_f", NAN), ("t_b", NAN), ("t_w", INF), ("t_f", -1.0),
                                         ("act", -0.5), ("act", NAN), ("comm", NAN), ("comm", -1.0)])
def test_cost_model_refuses_nan_inf_and_negative(field, value):
    base = CostModel.uniform(4)
    bad = value if field == "comm" else (value,) + getattr(base, field)[1:]
    with pytest.raises(ScheduleError, match=field.split("_")[0] if field != "comm" else "comm"):
        CostModel(**{**dict(t_f=base.t_f, t_b=base.t_b, t_w=base.t_w, comm=base.comm, act=base.act),
                     field: bad})


def test_cost_model_refuses_bad_byte_sizes_and_overflowing_times():
    with pytest.raises(ScheduleError, match="bytes_per_unit"):
        CostModel.uniform(2, bytes_per_unit=NAN)
    with pytest.raises(ScheduleError, match="bytes_per_message"):
        CostModel.uniform(2, bytes_per_message=-1.0)
    with pytest.raises(ScheduleError, match="larger unit"):
        CostModel((1e308,) * 2, (1e308,) * 2, (0.0,) * 2, act=(1.0, 1.0))


@pytest.mark.parametrize("costs", [(1, NAN, 1, 0), (NAN, 1, 1, 0), (1, 1, INF, 0), (1, 1, 1, NAN), (1, -1, 1, 0),
                                   (1, 1, -1, 0), (1e308, 1e308, 1e308, 0), "1,nan,1", "1,1,1,-0.1"])
def test_build_schedule_refuses_bad_costs_with_schedule_error(costs):
    with pytest.raises(ScheduleError, match="--costs"):
        build_schedule("zb-h1", 4, 8, costs=costs)


def test_costs_that_overflow_over_the_microbatches_are_refused():
    # each number is fine, but 10**6 microbatches of them overflow the arithmetic
    with pytest.raises(ScheduleError, match="too large to simulate"):
        build_schedule("1f1b", 2, 10**6, costs=(1e295, 1e295, 1e295, 0))


def test_schedules_too_large_to_build_are_refused_before_any_work():
    from megatron_pp_ext.schedule.registry import MAX_OPS
    with pytest.raises(ScheduleError, match="--microbatches"):
        build_schedule("zbv", 64, MAX_OPS, costs=(1, 1, 1, 0))


def test_costs_below_the_simulators_resolution_are_refused():
    with pytest.raises(ScheduleError, match="smaller unit"):
        build_schedule("zbv", 4, 8, costs=(1e-12, 1e-12, 1e-12, 0))
    c = CostModel.uniform(4, f=1e-12, b=1e-12, w=0.0)
    s, _ = build_schedule("1f1b", 4, 8)
    with pytest.raises(ScheduleError, match="resolution"):
        simulate(s, c)
    with pytest.raises(ScheduleError, match="resolution"):
        validate(s, c)


def test_a_tiny_w_or_comm_is_accepted():
    s, c = build_schedule("zb-h1", 4, 8, costs=(1, 1, 6e-8, 1e-12))
    assert simulate(s, c).makespan > 0


def test_simulate_says_a_comm_below_the_resolution_counts_as_0():
    """A COMM of 1e-12 is accepted (no schedule can depend on it) and simulated as 0: the output
    says so under the header that shows it, not only a makespan equal to comm 0's."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "megatron_pp_ext.cli", "simulate", "--schedule", "zbv", "--pp", "4",
           "--microbatches", "8", "--comm-model", "nccl-batched", "--costs"]
    tiny = subprocess.run(cmd + ["1,1,1,1e-12"], capture_output=True, text=True, timeout=120).stdout
    zero = subprocess.run(cmd + ["1,1,1,0"], capture_output=True, text=True, timeout=120).stdout
    assert "note      COMM=1e-12 is below the simulator's resolution (1e-09) and counts as 0" in tiny, tiny
    assert "note" not in zero
    makespan = [ln for ln in tiny.splitlines() if ln.startswith("makespan")]
    assert makespan and makespan == [ln for ln in zero.splitlines() if ln.startswith("makespan")]


def test_tiny_but_resolvable_costs_give_the_scaled_result():
    s, c = build_schedule("zb-h1", 4, 8, costs=(1, 2, 1, 0))
    s2, c2 = build_schedule("zb-h1", 4, 8, costs=(1e-6, 2e-6, 1e-6, 0))
    assert simulate(s2, c2).makespan == pytest.approx(simulate(s, c).makespan * 1e-6, rel=1e-6)
    assert simulate(s2, c2).max_peak_memory == simulate(s, c).max_peak_memory


def test_validate_refuses_a_nan_cost():
    s, _ = build_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError):
        validate(s, CostModel.uniform(2, b=NAN))


# --- memory budget ----------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "nanx", "inf%", "1e999", "0", "-2", "0x"])
def test_memory_budget_must_be_finite_and_positive(text):
    with pytest.raises(ScheduleError, match="--memory-budget"):
        parse_memory_budget(text, 4)
    with pytest.raises(ScheduleError, match="--memory-budget"):
        build_schedule("v-budget", 4, 8, memory_budget=text)


@pytest.mark.parametrize("value", [NAN, INF, -1.0, 0.0])
def test_memory_budget_numbers_must_be_finite_and_positive(value):
    with pytest.raises(ScheduleError, match="--memory-budget"):
        parse_memory_budget(value, 4)


# --- imported schedules: the same validator as generated ones --------------------------------

def _doc(**changes):
    s, c = build_schedule("zb-h1", 2, 3)
    d = json.loads(dumps_json(s, c))
    d.update(changes)
    return d


def _drop_op(d):
    d["ops"][1] = d["ops"][1][:-1]
    return d


def _dup_op(d):
    d["ops"][0].append(d["ops"][0][0])
    return d


@pytest.mark.parametrize("make,match", [
    (_drop_op, "need exactly 1|need one BW"),
    (_dup_op, "appears 2 times"),
    (lambda d: {**d, "num_microbatches": 0}, "at least one"),
    (lambda d: {**d, "num_microbatches": -1}, "at least one"),
    (lambda d: {**d, "num_microbatches": 2}, "microbatch out of range"),
    (lambda d: {**d, "placement": [0, 0]}, "placement"),
    (lambda d: {**d, "placement": [1, 0]}, "placed on rank"),
    (lambda d: {**d, "placement": [0, 1, 0, 1]}, "stages"),
])
def test_loads_json_validates_imported_schedules(make, match):
    text = json.dumps(make(_doc()))
    with pytest.raises(ScheduleError, match=match):
        loads_json_with_cost(text)
    with pytest.raises(ScheduleError):
        loads_json(text)


def test_loads_json_check_false_reads_without_validating():
    d = _drop_op(_doc())
    s = loads_json(json.dumps(d), check=False)
    assert len(s.ops[1]) == len(_doc()["ops"][1]) - 1


@pytest.mark.parametrize("text,match", [
    (lambda: json.dumps(_doc(num_microbatches=10**18)), "larger than the 10,000,000 ops"),
    (lambda: json.dumps(_doc(num_microbatches=10**7)), "larger than the 10,000,000 ops"),
    (lambda: json.dumps(_doc(num_microbatches=10**6)), "declares 1000000 microbatches on 2 stages but lists only"),
    (lambda: "[" * 100000, "nested too deeply"),
    (lambda: json.dumps(_doc(meta={}))[:-1] + ', "meta": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
     "nested too deeply"),
])
def test_schedule_import_refuses_what_would_hang_or_crash_at_once(text, match):
    """A JSON declaring 10^7 microbatches took 67 s to fail, 10^18 overflowed, deep
    nesting raised RecursionError: each is a ScheduleError in well under a second."""
    import time
    t = time.perf_counter()
    with pytest.raises(ScheduleError, match=match):
        loads_json(text())
    assert time.perf_counter() - t < 2.0


@pytest.mark.parametrize("csv_text,match", [
    ("99999999999F0\n", "cannot read action '99999999999F0'"),        # was a MemoryError
    ("0F99999999999999999999\n", "cannot read action"),                # never returned
    ("999999999F0,999999999I0,999999999W0\n", "appear on no rank"),
    ("0F0,0I0,0W0\n1F999999999,1I999999999,1W999999999\n", "larger than the 10,000,000 ops"),
    # a cross-rank deadlock and a causality violation: refused by the validator generated schedules pass
    ("0F0,0I0,0W0,0F1,0I1,0W1\n1F1,1I1,1W1,1F0,1I0,1W0\n", "deadlocks"),
    ("0I0,0F0,0W0,0F1,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n", "deadlocks"),
])
def test_torch_csv_import_is_bounded_and_validated(tmp_path, csv_text, match):
    import time
    path = tmp_path / "s.csv"
    path.write_text(csv_text)
    t = time.perf_counter()
    with pytest.raises(ScheduleError, match=match):
        load(path)
    assert time.perf_counter() - t < 2.0


@pytest.mark.skipif(not __import__("os").path.exists("/dev/zero"), reason="no /dev/zero")
def test_endless_input_files_are_refused(capsys, monkeypatch):
    """A device with no end (/dev/zero) was read until the memory ran out."""
    from megatron_pp_ext.schedule import export
    monkeypatch.setattr(export, "MAX_FILE_BYTES", 1 << 16)
    with pytest.raises(ScheduleError, match="holds more than 65,536 characters"):
        load("/dev/zero", fmt="json")
    assert "--calibration /dev/zero: larger than 16 MiB" in one_line_error(
        capsys, "plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64", "--calibration", "/dev/zero")


def test_load_and_save_errors_are_schedule_errors(tmp_path):
    s, c = build_schedule("zbv", 2, 4)
    with pytest.raises(ScheduleError, match="cannot read"):
        load(tmp_path / "missing.json")
    with pytest.raises(ScheduleError, match="cannot write"):
        save(s, tmp_path / "no" / "dir.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_dup_op(_doc())))
    with pytest.raises(ScheduleError, match="appears 2 times"):
        load(bad)


@pytest.mark.parametrize("mutate,match", [
    (lambda s: Schedule(s.name, s.num_microbatches, s.placement, [s.ops[0][:-1], s.ops[1]]), "need"),
    (lambda s: Schedule(s.name, s.num_microbatches, s.placement, [s.ops[0] + s.ops[0][:1], s.ops[1]]),
     "appears 2 times"),
    (lambda s: Schedule(s.name, 0, s.placement, s.ops), "at least one"),
    (lambda s: Schedule(s.name, -1, s.placement, s.ops), "at least one"),
    (lambda s: Schedule(s.name, s.num_microbatches, (1, 0), s.ops), "placed on rank"),
])
def test_simulate_refuses_what_the_validator_refuses(mutate, match):
    s, c = build_schedule("zb-h1", 2, 3)
    with pytest.raises(ValidationError, match=match):
        simulate(mutate(s), c)
    with pytest.raises(ValidationError, match=match):
        validate(mutate(s), c)


def test_simulate_check_false_is_the_raw_simulator():
    s, c = build_schedule("zb-h1", 2, 3)
    short = Schedule(s.name, s.num_microbatches, s.placement, [s.ops[0][:-1], s.ops[1]])
    assert simulate(short, c, check=False).makespan > 0


# --- the CLI: bad input and its siblings -----------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["simulate", "--schedule", "zbv", "--costs", "1e308,1e308,1e308"], "--costs"),
    (["simulate", "--schedule", "zbv", "--costs", "1e-12,1e-12,1e-12"], "--costs"),
    (["simulate", "--schedule", "zbv", "--costs", "1,1,1,nan"], "--costs"),
    (["simulate", "--schedule", "zbv", "--costs", "1,1e-9,1"], "--costs"),
    (["simulate", "--schedule", "zbv", "--costs", "1,inf,1"], "--costs"),
    (["compare", "--costs", "1e308,1,1"], "--costs"),
    (["simulate", "--schedule", "zbv", "--costs", "1e299,1e299,1e299"], "--costs"),
    (["compare", "--schedules", ","], "--schedules"),
    (["viz", "--schedule", "zbv", "--costs", "nan,1,1", "-o", "x.png"], "--costs"),
    (["export", "--schedule", "zbv", "--costs", "1,1,-1", "--format", "json"], "--costs"),
    (["simulate", "--schedule", "v-budget", "--memory-budget", "nan"], "--memory-budget"),
    (["simulate", "--schedule", "v-budget", "--memory-budget", "inf"], "--memory-budget"),
    (["compare", "--memory-budget", "nan"], "--memory-budget"),
    (["compare", "--memory-budget", "nanx"], "--memory-budget"),
    (["viz", "--schedule", "v-budget", "--memory-budget", "nan", "-o", "x.png"], "--memory-budget"),
    (["export", "--schedule", "v-budget", "--memory-budget", "inf%", "--format", "json"], "--memory-budget"),
    (["viz", "--schedule", "zbv", "-o", "/proc/x.png"], "-o"),
    (["compare", "-o", "/proc/x.png"], "-o"),
    (["export", "--schedule", "zbv", "-o", "/proc/x.json"], "-o"),
    (["simulate", "--schedule", "zbv", "--bytes-per-unit", "nanGiB"], "--bytes-per-unit"),
    (["simulate", "--schedule", "zbv", "--bytes-per-message", "1e999"], "--bytes-per-message"),
    (["simulate", "--schedule", "zbv", "--bytes-per-unit", "0.0000001"], "--bytes-per-unit"),
    (["simulate", "--schedule", "1f1b", "--pp", "99999999999", "--microbatches", "1"], "fewer ranks (--pp)"),
    (["simulate", "--schedule", "1f1b", "--microbatches", "99999999999"], "--microbatches 833333 or fewer"),
    (["export", "--schedule", "zbv", "--pp", "64", "--microbatches", "100000", "--format", "json"], "ops"),
])
def test_cli_bad_values_give_one_line(capsys, tmp_path, monkeypatch, argv, needle):
    monkeypatch.chdir(tmp_path)
    assert needle in one_line_error(capsys, *argv)
    assert not (tmp_path / "x.png").exists()


def test_viz_refuses_a_figure_too_large_to_draw_before_building_it(capsys, tmp_path, monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("the schedule was built before the size was checked")
    monkeypatch.setattr("megatron_pp_ext.cli.commands.viz.build_from_args", no_build)
    line = one_line_error(capsys, "viz", "--schedule", "zbv", "--pp", "64", "--microbatches", "4096",
                          "-o", str(tmp_path / "big.png"))
    assert "--microbatches 4096" in line and "--microbatches 170 or fewer" in line
    line = one_line_error(capsys, "viz", "--schedule", "1f1b", "--pp", "1000", "--microbatches", "1",
                          "-o", str(tmp_path / "big.png"))
    assert "--pp" in line
    assert not (tmp_path / "big.png").exists()


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="no /dev/full")
def test_standard_output_that_takes_no_write_is_one_line():
    """``mppx compare --json > /dev/full`` ended in a traceback (docs/cli.md)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "megatron_pp_ext.cli", "schedules", "--json"], stdout=full,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "mppx: error: writing the output failed (No space left on device); free some space or write it elsewhere"], r.stderr


def test_viz_title_with_dollar_signs_is_drawn_as_written(capsys, tmp_path):
    """``$\\frac{1}{$`` was parsed as mathematics when the figure was saved (a traceback)."""
    out = tmp_path / "t.svg"
    rc = main(["viz", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "-o", str(out),
               "--title", "$\\frac{1}{$ costs $5"])
    assert rc == 0, capsys.readouterr().err
    assert "$\\frac{1}{$ costs $5" in out.read_text()


def test_viz_largest_allowed_figure_is_drawn(capsys, tmp_path):
    from megatron_pp_ext.schedule.plots import MAX_FIGURE_OPS_PER_RANK
    m = MAX_FIGURE_OPS_PER_RANK // 6  # zbv: 2 chunks x F, B, W per microbatch
    rc = main(["viz", "--schedule", "zbv", "--pp", "2", "--microbatches", str(m), "-o", str(tmp_path / "ok.png")])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "ok.png").stat().st_size > 0


# --- mppx plan: out-of-range cluster, search and calibration values ----------------------------

PLAN = ["plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64"]


@pytest.mark.parametrize("extra,needle", [
    (["--memory", "nan"], "--memory"), (["--memory", "0"], "--memory"), (["--memory", "-3"], "--memory"),
    (["--memory", "2"], "--memory"),
    (["--peak-tflops", "-5"], "--peak-tflops"), (["--peak-tflops", "1e-9"], "--peak-tflops"),
    (["--peak-tflops", "inf"], "--peak-tflops"),
    (["--nvlink-gbps", "0"], "--nvlink-gbps"), (["--net-gbps", "nan"], "--net-gbps"),
    (["--host-gbps", "-1"], "--host-gbps"),
    (["--time-limit", "0"], "--time-limit"), (["--time-limit", "nan"], "--time-limit"),
    (["--time-limit", "-1"], "--time-limit"),
    (["--time-limit", "1e-9"], "raise --time-limit"),
    (["--budgets", "nan"], "--budgets"), (["--budgets", "fit,0"], "--budgets"),
    (["--memory-model", "cpu", "--p2p-strategy", "pairwise"], "--p2p-strategy"),   # (an NCCL strategy)
])
def test_plan_refuses_out_of_range_values(capsys, extra, needle):
    line = one_line_error(capsys, *PLAN, *extra)
    assert needle in line
    assert "OOM" not in line and "use more GPUs" not in line  # not a misleading verdict


@pytest.mark.parametrize("doc,needle", [
    ({"efficiency": {"gemm_max": 5}}, "gemm_max"),       # an MFU above 100% otherwise
    ({"efficiency": {"hbm": float("nan")}}, "hbm"),
    ({"efficiency": {"gemm_half": 0}}, "gemm_half"),
    ({"efficiency": 3}, "'efficiency' must be an object"),
    ({"gemm_points": [{"x": 1e5, "efficiency": float("nan")}]}, "efficiency must be a finite number"),
    ({"gemm_points": [{"y": 1}]}, "has no 'efficiency'"),
    ({"gemm_points": 7}, "must be a list"),
    ({"layer_points": [{"mbs": 1, "tp": 1, "forward_ms": float("nan")}]}, "forward_ms"),
    ({"layer_points": [{"mbs": 0, "tp": 1, "forward_ms": 3}]}, "mbs and tp"),
    ({"layer_points": [{"mbs": 1, "forward_ms": 3}]}, "has no 'tp'"),     # (not silently tp 1)
    # nothing in the file is ignored: a field at the wrong level, an empty file, a point out
    # of range or not whole is refused, not dropped, truncated or reported as "calibrated from FILE"
    ({"gemm_max": 0.6}, "unknown keys ['gemm_max']; gemm_max go(es) under \"efficiency\""),
    ({}, "nothing to calibrate"),
    ({"gemm_points": []}, "nothing to calibrate"),
    ({"gemm_points": [{"x": 1e5, "efficiency": 1.5}]}, "need x (or tokens x hidden_per_tp) > 0 and 0 < efficiency <= 1"),
    ({"gemm_points": [{"x": 0, "efficiency": 0.5}]}, "need x (or tokens x hidden_per_tp) > 0"),
    ({"gemm_points": [{"x": 1e5, "efficiency": 0.5, "eff": 0.6}]}, "unknown keys ['eff']"),
    ({"layer_points": [{"mbs": 1.9, "tp": 1, "forward_ms": 3}]}, "mbs and tp must be whole numbers"),
    ({"layer_points": [{"mbs": 1e300, "tp": 1, "forward_ms": 3}]}, "mbs and tp must be whole numbers (mbs 1 to 4096"),
    ({"layer_points": [{"mbs": 1, "tp": 1, "forward_ms": 3, "seq": 4096}]}, "unknown keys ['seq']"),
    ({"efficiency": {"dp_overlap": 1}}, "dp_overlap=1: must be true or false"),
    # a fit is never capped: one point far below the curve would need gemm_max 40 (capped to 1 it predicted MFU 78.6%)
    ({"gemm_points": [{"x": 100, "efficiency": 0.01}]}, "(x=100, efficiency=0.01) need gemm_max=40 with gemm_half=400000: above the GPU's peak"),
    ({"efficiency": {"gemm_max": 0.6, "gemm_half": 1e5}, "gemm_points": [{"x": 1e6, "efficiency": 0.5}]},
     "which \"efficiency\" already sets"),
    ({"efficiency": {"gemm_max": 0.4}, "gemm_points": [{"x": 1e6, "efficiency": 0.5}]}, "at or above gemm_max=0.4"),
    # measured stage times (the shape of table 6): every time there, finite and > 0
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 1, "b_ms": 2, "w_ms": 1, "p2p_ms": 0.1}}, "stage_times.f_ms is missing"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 1, "f_ms": 0, "b_ms": 2, "w_ms": 1, "p2p_ms": 0.1}}, "stage_times.f_ms=0"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 1, "f_ms": 1, "b_ms": -2, "w_ms": 1, "p2p_ms": 0.1}}, "stage_times.b_ms=-2"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 1, "f_ms": 1, "b_ms": 2, "w_ms": float("nan"), "p2p_ms": 0.1}},
     "stage_times.w_ms=nan"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 1, "f_ms": 1, "b_ms": 2, "w_ms": 1}}, "stage_times.p2p_ms is missing"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 1, "f_ms": 1, "b_ms": 2, "w_ms": 1, "p2p_ms": "fast"}},
     "stage_times.p2p_ms='fast'"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "f_ms": 1, "b_ms": 2, "w_ms": 1, "p2p_ms": 0.1}}, "stage_times.micro_batch_size is missing"),
    # no default for the sizes: 4 measured layers read as 1 planned 4x slower (13.9 s against 3.5 s)
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "layers": 4, "f_ms": 1, "b_ms": 2, "w_ms": 1, "p2p_ms": 0.1}},
     "stage_times.tp is missing: give the tensor-parallel size the times were measured at"),
    ({"stage_times": {"micro_batch_size": 1, "tp": 1, "f_ms": 1, "b_ms": 2, "w_ms": 1, "p2p_ms": 0.1}},
     "stage_times.layers is missing"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1.5, "tp": 1, "layers": 1, "f_ms": 1, "b_ms": 2, "w_ms": 1, "p2p_ms": 0.1}},
     "stage_times.micro_batch_size=1.5: a whole number"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 1, "f_ms": 1, "b_ms": 2, "w_ms": 1, "p2p_ms": 0.1, "t_f": 1}},
     "stage_times: unknown keys ['t_f']"),
    # the sequence and the model the times were measured on: no default, checked against the plan
    ({"stage_times": {"micro_batch_size": 1, "tp": 1, "layers": 4, "f_ms": 20, "b_ms": 20, "w_ms": 14, "p2p_ms": 0.4}},
     "stage_times.seq is missing: give the sequence length the times were measured at"),
    ({"stage_times": {"seq": 4096, "micro_batch_size": 1, "tp": 1, "layers": 4, "f_ms": 20, "b_ms": 20, "w_ms": 14,
                      "p2p_ms": 0.4}}, "stage_times.hidden is missing: give the hidden size of the model"),
    ({"stage_times": {"seq": 4096, "hidden": 5120, "micro_batch_size": 1, "tp": 1, "layers": 4, "f_ms": 20, "b_ms": 20,
                      "w_ms": 14, "p2p_ms": 0.4}}, "stage_times.hidden=5120: the times were measured on a model of "
                                                   "hidden size 5120, and llama2-7b's is 4096"),
    ({"stage_times": {"seq": 8192, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 4, "f_ms": 20, "b_ms": 20,
                      "w_ms": 14, "p2p_ms": 0.4}}, "stage_times were measured at a sequence of 8192 tokens, the plan's "
                                                   "is 4096"),
    # a layer point at a tp no layer of the model runs at
    ({"layer_points": [{"mbs": 1, "tp": 3, "forward_ms": 30}]}, "tp 3 does not divide llama2-7b's 32 attention heads"),
    ({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 1, "tp": 1, "layers": 99, "f_ms": 1, "b_ms": 2, "w_ms": 1, "p2p_ms": 0.1}},
     "stage_times.layers=99: more than the model's 32 layers"),
])
def test_plan_refuses_bad_calibration_files(capsys, tmp_path, doc, needle):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(doc))
    assert needle in one_line_error(capsys, *PLAN, "--calibration", str(path))


def test_plan_refuses_stage_times_of_another_microbatch_size(capsys, tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"stage_times": {"seq": 4096, "hidden": 4096, "micro_batch_size": 2, "tp": 1, "layers": 1, "f_ms": 1000, "b_ms": 2000, "w_ms": 1000,
                                                "p2p_ms": 0.1}}))
    line = one_line_error(capsys, *PLAN, "--calibration", str(path), "--mbs", "1")
    assert "stage_times.micro_batch_size=2: the times were measured at mbs 2, but --mbs 1 is planned" in line
    line = one_line_error(capsys, *PLAN, "--calibration", str(path), "--tp", "2")
    assert "stage_times.tp=1" in line


def test_a_stage_times_size_no_layout_allows_is_named(capsys, tmp_path):
    """The search takes tp and the micro-batch size from stage_times: when no layout allows them,
    the error names stage_times.tp / stage_times.micro_batch_size, not flags the user never gave."""
    base = {"micro_batch_size": 1, "tp": 1, "layers": 4, "seq": 4096, "hidden": 4096, "f_ms": 20.0, "b_ms": 20.0,
            "w_ms": 14.0, "p2p_ms": 0.4}
    slow = {"f_ms": 2000.0, "b_ms": 2000.0, "w_ms": 1500.0}   # (128 sequences: above the GPU's peak otherwise)
    for key, value, more in (("tp", 3, {}), ("micro_batch_size", 128, slow)):
        path = tmp_path / f"{key}.json"
        path.write_text(json.dumps({"stage_times": dict(base, **{key: value}, **more)}))
        line = one_line_error(capsys, "plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64", "--top", "1",
                              "--no-baseline", "--calibration", str(path))
        assert f"stage_times.{key}={value}" in line and "--tp" not in line and "--mbs" not in line, line


def test_planner_library_refuses_the_same_values():
    from megatron_pp_ext.planner import PlannerError, PlanRequest, get_model, make_cluster
    from megatron_pp_ext.planner.timing import Efficiency

    with pytest.raises(PlannerError, match="--memory"):
        make_cluster("h100", 8, memory_gib=float("nan"))
    with pytest.raises(PlannerError, match="--peak-tflops"):
        make_cluster("h100", 8, peak_tflops=0.0)
    with pytest.raises(PlannerError, match="gemm_max"):
        Efficiency(gemm_max=1.5)
    from megatron_pp_ext.planner.timing import fit_gemm_curve
    with pytest.raises(PlannerError, match="efficiency=1.5. is out of range"):   # refused, not dropped
        fit_gemm_curve([(1e5, 0.5), (1e6, 1.5)], Efficiency())
    cluster = make_cluster("h100", 8)
    with pytest.raises(PlannerError, match="--time-limit"):
        PlanRequest(get_model("llama2-7b"), cluster, 64, time_limit=0.0)
    with pytest.raises(PlannerError, match="--budgets"):
        PlanRequest(get_model("llama2-7b"), cluster, 64, budgets=("nan",))


@pytest.mark.parametrize("extra,needle", [
    (["--schedule", "v-budget", "--memory-budget", "nan"], "--memory-budget 'nan'"),
    (["--schedule", "v-budget", "--memory-budget", "inf"], "--memory-budget 'inf'"),
    (["--schedule", "zbv", "--costs", "1,nan,1"], "--costs"),
    (["--schedule", "zbv", "--costs", "1e308,1e308,1e308"], "--costs"),
])
def test_train_refuses_bad_budget_and_costs_before_starting(capsys, tmp_path, extra, needle):
    assert needle in one_line_error(capsys, "train", "--out", str(tmp_path / "run"), *extra)
    assert not (tmp_path / "run").exists()


# --- long work: a progress bar on a terminal only ----------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["compare", "--pp", "2", "--microbatches", "4"], "mppx compare"),
    (["simulate", "--schedule", "zbv", "--pp", "2", "--microbatches", "4"], "1F1B for comparison"),
])
def test_progress_bar_on_a_terminal_once_the_work_is_long(capsys, monkeypatch, argv, needle):
    from megatron_pp_ext.cli import progress

    assert main(argv) == 0
    assert capsys.readouterr().err == ""              # not a terminal: nothing extra
    monkeypatch.setattr(progress, "_is_terminal", lambda stream: True)
    monkeypatch.setattr(progress, "DELAY_S", 0.0)     # as if every step had taken long
    monkeypatch.setattr(progress, "REDRAW_S", 0.0)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert needle in err and "elapsed" in err
    assert needle not in out                          # the report itself is unchanged


def test_progress_waits_for_long_work(capsys, monkeypatch):
    from megatron_pp_ext.cli import progress

    monkeypatch.setattr(progress, "_is_terminal", lambda stream: True)
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "2"]) == 0
    assert capsys.readouterr().err == ""              # well under DELAY_S: no bar


def test_simulate_checks_its_byte_flags_before_building(capsys, monkeypatch):
    def no_build(*a, **k):
        raise AssertionError("built before the flags were checked")
    monkeypatch.setattr("megatron_pp_ext.cli.commands.simulate.build_from_args", no_build)
    assert "--bytes-per-unit" in one_line_error(capsys, "simulate", "--schedule", "zbv", "--bytes-per-unit", "nan")


def test_loader_refuses_a_file_that_deadlocks_under_the_nccl_model_it_names():
    """A JSON naming an NCCL strategy (mppx export --backend nccl) is a promise that it runs there:
    writing such a file and reading one are both checked under that model."""
    from megatron_pp_ext.schedule import build_schedule
    from megatron_pp_ext.schedule.simresult import DeadlockError
    s, c = build_schedule("v-min", 4, 4, costs=(1, 1, 0, 0), with_comm=True)
    with pytest.raises(DeadlockError, match="deadlocks under nccl-pairwise"):
        dumps_json(s, c, comm_model="nccl-pairwise")
    d = json.loads(dumps_json(s, c, comm_model="nccl-channels"))
    assert loads_json(json.dumps(d)).meta["comm_model"] == "nccl-channels"
    d["meta"]["comm_model"] = "nccl-pairwise"     # the same order, claimed for plain isend/irecv
    with pytest.raises(DeadlockError, match="deadlocks under nccl-pairwise"):
        loads_json(json.dumps(d))
    assert loads_json(json.dumps(d), check=False).meta["comm_model"] == "nccl-pairwise"
    d["meta"]["comm_model"] = "nccl-magic"
    with pytest.raises(ScheduleError, match="unknown communication model"):
        loads_json(json.dumps(d))


def test_interleaved_1f1b_refuses_an_order_that_deadlocks_in_one_line(capsys):
    """Every (p, v, m) with p <= 16, v <= 4, p < m <= 4p and m not a multiple of p: the 780 whose
    order deadlocks are refused in one line naming --microbatches (never the validator's dump),
    the others still build (p=4, m=6 is what torch's Interleaved1F1B runs), as do m < p."""
    from megatron_pp_ext.schedule import ScheduleRequest, schedule_info
    from megatron_pp_ext.schedule.simresult import DeadlockError
    generate = schedule_info("interleaved-1f1b").generate   # (build_schedule also validates: 20 s here)
    refused = 0
    for p in range(2, 17):
        for v in range(2, 5):
            for m in range(p + 1, 4 * p + 1):
                if m % p == 0:
                    continue
                try:
                    generate(ScheduleRequest(p, m, v))
                except ScheduleError as e:
                    assert not isinstance(e, DeadlockError) and "\n" not in str(e)
                    lo = m - m % p
                    assert f"--microbatches {m} with --pp {p}" in str(e) and f"use --microbatches {lo} or {lo + p}" in str(e)
                    refused += 1
    assert refused == 780
    for p, v, m in [(8, 2, 16), (8, 2, 4), (3, 3, 2), (4, 2, 6)]:
        build_schedule("interleaved-1f1b", p, m, chunks=v)
    assert main(["simulate", "--schedule", "interleaved-1f1b", "--chunks", "2", "--pp", "8",
                 "--microbatches", "12"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "waits" not in err and "--microbatches 8 or 16" in err


@pytest.mark.parametrize("extra,needle", [
    # the required feature is left out by --features: the conflict, not plans that use it anyway
    (["--features", "none", "--require-features", "bpipe"], "--features none leaves it out"),
    (["--features", "offload", "--require-features", "bpipe"], "--features offload leaves it out"),
    # the cause is the schedule list (BPipe has no V schedules), not "use more GPUs"
    (["--schedules", "zbv", "--require-features", "bpipe"], "bpipe is planned with 1f1b only"),
    # standard output carries one document
    (["--json", "--emit-flags", "-"], "--emit-flags - with --json"),
    (["--json", "--emit-slurm", "-"], "--emit-slurm - with --json"),
    (["--emit-flags", "-", "--emit-slurm", "-"], "only one of them can go to standard output"),
    # Megatron-FSDP runs on Megatron-Core's own schedules only, without features (megatron_lm/flags.py)
    (["--use-megatron-fsdp", "--schedules", "zbv"], "--use-megatron-fsdp with --schedules zbv"),
    (["--use-megatron-fsdp", "--schedules", "1f1b,zb-h1"], "--use-megatron-fsdp with --schedules zb-h1"),
    (["--use-megatron-fsdp", "--require-features", "offload"], "--use-megatron-fsdp with --require-features offload"),
    (["--use-megatron-fsdp", "--features", "vocab-parallel"], "--use-megatron-fsdp with --features vocab-parallel"),
    (["--use-megatron-fsdp", "--no-distributed-optimizer"], "drop --no-distributed-optimizer"),
    (["--use-megatron-fsdp", "--explain-bpipe"], "--explain-bpipe with --use-megatron-fsdp"),
])
def test_plan_refuses_flags_that_contradict_each_other_before_searching(capsys, extra, needle):
    line = one_line_error(capsys, *PLAN, *extra)
    assert needle in line
    assert "use more GPUs" not in line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [
    ["--layers", "100000", "--hidden", "4096", "--heads", "32", "--arch", "llama", "--gpus", "8",
     "--global-batch-size", "64"],                                  # 300 s silent before
    ["--model", "deepseek-v3-like", "--gpus", "64", "--global-batch-size", "1024"],   # 149 s at --time-limit 20
])
def test_plan_answers_within_its_time_limit(capsys, argv):
    import time
    t0 = time.process_time()
    rc = main(["plan", *argv, "--time-limit", "1", "--no-cache"])
    spent = time.process_time() - t0
    out, err = capsys.readouterr()
    # a plan, or one line saying the limit stopped it: 1 s of search and the baseline's tenth,
    # plus the set-up and one candidate's costing past the check
    assert spent < 1.1 + 2, spent
    # (or, where the parameters alone overflow every GPU, the one line that says so without searching)
    assert rc == 0 or (rc == 2 and len(err.strip().splitlines()) == 1
                       and ("--time-limit 1" in err or "optimizer states alone need" in err)), err
    if "--time-limit 1" in err and "memory" in err:
        # all it costed overflowed: more time may find nothing, so the other ways out are named too
        assert ("every one it costed overflows memory" in err and "raise --time-limit (default 120) to try the rest, "
                "or use more GPUs (--gpus)" in err), err


def test_overlapped_pairs_with_a_zero_all_to_all_time_say_so(capsys):
    """--a2a-time 0 was given: the message says there is nothing to hide, not that the time is missing."""
    line = one_line_error(capsys, "simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "16",
                          "--overlap-moe-expert-parallel-comm", "--a2a-time", "0")
    assert "--a2a-time 0: there is no all-to-all time to hide" in line


@pytest.mark.parametrize("argv,needle", [
    # flags that would do nothing are refused, not ignored
    (["--pp", "2", "--a2a-time", "0.3"], "--a2a-time 0.3 times the all-to-all that overlapped pairs hide, and "
                                         "nothing is paired without --overlap-moe-expert-parallel-comm"),
    (["--pp", "2", "--mtp-loss-scaling-factor", "5"], "--mtp-loss-scaling-factor 5 scales the multi-token prediction "
                                                      "loss, and there is none without --mtp-num-layers N"),
    (["--model", "llama", "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
      "--expert-model-parallel-size", "2", "--pp", "2", "--nproc", "4", "--layers", "4", "--schedule", "dualpipev",
      "--global-batch-size", "8", "--overlap-moe-expert-parallel-comm", "--a2a-time", "0"],
     "--a2a-time 0: there is no all-to-all time to hide"),
])
def test_train_refuses_flags_that_would_do_nothing(capsys, argv, needle):
    assert needle in one_line_error(capsys, "train", *argv, "--no-progress")


def test_an_emulated_strategy_is_said_and_a_contradicting_environment_refused(capsys, monkeypatch, tmp_path):
    """MPPX_EMULATE_NCCL=batched with --emulate-nccl channels ran channels without a word; the
    header names the emulated strategy, and --pp 1 says what --emulate-nccl still does."""
    from megatron_pp_ext.trainer.config import TrainConfig, make_plan
    from megatron_pp_ext.trainer.report import header_lines
    monkeypatch.setenv("MPPX_EMULATE_NCCL", "batched")
    line = one_line_error(capsys, "train", "--pp", "2", "--p2p-strategy", "channels", "--emulate-nccl",
                          "--no-progress", "--out", str(tmp_path / "a"))
    assert "MPPX_EMULATE_NCCL=batched contradicts --emulate-nccl channels" in line
    plan = make_plan(TrainConfig(pp=2, emulate_nccl="batched", progress=False, out=str(tmp_path / "b")))
    assert "gloo, NCCL's rules emulated: batched strategy" in header_lines(plan, {}, "synthetic", 0.0)[1]
    monkeypatch.delenv("MPPX_EMULATE_NCCL")
    plan = make_plan(TrainConfig(pp=1, emulate_nccl="channels", progress=False, out=str(tmp_path / "c")))
    assert any("--emulate-nccl emulates NCCL's rules for the collectives only" in n for n in plan.notes)
    plain = make_plan(TrainConfig(pp=2, progress=False, out=str(tmp_path / "d")))
    assert "emulated" not in header_lines(plain, {}, "synthetic", 0.0)[1]


@pytest.mark.parametrize("feature,pp,least", [("bpipe", "2", 4), ("bpipe", "1", 4), ("vocab-parallel", "1", 2)])
def test_a_required_feature_no_pinned_pp_can_have_is_named(capsys, feature, pp, least):
    """BPipe is planned at pp >= 4 and vocabulary parallelism at pp >= 2: --require-features with a
    --pp that has no such size names both flags, not "the cluster is too small, use more GPUs"."""
    line = one_line_error(capsys, "plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64",
                          "--no-baseline", "--top", "1", "--require-features", feature, "--pp", pp)
    assert line == (f"mppx: error: --require-features {feature}: {feature} is planned at pp >= {least} only, and "
                    f"--pp {pp} has no such size; give --pp {least} or more or drop --require-features {feature}")


@pytest.mark.parametrize("doc,needle", [
    ({"efficiency": {"gemm_max": 1e-300}}, "efficiency gemm_max=1e-300: must be a fraction of peak in [0.001, 1]"),
    ({"efficiency": {"layer_overhead_us": 1e300}}, "efficiency layer_overhead_us=1e+300: must be a number from 0 to 1e+06"),
    ({"efficiency": {"gemm_half": 1e300}}, "efficiency gemm_half=1e+300: must be a number in (0, 1e12]"),
    ({"efficiency": {"p2p_gbps": 1e9}}, "efficiency p2p_gbps=1000000000.0: must be a number from 0 to 100000"),
    ({"layer_points": [{"mbs": 1, "tp": 1, "forward_ms": 1e9}]}, "below 0.001 of the GPU's peak; check forward_ms"),
])
def test_absurd_calibration_values_are_one_line(capsys, tmp_path, doc, needle):
    """Values no measurement gives (an efficiency of 1e-300, an overhead of 1e300 us, a layer taking
    11 days) printed iteration times of 300 digits; each is refused in one line naming the field."""
    import json
    f = tmp_path / "cal.json"
    f.write_text(json.dumps(doc))
    line = one_line_error(capsys, "plan", "--model", "llama2-7b", "--gpus", "8", "--global-batch-size", "64",
                          "--top", "1", "--no-baseline", "--calibration", str(f))
    assert needle in line, line



_PLAN = ("plan", "--model", "llama2-7b", "--gpus", "16", "--global-batch-size", "64", "--tp", "2", "--pp", "4",
         "--mbs", "1", "--no-baseline", "--top", "3")
_COMPARE = ("compare", "--pp", "2", "--microbatches", "4")


@pytest.mark.parametrize("argv,needle", [
    (_COMPARE + ("--schedules", ""), "--schedules '': no name given; omit --schedules for all of them"),
    (_COMPARE + ("--schedules", "zbv,zbv"), "--schedules zbv,zbv: zbv given twice"),
    (_PLAN + ("--schedules", ","), "--schedules ',': no name given"),
    (_PLAN + ("--schedules", "mcore"), "unknown schedule 'mcore' (--schedules); available: 1f1b,"),
    (_PLAN + ("--features", ""), "--features '': no name given; omit --features for all of them, or give none"),
    (_PLAN + ("--features", "none,offload"), "--features none,offload: none means no feature at all"),
    (_PLAN + ("--require-features", "none"), "unknown feature 'none' (--require-features); available: offload,"),
])
def test_name_lists_are_read_one_way_everywhere(capsys, argv, needle):
    """plan's and compare's --schedules / --features / --require-features go through one reader: an
    empty list, a name twice, 'none' beside a name and an unknown name are one line naming the flag
    given (compare ran every schedule for --schedules '', plan for ','; errors named --schedule or
    --features for another flag)."""
    assert needle in one_line_error(capsys, *argv)


def test_compare_json_memory_budget_is_the_units_it_ran_with(capsys):
    import json
    for given, units in (("3", 3.0), ("0.5x", 2.0)):
        assert main(["compare", "--memory-budget", given, "--pp", "4", "--microbatches", "8", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["memory_budget"] == units


@pytest.mark.parametrize("extra,needle", [
    (("--comm-model", "nccl"), "--vocab-layouts compares the layouts' compute and memory; --comm-model nccl would "
                               "change nothing here"),
    (("--schedules", "zbv,zbv"), "--schedules zbv,zbv: zbv given twice"),
])
def test_vocab_layouts_view_refuses_what_it_would_ignore(capsys, extra, needle):
    """compare --vocab-layouts printed the same table with --comm-model as without, without a word;
    its --schedules goes through the same name-list reader as compare's and plan's."""
    assert needle in one_line_error(capsys, "compare", "--vocab-layouts", "32000", *extra)


def test_costs_too_large_over_the_stages_name_the_flag_as_typed(capsys):
    """An iteration's costs that overflow once summed over the schedule's stages: one line quoting the
    --costs numbers (no Python list, no internal class name)."""
    from megatron_pp_ext.cli.core import main
    assert main(["simulate", "--schedule", "zbv", "--pp", "4", "--microbatches", "8", "--costs", "1,1,1,1e299",
                 "--comm-model", "nccl-batched"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mppx: error: --costs '1,1,1,1e+299': the times of one microbatch add up to 1.6e+300, too large "
                   "to simulate; give the costs in a larger unit (e.g. seconds instead of nanoseconds)"], err
