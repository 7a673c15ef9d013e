"""The scoped, reversible switch of the B/W split: :func:`split_weight_grads` patches Megatron-Core's
linear layers (:mod:`.linear`) and hooks Transformer Engine modules (:mod:`.te`) for one context,
and restores both on exit, normal or not.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence, Union

import torch

from . import linear
from .store import WeightGradStore
from .te import _TEState, find_te_wgrad_modules, te_available

# ------------------------------------------------------------------------------------------
# The context manager
# ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def split_weight_grads(store: WeightGradStore,
                       models: Union[None, torch.nn.Module, Sequence[torch.nn.Module]] = None,
                       *, sp_gather: str = "w", te: Union[str, bool] = "auto"
                       ) -> Iterator[WeightGradStore]:
    """Split the backward of linear layers into B (now) and W (queued in ``store``).

    Args:
        store: where W work is queued (see :class:`WeightGradStore` for the protocol).
        models: the model chunks this split applies to (a module or a list). None: every
            Megatron-Core ColumnParallelLinear / RowParallelLinear in the process (TE modules
            are then not handled). Given: only the local linear layers inside them, and the
            TE modules inside them are switched to TE's ``backward_dw`` path.
        sp_gather: ``"w"`` (re-gather the sequence-parallel input at W; keeps 1/tp of it) or
            ``"b"`` (gather in B, keep the gathered input until W; no collective in W).
        te: ``"auto"`` (handle TE modules when Transformer Engine is importable and ``models``
            is given), True (always scan ``models`` for TE modules), False (never: TE modules
            then compute their weight gradients in B as configured).

    The patch is process-wide but scoped: on exit (normal or exception) the layer classes
    and TE modules are restored; W work still queued stays in ``store`` (run it, or it will be
    reported by :func:`check_no_pending_wgrad`). Not re-entrant.
    """
    if sp_gather not in ("w", "b"):
        raise ValueError(f"sp_gather must be 'w' or 'b', not {sp_gather!r}")
    if te not in ("auto", True, False):
        raise ValueError(f"te must be 'auto', True or False, not {te!r}")
    if isinstance(models, torch.nn.Module):
        models = [models]
    local_mods, names = None, {}
    if models is not None:
        models = list(models)
        local_mods, names = linear.local_linear_modules(models)
    if te is True and models is None:
        raise ValueError("te=True needs the model chunks (models=...) to find the TE modules")
    use_te = (te is True) or (te == "auto" and models is not None and te_available())
    te_state = None
    if use_te and models is not None:
        te_state = _TEState(store, find_te_wgrad_modules(models))
    try:
        state = linear.install_split(store, local_mods, names, sp_gather)
    except BaseException:
        if te_state is not None:
            te_state.close()
        raise
    try:
        yield store
    finally:
        linear.uninstall_split(state)
        if te_state is not None:
            te_state.close()
