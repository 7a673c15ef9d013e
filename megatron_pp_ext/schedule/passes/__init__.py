"""Schedule passes: functions Schedule -> Schedule that add ops (communication, and the
offload / vocabulary / BPipe ops of the feature packages)."""

from .comm import insert_comm
from .gaps import insert_at_gaps

__all__ = ["insert_comm", "insert_at_gaps"]
