"""``mppx train``'s flags for DeepSeek-V3-style training: overlapped forward-backward pairs and
multi-token prediction, with Megatron-LM's names and rules.

``--overlap-moe-expert-parallel-comm`` runs forwards and backwards of other microbatches as
overlapped pairs where that pays (schedule/pairs.py), through Megatron-Core's fine-grained
schedule plan (runtime/overlap.py). It works alone, as Megatron's flag does; the expert
all-to-all time the pairing decides by is, in this order:

* given: ``--a2a-time T`` (per microbatch and rank, in ``--costs`` units), an override that is
  not measured over (no profiling window then: its times are milliseconds);
* measured: with a profiling window (the default with one of our schedules and ``--iters`` >= 5)
  the window times the dispatcher's all-to-alls as it times the ops (trainer/profile.py), and
  the re-generated schedule is paired from the measured costs; until then it runs unpaired;
* none yet: the pairs the schedule publishes (DualPipeV's) run as they are, other schedules run
  unpaired, and a note says so.

``--delay-wgrad-compute`` is Megatron-LM's flag of
Transformer Engine's deferred weight gradients. ``--mtp-num-layers N`` (and
``--mtp-loss-scaling-factor``) adds Megatron-Core's multi-token prediction layers on the last
stage. Everything that cannot run is refused here, in the parent, in one line naming the flag and
the fix. No torch import.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

from ..clibase import add_overlap_arguments

__all__ = ["add_frontier_arguments", "frontier_from_args", "check_frontier", "mtp_spec_fields", "OVERLAP_FLAG",
           "overlap_plan", "overlap_summary"]

OVERLAP_FLAG = "--overlap-moe-expert-parallel-comm"
#: Megatron-LM's default --mtp-loss-scaling-factor
MTP_LOSS_SCALING_DEFAULT = 0.1


def add_frontier_arguments(parser: argparse.ArgumentParser, whole: Callable[[str], int],
                           number: Callable[[str], float]) -> None:
    g = parser.add_argument_group("overlapped pairs and multi-token prediction (Megatron-LM's flags)")
    add_overlap_arguments(g, train=True)
    g.add_argument("--delay-wgrad-compute", action="store_true",
                   help="Megatron-LM's deferred weight gradients of Transformer Engine layers (with "
                        f"{OVERLAP_FLAG}); the local layers' B/W split defers them already")
    g.add_argument("--mtp-num-layers", type=whole, default=None, metavar="N",
                   help="multi-token prediction: N MTP layers (the kind of the last decoder layer) and their loss on "
                        "the last stage, where Megatron-Core puts them (V placement: rank 0's last chunk)")
    g.add_argument("--mtp-loss-scaling-factor", type=number, default=MTP_LOSS_SCALING_DEFAULT, metavar="S",
                   help="weight of the MTP loss (default: 0.1, as in Megatron-LM)")


def frontier_from_args(args: argparse.Namespace) -> dict:
    """TrainConfig fields of these flags."""
    return dict(overlap_moe_expert_parallel_comm=bool(args.overlap_moe_expert_parallel_comm),
                a2a_time=args.a2a_time, delay_wgrad_compute=bool(args.delay_wgrad_compute),
                mtp_num_layers=args.mtp_num_layers, mtp_loss_scaling_factor=args.mtp_loss_scaling_factor)


def check_frontier(c: Any, *, pp: int, mcore: bool, layers: int, moe_pattern: tuple[int, ...]) -> str | None:
    """The first error of these flags (naming the flag and the fix), or None. ``moe_pattern``: 1 per
    MoE layer, 0 per dense one."""
    if c.mtp_num_layers is not None:
        if c.mtp_num_layers < 1:
            return f"--mtp-num-layers {c.mtp_num_layers}: must be >= 1"
        if c.features:
            return f"--mtp-num-layers with {_feature_flags(c)}: not supported together yet; drop one of them"
    if not (math.isfinite(c.mtp_loss_scaling_factor) and c.mtp_loss_scaling_factor >= 0):
        return f"--mtp-loss-scaling-factor {c.mtp_loss_scaling_factor}: must be a finite number >= 0, e.g. 0.1"
    if c.mtp_num_layers is None and c.mtp_loss_scaling_factor != MTP_LOSS_SCALING_DEFAULT:
        return (f"--mtp-loss-scaling-factor {c.mtp_loss_scaling_factor:g} scales the multi-token prediction loss, and "
                "there is none without --mtp-num-layers N: add it or drop the flag")
    if c.delay_wgrad_compute:
        if not c.overlap_moe_expert_parallel_comm:
            return f"--delay-wgrad-compute needs {OVERLAP_FLAG} (Megatron-Core's rule); add it or drop the flag"
        return ("--delay-wgrad-compute defers Transformer Engine's weight gradients (Megatron-LM's rule: "
                "--transformer-impl transformer_engine), which mppx train does not run with --num-experts; the local "
                "layers' B/W split already runs the weight gradients of a pair's backward in their W op: drop the flag")
    if not c.overlap_moe_expert_parallel_comm:
        if c.a2a_time is not None:   # (a flag that would do nothing is refused, not ignored)
            return (f"--a2a-time {c.a2a_time:g} times the all-to-all that overlapped pairs hide, and nothing is paired "
                    f"without {OVERLAP_FLAG}: add it or drop --a2a-time")
        return None
    f = OVERLAP_FLAG
    if c.num_experts is None:
        return (f"{f} hides the expert all-to-all of a mixture-of-experts model, and this model is dense: add "
                "--num-experts E with --expert-model-parallel-size >= 2, or drop the flag")
    if c.expert_model_parallel_size < 2:
        return (f"{f} needs --expert-model-parallel-size >= 2: with one expert-parallel rank there is no all-to-all "
                "to hide; raise it (and --nproc) or drop the flag")
    if c.num_experts == c.expert_model_parallel_size:
        return (f"{f} with one expert per expert-parallel rank (--num-experts {c.num_experts} = "
                f"--expert-model-parallel-size): Megatron-Core's plan frees the dispatched tokens that the single "
                "local expert keeps for its backward; use at least two experts per rank (e.g. --num-experts "
                f"{2 * c.expert_model_parallel_size})")
    if c.moe_token_dispatcher_type != "alltoall":
        return f"{f} overlaps the all-to-all dispatcher (Megatron-Core's rule): add --moe-token-dispatcher-type alltoall"
    if c.a2a_time is not None and not (math.isfinite(c.a2a_time) and c.a2a_time > 0):
        return (f"{f} with --a2a-time {c.a2a_time:g}: there is no all-to-all time to hide; give the measured time "
                "(--a2a-time T > 0), drop --a2a-time to have the profiling window measure it, or drop the flag")
    if mcore or pp < 2:
        return (f"{f} runs the pairs of our schedules (Megatron-Core's combined 1F1B needs bf16 and --vp): use "
                "--pp >= 2 with one of them, e.g. --schedule dualpipev")
    if c.features:
        return f"{f} with {_feature_flags(c)}: not supported together yet; drop one of them"
    if c.recompute_granularity is not None:
        return (f"{f} with --recompute-granularity: Megatron-Core's plan runs without activation recomputation; "
                "drop --recompute-granularity")
    if c.mtp_num_layers is not None:
        if c.mtp_num_layers != 1:
            return f"{f} with --mtp-num-layers {c.mtp_num_layers}: Megatron-Core overlaps one MTP layer; use 1"
        if not moe_pattern or not moe_pattern[-1]:
            return (f"{f} with --mtp-num-layers: Megatron-Core's plan overlaps an MTP layer only when it is an MoE "
                    "layer, and the MTP layer takes the kind of the last decoder layer; make the last layer MoE "
                    "(--moe-layer-freq)")
    from .. import compat
    if not compat.has_fine_grained_plan():
        return (f"{f} runs through Megatron-Core's fine-grained schedule plan, which this megatron-core lacks; "
                "install megatron-core 0.16.1 or later, or drop the flag")
    return None


def overlap_plan(c: Any, sched: Any, *, measure: bool, window: tuple[int, int]) -> tuple[str, dict]:
    """The note line and ``Plan.overlap_info`` of the flag: where the pairs of ``sched`` (the
    schedule the run starts with) come from (module doc)."""
    from ..schedule.pairs import count_pairs
    n, meta, name = count_pairs(sched), sched.meta, c.schedule
    head = "overlapped pairs:"
    if c.a2a_time is not None:
        return (f"{head} {n} forward-backward pairs ({meta.get('overlap_policy')}) through Megatron-Core's fine-grained "
                f"schedule plan, paired by the all-to-all time given with --a2a-time ({c.a2a_time:g} per microbatch "
                f"and rank, --costs units) (the same schedule unpaired: simulated makespan "
                f"{meta.get('overlap_unpaired_makespan', float('nan')):g} without send/recv)",
                {"pairs_from": "given", "a2a_time": c.a2a_time, "a2a_unit": "--costs units", "pairs": n,
                 "policy": meta.get("overlap_policy")})
    if measure:
        span = f"iteration {window[0]}" if window[0] == window[1] else f"iterations {window[0]}-{window[1]}"
        return (f"{head} from the all-to-all time the profiling window measures ({span}: "
                "dispatch and combine of Megatron-Core's alltoall dispatcher, timed in every F and B); until then "
                f"{name} runs unpaired, so that F, B and the all-to-all inside them are timed apart",
                {"pairs_from": "measured", "a2a_time": None, "a2a_unit": "ms", "pairs": 0, "initial_pairs": 0,
                 "window": list(window)})
    why = ("no all-to-all time is measured (no profiling window: --profile-iters K with --iters >= K + 2 has one) "
           "or given (--a2a-time T)")
    if n:
        return (f"{head} {n} forward-backward pairs, the ones {name} publishes, through Megatron-Core's fine-grained "
                f"schedule plan: {why} to choose others by",
                {"pairs_from": "published", "a2a_time": None, "a2a_unit": None, "pairs": n, "policy": "published"})
    return (f"{head} none: {name} publishes no pairs, and {why} to choose them by; it runs unpaired",
            {"pairs_from": "none", "a2a_time": None, "a2a_unit": None, "pairs": 0, "policy": "none"})


def overlap_summary(info: dict, profile: dict | None) -> dict | None:
    """``summary.json``'s ``overlap``: ``Plan.overlap_info`` and, when the pairs come from the
    measurement, what the profiling window measured (``a2a_ms``: per stage forward, backward and
    the model's mean, per rank) and paired (None without the flag)."""
    if not info:
        return None
    out = dict(info)
    if info.get("pairs_from") != "measured":
        return out
    prof = profile or {}
    a2a = prof.get("a2a_ms")
    out["a2a_ms"] = a2a
    out["a2a_time"] = a2a["per_rank"] if a2a else None
    pairs = prof.get("pairs")
    if pairs is None:
        out["why"] = ("the profiling window did not re-generate the schedule"
                      + (f" ({prof['error']})" if prof.get("error") else "") + ": the run stayed unpaired")
        return out
    out["pairs"] = pairs.get("count", 0)
    out["policy"] = pairs.get("policy")
    if pairs.get("why"):
        out["why"] = pairs["why"]
    return out


def _feature_flags(c: Any) -> str:
    from .features import train_features
    registry = train_features()
    return ", ".join(registry[name].flag_of(cfg) for name, cfg in c.features)


def mtp_spec_fields(c: Any) -> dict:
    """ModelSpec fields of these flags (empty without multi-token prediction)."""
    if c.mtp_num_layers is None:
        return {}
    return dict(mtp_num_layers=c.mtp_num_layers, mtp_loss_scaling_factor=float(c.mtp_loss_scaling_factor))
