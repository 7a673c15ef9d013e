"""megatron_pp_ext.compat: the supported Megatron-Core range at start-up, and the import shims.

The version check runs in subprocesses with a stand-in ``megatron/core/package_info.py`` first on
``PYTHONPATH`` (the check reads the version of the Megatron-Core that would be imported, without
importing it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext import compat

ROOT = Path(__file__).resolve().parents[1]


def _fake_megatron(tmp_path: Path, version: tuple[int, int, int]) -> Path:
    core = tmp_path / "fake" / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise ImportError('a stand-in: never imported by the check')\n")
    (core / "package_info.py").write_text("MAJOR = {}\nMINOR = {}\nPATCH = {}\n".format(*version))
    return tmp_path / "fake"


def _run(args: list[str], fake: Path | None, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(p) for p in (fake, ROOT) if p is not None] + [os.environ.get("PYTHONPATH", "")])
    e = {k: v for k, v in os.environ.items() if k != "MPPX_ALLOW_UNSUPPORTED_MEGATRON"}
    e.update(PYTHONPATH=path, **env)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e, timeout=300)


CHECK = ["-c", "from megatron_pp_ext import compat; compat.check_supported(); print('supported', compat.megatron_core_version())"]


def test_this_environment_is_supported():
    r = _run(CHECK, None)
    assert r.returncode == 0 and "supported" in r.stdout, r.stderr
    ver = compat.megatron_core_version()
    assert ver is not None
    if ver == compat.MEGATRON_LM_MAIN["version"]:   # (by hand: a Megatron-LM main checkout)
        assert compat.main_checkout()[0], compat.main_checkout()[1]
    else:
        assert compat.SUPPORTED[0] <= ver < compat.SUPPORTED[1]


@pytest.mark.parametrize("version", [(0, 20, 0), (0, 15, 3), (1, 0, 0)])
def test_unsupported_version_is_one_clear_line(tmp_path, version):
    r = _run(CHECK, _fake_megatron(tmp_path, version))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_pp_ext.compat.UnsupportedMegatronError: megatron_pp_ext supports "
                           "megatron-core 0.16.1 through 0.19.x, but megatron-core " + ".".join(map(str, version)))
    assert "pip install 'megatron-core>=0.16.1,<0.20'" in last and "MPPX_ALLOW_UNSUPPORTED_MEGATRON=1" in last


def test_unsupported_version_can_be_tried_with_a_warning(tmp_path):
    r = _run(CHECK, _fake_megatron(tmp_path, (0, 20, 0)), MPPX_ALLOW_UNSUPPORTED_MEGATRON="1")
    assert r.returncode == 0 and "supported (0, 20, 0)" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron_pp_ext: warning: megatron_pp_ext supports megatron-core "
                                                   "0.16.1 through 0.19.x, but megatron-core 0.20.0 is installed")
    assert lines[0].endswith("trying anyway (MPPX_ALLOW_UNSUPPORTED_MEGATRON=1)")


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    r = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(repo), *args],
                       capture_output=True, text=True, env=env, check=True)
    return r.stdout.strip()


@pytest.fixture
def main_repo(tmp_path):
    """A stand-in Megatron-LM git history: commits a <- b <- c on main (package_info reports the
    version of :data:`compat.MEGATRON_LM_MAIN`) and a side branch from a; HEAD at c."""
    if shutil.which("git") is None:
        pytest.fail("git is needed (the version check reads a checkout's commit with it)")
    repo = _fake_megatron(tmp_path, compat.MEGATRON_LM_MAIN["version"])
    _git(repo, "init", "-q", "-b", "main")
    ids = {}
    for name in ("a", "b", "c"):
        (repo / "megatron" / "core" / "log.txt").write_text(name)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", name)
        ids[name] = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "-b", "side", ids["a"])
    (repo / "megatron" / "core" / "log.txt").write_text("side")
    _git(repo, "commit", "-q", "-am", "side")
    ids["side"] = _git(repo, "rev-parse", "HEAD")
    _git(repo, "checkout", "-q", "main")
    return repo, ids


def _check_pinned(pinned: str) -> list[str]:
    """The version check with ``pinned`` as the main commit megatron_pp_ext is verified at."""
    return ["-c", "from megatron_pp_ext import compat; compat.MEGATRON_LM_MAIN['commit'] = %r; "
                  "compat.check_supported(); print('supported', compat.megatron_core_version())" % pinned]


def test_main_checkout_at_or_after_the_pinned_commit_runs_as_a_development_build(main_repo):
    """Megatron-LM main (megatron-core 0.20.0) from a git checkout whose history has the pinned
    commit: accepted, with one line saying it is a development build (rank 0 only)."""
    repo, ids = main_repo
    for pinned in (ids["b"], ids["c"]):        # after it, at it
        r = _run(_check_pinned(pinned), repo)
        assert r.returncode == 0 and "supported (0, 20, 0)" in r.stdout, r.stderr
        lines = r.stderr.strip().splitlines()
        assert lines == [f"megatron_pp_ext: note: megatron-core 0.20.0 is a development build (Megatron-LM main at "
                         f"{ids['c'][:10]}, at or after {pinned[:10]} of {compat.MEGATRON_LM_MAIN['date']}, verified "
                         "by hand: docs/compatibility.md)"]
    r = _run(_check_pinned(ids["b"]), repo, RANK="1")
    assert r.returncode == 0 and r.stderr.strip() == ""


def test_development_build_it_cannot_place_is_refused_in_one_line(main_repo, tmp_path):
    """0.20.0 before the pinned commit, on another branch, from a history without the pinned commit
    (a shallow clone), not from a git checkout at all (a wheel), or without git: refused, naming
    why and the fix (install_megatron.sh --ref, or a supported release)."""
    repo, ids = main_repo
    cases = [(ids["c"], {}, "before", f"which does not descend from main {ids['c'][:10]}"),
             (ids["b"], {"side": True}, "side branch", f"which does not descend from main {ids['b'][:10]}"),
             ("f" * 40, {}, "shallow", "does not have main ffffffffff in its history (a shallow clone?"),
             (ids["b"], {"wheel": True}, "wheel", "it is not a git checkout of Megatron-LM"),
             (ids["b"], {"PATH": str(tmp_path / "nothing")}, "no git", "git is not installed")]
    for pinned, how, what, why in cases:
        where = repo
        env = {}
        if what == "before":
            _git(repo, "checkout", "-q", ids["b"])
        elif what == "side branch":
            _git(repo, "checkout", "-q", "side")
        elif what == "wheel":
            where = _fake_megatron(tmp_path / "wheel", compat.MEGATRON_LM_MAIN["version"])
        elif what == "no git":
            env["PATH"] = how["PATH"]
        r = _run(_check_pinned(pinned), where, **env)
        _git(repo, "checkout", "-q", "main")
        assert r.returncode != 0, what
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("megatron_pp_ext.compat.UnsupportedMegatronError: megatron_pp_ext supports "
                               "megatron-core 0.16.1 through 0.19.x, but megatron-core 0.20.0 is installed"), what
        assert why in last, (what, last)
        assert (f"0.20.0 runs only as Megatron-LM main at or after {pinned[:10]} ({compat.MEGATRON_LM_MAIN['date']}) "
                "from a git checkout") in last
        assert f"scripts/install_megatron.sh --ref {pinned[:10]} DIR and PYTHONPATH=DIR" in last, what
        assert "pip install 'megatron-core>=0.16.1,<0.20'" in last and "MPPX_ALLOW_UNSUPPORTED_MEGATRON=1" in last


def test_mppx_train_refuses_an_unsupported_version_before_starting(tmp_path):
    r = _run(["-m", "megatron_pp_ext.cli", "train", "--iters", "1"], _fake_megatron(tmp_path, (0, 20, 1)))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mppx: error: megatron_pp_ext supports megatron-core 0.16.1 "
                                                   "through 0.19.x, but megatron-core 0.20.1 is installed")


def test_megatron_lm_install_refuses_an_unsupported_version(tmp_path):
    code = "import megatron_pp_ext.megatron_lm as m; m.install(cpu_compat=False)"
    r = _run(["-c", code], _fake_megatron(tmp_path, (0, 21, 0)))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stdout.strip().startswith("megatron_pp_ext: error: megatron_pp_ext supports megatron-core 0.16.1")


def test_import_shims_leave_no_trace():
    """After ``import megatron_pp_ext`` Megatron-Core and Megatron-LM's training loop import on
    this interpreter (0.18+ need triton and typing.override); neither a triton stub nor
    typing.override is left behind for anything else to find."""
    code = ("import importlib.util, sys, typing, megatron_pp_ext\n"
            "had = importlib.util.find_spec('triton') is not None\n"
            "import megatron.core, megatron.core.pipeline_parallel.schedules\n"
            "try:\n    import megatron.training.training\nexcept ImportError as e:\n    print('no training loop', e)\n"
            "stub = getattr(sys.modules.get('triton'), '__mppx_stub__', False)\n"
            "print('triton', had, importlib.util.find_spec('triton') is not None, stub)\n"
            "print('override', hasattr(typing, 'override'))\n")
    r = _run(["-W", "ignore", "-c", code], None)
    assert r.returncode == 0, r.stderr[-3000:]
    triton = next(l for l in r.stdout.splitlines() if l.startswith("triton"))
    had, found, stub = triton.split()[1:]
    assert found == had and stub == "False"
    assert ("override True" in r.stdout) == (sys.version_info >= (3, 12))


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None
                    or importlib.util.find_spec("nvidia_resiliency_ext") is not None,
                    reason="Transformer Engine or nvidia-resiliency-ext is installed (no stub is needed)")
def test_bridge_modules_see_a_stub_of_an_absent_package_only_while_they_import(tmp_path):
    """Megatron-Bridge 0.6 imports Transformer Engine (LoRA layers) and nvidia-resiliency-ext
    (``pretrain``) unconditionally: those modules import without them, isinstance checks against
    the stub are False, using it says the package is missing, and nothing else finds a stub
    (Megatron-Core's own ``HAVE_TE`` probes must still see no Transformer Engine)."""
    mods = tmp_path / "fake" / "megatron" / "bridge"
    (mods / "peft").mkdir(parents=True)
    (mods / "training").mkdir()
    (mods / "peft" / "lora_layers.py").write_text(
        "import torch\nimport transformer_engine.pytorch as te\n"
        "IS_TE = isinstance(torch.nn.Linear(1, 1), (te.Linear, te.LayerNormLinear))\n"
        "try:\n    te.ops.Sequential()\nexcept ImportError as e:\n    USE = str(e)\n")
    (mods / "training" / "pretrain.py").write_text(
        "from nvidia_resiliency_ext.inprocess import CallWrapper\n"
        "def f(w: CallWrapper | None = None):\n    return w\n")
    code = ("import importlib.util, sys, megatron_pp_ext\n"
            "import megatron.bridge.peft.lora_layers as l, megatron.bridge.training.pretrain as p\n"
            "print(l.IS_TE, l.USE)\n"
            "print([m for m in ('transformer_engine', 'nvidia_resiliency_ext') if m in sys.modules"
            " or importlib.util.find_spec(m) is not None])\n")
    r = _run(["-c", code], tmp_path / "fake")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.splitlines() == [
        "False transformer_engine.pytorch.ops.Sequential needs transformer_engine, which is not installed", "[]"]


def test_backward_step_follows_the_signature(monkeypatch):
    """megatron-core 0.17 dropped ``model_type`` from schedules.backward_step."""
    from megatron.core.pipeline_parallel import schedules

    seen = []
    monkeypatch.setattr(schedules, "backward_step", lambda i, o, g, config: seen.append(("new", config)) or "dx")
    assert compat.backward_step(1, 2, 3, "mt", "cfg") == "dx" and seen == [("new", "cfg")]
    monkeypatch.setattr(schedules, "backward_step", lambda i, o, g, model_type, config: seen.append((model_type, config)))
    compat.backward_step(1, 2, 3, "mt", "cfg")
    assert seen[-1] == ("mt", "cfg")


def _traced_with_wraps(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def _traced_without_wraps(fn, span="megatron.microbatch.backward"):
    """A tracing decorator that does not use functools.wraps: its closure also holds a helper."""
    def record(what):
        return (span, what)

    def wrapper(*args, **kwargs):
        record("start")
        return fn(*args, **kwargs)
    return wrapper


class _TracedObject:
    """A tracing wrapper object: only ``(*args, **kwargs)`` to see, the function in an attribute."""

    def __init__(self, fn):
        self.target, self.span = fn, "megatron.microbatch.backward"

    def __call__(self, *args, **kwargs):
        return self.target(*args, **kwargs)


WRAPPERS = {"functools.wraps": _traced_with_wraps, "no functools.wraps": _traced_without_wraps,
            "wrapper object": _TracedObject,
            "two layers": lambda fn: _traced_without_wraps(_traced_with_wraps(fn))}


@pytest.mark.parametrize("wrap", list(WRAPPERS), ids=list(WRAPPERS))
def test_signature_probes_see_through_a_tracing_wrapper(monkeypatch, wrap):
    """Megatron-LM main decorates schedules.forward_step / backward_step with a tracing decorator
    (a no-op without its package): compat.backward_step still passes model_type exactly where the
    wrapped function takes it, and bind_call binds a wrapped function's arguments by name."""
    from megatron.core.pipeline_parallel import schedules

    seen = []

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        seen.append(("new", config))
        return "dx"

    def old_backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        seen.append((model_type, config))
        return "dx"
    old_backward_step.__name__ = "backward_step"

    monkeypatch.setattr(schedules, "backward_step", WRAPPERS[wrap](backward_step))
    assert compat.backward_step(1, 2, 3, "mt", "cfg") == "dx" and seen == [("new", "cfg")]
    monkeypatch.setattr(schedules, "backward_step", WRAPPERS[wrap](old_backward_step))
    assert compat.backward_step(1, 2, 3, "mt", "cfg") == "dx" and seen[-1] == ("mt", "cfg")

    def pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
                 process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}):  # noqa: B006
        return extra_args_provider
    bound = compat.bind_call(WRAPPERS[wrap](pretrain), ("data", "model", "type", "step"), {"extra_args_provider": 1})
    assert bound is not None and bound.arguments["extra_args_provider"] == 1
    assert "extra_args_provider" in bound.signature.parameters and bound.arguments["model_type"] == "type"


def test_unreadable_wrapper_is_one_line_naming_the_fix(monkeypatch):
    """A wrapper that hides which function it calls (two candidates, neither named backward_step):
    one line naming the fix, not a guess at the arguments."""
    from megatron.core.pipeline_parallel import schedules

    def first(*args):
        return args

    def second(*args):
        return args

    def wrapper(*args, **kwargs):
        return second(first(*args))
    monkeypatch.setattr(schedules, "backward_step", wrapper)
    with pytest.raises(RuntimeError, match="cannot read the parameters of Megatron-Core's schedules.backward_step "
                                           "through its wrapper .* or have it use functools.wraps$"):
        compat.backward_step(1, 2, 3, "mt", "cfg")


def test_default_pg_collection_has_every_group_megatrons_schedules_fill():
    """The executor's ProcessGroupCollection when the caller passes none: every field Megatron-Core's
    own schedules fill (their _build_default_pg_collection where this release has one: Megatron-LM
    main adds the gtp_remat groups), and tp_dp_cp and dp on every release (finalize_model_grads
    asserts tp_dp_cp with moe_router_enable_expert_bias on 0.18.2+); the caller's pipeline group wins."""
    import socket

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    from megatron_pp_ext.runtime.cpu_compat import enable_cpu_compat

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with enable_cpu_compat():
        store = torch.distributed.TCPStore("127.0.0.1", port, 1, is_master=True)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            ps.initialize_model_parallel()
            pgc = compat.default_pg_collection()
            fields = set(vars(pgc))
            build = getattr(schedules, "_build_default_pg_collection", None)
            theirs = vars(build()) if build is not None else {}
            assert set(theirs) <= fields, set(theirs) - fields
            assert all(getattr(pgc, k) is v for k, v in theirs.items())
            assert {"tp", "cp", "embd", "pos_embd", "pp", "dp_cp", "tp_dp_cp", "dp"} <= fields
            assert pgc.tp_dp_cp is ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
            assert pgc.pp is ps.get_pipeline_model_parallel_group()
            mine = torch.distributed.new_group([0])
            assert compat.default_pg_collection(mine).pp is mine
        finally:
            ps.destroy_model_parallel()
            torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_moe_metrics_read_clear_and_reset():
    """The MoE aux-loss tracker (a module dict before core 0.19, a tracker object since): read, zero
    after logging, forget between runs; and the router's gating runs without Transformer Engine."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    compat.reset_moe_metrics()
    assert compat.moe_metric_values("load_balancing_loss") is None
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.5), 2, 3)
    moe_utils.save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(0.5), 2, 3)
    assert compat.moe_metric_values("load_balancing_loss").tolist() == [0.0, 2.0, 0.0]
    compat.clear_moe_metrics()
    assert compat.moe_metric_values("load_balancing_loss").tolist() == [0.0, 0.0, 0.0]
    moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.25))
    compat.reset_moe_metrics()
    assert compat.moe_metric_values("load_balancing_loss") is None
    assert moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale is None
    compat.moe_without_te()
    x, w = torch.randn(3, 4), torch.randn(2, 4)
    assert torch.equal(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.t())


def test_the_pairs_communication_stream_is_the_one_given(monkeypatch):
    """Overlapped pairs hand Megatron-Core's fine-grained plan a stream of their own on CUDA (a pool
    stream could be a communicator's: runtime/streams.py); without one, Megatron-Core's default."""
    from megatron.core.pipeline_parallel import utils as pp_utils

    from megatron_pp_ext import compat
    calls = []
    monkeypatch.setattr(pp_utils, "set_streams", lambda *a, **kw: calls.append((a, kw)))
    stream = object()
    assert compat.fine_grained_plan(comm_stream=stream) is not None
    assert compat.fine_grained_plan() is not None
    assert calls == [((), {"comm_stream": stream}), ((), {})]
