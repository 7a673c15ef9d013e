"""CUDA streams of our own, outside PyTorch's stream pool.

``torch.cuda.Stream()`` hands out one of a pool of 32 streams per device and priority, round
robin, and ProcessGroupNCCL takes its communication streams from the same pool. Once the pool
wraps, a side stream (activation offload's copies, vocabulary parallelism's channels) can be the
very stream of a communicator, and its work queues behind a receive that waits for another
rank. :func:`dedicated_stream` creates a stream with the CUDA runtime instead, one per device
and purpose, kept for the life of the process.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["dedicated_stream"]

_STREAMS: dict = {}
_LOCK = threading.Lock()


def dedicated_stream(device: torch.device | int, purpose: str) -> "torch.cuda.Stream":
    """The stream of ``purpose`` on CUDA ``device``, created on first use (``cudaStreamCreate``)."""
    index = device if isinstance(device, int) else (device.index if device.index is not None
                                                   else torch.cuda.current_device())
    key = (index, purpose)
    with _LOCK:
        st = _STREAMS.get(key)
        if st is None:
            handle = torch.zeros(1, dtype=torch.int64)   # receives the cudaStream_t
            with torch.cuda.device(index):
                err = torch.cuda.cudart().cudaStreamCreate(handle.data_ptr())
            code = int(getattr(err, "value", err))
            if code != 0:
                raise RuntimeError(f"cudaStreamCreate failed on cuda:{index} for {purpose} (error {code})")
            st = _STREAMS[key] = torch.cuda.ExternalStream(int(handle.item()), device=torch.device("cuda", index))
        return st
