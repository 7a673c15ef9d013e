"""Suite-wide pytest hooks.

The version check runs once at session start (:func:`pytest_sessionstart`).

The parity matrices marked ``@pytest.mark.pairwise`` (schedule x layout x model variant x
feature row, run against pp=1) run their *pairwise* subset by default: every pair of values of two
of their parameters at least once (every schedule on every layout and with every row, each with
both model variants somewhere), not every triple; ``MPPX_TEST_COVERING=full`` runs the whole cross
product (by hand). Why: CI's time budget; the subset keeps 160 of the 280 cases of those four
matrices, and the cases it leaves out test only interactions of three parameters or more
(docs/tests.md#the-pairwise-matrices).

``MPPX_TEST_COVERING=1`` (what scripts/test_megatron_core_0.19.sh sets for the second venv): each
parametrised test runs a *covering* subset of its cases -- every value of every parameter at
least once (greedy: a case is kept when it brings a value not seen yet) -- instead of the whole
cross product. The first venv runs every case; the second one is there to catch what another
megatron-core release does differently, which shows on any case that takes the changed path, so
each schedule, layout, precision and feature row still runs there once. The cases left out are
reported by pytest as "deselected" in the summary line (under pytest-xdist, in a line of their
own at the end), never skipped silently.
"""

from __future__ import annotations

import os
from collections import defaultdict

import pytest


def covering_subset(items: list) -> tuple[list, list]:
    """(kept, left out): per test function, the parametrised cases that together take every
    value of every parameter at least once, in collection order."""
    kept, dropped = [], []
    seen: dict = defaultdict(set)
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None:
            kept.append(item)
            continue
        fn = item.nodeid.split("[", 1)[0]
        new = [(fn, k, _key(v)) for k, v in spec.params.items() if _key(v) not in seen[(fn, k)]]
        if new or not spec.params:
            for fn_, k, v in new:
                seen[(fn_, k)].add(v)
            kept.append(item)
        else:
            dropped.append(item)
    return kept, dropped


def pairwise_subset(items: list) -> tuple[list, list]:
    """(kept, left out): per test function, parametrised cases that together take every *pair* of
    values of two parameters that the full list takes (greedy, as AETG: repeatedly the case that
    brings the most pairs not seen yet; ties in collection order), kept in collection order."""
    groups: dict = defaultdict(list)
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and len(spec.params) > 1:
            groups[item.nodeid.split("[", 1)[0]].append(item)
    keep = set(id(i) for i in items)
    for cases in groups.values():
        pairs_of = {}
        for item in cases:
            vals = sorted((k, _key(v)) for k, v in item.callspec.params.items())
            pairs_of[id(item)] = {(a, b) for n, a in enumerate(vals) for b in vals[n + 1:]}
        todo = set().union(*pairs_of.values())
        chosen = set()
        while todo:
            best = max(cases, key=lambda it: (len(pairs_of[id(it)] & todo), -cases.index(it)))
            chosen.add(id(best))
            todo -= pairs_of[id(best)]
        keep -= {id(it) for it in cases if id(it) not in chosen}
    return [i for i in items if id(i) in keep], [i for i in items if id(i) not in keep]


def _key(value) -> str:
    try:
        hash(value)
        return repr(value)
    except TypeError:
        return repr(value)


def pytest_collection_modifyitems(config, items):
    mode = os.environ.get("MPPX_TEST_COVERING", "").strip()
    if mode == "full":
        return
    if mode in ("", "0"):   # the default: the matrices marked ``pairwise`` run their pairwise subset
        marked = [i for i in items if i.get_closest_marker("pairwise") is not None]
        kept, dropped = pairwise_subset(marked)
    else:
        kept, dropped = covering_subset(items)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(map(id, dropped))
        items[:] = [i for i in items if id(i) not in gone]
    if hasattr(config, "workeroutput"):   # a pytest-xdist worker: tell the controller (below)
        config.workeroutput["mppx_deselected"] = len(dropped)


# Under pytest-xdist (-n N) the workers collect and deselect; the controller's summary line has no
# "deselected" then, so the count the workers report is printed at the end of the run.
_WORKER_DESELECTED: list = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    n = getattr(node, "workeroutput", {}).get("mppx_deselected")
    if n is not None:
        _WORKER_DESELECTED.append(n)


def pytest_terminal_summary(terminalreporter):
    if _WORKER_DESELECTED:   # (every worker collects every test: the same count)
        mode = os.environ.get("MPPX_TEST_COVERING", "").strip() or "pairwise"
        terminalreporter.write_line(f"{max(_WORKER_DESELECTED)} deselected by the workers ({mode} subsets: "
                                    "docs/tests.md#the-pairwise-matrices)")


def pytest_sessionstart(session):
    """The version check once, before any test: on a development build (Megatron-LM main) it prints
    its one note line here, not into the captured stderr of whichever test first starts ``mppx
    train`` (whose one-line-error assertions would see two lines); an unsupported release is left
    to the tests that check the refusal."""
    from megatron_pp_ext import compat
    try:
        compat.check_supported()
    except compat.UnsupportedMegatronError:
        pass
