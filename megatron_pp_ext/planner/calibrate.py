"""A profiled run -> a planner calibration document (``mppx calibrate``; torch-free).

Two inputs are read:

* the ``summary.json`` of ``mppx train --profile-iters K`` (its ``profile.costs_ms``: the median
  F, B and W of every pipeline stage over the window and the measured p2p time of one
  activation-sized message; ``layout.layers_per_stage``; ``config``);
* the profile JSON that Megatron-LM with megatron_pp_ext writes with
  ``--pipeline-profile-iters K --pipeline-profile-out FILE`` (:data:`PROFILE_FORMAT`, written by
  :func:`megatron_pp_ext.megatron_lm.profile_out.profile_document`).

The document :func:`calibration_from_profile` returns holds ``stage_times`` (one stage of
transformer layers: the median F/B/W of the stages that hold neither the embedding nor the loss,
at the run's microbatch size and tp, and the measured message time), ``efficiency.p2p_gbps``
(the message's bytes over its measured time), ``precision`` and ``measured`` (where it came
from). ``efficiency.exchange_sync_us`` -- the GPU's idle time after one of Megatron-Core's
synchronised exchanges -- is written when the profile carries it measured on a GPU (both runs
measure it in their window's last iteration: trainer/exchange_sync.py); a run on CPU processes
does not measure it (no device idles there), and ``measured.not_measured`` says so.

Every input that cannot give such a document is a :class:`CalibrateError`, one line naming the
file and what was expected.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
from collections import Counter

from ..textfile import read_text_bounded
from .presets import moe_layer_pattern

__all__ = ["CalibrateError", "PROFILE_FORMAT", "read_profile", "calibration_from_profile", "calibrate_file",
           "pick_stages"]

#: the ``format`` of the Megatron-LM profile JSON (``--pipeline-profile-out``)
PROFILE_FORMAT = "megatron_pp_ext.pipeline_profile"
_MAX_FILE = 64 << 20
_EXPECTED = ("expected the summary.json of 'mppx train --profile-iters K' or the JSON of Megatron-LM's "
             "--pipeline-profile-out")


class CalibrateError(ValueError):
    """An input that gives no calibration; the message is one line naming the file."""


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def read_profile(path: str) -> tuple[str, dict]:
    """``(kind, document)`` of a profile file: kind ``"mppx-train"`` or ``"megatron-lm"``."""
    try:
        text = read_text_bounded(path, _MAX_FILE)
    except FileNotFoundError:
        raise CalibrateError(f"{path}: no such file; {_EXPECTED}") from None
    except IsADirectoryError:
        raise CalibrateError(f"{path}: a directory; give its summary.json (mppx train --out DIR writes "
                             "DIR/summary.json)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrateError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e}); {_EXPECTED}") from None
    if text is None:
        raise CalibrateError(f"{path}: larger than {_MAX_FILE >> 20} MiB; {_EXPECTED}")
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CalibrateError(f"{path}: not JSON ({e}); {_EXPECTED}") from None
    if isinstance(doc, dict) and doc.get("format") == PROFILE_FORMAT:
        return "megatron-lm", doc
    if isinstance(doc, dict) and isinstance(doc.get("config"), dict) and isinstance(doc.get("layout"), dict) \
            and "profile" in doc:
        return "mppx-train", doc
    if isinstance(doc, dict) and {"efficiency", "stage_times", "gemm_points", "layer_points"} & set(doc):
        raise CalibrateError(f"{path}: already a calibration file (give it to 'mppx plan --calibration'); "
                             f"{_EXPECTED}")
    raise CalibrateError(f"{path}: not a profile; {_EXPECTED}")


# --- the stage that stands for one stage of transformer layers ----------------------------------

def pick_stages(layers: list[int]) -> tuple[list[int], str]:
    """The stages whose times describe ``layers`` transformer layers and nothing else, and a note.

    The first stage also runs the embedding and the last the output layer and the loss, so the
    interior stages are used; among them the most common layer count (ties: the larger) and every
    stage holding it. With two stages (no interior one) the first stage is used: its embedding
    lookup is a small share, the output layer of the last is not (the note says so)."""
    n = len(layers)
    interior = [s for s in range(1, n - 1) if layers[s] >= 1]
    if not interior:
        firsts = [s for s in (0, n - 1) if layers[s] >= 1]
        if not firsts:
            raise ValueError("no stage holds a transformer layer")
        s = firsts[0]
        what = "the embedding lookup" if s == 0 else "the output layer and the loss"
        return [s], (f"stage {s} of {n} ({layers[s]} layers); it includes {what} (a run of 3 or more stages "
                     "has stages of transformer layers only)")
    counts = Counter(layers[s] for s in interior)
    best = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
    chosen = [s for s in interior if layers[s] == best]
    note = (f"median of stage{'s' if len(chosen) > 1 else ''} {_span(chosen)} of {n} ({best} layers each); "
            f"stages 0 and {n - 1} also hold the embedding / the output layer and loss")
    if len(counts) > 1:
        others = ", ".join(f"{c} layers: {k} stage{'s' if k > 1 else ''}" for c, k in sorted(counts.items())
                           if c != best)
        note += (f"; the interior stages hold different layer counts ({others}): the most common count, "
                 f"{best} layers, was used")
    return chosen, note


def _span(stages: list[int]) -> str:
    if len(stages) > 2 and stages == list(range(stages[0], stages[-1] + 1)):
        return f"{stages[0]}-{stages[-1]}"
    return ", ".join(map(str, stages))


# --- the conversion ---------------------------------------------------------------------------

def _number_list(value, name: str, path: str, n: int) -> list[float]:
    if not isinstance(value, list) or len(value) != n or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in value):
        raise CalibrateError(f"{path}: {name} must list {n} finite times >= 0 (one per stage), got {value!r}")
    return [float(v) for v in value]


def _whole(value, name: str, path: str, lo: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or value < lo:
        raise CalibrateError(f"{path}: {name}={value!r}: expected a whole number >= {lo}")
    return int(value)


def _from_mppx_train(doc: dict, path: str) -> dict:
    c, lay = doc["config"], doc["layout"]
    prof = doc.get("profile")
    if not prof:
        why = ("the run had --profile-iters 0" if c.get("profile_iters") == 0 else
               "the run had no profiling window: --pp 1, --schedule mcore, some features and --emulate-compute have "
               "none")
        raise CalibrateError(f"{path}: no profile section ({why}); re-run with --profile-iters K (e.g. "
                             "--profile-iters 3, and --iters >= K + 2) and one of our schedules at --pp >= 2")
    if not prof.get("costs_ms"):
        raise CalibrateError(f"{path}: the profiling window measured no costs ({prof.get('error', 'no costs_ms')}); "
                             "re-run with --profile-iters K")
    if c.get("fp16"):
        raise CalibrateError(f"{path}: an fp16 run; the planner plans bf16, fp8 or fp32: profile a run with --bf16 "
                             "(or in fp32)")
    experts = c.get("num_experts")
    cmd = ["mppx", "train"]
    for key, flag in (("model", "--model"), ("layers", "--layers"), ("hidden", "--hidden"), ("heads", "--heads"),
                      ("kv_heads", "--kv-heads"), ("ffn", "--ffn"), ("vocab", "--vocab"), ("seq", "--seq"),
                      ("num_experts", "--num-experts"), ("pp", "--pp"), ("tp", "--tp"), ("vp", "--vp"),
                      ("schedule", "--schedule"), ("micro_batch_size", "--micro-batch-size"),
                      ("global_batch_size", "--global-batch-size"), ("iters", "--iters"),
                      ("profile_iters", "--profile-iters")):
        if c.get(key) is not None:
            cmd += [flag, str(c[key])]
    if c.get("bf16"):
        cmd.append("--bf16")
    window = prof.get("window") or [None, None]
    costs = prof["costs_ms"]
    seq, mbs, hidden = (_whole(c.get(k), f"config.{k}", path) for k in ("seq", "micro_batch_size", "hidden"))
    return dict(
        kind="mppx train --profile-iters", costs=costs, layers=lay.get("layers_per_stage"),
        mbs=mbs, tp=_whole(c.get("tp", 1), "config.tp", path), cp=1,
        precision="bf16" if c.get("bf16") else "fp32", experts=experts,
        expert=dict(topk=c.get("moe_router_topk"), ep=c.get("expert_model_parallel_size", 1),
                    etp=c.get("expert_tensor_parallel_size") or c.get("tp", 1), freq=c.get("moe_layer_freq", 1),
                    dispatcher=c.get("moe_token_dispatcher_type"), flag="--moe-token-dispatcher-type"),
        # the probe: one (seq, mbs, hidden) fp32 tensor per message (trainer/profile.py)
        message_bytes=4 * seq * mbs * hidden, message="(seq, micro batch, hidden) in fp32",
        command=shlex.join(cmd) + "  (rebuilt from summary.json's config)",
        iterations=window, schedule=(doc.get("schedule") or {}).get("name") or c.get("schedule"),
        device=lay.get("device"),
        model={k: c.get(k) for k in ("model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")},
        rerun="--profile-iters K", sync=_sync_fields(prof))


def _from_megatron_lm(doc: dict, path: str) -> dict:
    costs = doc.get("costs_ms")
    if not costs:
        raise CalibrateError(f"{path}: the profiling window measured no costs ({doc.get('error', 'no costs_ms')}); "
                             "re-run with --pipeline-profile-iters K")
    prec = doc.get("precision")
    if prec == "fp16":
        raise CalibrateError(f"{path}: an --fp16 run; the planner plans bf16, fp8 or fp32: profile a run with --bf16")
    if prec not in ("bf16", "fp8", "fp32"):
        raise CalibrateError(f"{path}: precision {prec!r}: expected bf16, fp8 or fp32")
    msg = doc.get("p2p_message") or {}
    return dict(
        kind="Megatron-LM --pipeline-profile-out", costs=costs, layers=doc.get("layers_per_stage"),
        mbs=_whole(doc.get("micro_batch_size"), "micro_batch_size", path),
        tp=_whole(doc.get("tensor_model_parallel_size", 1), "tensor_model_parallel_size", path),
        cp=_whole(doc.get("context_parallel_size", 1), "context_parallel_size", path),
        precision=prec, experts=doc.get("num_moe_experts"), message_bytes=msg.get("bytes"),
        expert=dict(topk=doc.get("moe_router_topk"), ep=doc.get("expert_model_parallel_size", 1),
                    etp=doc.get("expert_tensor_parallel_size") or doc.get("tensor_model_parallel_size", 1),
                    freq=doc.get("moe_layer_freq", 1), dispatcher=doc.get("moe_token_dispatcher_type"),
                    flag="--moe-token-dispatcher-type"),
        message=f"shape {msg.get('shape')} in {msg.get('dtype')}" if msg else None,
        command=doc.get("command"), iterations=doc.get("window"), schedule=doc.get("schedule"),
        device=doc.get("device"), model=doc.get("model"), rerun="--pipeline-profile-iters K", sync=_sync_fields(doc))


def _sync_fields(doc: dict) -> tuple:
    """``(exchange_sync_us, exchange_sync)`` of a profile (None, None: a profile without them)."""
    return doc.get("exchange_sync_us"), doc.get("exchange_sync")


def _exchange_sync(run: dict, path: str) -> tuple[float | None, str]:
    """The measured ``exchange_sync_us`` to write (None: none) and the ``measured`` note on it."""
    value, detail = run["sync"]
    detail = detail if isinstance(detail, dict) else {}
    if value is not None:   # (Efficiency's own bounds, the ones the plan holds the file to)
        from .presets import PlannerError
        from .timing import Efficiency
        try:
            Efficiency().with_(exchange_sync_us=value)
        except (PlannerError, TypeError) as e:
            raise CalibrateError(f"{path}: exchange_sync_us={value!r}: expected microseconds "
                                 f"({str(e).split(': ', 1)[-1].split(' (')[0]}, or null)") from None
    if run["device"] == "cpu":
        return None, ("exchange_sync_us: a run on CPU processes, where the host runs every op to its end: no device "
                      "idles while the host relaunches, so nothing was measured; the plan keeps the GPU preset's value")
    if run["device"] != "cuda":
        return None, (f"exchange_sync_us: the profile does not say it ran on a GPU (device {run['device']!r}), so its "
                      "figure is not used; the plan keeps the GPU preset's value")
    if value is None:
        why = detail.get("why") or (f"the profile does not carry it (written before megatron_pp_ext measured it): "
                                    f"re-run with {run['rerun']}")
        return None, f"exchange_sync_us: {why}; the plan keeps the GPU preset's value"
    n = detail.get("samples")
    return float(value), (f"exchange_sync_us: measured on the GPU{f' from {n} forwards' if n else ''}: "
                          + (detail.get("how") or "the idle time after a synchronise"))


def calibration_from_profile(kind: str, doc: dict, path: str) -> dict:
    """The calibration document of a profile read by :func:`read_profile` (``path`` names it)."""
    run = _from_mppx_train(doc, path) if kind == "mppx-train" else _from_megatron_lm(doc, path)
    if run["cp"] > 1:
        raise CalibrateError(f"{path}: a run at context parallel size {run['cp']}: its stage times are for "
                             f"seq/{run['cp']} tokens per rank, and the planner's stage_times hold whole sequences; "
                             "profile at --context-parallel-size 1")
    costs = run["costs"]
    if not isinstance(costs, dict):
        raise CalibrateError(f"{path}: costs_ms must be an object with F, B, W and comm")
    layers = run["layers"]
    if not isinstance(layers, list) or not layers:
        raise CalibrateError(f"{path}: the layer count of every stage is missing (layers_per_stage); the stage times "
                             "cannot be turned into per-layer times")
    layers = [_whole(v, "layers_per_stage", path, lo=0) for v in layers]
    n = len(layers)
    f, b, w = (_number_list(costs.get(k), f"costs_ms.{k}", path, n) for k in ("F", "B", "W"))
    comm = costs.get("comm")
    if isinstance(comm, bool) or not isinstance(comm, (int, float)) or not math.isfinite(comm) or comm <= 0:
        raise CalibrateError(f"{path}: costs_ms.comm={comm!r}: no p2p time was measured (a run at pp 1?); profile a "
                             "pipeline of 2 or more stages")
    try:
        chosen, note = pick_stages(layers)
    except ValueError as e:
        raise CalibrateError(f"{path}: {e}") from None
    expert = _expert_fields(run, layers, chosen, path) if run["experts"] else None
    ff, bb, ww = (statistics.median(x[s] for s in chosen) for x in (f, b, w))
    if ww <= 0:
        raise CalibrateError(f"{path}: the stage's W time is 0: the run's schedule ({run['schedule']}) does not split "
                             "the backward into B and W, and stage_times need both; re-run with a schedule that splits "
                             f"it (zb-h1, zbv) and {run['rerun']}")
    if ff <= 0 or bb <= 0:
        raise CalibrateError(f"{path}: the stage's F or B time is 0; re-run with {run['rerun']}")
    eff = {}
    if run["message_bytes"]:
        eff["p2p_gbps"] = _sig(run["message_bytes"] / (comm * 1e-3) / 1e9)
    sync_us, sync_note = _exchange_sync(run, path)
    if sync_us is not None:
        eff["exchange_sync_us"] = sync_us
    measured = {
        "source": os.path.abspath(path),
        "from": run["kind"],
        "command": run["command"],
        "iterations": run["iterations"],
        "schedule": run["schedule"],
        "device": run["device"],
        "model": run["model"],
        "layers_per_stage": layers,
        "stage": note,
        "p2p": (f"p2p_ms: one activation-sized message, {run['message']}, {run['message_bytes']} bytes; "
                "p2p_gbps: those bytes over that time (its latency included)") if run["message_bytes"]
               else "p2p_ms: one activation-sized message (its bytes unknown: no p2p_gbps)",
    }
    measured["exchange_sync" if sync_us is not None else "not_measured"] = sync_note
    out = {
        "stage_times": {"micro_batch_size": run["mbs"], "tp": run["tp"], "layers": layers[chosen[0]],
                        "f_ms": _sig(ff), "b_ms": _sig(bb), "w_ms": _sig(ww), "p2p_ms": _sig(comm)},
        "precision": run["precision"],
        "measured": measured,
    }
    if expert is not None:
        out["stage_times"].update(expert)
        a2a = costs.get("a2a")
        if a2a is not None:
            a2a = _number_list(a2a, "costs_ms.a2a", path, n)
            out["stage_times"]["a2a_ms"] = _sig(min(statistics.median(a2a[s] for s in chosen), ff))
        measured["all_to_all"] = ("a2a_ms: the stage's measured all-to-all inside one F (the same inside B)"
                                  if a2a is not None else
                                  "not measured (profile with --overlap-moe-expert-parallel-comm to measure it): the "
                                  "plan takes the all-to-all's share of F from its model")
    m = run["model"] if isinstance(run["model"], dict) else {}
    # (the planner refuses the times for another sequence or model; mppx train's names, then Megatron-LM's)
    for key, other in (("seq", "seq_length"), ("hidden", "hidden_size")):
        v = m.get(key, m.get(other))
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise CalibrateError(f"{path}: the run's config has no {key} (model.{key}): the planner needs the "
                               f"{'sequence length' if key == 'seq' else 'hidden size'} its times were measured at")
        out["stage_times"][key] = v
    if eff:
        out = {"efficiency": eff, **out}
    return out


def _expert_fields(run: dict, layers: list[int], chosen: list[int], path: str) -> dict:
    """An MoE run's expert layout for ``stage_times`` -- experts, top-k, ep, etp -- after checking
    that the chosen stages hold MoE layers only (the planner uses the times for its MoE layers)
    and that the run's dispatcher is the one plans run."""
    e = run["expert"]
    out = {"experts": _whole(run["experts"], "num_experts", path)}
    names = {"topk": "moe_router_topk", "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}
    for key, name in names.items():
        if e.get(key) is None:
            raise CalibrateError(f"{path}: an MoE run ({out['experts']} experts) whose file does not record its "
                                 f"{name} (written by an older megatron_pp_ext?): re-run with {run['rerun']}")
        out[key] = _whole(e.get(key), name, path)
    if e.get("dispatcher") not in (None, "alltoall"):
        raise CalibrateError(f"{path}: an MoE run with the {e['dispatcher']} token dispatcher; the planner's plans run "
                             f"alltoall: re-run with {e['flag']} alltoall and {run['rerun']}")
    freq = e.get("freq", 1)
    if isinstance(freq, str):   # (Megatron-LM writes a list pattern as its string, e.g. "[0]*3+[1]*58")
        raise CalibrateError(f"{path}: moe_layer_freq {freq!r} is not a number or a list of 0/1 per layer")
    if not (isinstance(freq, int) and freq >= 1 or isinstance(freq, list) and len(freq) == sum(layers)):
        raise CalibrateError(f"{path}: moe_layer_freq {freq!r}: expected a whole number >= 1 or one 0/1 per layer "
                             f"({sum(layers)})")
    pattern = moe_layer_pattern(freq, sum(layers))
    starts = [sum(layers[:s]) for s in range(len(layers))]
    mixed = [s for s in chosen if not all(pattern[starts[s]:starts[s] + layers[s]])]
    if mixed:
        raise CalibrateError(f"{path}: stage {mixed[0]} holds dense layers as well as MoE layers (moe_layer_freq "
                             f"{freq}): its times stand for neither; profile a run whose every layer is an MoE layer "
                             "(--moe-layer-freq 1)")
    return out


def calibrate_file(path: str) -> dict:
    """:func:`calibration_from_profile` of the file at ``path``."""
    kind, doc = read_profile(path)
    return calibration_from_profile(kind, doc, path)
