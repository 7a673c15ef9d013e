"""Shared by the feature flag modules and the Megatron-LM integration (torch-free): add flags to
a parser that may already define some of them (Megatron-LM's own parser, or a second call)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

__all__ = ["has_flag", "argument_adder"]


def has_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    """Whether ``parser`` already defines option ``flag``."""
    return flag in getattr(parser, "_option_string_actions", {})


def argument_adder(parser: argparse.ArgumentParser, group: Any) -> Callable[..., None]:
    """``add(flag, **kw)`` that adds ``flag`` to ``group`` unless ``parser`` already has it
    (a host parser's own definition wins)."""
    def add(flag: str, **kw: Any) -> None:
        if not has_flag(parser, flag):
            group.add_argument(flag, **kw)
    return add
