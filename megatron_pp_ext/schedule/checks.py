"""The validator's rules 1-3 (:mod:`.validate`): structure, completeness, communication -- one
implementation of each, on the simulator's compiled form of the schedule (:func:`.engine.prepare`).

The compiled form codes the ops of one (kind, stage, rank, peer) on a rank as one template, with
the microbatches it has, and every data key and transfer as an integer id. Each rule is decided
once per template where it depends on the template alone (an op on the wrong rank, a stage out of
range, a send to the wrong rank), and per op on integer ids where it does not (the microbatches of
each (stage, kind), an input received before it is used, the order of the transfers of each pair of
ranks). Nothing is formatted while nothing is wrong: the messages are built, in op order, only for
the problems found. :func:`.validate.validate` and :func:`.simulate.simulate` run them.
"""

from __future__ import annotations

from collections import Counter
from .costs import CostModel
from .engine import Prepared, prepare
from .ir import COMM_PAIRS, PEER_ROUTED, Schedule, ScheduleError, op_kind, op_parts

__all__ = ["ValidationError", "prepare_checked", "problems", "fail",
           "sizes_problems", "structure_problems", "completeness_problems", "comm_problems"]


class ValidationError(ScheduleError):
    """The schedule breaks a rule; the message lists the first problems found."""


def fail(schedule: Schedule, problems: list[str]) -> None:
    """Raise ValidationError listing the first eight ``problems`` (nothing when there are none)."""
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValidationError(f"schedule {schedule.name!r} is invalid:\n  " + "\n  ".join(problems[:8]) + more)


def sizes_problems(schedule: Schedule) -> list[str]:
    """A schedule with no rank or no microbatch: nothing else is checked."""
    p, m = schedule.num_ranks, schedule.num_microbatches
    return [f"need at least one rank and one microbatch (ranks={p}, microbatches={m})"] if p < 1 or m < 1 else []


def problems(prep: Prepared, comm: bool = True) -> list[str]:
    """The problems of the first rule that finds any (structure, completeness, then, with
    ``comm``, communication) on ``prep`` (an :class:`.engine.Prepared`); [] when all pass."""
    return (sizes_problems(prep.schedule) or structure_problems(prep) or completeness_problems(prep)
            or (comm_problems(prep) if comm else []))


def structure_problems(prep: Prepared) -> list[str]:
    """Rule 1: every rank in the placement; an op's rank is its list's, its stage and
    microbatch in range, a compute op on its stage's rank; no op twice."""
    schedule = prep.schedule
    p, S, m = schedule.num_ranks, schedule.num_stages, schedule.num_microbatches
    placement = schedule.placement
    out: list[str] = []
    if sorted(set(placement)) != list(range(p)):
        out.append(f"placement {placement} must use every rank 0..{p - 1}")
    # per template: (listed on another rank, stage out of range, microbatch out of range (an op
    # coded on its own), a compute op on another rank than its stage's)
    why = []
    any_bad = prep._dup
    for tp in prep._tpls:
        s = tp.stage
        w = (tp.rank != tp.r, type(s) is not int or not 0 <= s < S,
             tp.mb is not None and not (type(tp.mb) is int and 0 <= tp.mb < m), False)
        spec = op_kind(tp.kind)
        if not w[1] and spec.category == "compute" and placement[s] != tp.r:
            w = w[:3] + (True,)
        if spec.parts is not None and not any(w):
            any_bad = True   # (a unit of several ops: each part is checked below, per op)
            why.append("parts")
            continue
        if any(w):
            any_bad = True
            why.append(w)
        else:
            why.append(None)
    if not any_bad:
        return out
    seen: Counter = Counter()
    for r, (rank_ops, tl) in enumerate(zip(schedule.ops, prep._tids)):
        for op, t in zip(rank_ops, tl):
            w = why[t]
            if w == "parts":
                out += _part_problems(op, r, S, m, placement)
                w = None
            if w is not None:
                if w[0]:
                    out.append(f"op {op} is listed on rank {r} but says rank {op.rank}")
                if w[1]:
                    out.append(f"op {op}: stage out of range 0..{S - 1}")
                    continue
                if w[2]:
                    out.append(f"op {op}: microbatch out of range 0..{m - 1}")
                if w[3]:
                    out.append(f"op {op} runs on rank {r} but stage {op.stage} is placed on rank "
                               f"{placement[op.stage]}")
            seen[(op.kind, op.stage, op.microbatch, op.rank, op.peer)] += 1
    out += [f"op {k[1]}{k[0]}{k[2]} appears {n} times on rank {k[3]}" for k, n in seen.items() if n > 1]
    return out


def _part_problems(op, r: int, S: int, m: int, placement) -> list[str]:
    """Rule 1 for each op of a unit (an overlapped pair's forward and backward)."""
    out = []
    try:
        parts = op_parts(op)
    except ScheduleError as e:
        return [f"op {op}: {e}"]
    for part in parts:
        if type(part.stage) is not int or not 0 <= part.stage < S:
            out.append(f"op {op}: stage {part.stage} of its {part.kind} out of range 0..{S - 1}")
        elif placement[part.stage] != r:
            out.append(f"op {op} runs on rank {r} but the stage {part.stage} of its {part.kind} is placed on rank "
                       f"{placement[part.stage]}")
        if not (type(part.microbatch) is int and 0 <= part.microbatch < m):
            out.append(f"op {op}: microbatch {part.microbatch} of its {part.kind} out of range 0..{m - 1}")
    return out


_BACKWARD_OK = frozenset({(1, 0, 0), (0, 1, 1)})   # (BW, B, W) per (stage, microbatch)


def completeness_problems(prep: Prepared) -> list[str]:
    """Rule 2: each (stage, microbatch) has one F and one BW, or one B and one W (forward-only
    schedules: one F)."""
    schedule = prep.schedule
    S, m = schedule.num_stages, schedule.num_microbatches
    groups: dict = {}
    units: dict = {}    # (kind, stage) -> microbatches that units (overlapped pairs) run
    for tp in prep._tpls:
        if tp.kind in ("F", "B", "W", "BW") and (tp.mb is not None or tp.seen is not None):
            groups.setdefault((tp.kind, tp.stage), []).append(tp)
    if prep.units:
        for r, tl in enumerate(prep._tids):
            for op, t in zip(schedule.ops[r], tl):
                if op_kind(op.kind).parts is not None:
                    for part in op_parts(op):
                        if 0 <= part.microbatch < m:
                            units.setdefault((part.kind, part.stage), []).append(part.microbatch)
    zeros = bytes(m)

    def count(kind: str, s: int):   # ops per microbatch
        got = groups.get((kind, s))
        more = units.get((kind, s))
        if not got and not more:
            return zeros
        if not more and len(got) == 1 and got[0].mb is None:
            return got[0].seen
        c = [0] * m
        for mb in more or ():
            c[mb] += 1
        got = got or ()
        for tp in got:
            if tp.mb is not None:
                c[tp.mb] += 1
            else:
                for mb, x in enumerate(tp.seen):
                    c[mb] += x
        return c

    forward_only = bool(schedule.meta.get("forward_only"))
    out: list[str] = []
    for s in range(S):
        nf = count("F", s)
        bad_f = [mb for mb, n in enumerate(nf) if n != 1]
        bad_b = []
        if not forward_only:
            nb, nw, nbw = count("B", s), count("W", s), count("BW", s)
            bad_b = [mb for mb, x in enumerate(zip(nbw, nb, nw)) if x not in _BACKWARD_OK]
        if not bad_f and not bad_b:
            continue
        for mb in sorted(set(bad_f) | set(bad_b)):
            if nf[mb] != 1:
                out.append(f"stage {s} microbatch {mb}: {nf[mb]} F ops, need exactly 1")
            if not forward_only and (nbw[mb], nb[mb], nw[mb]) not in _BACKWARD_OK:
                out.append(f"stage {s} microbatch {mb}: B={nb[mb]} W={nw[mb]} BW={nbw[mb]}; need one BW, "
                           "or one B and one W")
    return out


def comm_problems(prep: Prepared) -> list[str]:
    """Rule 3 (schedules with comm ops): a send goes to a stage that exists, on that stage's
    rank (unless its kind routes by peer); every input a compute op needs from another rank is
    received earlier on its rank; the sends from one rank to another on a channel and the
    receives there name the same messages in the same order (point-to-point matches in order).
    Pairs of ranks are reported in rank order."""
    if not prep.n_comm:
        return []
    schedule = prep.schedule
    S = schedule.num_stages
    placement = schedule.placement
    tpls = prep._tpls
    got = bytearray(prep.n_ids)        # key id -> received (on the rank the id belongs to)
    lists: dict = {}                   # ((src, dst, channel), is send) -> message ids in order
    sinks: list = []                   # per template: (append, id, key ids received, send problem)
    foreign: list = []                 # per template: ((id, key), ...) of inputs from other ranks
    for tp in tpls:
        fr = ()
        if tp.sink is None:
            sinks.append(None)
            if tp.req and op_kind(tp.kind).category == "compute":
                fr = tuple((i, key) for key, i in zip(tp.req, tp.code[3])
                           if 0 <= key[1] < S and placement[key[1]] != tp.r)
        else:
            key, is_send = tp.sink
            app = lists.setdefault((key, is_send), []).append
            if is_send:
                rs = tp.stage + COMM_PAIRS[tp.kind][1]
                why = ("stage" if not 0 <= rs < S else
                       "peer" if tp.kind not in PEER_ROUTED and tp.peer != placement[rs] else None)
                sinks.append((app, tp.code[7], (), why))
            else:
                sinks.append((app, tp.code[6], tp.code[4], None))
        foreign.append(fr)
    out: list[str] = []
    for r, (tl, shl) in enumerate(zip(prep._tids, prep._shifts)):
        for idx, (t, mb) in enumerate(zip(tl, shl)):
            sk = sinks[t]
            if sk is not None:
                if sk[3] is not None:
                    op = schedule.ops[r][idx]
                    rs = op.stage + COMM_PAIRS[op.kind][1]
                    if sk[3] == "stage":
                        out.append(f"rank {r}: {op} sends to a stage that does not exist")
                        continue
                    out.append(f"rank {r}: {op} must go to rank {placement[rs]} (stage {rs})")
                sk[0](sk[1] + mb)
                for i in sk[2]:
                    got[i + mb] = 1
                continue
            fr = foreign[t]
            if fr:
                for i, key in fr:
                    if not got[i + mb]:
                        op = schedule.ops[r][idx]
                        key = (key[0], key[1], key[2] + mb) if mb else key
                        out.append(f"rank {r}: {op} needs {key} from rank {placement[key[1]]} "
                                   "but no receive for it comes earlier on this rank")
    for chan in sorted({key for key, _ in lists}, key=_pair_order):
        sends, recvs = lists.get((chan, True), []), lists.get((chan, False), [])
        if sends != recvs:
            s, d = chan[:2]
            name = prep.comm_name
            extra_s = {name(i) for i in set(sends) - set(recvs)}
            extra_r = {name(i) for i in set(recvs) - set(sends)}
            if extra_s or extra_r:
                out.append(f"ranks {s}->{d}: unmatched sends {sorted(extra_s)[:3]} / "
                           f"unmatched receives {sorted(extra_r)[:3]}")
            else:
                out.append(f"ranks {s}->{d}: sends and receives are in different orders "
                           "(point-to-point matches in order)")
    return out


def _pair_order(chan: tuple) -> tuple:
    """(src, dst, channel) in rank order (a rank may be None: a comm op without a peer)."""
    src, dst, name = chan
    return (-1 if src is None else src, -1 if dst is None else dst, name)


def prepare_checked(schedule: Schedule, cost: CostModel | None, *, comm: bool = True) -> Prepared:
    """:func:`.engine.prepare`, once rules 1-3 (``comm=False``: 1 and 2) pass on it; raises
    ValidationError with their messages. With a ``cost`` for another number of stages, or None,
    the rules run on a copy coded without costs (then returned: the caller prepares again with
    its costs, and is told that they do not fit)."""
    fail(schedule, sizes_problems(schedule))
    if cost is not None and cost.num_stages != schedule.num_stages:
        cost = None
    prep = prepare(schedule, cost)
    fail(schedule, problems(prep, comm))
    return prep
