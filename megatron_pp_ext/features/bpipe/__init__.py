"""BPipe: memory-balanced pipeline parallelism (REFERENCE §7), scheduled, proven and measured.

Rank x < p/2 evicts the activations of in-flight microbatches to its partner p-1-x right after
their forward and fetches them back before their backward, so every rank holds about
ceil((p+1)/2) microbatches under 1F1B instead of up to p. See docs/bpipe.md.

Schedule side (torch-free, imported here; importing this package registers the SEND_EVICT,
RECV_EVICT, SEND_FETCH and RECV_FETCH op kinds, their comm pairs on the ``bpipe`` channel, the
backward's wait for its fetch and the validator check):

* :mod:`.schedule_pass`: op kinds, :class:`BPipeTransfer` (partner-link model),
  :func:`insert_bpipe`, :func:`bpipe_summary`, :func:`check_bpipe`;
* :mod:`.flags`: ``--bpipe``, ``--bpipe-threshold``, ``--bpipe-transfer-time`` (shared by ``mppx
  train`` and the Megatron-LM integration), :class:`BPipeConfig`, :func:`build_bpipe_schedule`,
  :class:`BPipeScheduleFactory`.

Runtime side (torch, imported lazily): :class:`~.store.PartnerStore` (the offload package's
saved-tensor store, with groups that leave for the partner and come back),
:class:`~.runtime.BPipeRuntime` (drives it from the schedule executor's op hook and handlers,
over its own process groups).
"""

from __future__ import annotations

from .flags import (DEFAULT_TRANSFER_TIME, BPipeConfig, BPipeFlagError, BPipeScheduleFactory,  # noqa: F401
                    add_bpipe_arguments, bpipe_config_from_args, build_bpipe_schedule, check_bpipe_combination)
from .schedule_pass import (BPIPE_KINDS, CHANNEL, RECV_EVICT, RECV_FETCH, SEND_EVICT, SEND_FETCH,  # noqa: F401
                            BPipeError, BPipeSummary, BPipeTransfer, bpipe_params, bpipe_summary, check_bpipe,
                            check_bpipe_schedule, default_threshold, evicted_pairs, has_bpipe, insert_bpipe,
                            partner, strip_bpipe, with_bpipe_transfer)

_LAZY = {"PartnerStore": ".store", "BPipeRuntime": ".runtime", "BPipeGroups": ".runtime"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        mod = importlib.import_module(_LAZY[name], __name__)
        return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
