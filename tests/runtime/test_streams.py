"""Our side streams are created non-blocking, outside PyTorch's pool (runtime/streams.py).

On CPU the CUDA driver is stood in for: what this shows is that ``cuStreamCreate`` is asked for
``CU_STREAM_NON_BLOCKING`` in the device's context, that the flag read back is checked, and that one
stream per device and purpose is kept. That such a stream really overlaps a kernel of the default
stream is measured only on a GPU (scripts/gpu_check.sh, docs/gpu.md).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from megatron_pp_ext.runtime import streams


class FakeDriver:
    def __init__(self, flags_back=None):
        self.created: list[int] = []
        self.flags_back = flags_back

    def cuStreamCreate(self, handle_ref, flags):
        self.created.append(flags.value)
        ctypes.cast(handle_ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1000 + len(self.created)
        return 0

    def cuStreamGetFlags(self, handle, flags_ref):
        value = self.created[-1] if self.flags_back is None else self.flags_back
        ctypes.cast(flags_ref, ctypes.POINTER(ctypes.c_uint))[0] = value
        return 0


@pytest.fixture
def fake_cuda(monkeypatch):
    class External:
        def __init__(self, handle, device):
            self.handle, self.device = handle, device
    monkeypatch.setattr(torch.cuda, "device", lambda index: __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: None)
    monkeypatch.setattr(torch.cuda, "ExternalStream", External)
    monkeypatch.setattr(streams, "_STREAMS", {})


def test_side_streams_are_requested_non_blocking_and_kept_per_purpose(monkeypatch, fake_cuda):
    drv = FakeDriver()
    monkeypatch.setattr(streams, "_driver", lambda: drv)
    a = streams.dedicated_stream(0, "offload-d2h")
    assert drv.created == [streams.CU_STREAM_NON_BLOCKING] and a.handle == 0x1001
    assert streams.dedicated_stream(0, "offload-d2h") is a and len(drv.created) == 1
    b = streams.dedicated_stream(1, "offload-d2h")
    assert b is not a and b.handle == 0x1002 and b.device == torch.device("cuda", 1)


def test_a_stream_that_comes_back_blocking_is_refused(monkeypatch, fake_cuda):
    monkeypatch.setattr(streams, "_driver", lambda: FakeDriver(flags_back=0))
    with pytest.raises(RuntimeError, match="the vocab-fwd stream on cuda:0 was created blocking"):
        streams.dedicated_stream(0, "vocab-fwd")
