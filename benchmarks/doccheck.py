"""Check that the deterministic tables of docs/benchmarks/*.md still match their commands.

Every benchmark script with simulated (deterministic) tables has ``doc_tables(quick)``: the
markdown of those tables (with the headings and captions they sit under in its document),
rendered by the same code that writes the document. ``quick=True`` computes a subset of the
configurations (whole rows only) in seconds; ``quick=False`` computes all of them.

:func:`check` then requires every generated table to be in the document under the same
heading and caption with the same header, and each of its rows to be there verbatim; with
``exact`` the document's table must have no other rows. Measured tables and timings are not
generated, so they are never compared.

    python -m benchmarks.doccheck            # every script, all configurations (minutes)
    python -m benchmarks.doccheck vocab bpipe --quick
    python -m benchmarks.doccheck --update offload   # rewrite its deterministic tables in place

tests/test_benchmark_docs.py runs the quick check of every script in the test suite.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: script name -> its document (every script here has ``doc_tables(quick)``)
DOCS = {"vocab": "vocab.md", "bpipe": "bpipe.md", "offload": "offload.md", "schedules": "schedules.md",
        "planner": "planner.md", "comm": "comm.md", "moe": "moe.md", "published": "published.md"}


@dataclass
class Table:
    heading: str                 # the nearest heading above it ("### 1f1b, seq 2048")
    caption: str                 # the last text line between that heading and the table ("p = 4"), or ""
    header: str                  # the header row
    rows: list[str] = field(default_factory=list)      # normalised (whitespace) for comparing
    raw: list[str] = field(default_factory=list)       # as written

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.heading, self.caption, self.header)


def _norm(line: str) -> str:
    return " ".join(line.strip().split())


def tables(md: str) -> list[Table]:
    """The markdown tables of ``md`` with their heading and caption."""
    out: list[Table] = []
    heading, caption = "", ""
    lines = md.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading, caption = _norm(line), ""
        elif line.startswith("|") and i + 1 < len(lines) and lines[i + 1].strip().startswith("|-"):
            t = Table(heading, caption, _norm(line))
            i += 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                t.rows.append(_norm(lines[i]))
                t.raw.append(lines[i].rstrip())
                i += 1
            out.append(t)
            continue
        elif line:
            caption = _norm(line)
        i += 1
    return out


def _first_cells(row: str, k: int = 2) -> str:
    return "|".join(row.split("|")[1:1 + k])


def check(doc: str, generated: str, *, exact: bool = False, where: str = "doc") -> list[str]:
    """Problems (empty: none): generated tables missing from ``doc`` or with rows that differ."""
    problems: list[str] = []
    doc_tables: dict[tuple, list[Table]] = {}
    for t in tables(doc):
        doc_tables.setdefault(t.key, []).append(t)
    gen = tables(generated)
    if not gen:
        return [f"{where}: the generator produced no table"]
    for t in gen:
        found = doc_tables.get(t.key)
        if not found:
            problems.append(f"{where}: no table under {t.heading!r}" + (f" / {t.caption!r}" if t.caption else "")
                            + f" with header {t.header!r}")
            continue
        doc_rows = [r for d in found for r in d.rows]
        for row in t.rows:
            if row not in doc_rows:
                near = [r for r in doc_rows if _first_cells(r) == _first_cells(row)]
                problems.append(f"{where}: under {t.heading!r}" + (f" / {t.caption!r}" if t.caption else "")
                                + f": the command now prints\n    {row}\n  the document has\n    "
                                + (near[0] if near else "(no row with that key)"))
        if exact:
            extra = [r for r in doc_rows if r not in t.rows]
            problems += [f"{where}: under {t.heading!r}: row no longer printed: {r}" for r in extra]
    return problems


def update(doc: str, generated: str) -> tuple[str, list[str]]:
    """``doc`` with the rows of every table that ``generated`` also has (same heading, caption and
    header) replaced by the generated rows; and the keys of generated tables it does not have
    (their heading or header changed: regenerate the document with its command instead)."""
    gen = {t.key: t for t in tables(generated)}
    out: list[str] = []
    used: set = set()
    heading, caption = "", ""
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("#"):
            heading, caption = _norm(line), ""
        elif line.startswith("|") and i + 1 < len(lines) and lines[i + 1].strip().startswith("|-"):
            key = (heading, caption, _norm(line))
            if key in gen:
                out += [lines[i], lines[i + 1]] + gen[key].raw
                used.add(key)
                i += 2
                while i < len(lines) and lines[i].strip().startswith("|"):
                    i += 1
                continue
        elif line:
            caption = _norm(line)
        out.append(lines[i])
        i += 1
    missing = [" / ".join(x for x in k if x) for k in gen if k not in used]
    return "\n".join(out) + ("\n" if doc.endswith("\n") else ""), missing


def check_script(name: str, *, quick: bool) -> list[str]:
    """Regenerate ``benchmarks/<name>.py``'s deterministic tables and compare with its document."""
    mod = importlib.import_module(f"benchmarks.{name}")
    doc_path = ROOT / "docs" / "benchmarks" / DOCS[name]
    generated = mod.doc_tables(quick=quick)
    return check(doc_path.read_text(encoding="utf-8"), generated, exact=not quick,
                 where=f"docs/benchmarks/{DOCS[name]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="check docs/benchmarks/*.md against their benchmark scripts")
    ap.add_argument("scripts", nargs="*", metavar="SCRIPT", help=f"which ({', '.join(DOCS)}; default: all)")
    ap.add_argument("--quick", action="store_true", help="a subset of the configurations (what the tests run)")
    ap.add_argument("--update", action="store_true",
                    help="rewrite the deterministic tables in the documents in place (measured tables are kept)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.scripts) - set(DOCS))
    if unknown:
        ap.error(f"unknown script(s) {', '.join(unknown)}; choose from {', '.join(DOCS)}")
    bad = 0
    for name in args.scripts or list(DOCS):
        t = time.time()
        if args.update:
            path = ROOT / "docs" / "benchmarks" / DOCS[name]
            mod = importlib.import_module(f"benchmarks.{name}")
            text, missing = update(path.read_text(encoding="utf-8"), mod.doc_tables(quick=args.quick))
            path.write_text(text, encoding="utf-8")
            print(f"{name}: updated {path.relative_to(ROOT)}" + (f"; not found (regenerate the document with "
                  f"python benchmarks/{name}.py): {missing}" if missing else ""))
            bad += bool(missing)
            continue
        problems = check_script(name, quick=args.quick)
        print(f"{name}: {'ok' if not problems else f'{len(problems)} problem(s)'} ({time.time() - t:.0f} s)")
        for p in problems:
            print("  " + p)
        bad += bool(problems)
    if bad:
        print("regenerate the documents with their commands (python benchmarks/NAME.py)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
