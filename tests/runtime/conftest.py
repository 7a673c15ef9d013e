"""Fixtures of the runtime tests: one pool of forked gloo workers for the whole session.

Every multi-process test submits configurations to the same :class:`WorkerPool` (started the
first time a test asks for it, after collection, so the workers already hold every test
module); references (the pp=1 runs) are computed once per session and cached.
"""

from __future__ import annotations

import warnings

import pytest

from megatron_pp_ext.testing.parity import merge_results, run_training
from megatron_pp_ext.runtime.pool import WorkerPool

from _pools import RetryingPool

from runtime_helpers import GPU_PATH_ENV

# Megatron-Core warns at import time that Transformer Engine / apex are missing (expected on CPU).
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")


@pytest.fixture(scope="session")
def pool():
    # Every executor of these tests runs the GPU path's point-to-point (the NCCL strategy) under
    # NCCL's rules emulated on gloo (runtime/nccl_emulation.py): untagged, matched in issue order,
    # one stream per communicator. Tests of the tagged gloo path ask for it (p2p="tagged").
    p = RetryingPool(4, timeout=180, env=GPU_PATH_ENV)
    yield p
    p.close()


class Runs:
    """Run configurations on the pool; memoise the merged records (references are shared).
    ``worker``: the function each rank runs (default ``run_training``; a module-level wrapper of
    it, e.g. runtime_helpers.run_training_fused)."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self._cache: dict = {}

    def __call__(self, cfg, *, cache: bool = False, worker=run_training) -> dict:
        key = cfg if worker is run_training else (cfg, worker.__name__)
        if cache and key in self._cache:
            return self._cache[key]
        rec = merge_results(self.pool.run(worker, cfg.world_size, cfg=cfg), cfg)
        if cache:
            self._cache[key] = rec
        return rec

    def reference(self, cfg, *, worker=run_training) -> dict:
        """The pp=1 run of ``cfg`` (same model, data, tp, dp, loss and optimizer); cached."""
        ref = cfg.replace(pp=1, schedule=None, chunks=1, memory_budget=None, executor_options={},
                          record_timings=False)
        return self(ref, cache=True, worker=worker)


@pytest.fixture(scope="session")
def runs(pool):
    return Runs(pool)
