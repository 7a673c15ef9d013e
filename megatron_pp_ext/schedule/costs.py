"""Cost and memory model of one pipeline configuration.

Times are per stage (a stage is one model chunk on one rank), so the first and last stages
can carry the embedding and the loss. Memory is in *units*: one unit is the activation
that one microbatch leaves on one rank after the forward of all its layers (REFERENCE §1),
so with v chunks per rank each F adds 1/v unit by default.

Memory convention (``w_fraction``): the share of an F's activation that is freed only by
its W. The default 1.0 counts a microbatch's activation as held from F until W, as the
reference code and the figures of REFERENCE §2 do; it is the unit of ``--memory-budget``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from .ir import ScheduleError


def _per_stage(value: float | Sequence[float], n: int, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        vals = (float(value),) * n
    else:
        vals = tuple(float(x) for x in value)
        if len(vals) != n:
            raise ScheduleError(f"{what}: expected {n} per-stage values, got {len(vals)}")
    if any(x < 0 for x in vals):
        raise ScheduleError(f"{what}: costs must be >= 0, got {vals}")
    return vals


@dataclass(frozen=True)
class CostModel:
    """Per-stage compute times, p2p latency and the activation-memory model."""

    t_f: tuple[float, ...]
    t_b: tuple[float, ...]
    t_w: tuple[float, ...]
    comm: float = 0.0
    act: tuple[float, ...] = ()
    w_fraction: float = 1.0
    bytes_per_unit: float | None = None
    bytes_per_message: float | None = None
    #: per-stage ``w_fraction`` where stages differ (measured: the embedding, layer and loss
    #: stages keep different shares for their weight gradients); None: the scalar applies.
    w_fraction_per_stage: tuple[float, ...] | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        n = len(self.t_f)
        if not (len(self.t_b) == len(self.t_w) == n) or n == 0:
            raise ScheduleError("t_f, t_b, t_w must have one value per stage")
        if not self.act:
            raise ScheduleError("act must have one value per stage (use CostModel.uniform)")
        if len(self.act) != n:
            raise ScheduleError(f"act: expected {n} per-stage values, got {len(self.act)}")
        if not 0.0 <= self.w_fraction <= 1.0:
            raise ScheduleError(f"w_fraction must be in [0, 1], got {self.w_fraction}")
        if self.w_fraction_per_stage is not None:
            per = tuple(float(w) for w in self.w_fraction_per_stage)
            if len(per) != n or not all(0.0 <= w <= 1.0 for w in per):
                raise ScheduleError(f"w_fraction_per_stage: expected {n} values in [0, 1], got {per}")
            object.__setattr__(self, "w_fraction_per_stage", per)
        if self.comm < 0:
            raise ScheduleError(f"comm latency must be >= 0, got {self.comm}")

    def w_share(self, stage: int) -> float:
        """Share of stage ``stage``'s activation that only its W frees."""
        per = self.w_fraction_per_stage
        return self.w_fraction if per is None else per[stage]

    @property
    def num_stages(self) -> int:
        return len(self.t_f)

    @classmethod
    def uniform(cls, num_stages: int, chunks_per_rank: int = 1, f: float = 1.0, b: float = 1.0,
                w: float = 1.0, comm: float = 0.0, **kw) -> "CostModel":
        """Equal stages. ``f, b, w`` are per *rank* (all its chunks), as in the papers:
        each of the v chunks on a rank costs 1/v of it and holds 1/v unit of activation."""
        v = chunks_per_rank
        return cls(_per_stage(f / v, num_stages, "F"), _per_stage(b / v, num_stages, "B"),
                   _per_stage(w / v, num_stages, "W"), comm,
                   (1.0 / v,) * num_stages, **kw)

    @classmethod
    def from_spec(cls, spec: str | Sequence[float] | None, num_stages: int,
                  chunks_per_rank: int, **kw) -> "CostModel":
        """Build from ``"F,B,W[,COMM]"`` (the ``--costs`` flag), per rank as in :meth:`uniform`."""
        if spec is None:
            vals: list[float] = [1.0, 1.0, 1.0, 0.0]
        else:
            try:
                vals = [float(x) for x in (spec.split(",") if isinstance(spec, str) else spec)]
            except ValueError:
                raise ScheduleError(f"--costs {spec!r}: expected numbers F,B,W[,COMM], e.g. 1,1.8,0.4,0.05") from None
            if len(vals) not in (3, 4):
                raise ScheduleError(f"--costs {spec!r}: expected 3 or 4 numbers F,B,W[,COMM], e.g. 1,2,1,0")
            if len(vals) == 3:
                vals.append(0.0)
        f, b, w, comm = vals
        if f <= 0 or b <= 0 or w < 0 or comm < 0:
            raise ScheduleError(f"--costs {spec!r}: F and B must be > 0, W and COMM >= 0")
        return cls.uniform(num_stages, chunks_per_rank, f, b, w, comm, **kw)

    def with_(self, **changes) -> "CostModel":
        return replace(self, **changes)


def per_stage_values(value: float | Sequence[float], n: int, what: str) -> list[float]:
    """``value`` for each of ``n`` stages: one number for all, or ``n`` numbers; every one
    >= 0. ``what`` names the quantity in the error (e.g. "offload fraction")."""
    vals = [float(value)] * n if isinstance(value, (int, float)) else [float(x) for x in value]
    if len(vals) != n:
        raise ScheduleError(f"{what}: expected {n} per-stage values, got {len(vals)}")
    if any(v < 0 or math.isnan(v) for v in vals):
        raise ScheduleError(f"{what}: values must be >= 0, got {vals}")
    return vals
