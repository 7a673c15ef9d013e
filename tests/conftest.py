"""Suite-wide pytest hooks.

The version check runs once at session start (:func:`pytest_sessionstart`).

``MPPX_TEST_COVERING=1`` (what scripts/test_megatron_core_0.19.sh sets for the second venv): each
parametrised test runs a *covering* subset of its cases -- every value of every parameter at
least once (greedy: a case is kept when it brings a value not seen yet) -- instead of the whole
cross product. The first venv runs every case; the second one is there to catch what another
megatron-core release does differently, which shows on any case that takes the changed path, so
each schedule, layout, precision and feature row still runs there once. The cases left out are
reported by pytest as "deselected" in the summary line, never skipped silently.
"""

from __future__ import annotations

import os
from collections import defaultdict


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


def _key(value) -> str:
    try:
        hash(value)
        return repr(value)
    except TypeError:
        return repr(value)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MPPX_TEST_COVERING", "") in ("", "0"):
        return
    kept, dropped = covering_subset(items)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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
