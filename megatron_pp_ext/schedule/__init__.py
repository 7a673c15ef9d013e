"""Pure-Python schedule core. Imports no torch, numpy or matplotlib (plots import
matplotlib lazily)."""

from .costs import CostModel
from .ir import (BW, B, F, W, Op, OpKind, PairedOp, Schedule, ScheduleError, loop_placement, op_kind,
                 register_op_kind, split_layers, v_placement)
from . import pairs  # noqa: F401  (registers the overlapped-pair kinds F&B, F&BW)
from .passes import insert_comm
from .registry import (ScheduleInfo, ScheduleRequest, build_schedule, parse_memory_budget,
                       register_schedule, schedule_info, schedule_names)
from .simulate import DeadlockError, SimResult, simulate
from .validate import ValidationError, register_check, validate

__all__ = [
    "BW", "B", "F", "W", "Op", "OpKind", "PairedOp", "Schedule", "ScheduleError", "loop_placement", "op_kind",
    "register_op_kind", "split_layers", "v_placement", "insert_comm", "ScheduleInfo", "ScheduleRequest",
    "build_schedule", "parse_memory_budget", "register_schedule", "schedule_info", "schedule_names",
    "DeadlockError", "SimResult", "simulate", "ValidationError", "register_check", "validate",
    "CostModel",
]
