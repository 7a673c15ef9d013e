"""CUDA-event op timings, converted after the call (the part that runs without a GPU)."""

from megatron_pp_ext.runtime.executor import OpTiming, _event_times


class FakeEvent:
    """Stands in for torch.cuda.Event: elapsed_time in milliseconds, synchronize once."""

    synced = 0

    def __init__(self, ms: float):
        self.ms = ms

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.ms - self.ms

    def synchronize(self) -> None:
        FakeEvent.synced += 1


def test_event_times_are_seconds_since_the_first_event_with_one_sync():
    ev0 = FakeEvent(100.0)
    got = _event_times([OpTiming("0F0", "F", 0, 0, FakeEvent(100.0), FakeEvent(102.5)),
                        OpTiming("0B0", "B", 0, 0, FakeEvent(103.0), FakeEvent(107.0))], ev0)
    assert [(t.start, t.end) for t in got] == [(0.0, 0.0025), (0.003, 0.007)]
    assert FakeEvent.synced == 1 and got[1].kind == "B"
    assert _event_times([], ev0) == []
