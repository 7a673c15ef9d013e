"""Megatron-LM's per-layer pattern expressions (``--moe-layer-freq '([1]*3+[0])*2'``), evaluated
without ``eval`` and within bounds.

Megatron-LM ``eval``s the text. Here a small parser reads integers, lists, parentheses, ``+`` and
``*`` only: a chain of terms is read in a loop, so a pattern of thousands of terms such as
``[1]+[0]+...`` works (Python's own parser gives up on it: too deep a syntax tree), and sizes are
checked before anything is built, so ``[1]*99999999999`` is refused at once instead of filling
the memory. Used by ``mppx train`` and ``mppx plan``.

Megatron-Core's ``--pipeline-model-parallel-layout`` strings (``E`` the embedding, ``t`` a
transformer layer, ``L`` the loss, ``|`` between stages, ``x*n`` and ``(...)*n`` repeats, commas
cosmetic) are written by :func:`layout_string` and read by :func:`parse_layout` with the same
bounds: ``mppx plan`` prints them, ``mppx train`` and the Megatron-LM integration take them.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["evaluate_pattern", "MAX_ENTRIES", "MAX_TEXT", "layout_string", "parse_layout"]

#: the longest list a pattern may produce (layers), and the longest text read
MAX_ENTRIES = 1 << 16
MAX_TEXT = 100_000
_MAX_DEPTH = 64
_MAX_INT = 1 << 62
_TOKENS = re.compile(r"\s*(?:(\d+)|([\[\]()+*,]))")


def _tokens(text: str) -> list:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKENS.match(text, pos)
        if m is None:
            raise ValueError(f"unexpected {text[pos:].lstrip()[:10]!r}: only integers, lists, +, * and parentheses "
                             "are allowed")
        if m.group(1) is not None:
            if len(m.group(1)) > 19:
                raise ValueError(f"the number {m.group(1)[:12]}... is too large")
            out.append(int(m.group(1)))
        else:
            out.append(m.group(2))
        pos = m.end()
    return out


def _add(a: Any, b: Any) -> Any:
    if isinstance(a, list) and isinstance(b, list):
        if len(a) + len(b) > MAX_ENTRIES:
            raise ValueError(f"the pattern is longer than {MAX_ENTRIES} entries")
        a.extend(b)   # (every list here is a fresh one: a chain of n terms costs n, not n^2)
        return a
    if isinstance(a, int) and isinstance(b, int):
        return _small(a + b)
    raise ValueError("+ joins two lists or two integers")


def _mul(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int):
        return _small(a * b)
    if isinstance(a, list) != isinstance(b, list):
        seq, n = (a, b) if isinstance(a, list) else (b, a)
        if len(seq) * max(n, 0) > MAX_ENTRIES:
            raise ValueError(f"the pattern is longer than {MAX_ENTRIES} entries")
        return seq * n
    raise ValueError("* repeats a list a whole number of times")


def _small(n: int) -> int:
    if abs(n) > _MAX_INT:
        raise ValueError("a number in the pattern is too large")
    return n


def evaluate_pattern(text: str) -> Any:
    """The value of a pattern expression: an int, or a (possibly nested) list. ValueError says
    what is wrong (syntax, an operation that is not allowed, a size beyond :data:`MAX_ENTRIES`)."""
    if len(text) > MAX_TEXT:
        raise ValueError(f"longer than {MAX_TEXT} characters")
    toks = _tokens(text)
    pos = 0

    def peek() -> Any:
        return toks[pos] if pos < len(toks) else None

    def take() -> Any:
        nonlocal pos
        if pos >= len(toks):
            raise ValueError("the pattern ends too early")
        pos += 1
        return toks[pos - 1]

    def expr(depth: int) -> Any:
        value = term(depth)
        while peek() == "+":
            take()
            value = _add(value, term(depth))
        return value

    def term(depth: int) -> Any:
        value = atom(depth)
        while peek() == "*":
            take()
            value = _mul(value, atom(depth))
        return value

    def atom(depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise ValueError(f"brackets nested more than {_MAX_DEPTH} deep")
        tok = take()
        if isinstance(tok, int):
            return tok
        if tok not in ("[", "("):
            raise ValueError(f"unexpected {tok!r}")
        close = "]" if tok == "[" else ")"
        items, comma = [], False
        while peek() != close:
            items.append(expr(depth + 1))
            if peek() == ",":
                take()
                comma = True
            elif peek() != close:
                raise ValueError(f"expected ',' or {close!r}")
        take()
        if tok == "(" and len(items) == 1 and not comma:
            return items[0]     # (parentheses around an expression)
        if len(items) > MAX_ENTRIES:
            raise ValueError(f"the pattern is longer than {MAX_ENTRIES} entries")
        return items

    value = expr(0)
    if pos != len(toks):
        raise ValueError(f"unexpected {toks[pos]!r}")
    return value


# --- Megatron-Core's pipeline layout strings ------------------------------------------------------

_LAYOUT_REPEAT = re.compile(r"\(([^()]+)\)\*(\d+)|([^()*])\*(\d+)")


def layout_string(counts: tuple[int, ...] | list[int]) -> str:
    """Megatron-Core's ``--pipeline-model-parallel-layout`` for these transformer layers per
    stage (stage order): ``E`` on the first stage, ``L`` on the last, ``t*N`` the layers; a stage
    of the first or last with no layer holds only the embedding or the loss (``E|t*3|...|L``)."""
    parts = [f"t*{n}" if n else "" for n in counts]
    parts[0] = "E" + parts[0]
    parts[-1] = parts[-1] + "L"
    return "|".join(parts)


def parse_layout(text: str) -> tuple[int, ...]:
    """Transformer layers per stage of a ``--pipeline-model-parallel-layout`` string, the way
    Megatron-Core reads it (its ``parse_str_to_list``): the embedding first in the first stage,
    the loss last in the last, each once; only ``E``, ``t`` and ``L`` (no MTP layers). ValueError
    says what is wrong; sizes are checked before a repeat is unrolled."""
    if len(text) > MAX_TEXT:
        raise ValueError(f"longer than {MAX_TEXT} characters")
    s = text.replace(",", "").replace(" ", "")
    if not s:
        raise ValueError("empty")
    while True:
        m = _LAYOUT_REPEAT.search(s)
        if m is None:
            break
        body = m.group(1) if m.group(1) is not None else m.group(3)
        n = int(m.group(2) if m.group(2) is not None else m.group(4))
        if len(s) + len(body) * max(n - 1, 0) > MAX_ENTRIES * 4:
            raise ValueError(f"the layout is longer than {MAX_ENTRIES} layers")
        s = s[:m.start()] + body * n + s[m.end():]
    bad = sorted(set(s) - set("EtL|"))
    if bad:
        what = "MTP layers ('m') are not built here" if bad == ["m"] else f"unknown characters {bad}"
        raise ValueError(f"{what}: a layout holds E (the embedding), t (a transformer layer), L (the loss), "
                         "'|' between stages, x*n and (...)*n repeats")
    stages = s.split("|")
    if s.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError("the embedding 'E' must open the first stage, once")
    if s.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError("the loss 'L' must close the last stage, once")
    if len(stages) > MAX_ENTRIES:
        raise ValueError(f"more than {MAX_ENTRIES} stages")
    return tuple(st.count("t") for st in stages)
