"""Vocabulary parallelism in the schedule IR: op kinds, a pass that adds them to any schedule
family, the validator check (torch-free).

Op kinds (``h`` = the rank's *home* stage, its lowest; ``L`` the last stage; one op per
microbatch ``m`` and rank unless said otherwise):

* ``VEF(h, m)``: this rank's partial lookup of the input embedding; produces ``("ve", h, m)``.
* ``VEIN(0, m)`` (rank of stage 0): waits for every rank's partial lookup (the sum arrives
  there); comes before ``F(0, m)`` in that rank's list.
* ``VS(h, m)``: the S pass; needs the last stage's output ``("act", L, m)`` (broadcast to every
  rank); produces ``("vs", h, m)`` (the shard statistics, and Algorithm 2's input-gradient
  terms). Holds ``vocab_s_mem`` units (softmax slice, x) until its T. ``VSE``: the same for
  forward-only evaluation (keeps nothing).
* ``VT(h, m)``: the T pass (weight gradient; Algorithm 1 also the partial input gradient);
  needs every rank's ``("vs", ., m)`` (the first barrier); produces ``("vt", h, m)``.
* ``VLOSS(L, m)`` (rank of stage L): the loss from the reduced statistics; needs every rank's
  ``("vs", ., m)`` and, with Algorithm 1 in training, every ``("vt", ., m)`` (the second
  barrier: the input gradient it hands to the backward); comes before ``B(L, m)`` / ``BW(L, m)``.
* ``VEB(h, m)``: the embedding gradient; needs ``("grad", 0, m)`` (broadcast from stage 0).

Cross-rank keys arrive ``comm`` after they are made (the simulator's model of a schedule
without communication ops), so the simulator sees every barrier. Durations and held memory
come from ``CostModel.extra`` (``vocab_s``, ``vocab_t``, ``vocab_loss``, ``vocab_emb_f``,
``vocab_emb_in``, ``vocab_emb_b``, ``vocab_s_mem``; a number or one value per rank; see
:func:`vocab_costs`).

:func:`insert_vocab` places the ops with a list scheduler that replays the base schedule: each
rank keeps its base order of F/B/W, runs an S (Algorithm 1: also a T) as soon as its input
is there, and when its next base op waits for a barrier it runs the next F (or a W, or a B of
another stage) ahead, up to ``extra_inflight`` microbatches of activation above the base
schedule's peak (Algorithm 1: 2, Algorithm 2: 1, the paper's p+2 / p+1). The same slack can
instead be built into the base order: every backward moved after 1 (2) more forwards — the
extra warm-up microbatches of the paper's 1F1B schedules — generalised to every family
(:func:`shift_backwards`). Variants (run-ahead or shifted warm-up; S before or after a ready
transformer op; T before or after) are simulated and the fastest is kept (then the one with
less memory); a variant whose replay cannot finish is dropped.
:func:`build_vocab_schedule` builds base + pass + point-to-point communication and validates.

With communication inserted (what the runtime executes), the collectives are not ops: they
are started inside the producing passes and waited for by the consuming ones. The validator
check then rebuilds the schedule with one send/receive per cross-rank dependency, placed by the
comm pass's rule (send after its producer, receive before the first compute op that starts
after the send), and runs the blocking deadlock proof on it.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from ...schedule.costs import CostModel
from ...schedule.ir import (Op, OpKind, Schedule, ScheduleError, op_kind, register_comm_pair,
                            register_op_kind)
from ...schedule.simulate import DeadlockError, SimResult, simulate
from ...schedule.validate import ValidationError, register_check
from .config import VocabParallelConfig
from .kinds import VEB, VEF, VEIN, VLOSS, VOCAB_KINDS, VS, VSE, VT, has_vocab, vocab_meta

__all__ = ["VOCAB_KINDS", "VOCAB_COMM_KINDS", "insert_vocab", "build_vocab_schedule", "vocab_costs", "has_vocab",
           "check_vocab", "vocab_meta", "strip_vocab", "with_vocab_comm", "simulate_vocab", "forward_only_vocab",
           "home_stages", "VocabPolicy", "shift_backwards"]

_COST_KEYS = {VEF: "vocab_emb_f", VEIN: "vocab_emb_in", VS: "vocab_s", VSE: "vocab_s", VT: "vocab_t",
              VLOSS: "vocab_loss", VEB: "vocab_emb_b"}


# --- helpers on placements and metadata ---------------------------------------------------------

@lru_cache(maxsize=256)
def home_stages(placement: tuple) -> tuple:
    """Per rank, the stage its vocabulary ops are attached to (its lowest stage)."""
    p = max(placement) + 1
    return tuple(min(s for s, r in enumerate(placement) if r == rank) for rank in range(p))


def _full(sched: Schedule) -> bool:
    """Whether cross-rank vocabulary keys are listed (no comm ops, or the augmented proof schedule)."""
    return not sched.meta.get("comm_inserted") or bool(sched.meta.get("vocab_comm"))


def _local(op: Op, sched: Schedule, keys: list) -> tuple:
    if _full(sched):
        return tuple(keys)
    pl = sched.placement
    return tuple(k for k in keys if pl[k[1]] == op.rank)


def _all(tag: str, sched: Schedule, m: int) -> list:
    return [(tag, h, m) for h in home_stages(sched.placement)]


def _cost_value(c: CostModel, key: str, rank: int) -> float:
    v = c.extra.get(key)
    if v is None:
        v = _default_costs(c).get(key, 0.0)
    if isinstance(v, (list, tuple)):
        return float(v[rank])
    return float(v)


_DEFAULTS_CACHE: dict = {}


def _default_costs(c: CostModel) -> dict:
    """Defaults when a cost model has no vocabulary entries: one shard matmul = 10% of a rank's
    forward; Algorithm 1: S = 1, T = 2 matmuls; Algorithm 2: S = 2, T = 1 (the caller sets
    ``vocab_algorithm`` in ``extra``)."""
    key = id(c)
    got = _DEFAULTS_CACHE.get(key)
    if got is not None and got[0] is c:
        return got[1]
    p = max(1, int(c.extra.get("vocab_ranks", 0)) or 1)
    per_rank_f = sum(c.t_f) / p if c.extra.get("vocab_ranks") else max(c.t_f)
    u = 0.1 * per_rank_f
    alg = int(c.extra.get("vocab_algorithm", 2))
    d = {"vocab_s": u * (1 if alg == 1 else 2), "vocab_t": u * (2 if alg == 1 else 1), "vocab_loss": 0.0,
         "vocab_emb_f": 0.0, "vocab_emb_in": 0.0, "vocab_emb_b": 0.0, "vocab_s_mem": 0.0}
    if len(_DEFAULTS_CACHE) > 256:
        _DEFAULTS_CACHE.clear()
    _DEFAULTS_CACHE[key] = (c, d)
    return d


def vocab_costs(cost: CostModel, *, s: float | Sequence[float] | None = None, t: float | Sequence[float] | None = None,
                loss: float | None = None, emb_f: float | None = None, emb_in: float | None = None,
                emb_b: float | None = None, s_mem: float | Sequence[float] | None = None,
                algorithm: int | None = None, ranks: int | None = None) -> CostModel:
    """A copy of ``cost`` with vocabulary-pass durations (time units of ``cost``, per rank) and
    the memory an S holds until its T (activation units). Unset entries keep their value or the
    defaults (one shard matmul = 10% of a rank's forward)."""
    extra = dict(cost.extra)
    for key, val in (("vocab_s", s), ("vocab_t", t), ("vocab_loss", loss), ("vocab_emb_f", emb_f),
                     ("vocab_emb_in", emb_in), ("vocab_emb_b", emb_b), ("vocab_s_mem", s_mem),
                     ("vocab_algorithm", algorithm), ("vocab_ranks", ranks)):
        if val is not None:
            if isinstance(val, (list, tuple)):
                val = tuple(float(x) for x in val)
                if any(x < 0 for x in val):
                    raise ScheduleError(f"{key}: costs must be >= 0, got {val}")
            elif float(val) < 0:
                raise ScheduleError(f"{key}: cost must be >= 0, got {val}")
            extra[key] = val
    return cost.with_(extra=extra)


def _dur(kind: str):
    key = _COST_KEYS[kind]
    return lambda c, op: _cost_value(c, key, op.rank)


# --- op kinds ----------------------------------------------------------------------------------

def _vs_requires(op: Op, s: Schedule) -> tuple:
    return _local(op, s, [("act", s.num_stages - 1, op.microbatch)])


def _vt_requires(op: Op, s: Schedule) -> tuple:
    return _local(op, s, _all("vs", s, op.microbatch))


def _vloss_requires(op: Op, s: Schedule) -> tuple:
    keys = _all("vs", s, op.microbatch)
    meta = vocab_meta(s)
    if (meta.get("algorithm", 2) == 1 or meta.get("one_queue")) and not s.meta.get("forward_only"):
        keys += _all("vt", s, op.microbatch)
    return _local(op, s, keys)


def _vein_requires(op: Op, s: Schedule) -> tuple:
    return _local(op, s, _all("ve", s, op.microbatch))


def _veb_requires(op: Op, s: Schedule) -> tuple:
    return _local(op, s, [("grad", 0, op.microbatch)])


register_op_kind(OpKind(
    VEF, "compute", "vocabulary parallel: this rank's partial lookup of the input embedding",
    produces=lambda op, s: (("ve", op.stage, op.microbatch),), duration=_dur(VEF),
    communicators=("vocab-emb",)), replace=True)
register_op_kind(OpKind(
    VEIN, "compute", "vocabulary parallel: the summed input embedding arrives at the first stage (before its F)",
    requires=_vein_requires, duration=_dur(VEIN)), replace=True)
register_op_kind(OpKind(
    VS, "compute", "vocabulary parallel: S pass (shard logits, softmax statistics; Alg. 2 also A_i, B_i)",
    requires=_vs_requires, produces=lambda op, s: (("vs", op.stage, op.microbatch),), duration=_dur(VS),
    memory=lambda c, op: _cost_value(c, "vocab_s_mem", op.rank), communicators=("vocab-x", "vocab-stats")),
    replace=True)
register_op_kind(OpKind(
    VSE, "compute", "vocabulary parallel: S pass of forward-only evaluation (statistics only)",
    requires=_vs_requires, produces=lambda op, s: (("vs", op.stage, op.microbatch),), duration=_dur(VSE),
    communicators=("vocab-x", "vocab-stats")), replace=True)
register_op_kind(OpKind(
    VT, "compute", "vocabulary parallel: T pass (shard weight gradient; Alg. 1 also the partial input gradient)",
    requires=_vt_requires, produces=lambda op, s: (("vt", op.stage, op.microbatch),), duration=_dur(VT),
    memory=lambda c, op: -_cost_value(c, "vocab_s_mem", op.rank), communicators=("vocab-dx",)), replace=True)
register_op_kind(OpKind(
    VLOSS, "compute", "vocabulary parallel: the loss from the reduced statistics (before the last stage's B)",
    requires=_vloss_requires, produces=lambda op, s: (("vloss", op.stage, op.microbatch),), duration=_dur(VLOSS)),
    replace=True)
register_op_kind(OpKind(
    VEB, "compute", "vocabulary parallel: input-embedding gradient of this rank's shard",
    requires=_veb_requires, duration=_dur(VEB), communicators=("vocab-embgrad",)), replace=True)


# Communication kinds of the *proof* schedule only (with_vocab_comm): one message per
# cross-rank dependency of a collective. The stage field holds the receiving rank's home stage.
_VCOMM = {  # tag -> (send kind, recv kind)
    "act": ("SEND_VX", "RECV_VX"), "vs": ("SEND_VS", "RECV_VS"), "vt": ("SEND_VT", "RECV_VT"),
    "ve": ("SEND_VE", "RECV_VE"), "grad": ("SEND_VG", "RECV_VG"),
}
VOCAB_COMM_KINDS = tuple(k for pair in _VCOMM.values() for k in pair)


def _sent_key(tag: str, op: Op, s: Schedule, src: int) -> tuple:
    if tag == "act":
        return ("act", s.num_stages - 1, op.microbatch)
    if tag == "grad":
        return ("grad", 0, op.microbatch)
    return (tag, home_stages(s.placement)[src], op.microbatch)


for _tag, (_send, _recv) in _VCOMM.items():
    register_op_kind(OpKind(
        _send, "comm", f"vocabulary parallel (deadlock proof): {_tag} of a collective, sent",
        requires=lambda op, s, _t=_tag: (_sent_key(_t, op, s, op.rank),)), replace=True)
    register_op_kind(OpKind(
        _recv, "comm", f"vocabulary parallel (deadlock proof): {_tag} of a collective, received",
        produces=lambda op, s, _t=_tag: (_sent_key(_t, op, s, op.peer),)), replace=True)
    register_comm_pair(_send, _recv, 0)


def strip_vocab(schedule: Schedule) -> Schedule:
    """The schedule without its vocabulary ops (and metadata)."""
    ops = [[op for op in r if op.kind not in VOCAB_KINDS and op.kind not in VOCAB_COMM_KINDS] for r in schedule.ops]
    meta = {k: v for k, v in schedule.meta.items() if k not in ("vocab", "vocab_comm")}
    return Schedule(schedule.name.split("+vocab")[0], schedule.num_microbatches, schedule.placement, ops, meta)


# --- the pass -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class VocabPolicy:
    """Knobs of the list scheduler (the pass tries several and keeps the fastest)."""

    s_first: bool = True          # an S that is ready goes before a ready transformer op
    t_first: bool = True          # Algorithm 1: a ready T goes before a ready transformer op
    extra_inflight: int = 1       # activation units a rank may run ahead of its base peak
    emb_depth: int = 2            # partial embeddings computed ahead of the first stage's F
    shift: int = 0                # every backward moved after this many more forwards (extra warm-up)


def shift_backwards(ops: Sequence[Op], k: int) -> list[Op]:
    """The rank's base order with every backward (B, BW, W) moved after ``k`` more forwards:
    ``k`` extra warm-up microbatches, as the paper does for 1F1B (relative orders kept)."""
    if k <= 0:
        return list(ops)
    out: list[Op] = []
    pending: list[list] = []
    for op in ops:
        if op.kind == "F":
            out.append(op)
            for item in pending:
                item[1] -= 1
            while pending and pending[0][1] <= 0:
                out.append(pending.pop(0)[0])
        else:
            pending.append([op, k])
    out.extend(item[0] for item in pending)
    return out


class _Replay:
    """List scheduler: the base order per rank, vocabulary ops inserted, F/W/B run ahead of a
    backward that waits for a barrier (memory-capped)."""

    def __init__(self, base: Schedule, cost: CostModel, cfg: VocabParallelConfig, policy: VocabPolicy,
                 forward_only: bool):
        self.base, self.cost, self.cfg, self.pol, self.fwd = base, cost, cfg, policy, forward_only
        self.p, self.S, self.M = base.num_ranks, base.num_stages, base.num_microbatches
        self.L = self.S - 1
        self.pl = base.placement
        self.homes = home_stages(self.pl)
        self.first, self.last = self.pl[0], self.pl[self.L]
        self.meta = dict(base.meta, vocab=dict(cfg.to_dict(), policy=policy.__dict__))
        if forward_only:
            self.meta["forward_only"] = True
        # a schedule object used only to resolve requires/produces of the result's kinds
        self.view = Schedule(base.name, self.M, self.pl, [[] for _ in range(self.p)], self.meta)
        self.base_ops = [[op for op in base.ops[r] if op_kind(op.kind).category == "compute"]
                         for r in range(self.p)]
        for r in range(self.p):
            bad = [op for op in self.base_ops[r] if op.kind not in ("F", "B", "W", "BW")]
            if bad:
                raise ScheduleError(f"vocabulary parallel: the base schedule has op {bad[0]} on rank {r}; insert "
                                    "vocabulary parallelism before other features' ops")
        base_sim = simulate(Schedule(base.name, self.M, self.pl, self.base_ops, dict(base.meta)), cost)
        self.unit = [sum(cost.act[s] for s in base.stages_of(r)) for r in range(self.p)]
        k = policy.shift + policy.extra_inflight
        self.limit = [base_sim.peak_memory[r] + k * self.unit[r] + 1e-9 for r in range(self.p)]
        if policy.shift:
            self.base_ops = [shift_backwards(o, policy.shift) for o in self.base_ops]

    def _dur(self, op: Op) -> float:
        return op_kind(op.kind).duration(self.cost, op)

    def _mem(self, op: Op) -> float:
        return op_kind(op.kind).memory(self.cost, op)

    def run(self) -> Schedule:
        p, M = self.p, self.M
        produced: dict[tuple, tuple[int, float]] = {}
        comm = self.cost.comm
        out: list[list[Op]] = [[] for _ in range(p)]
        time = [0.0] * p
        mem = [0.0] * p
        ptr = [0] * p
        ahead: list[set] = [set() for _ in range(p)]
        nxt = {k: [0] * p for k in ("s", "t", "ef", "eb", "loss")}
        f0_started = [0]          # F(0, m) started on the first rank
        need_t = not self.fwd
        emb = self.cfg.input_embedding
        blocked = [False] * p
        wake: list = [None] * p
        view = self.view
        # one queue, Algorithm 2: T posts the input-gradient all-reduce when it starts
        early_vt = self.cfg.one_queue and self.cfg.algorithm == 2

        def key_time(key, r):
            got = produced.get(key)
            if got is None:
                return None
            return got[1] + (comm if got[0] != r else 0.0)

        def ready_at(keys, r):
            t = 0.0
            for k in keys:
                kt = key_time(k, r)
                if kt is None:
                    return None
                t = max(t, kt)
            return t

        req_cache: dict = {}

        def full_requires(op):
            got = req_cache.get(op)
            if got is None:
                got = req_cache[op] = op_kind(op.kind).requires(op, view)
            return got

        op_cache: dict = {}

        def vocab_op(kind, r, m):
            key = (kind, r, m)
            got = op_cache.get(key)
            if got is None:
                stage = {VEIN: 0, VLOSS: self.L}.get(kind, self.homes[r])
                got = op_cache[key] = Op(kind, stage, m, r)
            return got

        def compound(r, op):
            """The ops to emit for base op ``op`` (with the vocabulary op glued before it)."""
            if emb and op.kind == "F" and op.stage == 0:
                return [vocab_op(VEIN, r, op.microbatch), op]
            if not self.fwd and op.kind in ("B", "BW") and op.stage == self.L:
                return [vocab_op(VLOSS, r, op.microbatch), op]
            return [op]

        def group_ready(r, ops):
            if len(ops) == 1:
                return ready_at(full_requires(ops[0]), r)
            t = 0.0
            for op in ops:
                made = own_made(ops, op)
                keys = [k for k in full_requires(op) if k not in made]
                rt = ready_at(keys, r)
                if rt is None:
                    return None
                t = max(t, rt)
            return t

        def own_made(ops, upto):
            made = set()
            for o in ops:
                if o is upto:
                    break
                made.update(op_kind(o.kind).produces(o, view))
            return made

        def next_base(r):
            i = ptr[r]
            ops = self.base_ops[r]
            while i < len(ops) and i in ahead[r]:
                i += 1
            ptr[r] = i
            return i

        def done(r):
            if next_base(r) < len(self.base_ops[r]):
                return False
            if nxt["s"][r] < M or (need_t and nxt["t"][r] < M):
                return False
            if emb and (nxt["ef"][r] < M or (need_t and nxt["eb"][r] < M)):
                return False
            if self.fwd and r == self.last and nxt["loss"][r] < M:
                return False
            return True

        scan_cache: dict = {}

        def scan(r, i):
            """Index of the first F, W and B/BW after base position i not yet run (cached until
            the rank emits again)."""
            key = (r, i, len(out[r]))
            got = scan_cache.get(r)
            if got is not None and got[0] == key:
                return got[1]
            ops = self.base_ops[r]
            first_f = first_w = first_b = None
            for j in range(i + 1, len(ops)):
                if j in ahead[r]:
                    continue
                k = ops[j].kind
                if k == "W" and first_w is None:
                    first_w = j
                elif k == "F" and first_f is None:
                    first_f = j
                elif k in ("B", "BW") and first_b is None:
                    first_b = j
                if first_f is not None and first_w is not None and first_b is not None:
                    break
            scan_cache[r] = (key, (first_f, first_w, first_b))
            return first_f, first_w, first_b

        def candidates(r):
            """(priority, ops, index into base or None, kind) in priority order."""
            pol = self.pol
            c = []
            i = next_base(r)
            base_op = self.base_ops[r][i] if i < len(self.base_ops[r]) else None
            alg1 = self.cfg.algorithm == 1 or self.cfg.one_queue   # (T posts the input-gradient reduction)
            backlog_t = nxt["s"][r] - nxt["t"][r]
            if need_t and alg1 and pol.t_first and nxt["t"][r] < nxt["s"][r]:
                c.append(("t", [vocab_op(VT, r, nxt["t"][r])], None))
            if pol.s_first and nxt["s"][r] < M:
                c.append(("s", [vocab_op(VSE if self.fwd else VS, r, nxt["s"][r])], None))
            if self.cfg.one_queue and emb and need_t and nxt["eb"][r] < M:
                # one queue: the embedding gradient is consumed when it arrives, so that the first
                # stage's next broadcast of it does not wait for this rank's later progress
                c.append(("eb", [vocab_op(VEB, r, nxt["eb"][r])], None))
            if self.fwd and r == self.last and nxt["loss"][r] < nxt["s"][r]:
                c.append(("loss", [vocab_op(VLOSS, r, nxt["loss"][r])], None))
            if emb and nxt["ef"][r] < M and nxt["ef"][r] <= f0_started[0] + 1:
                c.append(("ef", [vocab_op(VEF, r, nxt["ef"][r])], None))
            if need_t and nxt["t"][r] < nxt["s"][r] and backlog_t > pol.extra_inflight + 1:
                c.append(("t", [vocab_op(VT, r, nxt["t"][r])], None))
            if base_op is not None:
                c.append(("base", compound(r, base_op), i))
            if need_t and alg1 and not pol.t_first and nxt["t"][r] < nxt["s"][r]:
                c.append(("t", [vocab_op(VT, r, nxt["t"][r])], None))
            if not pol.s_first and nxt["s"][r] < M:
                c.append(("s", [vocab_op(VSE if self.fwd else VS, r, nxt["s"][r])], None))
            if emb and nxt["ef"][r] < M and nxt["ef"][r] < f0_started[0] + pol.emb_depth + pol.extra_inflight:
                c.append(("ef", [vocab_op(VEF, r, nxt["ef"][r])], None))
            if base_op is not None:
                ops = self.base_ops[r]
                first_f, first_w, first_b = scan(r, i)
                if first_w is not None:
                    c.append(("ahead", [ops[first_w]], first_w))
                if first_b is not None and (ops[first_b].stage != base_op.stage or base_op.kind == "F"):
                    c.append(("ahead", compound(r, ops[first_b]), first_b))
                if first_f is not None and mem[r] + self._mem(ops[first_f]) <= self.limit[r]:
                    c.append(("ahead", compound(r, ops[first_f]), first_f))
            if need_t and nxt["t"][r] < nxt["s"][r]:
                c.append(("t", [vocab_op(VT, r, nxt["t"][r])], None))
            if emb and need_t and nxt["eb"][r] < M:
                c.append(("eb", [vocab_op(VEB, r, nxt["eb"][r])], None))
            return c

        def emit(r, what, ops, idx, start):
            t = start
            for op in ops:
                d = self._dur(op)
                out[r].append(op)
                for k in op_kind(op.kind).produces(op, view):
                    produced[k] = (r, t if (op.kind == VT and early_vt) else t + d)
                if op.kind in ("F", "B", "W", "BW"):   # the cap counts transformer activations only
                    mem[r] += self._mem(op)
                if op.kind == "F" and op.stage == 0:
                    f0_started[0] = max(f0_started[0], op.microbatch + 1)
                t += d
            time[r] = t
            if what == "base":
                ptr[r] = idx + 1
            elif what == "ahead":
                ahead[r].add(idx)
            else:
                nxt[what][r] += 1
            for q in range(p):
                blocked[q] = False

        active = set(r for r in range(p) if not done(r))
        guard = 0
        while active:
            guard += 1
            if guard > 50 * (sum(len(o) for o in self.base_ops) + 8 * p * M) + 1000:
                raise ScheduleError("vocabulary pass: the list scheduler does not terminate")
            cand_ranks = [r for r in active if not blocked[r]]
            if not cand_ranks:
                # every rank waits at the same time: advance the one whose next op is known to
                # become ready first
                known = [(wake[r], r) for r in active if wake[r] is not None]
                if not known:
                    raise DeadlockError("vocabulary pass: every rank waits (" + ", ".join(
                        f"rank {r} at {time[r]:g}" for r in sorted(active)) + ")")
                t_w, r_w = min(known)
                time[r_w] = max(time[r_w], t_w)
                blocked[r_w] = False
                continue
            r = min(cand_ranks, key=lambda q: (time[q], q))
            t = time[r]
            cands = candidates(r)
            best = None
            earliest = None
            for what, ops, idx in cands:
                rt = group_ready(r, ops)
                if rt is None:
                    continue
                if rt <= t + 1e-12:
                    best = (what, ops, idx)
                    break
                earliest = rt if earliest is None else min(earliest, rt)
            if best is not None:
                emit(r, *best, t)
                if done(r):
                    active.discard(r)
                continue
            others = [time[q] for q in active if q != r]
            t_other = min(others) if others else None
            if earliest is not None and (t_other is None or earliest <= t_other + 1e-12):
                time[r] = earliest
                continue
            if t_other is not None and t_other > t + 1e-12:
                time[r] = t_other if earliest is None else min(t_other, earliest)
                continue
            blocked[r] = True
            wake[r] = earliest
        name = f"{self.base.name}+vocab{self.cfg.algorithm}"
        return Schedule(name, M, self.pl, out, dict(self.meta))


def insert_vocab(schedule: Schedule, cost: CostModel, config: VocabParallelConfig | None = None, *,
                 forward_only: bool | None = None, policies: Sequence[VocabPolicy] | None = None,
                 return_all: bool = False):
    """Add the vocabulary ops to a compute-only ``schedule`` (any family), placed by the cost
    model; returns the fastest of the tried policies (then the one with less memory)."""
    if schedule.has_comm():
        raise ScheduleError("insert_vocab works on a schedule without communication ops; insert communication "
                            "afterwards (build_vocab_schedule does both)")
    if has_vocab(schedule):
        raise ScheduleError(f"schedule {schedule.name!r} already has vocabulary-parallel ops")
    cfg = config or VocabParallelConfig()
    fwd = bool(schedule.meta.get("forward_only")) if forward_only is None else bool(forward_only)
    if fwd and any(op.kind != "F" for op in schedule.all_ops()):
        schedule = forward_only_base(schedule)
    cost = _with_alg(cost, cfg, schedule.num_ranks)
    if policies is None:
        k = cfg.inflight
        tfs = (True, False) if (cfg.algorithm == 1 or cfg.one_queue) and not fwd else (True,)
        policies = [VocabPolicy(s_first=sf, t_first=tf, extra_inflight=k) for sf in (True, False) for tf in tfs]
        if not fwd and k > 0:   # or: k extra warm-up forwards on every rank (the paper's 1F1B)
            policies += [VocabPolicy(s_first=sf, t_first=tf, extra_inflight=0, shift=k)
                         for sf in (True, False) for tf in tfs]
    results = []
    errors = []
    for pol in policies:
        try:
            sched = _Replay(schedule, cost, cfg, pol, fwd).run()
            res = simulate(sched, cost)
        except DeadlockError as e:
            errors.append(f"{pol}: {e}")
            continue
        results.append((round(res.makespan, 9), round(res.max_peak_memory, 9), len(results), sched, res))
    if not results:
        raise ScheduleError(f"vocabulary pass: no placement of the vocabulary ops in {schedule.name!r} works: "
                            + "; ".join(errors))
    results.sort(key=lambda x: x[:3])
    if return_all:
        return [(r[3], r[4]) for r in results]
    return results[0][3]


def _with_alg(cost: CostModel, cfg: VocabParallelConfig, p: int) -> CostModel:
    extra = dict(cost.extra)
    if extra.get("vocab_algorithm") == cfg.algorithm and extra.get("vocab_ranks") == p:
        return cost
    extra.setdefault("vocab_algorithm", cfg.algorithm)
    extra.setdefault("vocab_ranks", p)
    return cost.with_(extra=extra)


def forward_only_base(schedule: Schedule) -> Schedule:
    """The forward ops of a (training) schedule, in the same order."""
    base = schedule.without(["comm"])
    ops = [[op for op in r if op.kind == "F"] for r in base.ops]
    meta = {k: v for k, v in base.meta.items() if k != "comm_inserted"}
    meta["forward_only"] = True
    return Schedule(base.name, base.num_microbatches, base.placement, ops, meta)


def forward_only_vocab(schedule: Schedule, cost: CostModel | None = None,
                       config: VocabParallelConfig | None = None, *, with_comm: bool = True) -> Schedule:
    """The forward-only (evaluation) schedule of a vocabulary-parallel training schedule."""
    from ...schedule.validate import validate

    meta = vocab_meta(schedule)
    cfg = config or VocabParallelConfig(algorithm=int(meta.get("algorithm", 2)),
                                        label_smoothing=float(meta.get("label_smoothing", 0.0)),
                                        input_embedding=bool(meta.get("input_embedding", True)),
                                        one_queue=bool(meta.get("one_queue", False)),
                                        one_queue_comms=int(meta.get("one_queue_comms", 1)))
    base = forward_only_base(strip_vocab(schedule))
    cost = cost or CostModel.uniform(base.num_stages, base.chunks_per_rank)
    sched = insert_vocab(base, cost, cfg, forward_only=True)
    if with_comm:
        sched = _insert_comm_proved(sched, cost)
        if cfg.one_queue:
            from .one_queue import place_posts
            sched.meta["vocab_posts"] = place_posts(sched, cost, cfg.one_queue_comms)
    validate(sched, cost)
    return sched


# --- communication and the deadlock proof -------------------------------------------------------

def _compute_only(sched: Schedule) -> Schedule:
    base = sched.without(["comm"])
    base.meta = {k: v for k, v in base.meta.items() if k not in ("comm_inserted", "vocab_comm")}
    return base


def with_vocab_comm(sched: Schedule, cost: CostModel) -> Schedule:
    """``sched`` (with point-to-point communication) plus one send/receive per cross-rank
    dependency of the vocabulary collectives, placed by the comm pass's safe rule against the
    compute-only timeline: the schedule the deadlock proof and the timing model run on."""
    if not sched.meta.get("comm_inserted"):
        raise ScheduleError("with_vocab_comm needs a schedule with communication inserted")
    base = _compute_only(sched)
    times = simulate(base, cost).times
    pl = sched.placement
    homes = home_stages(pl)
    p = sched.num_ranks
    full_view = Schedule(base.name, base.num_microbatches, pl, [[] for _ in range(p)], base.meta)
    # compute-op positions and start times per rank (in list order, made monotone)
    comp_idx: list[dict] = []
    starts: list[list[float]] = []
    for r in range(p):
        idx, st, cur = {}, [], 0.0
        for i, op in enumerate(base.ops[r]):
            idx[op] = i
            cur = max(cur, times[op][0])
            st.append(cur)
        comp_idx.append(idx)
        starts.append(st)
    producer: dict[tuple, Op] = {}
    for r in range(p):
        for op in base.ops[r]:
            for k in op_kind(op.kind).produces(op, full_view):
                producer[k] = op
    gaps: list[dict[int, list]] = [defaultdict(list) for _ in range(p)]
    seen = set()
    for r in range(p):
        for op in base.ops[r]:
            if op.kind not in VOCAB_KINDS:
                continue
            for key in op_kind(op.kind).requires(op, full_view):
                src_op = producer.get(key)
                if src_op is None:
                    raise ValidationError(f"schedule {sched.name!r}: {op} on rank {r} needs {key}, which no op makes")
                a = src_op.rank
                if a == r or (key, r) in seen:
                    continue
                seen.add((key, r))
                send_kind, recv_kind = _VCOMM[key[0]]
                t = times[src_op][1]
                sort = (t, send_kind, key[1], key[2], a, r)
                gaps[a][comp_idx[a][src_op] + 1].append((sort, Op(send_kind, homes[r], key[2], a, r)))
                k = bisect.bisect_left(starts[r], t)
                k = min(k, comp_idx[r][op])
                gaps[r][k].append((sort, Op(recv_kind, homes[r], key[2], r, a)))
    new_ops = []
    for r in range(p):
        out: list[Op] = []
        ci = 0
        pending = gaps[r]
        for op in sched.ops[r]:
            if op_kind(op.kind).category != "comm":
                out.extend(o for _, o in sorted(pending.get(ci, ()), key=lambda x: x[0]))
                ci += 1
            out.append(op)
        out.extend(o for _, o in sorted(pending.get(ci, ()), key=lambda x: x[0]))
        new_ops.append(out)
    meta = dict(sched.meta, vocab_comm=True)
    return Schedule(sched.name, sched.num_microbatches, pl, new_ops, meta)


def simulate_vocab(sched: Schedule, cost: CostModel, *, comm_model: str = "eager") -> SimResult:
    """Simulate with the vocabulary collectives modelled (adds their messages to a schedule with
    communication; a compute-only schedule already models them)."""
    if sched.meta.get("comm_inserted") and not sched.meta.get("vocab_comm") and has_vocab(sched):
        sched = with_vocab_comm(sched, cost)
    return simulate(sched, cost, comm_model=comm_model)


def _insert_comm_proved(sched: Schedule, cost: CostModel) -> Schedule:
    """Point-to-point communication (early receives if the proof with the vocabulary messages
    holds, else the comm pass's safe rule)."""
    from ...schedule.passes.comm import insert_comm

    last_err = None
    for placement in ("early", "safe"):
        cand = insert_comm(sched, cost, recv_placement=placement)
        try:
            simulate(with_vocab_comm(cand, cost), cost, comm_model="blocking")
            return cand
        except DeadlockError as e:
            last_err = e
    raise ValidationError(f"schedule {sched.name!r}: no deadlock-free communication order found: {last_err}")


def build_vocab_schedule(name: str, pp: int, microbatches: int, *, chunks: int = 1,
                         costs: Sequence[float] | CostModel = (1.0, 1.0, 1.0, 0.0),
                         memory_budget: float | str | None = None, config: VocabParallelConfig | None = None,
                         with_comm: bool = True, forward_only: bool = False,
                         options: dict | None = None) -> tuple[Schedule, CostModel]:
    """A registered schedule with vocabulary parallelism: base (validated) -> :func:`insert_vocab`
    -> point-to-point communication -> validated. ``costs`` may carry the vocabulary costs
    (:func:`vocab_costs`); otherwise defaults are used."""
    from ...schedule.registry import build_schedule
    from ...schedule.validate import validate

    cfg = config or VocabParallelConfig()

    def build(opts: dict | None) -> tuple[Schedule, CostModel]:
        base, cost = build_schedule(name, pp, microbatches, chunks=chunks, costs=costs,
                                    memory_budget=memory_budget, with_comm=False, options=opts)
        cost = _with_alg(cost, cfg, pp)
        if forward_only:
            base = forward_only_base(base)
        return insert_vocab(base, cost, cfg, forward_only=forward_only), cost

    if cfg.one_queue and with_comm:
        return _build_one_queue(name, pp, microbatches, chunks=chunks, costs=costs, memory_budget=memory_budget,
                                cfg=cfg, forward_only=forward_only, options=options)
    sched, cost = build(options)
    if "polished" in sched.meta and "polish" not in (options or {}):
        # the polish tuned the base's order without the vocabulary passes, which need slack
        # of their own: keep whichever base makes the faster vocabulary schedule
        other, cost2 = build({**(options or {}), "polish": False})
        if simulate(other, cost2).makespan < simulate(sched, cost).makespan - 1e-9:
            sched, cost = other, cost2
    if with_comm:
        sched = _insert_comm_proved(sched, cost)
    validate(sched, cost)
    return sched, cost


def _build_one_queue(name: str, pp: int, microbatches: int, *, chunks, costs, memory_budget, cfg, forward_only,
                     options) -> tuple[Schedule, CostModel]:
    """``build_vocab_schedule`` for one hardware queue: every variant of the pass (policies, the
    polished and unpolished base) with each receive placement, the collectives' posts placed and
    proved (:mod:`.one_queue`); the variant with the shortest one-queue makespan is kept."""
    from ...schedule.passes.comm import insert_comm
    from ...schedule.registry import build_schedule
    from ...schedule.validate import validate
    from .one_queue import OneQueueDeadlock, place_posts

    bases = [options]
    if "polish" not in (options or {}):
        bases.append({**(options or {}), "polish": False})
    best, errors, seen = None, [], set()
    for opts in bases:
        base, cost = build_schedule(name, pp, microbatches, chunks=chunks, costs=costs,
                                    memory_budget=memory_budget, with_comm=False, options=opts)
        if opts is not options and "polished" not in base.meta:
            continue
        cost = _with_alg(cost, cfg, pp)
        if forward_only:
            base = forward_only_base(base)
        for sched, _ in insert_vocab(base, cost, cfg, forward_only=forward_only, return_all=True):
            key = tuple(tuple(r) for r in sched.ops)
            if key in seen:
                continue
            seen.add(key)
            for placement in ("early", "safe"):
                cand = insert_comm(sched, cost, recv_placement=placement)
                try:
                    simulate(with_vocab_comm(cand, cost), cost, comm_model="blocking")
                    entry = place_posts(cand, cost, cfg.one_queue_comms)
                except (DeadlockError, OneQueueDeadlock) as e:
                    errors.append(str(e).splitlines()[0])
                    continue
                if best is None or entry["makespan"] < best[0] - 1e-9:
                    cand.meta["vocab_posts"] = entry
                    best = (entry["makespan"], cand, cost)
    if best is None:
        raise ValidationError(f"schedule {name!r} (vocabulary parallel, one hardware queue): no variant of the pass "
                              f"runs under one queue: {errors[0] if errors else 'no variant'}")
    _, sched, cost = best
    validate(sched, cost)
    return sched, cost


# --- validator check ------------------------------------------------------------------------

def check_vocab(schedule: Schedule, cost: CostModel) -> None:
    """Every rank runs each vocabulary pass once per microbatch, in microbatch order (each
    channel's collectives are matched in order); the embedding reaches stage 0 before its F and
    the loss is ready before the last stage's backward; with communication: deadlock-free with
    the collectives' messages (blocking proof)."""
    if not has_vocab(schedule):
        return
    meta = vocab_meta(schedule)
    fwd = bool(schedule.meta.get("forward_only"))
    emb = bool(meta.get("input_embedding", True))
    M, S = schedule.num_microbatches, schedule.num_stages
    pl = schedule.placement
    first, last = pl[0], pl[S - 1]
    problems: list[str] = []
    want = {VS if not fwd else VSE: "all"}
    if not fwd:
        want[VT] = "all"
    if emb:
        want[VEF] = "all"
        want[VEIN] = "first"
        if not fwd:
            want[VEB] = "all"
    want[VLOSS] = "last"
    for r in range(schedule.num_ranks):
        ops = schedule.ops[r]
        pos = {op: i for i, op in enumerate(ops)}
        for kind, where in want.items():
            mine = [op.microbatch for op in ops if op.kind == kind]
            expect = list(range(M)) if (where == "all" or (where == "first" and r == first)
                                        or (where == "last" and r == last)) else []
            if mine != expect:
                problems.append(f"rank {r}: {kind} ops for microbatches {mine[:6]}{'...' if len(mine) > 6 else ''}, "
                                f"need {expect[:6]}{'...' if len(expect) > 6 else ''} (one per microbatch, in order)")
        extra = [op for op in ops if op.kind in (VS, VSE, VT) and (op.kind == VSE) != fwd]
        if extra:
            problems.append(f"rank {r}: {extra[0]} does not belong in a {'forward-only' if fwd else 'training'} schedule")
        by_key = {(op.kind, op.stage, op.microbatch): i for i, op in enumerate(ops)}
        for m in range(M):
            if emb and r == first:
                a, b = by_key.get((VEIN, 0, m)), by_key.get(("F", 0, m))
                if a is not None and b is not None and a > b:
                    problems.append(f"rank {r}: VEIN of microbatch {m} comes after F(0, {m})")
            if not fwd and r == last:
                a = by_key.get((VLOSS, S - 1, m))
                b = by_key.get(("B", S - 1, m), by_key.get(("BW", S - 1, m)))
                if a is not None and b is not None and a > b:
                    problems.append(f"rank {r}: VLOSS of microbatch {m} comes after the last stage's backward")
        del pos
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValidationError(f"schedule {schedule.name!r} (vocabulary parallel) is invalid:\n  "
                              + "\n  ".join(problems[:8]) + more)
    if schedule.meta.get("comm_inserted") and not schedule.meta.get("vocab_comm"):
        try:
            simulate(with_vocab_comm(schedule, cost), cost, comm_model="blocking")
        except DeadlockError as e:
            raise ValidationError(f"schedule {schedule.name!r}: the vocabulary collectives deadlock with the "
                                  f"point-to-point order:\n{e}") from None
        if meta.get("one_queue"):
            from .one_queue import OneQueueDeadlock, check_posts
            try:
                check_posts(schedule, cost)
            except OneQueueDeadlock as e:
                raise ValidationError(str(e)) from None


register_check(check_vocab)
