"""The Megatron-Bridge integration's pieces that need no Bridge (every venv): the ``mppx.*`` keys,
the checks on a Bridge ``ConfigContainer`` (the Megatron-LM integration's rules, messages in
Bridge's keys), the launcher's command line, and the version gate. Bridge's own ``pretrain()``
under our schedules: tests/test_bridge_pretrain.py (scripts/test_bridge.sh)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from megatron_pp_ext.bridge.launch import _HELP, LaunchError, parse_command_line
from megatron_pp_ext.bridge.options import (FLAG_KEYS, MPPX_KEYS, BridgeConfigError, bridge_message, megatron_args,
                                            split_overrides)
from megatron_pp_ext.bridge.plan import plan_for

ROOT = Path(__file__).resolve().parents[1]


class _Provider(types.SimpleNamespace):
    """Stands in for a recipe's GPTModelProvider: the fields the checks read, and a provide()."""

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        raise AssertionError("not built here")


def bridge_cfg(**model) -> types.SimpleNamespace:
    """A Bridge ConfigContainer's fields that plan_for reads (the vanilla GPT recipe's names)."""
    m = dict(num_layers=8, pipeline_model_parallel_size=2, tensor_model_parallel_size=1, context_parallel_size=1,
             virtual_pipeline_model_parallel_size=None, pipeline_model_parallel_layout=None,
             num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
             account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
             variable_seq_lengths=False, overlap_moe_expert_parallel_comm=False, cuda_graph_impl="none",
             cuda_graph_scope=[], mtp_num_layers=None, share_embeddings_and_output_weights=True,
             expert_model_parallel_size=1, init_model_with_meta_device=False, init_method_std=0.02,
             gated_linear_unit=False, layernorm_zero_centered_gamma=False)
    m.update(model)
    return types.SimpleNamespace(model=_Provider(**m),
                                 train=types.SimpleNamespace(global_batch_size=8, micro_batch_size=1, train_iters=10),
                                 dist=types.SimpleNamespace(use_decentralized_pg=False),
                                 rng=types.SimpleNamespace(seed=1234))


def test_split_overrides_takes_the_mppx_keys_and_leaves_the_rest():
    ours, rest = split_overrides(["mppx.schedule=zbv", "model.num_layers=8", "mppx.layout_independent_init",
                                  "mppx.allow_padding_num_layers=false", "+mppx.costs=1,2,1", "train.train_iters=3"])
    assert ours == {"schedule": "zbv", "layout_independent_init": True, "allow_padding_num_layers": False,
                    "costs": "1,2,1"}
    assert rest == ["model.num_layers=8", "train.train_iters=3"]


@pytest.mark.parametrize("arg,needle", [
    ("mppx.schedul=zbv", "unknown key mppx.schedul; megatron_pp_ext's keys are mppx.schedule, "),
    ("mppx.schedule", "mppx.schedule needs a value: mppx.schedule=VALUE"),
    ("mppx.layout_independent_init=maybe", "mppx.layout_independent_init=maybe: give true or false"),
])
def test_a_bad_mppx_key_names_the_key_and_the_fix(arg, needle):
    with pytest.raises(BridgeConfigError) as e:
        split_overrides([arg])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bridge_message_writes_the_flags_as_bridge_keys():
    assert bridge_message("--pipeline-schedule zbv needs pipeline parallelism: add --pipeline-model-parallel-size P "
                          "with P >= 2") == ("mppx.schedule=zbv needs pipeline parallelism: add "
                                             "model.pipeline_model_parallel_size=P with P >= 2")
    assert bridge_message("(--mtp-num-layers) is not supported; drop --mtp-num-layers") == \
        "(model.mtp_num_layers) is not supported; drop model.mtp_num_layers"
    assert bridge_message("--layout-independent-init cannot be combined with --init-model-with-meta-device") == \
        "mppx.layout_independent_init cannot be combined with model.init_model_with_meta_device"
    assert bridge_message("--pipeline-layers-per-stage has 3 entries") == "mppx.layers_per_stage has 3 entries"
    assert bridge_message("(--cuda-graph-scope full_iteration)") == "(model.cuda_graph_scope=full_iteration)"


def test_every_mppx_key_is_a_flag_of_the_megatron_lm_integration():
    """One source for the rules: each key sets a destination of that parser, and its flag is
    written back as the key in messages."""
    from megatron_pp_ext.megatron_lm.flags import build_parser
    dests = {a.dest for a in build_parser()._actions}
    for key, (dest, _) in MPPX_KEYS.items():
        assert dest in dests, key
        assert ("--" + dest.replace("_", "-")) in FLAG_KEYS and FLAG_KEYS["--" + dest.replace("_", "-")][0] == \
            f"mppx.{key}", key
        assert f"mppx.{key}" in _HELP


def test_zbv_plan_puts_the_loss_on_rank_0_and_two_chunks_per_rank():
    plan = plan_for(bridge_cfg(share_embeddings_and_output_weights=False), {"schedule": "zbv"}, world_size=2)
    assert plan.v and plan.pp == 2 and plan.chunks == 2 and plan.placement == (0, 1, 1, 0) and plan.loss_rank == 0
    assert plan.layers_per_stage == (2, 2, 2, 2) and plan.microbatches == 8
    assert plan.options.flag == "--pipeline-schedule zbv"


def test_tied_embeddings_under_v_get_a_note_in_bridge_keys():
    plan = plan_for(bridge_cfg(), {"schedule": "zbv"}, world_size=2)
    assert plan.notes == ["mppx.schedule=zbv with tied embeddings: the embedding (stage 0) and the output layer "
                          "(stage 3) are both on pipeline rank 0; their gradients are summed there"]


def test_loop_schedules_keep_bridges_layout_and_chunks():
    plan = plan_for(bridge_cfg(virtual_pipeline_model_parallel_size=2), {"schedule": "interleaved-zb"}, world_size=2)
    assert not plan.v and plan.chunks == 2 and plan.layers_per_stage is None and plan.placement == (0, 1, 0, 1)
    plan = plan_for(bridge_cfg(num_layers=7), {"schedule": "zb-h1", "allow_padding_num_layers": True}, world_size=2)
    assert plan.layers_per_stage == (4, 3) and plan.chunks == 1   # (split_layers: the extra layer to a middle stage)
    # no schedule: Bridge's own, with our initial weights
    plan = plan_for(bridge_cfg(), {"layout_independent_init": True}, world_size=2)
    assert not plan.options.active and plan.options.needs_install


def test_data_parallel_size_counts_into_the_microbatches():
    assert plan_for(bridge_cfg(), {"schedule": "zb-h1"}, world_size=4).microbatches == 4
    assert megatron_args(bridge_cfg(), 8).data_parallel_size == 4


@pytest.mark.parametrize("model,settings,needle", [
    (dict(mtp_num_layers=1), {"schedule": "zbv"},
     "mppx.schedule=zbv: multi-token prediction (model.mtp_num_layers) is not supported through Megatron-Bridge "
     "yet (Megatron-LM's pretrain_gpt.py runs it); drop model.mtp_num_layers"),
    (dict(overlap_moe_expert_parallel_comm=True), {"schedule": "zb-h1"},
     "mppx.schedule=zb-h1 cannot be combined with model.overlap_moe_expert_parallel_comm"),
    (dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]), {"schedule": "zbv"},
     "mppx.schedule=zbv cannot run inside a full-iteration CUDA graph (model.cuda_graph_scope=full_iteration)"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["full_iteration"]), {"schedule": "zb-h1"},
     "mppx.schedule=zb-h1 cannot run inside a full-iteration CUDA graph (model.cuda_graph_modules=full_iteration)"),
    (dict(cuda_graph_impl="full_iteration"), {"schedule": "zb-h1"},
     "mppx.schedule=zb-h1 cannot run inside a full-iteration CUDA graph (model.cuda_graph_impl=full_iteration)"),
    (dict(virtual_pipeline_model_parallel_size=2), {"schedule": "zbv"},
     "model.virtual_pipeline_model_parallel_size cannot be combined with mppx.schedule=zbv: its V placement"),
    (dict(pipeline_model_parallel_size=1), {"schedule": "zbv"},
     "mppx.schedule=zbv needs pipeline parallelism: add model.pipeline_model_parallel_size=P with P >= 2"),
    (dict(), {"schedule": "interleaved-zb"},
     "mppx.schedule=interleaved-zb needs several model chunks per rank: add "
     "model.virtual_pipeline_model_parallel_size=2 (or more)"),
    (dict(num_layers=7), {"schedule": "zbv"},
     "model.num_layers=7 cannot be split evenly over the 4 stages of mppx.schedule=zbv (V placement: 2 x pp = 4); use "
     "model.num_layers=4 or 8, add mppx.allow_padding_num_layers"),
    (dict(init_model_with_meta_device=True), {"layout_independent_init": True},
     "mppx.layout_independent_init cannot be combined with model.init_model_with_meta_device"),
    (dict(), {"schedule": "nope"}, "mppx.schedule 'nope': unknown schedule; available: "),
    (dict(), {"schedule": "zbv", "memory_budget": "0.5x"},
     "mppx.memory_budget: schedule 'zbv' (mppx.schedule=zbv) has a fixed memory footprint; use mppx.schedule=v-budget"),
])
def test_what_cannot_run_is_refused_in_one_line_in_bridge_keys(model, settings, needle):
    with pytest.raises(BridgeConfigError) as e:
        plan_for(bridge_cfg(**model), settings, world_size=2)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg
    assert not re.search(r"(?<![\w.])--[a-z]", msg), msg   # no Megatron-LM flag left in a Bridge message


def test_split_schedule_on_bridges_transformer_engine_layers_is_refused(monkeypatch):
    """With Transformer Engine installed, Bridge's default layer spec builds TE layers: a schedule that
    splits B and W is refused (TE's own split is neither verified on a GPU nor set up through
    Bridge), naming Bridge's local_layer_spec; a fused schedule and the local spec run."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))

    def default_layer_spec(config):   # (Bridge's default's name)
        return None

    def local_layer_spec(config):
        return None

    msg = str(pytest.raises(BridgeConfigError, plan_for, bridge_cfg(transformer_layer_spec=default_layer_spec),
                            {"schedule": "zbv"}).value)
    assert msg.startswith("mppx.schedule=zbv splits every backward into B and W") and "local_layer_spec" in msg, msg
    assert plan_for(bridge_cfg(transformer_layer_spec=default_layer_spec), {"schedule": "1f1b"}).pp == 2
    assert plan_for(bridge_cfg(transformer_layer_spec=local_layer_spec), {"schedule": "zbv"}).v


def test_a_gpu_machine_missing_what_bridge_needs_is_refused_in_one_line(monkeypatch):
    """On a GPU (the CPU layer steps aside): Bridge's default layer spec without Transformer Engine,
    and no host C compiler for its JIT warm-up, each refused before anything starts."""
    import importlib.util
    import shutil

    from megatron_pp_ext.bridge.cpu_compat import gpu_refusal

    def default_layer_spec(config):
        return None

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    cfg = bridge_cfg(transformer_layer_spec=default_layer_spec)
    assert "Transformer Engine is not installed" in gpu_refusal(cfg) and "local_layer_spec" in gpu_refusal(cfg)
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert "host C compiler" in gpu_refusal(cfg)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/gcc" if name == "gcc" else None)
    assert gpu_refusal(cfg) is None


def test_bridge_only_refusals():
    cfg = bridge_cfg()
    cfg.dist.use_decentralized_pg = True
    with pytest.raises(BridgeConfigError, match=r"mppx.schedule=zbv cannot be combined with "
                                                r"dist.use_decentralized_pg=true"):
        plan_for(cfg, {"schedule": "zbv"}, world_size=2)
    cfg = bridge_cfg()
    cfg.model = types.SimpleNamespace(**vars(cfg.model))   # a ModelConfig: built by a builder, no provide()
    with pytest.raises(BridgeConfigError, match="is built by a ModelBuilder, not a model provider's provide"):
        plan_for(cfg, {"schedule": "zbv"}, world_size=2)
    assert not plan_for(cfg, {}, world_size=2).options.needs_install   # Bridge's own run stays untouched


def test_launcher_command_line():
    recipe, step, ours, rest = parse_command_line(["--recipe", "vanilla_gpt_pretrain_config", "mppx.schedule=zbv",
                                                   "model.num_layers=8", "--forward-step=m:f"])
    assert (recipe, step, ours, rest) == ("vanilla_gpt_pretrain_config", "m:f", {"schedule": "zbv"},
                                          ["model.num_layers=8"])
    for argv, needle in ((["mppx.schedule=zbv"], "--recipe NAME is required"),
                         (["--recipe", "r", "--pp", "2"], "unknown option --pp"),
                         (["--recipe", "r", "--forward-step", "f"], "give MODULE:FUNCTION"),
                         (["--recipe", "r", "mppx.bogus=1"], "unknown key mppx.bogus")):
        with pytest.raises(LaunchError) as e:
            parse_command_line(argv)
        assert e.value.code == 2 and e.value.msg.startswith("megatron_pp_ext.bridge: error: ") and needle in e.value.msg


def test_launcher_refuses_a_bad_key_in_one_line_before_importing_bridge():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import sys, runpy\nsys.argv = ['x', '--recipe', 'vanilla_gpt_pretrain_config', 'mppx.shedule=zbv']\n"
            "try:\n    runpy.run_module('megatron_pp_ext.bridge', run_name='__main__')\n"
            "finally:\n    print('bridge imported:', 'megatron.bridge' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == ("megatron_pp_ext.bridge: error: mppx.shedule=zbv: unknown key mppx.shedule; "
                                "megatron_pp_ext's keys are " + ", ".join(f"mppx.{k}" for k in MPPX_KEYS))
    assert r.stdout.strip() == "bridge imported: False"


@pytest.mark.parametrize("module", ["megatron_pp_ext.bridge", "megatron_pp_ext.bridge.launch"])
def test_both_module_spellings_run_the_launcher(module):
    """``-m megatron_pp_ext.bridge.launch`` (what a torchrun command may name) is the launcher too:
    it once imported the module and exited 0 on every rank without training."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", module, "--recipe", "r", "mppx.bogus=1"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("megatron_pp_ext.bridge: error: mppx.bogus=1: unknown key"), \
        r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and "usage: python -m megatron_pp_ext.bridge --recipe NAME" in r.stdout


def test_bridge_version_gate(tmp_path, monkeypatch):
    """Megatron-Bridge outside 0.6.x is refused in one line (MPPX_ALLOW_UNSUPPORTED_MEGATRON=1: a warning)."""
    from megatron_pp_ext import compat
    pkg = tmp_path / "megatron" / "bridge"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "package_info.py").write_text("MAJOR = 0\nMINOR = 7\nPATCH = 1\n")
    monkeypatch.setattr(compat, "megatron_bridge_location", lambda: str(pkg))
    monkeypatch.setattr(compat, "check_supported", lambda: None)
    assert compat.megatron_bridge_version() == (0, 7, 1)
    monkeypatch.delenv("MPPX_ALLOW_UNSUPPORTED_MEGATRON", raising=False)
    with pytest.raises(compat.UnsupportedMegatronError) as e:
        compat.check_bridge_supported()
    assert str(e.value).startswith("megatron_pp_ext supports megatron-bridge 0.6.x, but megatron-bridge 0.7.1 is "
                                   "installed")
    monkeypatch.setenv("MPPX_ALLOW_UNSUPPORTED_MEGATRON", "1")
    compat.check_bridge_supported()
    (pkg / "package_info.py").write_text("MAJOR = 0\nMINOR = 6\nPATCH = 2\n")
    monkeypatch.delenv("MPPX_ALLOW_UNSUPPORTED_MEGATRON")
    compat.check_bridge_supported()
