"""The prepared GPU check (issue 29) keeps running: ``scripts/gpu_check.sh --cpu`` in CI.

The GPU run happens rarely, on a machine with no network and 15 minutes; whatever rots in
between is found there, too late. So the whole check runs here on CPU processes (gloo with
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
    for case in ("vocab-parallel zbv-pp2 [channels]", "bpipe 1f1b-pp4 [channels]"):   # (they hang under it)
        assert names[case + q]["status"] == "skip" and "refused under" in names[case + q]["detail"], case
    assert names["offload-full zbv-pp2 [channels]" + q]["status"] == "pass"
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
