"""BPipe in the schedule executor on a tiny Megatron-Core GPT (gloo worker pool, world = pp).

For pp in {2, 4, 6}, 1f1b and interleaved-1f1b (both in one pool launch per pp): losses and
gradients are bit-identical with and without BPipe (evict/fetch only move tensors), and the
measured per-rank peak of device-resident activation bytes (the rank's own saved activations plus
what it holds for its partner) is within 10% of what the simulator predicts for that rank, with
and without BPipe, from the measured per-stage activation bytes.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.testing.bpipe import bpipe_parity_run

from _pools import RetryingPool

from runtime_helpers import GPU_PATH_ENV


@pytest.fixture(scope="module")
def pool6():
    p = RetryingPool(6, timeout=240, env={**GPU_PATH_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    yield p
    p.close()


def _configs(pp: int) -> list[dict]:
    # one layer per stage, default (balanced) thresholds; pp=2 1F1B has nothing to balance
    # (ceil(3/2) = 2 = rank 0's own peak)
    out = [dict(schedule="1f1b", microbatches=2 * pp, num_layers=pp, steps=2 if pp == 4 else 1),
           dict(schedule="interleaved-1f1b", chunks=2, microbatches=2 * pp, num_layers=2 * pp)]
    if pp == 4:  # the CUDA code path (non-blocking posts, lazy headers and waits), on gloo
        out.append(dict(schedule="1f1b", microbatches=2 * pp, num_layers=pp, synchronous=False))
    return out


@pytest.mark.parametrize("pp", [2, 4, 6])
def test_bpipe_exact_and_balanced_as_simulated(pool6, pp):
    reports = pool6.run(bpipe_parity_run, pp, pp=pp, configs=_configs(pp))
    problems = []
    for ci, cfg in enumerate(_configs(pp)):
        per_rank = sorted((rep[ci] for rep in reports), key=lambda r: r["pp_rank"])
        name = f"{cfg['schedule']} pp={pp}"
        evictions = sum(r["evictions_on_rank"] for r in per_rank)
        asynchronous = cfg.get("synchronous") is False
        if asynchronous:
            name += " (asynchronous)"
        for r in per_rank:
            where = f"{name} rank {r['pp_rank']}"
            if not (r["exact"] and r["hooks_exact"]):
                problems.append(f"{where}: losses/gradients differ (max grad diff {r['max_grad_diff']:.3g})")
            if r["evicted_bytes"] != r["fetched_bytes"]:
                problems.append(f"{where}: evicted {r['evicted_bytes']} B but fetched {r['fetched_bytes']} B")
            if asynchronous:   # frees and allocations follow the partner's timing: no byte prediction
                continue
            for got, pred, what in ((r["peak_bytes"], r["predicted_peak_bytes"], "with BPipe"),
                                    (r["peak_bytes_without"], r["predicted_peak_bytes_without"], "without")):
                if abs(got - pred) > 0.10 * pred:
                    problems.append(f"{where} {what}: measured peak {got} vs simulated {pred:.0f} (> 10%)")
        peak_with = max(r["peak_bytes"] for r in per_rank)
        peak_without = max(r["peak_bytes_without"] for r in per_rank)
        if cfg["schedule"] == "1f1b" and pp == 2:
            assert evictions == 0                       # nothing to balance
            continue
        assert evictions > 0, name
        held = {r["pp_rank"]: r["peak_partner_bytes"] for r in per_rank}
        evicting = {r["pp_rank"] for r in per_rank if r["evictions_on_rank"]}
        assert all(held[pp - 1 - x] > 0 for x in evicting), (name, held)   # the partner holds them
        if not asynchronous:
            assert peak_with < peak_without, (name, peak_with, peak_without)  # the busiest rank holds less
    assert not problems, "\n".join(problems)


def test_bpipe_bf16_distributed_optimizer_exact(pool6):
    """bf16 + distributed optimizer + both overlaps: evictions move bf16 activations only, so
    losses and gradients stay bit-identical to the run without BPipe."""
    opts = (("precision", "bf16"), ("distributed_optimizer", True), ("overlap_grad_reduce", True),
            ("overlap_param_gather", True))
    configs = [dict(schedule="1f1b", microbatches=8, num_layers=4, run_options=opts)]
    reports = pool6.run(bpipe_parity_run, 4, pp=4, configs=configs)
    per_rank = [rep[0] for rep in reports]
    assert all(r["exact"] and r["hooks_exact"] for r in per_rank), [r["max_grad_diff"] for r in per_rank]
    assert sum(r["evictions_on_rank"] for r in per_rank) > 0
    assert all(r["evicted_bytes"] == r["fetched_bytes"] for r in per_rank)
