"""wrap_in_step: the forward-backward wrapper shared by the offload and BPipe runtimes."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from megatron_pp_ext.runtime.stepwrap import wrap_in_step


class _Runtime:
    def __init__(self) -> None:
        self.events: list = []

    @contextmanager
    def step(self, model):
        self.events.append(("enter", model))
        try:
            yield
        finally:
            self.events.append(("exit", model))


def forward_backward_func(**kwargs):
    return kwargs["forward_only"], kwargs["model"]


def test_runs_inside_step_and_passes_keywords_through():
    rt = _Runtime()
    fb = wrap_in_step(rt, forward_backward_func, "offload")
    assert fb(model="m", forward_only=False) == (False, "m")
    assert rt.events == [("enter", "m"), ("exit", "m")]
    assert fb.__name__ == "offload[forward_backward_func]" and fb.runtime is rt


def test_forward_only_calls_skip_the_step_when_asked():
    rt = _Runtime()
    fb = wrap_in_step(rt, forward_backward_func, "bpipe", skip_forward_only=True)
    assert fb(model="m", forward_only=True) == (True, "m")
    assert rt.events == []
    fb(model="m", forward_only=False)
    assert rt.events == [("enter", "m"), ("exit", "m")]
    plain = wrap_in_step(rt, forward_backward_func, "offload")
    plain(model="e", forward_only=True)
    assert rt.events[-2:] == [("enter", "e"), ("exit", "e")]


def test_step_exits_when_the_call_raises():
    rt = _Runtime()

    def boom(**kwargs):
        raise RuntimeError("x")

    fb = wrap_in_step(rt, boom, "offload")
    with pytest.raises(RuntimeError):
        fb(model="m", forward_only=False)
    assert rt.events == [("enter", "m"), ("exit", "m")]
