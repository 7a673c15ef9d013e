"""What every layer that talks to a user needs from the command line, below all of them: the
one-line error type (exit status 2), argparse number types and plain text tables. The CLI
(:mod:`megatron_pp_ext.cli.core`) re-exports them; features and the trainer import them from
here, so that no lower layer imports the command line."""

from __future__ import annotations

import argparse
import math
from typing import Sequence

__all__ = ["CLIError", "int_at_least", "format_table", "a2a_time", "add_overlap_arguments", "name_list"]


class CLIError(Exception):
    """Bad user input; the message names the flag and the fix. Exit status 2."""


def int_at_least(lo: int, example: int):
    """An argparse type: a whole number >= ``lo`` (``example`` goes into the message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give e.g. {example}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} is too small: need a whole number >= {lo}, e.g. {example}")
        return value
    parse.__name__ = "integer"
    return parse


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """Plain aligned text. ``align``: one 'l' or 'r' per column (default: first left, rest right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))
    out = []
    for k, r in enumerate(cells):
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)]
        out.append("  ".join(parts).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def a2a_time(text: str) -> float:
    """An argparse type: ``--a2a-time``, a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give e.g. 0.3") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: need a finite number >= 0, e.g. 0.3")
    return value


def add_overlap_arguments(parser, *, train: bool = False) -> None:
    """``--overlap-moe-expert-parallel-comm`` and ``--a2a-time`` on ``parser`` (or an argument group):
    the schedule commands and ``mppx train`` take them with the same meaning; a training run
    (``train``) measures the time when it is not given."""
    needs = ("without --a2a-time the profiling window measures the all-to-all and pairs from it; before "
             "that, or without a window, the schedule's published pairs (dualpipev's) or none" if train else
             "needs --a2a-time")
    parser.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                        help="run forwards and backwards of other microbatches as overlapped pairs where that "
                             f"pays, the expert all-to-all of each hidden behind the other's compute (MoE "
                             f"models; {needs})")
    parser.add_argument("--a2a-time", type=a2a_time, default=None, metavar="T",
                        help="expert all-to-all time (dispatch and combine) of one microbatch's forward on a "
                             "rank, part of F (its backward's, the same, part of B), in the units of --costs"
                             + ("; an override of the measured time (no profiling window then)" if train else ""))


def name_list(text: str | None, flag: str, known: Sequence[str], kind: str, *,
              none_ok: bool = False) -> tuple[str, ...] | None:
    """A comma-separated list of names given to ``flag`` (None when the flag was not given): every
    name known, none twice, at least one ("" and "," name nothing: omit the flag for all of them).
    ``kind``: what a name is (schedule, feature). ``none_ok``: ``none`` alone means the empty list
    (``--features none``), never beside a name."""
    if text is None:
        return None
    names = [x.strip() for x in text.split(",")]
    if not any(names):
        raise CLIError(f"{flag} {text!r}: no name given; omit {flag} for all of them"
                       + (", or give none for none" if none_ok else "") + f" ({', '.join(known)})")
    names = [n for n in names if n]
    if none_ok and "none" in names:
        if len(names) > 1:
            raise CLIError(f"{flag} {text}: none means no {kind} at all; "
                           "give it alone or drop it")
        return ()
    for n in names:
        if n not in known:
            raise CLIError(f"unknown {kind} {n!r} ({flag}); available: {', '.join(known)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise CLIError(f"{flag} {text}: {', '.join(twice)} given twice; name each once")
    return tuple(names)
