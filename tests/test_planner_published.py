"""The published layouts (docs/benchmarks/published.md) are planned, and the flags mppx plan
prints for them run: the end stages one layer short (layers = k*p - 2), interleaved 1F1B with one
layer per chunk (the first chunk the embedding alone, the last the loss alone), V schedules whose
two end chunks (both on rank 0) hold only the embedding and the loss. Their
``--pipeline-model-parallel-layout`` / ``--pipeline-layers-per-stage`` are accepted by ``mppx
train`` and by Megatron-LM (its parser and validate_args); scaled down, they train bit-exact
against pp=1 on CPU (tests/runtime/test_runtime_model.py: megatron_pp_ext's executor, the one
``mppx train`` runs; tests/test_megatron_lm_integration.py: Megatron-LM's loop)."""

from __future__ import annotations

import functools
import json

import pytest

from megatron_pp_ext.layer_pattern import layout_string, parse_layout
from megatron_pp_ext.planner import PlanRequest, make_cluster, plan
from megatron_pp_ext.planner.emit import megatron_flags
from megatron_pp_ext.planner.presets import ModelSpec
from megatron_pp_ext.trainer.config import TrainConfig, make_plan


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MPPX_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mppx-cache"))


def gpt(layers: int, hidden: int, heads: int, seq: int = 1024, vocab: int = 50257) -> ModelSpec:
    return ModelSpec(name=f"gpt-{layers}x{hidden}", num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                     ffn=4 * hidden, vocab=vocab, seq=seq, gated_mlp=False, norm="layernorm", bias=True,
                     position="learned", tied_embeddings=True, dropout=True, flash_attention=False)


@functools.lru_cache(maxsize=None)
def pinned(model: ModelSpec, p: int, schedule: str, vp: int, m: int, mbs: int = 1):
    """``mppx plan ... --tp 1 --pp p --mbs B --schedules S --max-vp vp --uneven-layers on``: the
    plan of that schedule with ``vp`` chunks per rank, and its request."""
    req = PlanRequest(model, make_cluster("a100", p), global_batch=m * mbs, schedules=(schedule,), features=(),
                      tp=(1,), pp=(p,), mbs=(mbs,), uneven_layers=True, max_vp=max(vp, 2), recompute=("none",),
                      distributed_optimizer=False, top=10)
    res = plan(req)
    est = next(e for e in res.plans if e.candidate.vp == vp)
    return req, est


def _flag(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


#: (layers, p, schedule, chunks per rank, expected layers per stage): the published layouts
PUBLISHED = [
    (22, 8, "1f1b", 1, (2,) + (3,) * 6 + (2,)),                     # Zero Bubble 1.5B: k*p - 2
    (22, 8, "zb-h2", 1, (2,) + (3,) * 6 + (2,)),
    (22, 8, "interleaved-1f1b", 3, (0,) + (1,) * 22 + (0,)),          # 1F1B-I: one layer per chunk
    (62, 32, "interleaved-1f1b", 2, (0,) + (1,) * 62 + (0,)),         # 28.3B on 32 GPUs
    (30, 16, "zbv", 2, (0,) + (1,) * 30 + (0,)),                      # ZB-V: 2p - 2 layers, end chunks E / L
    (46, 24, "zbv", 2, (0,) + (1,) * 46 + (0,)),
]


@pytest.mark.parametrize("layers,p,schedule,vp,lps", PUBLISHED,
                         ids=[f"{s}-L{L}-p{p}-v{v}" for L, p, s, v, _ in PUBLISHED])
def test_published_layouts_are_planned_with_their_layout_flags(layers, p, schedule, vp, lps):
    req, est = pinned(gpt(layers, 1024, 16), p, schedule, vp, m=p)
    flags = megatron_flags(est, req)
    parts = est.costs.parts
    assert tuple(x.layers for x in parts) == lps
    if est.candidate.schedule_placement() == "v":
        assert _flag(flags, "--pipeline-layers-per-stage") == ",".join(map(str, lps))
        assert _flag(flags, "--pipeline-model-parallel-layout") is None
        assert est.costs.placement[0] == est.costs.placement[-1] == 0    # the embedding and the loss on rank 0
    else:
        layout = _flag(flags, "--pipeline-model-parallel-layout")
        assert layout == layout_string(lps) and parse_layout(layout) == lps
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    # an end stage without layers costs its embedding / loss only, never nothing
    assert min(est.costs.t_f) > 0 and min(est.costs.t_b) > 0


def test_more_stages_than_layers_plus_two_is_refused():
    req = PlanRequest(gpt(6, 512, 8), make_cluster("a100", 8), global_batch=16, schedules=("interleaved-1f1b",),
                      features=(), tp=(1,), pp=(4,), mbs=(1,), uneven_layers=True, max_vp=3, recompute=("none",))
    res = plan(req)
    assert {e.candidate.vp for e in res.plans} == {2}                 # 8 stages for 6 layers: E and L alone
    assert any("12 stages for 6 layers: more than layers + 2" in ex for ex in res.rejections.examples("divisibility"))


def _train_args(flags: list[str], vp_schedule: str) -> list[str]:
    """mppx train's flags for a plan's layout: the planner's layout flag verbatim, a tiny model."""
    out = ["--pp", _flag(flags, "--pipeline-model-parallel-size"), "--schedule", vp_schedule]
    for name in ("--pipeline-model-parallel-layout", "--pipeline-layers-per-stage"):
        if _flag(flags, name) is not None:
            out += [name, _flag(flags, name)]
    return out


@pytest.mark.parametrize("layers,p,schedule,vp,lps", PUBLISHED,
                         ids=[f"{s}-L{L}-p{p}-v{v}" for L, p, s, v, _ in PUBLISHED])
def test_published_layout_flags_are_accepted_by_mppx_train(layers, p, schedule, vp, lps):
    req, est = pinned(gpt(layers, 1024, 16), p, schedule, vp, m=p)
    flags = megatron_flags(est, req)
    layout, per_stage = _flag(flags, "--pipeline-model-parallel-layout"), _flag(flags, "--pipeline-layers-per-stage")
    cfg = TrainConfig(pp=p, schedule=schedule, device="cpu", pipeline_layout=layout,
                      layers_per_stage=tuple(int(x) for x in per_stage.split(",")) if per_stage else None,
                      global_batch_size=p)
    tp = make_plan(cfg)
    assert tp.layers_per_stage == lps and tp.num_stages == len(lps)
    assert tp.run_config().chunks == vp


def published_flag_cases() -> list[dict]:
    """The flags mppx plan prints for every published layout, with what Megatron-LM's parser and
    validate_args must derive from them: tests/test_planner.py::test_emitted_flags_pass_megatron_lm_validation
    runs them through Megatron-LM (with megatron_pp_ext's Megatron-LM flags installed) in the process
    it starts for the MoE plans' flags."""
    cases = []
    for layers, p, schedule, vp, _ in PUBLISHED:
        req, est = pinned(gpt(layers, 1024, 16), p, schedule, vp, m=p)
        cases.append({"flags": megatron_flags(est, req), "world": p, "vocab": req.model.vocab,
                      "expect": {"pipeline_model_parallel_size": p, "virtual_pipeline_model_parallel_size": vp}})
    return cases


# --- the time model's physical terms (docs/planner.md, docs/benchmarks/published.md) --------------

def test_fp32_is_planned_at_the_fp32_peak_not_bf16s():
    """--precision fp32 runs its GEMMs at the fp32 peak and moves 4-byte activations: the same
    plan takes several times bf16's time (before: exactly bf16's)."""
    model = gpt(8, 2048, 16, seq=2048)
    times = {}
    for prec in ("bf16", "fp32"):
        req = PlanRequest(model, make_cluster("a100", 8), global_batch=16, schedules=("1f1b",), features=(),
                          tp=(1,), pp=(8,), mbs=(1,), recompute=("none",), precision=prec, top=1)
        times[prec] = plan(req).best
    ratio = times["fp32"].iteration_time / times["bf16"].iteration_time
    assert 5 < ratio < 16, ratio                          # 312 vs 19.5 TFLOPS for the GEMMs; bytes x2
    assert times["fp32"].mfu > times["bf16"].mfu / 16     # MFU against the fp32 peak


def test_megatron_interleaved_exchanges_block_and_cannot_deadlock():
    """Megatron-Core's interleaved exchanges (one batch after each warm-up forward, each
    forward-backward pair, each cool-down backward): every send matched, no deadlock under the
    blocking model, and each exchange's time on the critical path: slower than the same order
    whose receives only delay their consumer."""
    from megatron_pp_ext.schedule import CostModel, build_schedule, simulate
    from megatron_pp_ext.schedule.passes.megatron_comm import insert_comm_megatron_interleaved
    p, v, m = 4, 3, 8
    cost = CostModel.from_spec([1.0, 1.0, 1.0, 0.1], p * v, v)
    sched, _ = build_schedule("interleaved-1f1b", p, m, chunks=v, costs=cost)
    meg = insert_comm_megatron_interleaved(sched)
    sends = sum(1 for rank in meg.ops for o in rank if o.kind.startswith("SEND"))
    assert sends == 2 * m * (p * v - 1)                  # every boundary, both directions
    blocking = simulate(meg, cost, comm_model="blocking").makespan
    batched = simulate(meg, cost, comm_model="nccl-batched").makespan
    eager = simulate(sched, cost).makespan
    assert batched > eager and blocking >= eager


def test_planner_simulates_megatrons_own_runs_with_their_exchanges():
    """A plan that runs on Megatron-Core's own 1F1B (no plugin flags) pays every exchange on its
    critical path; the same schedule with a feature runs on our executor and does not."""
    from megatron_pp_ext.planner import Candidate, Planner
    from megatron_pp_ext.planner.simcache import SimCache
    model = gpt(22, 2304, 24)
    req = PlanRequest(model, make_cluster("a100", 8), global_batch=144, schedules=("1f1b",), features=(),
                      tp=(1,), pp=(8,), mbs=(6,), uneven_layers=True, recompute=("none",), top=1,
                      distributed_optimizer=False)
    planner = Planner(req, SimCache(disk=False))
    cand = Candidate(1, 8, 1, 1, "1f1b", 6, 24, "none", None, False)
    assert planner.megatron_run(cand) and not planner.megatron_run(cand.with_feature("offload", "half"))
    costs = planner.stage_costs(cand)
    args = (cand.schedule, 8, 24, 1, costs.t_f, costs.t_b, costs.t_w)
    ours = planner.cache.pipeline(*args, costs.comm, costs.act).makespan
    sync = planner.exchange_sync(cand)
    # Megatron's 1F1B synchronises the device at each exchange; our executor never does
    assert sync == req.efficiency.exchange_sync_us * 1e-6 > 0
    assert planner.exchange_sync(cand.with_feature("offload", "half")) == 0.0
    megatron = planner.cache.pipeline(*args, costs.comm + sync, costs.act, megatron=True).makespan
    blocking_only = planner.cache.pipeline(*args, costs.comm, costs.act, megatron=True).makespan
    # the exchanges' waits on the critical path, and the synchronise after each of them
    assert megatron > blocking_only > ours and megatron > 1.02 * ours


@pytest.mark.parametrize("field", ["dropout_rng_ps", "exchange_sync_us", "moe_layer_overhead_us", "moe_fp8_expert_us"])
def test_time_model_constants_refuse_nonsense(field):
    from megatron_pp_ext.planner import PlannerError
    from megatron_pp_ext.planner.timing import Efficiency
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(PlannerError, match=field):
            Efficiency(**{field: bad})


# --- calibration: gemm_max with points, measured stage times ----------------------------------------

def test_gemm_max_given_with_points_is_used_and_the_points_fit_gemm_half(tmp_path):
    """"Used or refused, never ignored": efficiency.gemm_max (or gemm_half) stays what the file
    says and the points, measured on another curve, fit the other field (before: the points'
    free fit silently replaced both)."""
    from megatron_pp_ext.planner.timing import Efficiency, load_calibration
    base = Efficiency(gemm_max=0.9, gemm_half=1e4)
    path = tmp_path / "cal.json"
    lower = Efficiency(gemm_max=0.55, gemm_half=3e5)          # every point below the given gemm_max 0.6
    path.write_text(json.dumps({"efficiency": {"gemm_max": 0.6},
                                "gemm_points": [{"x": x, "efficiency": lower.gemm(x)} for x in (1e5, 1e6, 1e7)]}))
    cal = load_calibration(str(path), base)
    assert cal.gemm_max == 0.6 and cal.gemm_half > 3e5       # a lower curve at E = 0.6: a later half point
    wider = Efficiency(gemm_max=0.6, gemm_half=1e6)
    path.write_text(json.dumps({"efficiency": {"gemm_half": 3e5},
                                "gemm_points": [{"x": x, "efficiency": wider.gemm(x)} for x in (1e5, 1e6, 1e7)]}))
    cal = load_calibration(str(path), base)
    assert cal.gemm_half == 3e5 and cal.gemm_max < 0.6       # the same points at an earlier half: a lower E


def test_stage_times_are_the_planned_op_times(tmp_path, capsys):
    """--calibration with table 6's shape (one stage of k layers: F, B, W, p2p at a microbatch
    size): the plan's per-layer F/B/W are the measured ones over k, its messages the measured
    p2p time (Megatron's 1F1B adds its synchronise at each exchange in the simulation, not in the
    message), and `mppx plan` prints the plan for them."""
    from megatron_pp_ext.cli import main
    from megatron_pp_ext.planner import Candidate, Planner
    from megatron_pp_ext.planner.simcache import SimCache
    from megatron_pp_ext.planner.timing import calibration_from_dict, default_efficiency
    model = gpt(22, 2304, 24, vocab=32000)
    doc = {"stage_times": {"micro_batch_size": 6, "tp": 1, "layers": 3, "seq": model.seq, "hidden": model.hidden,
                           "f_ms": 18.522, "b_ms": 18.086, "w_ms": 9.337, "p2p_ms": 0.601}}
    cluster = make_cluster("a100", 8)
    eff = calibration_from_dict(doc, default_efficiency(cluster.gpu), model, cluster)
    req = PlanRequest(model, cluster, global_batch=144, efficiency=eff, schedules=("zb-h2",), features=(), pp=(8,),
                      uneven_layers=True, recompute=("none",), distributed_optimizer=False)
    assert req.mbs == (6,) and req.tp == (1,)          # the measured microbatch size and tp are what is planned
    costs = Planner(req, SimCache(disk=False)).stage_costs(Candidate(1, 8, 1, 1, "zb-h2", 6, 24, "none", None, False))
    assert costs.t_f[3] == pytest.approx(18.522e-3) and costs.t_b[3] == pytest.approx(18.086e-3)
    assert costs.t_w[3] == pytest.approx(9.337e-3)
    assert costs.t_f[0] > 2 * 18.522e-3 / 3                    # 2 measured layers + the modelled embedding
    assert costs.comm == pytest.approx(0.601e-3)
    path = tmp_path / "t6.json"
    path.write_text(json.dumps(doc))
    rc = main(["plan", "--arch", "gpt", "--layers", "22", "--hidden", "2304", "--heads", "24", "--seq", "1024",
               "--vocab", "32000", "--gpu", "a100", "--gpus", "8", "--tp", "1", "--pp", "8", "--global-batch-size",
               "144", "--schedules", "1f1b", "--features", "none", "--recompute", "none", "--uneven-layers", "on",
               "--no-flash-attention", "--dropout", "--calibration", str(path), "--json", "--no-baseline"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["plans"][0]["micro_batch_size"] == 6 and out["efficiency"]["stage_times"]["layers"] == 3
    # the Zero Bubble paper measured 1F1B at 11.8 samples/GPU/s here: 1.525 s (docs/benchmarks/published.md)
    assert out["plans"][0]["iteration_time_s"] == pytest.approx(24 * 6 / (11.8 * 8), rel=0.02)


@pytest.mark.parametrize("name,p,v,m", [("1f1b", 4, 1, 8), ("1f1b", 8, 1, 24), ("interleaved-1f1b", 4, 2, 8),
                                        ("interleaved-1f1b", 8, 3, 24), ("interleaved-1f1b", 8, 3, 8),
                                        ("interleaved-1f1b", 5, 2, 5), ("interleaved-1f1b", 3, 2, 3)])
def test_blocking_makespan_is_the_simulators(name, p, v, m):
    """The planner's linear-time evaluation of Megatron's exchanges equals the event simulator's
    nccl-batched makespan, op costs differing per stage; with m = p the first ranks' warm-up holds
    every forward (Megatron-Core's "all warm-up": before, its exchanges deadlocked there), and at
    p = 3 and 5 one rank's warm-up holds all forwards but one, which is not all warm-up."""
    import random

    from megatron_pp_ext.schedule import CostModel, build_schedule, simulate
    from megatron_pp_ext.schedule.passes.megatron_comm import blocking_makespan, insert_comm_megatron_any
    rnd = random.Random(p * 100 + v * 10 + m)
    S = p * v
    cost = CostModel(tuple(rnd.uniform(0.5, 1.5) for _ in range(S)), tuple(rnd.uniform(0.5, 1.5) for _ in range(S)),
                     tuple(rnd.uniform(0.2, 1.0) for _ in range(S)), 0.07, (1.0 / v,) * S)
    sched, _ = build_schedule(name, p, m, chunks=v, costs=cost)
    meg = insert_comm_megatron_any(sched)
    assert blocking_makespan(meg, cost) == pytest.approx(simulate(meg, cost, comm_model="nccl-batched").makespan,
                                                         abs=1e-6)


def test_the_zero_bubble_generator_honours_a_budget_given_to_it():
    """The Zero Bubble paper's ZB-2p is its automatic schedule under a 2p activation limit; zb-h2's
    own limit is 2p - 1. benchmarks/published.py gives the generator 2p directly (the registry
    offers no budget for these names) to show how much of ZB-2p's gap is the limit: the request's
    budget is the one searched within, and where B outweighs F it buys time with activations."""
    from megatron_pp_ext.schedule import ScheduleError, build_schedule, schedule_info, simulate
    from megatron_pp_ext.schedule.catalog import ScheduleRequest
    from megatron_pp_ext.schedule.costs import CostModel
    p, m = 4, 8
    cost = CostModel.from_spec([1.0, 2.0, 1.0, 0.3], p, 1)
    gen = schedule_info("zb-h2").generate
    own = gen(ScheduleRequest(p, m, costs=cost))
    wide = gen(ScheduleRequest(p, m, costs=cost, memory_budget=2.0 * p))
    assert own.meta["budget_units"] == 2 * p - 1 and wide.meta["budget_units"] == 2 * p
    r_own, r_wide = simulate(own, cost), simulate(wide, cost)
    assert max(r_own.peak_memory) <= 2 * p - 1 < max(r_wide.peak_memory) <= 2 * p
    assert r_wide.makespan < r_own.makespan
    with pytest.raises(ScheduleError, match="budget"):   # still not a user's flag for this name
        build_schedule("zb-h2", p, m, memory_budget=2.0 * p)
