"""Extension points of the upper layers that features fill, and the discovery of the features.

A feature package (``megatron_pp_ext/features/<name>/``) never gets named by the layers below or
above it: the trainer asks its feature registry (:mod:`megatron_pp_ext.trainer.features`), the
schedule core its op-kind, pass and check registries, and the command line the registries here.
:func:`import_feature_modules` imports, by name at run time, the module of a given role
(``train``, ``cli``) of every feature package there is, which registers what it offers.

``mppx compare`` views (:func:`register_compare_view`): a feature adds flags to ``mppx compare``
and, when one of them is given, runs instead of the schedule table (vocabulary parallelism's
``--vocab-layouts``).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["import_feature_modules", "CompareView", "register_compare_view", "compare_views"]

FEATURES_PACKAGE = "megatron_pp_ext.features"
_IMPORTED: set = set()


def import_feature_modules(role: str) -> list[str]:
    """Import ``megatron_pp_ext.features.<name>.<role>`` of every feature package that has one
    (once); returns the module names imported."""
    out = []
    pkg = importlib.import_module(FEATURES_PACKAGE)
    for mod in pkgutil.iter_modules(pkg.__path__):
        if not mod.ispkg:
            continue
        name = f"{FEATURES_PACKAGE}.{mod.name}.{role}"
        if name in _IMPORTED:
            out.append(name)
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            continue
        _IMPORTED.add(name)
        out.append(name)
    return out


@dataclass(frozen=True)
class CompareView:
    """A feature's view of ``mppx compare``: ``add_arguments(parser)``; ``active(args)``: one of
    its flags was given; ``run(args) -> exit status``."""

    name: str
    add_arguments: Callable[[Any], None]
    active: Callable[[Any], bool]
    run: Callable[[Any], int]


_COMPARE_VIEWS: dict[str, CompareView] = {}


def register_compare_view(view: CompareView) -> CompareView:
    _COMPARE_VIEWS[view.name] = view
    return view


def compare_views() -> list[CompareView]:
    """Every registered view (the features' ``cli`` modules imported first)."""
    import_feature_modules("cli")
    return list(_COMPARE_VIEWS.values())
