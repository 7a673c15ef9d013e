"""Every skip and expected failure in the test sources has its reason in docs/tests.md#skips.

A skip that nobody listed hides a test that stopped running: this scans the sources (``ast``,
nothing imported) for ``pytest.skip``, ``pytest.importorskip``, ``pytest.xfail`` and the marks
``skip``, ``skipif``, ``xfail``, and fails on one whose (file, kind, reason) is not a row of the
table, on a row that no source has any more, and on a skip without a reason.
``python tests/test_skips.py`` prints the rows the sources have (the first three columns).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "tests.md"

#: pytest.<name>(...) and pytest.mark.<name>(...) -> kind
CALLS = {"skip": "skip", "importorskip": "importorskip", "xfail": "xfail"}
MARKS = {"skip": "mark.skip", "skipif": "skipif", "xfail": "mark.xfail"}


def _text(node: ast.expr | None) -> str | None:
    """A reason as the source gives it: literal text, ``{expr}`` for an f-string's fields,
    ``<expr>`` for anything computed."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    return f"<{ast.unparse(node)}>"


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _pytest_attr(node: ast.expr) -> tuple[str, str] | None:
    """("call", name) for ``pytest.name``, ("mark", name) for ``pytest.mark.name``."""
    if not isinstance(node, ast.Attribute):
        return None
    if isinstance(node.value, ast.Name) and node.value.id == "pytest" and node.attr in CALLS:
        return "call", node.attr
    v = node.value
    if (isinstance(v, ast.Attribute) and v.attr == "mark" and isinstance(v.value, ast.Name)
            and v.value.id == "pytest" and node.attr in MARKS):
        return "mark", node.attr
    return None


def scan(path: Path) -> tuple[set[tuple[str, str, str]], list[str]]:
    """The (file, kind, reason) of every skip in ``path``, and the problems (no reason, an
    indirect use the scan cannot read)."""
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    found: set[tuple[str, str, str]] = set()
    problems: list[str] = []
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("pytest", "unittest"):
            names = {a.name for a in node.names} & {"skip", "skipIf", "skipUnless", "xfail", "importorskip", "mark"}
            if names:
                problems.append(f"{rel}:{node.lineno}: from {node.module} import {', '.join(sorted(names))} "
                                "(write pytest.skip / pytest.mark.skipif ...: the scan reads those)")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "unittest" \
                and node.attr.startswith("skip"):
            problems.append(f"{rel}:{node.lineno}: unittest.{node.attr} (use pytest's skips)")
        if not isinstance(node, ast.Call):
            continue
        what = _pytest_attr(node.func)
        if what is None:
            continue
        called.add(id(node.func))
        how, name = what
        if how == "call" and name == "importorskip":
            mod = _text(node.args[0] if node.args else _kw(node, "modname"))
            reason = _text(_kw(node, "reason")) or f"import {mod}"
            kind = "importorskip"
        elif how == "call":
            reason = _text(node.args[0] if node.args else _kw(node, "reason"))
            kind = CALLS[name]
        else:
            kind = MARKS[name]
            first = node.args[0] if (name == "skip" and node.args) else None
            reason = _text(_kw(node, "reason") or first)
        if not reason:
            problems.append(f"{rel}:{node.lineno}: {kind} without a reason")
            continue
        found.add((rel, kind, reason))
    for node in ast.walk(tree):   # pytest.skip / pytest.mark.skipif ... used other than called
        if _pytest_attr(node) is not None and id(node) not in called:
            problems.append(f"{rel}:{node.lineno}: {ast.unparse(node)} used without a call the scan can read")
    return found, problems


def sources() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").rglob("*.py") if p.name != "test_skips.py")


def in_sources() -> tuple[set[tuple[str, str, str]], list[str]]:
    found: set[tuple[str, str, str]] = set()
    problems: list[str] = []
    for p in sources():
        f, pr = scan(p)
        found |= f
        problems += pr
    return found, problems


def table() -> set[tuple[str, str, str]]:
    """The rows of the table under ``## Skips`` in docs/tests.md: (file, kind, reason)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Skips", 1)[1].split("\n## ", 1)[0]
    rows = set()
    for line in section.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) < 4 or cells[0] in ("test file", "") or set(cells[0]) <= {"-"}:
            continue
        rows.add(tuple(c.strip("`").replace("\\|", "|") for c in cells[:3]))
    return rows


def row(item: tuple[str, str, str]) -> str:
    f, kind, reason = item
    return f"| `{f}` | {kind} | `{reason.replace('|', chr(92) + '|')}` | |"


def test_every_skip_has_its_reason_listed():
    found, problems = in_sources()
    listed = table()
    assert not problems, "\n".join(problems)
    missing = sorted(found - listed)
    assert not missing, ("skips not listed in docs/tests.md#skips (add the row and say when it applies):\n"
                         + "\n".join(row(m) for m in missing))
    stale = sorted(listed - found)
    assert not stale, "rows of docs/tests.md#skips that no test has any more:\n" + "\n".join(map(row, stale))


def test_the_scan_sees_every_form(tmp_path, monkeypatch):
    """The forms the scan reads, and the ones it refuses (so that a skip cannot slip past it)."""
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    src = tmp_path / "t.py"
    src.write_text(
        "import pytest\n"
        "pytest.importorskip('hypothesis')\n"
        "m = pytest.mark.skipif(X, reason='no ' 'x')\n"
        "@pytest.mark.xfail(reason=f'bug {n} open')\n"
        "def test_a():\n"
        "    pytest.skip(why)\n"
        "    pytest.xfail('later')\n"
        "    pytest.mark.skip('off')\n"
        "    pytest.mark.skipif(Y)\n"
        "    s = pytest.skip\n")
    found, problems = scan(src)
    assert found == {("t.py", "importorskip", "import hypothesis"), ("t.py", "skipif", "no x"),
                     ("t.py", "mark.xfail", "bug {n} open"), ("t.py", "skip", "<why>"), ("t.py", "xfail", "later"),
                     ("t.py", "mark.skip", "off")}
    assert [p.split(": ", 1)[1] for p in problems] == ["skipif without a reason",
                                                       "pytest.skip used without a call the scan can read"]
    src.write_text("from pytest import skip\nimport unittest\n@unittest.skipIf(1, 'x')\ndef test_b(): pass\n")
    assert len(scan(src)[1]) == 2


if __name__ == "__main__":
    for item in sorted(in_sources()[0]):
        print(row(item))
