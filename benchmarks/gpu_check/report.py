"""Results of the GPU check: one record per check, written as JSON and a markdown table, and
one log (``gpu_check.log``: every check's line and the texts too long for the table).

Written after every check (``Results.add`` saves), so a run an outer time limit cuts off still
leaves what it did. A check's ``status`` is ``pass`` / ``fail`` (correctness: decides the exit
status), ``measured`` (a timing or memory figure; ``goal_met`` says whether it meets its goal
in docs/gpu.md#what-it-does, which does not fail the run: timings on a shared GPU are not
pass/fail material) or ``skip`` (with the reason in ``detail``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Check", "Results", "STATUSES"]

STATUSES = ("pass", "fail", "measured", "skip")


@dataclass
class Check:
    step: str                 # setup | nccl | cuda
    name: str
    status: str
    detail: str = ""          # one line
    seconds: float = 0.0
    data: dict = field(default_factory=dict)
    goal_met: bool | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status {self.status!r}: one of {STATUSES}")
        self.detail = " ".join(str(self.detail).split())


def _plain(obj: Any) -> Any:
    """JSON-safe copy (tuples -> lists, non-finite floats -> strings, unknown -> str)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


class Results:
    """Checks of one run plus its environment; ``save()`` writes ``results.json`` / ``results.md``."""

    def __init__(self, out_dir: Path, *, mode: str, argv: list[str]):
        self.out_dir = Path(out_dir)
        self.mode = mode
        self.argv = list(argv)
        self.started = time.time()
        self.env: dict = {}
        self.checks: list[Check] = []

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        line = f"[{check.step}] {check.name}: {check.status.upper()}"
        if check.detail:
            line += f" - {check.detail}"
        line += f" ({check.seconds:.1f} s)"
        print(line, flush=True)
        self.log(line)
        self.save()
        return check

    def log(self, text: str) -> None:
        """Append to ``gpu_check.log``: every check's line, and the long texts (tracebacks, the
        stacks of ranks that hung, ``mppx train``'s output) the table leaves out."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "gpu_check.log", "a") as f:
            f.write(text.rstrip("\n") + "\n")

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def to_dict(self) -> dict:
        return _plain({
            "mode": self.mode, "argv": self.argv,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.started)),
            "wall_s": round(time.time() - self.started, 1), "env": self.env,
            "summary": {s: sum(c.status == s for c in self.checks) for s in STATUSES},
            "checks": [asdict(c) for c in self.checks],
        })

    def markdown(self) -> str:
        d = self.to_dict()
        e = d["env"]
        lines = [f"# GPU check results ({d['mode']})", "",
                 f"{d['date']}, {d['wall_s']} s in all; `{' '.join(['scripts/gpu_check.sh'] + d['argv'])}`", ""]
        keys = ("gpu", "capability", "gpu_memory", "compute_mode", "driver", "cuda_runtime", "torch", "torch_cuda",
                "nccl", "megatron_core", "python", "wheels")
        lines += ["| what | version |", "|---|---|"]
        lines += [f"| {k} | {e[k]} |" for k in keys if e.get(k) not in (None, "")]
        s = d["summary"]
        lines += ["", f"**{s['pass']} passed, {s['fail']} failed, {s['measured']} measured, {s['skip']} skipped**", "",
                  "| step | check | status | detail | s |", "|---|---|---|---|---|"]
        for c in d["checks"]:
            status = c["status"]
            if status == "measured" and c.get("goal_met") is not None:
                status += " (goal met)" if c["goal_met"] else " (goal missed)"
            detail = str(c["detail"]).replace("|", "\\|")
            lines.append(f"| {c['step']} | {c['name']} | {status} | {detail} | {c['seconds']:.1f} |")
        return "\n".join(lines) + "\n"

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "results.json").write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        (self.out_dir / "results.md").write_text(self.markdown())
