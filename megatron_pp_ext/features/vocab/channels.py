"""Asynchronous reduction channels of vocabulary parallelism: a FIFO of jobs that issue the
collectives of one process group, run by a thread of the channel while the main thread computes.

One design on CPU and GPU: the thread runs a job, waits on the host until its collectives have
ended (:func:`~megatron_pp_ext.runtime.nccl_rules.wait_host`: never a stream wait), and only
then takes the next one; the consumer's ``Pending.wait()`` blocks the host until the job is
done. On a GPU the job runs inside the channel's own CUDA stream (not a pooled one), ordered
after the work the main thread issued before submitting it. Why not issue every job at once
on the stream (waits ordering the streams, the host never blocking): with one hardware queue
(``CUDA_DEVICE_MAX_CONNECTIONS=1``, what Megatron-LM advises for TP overlap) a stream wait, or a
second collective behind one still waiting for another rank, holds every kernel issued after it
-- the forward kernels the pre-posted broadcasts wait for included: a hang. The channel threads
hang under one queue too (their collectives run at times unrelated to the main thread's issue
order); there :class:`~.parallel.VocabParallel` runs without channels, in its one-queue mode.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

import torch

from ...runtime.nccl_rules import wait_host
from ...runtime.streams import dedicated_stream

__all__ = ["Pending", "Channel", "wait_host"]


class Pending:
    """The result of a channel job: ``wait()`` returns it (re-raising the job's error)."""

    def __init__(self, future: Future, event=None):
        self._future, self._event = future, event

    @classmethod
    def of(cls, value) -> "Pending":
        """A result there already (nothing to wait for)."""
        fut: Future = Future()
        fut.set_result(value)
        return cls(fut)

    def wait(self):
        value = self._future.result()
        if self._event is not None:   # (ended already: orders the consumer's stream, holds nothing)
            cur = torch.cuda.current_stream()
            cur.wait_event(self._event)
            _record(value, cur)
        return value

    def done(self) -> bool:
        return self._future.done()


def _record(value, stream) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _record(v, stream)
    elif hasattr(value, "__dict__"):
        for v in vars(value).values():
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(stream)


class Channel:
    """A FIFO of jobs (functions that issue collectives on one process group and wait for them
    with :func:`wait_host`), run in order by the channel's thread."""

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.cuda = device.type == "cuda"
        self.device = device
        self._stream = dedicated_stream(device, f"vocab-{name}") if self.cuda else None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self.jobs = 0

    def _start(self) -> None:
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"mppx-vocab-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, fut, after, done_event = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with torch.no_grad():
                    if self.cuda:
                        self._stream.wait_event(after)   # the producers the main thread issued before
                        with torch.cuda.stream(self._stream):
                            value = fn(*args)
                        done_event.record(self._stream)
                    else:
                        value = fn(*args)
                fut.set_result(value)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)
            item = fn = args = None

    def submit(self, fn: Callable, *args) -> Pending:
        self.jobs += 1
        if self._thread is None:
            self._start()
        fut: Future = Future()
        after = done_event = None
        if self.cuda:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream())
            _record(list(args), self._stream)
            done_event = torch.cuda.Event()
        self._queue.put((fn, args, fut, after, done_event))
        return Pending(fut, done_event)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
