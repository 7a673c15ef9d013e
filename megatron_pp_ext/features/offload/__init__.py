"""PipeOffload: activation offload for any schedule, scheduled, overlapped and measured.

Schedule side (torch-free, imported here; importing this package registers the OFFLOAD and
RELOAD op kinds, the validator check and the policies):

* :mod:`.schedule_pass`: op kinds, :class:`TransferModel` (bandwidth model, shared host
  links), :func:`insert_offload`, :func:`simulate_offload` (stalls, device/host memory),
  the validator check;
* :mod:`.policies`: ``none``, ``full``, ``chunks:K``, ``selective:TARGET``, ``auto``;
  :func:`plan_offload`;
* :mod:`.flags`: the command-line flags shared by ``mppx train`` and the Megatron-LM
  integration, and :class:`OffloadConfig`.

Runtime side (torch, imported lazily): :class:`~.store.ActivationStore` (saved-tensor hooks,
pooled pinned host buffers, copy streams on GPU), :class:`~.runtime.OffloadRuntime` (drives the
store from the schedule executor's op hook and op handlers).
"""

from __future__ import annotations

from .flags import (OffloadConfig, add_offload_arguments, offload_config_from_args,  # noqa: F401
                    build_offload_schedule, OffloadScheduleFactory)
from .policies import (Candidate, OffloadPlan, OffloadPolicy, make_policy, measured_cost,  # noqa: F401
                       offload_candidates, plan_offload, policy_names, reference_offload_time, register_policy)
from .schedule_pass import (D2H, H2D, OFFLOAD, RELOAD, OffloadSimulation, TransferModel,  # noqa: F401
                            check_offload, has_offload, insert_offload, offload_pairs, simulate_offload,
                            strip_offload, transfer_params, with_transfer)

_LAZY = {
    "ActivationStore": ".store", "PinnedHostPool": ".store", "StoreStats": ".store",
    "OffloadRuntime": ".runtime", "measure_transfer_bandwidth": ".runtime",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        mod = importlib.import_module(_LAZY[name], __name__)
        return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
