"""Integrity of ``mppx train`` checkpoints: the size and SHA-256 of every file, written into the
checkpoint's ``mppx_checkpoint.json`` when it is saved and checked before it is loaded.

Megatron-Core loads a truncated or bit-flipped shard without complaint (a flipped exponent bit
turns a weight into 1e38 and the loss into NaN a few steps later), and a missing or garbled file
fails deep inside ``torch.load`` with a traceback. So:

* **at save** every rank hashes the files it wrote (``__<rank>_*.distcp``), rank 0 the rest
  (``common.pt``, ``.metadata``, ``metadata.json``, parts), and rank 0 writes the manifest into
  ``mppx_checkpoint.json``, last, after every shard;
* **at plan time** (:func:`check_files`, cheap): every file of the manifest is there with its size;
* **before any worker starts** (:func:`verify_files`, on by default, ``--no-verify-checkpoint``
  to skip): every file is read and hashed (threads; under torchrun/srun each rank checks a share).
  SHA-256 runs at about 1.2 GB/s per core (SHA extensions); reading from storage is usually the
  limit (docs/train.md).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

__all__ = ["HASH", "list_files", "digest", "hash_files", "check_files", "verify_files", "manifest_of", "write_failure",
           "read_failure"]

HASH = "sha256"
_CHUNK = 8 << 20


def list_files(directory: str, *, skip: Iterable[str] = ()) -> list[str]:
    """Every file under ``directory`` (relative paths, sorted), but ``skip``."""
    skip = set(skip)
    out = []
    for base, _, names in os.walk(directory):
        for n in names:
            rel = os.path.relpath(os.path.join(base, n), directory)
            if rel not in skip:
                out.append(rel)
    return sorted(out)


def digest(path: str) -> dict:
    """``{"size": bytes, "sha256": hex}`` of one file."""
    h = hashlib.new(HASH)
    size = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)    # (releases the GIL: files are hashed in parallel threads)
            size += len(block)
    return {"size": size, HASH: h.hexdigest()}


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def hash_files(directory: str, names: Iterable[str]) -> dict[str, dict]:
    """:func:`digest` of each of ``names`` under ``directory``, in parallel threads."""
    names = list(names)
    with ThreadPoolExecutor(_threads()) as ex:
        return dict(zip(names, ex.map(lambda n: digest(os.path.join(directory, n)), names)))


def manifest_of(meta: dict) -> dict[str, dict] | None:
    """The manifest of a checkpoint's metadata (None: written before checkpoints had one)."""
    files = meta.get("files")
    return files if isinstance(files, dict) else None


def check_files(directory: str, files: dict[str, dict]) -> str | None:
    """Every file of the manifest is there with its size: the first problem, or None."""
    for name in sorted(files):
        path = os.path.join(directory, name)
        want = files[name].get("size")
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror or e})"
        if size != want:
            return f"{name} has {size} bytes, the save wrote {want} ({'truncated' if size < want else 'grown'})"
    return None


def verify_files(directory: str, files: dict[str, dict], *, share: tuple[int, int] = (0, 1)) -> tuple[str | None, dict]:
    """Hash the files of the manifest (this rank's ``share`` = (index, count) of them) and compare:
    (the first problem or None, {"files", "bytes", "seconds"})."""
    t0 = time.perf_counter()
    index, count = share
    names = sorted(files)[index::count]
    problem = check_files(directory, {n: files[n] for n in names})
    total = 0
    if problem is None:
        try:
            got = hash_files(directory, names)
        except OSError as e:
            return f"{os.path.relpath(e.filename, directory) if e.filename else '?'} cannot be read " \
                   f"({e.strerror or e})", {}
        for n in names:
            total += got[n]["size"]
            if got[n][HASH] != files[n].get(HASH):
                problem = f"{n} does not match its checksum (its content changed after the save: damaged)"
                break
    return problem, {"files": len(names), "bytes": total, "seconds": time.perf_counter() - t0}


# --- what a failed write or read of a checkpoint was about ----------------------------------------

def _io_cause(e: BaseException) -> OSError | None:
    """The OSError behind ``e`` (its causes, or the per-rank failures torch's checkpoint writer and
    reader collect), if any."""
    seen: set = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        todo += [x.__cause__, x.__context__]
        todo += _inner(x)
    return None


def _inner(e: BaseException) -> list[BaseException]:
    """torch's CheckpointException: one wrapped exception (or (exception, stack)) per rank."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return []
    return [v[0] if isinstance(v, tuple) else v for v in failures.values()
            if isinstance(v[0] if isinstance(v, tuple) else v, BaseException)]


def _own(e: BaseException) -> bool:
    """An error of the run's own, not Ctrl-C, SIGTERM or an exit on the way through (torch's
    CheckpointException is a BaseException)."""
    return isinstance(e, Exception) or "Checkpoint" in type(e).__name__


def write_failure(e: BaseException) -> str | None:
    """Why writing a checkpoint failed, in a few words (``No space left on device: PATH``), when it is
    the files' fault; None for anything else (a bug keeps its traceback)."""
    cause = _io_cause(e)
    if not _own(e) or (cause is None and "Checkpoint" not in type(e).__name__):
        return None
    if cause is not None:
        return f"{cause.strerror or cause}" + (f": {cause.filename}" if getattr(cause, "filename", None) else "")
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


def read_failure(e: BaseException, *, verified: bool) -> str | None:
    """Why reading a checkpoint failed (``common.pt: UnpicklingError: ...``), naming the file where the
    loader tells. ``verified``: every file matched its checksum, so only an I/O error is the files'
    fault; None for anything else (a bug keeps its traceback)."""
    if not _own(e) or (verified and _io_cause(e) is None):
        return None
    named: set = set()
    for x in [e, e.__cause__, e.__context__] + _inner(e):
        if not isinstance(x, BaseException):
            continue
        text = str(x)
        named.update(re.findall(r"__\d+_\d+\.distcp|common\.pt|metadata\.json", text))
        if re.search(r"\bmetadata\b(?!\.json)", text):
            named.add(".metadata")
        if any("common" in f.name for f in traceback.extract_tb(x.__traceback__)):
            named.add("common.pt")
    first = (_inner(e) or [e])[0]
    text = re.split(r"(?<=\.)\s", (str(first).strip().splitlines() or [""])[0])[0][:160]
    return f"{', '.join(sorted(named)) + ': ' if named else ''}{type(first).__name__}: {text}"
