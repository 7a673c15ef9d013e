"""The vocabulary op kinds and the schedule metadata they carry, apart from the pass that places
them (:mod:`.schedule_pass`) so that the one-queue model (:mod:`.one_queue`), which the pass calls,
reads them without importing it back."""

from __future__ import annotations

from ...schedule.ir import Schedule

__all__ = ["VEF", "VEIN", "VS", "VSE", "VT", "VLOSS", "VEB", "VOCAB_KINDS", "vocab_meta", "has_vocab"]

VEF, VEIN, VS, VSE, VT, VLOSS, VEB = "VEF", "VEIN", "VS", "VSE", "VT", "VLOSS", "VEB"
VOCAB_KINDS = (VEF, VEIN, VS, VSE, VT, VLOSS, VEB)


def vocab_meta(sched: Schedule) -> dict:
    return sched.meta.get("vocab") or {}


def has_vocab(schedule: Schedule) -> bool:
    return any(op.kind in VOCAB_KINDS for op in schedule.all_ops())
