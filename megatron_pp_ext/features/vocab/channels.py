"""Asynchronous reduction channels of vocabulary parallelism: a FIFO of jobs that issue the
collectives of one process group. On CPU (gloo) a daemon thread runs them (``async_op=True``
handles waited on that thread) while the main thread computes; on GPU a job runs on the
channel's own CUDA stream (NCCL's ``wait()`` only orders streams), with an event for the consumer."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable

import torch

__all__ = ["Pending", "Channel"]


class Pending:
    """The result of a channel job: ``wait()`` returns it (re-raising the job's error)."""

    def __init__(self, future: Future | None = None, value=None, event=None, stream=None):
        self._future, self._value, self._event, self._stream = future, value, event, stream

    def wait(self):
        if self._future is not None:
            return self._future.result()
        if self._event is not None:
            cur = torch.cuda.current_stream()
            cur.wait_event(self._event)
            _record(self._value, cur)
        return self._value

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or self._event.query()


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
    """A FIFO of jobs (functions that issue collectives on one process group).

    CPU: a daemon thread runs the jobs in order (collectives with ``async_op=True`` waited on
    that thread), so the main thread keeps computing. GPU (CUDA tensors): a job runs at once on
    the calling thread but inside the channel's own CUDA stream, after that stream waited for
    the current one; NCCL's ``wait()`` only makes the channel stream wait, so nothing blocks
    the host. ``Pending.wait()`` then makes the consumer's stream wait for an event.
    """

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self.jobs = 0

    def _start(self) -> None:
        self._queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"mppx-vocab-{self.name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, args, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                with torch.no_grad():
                    fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)

    def submit(self, fn: Callable, *args) -> Pending:
        self.jobs += 1
        if self.cuda:
            cur = torch.cuda.current_stream()
            self._stream.wait_stream(cur)
            _record(list(args), self._stream)
            with torch.cuda.stream(self._stream), torch.no_grad():
                value = fn(*args)
            ev = torch.cuda.Event()
            ev.record(self._stream)
            return Pending(value=value, event=ev, stream=self._stream)
        if self._thread is None:
            self._start()
        fut: Future = Future()
        self._queue.put((fn, args, fut))
        return Pending(future=fut)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=5)
            self._thread = None
