"""Ours against the published orders, at equal or less memory: what CI re-derives and what it does not.

* PyTorch's orders (``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``,
  ``ScheduleDualPipeV``) are generated here by torch's own code (a dependency) and timed by our
  simulator: in CI, a comparison with those published generators' orders.
* sail-sg's generators (zero-bubble-pipeline-parallelism, a Megatron-LM fork) are not here.
  ``SAIL_SG`` holds the makespan and peak memory of their orders as *our simulator* read them
  (``benchmarks/generators.py --zbpp PATH``, each chunk half of a rank's F/B/W), measured once by
  hand from a checkout at commit 39f2c186. ``test_never_behind_stored_sail_sg_figures`` checks our
  schedules against those stored numbers: a regression test of ours, not a comparison with the
  published generators. The tests that re-derive the numbers and check that our implementations
  of the reference procedures (``generators/slots.py``, ``vfill.py``, ``vreorg.py``) give their
  very orders are marked ``needs_zbpp``; they need a checkout named by ``MPPX_ZBPP``, which CI
  does not have (no network): in CI they are always skipped, and they are run by hand.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.schedule import CostModel, build_schedule, simulate
from megatron_pp_ext.schedule.export import from_torch_rows

ROOT = Path(__file__).resolve().parents[1]
EPS = 1e-6
PROFILES = {"balanced": (1, 1, 1, 0), "b-heavy": (1, 1.8, 0.4, 0), "w-heavy": (1, 1, 2, 0), "comm": (1, 2, 1, 0.1)}
FAMILY = {"sail-sg ZB-V": "zbv", "sail-sg V-Half": "v-half", "sail-sg V-Min": "v-min",
          "sail-sg auto V-Half": "v-half", "sail-sg auto V-Min": "v-min"}
ZBPP = os.environ.get("MPPX_ZBPP")
needs_zbpp = pytest.mark.skipif(not ZBPP, reason="set MPPX_ZBPP to a checkout of "
                                "sail-sg/zero-bubble-pipeline-parallelism to run its generators (CI has none: "
                                "run by hand)")

#: (generator, p, m, profile) -> (makespan, peak units) of the published order, from
#: ``python benchmarks/generators.py --zbpp PATH`` (sail-sg commit 39f2c186)
SAIL_SG = {
    # sail-sg V-Half
    ('sail-sg V-Half', 4, 6, 'b-heavy'): (28.2, 3),
    ('sail-sg V-Half', 4, 6, 'balanced'): (20.5, 3),
    ('sail-sg V-Half', 4, 6, 'comm'): (34.2, 3),
    ('sail-sg V-Half', 4, 6, 'w-heavy'): (27, 3),
    ('sail-sg V-Half', 4, 8, 'b-heavy'): (35.8, 3),
    ('sail-sg V-Half', 4, 8, 'balanced'): (26.5, 3),
    ('sail-sg V-Half', 4, 8, 'comm'): (43.6, 3),
    ('sail-sg V-Half', 4, 8, 'w-heavy'): (35, 3),
    ('sail-sg V-Half', 4, 10, 'b-heavy'): (43.4, 3),
    ('sail-sg V-Half', 4, 10, 'balanced'): (32.5, 3),
    ('sail-sg V-Half', 4, 10, 'comm'): (53, 3),
    ('sail-sg V-Half', 4, 10, 'w-heavy'): (43, 3),
    ('sail-sg V-Half', 8, 12, 'b-heavy'): (61.8, 5),
    ('sail-sg V-Half', 8, 12, 'balanced'): (44.5, 5),
    ('sail-sg V-Half', 8, 12, 'comm'): (75.4, 5),
    ('sail-sg V-Half', 8, 12, 'w-heavy'): (56, 5),
    ('sail-sg V-Half', 8, 16, 'b-heavy'): (77, 5),
    ('sail-sg V-Half', 8, 16, 'balanced'): (56.5, 5),
    ('sail-sg V-Half', 8, 16, 'comm'): (94.2, 5),
    ('sail-sg V-Half', 8, 16, 'w-heavy'): (72, 5),
    # sail-sg V-Min
    ('sail-sg V-Min', 4, 6, 'b-heavy'): (38.4, 2),
    ('sail-sg V-Min', 4, 6, 'balanced'): (23.5, 2),
    ('sail-sg V-Min', 4, 6, 'comm'): (45.7, 2),
    ('sail-sg V-Min', 4, 6, 'w-heavy'): (28.5, 2),
    ('sail-sg V-Min', 4, 8, 'b-heavy'): (49.2, 2),
    ('sail-sg V-Min', 4, 8, 'balanced'): (29.5, 2),
    ('sail-sg V-Min', 4, 8, 'comm'): (58.5, 2),
    ('sail-sg V-Min', 4, 8, 'w-heavy'): (36.5, 2),
    ('sail-sg V-Min', 4, 10, 'b-heavy'): (60, 2),
    ('sail-sg V-Min', 4, 10, 'balanced'): (35.5, 2),
    ('sail-sg V-Min', 4, 10, 'comm'): (71.3, 2),
    ('sail-sg V-Min', 4, 10, 'w-heavy'): (44.5, 2),
    ('sail-sg V-Min', 8, 12, 'b-heavy'): (80.9, 4),
    ('sail-sg V-Min', 8, 12, 'balanced'): (49.5, 4),
    ('sail-sg V-Min', 8, 12, 'comm'): (97.7, 4),
    ('sail-sg V-Min', 8, 12, 'w-heavy'): (59.5, 4),
    ('sail-sg V-Min', 8, 16, 'b-heavy'): (102.5, 4),
    ('sail-sg V-Min', 8, 16, 'balanced'): (61.5, 4),
    ('sail-sg V-Min', 8, 16, 'comm'): (123.7, 4),
    ('sail-sg V-Min', 8, 16, 'w-heavy'): (75.5, 4),
    # sail-sg ZB-V
    ('sail-sg ZB-V', 4, 6, 'b-heavy'): (23.2, 4),
    ('sail-sg ZB-V', 4, 6, 'balanced'): (19.5, 4),
    ('sail-sg ZB-V', 4, 6, 'comm'): (28.3, 4),
    ('sail-sg ZB-V', 4, 6, 'w-heavy'): (25.5, 4),
    ('sail-sg ZB-V', 4, 8, 'b-heavy'): (29.6, 4),
    ('sail-sg ZB-V', 4, 8, 'balanced'): (25.5, 4),
    ('sail-sg ZB-V', 4, 8, 'comm'): (36.3, 4),
    ('sail-sg ZB-V', 4, 8, 'w-heavy'): (33.5, 4),
    ('sail-sg ZB-V', 4, 10, 'b-heavy'): (36, 4),
    ('sail-sg ZB-V', 4, 10, 'balanced'): (31.5, 4),
    ('sail-sg ZB-V', 4, 10, 'comm'): (44.3, 4),
    ('sail-sg ZB-V', 4, 10, 'w-heavy'): (41.5, 4),
    ('sail-sg ZB-V', 8, 12, 'b-heavy'): (48, 8),
    ('sail-sg ZB-V', 8, 12, 'balanced'): (39.5, 8),
    ('sail-sg ZB-V', 8, 12, 'comm'): (58.5, 8),
    ('sail-sg ZB-V', 8, 12, 'w-heavy'): (52, 8),
    ('sail-sg ZB-V', 8, 16, 'b-heavy'): (60.8, 8),
    ('sail-sg ZB-V', 8, 16, 'balanced'): (51.5, 8),
    ('sail-sg ZB-V', 8, 16, 'comm'): (74.5, 8),
    ('sail-sg ZB-V', 8, 16, 'w-heavy'): (67.5, 8),
    # sail-sg auto V-Half
    ('sail-sg auto V-Half', 4, 6, 'b-heavy'): (27, 3),
    ('sail-sg auto V-Half', 4, 6, 'balanced'): (20.5, 3),
    ('sail-sg auto V-Half', 4, 6, 'comm'): (33, 3),
    ('sail-sg auto V-Half', 4, 6, 'w-heavy'): (26.5, 3),
    ('sail-sg auto V-Half', 4, 8, 'b-heavy'): (34.6, 3),
    ('sail-sg auto V-Half', 4, 8, 'balanced'): (26.5, 3),
    ('sail-sg auto V-Half', 4, 8, 'comm'): (41.6, 3),
    ('sail-sg auto V-Half', 4, 8, 'w-heavy'): (34.5, 3),
    ('sail-sg auto V-Half', 4, 10, 'b-heavy'): (42.2, 3),
    ('sail-sg auto V-Half', 4, 10, 'balanced'): (32.5, 3),
    ('sail-sg auto V-Half', 4, 10, 'comm'): (50, 3),
    ('sail-sg auto V-Half', 4, 10, 'w-heavy'): (42.5, 3),
    ('sail-sg auto V-Half', 8, 12, 'b-heavy'): (61.4, 5),
    ('sail-sg auto V-Half', 8, 12, 'balanced'): (44.5, 5),
    ('sail-sg auto V-Half', 8, 12, 'comm'): (75.4, 5),
    ('sail-sg auto V-Half', 8, 12, 'w-heavy'): (56, 5),
    ('sail-sg auto V-Half', 8, 16, 'b-heavy'): (76.6, 5),
    ('sail-sg auto V-Half', 8, 16, 'balanced'): (56.5, 5),
    ('sail-sg auto V-Half', 8, 16, 'comm'): (94.2, 5),
    ('sail-sg auto V-Half', 8, 16, 'w-heavy'): (72, 5),
    # sail-sg auto V-Min
    ('sail-sg auto V-Min', 4, 6, 'b-heavy'): (35.2, 2),
    ('sail-sg auto V-Min', 4, 6, 'balanced'): (23.5, 2),
    ('sail-sg auto V-Min', 4, 6, 'comm'): (42.3, 2),
    ('sail-sg auto V-Min', 4, 6, 'w-heavy'): (29.5, 2),
    ('sail-sg auto V-Min', 4, 8, 'b-heavy'): (46, 2),
    ('sail-sg auto V-Min', 4, 8, 'balanced'): (29.5, 2),
    ('sail-sg auto V-Min', 4, 8, 'comm'): (55.1, 2),
    ('sail-sg auto V-Min', 4, 8, 'w-heavy'): (37.5, 2),
    ('sail-sg auto V-Min', 4, 10, 'b-heavy'): (56.8, 2),
    ('sail-sg auto V-Min', 4, 10, 'balanced'): (35.5, 2),
    ('sail-sg auto V-Min', 4, 10, 'comm'): (67.9, 2),
    ('sail-sg auto V-Min', 4, 10, 'w-heavy'): (45.5, 2),
    ('sail-sg auto V-Min', 8, 12, 'b-heavy'): (72, 4),
    ('sail-sg auto V-Min', 8, 12, 'balanced'): (47.5, 4),
    ('sail-sg auto V-Min', 8, 12, 'comm'): (87.1, 4),
    ('sail-sg auto V-Min', 8, 12, 'w-heavy'): (59, 4),
    ('sail-sg auto V-Min', 8, 16, 'b-heavy'): (93.6, 4),
    ('sail-sg auto V-Min', 8, 16, 'balanced'): (59.5, 4),
    ('sail-sg auto V-Min', 8, 16, 'comm'): (112.7, 4),
    ('sail-sg auto V-Min', 8, 16, 'w-heavy'): (75, 4),
}


def _ours(name: str, p: int, m: int, costs) -> tuple[float, float]:
    sched, cost = build_schedule(name, p, m, costs=costs)
    res = simulate(sched, cost)
    return res.makespan, res.max_peak_memory


@pytest.fixture(scope="module")
def ours_cache():
    return {}


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("p,m", sorted({(k[1], k[2]) for k in SAIL_SG}))
def test_never_behind_stored_sail_sg_figures(p, m, profile, ours_cache):
    """Ours against the stored figures of sail-sg's orders (see the module docstring: our
    simulator's reading, measured by hand; the generators do not run here)."""
    for (src, pp, mm, pk), (theirs, peak) in SAIL_SG.items():
        if (pp, mm, pk) != (p, m, profile):
            continue
        key = (FAMILY[src], p, m, profile)
        if key not in ours_cache:
            ours_cache[key] = _ours(FAMILY[src], p, m, PROFILES[profile])
        ms, pk_ours = ours_cache[key]
        assert pk_ours <= peak + EPS, (src, pk_ours, peak)
        assert ms <= theirs + EPS, (src, ms, theirs)


def test_v_half_matches_the_reference_at_the_issues_example():
    # sail-sg's V-Half gave 26.5 at p=4, m=8, F=B=W; ours gave 27.0 before its
    # reordered block (generators/slots.py) became a candidate
    assert _ours("v-half", 4, 8, (1, 1, 1, 0)) == (26.5, 3.0)


def _torch(name: str, p: int, m: int):
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    return from_torch_rows(get_schedule_ops(name, p, m, num_stages_per_rank=2))


@pytest.mark.parametrize("profile", list(PROFILES))
@pytest.mark.parametrize("p,m", [(4, 6), (4, 8), (4, 10), (8, 12), (8, 16), (8, 20)])
def test_never_behind_torch_at_no_more_memory(p, m, profile):
    """PyTorch's published orders, generated here by torch's own code, timed by our simulator."""
    costs = PROFILES[profile]
    cost = CostModel.from_spec(list(costs), 2 * p, 2)
    pairs = [("ZBVZeroBubble", "zbv"), ("InterleavedZeroBubble", "interleaved-zb")]
    if m >= 2 * p:
        pairs.append(("DualPipeV", "dualpipev"))
    for theirs_name, ours_name in pairs:
        theirs = simulate(_torch(theirs_name, p, m), cost)
        sched, c = build_schedule(ours_name, p, m, chunks=2, costs=costs)
        ours = simulate(sched, c)
        assert ours.max_peak_memory <= theirs.max_peak_memory + EPS, theirs_name
        if theirs_name == "InterleavedZeroBubble" and m % p:
            # torch's rounds of m // (m // p) > p microbatches hold more than 1F1B's p units; at
            # p units ours is the claim, not their faster order at more memory
            assert theirs.max_peak_memory > p
            continue
        assert ours.makespan <= theirs.makespan + EPS, theirs_name


# --- with a checkout of the reference (MPPX_ZBPP): never in CI, run by hand ---------------------

@pytest.fixture(scope="module")
def zbpp():
    sys.path.insert(0, str(ROOT))
    from benchmarks import generators as published
    return published, published.load_zbpp(ZBPP)


@needs_zbpp
@pytest.mark.parametrize("profile", list(PROFILES))
def test_golden_figures_are_the_reference_s(zbpp, profile):
    published, mods = zbpp
    pr = published.PROFILE[profile]
    for (src, p, m, pk), (ms, peak) in SAIL_SG.items():
        if pk != profile:
            continue
        res = simulate(published.published_order(mods, src, p, m, pr), CostModel.from_spec(list(pr.costs), 2 * p, 2))
        assert (round(res.makespan, 6), res.max_peak_memory) == (ms, peak), (src, p, m)


@needs_zbpp
@pytest.mark.parametrize("kind,setup", [("v-half", "half"), ("v-min", "min")])
def test_phased_block_is_the_reference_v_half_and_v_min(zbpp, kind, setup):
    from megatron_pp_ext.schedule.generators.patterns import v_block_offsets
    from megatron_pp_ext.schedule.generators.slots import phased_v_pattern
    published, mods = zbpp
    for p in (1, 2, 3, 4, 5, 6, 8):
        for m in sorted({1, 2, p, p + 1, 2 * p, 3 * p + 1}):
            theirs = published.sail_greedy(mods, p, m, published.PROFILE["balanced"], setup)
            assert phased_v_pattern(v_block_offsets(kind, p), p, m, kind).ops == theirs.ops, (p, m)


@needs_zbpp
@pytest.mark.parametrize("profile", list(PROFILES))
def test_v_fill_holds_the_reference_zbv(zbpp, profile):
    from megatron_pp_ext.schedule.generators.vfill import v_fill_schedules
    published, mods = zbpp
    pr = published.PROFILE[profile]
    for p in (2, 3, 4, 5, 8):
        for m in sorted({p, 2 * p - 1, 2 * p, 3 * p + 1}):
            theirs = published.sail_zbv(mods, p, m, pr)
            mine = v_fill_schedules("zbv", p, m, CostModel.from_spec(list(pr.costs), 2 * p, 2), float(p))
            assert any(s.ops == theirs.ops for s in mine), (p, m)


@needs_zbpp
@pytest.mark.parametrize("p,m", [(3, 4), (4, 8), (4, 13), (5, 7)])
def test_reorganised_blocks_are_the_reference_s(zbpp, p, m):
    import contextlib
    import io
    from megatron_pp_ext.schedule.generators.vreorg import offset_blocks, reorganized_v_order
    published, mods = zbpp
    va = mods["v_auto_schedule"]
    checked = 0
    for cap in sorted({2 * ((p + 4) // 3), 2 * ((p + 2) // 2), 2 * p}):
        for blk in offset_blocks(p)[::7]:
            with contextlib.redirect_stdout(io.StringIO()):
                rows, _, _ = va.schedule_by_building_block(p, m, [list(r) for r in blk], min(2 * p, cap))
            mine = reorganized_v_order(blk, p, m, cap)
            if rows is None:
                continue
            theirs = [[(n.type, r if n.chunk == 0 else 2 * p - 1 - r, n.minibatch)
                       for n in row] for r, row in enumerate(va.transform_schedule(rows, 1, 1, 1, 0))]
            assert mine is not None
            assert [[(o.kind, o.stage, o.microbatch) for o in row] for row in mine.ops] == theirs, blk
            checked += 1
    assert checked
