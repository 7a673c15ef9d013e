"""Which of our schedules may run on Transformer Engine layers (torch-free: checked at start-up).

A split schedule (``ScheduleInfo.split_backward``: zero-bubble, V, DualPipeV) defers every linear
layer's weight gradient from B to W. For Megatron-Core's local layers our patch does that and the
parity suite checks it bit for bit. For TE layers it is TE's own ``delay_wgrad_compute`` /
``backward_dw()`` (TE >= 2.3, :mod:`.wgrad.te`), which needs a GPU and has not been verified on one
in this project. So a split schedule on TE layers is refused before anything starts, naming the
local layers and the opt-in to the unverified TE path; fused schedules (1F1B, interleaved 1F1B,
Megatron-Core's own) run on TE unchanged. One rule for Megatron-LM's flags and ``mppx train``.
"""

from __future__ import annotations

import importlib.util
import re

#: the Transformer Engine release that added ``delay_wgrad_compute`` / ``backward_dw()``
MIN_TE_VERSION = (2, 3)
TE = "transformer_engine"


def installed_te_version() -> tuple[int, ...] | None:
    """Transformer Engine's version as installed (without importing it: no CUDA needed), or None."""
    if importlib.util.find_spec(TE) is None:
        return None
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("transformer-engine", "transformer_engine", "transformer-engine-cu12", "transformer-engine-cu13"):
        try:
            text = version(dist)
        except PackageNotFoundError:
            continue
        parts = re.findall(r"\d+", text)[:3]
        return tuple(int(p) for p in parts) if parts else None
    return None


#: (flag that needs a newer TE with delay_wgrad_compute, the version it needs): Megatron-LM
#: core_v0.19's own rules for ``--delay-wgrad-compute``, which the opt-in bypasses
_NEEDS = {"--overlap-grad-reduce": (2, 8), "--no-gradient-accumulation-fusion": (2, 7)}


def splits_on_te(schedule: str | None, transformer_impl: str) -> bool:
    """Whether ``schedule`` splits B and W on ``transformer_impl`` layers that are TE's."""
    from ..schedule.registry import schedule_info
    return schedule is not None and transformer_impl == TE and schedule_info(schedule).split_backward


def te_split_refusal(schedule: str | None, *, transformer_impl: str, opted_in: bool, schedule_flag: str,
                     impl_flag: str, opt_in_flag: str, doc: str, flags: tuple[str, ...] = ()) -> str | None:
    """One line refusing ``schedule`` on ``transformer_impl`` layers, or None when it may run.

    ``schedule_flag``: how the user named the schedule (``--pipeline-schedule zbv``, an alias).
    ``opted_in``: the user asked for TE's own B/W split (``opt_in_flag``); then TE must be
    installed at ``MIN_TE_VERSION`` or later, and at the version Megatron-LM requires with each
    of ``flags`` (``--overlap-grad-reduce``, ``--no-gradient-accumulation-fusion``) given. The
    opt-in without a split schedule on TE layers is refused too (it would change nothing)."""
    from ..schedule.registry import schedule_info
    split = schedule is not None and schedule_info(schedule).split_backward
    if opted_in and not splits_on_te(schedule, transformer_impl):
        what = (f"{schedule_flag} does not split the backward" if schedule is not None and not split else
                "no megatron_pp_ext schedule is chosen" if schedule is None else
                f"the layers are not Transformer Engine's ({impl_flag} {transformer_impl})")
        return (f"{opt_in_flag} makes Transformer Engine's layers split their backward for a zero-bubble or V "
                f"schedule, but {what}: drop {opt_in_flag}")
    if not splits_on_te(schedule, transformer_impl):
        return None
    if not opted_in:
        return (f"{schedule_flag} splits every backward into B and W, which Transformer Engine's layers "
                f"({impl_flag} {TE}) do through TE's delay_wgrad_compute, not yet verified on a GPU: add {impl_flag} "
                f"local, use a schedule without the split (1f1b, interleaved-1f1b), or opt in with {opt_in_flag} "
                f"(Transformer Engine >= {'.'.join(map(str, MIN_TE_VERSION))}; {doc})")
    have = installed_te_version()
    need = ".".join(map(str, MIN_TE_VERSION))
    if have is None:
        return f"{opt_in_flag}: Transformer Engine is not installed (>= {need} is needed); add {impl_flag} local"
    if have[:2] < MIN_TE_VERSION:
        return (f"{opt_in_flag}: Transformer Engine {'.'.join(map(str, have))} cannot defer weight gradients "
                f"(delay_wgrad_compute needs >= {need}); upgrade it, or add {impl_flag} local")
    for flag in flags:
        least = _NEEDS.get(flag)
        if least is not None and have[:2] < least:
            return (f"{opt_in_flag} with {flag}: Transformer Engine {'.'.join(map(str, have))} defers weight "
                    f"gradients only without it (>= {'.'.join(map(str, least))} is needed); upgrade it, drop {flag}, "
                    f"or add {impl_flag} local")
    return None
