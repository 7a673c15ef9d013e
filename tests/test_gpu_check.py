"""The prepared GPU check (docs/gpu.md#the-gpu-check-scriptsgpu_checksh) keeps running: ``scripts/gpu_check.sh --cpu`` in CI.

The GPU run happens rarely, often on a machine without network and with little time; whatever
rots in between is found there, too late. So the whole check runs here on CPU processes (gloo with
NCCL's rules emulated, small shapes, no sanitizer): every step, every parity case with every
NCCL strategy, the deadlock probe, the JSON and markdown it writes (about 20 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    parts = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHON=sys.executable, PYTHONPATH=os.pathsep.join(parts))


def _script(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=str(ROOT), env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_cpu_run_passes_every_step_and_writes_its_results(tmp_path):
    p = _script("--cpu", "--out", str(tmp_path))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "results.md").read_text()
    assert doc["mode"] == "cpu" and doc["summary"]["fail"] == 0
    names = {c["name"]: c for c in doc["checks"]}
    by_status = {c["status"] for c in doc["checks"]}
    assert by_status <= {"pass", "measured", "skip"}
    # the parity subset: V placement, zbv, v-half, dualpipev, interleaved-zb at pp=4, features, MoE
    for case in ("zbv-pp2", "dualpipev-pp2", "interleaved-zb-pp4", "moe ep2 zbv-pp2-dp2"):
        for strategy in ("channels", "batched", "pairwise"):
            assert names[f"{case} [{strategy}]"]["status"] == "pass", case
    for case in ("v-half-pp2 [channels]", "zbv-pp4 [channels]", "vocab-parallel zbv-pp2 [channels]",
                 "bpipe 1f1b-pp4 [channels]", "offload-full zbv-pp2 [channels]"):
        assert names[case]["status"] == "pass", case
    assert names["zbv-pp2 [channels]"]["data"]["exact"] is True
    assert names["zbv-pp2 [channels]"]["data"]["probe"]["p2p"] == "emulated-channels"
    assert names["bpipe 1f1b-pp4 [channels]"]["data"]["probe"]["feature"]["evicted_bytes"] > 0
    assert names["a deadlock is a one-line failure within the limit"]["status"] == "pass"
    # one rank: the B/W split, op times of the three layer shapes, memory, offload
    wgrad = [c for c in doc["checks"] if c["name"].startswith("B/W split")]
    assert len(wgrad) == 5 and all(c["status"] == "pass" for c in wgrad)
    assert sum(c["name"].startswith("op times ") and c["status"] == "measured" for c in doc["checks"]) == 3
    assert names["peak memory vs the planner"]["status"] == "measured"
    assert names["offload copy time vs the compute it hides behind"]["status"] == "measured"
    assert names["offload on CUDA streams under the CUDA sanitizer"]["status"] == "skip"
    assert "| step | check | status |" in md and "megatron_core" in json.dumps(doc["env"])
    # the one-rank steps come first, the NCCL cases after them, then the same under one hardware queue
    order = [c["name"] for c in doc["checks"]]
    assert order.index("peak memory vs the planner") < order.index("zbv-pp2 [channels]")
    q = " (CUDA_DEVICE_MAX_CONNECTIONS=1)"
    assert order.index("a deadlock is a one-line failure within the limit") < order.index("zbv-pp2 [channels]" + q)
    for case in ("zbv-pp2", "dualpipev-pp2", "interleaved-zb-pp4", "moe ep2 zbv-pp2-dp2"):
        for strategy in ("channels", "batched", "pairwise"):
            assert names[f"{case} [{strategy}]{q}"]["status"] == "pass", case
    # vocabulary parallelism runs its one-queue mode under it (the threaded channels would hang)
    assert names["vocab-parallel zbv-pp2 [channels]" + q]["status"] == "pass"
    assert names["bpipe 1f1b-pp4 [channels]" + q]["status"] == "pass"   # one message per eviction or fetch
    assert names["offload-full zbv-pp2 [channels]" + q]["status"] == "pass"
    # every strategy beside busy TP-overlap streams, with several hardware queues and with one
    for strategy in ("channels", "batched", "pairwise"):
        for suffix in ("", q):
            c = names[f"zbv-pp2 [{strategy}] busy streams{suffix}"]
            assert c["status"] == "pass" and c["data"]["exact"] is True and min(c["data"]["busy_side_ops"]) > 0
    # the communicators' memory: n/a on gloo, but its path ran
    mem = names["NCCL communicator memory"]
    assert mem["status"] == "skip" and "n/a on CPU" in mem["detail"] and "16 two-rank groups" in mem["detail"]
    # every check's line in the one log
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"] {c['name']}: " in log for c in doc["checks"]), log[-2000:]


@pytest.mark.parametrize("args,needle", [(["--only", "bogus"], "--only 'bogus': unknown step"),
                                         (["--spawn"], "--spawn is for --cpu"),
                                         (["--cpu", "--budget", "-1"], "argument --budget: '-1'"),
                                         (["--cpu", "--budget", "nan"], "argument --budget: 'nan'"),
                                         (["--cpu", "--budget", "inf"], "argument --budget: 'inf'"),
                                         (["--cpu", "--budget=-inf"], "argument --budget: '-inf'"),
                                         (["--cpu", "--budget", "soon"], "argument --budget: 'soon'"),
                                         (["--cpu", "--quick", "--out", "/proc/gc"], "--out /proc/gc: cannot write"),
                                         (["--cpu", "--out", "/dev/null/x"], "--out /dev/null/x: cannot write")])
def test_bad_arguments_are_one_line_and_exit_2(args, needle):
    from benchmarks.gpu_check.main import main
    import io
    import contextlib
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_a_stress_case_that_hangs_is_a_result_line_not_a_failure(tmp_path):
    """Under CUDA_DEVICE_MAX_CONNECTIONS=1 or busy streams a hang is what the check found out:
    one measured line ("channels hangs under ..."), exit status untouched; a plain case's hang
    stays a failure that stops the NCCL part."""
    import types

    from benchmarks.gpu_check.main import Runner
    from benchmarks.gpu_check.parity import ParityCase, stress_label
    from benchmarks.gpu_check.report import Results
    from megatron_pp_ext.runtime.pool import PoolTimeout, WorkerError

    class HangingPool:
        def __init__(self, error):
            self.error = error

        def run(self, fn, world, timeout=None, **kw):
            raise self.error

    args = types.SimpleNamespace(budget=0, only=["nccl"])
    r = Runner(args, types.SimpleNamespace(name="cpu", cpu=True), Results(tmp_path, mode="cpu", argv=[]))
    case = ParityCase("zbv-pp2 [channels] busy streams", "plain", None, "channels", busy=True)
    assert stress_label(case, one_queue=True) == ("channels hangs under CUDA_DEVICE_MAX_CONNECTIONS=1 with busy "
                                                  "TP-overlap streams")
    assert stress_label(ParityCase("x", "plain", None, "pairwise"), one_queue=False) is None
    r.pool = HangingPool(PoolTimeout("stuck", {0: "stack of rank 0"}))
    got, _ = r.run("nccl", case.name, print, 2, timeout=3.0, hang_result=stress_label(case, one_queue=False))
    emulated = WorkerError("x", {1: "Traceback ...\nmegatron_pp_ext.runtime.nccl_rules.NCCLHangError: rank 1 waited"})
    r.pool = HangingPool(emulated)
    r.run("nccl", "pairwise case", print, 2, timeout=3.0, hang_result="pairwise hangs under busy TP-overlap streams")
    first, second = r.results.checks
    assert got is None and r.hung is None and not r.results.failed
    assert (first.status, first.goal_met) == ("measured", False)
    assert first.detail.startswith("channels hangs under busy TP-overlap streams: did not finish within 3 s")
    assert second.detail.startswith("pairwise hangs under busy TP-overlap streams (NCCL's rules emulated): rank 1: ")
    r.pool = HangingPool(PoolTimeout("stuck", {}))
    r.run("nccl", "plain case", print, 2, timeout=3.0)
    assert r.results.failed and r.hung == "plain case"


def test_an_exclusive_gpu_runs_the_one_rank_steps_and_says_why_the_rest_is_skipped(tmp_path, monkeypatch):
    """A GPU in Exclusive_Process mode admits one CUDA context: the one-rank steps run in a
    one-worker pool, the NCCL steps are skipped with the reason in results.md (a --cpu run acts as
    the compute mode GPU_CHECK_COMPUTE_MODE names)."""
    monkeypatch.setenv("GPU_CHECK_COMPUTE_MODE", "Exclusive_Process")
    p = _script("--cpu", "--quick", "--only", "wgrad,nccl,train", "--out", str(tmp_path))
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    doc = json.loads((tmp_path / "results.json").read_text())
    by_step = {c["step"]: c for c in doc["checks"]}
    assert all(c["status"] == "pass" for c in doc["checks"] if c["step"] == "wgrad")
    for step in ("nccl", "train"):
        assert by_step[step]["status"] == "skip" and "compute mode is Exclusive_Process" in by_step[step]["detail"]
    assert "one-worker pool" in (tmp_path / "results.md").read_text()
    from benchmarks.gpu_check.main import exclusive_reason
    assert exclusive_reason("Default") is None and exclusive_reason("") is None
    assert "Prohibited" in exclusive_reason("Prohibited")


def test_the_sanitizer_step_is_bounded_by_the_budget(tmp_path):
    """The sanitizer, the longest step and the last, gets at most what is left of the budget plus
    BUDGET_TAIL_S, and is skipped with under STEP_MIN_S left: the run ends near its budget."""
    import types

    from benchmarks.gpu_check.main import BUDGET_TAIL_S, STEP_MIN_S, Runner
    from benchmarks.gpu_check.report import Results
    from benchmarks.gpu_check.sizes import Mode
    r = Runner(types.SimpleNamespace(budget=420.0, only=None), Mode(cpu=True, quick=False),
               Results(tmp_path, mode="cpu", argv=[]))
    r.t0 -= 100.0                       # 100 s into the run: the step's own limit holds
    assert r.step_limit(240.0) == 240.0
    r.t0 -= 300.0                       # 400 s in: what is left of 420 + the tail
    assert r.step_limit(240.0) == pytest.approx(420.0 + BUDGET_TAIL_S - 400.0, abs=1.0)
    r.t0 -= 460.0 + BUDGET_TAIL_S - STEP_MIN_S - 400.0   # too little left: skipped
    assert r.step_limit(240.0) is None
    r.budget = 0.0                      # no budget: the step's own limit
    assert r.step_limit(240.0) == 240.0


def test_communicator_memory_figures():
    """c per communicator, k per connection: one way 8 x (2c + 2k), both ways 8 x (2c + 4k)."""
    from benchmarks.gpu_check.commcheck import figures
    c, k = 3 << 20, 2 << 20
    before = 80 << 30
    levels = [before, before - 8 * (2 * c + 2 * k), before - 8 * (2 * c + 2 * k) - 8 * (2 * c + 4 * k)]
    f = figures([{"count": 8, "free_bytes": levels}])
    assert (f["per_communicator_bytes"], f["per_connection_bytes"]) == (c, k)


def test_missing_wheels_is_one_line(tmp_path, monkeypatch):
    from benchmarks.gpu_check import setup_env
    monkeypatch.setattr(setup_env, "_importable", lambda module: False)
    with pytest.raises(setup_env.SetupError, match="--fetch-wheels"):
        setup_env.ensure_packages(tmp_path / "none", tmp_path / "site")


def test_shared_gpu_environment():
    from megatron_pp_ext.runtime.shared_gpu import share_gpu_requested, shared_gpu_env
    a, b = shared_gpu_env(0, tag="x", env={}), shared_gpu_env(1, tag="x", env={"NCCL_SOCKET_IFNAME": "eth0"})
    assert a["NCCL_HOSTID"] != b["NCCL_HOSTID"]
    assert a["NCCL_P2P_DISABLE"] == a["NCCL_SHM_DISABLE"] == "1" and a["NCCL_NET"] == "Socket"
    assert a["NCCL_SOCKET_IFNAME"] == "lo" and b["NCCL_SOCKET_IFNAME"] == "eth0"   # the caller's setting wins
    assert share_gpu_requested({"MPPX_SHARE_GPU": "1"}) and not share_gpu_requested({"MPPX_SHARE_GPU": "0"})
    assert not share_gpu_requested({})
