"""Cost and memory model of one pipeline configuration.

Times are per stage (a stage is one model chunk on one rank), so the first and last stages
can carry the embedding and the loss. Memory is in *units*: one unit is the activation
that one microbatch leaves on one rank after the forward of all its layers (REFERENCE §1),
so with v chunks per rank each F adds 1/v unit by default.

Memory convention (``w_fraction``): the share of an F's activation that is freed only by
its W. The default 1.0 counts a microbatch's activation as held from F until W, as the
reference code and the figures of REFERENCE §2 do; it is the unit of ``--memory-budget``.
What the B/W split really keeps for W -- the inputs *and* the output gradients of every linear
layer -- is less than what F saved for most models (about 16h against 16h + a*s values per token
for a GPT layer without fused attention); a model that knows its shapes gives that share per
stage (``w_fraction_per_stage``, :mod:`megatron_pp_ext.planner.stagemem`). Under full
recomputation F saves only each layer's input while W still keeps every linear's input and
output gradient: the share is then above 1 and B *adds* ``(w - 1) * act`` (the simulators count
it; the generators' own memory trackers use the same arithmetic).

Held memory beyond the op kinds' own effects (all in units, per stage, empty = none; the
generators' own trackers ignore them, the simulators count them, :mod:`.buffers`):

* ``transient_f`` / ``transient_b`` / ``transient_w``: what an op holds only while it runs, on
  top of the level before it (plus, for F, its own activation): the attention backward's
  score-sized gradients in B, the weight-gradient GEMM's output in W, ...;
* ``msg``: the bytes of stage s's output activation (and of the gradient sent back for it):
  receive buffers from their post until their consumer runs, send buffers from their producer
  until the transfer has ended, local hand-overs (V turn-around) from producer to consumer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from .ir import ScheduleError


#: the simulator rounds times to 9 decimals (simulate._round): a positive time below this
#: would vanish, one a little above it would lose its digits
MIN_TIME = 1e-9
#: a request's F and B (``--costs``, per rank) must be at least this: 1000x the rounding step,
#: so no schedule is decided by rounding
MIN_REQUEST_COST = 1e-6
#: the total time of an iteration must stay below this, far from float overflow (1.8e308)
MAX_TOTAL_TIME = 1e300


def _per_stage(value: float | Sequence[float], n: int, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        vals = (float(value),) * n
    else:
        vals = tuple(float(x) for x in value)
        if len(vals) != n:
            raise ScheduleError(f"{what}: expected {n} per-stage values, got {len(vals)}")
    if any(not (x >= 0 and math.isfinite(x)) for x in vals):
        raise ScheduleError(f"{what}: costs must be finite and >= 0, got {vals}")
    return vals


def _checked(values: Sequence[float], what: str, n: int | None = None) -> tuple[float, ...]:
    """``values`` as floats, each finite and >= 0 (the error names ``what``)."""
    try:
        vals = tuple(float(x) for x in values)
    except (TypeError, ValueError):
        raise ScheduleError(f"CostModel {what}: expected numbers, got {values!r}") from None
    if n is not None and len(vals) != n:
        raise ScheduleError(f"CostModel {what}: expected {n} per-stage values, got {len(vals)}")
    bad = [x for x in vals if not (math.isfinite(x) and x >= 0)]
    if bad:
        raise ScheduleError(f"CostModel {what}: every value must be finite and >= 0, got {bad[0]!r} in {vals}")
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
    #: per stage, units: held only while an F / B / W op runs (see the module doc); () = none
    transient_f: tuple[float, ...] = ()
    transient_b: tuple[float, ...] = ()
    transient_w: tuple[float, ...] = ()
    #: per stage, units: stage s's output message (the activation sent on, the gradient sent back)
    msg: tuple[float, ...] = ()
    #: per stage: the expert-parallel all-to-all time (dispatch and combine) of one microbatch's
    #: forward, part of ``t_f``; its backward moves the same bytes, the same time within ``t_b``.
    #: An overlapped pair hides it behind the other half's compute (:mod:`.pairs`); () = none
    a2a: tuple[float, ...] = ()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        """Every time, the latency and every activation finite and >= 0 (NaN, inf and negative
        values are refused: they would give NaN bubbles, zero peaks or false deadlocks)."""
        n = len(self.t_f)
        if not (len(self.t_b) == len(self.t_w) == n) or n == 0:
            raise ScheduleError("t_f, t_b, t_w must have one value per stage")
        if not self.act:
            raise ScheduleError("act must have one value per stage (use CostModel.uniform)")
        if len(self.act) != n:
            raise ScheduleError(f"act: expected {n} per-stage values, got {len(self.act)}")
        for name in ("t_f", "t_b", "t_w", "act"):
            object.__setattr__(self, name, _checked(getattr(self, name), name, n))
        comm = _checked((self.comm,), "comm latency")[0]
        object.__setattr__(self, "comm", comm)
        if not 0.0 <= self.w_fraction <= 1.0:
            raise ScheduleError(f"w_fraction must be in [0, 1], got {self.w_fraction}")
        if self.w_fraction_per_stage is not None:
            per = tuple(float(w) for w in self.w_fraction_per_stage)
            if len(per) != n or not all(0.0 <= w < math.inf for w in per):
                raise ScheduleError(f"w_fraction_per_stage: expected {n} finite values >= 0, got {per}")
            object.__setattr__(self, "w_fraction_per_stage", per)
        for name in ("transient_f", "transient_b", "transient_w", "msg", "a2a"):
            vals = getattr(self, name)
            if vals:
                object.__setattr__(self, name, _checked(vals, name, n))
            else:
                object.__setattr__(self, name, ())
        for s, a in enumerate(self.a2a):
            if a > self.t_f[s] + 1e-12 or a > self.t_b[s] + 1e-12:
                raise ScheduleError(f"--a2a-time: the all-to-all time of stage {s} ({a:g}) is part of its forward "
                                    f"({self.t_f[s]:g}) and of its backward ({self.t_b[s]:g}) and cannot exceed "
                                    "either; give a smaller --a2a-time or larger --costs")
        for name in ("bytes_per_unit", "bytes_per_message"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ScheduleError(f"CostModel {name} must be a finite number > 0 (or None), got {v!r}")
        total = sum(self.t_f) + sum(self.t_b) + sum(self.t_w) + 2 * n * comm
        if not total < MAX_TOTAL_TIME:
            raise ScheduleError(f"CostModel: the times of one microbatch add up to {total:g}, too large to "
                                "simulate; give the costs in a larger unit (e.g. seconds instead of nanoseconds)")

    def check_scale(self, num_microbatches: int, flag: str = "costs") -> None:
        """Raise ScheduleError when ``num_microbatches`` microbatches under these times would
        not survive the simulator's arithmetic: a positive F or B below :data:`MIN_TIME`
        (rounded to zero time) or a total time of :data:`MAX_TOTAL_TIME` or more (overflow).
        ``flag`` names the input in the message (e.g. ``--costs``)."""
        small = [x for x in self.t_f + self.t_b if 0 < x < MIN_TIME]
        if small:
            raise ScheduleError(f"{flag}: a time of {small[0]:g} per stage is below the simulator's resolution "
                                f"({MIN_TIME:g}); give the costs in a smaller unit (e.g. microseconds instead "
                                "of seconds)")
        total = num_microbatches * (sum(self.t_f) + sum(self.t_b) + sum(self.t_w) + 2 * self.num_stages * self.comm)
        if not total < MAX_TOTAL_TIME:
            raise ScheduleError(f"{flag}: {num_microbatches} microbatches take {total:g} time units in all, too "
                                "large to simulate; give the costs in a larger unit (e.g. seconds instead of "
                                "nanoseconds)")

    def a2a_time(self, stage: int) -> float:
        """The all-to-all time within stage ``stage``'s F (and within its B); 0 without one."""
        return self.a2a[stage] if self.a2a else 0.0

    def with_a2a(self, per_rank: float, chunks_per_rank: int) -> "CostModel":
        """This model with an all-to-all time of ``per_rank`` per microbatch on a rank (all its
        chunks; ``--a2a-time``), spread over the chunks as ``--costs`` spreads F and B."""
        try:
            value = float(per_rank)
        except (TypeError, ValueError):
            raise ScheduleError(f"--a2a-time {per_rank!r}: expected a number, e.g. --a2a-time 0.3") from None
        if not (math.isfinite(value) and value >= 0):
            raise ScheduleError(f"--a2a-time {per_rank!r}: must be a finite number >= 0, e.g. --a2a-time 0.3")
        return replace(self, a2a=(value / chunks_per_rank,) * self.num_stages if value else ())

    def w_share(self, stage: int) -> float:
        """Share of stage ``stage``'s activation that only its W frees."""
        per = self.w_fraction_per_stage
        return self.w_fraction if per is None else per[stage]

    @property
    def num_stages(self) -> int:
        return len(self.t_f)

    @property
    def holds_extra(self) -> bool:
        """Transients or message buffers to charge (:mod:`.buffers`)."""
        return any(any(v) for v in (self.transient_f, self.transient_b, self.transient_w, self.msg))

    def transient(self, kind: str, stage: int) -> float:
        """Units an op of ``kind`` on ``stage`` holds only while it runs (BW: the larger of B's and W's)."""
        if kind == "F":
            return self.transient_f[stage] if self.transient_f else 0.0
        if kind == "B":
            return self.transient_b[stage] if self.transient_b else 0.0
        if kind == "W":
            return self.transient_w[stage] if self.transient_w else 0.0
        if kind == "BW":
            return max(self.transient_b[stage] if self.transient_b else 0.0,
                       self.transient_w[stage] if self.transient_w else 0.0)
        return 0.0

    def headroom(self, ranks_stages: Sequence[Sequence[int]]) -> list[float]:
        """Per rank (its stages given): the most a transient adds on top of the held level, plus
        one receive and one send buffer of its largest message -- what a budgeted generator,
        whose trackers count only held memory, leaves free (:func:`..registry.build_schedule`)."""
        out = []
        for stages in ranks_stages:
            tr = max((self.transient(k, s) for s in stages for k in ("F", "B", "W")), default=0.0)
            mg = max((self.msg[s] for s in stages) if self.msg else [0.0], default=0.0)
            mg_in = max((self.msg[s - 1] for s in stages if s > 0) if self.msg else [0.0], default=0.0)
            out.append(tr + mg + mg_in)
        return out

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
        f, b, w, comm = parse_costs(spec)
        try:
            return cls.uniform(num_stages, chunks_per_rank, f, b, w, comm, **kw)
        except ScheduleError as e:  # e.g. one microbatch over all stages too long to simulate
            shown = spec if isinstance(spec, str) else ",".join(f"{x:g}" for x in (f, b, w, comm))
            why = str(e).removeprefix("CostModel: ")
            raise ScheduleError(f"--costs {shown!r}: {why}") from None

    def with_(self, **changes) -> "CostModel":
        return replace(self, **changes)


def check_cost_numbers(vals: Sequence[float], spec: object = None) -> None:
    """The rule of ``--costs F,B,W,COMM`` (per rank): all finite, F and B at least
    :data:`MIN_REQUEST_COST` (so the simulator's rounding never decides a schedule; a smaller W
    or COMM only rounds towards 0, which changes nothing), W and COMM >= 0, their sum below
    :data:`MAX_TOTAL_TIME`."""
    shown = spec if spec is not None else ",".join(f"{x:g}" for x in vals)
    f, b, w, comm = vals
    if not all(math.isfinite(x) for x in vals) or not (f > 0 and b > 0 and w >= 0 and comm >= 0):
        raise ScheduleError(f"--costs {shown!r}: F and B must be > 0, W and COMM >= 0 (finite numbers), "
                            "e.g. --costs 1,2,1,0")
    if min(f, b) < MIN_REQUEST_COST:
        raise ScheduleError(f"--costs {shown!r}: F and B must be at least {MIN_REQUEST_COST:g}, where the "
                            "simulator's rounding (9 decimals) would decide the schedule; give the costs in a "
                            "smaller unit (e.g. microseconds instead of seconds)")
    if not sum(vals) < MAX_TOTAL_TIME:
        raise ScheduleError(f"--costs {shown!r}: the numbers are too large to simulate (their sum must stay "
                            f"below {MAX_TOTAL_TIME:g}); give the costs in a larger unit, e.g. --costs 1,2,1")


def resolution_note(w: float, comm: float) -> str | None:
    """The line to print when a W or COMM of ``--costs`` is positive but below the simulator's
    resolution (:data:`MIN_TIME`): it is accepted and counts as 0 (a schedule cannot depend on it)."""
    tiny = [f"{name}={v:g}" for name, v in (("W", w), ("COMM", comm)) if 0 < v < MIN_TIME]
    if not tiny:
        return None
    return (f"note      {' and '.join(tiny)} is below the simulator's resolution ({MIN_TIME:g}) and counts as 0; "
            "give the costs in a smaller unit to time it")


def per_stage_values(value: float | Sequence[float], n: int, what: str) -> list[float]:
    """``value`` for each of ``n`` stages: one number for all, or ``n`` numbers; every one
    >= 0. ``what`` names the quantity in the error (e.g. "offload fraction")."""
    vals = [float(value)] * n if isinstance(value, (int, float)) else [float(x) for x in value]
    if len(vals) != n:
        raise ScheduleError(f"{what}: expected {n} per-stage values, got {len(vals)}")
    if any(not (v >= 0 and math.isfinite(v)) for v in vals):
        raise ScheduleError(f"{what}: values must be finite and >= 0, got {vals}")
    return vals


def parse_costs(spec: str | Sequence[float] | None) -> tuple[float, float, float, float]:
    """``--costs F,B,W[,COMM]`` (or those 3-4 numbers) -> (F, B, W, COMM), per rank; F and B > 0,
    W and COMM >= 0. Raises ScheduleError naming ``--costs`` (the CLI, the trainer, the
    Megatron-LM flags and :meth:`CostModel.from_spec` share it)."""
    if spec is None:
        return (1.0, 1.0, 1.0, 0.0)
    try:
        vals = [float(x) for x in (spec.split(",") if isinstance(spec, str) else spec)]
    except ValueError:
        raise ScheduleError(f"--costs {spec!r}: expected numbers F,B,W[,COMM] per rank, e.g. --costs 1,2,1,0.1") from None
    if len(vals) not in (3, 4):
        raise ScheduleError(f"--costs {spec!r}: expected 3 or 4 numbers F,B,W[,COMM], e.g. --costs 1,2,1,0.1")
    if len(vals) == 3:
        vals.append(0.0)
    check_cost_numbers(vals, spec)
    f, b, w, comm = vals
    return (f, b, w, comm)
