"""The layers of megatron_pp_ext/layers.py hold: every import of every module of the package (at
module level or inside a function) goes to its own layer or a lower one, a feature does not
import another feature, no module takes a name with a leading underscore from another package,
and nothing in the library imports the test support (megatron_pp_ext.testing)."""

from __future__ import annotations

import ast
from pathlib import Path

from megatron_pp_ext.layers import FACADE, FEATURE_DEPENDS, LAYERS, feature_of, layer_of

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "megatron_pp_ext"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) of every import in ``path``."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            if node.module is None or node.level and not node.module:
                # ``from . import x``: each name may be a module of that package
                for n in names:
                    out.append((f"{target}.{n}" if (PKG.parent / (target.replace(".", "/") + f"/{n}.py")).exists()
                                or (PKG.parent / target.replace(".", "/") / n).is_dir() else target, [n], node.lineno))
                continue
            out.append((target, names, node.lineno))
    return out


def problems() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        src = _module(path)
        if src in FACADE:
            continue
        lsrc = layer_of(src)
        if lsrc is None:
            out.append(f"{src}: in no layer of megatron_pp_ext/layers.py (add it to one)")
            continue
        for target, names, line in imports(path):
            if not target.startswith("megatron_pp_ext"):
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            ltgt = layer_of(target)
            if ltgt is not None and ltgt > lsrc:
                out.append(f"{where}: {src} ({LAYERS[lsrc][0]}) imports {target} ({LAYERS[ltgt][0]}), a higher layer")
            fs, ft = feature_of(src), feature_of(target)
            if fs and ft and fs != ft and ft not in FEATURE_DEPENDS.get(fs, ()):
                out.append(f"{where}: feature {fs} imports feature {ft} (share through a lower layer, or "
                           "declare the dependency in megatron_pp_ext/layers.py FEATURE_DEPENDS)")
            other = target.split(".")[:2] != src.split(".")[:2] or (fs and ft and fs != ft)
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if other and private:
                out.append(f"{where}: {src} takes private name(s) {private} from {target}")
    return out


def test_every_import_goes_down_the_layers():
    found = problems()
    assert not found, "\n".join(found)


def test_the_check_finds_an_import_that_goes_up(tmp_path, monkeypatch):
    """The checker itself: a schedule-core module that imports the runtime is reported."""
    import megatron_pp_ext.layers as layers
    bad = PKG / "schedule" / "_layer_probe_tmp.py"
    bad.write_text("from ..runtime import executor\nfrom ..trainer.config import _fail\n")
    try:
        found = problems()
    finally:
        bad.unlink()
    assert any("_layer_probe_tmp" in p and "a higher layer" in p for p in found), found
    assert any("_layer_probe_tmp" in p and "private name" in p for p in found), found
    assert layers.layer_of("megatron_pp_ext.schedule.ir") < layers.layer_of("megatron_pp_ext.runtime.executor")


def _typing_only_lines(path: Path) -> set[int]:
    """Lines of ``if TYPE_CHECKING:`` blocks (imports for annotations, never run)."""
    out: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return out


def mutual_imports(under: Path = PKG) -> list[str]:
    """Pairs of modules of the package (``under``: one of its folders) that import each other (at
    module level or in a function; not for annotations only)."""
    deps: dict[str, set] = {}
    for path in sorted(under.rglob("*.py")):
        typing_only = _typing_only_lines(path)
        deps[_module(path)] = {t for t, _, line in imports(path)
                               if t.startswith("megatron_pp_ext") and line not in typing_only}
    return sorted(f"{a} <-> {b}" for a in deps for b in deps[a] if a < b and a in deps.get(b, ()))


def test_no_two_modules_import_each_other():
    """A module and the module it builds on do not call back into each other (e.g. the executor's
    point-to-point strategies and their NCCL emulation: the factory that picks one sits above both)."""
    found = mutual_imports()
    assert not found, "\n".join(found)


def test_the_check_finds_two_modules_that_import_each_other():
    """The checker itself: a module that imports another, which calls back into it from inside a
    function (as p2p did into its NCCL emulation), is reported."""
    a, b = PKG / "runtime" / "_mutual_a_tmp.py", PKG / "runtime" / "_mutual_b_tmp.py"
    a.write_text("from . import _mutual_b_tmp\n")
    b.write_text("def probe():\n    from ._mutual_a_tmp import probe\n")
    try:
        found = mutual_imports(PKG / "runtime")
    finally:
        a.unlink()
        b.unlink()
    assert found == ["megatron_pp_ext.runtime._mutual_a_tmp <-> megatron_pp_ext.runtime._mutual_b_tmp"], found
