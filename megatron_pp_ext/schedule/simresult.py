"""What a simulation gives: :class:`SimResult`, and :class:`DeadlockError` when a schedule cannot
run to the end. Its own module so that the simulator (:mod:`.simulate`, :mod:`.engine`) and the
validator share it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from .ir import Op, ScheduleError

__all__ = ["SimResult", "DeadlockError"]


class DeadlockError(ScheduleError):
    """The schedule cannot run to the end: some rank waits forever.

    ``model``: the communication model it deadlocks under (None: not told); ``waits``: one line
    per stuck rank or NCCL stream, for :meth:`brief`."""

    def __init__(self, message: str, *, model: str | None = None, waits: tuple[str, ...] = ()):
        super().__init__(message)
        self.model = model
        self.waits = tuple(waits)

    def brief(self, limit: int = 2) -> str:
        """The first ``limit`` waits in a few words (the full message lists every rank)."""
        if not self.waits:
            return str(self).splitlines()[0] if str(self) else "every rank waits"
        more = len(self.waits) - limit
        return "; ".join(self.waits[:limit]) + (f"; {more} more" if more > 0 else "")


@dataclass
class SimResult:
    makespan: float
    busy: list[float]                      # compute time per rank
    peak_memory: list[float]               # activation units per rank
    memory_timeline: list[list[tuple[float, float]]]  # per rank: (time, units after change)
    times: dict[Op, tuple[float, float]]   # op -> (start, end)
    messages: list[int]                    # p2p messages sent per rank
    comm_wait: list[float] = field(default_factory=list)  # compute-stream time blocked in comm batches
    bytes_per_unit: float | None = None
    bytes_per_message: float | None = None
    recv_wait: list[float] = field(default_factory=list)  # compute-stream time waiting for a received
    #   tensor right before the op that reads it (models that wait at the consumer)

    @property
    def num_ranks(self) -> int:
        return len(self.busy)

    @property
    def bubble_rates(self) -> list[float]:
        return [1.0 - b / self.makespan if self.makespan > 0 else 0.0 for b in self.busy]

    @property
    def bubble_rate(self) -> float:
        """Bubble of the busiest rank (REFERENCE §1)."""
        return 1.0 - max(self.busy) / self.makespan if self.makespan > 0 else 0.0

    @property
    def max_peak_memory(self) -> float:
        return max(self.peak_memory)

    @property
    def peak_memory_bytes(self) -> list[float] | None:
        if self.bytes_per_unit is None:
            return None
        return [m * self.bytes_per_unit for m in self.peak_memory]

    @property
    def comm_bytes(self) -> list[float] | None:
        if self.bytes_per_message is None:
            return None
        return [n * self.bytes_per_message for n in self.messages]

    def to_dict(self) -> dict:
        d = {
            "makespan": self.makespan,
            "bubble_rate": self.bubble_rate,
            "bubble_rate_per_rank": self.bubble_rates,
            "busy_per_rank": self.busy,
            "peak_memory": self.peak_memory,
            "max_peak_memory": self.max_peak_memory,
            "messages_per_rank": self.messages,
        }
        if self.peak_memory_bytes is not None:
            d["peak_memory_bytes"] = self.peak_memory_bytes
        if self.comm_bytes is not None:
            d["comm_bytes_per_rank"] = self.comm_bytes
        if self.comm_wait:
            # in batches (batch-end models) and before the op that reads a received tensor (consumer waits)
            rw = self.recv_wait or [0.0] * len(self.comm_wait)
            d["comm_wait_per_rank"] = [round(a + b, 9) for a, b in zip(self.comm_wait, rw)]
        return d
