"""CUDA streams of our own: outside PyTorch's stream pool, and non-blocking.

``torch.cuda.Stream()`` hands out one of a pool of 32 streams per device and priority, round
robin, and ProcessGroupNCCL takes its communication streams from the same pool. Once the pool
wraps, a side stream (activation offload's copies, vocabulary parallelism's channels) can be the
very stream of a communicator, and its work queues behind a receive that waits for another
rank. :func:`dedicated_stream` creates a stream of its own instead, one per device and purpose,
kept for the life of the process (CUDA frees it with the context).

It is created *non-blocking* (``CU_STREAM_NON_BLOCKING``): PyTorch computes on the legacy
default stream, which waits for, and is waited for by, every blocking stream, so a plain
``cudaStreamCreate`` stream would serialise every offload copy and vocabulary kernel with
compute. torch's ``cudart()`` bindings offer only ``cudaStreamCreate``, so the driver's
``cuStreamCreate`` is called (libcuda, present wherever a GPU driver is), in the device's primary
context, the one PyTorch uses; the flag is read back from the created stream.
"""

from __future__ import annotations

import ctypes
import threading

import torch

__all__ = ["dedicated_stream", "CU_STREAM_NON_BLOCKING"]

#: cuda.h's CU_STREAM_NON_BLOCKING (= cudaStreamNonBlocking)
CU_STREAM_NON_BLOCKING = 0x1

_STREAMS: dict = {}
_LOCK = threading.Lock()


def _driver():
    """The CUDA driver library (a function, so that tests can stand in for it)."""
    return ctypes.CDLL("libcuda.so.1")


def _check(code: int, call: str, index: int, purpose: str) -> None:
    if int(code) != 0:
        raise RuntimeError(f"{call} failed on cuda:{index} for the {purpose} stream (CUresult {int(code)})")


def _create_non_blocking(index: int, purpose: str) -> int:
    """A new non-blocking stream in ``cuda:index``'s primary context; its handle."""
    drv = _driver()
    with torch.cuda.device(index):
        torch.cuda.synchronize(index)   # (a runtime call: the device's primary context is now current)
        handle = ctypes.c_void_p()
        _check(drv.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(CU_STREAM_NON_BLOCKING)), "cuStreamCreate",
               index, purpose)
        flags = ctypes.c_uint(0)
        _check(drv.cuStreamGetFlags(handle, ctypes.byref(flags)), "cuStreamGetFlags", index, purpose)
    if not flags.value & CU_STREAM_NON_BLOCKING:
        raise RuntimeError(f"the {purpose} stream on cuda:{index} was created blocking (flags {flags.value})")
    return int(handle.value)


def dedicated_stream(device: torch.device | int, purpose: str) -> "torch.cuda.Stream":
    """The non-blocking stream of ``purpose`` on CUDA ``device``, created on first use."""
    index = device if isinstance(device, int) else (device.index if device.index is not None
                                                   else torch.cuda.current_device())
    key = (index, purpose)
    with _LOCK:
        st = _STREAMS.get(key)
        if st is None:
            st = _STREAMS[key] = torch.cuda.ExternalStream(_create_non_blocking(index, purpose),
                                                           device=torch.device("cuda", index))
        return st
