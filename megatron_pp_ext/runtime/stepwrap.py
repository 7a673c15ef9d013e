"""One wrapper for feature runtimes that hook a whole forward-backward call.

Offload and BPipe each keep per-iteration state (host buffers, peer transfers) that must be
set up before the schedule runs and flushed after it; both expose a ``step(model)`` context
manager, and :func:`wrap_in_step` turns it into a forward-backward function with the same
keyword arguments as Megatron-Core's (``get_forward_backward_func()``), so the trainer and
the Megatron-LM integration can stack features without knowing them.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["wrap_in_step"]


def wrap_in_step(runtime: Any, forward_backward: Callable, prefix: str, *,
                 skip_forward_only: bool = False) -> Callable:
    """``forward_backward`` run inside ``runtime.step(model)``; the result is named
    ``prefix[inner name]`` and carries ``.runtime``. ``skip_forward_only``: evaluation calls
    (``forward_only=True``) run unwrapped (no backward, nothing to balance)."""
    def wrapped(**kwargs):
        if skip_forward_only and kwargs.get("forward_only"):
            return forward_backward(**kwargs)
        with runtime.step(kwargs.get("model")):
            return forward_backward(**kwargs)
    wrapped.__name__ = f"{prefix}[{getattr(forward_backward, '__name__', 'fb')}]"
    wrapped.runtime = runtime  # type: ignore[attr-defined]
    return wrapped
