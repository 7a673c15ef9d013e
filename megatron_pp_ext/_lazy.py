"""Lazy package exports: public names that live in submodules, imported on first use.

``import megatron_pp_ext.runtime`` (or ``.trainer``) then costs nothing until a name is used,
so the torch-free schedule core and the CLI's help stay fast.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package``: ``exports`` maps each public name to the
    submodule (relative to the package) that defines it.

    Example, in a package's ``__init__.py``::

        __getattr__, __all__ = lazy_exports(__name__, {"WorkerPool": "pool"})
    """
    def __getattr__(name: str) -> Any:
        if name in exports:
            return getattr(importlib.import_module(f".{exports[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__, sorted(exports)
