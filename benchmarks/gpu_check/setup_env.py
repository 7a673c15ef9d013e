"""Set-up without network: Megatron-Core (and what it needs) from wheels that travel with the tree.

The GPU machine has torch, numpy and no Megatron-Core, and cannot reach a package index. The
wheels are downloaded here (``scripts/gpu_check.sh --fetch-wheels``: ``pip download
--only-binary=:all: --python-version 3.12 ...`` into the git-ignored ``.whl/``) and travel with
the working tree (at most 64 MiB in all; the set is about 4 MiB: megatron-core, and packaging,
setuptools -- ``torch.utils.cpp_extension``, which megatron-core imports, needs it --, tqdm and
psutil, in case the image lacks them). A wheel is a zip archive, so "installing" one for a
single run is extracting it: no pip, no compilation. The folder goes to the *end* of
``sys.path`` and ``PYTHONPATH``, so whatever the machine has already (its ``packaging``, say)
wins and only what is missing comes from the wheels.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import zipfile
from pathlib import Path

__all__ = ["ROOT", "WHEEL_DIR", "SITE_DIR", "WHEELS", "wheel_files", "ensure_packages", "versions", "nccl_version"]

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / ".whl"
SITE_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "mppx-gpu-check-site"
#: what ``--fetch-wheels`` downloads (name==version): megatron-core as CI uses it, and the pure-
#: Python packages it (or mppx train) imports that a bare torch image may lack
WHEELS = ("megatron-core==0.16.1", "packaging==24.2", "setuptools==80.9.0", "tqdm==4.67.1", "psutil==7.0.0")


class SetupError(RuntimeError):
    """The set-up cannot make Megatron-Core importable (one line: what to do)."""


def wheel_files(folder: Path = WHEEL_DIR) -> list[Path]:
    return sorted(folder.glob("*.whl")) if folder.is_dir() else []


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _add_path(path: Path) -> None:
    if str(path) not in sys.path:
        sys.path.append(str(path))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(path) not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts + [str(path)])


def ensure_packages(folder: Path = WHEEL_DIR, site: Path = SITE_DIR) -> dict:
    """Make ``megatron.core`` importable: as installed, or from the wheels in ``folder``
    (extracted into ``site``). Returns what was done, with the wheels' total size."""
    wheels = wheel_files(folder)
    info = {"wheel_dir": str(folder), "wheels": [w.name for w in wheels],
            "wheel_bytes": sum(w.stat().st_size for w in wheels), "extracted": [], "site": None}
    if _importable("megatron.core"):
        info["source"] = "installed"
        _import_megatron(folder)
        return info
    if not wheels:
        raise SetupError(f"megatron-core is not importable and {folder} holds no wheel: run "
                         "scripts/gpu_check.sh --fetch-wheels on a machine with network first (the folder then "
                         "travels with the working tree)")
    site.mkdir(parents=True, exist_ok=True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
        info["extracted"].append(w.name)
    _add_path(site)
    importlib.invalidate_caches()
    if not _importable("megatron.core"):
        raise SetupError(f"megatron.core still not importable after extracting {len(wheels)} wheel(s) from {folder} "
                         f"into {site}: is one of them megatron-core for this Python "
                         f"({sys.version_info.major}.{sys.version_info.minor})?")
    _import_megatron(folder)
    info["source"] = "wheels"
    info["site"] = str(site)
    return info


def _import_megatron(folder: Path) -> None:
    """Import megatron.core now (its imports need more than the wheel: numpy, packaging and, through
    torch.utils.cpp_extension, setuptools); a missing one is a one-line SetupError."""
    try:
        importlib.import_module("megatron.core")
    except ImportError as e:
        raise SetupError(f"import megatron.core failed ({type(e).__name__}: {e}): add the missing package to WHEELS "
                         f"in benchmarks/gpu_check/setup_env.py and run scripts/gpu_check.sh --fetch-wheels "
                         f"(wheels in {folder})") from None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """Python, torch, CUDA and NCCL as torch was built, megatron-core (no CUDA context made)."""
    import platform

    import torch
    out = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "megatron_core": _version("megatron-core") or _version("megatron_core"),
           "numpy": _version("numpy"), "host": platform.node(), "cpus": os.cpu_count()}
    try:
        import megatron.core
        out["megatron_core_path"] = str(Path(megatron.core.__file__).parent)
    except Exception as e:  # noqa: BLE001 - reported
        out["megatron_core_error"] = f"{type(e).__name__}: {e}"
    return out


def nccl_version() -> str | None:
    """NCCL's version as torch was built with it (no CUDA context), or None without NCCL."""
    try:
        import torch.cuda.nccl
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build
        return None
    return ".".join(str(x) for x in v) if isinstance(v, (tuple, list)) else str(v)
