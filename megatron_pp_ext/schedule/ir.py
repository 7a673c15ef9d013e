"""Schedule intermediate representation: op kinds, ops, placements and schedules.

The IR is deliberately small and torch-free. A schedule is an ordered list of ops per
pipeline rank plus a placement (stage -> rank). What an op *means* (what it needs, what it
produces, how long it takes, how much memory it holds) is not hard-coded here: it lives in
the :class:`OpKind` registered for it, so feature packages (offload, vocabulary
parallelism, BPipe) add kinds without touching the simulator or the validator.

Data keys: an op consumes and produces *keys* ``(tag, stage, microbatch)``:
``("act", s, m)`` is the output activation of stage ``s``; ``("grad", s, m)`` is the
gradient w.r.t. the input of stage ``s``; ``("wgrad", s, m)`` marks the weight gradient as
accumulated. A key produced on another rank than the consumer's crosses the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

Key = tuple  # (tag: str, stage: int, microbatch: int)


class ScheduleError(ValueError):
    """A schedule or a request for one is invalid; the message says what and how to fix it."""


@dataclass(frozen=True, slots=True)
class Op:
    """One action of one rank: ``kind`` on ``stage`` for ``microbatch``.

    ``peer`` is the other rank of a communication op (None for compute ops).
    """

    kind: str
    stage: int
    microbatch: int
    rank: int
    peer: int | None = None

    def __str__(self) -> str:  # e.g. "3F7", "0SEND_F2->1"
        s = f"{self.stage}{self.kind}{self.microbatch}"
        return s if self.peer is None else f"{s}{'->' if self.kind.startswith('SEND') else '<-'}{self.peer}"

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "stage": self.stage, "microbatch": self.microbatch, "rank": self.rank}
        if self.peer is not None:
            d["peer"] = self.peer
        return d

    @staticmethod
    def from_dict(d: dict) -> "Op":
        if "pair" in d:
            bs, bm = d["pair"]
            return PairedOp(d["kind"], int(d["stage"]), int(d["microbatch"]), int(d["rank"]), d.get("peer"),
                            (int(bs), int(bm)))
        return Op(d["kind"], int(d["stage"]), int(d["microbatch"]), int(d["rank"]), d.get("peer"))


@dataclass(frozen=True, slots=True)
class PairedOp(Op):
    """Two compute ops of one rank run as one unit (:mod:`.pairs`: the forward of one stage and
    microbatch with the backward of another, their communication hidden behind each other's
    compute). ``stage`` / ``microbatch`` are the forward's, ``pair`` = (stage, microbatch) of the
    backward; ``kind`` names the pair (``F&B``: the backward for inputs, its W later; ``F&BW``:
    the full backward)."""

    pair: tuple = (0, 0)

    def __str__(self) -> str:  # e.g. "3F7&4B2"
        back = self.kind.split("&", 1)[-1]
        return f"{self.stage}F{self.microbatch}&{self.pair[0]}{back}{self.pair[1]}"

    def to_dict(self) -> dict:
        d = Op.to_dict(self)
        d["pair"] = [self.pair[0], self.pair[1]]
        return d


def _no_keys(op: Op, sched: "Schedule") -> tuple:
    return ()


def _zero(cost, op: Op) -> float:
    return 0.0


@dataclass(frozen=True)
class OpKind:
    """Semantics of an op kind, looked up by name from the registry.

    category: "compute" (occupies the rank's compute stream), "comm" (point-to-point,
    matched between ranks), or any stream name a feature defines (e.g. "d2h").
    requires/produces: data keys (see module doc). duration/memory: from the cost model.
    communicators: the process groups (by name) on which the op issues collectives; on NCCL
    every rank of one must issue its collectives in the same order, and none may be the
    pipeline group ("pp"), whose stream carries the point-to-point transfers.
    per_stage: the kind's functions depend on the op's kind, stage, rank and peer only, and the
    keys it needs and makes are at the op's own microbatch: the simulator (:mod:`.engine`)
    then evaluates them once per (kind, stage, rank, peer) instead of once per op.
    """

    name: str
    category: str
    description: str
    requires: Callable[[Op, "Schedule"], tuple] = _no_keys
    produces: Callable[[Op, "Schedule"], tuple] = _no_keys
    duration: Callable[[object, Op], float] = _zero
    memory: Callable[[object, Op], float] = _zero
    communicators: tuple = ()
    per_stage: bool = False
    #: an op that runs several ops of the built-in kinds as one unit (an overlapped pair):
    #: ``parts(op)`` -> those ops; the completeness rule, the message buffers and the runtime
    #: read them (None: the op is its own part)
    parts: Callable[[Op], tuple] | None = None


_KINDS: dict[str, OpKind] = {}
# Requirements features add to kinds they do not own (e.g. offload: a backward waits for the
# reload of its activations): kind name -> {requirement name: fn(op, schedule) -> keys}.
_EXTRA_REQUIRES: dict[str, dict[str, Callable[[Op, "Schedule"], tuple]]] = {}
_COMPOSED: dict[str, OpKind] = {}


def register_op_kind(kind: OpKind, *, replace: bool = False) -> OpKind:
    """Add an op kind to the registry (features call this at import time).

    A different kind under a registered name is refused unless ``replace`` (the owner
    re-registering, e.g. on module reload); to make ops of someone else's kind wait for more
    data, use :func:`register_requirement` instead of replacing the kind.
    """
    if kind.name in _KINDS and not replace and _KINDS[kind.name] != kind:
        raise ScheduleError(f"op kind {kind.name!r} is already registered")
    _KINDS[kind.name] = kind
    _COMPOSED.pop(kind.name, None)
    return kind


def unregister_op_kind(name: str) -> None:
    """Remove a kind (tests and plugins that register temporary kinds)."""
    _KINDS.pop(name, None)
    _COMPOSED.pop(name, None)
    _EXTRA_REQUIRES.pop(name, None)


def register_requirement(kinds: Iterable[str], name: str,
                         requires: Callable[[Op, "Schedule"], tuple]) -> None:
    """Make ops of ``kinds`` also wait for the keys ``requires(op, schedule)`` returns.

    Registered under ``name`` (registering the same name again replaces it, so module reloads
    are harmless). The simulator, the validator and the passes see the combined requirement
    through :func:`op_kind`; the kind itself is not replaced, so features compose.
    """
    for k in kinds:
        _EXTRA_REQUIRES.setdefault(k, {})[name] = requires
        _COMPOSED.pop(k, None)


def _compose(base: OpKind, extras: dict) -> OpKind:
    fns = tuple(extras.values())
    orig = base.requires

    def requires(op: Op, sched: "Schedule") -> tuple:
        keys = tuple(orig(op, sched))
        for fn in fns:
            more = fn(op, sched)
            if more:
                keys += tuple(more)
        return keys

    return OpKind(base.name, base.category, base.description, requires, base.produces,
                  base.duration, base.memory, parts=base.parts)


def op_kind(name: str) -> OpKind:
    got = _COMPOSED.get(name)
    if got is not None:
        return got
    try:
        base = _KINDS[name]
    except KeyError:
        raise ScheduleError(f"unknown op kind {name!r}; registered: {', '.join(sorted(_KINDS))}") from None
    extras = _EXTRA_REQUIRES.get(name)
    got = _compose(base, extras) if extras else base
    _COMPOSED[name] = got
    return got


def kind_parts(name: str) -> tuple[OpKind, tuple]:
    """The registered kind ``name`` and the requirement functions features composed onto it:
    :func:`op_kind` is their composition (for compilers that evaluate the parts separately)."""
    op_kind(name)  # unknown kinds raise
    return _KINDS[name], tuple(_EXTRA_REQUIRES.get(name, {}).values())


def op_parts(op: Op) -> tuple:
    """The ops of the built-in kinds ``op`` runs: ``(op,)``, or an overlapped pair's two halves."""
    fn = op_kind(op.kind).parts
    return (op,) if fn is None else fn(op)


def op_kinds() -> dict[str, OpKind]:
    return {name: op_kind(name) for name in _KINDS}


# --- the built-in compute kinds -------------------------------------------------------

def _fwd_requires(op: Op, sched: "Schedule") -> tuple:
    return (("act", op.stage - 1, op.microbatch),) if op.stage > 0 else ()


def _bwd_requires(op: Op, sched: "Schedule") -> tuple:
    own = ("act", op.stage, op.microbatch)
    if op.stage < sched.num_stages - 1:
        return (own, ("grad", op.stage + 1, op.microbatch))
    return (own,)


F = register_op_kind(OpKind(
    "F", "compute", "forward of one stage for one microbatch",
    requires=_fwd_requires,
    produces=lambda op, s: (("act", op.stage, op.microbatch),),
    duration=lambda c, op: c.t_f[op.stage],
    memory=lambda c, op: c.act[op.stage],
    per_stage=True,
))
B = register_op_kind(OpKind(
    "B", "compute", "backward for inputs (activation gradient) only",
    requires=_bwd_requires,
    produces=lambda op, s: (("grad", op.stage, op.microbatch),),
    duration=lambda c, op: c.t_b[op.stage],
    memory=lambda c, op: -c.act[op.stage] * (1.0 - c.w_share(op.stage)),
    per_stage=True,
))
W = register_op_kind(OpKind(
    "W", "compute", "backward for weights, deferred from its B",
    requires=lambda op, s: (("grad", op.stage, op.microbatch),),
    produces=lambda op, s: (("wgrad", op.stage, op.microbatch),),
    duration=lambda c, op: c.t_w[op.stage],
    memory=lambda c, op: -c.act[op.stage] * c.w_share(op.stage),
    per_stage=True,
))
BW = register_op_kind(OpKind(
    "BW", "compute", "full backward (inputs and weights together)",
    requires=_bwd_requires,
    produces=lambda op, s: (("grad", op.stage, op.microbatch), ("wgrad", op.stage, op.microbatch)),
    duration=lambda c, op: c.t_b[op.stage] + c.t_w[op.stage],
    memory=lambda c, op: -c.act[op.stage],
    per_stage=True,
))

# Communication kinds: the one table of what the pipeline's messages carry. SEND_F(s, m) sends the
# output of F(s, m) ("act") to the rank of stage s+1, where RECV_F(s+1, m) receives it as the input
# of F(s+1, m); SEND_B(s, m) sends the input gradient made by B(s, m) ("grad") to stage s-1, where
# RECV_B(s-1, m) receives it for B(s-1, m). The simulator, the comm pass and the runtime's message
# keys all read PIPELINE_MESSAGES.

#: send kind -> (data tag it carries, stage offset of the receiver, matching receive kind)
PIPELINE_MESSAGES: dict[str, tuple[str, int, str]] = {"SEND_F": ("act", +1, "RECV_F"),
                                                      "SEND_B": ("grad", -1, "RECV_B")}
#: receive kind -> its send kind
PIPELINE_RECEIVES: dict[str, str] = {recv: send for send, (_, _, recv) in PIPELINE_MESSAGES.items()}


def pipeline_message(kind: str, stage: int, microbatch: int) -> tuple[str, int, int]:
    """The data key a pipeline send or receive op carries: (tag, producer stage, microbatch)."""
    if kind in PIPELINE_MESSAGES:
        return (PIPELINE_MESSAGES[kind][0], stage, microbatch)
    send = PIPELINE_RECEIVES.get(kind)
    if send is None:
        raise ValueError(f"not a point-to-point op kind: {kind!r}")
    tag, off, _ = PIPELINE_MESSAGES[send]
    return (tag, stage - off, microbatch)


def _send_kind(name: str, what: str) -> OpKind:
    return OpKind(name, "comm", what, requires=lambda op, s: (pipeline_message(op.kind, op.stage, op.microbatch),),
                  per_stage=True)


def _recv_kind(name: str, what: str) -> OpKind:
    return OpKind(name, "comm", what, produces=lambda op, s: (pipeline_message(op.kind, op.stage, op.microbatch),),
                  per_stage=True)


SEND_F = register_op_kind(_send_kind("SEND_F", "send a forward activation to the next stage"))
RECV_F = register_op_kind(_recv_kind("RECV_F", "receive a forward activation from the previous stage"))
SEND_B = register_op_kind(_send_kind("SEND_B", "send an input gradient to the previous stage"))
RECV_B = register_op_kind(_recv_kind("RECV_B", "receive an output gradient from the next stage"))

#: send kind -> (matching receive kind, stage offset of the receiver); features add their own
COMM_PAIRS: dict[str, tuple[str, int]] = {send: (recv, off) for send, (_, off, recv) in PIPELINE_MESSAGES.items()}


#: comm kind -> the channel (process group) it travels on; unlisted kinds use ``"pp"``, the
#: pipeline group. Point-to-point matches in order within one channel, and a run of
#: consecutive comm ops of one channel is one batch.
COMM_CHANNELS: dict[str, str] = {}
#: send kinds whose receiver is ``op.peer`` itself (e.g. BPipe's partner rank), not the rank
#: of stage s+offset; the feature that registers them checks its peers.
PEER_ROUTED: set[str] = set()


def register_comm_pair(send: str, recv: str, stage_offset: int, *, channel: str = "pp",
                       peer_routed: bool = False) -> None:
    """Declare that ``send`` on stage s is received by ``recv`` on stage s+offset (on the rank
    of that stage, or on ``op.peer`` when ``peer_routed``), over ``channel``."""
    COMM_PAIRS[send] = (recv, stage_offset)
    if channel != "pp":
        COMM_CHANNELS[send] = COMM_CHANNELS[recv] = channel
    if peer_routed:
        PEER_ROUTED.add(send)


def comm_channel(kind: str) -> str:
    """The channel (process group) of a comm kind: ``"pp"`` unless registered otherwise."""
    return COMM_CHANNELS.get(kind, "pp")


def matching_recv(op: Op) -> tuple[str, int, int]:
    """(kind, stage, microbatch) of the receive that matches send ``op``."""
    recv, off = COMM_PAIRS[op.kind]
    return recv, op.stage + off, op.microbatch


# --- placements ------------------------------------------------------------------------

def loop_placement(p: int, v: int = 1) -> tuple[int, ...]:
    """Stage s on rank s mod p (1F1B, interleaved 1F1B, ZB-H1/H2)."""
    return tuple(s % p for s in range(p * v))


def v_placement(p: int) -> tuple[int, ...]:
    """Two chunks per rank in a V: rank r holds stages r and 2p-1-r."""
    return tuple(range(p)) + tuple(reversed(range(p)))


def split_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Transformer layers per stage, as even as possible; when the count does not divide, the
    middle stages get the extra layers first, then the first and the last (which also hold the
    embedding and the loss). One rule for the runtime, the Megatron-LM integration and the planner."""
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = list(range(1, num_stages - 1)) + [0, num_stages - 1]   # middle stages first
    for s in order[:extra]:
        counts[s] += 1
    return tuple(counts)


def placement_kind(placement: Sequence[int]) -> str:
    p = max(placement) + 1
    if tuple(placement) == v_placement(p):
        return "v"
    if tuple(placement) == loop_placement(p, len(placement) // p):
        return "loop"
    return "custom"


# --- schedule --------------------------------------------------------------------------

@dataclass
class Schedule:
    """Ordered op lists per rank plus a placement. ``meta`` holds generator details."""

    name: str
    num_microbatches: int
    placement: tuple[int, ...]
    ops: list[list[Op]]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.placement = tuple(int(r) for r in self.placement)

    @property
    def num_ranks(self) -> int:
        return len(self.ops)

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def chunks_per_rank(self) -> int:
        return self.num_stages // self.num_ranks

    def stages_of(self, rank: int) -> list[int]:
        """Stages held by ``rank`` in chunk order (chunk 0 first)."""
        return [s for s, r in enumerate(self.placement) if r == rank]

    def chunk_of(self, stage: int) -> int:
        return self.stages_of(self.placement[stage]).index(stage)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage]

    def all_ops(self) -> Iterator[Op]:
        for rank_ops in self.ops:
            yield from rank_ops

    def compute_ops(self, rank: int) -> list[Op]:
        return [op for op in self.ops[rank] if op_kind(op.kind).category == "compute"]

    def has_comm(self) -> bool:
        return any(op_kind(op.kind).category == "comm" for op in self.all_ops())

    def without(self, categories: Iterable[str]) -> "Schedule":
        """A copy without the ops of the given categories (e.g. drop comm for plotting)."""
        cats = set(categories)
        ops = [[op for op in r if op_kind(op.kind).category not in cats] for r in self.ops]
        return Schedule(self.name, self.num_microbatches, self.placement, ops, dict(self.meta))

    def to_dict(self) -> dict:
        return {
            "format": "megatron_pp_ext.schedule/1",
            "name": self.name,
            "num_microbatches": self.num_microbatches,
            "placement": list(self.placement),
            "meta": self.meta,
            "ops": [[op.to_dict() for op in r] for r in self.ops],
        }

    @staticmethod
    def from_dict(d: dict) -> "Schedule":
        if d.get("format", "").split("/")[0] != "megatron_pp_ext.schedule":
            raise ScheduleError("not a megatron_pp_ext schedule JSON (missing 'format' field)")
        return Schedule(d["name"], int(d["num_microbatches"]), tuple(d["placement"]),
                        [[Op.from_dict(o) for o in r] for r in d["ops"]], dict(d.get("meta", {})))

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(o) for o in ops) for r, ops in enumerate(self.ops))
