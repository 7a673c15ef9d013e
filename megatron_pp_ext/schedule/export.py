"""Export and import of schedules: our JSON, and PyTorch pipelining's compute-only CSV.

Pure Python (no torch): the CSV text is what ``torch.distributed.pipelining`` reads with
``PipelineScheduleMulti._load_csv(filename)`` and writes with ``_dump_csv``.

JSON (``dumps_json`` / ``loads_json``)
    ``Schedule.to_dict()`` plus, when given, the cost model under ``"cost"``. The round trip is
    exact: ``loads_json(dumps_json(s)) == s`` and ``loads_json_with_cost`` gives back an equal
    CostModel (``extra`` included). JSON has no tuples and only string keys, so tuples and
    dicts with non-string keys inside ``meta`` / ``extra`` are written tagged
    (``{"__tuple__": [...]}``, ``{"__items__": [[k, v], ...]}``) and restored on load.

Torch CSV (``to_torch_csv`` / ``from_torch_csv``, REFERENCE §9)
    One row per rank, one cell per action ``{stage}{type}{microbatch}`` with global stage
    indices. Kinds map as F -> ``F``, B -> ``I`` (backward for inputs), W -> ``W``, BW -> ``B``
    (full backward). Communication ops (and any other non-compute op) are dropped: torch's
    runtime lowers a compute-only schedule by inserting its own send/recv. Overlapped pairs
    -- the IR's ``F&B`` / ``F&BW`` ops (pairs.py) and those recorded in ``meta["overlap_pairs"]``
    (DualPipeV, ``[rank, f_stage, f_mb, b_stage, b_mb]``) -- are written as torch's
    ``(7F3;0B1)OVERLAP_F_B`` cells, and read back as a consecutive F and backward plus the pair
    in ``meta`` (which the pairing pass, --overlap-moe-expert-parallel-comm, can pair again). On import, empty cells (idle slots) are skipped, and so
    are torch's own lowering actions (``SEND_F``, ``RECV_B``, ``UNSHARD``, ``RESHARD``,
    ``REDUCE_GRAD``); the stage -> rank map is inferred from which row holds each stage and the
    microbatch count from the largest index, unless given.

``save(schedule, path, fmt=None)`` / ``load(path, fmt=None)`` pick the format from ``fmt``
(``"json"`` or ``"csv"``) or from the file extension.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from typing import Any, Iterable, Sequence

from .costs import CostModel
from .ir import Op, Schedule, ScheduleError, op_kind, op_parts
from .pairs import PAIR_KINDS, halves
from .registry import MAX_OPS
from .validate import validate

__all__ = [
    "cost_to_dict", "cost_from_dict", "dumps_json", "loads_json", "loads_json_with_cost",
    "to_torch_rows", "to_torch_csv", "from_torch_rows", "from_torch_csv", "save", "load",
    "load_with_cost", "check_runs_under", "TORCH_OF_KIND", "KIND_OF_TORCH",
]

#: our compute kind -> torch's computation type letter
TORCH_OF_KIND = {"F": "F", "B": "I", "W": "W", "BW": "B"}
#: torch's computation type letter -> our kind
KIND_OF_TORCH = {v: k for k, v in TORCH_OF_KIND.items()}

_SCHEDULE_FORMAT = "megatron_pp_ext.schedule/1"


def _check_size(where: str, stages: int, microbatches: int) -> None:
    """Refuse, at once, a schedule that declares more stages x microbatches than a schedule can be
    built with here (registry.MAX_OPS): the checks would walk them all (minutes, gigabytes)."""
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ScheduleError(f"{where}: num_microbatches must be a whole number, at least one, got {microbatches!r}")
    if stages * microbatches * 3 > MAX_OPS:
        raise ScheduleError(f"{where}: {stages} stages x {microbatches} microbatches is larger than the "
                            f"{MAX_OPS:,} ops a schedule may have here")


def _check_enough_ops(where: str, stages: int, microbatches: int, compute_ops: int, *, per_pair: int = 2) -> None:
    """A complete schedule has a forward (and a backward) of every stage and microbatch: refuse one
    that lists fewer compute ops than that before the completeness check walks every pair."""
    if compute_ops < per_pair * stages * microbatches:
        raise ScheduleError(f"{where}: declares {microbatches} microbatches on {stages} stages but lists only "
                            f"{compute_ops} compute ops; a complete schedule has a forward"
                            f"{' and a backward' if per_pair > 1 else ''} of every stage and microbatch")


# --- JSON --------------------------------------------------------------------------------

def _encode(value: Any, where: str) -> Any:
    """Make ``value`` JSON-safe so that :func:`_decode` restores it exactly."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not ({"__tuple__", "__items__"} & set(value)):
            return {k: _encode(v, where) for k, v in value.items()}
        return {"__items__": [[_encode(k, where), _encode(v, where)] for k, v in value.items()]}
    raise ScheduleError(f"{where}: cannot write a {type(value).__name__} ({value!r}) to JSON; "
                        "keep meta/extra values to numbers, strings, lists, tuples and dicts")


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, list) else value


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v) for v in value["__tuple__"])
        if set(value) == {"__items__"}:
            return {_hashable(_decode(k)): _decode(v) for k, v in value["__items__"]}
        return {k: _decode(v) for k, v in value.items()}
    return value


def cost_to_dict(cost: CostModel) -> dict:
    """JSON-safe dict of a CostModel (every field, ``extra`` included)."""
    return {
        "t_f": list(cost.t_f), "t_b": list(cost.t_b), "t_w": list(cost.t_w), "comm": cost.comm,
        "act": list(cost.act), "w_fraction": cost.w_fraction, "bytes_per_unit": cost.bytes_per_unit,
        "bytes_per_message": cost.bytes_per_message, "extra": _encode(dict(cost.extra), "cost.extra"),
        **({"w_fraction_per_stage": list(cost.w_fraction_per_stage)} if cost.w_fraction_per_stage else {}),
        **{k: list(getattr(cost, k)) for k in _HELD if getattr(cost, k)},
    }


#: the optional per-stage fields of a CostModel: held memory and the all-to-all time (written only when set)
_HELD = ("transient_f", "transient_b", "transient_w", "msg", "a2a")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_index(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def cost_from_dict(d: dict) -> CostModel:
    """Inverse of :func:`cost_to_dict`. Numbers must be JSON numbers (a string "0", true or null
    where a time belongs is refused, not converted)."""
    if not isinstance(d, dict):
        raise ScheduleError(f"cost model: expected a JSON object, got {type(d).__name__}")
    for key in ("t_f", "t_b", "t_w", "act", "w_fraction_per_stage", *_HELD):
        v = d.get(key)
        if v is not None and not (isinstance(v, list) and all(_is_number(x) for x in v)):
            raise ScheduleError(f"cost model: field {key!r} must be a list of numbers, got {v!r:.80}")
    for key in ("comm", "w_fraction"):
        if key in d and not _is_number(d[key]):
            raise ScheduleError(f"cost model: field {key!r} must be a number, got {d[key]!r:.80}")
    for key in ("bytes_per_unit", "bytes_per_message"):
        if d.get(key) is not None and not _is_number(d[key]):
            raise ScheduleError(f"cost model: field {key!r} must be a number or null, got {d[key]!r:.80}")
    try:
        return CostModel(
            t_f=tuple(d["t_f"]), t_b=tuple(d["t_b"]), t_w=tuple(d["t_w"]), comm=d.get("comm", 0.0),
            act=tuple(d["act"]), w_fraction=d.get("w_fraction", 1.0), bytes_per_unit=d.get("bytes_per_unit"),
            bytes_per_message=d.get("bytes_per_message"), extra=_decode(d.get("extra") or {}),
            w_fraction_per_stage=tuple(d["w_fraction_per_stage"]) if d.get("w_fraction_per_stage") else None,
            **{k: tuple(d[k]) for k in _HELD if d.get(k)})
    except KeyError as e:
        raise ScheduleError(f"cost model: missing field {e.args[0]!r} (need t_f, t_b, t_w, act)") from None
    except TypeError as e:
        raise ScheduleError(f"cost model: malformed field ({e})") from None


def dumps_json(schedule: Schedule, cost: CostModel | None = None, *, indent: int | None = None,
               comm_model: str | None = None) -> str:
    """JSON text of ``schedule`` (and of ``cost`` when given); see the module doc.

    ``comm_model``: an NCCL model (:mod:`.commmodel`; ``"nccl"`` is the executor's strategy): the
    comm ops as that NCCL path issues them -- each carries ``"stream"`` and, batched, ``"batch"``
    (shared by the ops of one ``batch_isend_irecv``) -- and ``meta`` gains ``"p2p"``
    (``"batched"`` | ``"pairwise"``), ``"recv_wait"`` (``"batch-end"`` | ``"consumer"``) and
    ``"comm_model"``. The schedule must run under that model (:func:`.validate.validate_comm_model`:
    NCCL's matching order, no deadlock on its streams), else a ScheduleError says where it waits:
    a file that names a model is a promise that it runs there. (Loading checks the same.)"""
    d = schedule.to_dict()
    meta = dict(schedule.meta)
    if comm_model is not None:
        from .commmodel import annotate_ops, comm_model as _model
        model = _model(comm_model)
        if model is not None:
            check_runs_under(schedule, cost, model.name)
            for ops, notes in zip(d["ops"], annotate_ops(schedule, model)):
                for o, extra in zip(ops, notes):
                    o.update(extra)
            meta.update(p2p=model.p2p, recv_wait=model.recv_wait, comm_model=model.name)
    d["meta"] = _encode(meta, "schedule meta")
    if cost is not None:
        if cost.num_stages != schedule.num_stages:
            raise ScheduleError(f"cost model has {cost.num_stages} stages but the schedule has "
                                f"{schedule.num_stages}")
        d["cost"] = cost_to_dict(cost)
    return json.dumps(d, indent=indent)


def check_runs_under(schedule: Schedule, cost: CostModel | None, model: str) -> None:
    """Refuse (ScheduleError, one line) a schedule with send/recv ops that the NCCL ``model``
    cannot run: messages matched out of order, or a deadlock on its streams (nccl-pairwise runs
    both directions between two ranks on one stream: an order the blocking proof accepts can
    still wait forever there)."""
    from .simresult import DeadlockError
    from .validate import validate_comm_model
    if cost is None:
        cost = CostModel.uniform(schedule.num_stages, schedule.chunks_per_rank)
    try:
        validate_comm_model(schedule, cost, model)
    except DeadlockError as e:
        raise DeadlockError(f"schedule {schedule.name!r} deadlocks under {model} ({e.brief()})",
                            model=model, waits=e.waits) from None


def _bad_op_fields(o) -> str | None:
    """What is wrong with an op's JSON object, or None: its indices must be JSON integers (a
    microbatch 1.5 or "0", or true, was once read as 1, 0 or 1)."""
    if not isinstance(o, dict):
        return "an op must be an object with kind, stage, microbatch, rank and optionally peer"
    for key in ("stage", "microbatch", "rank"):
        if key in o and not _is_index(o[key]):
            return f"{key} must be an integer, got {o[key]!r:.40}"
    if o.get("peer") is not None and not _is_index(o["peer"]):
        return f"peer must be an integer or null, got {o['peer']!r:.40}"
    if "pair" in o and not (isinstance(o["pair"], list) and len(o["pair"]) == 2 and all(map(_is_index, o["pair"]))):
        return f"pair must be [stage, microbatch] integers, got {o['pair']!r:.40}"
    return None


def loads_json_with_cost(text: str, *, check: bool = True) -> tuple[Schedule, CostModel | None]:
    """Schedule and cost model (None when the JSON holds none) from :func:`dumps_json` text.

    With ``check`` (default) the schedule must pass :func:`..validate.validate`, the validator
    every generated schedule passes (each op present once, placement and ranks consistent,
    sends matched, deadlock-free), under its own cost model when the file has one; a file whose
    ``meta["comm_model"]`` names an NCCL model (``mppx export --backend nccl``) must also run
    under that model (:func:`check_runs_under`)."""
    try:
        d = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        raise ScheduleError(f"schedule JSON is not valid JSON: {e}") from None
    except RecursionError:
        raise ScheduleError("schedule JSON is nested too deeply to read (thousands of [ or {)") from None
    if not isinstance(d, dict):
        raise ScheduleError(f"schedule JSON: expected an object at the top level, got {type(d).__name__}")
    if not isinstance(d.get("format"), str) or d["format"].split("/")[0] != _SCHEDULE_FORMAT.split("/")[0]:
        raise ScheduleError("not a megatron_pp_ext schedule JSON (missing or wrong 'format' field; "
                            f"expected {_SCHEDULE_FORMAT!r})")
    if d["format"] != _SCHEDULE_FORMAT:
        raise ScheduleError(f"schedule JSON format {d['format']!r} is not supported (this version reads "
                            f"{_SCHEDULE_FORMAT!r})")
    for key, typ in (("name", str), ("num_microbatches", int), ("placement", list), ("ops", list)):
        if key not in d:
            raise ScheduleError(f"schedule JSON: missing field {key!r}")
        if not isinstance(d[key], typ) or isinstance(d[key], bool):
            raise ScheduleError(f"schedule JSON: field {key!r} must be a {typ.__name__}")
    ops: list[list[Op]] = []
    for r, rank_ops in enumerate(d["ops"]):
        if not isinstance(rank_ops, list):
            raise ScheduleError(f"schedule JSON: ops of rank {r} must be a list")
        lst = []
        for i, o in enumerate(rank_ops):
            bad = _bad_op_fields(o)
            if bad:
                raise ScheduleError(f"schedule JSON: op {i} of rank {r} ({o!r:.120}): {bad}")
            try:
                op = Op.from_dict(o)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                raise ScheduleError(f"schedule JSON: op {i} of rank {r} is malformed ({o!r}: {e!r}); "
                                    "need kind, stage, microbatch, rank and optionally peer") from None
            if not isinstance(op.kind, str) or (op.peer is not None and not isinstance(op.peer, int)):
                raise ScheduleError(f"schedule JSON: op {i} of rank {r} ({o!r}): kind must be a string and "
                                    "peer an integer")
            lst.append(op)
        ops.append(lst)
    try:
        meta = _decode(d.get("meta") or {})
    except RecursionError:
        raise ScheduleError("schedule JSON: 'meta' is nested too deeply") from None
    if not isinstance(meta, dict):
        raise ScheduleError("schedule JSON: 'meta' must be an object")
    if not all(_is_index(x) for x in d["placement"]):
        raise ScheduleError("schedule JSON: 'placement' must be a list of rank numbers (integers)")
    placement = tuple(d["placement"])
    _check_size("schedule JSON", len(placement), d["num_microbatches"])
    sched = Schedule(d["name"], d["num_microbatches"], placement, ops, meta)
    cost = cost_from_dict(d["cost"]) if d.get("cost") is not None else None
    if cost is not None and cost.num_stages != sched.num_stages:
        raise ScheduleError(f"schedule JSON: the cost model has {cost.num_stages} stages but the placement "
                            f"{sched.num_stages}")
    if check:
        compute = sum(len(op_parts(op)) for lst in ops for op in lst
                      if op.kind in KIND_OF_TORCH.values() or op.kind in PAIR_KINDS)
        _check_enough_ops("schedule JSON", len(placement), d["num_microbatches"], compute,
                          per_pair=1 if meta.get("forward_only") else 2)
        validate(sched, cost, want_result=False)
        named = meta.get("comm_model")
        if named is not None and named not in ("eager", "blocking"):
            from .commmodel import comm_model as _model
            if not isinstance(named, str):
                raise ScheduleError(f"schedule JSON: meta 'comm_model' must be a model's name, got {named!r}")
            _model(named)   # an unknown name is refused
            check_runs_under(sched, cost, named)
    return sched, cost


def loads_json(text: str, *, check: bool = True) -> Schedule:
    """Inverse of :func:`dumps_json` (the cost model, if any, is read by :func:`loads_json_with_cost`);
    ``check``: validate it as :func:`loads_json_with_cost` does."""
    return loads_json_with_cost(text, check=check)[0]


# --- torch CSV -----------------------------------------------------------------------------

_ACTION_RE = re.compile(r"^(\d{1,9})([FIWB])(\d{1,9})$")   # (indices below 10^9: an int, not a memory bomb)
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")
# torch's lowering actions (communication, FSDP unshard/reshard, grad reduction): skipped on import
_TORCH_NONCOMPUTE_RE = re.compile(r"^(\d{1,9})(UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d{0,9})$")


def _torch_cell(op: Op) -> str:
    try:
        return f"{op.stage}{TORCH_OF_KIND[op.kind]}{op.microbatch}"
    except KeyError:
        raise ScheduleError(f"op {op} (kind {op.kind!r}) has no PyTorch pipelining equivalent; the torch CSV "
                            f"holds only {', '.join(TORCH_OF_KIND)} compute ops") from None


def to_torch_rows(schedule: Schedule, *, overlap: bool = True) -> list[list[str]]:
    """Per rank, the torch action strings of its compute ops (comm and other streams dropped).

    With ``overlap`` the pairs of ``meta["overlap_pairs"]`` become ``(F;B)OVERLAP_F_B`` cells
    when their two ops are consecutive among the rank's compute ops."""
    pairs = set()
    if overlap:
        for pr in schedule.meta.get("overlap_pairs", ()) or ():
            pairs.add(tuple(int(x) for x in pr))
    rows = []
    for r, rank_ops in enumerate(schedule.ops):
        comp = [op for op in rank_ops if op_kind(op.kind).category == "compute"]
        row, i = [], 0
        while i < len(comp):
            op = comp[i]
            if op.kind in PAIR_KINDS:   # an overlapped pair of the IR (pairs.py)
                f, b = halves(op)
                row.append(f"({_torch_cell(f)};{_torch_cell(b)})OVERLAP_F_B")
                i += 1
                continue
            nxt = comp[i + 1] if i + 1 < len(comp) else None
            if (pairs and nxt is not None and op.kind == "F" and nxt.kind in ("B", "BW")
                    and (r, op.stage, op.microbatch, nxt.stage, nxt.microbatch) in pairs):
                row.append(f"({_torch_cell(op)};{_torch_cell(nxt)})OVERLAP_F_B")
                i += 2
                continue
            row.append(_torch_cell(op))
            i += 1
        rows.append(row)
    return rows


def to_torch_csv(schedule: Schedule, *, overlap: bool = True) -> str:
    """PyTorch pipelining's compute-only CSV (one row per rank; see the module doc)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in to_torch_rows(schedule, overlap=overlap):
        writer.writerow(row)
    return buf.getvalue()


def _parse_action(cell: str, where: str) -> tuple[str, int, int] | None:
    m = _ACTION_RE.match(cell)
    if m:
        return KIND_OF_TORCH[m.group(2)], int(m.group(1)), int(m.group(3))
    if _TORCH_NONCOMPUTE_RE.match(cell):
        return None
    shown = cell if len(cell) <= 40 else cell[:37] + "..."
    raise ScheduleError(f"{where}: cannot read action {shown!r}; expected {{stage}}{{F|I|W|B}}{{microbatch}} "
                        "such as 0F3, 7I0, 7W0, 5B2, or (0F3;7B1)OVERLAP_F_B (indices below 10^9)")


def from_torch_rows(rows: Iterable[Iterable[Any]], num_microbatches: int | None = None,
                    placement: Sequence[int] | None = None, *, name: str = "torch",
                    check: bool = True) -> Schedule:
    """Schedule from per-rank torch actions: strings such as ``"0F3"``, torch ``_Action`` objects
    (anything whose ``str()`` is the action), or None / ``""`` for idle slots.

    ``placement`` (stage -> rank) and ``num_microbatches`` are inferred when not given. With
    ``check`` the result must hold every F and backward exactly once (torch's own rule)."""
    parsed: list[list[tuple[str, int, int]]] = []
    pairs: list[list[int]] = []
    for r, row in enumerate(rows):
        lst: list[tuple[str, int, int]] = []
        for c, item in enumerate(row):
            cell = "" if item is None else str(item).strip()
            if cell in ("", "None"):
                continue
            where = f"torch schedule row {r} (rank {r}), cell {c}"
            m = _OVERLAP_RE.match(cell)
            if m:
                subs = [s.strip() for s in m.group(1).split(";") if s.strip()]
                acts = [_parse_action(s, where) for s in subs]
                if len(acts) != 2 or None in acts or acts[0][0] != "F" or acts[1][0] not in ("B", "BW"):
                    raise ScheduleError(f"{where}: {cell!r}: an OVERLAP_F_B cell must hold one forward and "
                                        "one backward, e.g. (0F3;7B1)OVERLAP_F_B")
                lst += acts
                pairs.append([r, acts[0][1], acts[0][2], acts[1][1], acts[1][2]])
                continue
            act = _parse_action(cell, where)
            if act is not None:
                lst.append(act)
        parsed.append(lst)
    while parsed and not parsed[-1]:
        parsed.pop()  # trailing blank lines
    if not parsed:
        raise ScheduleError("torch schedule is empty: no rank holds any action")
    p = len(parsed)

    if placement is None:
        stage_rank: dict[int, int] = {}
        for r, lst in enumerate(parsed):
            for kind, s, mb in lst:
                if stage_rank.setdefault(s, r) != r:
                    raise ScheduleError(f"torch schedule: stage {s} appears on rank {stage_rank[s]} and on rank {r}; "
                                        "a stage must live on one rank")
        S = max(stage_rank) + 1
        missing = []
        for st in range(S):   # (the first few only: a stage index may be huge)
            if st not in stage_rank:
                missing.append(st)
                if len(missing) == 3 or len(missing) + len(stage_rank) >= S:
                    break
        if missing:
            raise ScheduleError(f"torch schedule: stages {missing} appear on no rank, so their placement cannot be "
                                "inferred; pass placement=")
        placement_t = tuple(stage_rank[s] for s in range(S))
    else:
        placement_t = tuple(int(x) for x in placement)
        S = len(placement_t)
        if not placement_t or max(placement_t) + 1 != p or min(placement_t) < 0:
            raise ScheduleError(f"placement {placement_t} names ranks 0..{max(placement_t, default=-1)}, but the "
                                f"torch schedule has {p} rows")
        for r, lst in enumerate(parsed):
            for kind, s, mb in lst:
                if not 0 <= s < S:
                    raise ScheduleError(f"torch schedule rank {r}: stage {s} is outside the placement's {S} stages")
                if placement_t[s] != r:
                    raise ScheduleError(f"torch schedule rank {r}: stage {s} is placed on rank {placement_t[s]}")
    if sorted(set(placement_t)) != list(range(p)):
        raise ScheduleError(f"torch schedule: ranks {sorted(set(range(p)) - set(placement_t))} hold no stage")
    max_mb = max((mb for lst in parsed for _, _, mb in lst), default=-1)
    if num_microbatches is None:
        num_microbatches = max_mb + 1
    elif max_mb >= num_microbatches:
        raise ScheduleError(f"torch schedule uses microbatch {max_mb}, but num_microbatches={num_microbatches}")
    _check_size("torch schedule", S, num_microbatches)
    if check:
        _check_enough_ops("torch schedule", S, num_microbatches, sum(len(lst) for lst in parsed))
    ops = [[Op(kind, s, mb, r) for kind, s, mb in lst] for r, lst in enumerate(parsed)]
    meta: dict = {"source": "torch"}
    if pairs:
        meta["overlap_pairs"] = pairs
    sched = Schedule(name, num_microbatches, placement_t, ops, meta)
    if check:   # the validator every generated schedule passes: complete, causal, deadlock-free
        validate(sched, want_result=False)
    return sched


def from_torch_csv(text: str, num_microbatches: int | None = None, placement: Sequence[int] | None = None,
                   *, name: str = "torch-csv", check: bool = True) -> Schedule:
    """Schedule from PyTorch pipelining's compute-only CSV text (see :func:`from_torch_rows`)."""
    if not isinstance(text, str):
        raise ScheduleError(f"from_torch_csv expects the CSV text, got {type(text).__name__}")
    try:
        rows = list(csv.reader(io.StringIO(text)))
    except csv.Error as e:
        raise ScheduleError(f"torch schedule CSV is malformed: {e}") from None
    return from_torch_rows(rows, num_microbatches, placement, name=name, check=check)


# --- files ---------------------------------------------------------------------------------

_FORMATS = {"json": "json", "csv": "csv", "torch": "csv", "torch-csv": "csv"}
#: the largest schedule file read (a JSON of MAX_OPS ops with their comm ops is well below it)
MAX_FILE_BYTES = 1 << 30


def _format_of(path: str | os.PathLike, fmt: str | None) -> str:
    if fmt is None:
        ext = os.path.splitext(os.fspath(path))[1].lower().lstrip(".")
        if ext not in ("json", "csv"):
            raise ScheduleError(f"{os.fspath(path)!r}: cannot tell the format from the extension; use .json or "
                                ".csv, or pass fmt='json' / fmt='csv'")
        return ext
    try:
        return _FORMATS[fmt.lower()]
    except KeyError:
        raise ScheduleError(f"unknown schedule file format {fmt!r}; use 'json' or 'csv'") from None


def save(schedule: Schedule, path: str | os.PathLike, fmt: str | None = None, *,
         cost: CostModel | None = None) -> None:
    """Write ``schedule`` to ``path`` as JSON (with ``cost`` when given) or torch CSV."""
    kind = _format_of(path, fmt)
    if kind == "json":
        text = dumps_json(schedule, cost, indent=1)
    else:
        text = to_torch_csv(schedule)
    try:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
    except OSError as e:
        raise ScheduleError(f"cannot write schedule file {os.fspath(path)!r}: {e.strerror or e}; give a "
                            "writable path") from None


def load_with_cost(path: str | os.PathLike, fmt: str | None = None, **csv_options) -> tuple[Schedule, CostModel | None]:
    """Read a schedule file; the cost model is None for CSV and for JSON saved without one.
    ``csv_options`` (num_microbatches, placement, name, check) go to :func:`from_torch_csv`;
    ``check`` also applies to JSON (validated by default)."""
    kind = _format_of(path, fmt)
    try:
        size = os.stat(path).st_size
        if size > MAX_FILE_BYTES:
            raise ScheduleError(f"schedule file {os.fspath(path)!r} has {size:,} bytes, more than a schedule of "
                                f"{MAX_OPS:,} ops takes ({MAX_FILE_BYTES:,}); not a schedule file")
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read(MAX_FILE_BYTES + 1)   # (a device such as /dev/zero has no size and no end)
        if len(text) > MAX_FILE_BYTES:
            raise ScheduleError(f"schedule file {os.fspath(path)!r} holds more than {MAX_FILE_BYTES:,} characters; "
                                "not a schedule file")
    except OSError as e:
        raise ScheduleError(f"cannot read schedule file {os.fspath(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ScheduleError(f"schedule file {os.fspath(path)!r} is not text (JSON or CSV)") from None
    if kind == "json":
        check = csv_options.pop("check", True)
        if csv_options:
            raise ScheduleError(f"options {sorted(csv_options)} apply to CSV files only")
        return loads_json_with_cost(text, check=check)
    csv_options.setdefault("name", os.path.splitext(os.path.basename(os.fspath(path)))[0])
    return from_torch_csv(text, **csv_options), None


def load(path: str | os.PathLike, fmt: str | None = None, **csv_options) -> Schedule:
    """Read a schedule saved by :func:`save` (or by torch's ``_dump_csv``)."""
    return load_with_cost(path, fmt, **csv_options)[0]
