"""GPU memory of the pipeline's NCCL communicators (torch-free): what ``predicted_peak_bytes``
(``mppx train`` on a GPU) and the planner add per rank for the point-to-point strategy.

NCCL allocates its buffers with ``cudaMalloc``/``cuMem``, outside PyTorch's caching allocator,
when a communicator is created and each of its connections set up (at the first transfer to a
peer in a direction). A point-to-point connection holds, per NCCL channel, one buffer of the
Simple protocol of ``NCCL_STEPS`` (8) slots of the p2p chunk size. So, per rank:

    bytes = communicators x per_communicator + connections x per_connection
    per_connection = channels_per_peer x 8 x chunk

with NCCL's defaults and environment variables:

* ``chunk``: ``NCCL_P2P_NET_CHUNKSIZE`` (default 128 KiB: pipeline neighbours on other nodes;
  ``NCCL_P2P_NVL_CHUNKSIZE`` 512 KiB over NVLink, ``NCCL_P2P_PCI_CHUNKSIZE`` 128 KiB over PCIe
  apply within a node: the planner picks the link it times the pipeline on, a run ``net``;
  ``MPPX_NCCL_P2P_LINK=nvl|pci|net`` overrides both), at most
  ``NCCL_BUFFSIZE`` / 8 (default 4 MiB / 8);
* ``channels_per_peer``: ``NCCL_NCHANNELS_PER_NET_PEER`` (2: NCCL's default for network peers up
  to 2.2x; newer versions choose it, typically the same), within ``NCCL_MIN_P2P_NCHANNELS`` (1)
  and ``NCCL_MAX_P2P_NCHANNELS`` (32);
* ``per_communicator``: NCCL's own structures per communicator; not modelled (0) until measured.

A connection is one (communicator, peer, direction) a rank uses: ``channels`` one per channel
(a channel communicator carries one direction), ``pairwise`` one per neighbour and direction
(on the pair's communicator), ``batched`` the same on the pipeline group's one communicator.

**Measured figures replace the model** when ``MPPX_NCCL_MEMORY`` names a JSON file: the GPU
check's ``results.json`` (its check "NCCL communicator memory" measures both figures on the GPU:
``benchmarks/gpu_check/commcheck.py``), or ``{"per_communicator_bytes": N,
"per_connection_bytes": N}``. What the check measured holds for its GPU, NCCL version, transport
and environment; the model's defaults for a network link otherwise.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..textfile import read_text_bounded

__all__ = ["NCCLMemory", "nccl_memory", "held_strategy", "connections_per_rank", "placement_channels", "communicator_bytes",
           "MEASURED_CHECK", "NCCL_STEPS"]

NCCL_STEPS = 8
#: the GPU check's result that carries the measured figures (benchmarks/gpu_check/commcheck.py)
MEASURED_CHECK = "NCCL communicator memory"
_CHUNKS = {"net": ("NCCL_P2P_NET_CHUNKSIZE", 1 << 17), "pci": ("NCCL_P2P_PCI_CHUNKSIZE", 1 << 17),
           "nvl": ("NCCL_P2P_NVL_CHUNKSIZE", 1 << 19)}


@dataclass(frozen=True)
class NCCLMemory:
    """Bytes per communicator and per connection, and where they come from."""

    per_communicator: float
    per_connection: float
    source: str          # "model (...)" or "measured (<file>)"


#: how NCCL reads its integer variables: ``strtoll(value, NULL, 0)`` -- leading blanks, a sign,
#: then hex (0x...), octal (0...) or decimal digits, the rest ignored ("1.9" and "1e30" are 1)
_STRTOLL = re.compile(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")
#: the largest value the model takes (1 TiB of buffer: beyond any GPU's memory)
_MAX_VALUE = 1 << 40


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    v = env.get(name, "").strip()
    if not v:
        return default
    m = _STRTOLL.match(v)
    if m is None:
        raise ValueError(f"{name}={v!r}: NCCL reads an integer here; fix or unset it")
    digits = m.group(2)
    n = int(digits, 16 if digits[:2] in ("0x", "0X") else 8 if digits.startswith("0") and len(digits) > 1 else 10)
    n = -n if m.group(1) == "-" else n
    if n < 1:
        raise ValueError(f"{name}={v}: NCCL reads {n}; must be >= 1; fix or unset it")
    if n > _MAX_VALUE:
        raise ValueError(f"{name}={v}: NCCL reads {n}, more than 1 TiB; fix or unset it")
    return n


def nccl_memory(env: Mapping[str, str] | None = None, *, link: str = "net") -> NCCLMemory:
    """The figures in force: measured (``MPPX_NCCL_MEMORY``), else NCCL's defaults and environment
    for ``link`` (the planner's: where it puts the pipeline; ``MPPX_NCCL_P2P_LINK`` overrides)."""
    env = os.environ if env is None else env
    path = env.get("MPPX_NCCL_MEMORY", "").strip()
    if path:
        return _measured(path)
    link = env.get("MPPX_NCCL_P2P_LINK", "").strip() or link
    if link not in _CHUNKS:
        raise ValueError(f"MPPX_NCCL_P2P_LINK={link!r}: use net, pci or nvl (the link between pipeline neighbours), "
                         "or unset it (net)")
    var, default = _CHUNKS[link]
    chunk = _int_env(env, var, default)
    buff = _int_env(env, "NCCL_BUFFSIZE", 1 << 22)
    chunk = min(chunk, buff // NCCL_STEPS)
    lo = _int_env(env, "NCCL_MIN_P2P_NCHANNELS", 1)
    hi = _int_env(env, "NCCL_MAX_P2P_NCHANNELS", 32)
    channels = min(max(_int_env(env, "NCCL_NCHANNELS_PER_NET_PEER", 2), lo), hi)
    return NCCLMemory(0.0, float(channels * NCCL_STEPS * chunk),
                      f"model ({channels} channel(s) x {NCCL_STEPS} x {chunk} B chunk per connection, link {link})")


#: the largest file read as MPPX_NCCL_MEMORY (the GPU check's results.json is a few hundred KiB;
#: a device such as /dev/zero has no end)
_MAX_FILE = 16 << 20


def _measured(path: str) -> NCCLMemory:
    hint = ("give the GPU check's results.json or {\"per_communicator_bytes\": N, \"per_connection_bytes\": N}")
    try:
        text = read_text_bounded(path, _MAX_FILE)
        if text is None:
            raise ValueError(f"MPPX_NCCL_MEMORY={path}: larger than {_MAX_FILE >> 20} MiB; {hint}")
        doc = json.loads(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"MPPX_NCCL_MEMORY={path}: cannot read it as JSON ({e}); {hint}") from None
    data = doc
    plain = ("per_communicator_bytes", "per_connection_bytes")
    if isinstance(doc, dict) and "checks" not in doc and set(doc) - set(plain):
        raise ValueError(f"MPPX_NCCL_MEMORY={path}: unknown key(s) {', '.join(sorted(set(doc) - set(plain)))}; "
                         f"{hint}")
    if isinstance(doc, dict) and "checks" in doc:   # the GPU check's results.json
        checks = doc["checks"]
        if not isinstance(checks, list) or not all(isinstance(c, dict) for c in checks):
            raise ValueError(f"MPPX_NCCL_MEMORY={path}: \"checks\" is not a list of checks as the GPU check "
                             f"writes them; {hint}")
        data = next((c.get("data") for c in checks
                     if c.get("name") == MEASURED_CHECK and c.get("status") == "measured"), None)
        if data is None:
            raise ValueError(f"MPPX_NCCL_MEMORY={path}: its results have no measured {MEASURED_CHECK!r} check (run "
                             "the GPU check's nccl step on a GPU)")
    try:
        raw = [data[k] for k in plain]
    except (KeyError, TypeError, IndexError):
        raise ValueError(f"MPPX_NCCL_MEMORY={path}: needs per_communicator_bytes and per_connection_bytes") from None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in raw):
        raise ValueError(f"MPPX_NCCL_MEMORY={path}: per_communicator_bytes and per_connection_bytes must be numbers "
                         f"(bytes), got {raw[0]!r:.30} and {raw[1]!r:.30}")
    a, b = float(raw[0]), float(raw[1])
    if not (a >= 0 and b >= 0 and a < 2 ** 40 and b < 2 ** 40):
        raise ValueError(f"MPPX_NCCL_MEMORY={path}: per_communicator_bytes and per_connection_bytes must be >= 0")
    return NCCLMemory(a, b, f"measured ({path})")


def connections_per_rank(strategy: str, channels: Sequence[tuple[int, int, str]], ranks: int) -> list[tuple[int, int]]:
    """Per pipeline rank, (communicators, connections) of ``strategy`` for the pipeline messages
    ``channels`` ((sender, receiver, "act"|"grad"), pipeline ranks)."""
    out = []
    for r in range(ranks):
        mine = {(s, d, c) for s, d, c in channels if r in (s, d)}
        dirs = {(s, d) for s, d, _ in mine}
        if strategy == "channels":
            out.append((len(mine), len(mine)))
        elif strategy == "pairwise":
            out.append((len({frozenset(x) for x in dirs}), len(dirs)))
        elif strategy == "batched":
            out.append((1 if dirs else 0, len(dirs)))
        else:
            raise ValueError(f"unknown p2p strategy {strategy!r}")
    return out


def placement_channels(placement: Sequence[int]) -> list[tuple[int, int, str]]:
    """(sender, receiver, "act"|"grad") of the pipeline messages of a stage placement: each pair
    of consecutive stages on different ranks sends activations forward and gradients back."""
    out = set()
    for s in range(len(placement) - 1):
        a, b = placement[s], placement[s + 1]
        if a != b:
            out |= {(a, b, "act"), (b, a, "grad")}
    return sorted(out)


def held_strategy(strategy: str | None, *, megatron_own: bool) -> str:
    """The strategy whose communicators a run holds: Megatron-Core's own schedules use
    ``batch_isend_irecv`` on the pipeline group (``batched``'s one communicator) whatever is
    asked; ours the strategy given, or the default."""
    from .p2pstrategy import DEFAULT_STRATEGY
    return "batched" if megatron_own else (strategy or DEFAULT_STRATEGY)


def communicator_bytes(strategy: str, placement: Sequence[int], env: Mapping[str, str] | None = None, *,
                       mem: NCCLMemory | None = None) -> list[int]:
    """Per pipeline rank, the device bytes of ``strategy``'s communicators for a pipeline of this
    stage ``placement`` (``mem``: the figures in force, read once by a caller that asks often;
    else :func:`nccl_memory` of ``env``)."""
    ranks = max(placement) + 1 if placement else 1
    mem = mem if mem is not None else nccl_memory(env)
    return [int(round(n * mem.per_communicator + k * mem.per_connection))
            for n, k in connections_per_rank(strategy, placement_channels(placement), ranks)]
