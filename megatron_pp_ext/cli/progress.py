"""Progress bars for long ``mppx`` work: tqdm on standard error, only on a terminal and only
once the work has lasted :data:`DELAY_S` seconds (short commands print nothing extra).

The bar listens to the schedule core's :func:`~megatron_pp_ext.schedule.progress.report`
calls (a generator's candidates, send/recv insertion, validation), so a single long build
also moves it.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

from ..schedule.progress import listening

#: seconds of work before a bar appears, and between two redraws
DELAY_S = 2.0
REDRAW_S = 0.1


class Progress:
    """A tqdm bar counting ``unit`` (``total`` of them when known), with the current step as
    its postfix. ``count_reports``: each core report is one unit (else reports only relabel)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "step", count_reports: bool = True,
                 stream=None) -> None:
        from tqdm import tqdm

        stream = sys.stderr if stream is None else stream
        self.count_reports = count_reports
        fmt = ("{desc}: {n_fmt}/{total_fmt} {unit}s |{bar:20}| {elapsed} elapsed{postfix}" if total else
               "{desc}: {elapsed} elapsed, step {n_fmt}{postfix}")
        self.bar = tqdm(total=total, desc=desc, unit=unit, file=stream, leave=False, delay=DELAY_S,
                        mininterval=REDRAW_S, dynamic_ncols=True, bar_format=fmt, disable=not _is_terminal(stream))

    def step(self, text: str) -> None:
        """A new step starts (the core's reports land here)."""
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(1 if self.count_reports else 0)

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@contextmanager
def progress(desc: str, total: int | None = None, unit: str = "step", count_reports: bool = True,
             stream=None) -> Iterator[Progress]:
    """A :class:`Progress` receiving the schedule core's reports for the duration of the block."""
    bar = Progress(desc, total, unit, count_reports, stream)
    try:
        with listening(bar.step):
            yield bar
    finally:
        bar.close()
