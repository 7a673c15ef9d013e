"""Real NCCL on one GPU: the parity subset against pp=1, with every NCCL strategy of the executor.

Each case trains the same model for 2 iterations (plus one evaluation iteration) under one of
our schedules on 2 or 4 NCCL ranks sharing the GPU, and the pp=1 run of the same model on the
same GPU (Megatron-Core's own no-pipelining function, as many ranks as dp x ep need) is the
reference: every microbatch loss, every gradient of every step and the final parameters are
compared (``testing.parity.compare_records``). The CPU suite proves these bit-exact on gloo; on CUDA
the same argument holds (every reduction happens in the same order on the same shapes) as long
as the kernels are deterministic, so the workers run with ``torch.use_deterministic_algorithms
(True, warn_only=True)`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` and report every op that warned
it has no deterministic implementation. A case passes bit-exact, or -- named as such in the
table -- within the stated tolerance (rtol 1e-5 for losses and for all gradients of a step
together, 1e-4 per tensor, as the CPU suite allows for vocabulary parallelism, whose sharded
softmax is never bit-exact). SGD, so that rounding noise in a not-bit-exact run is not
amplified into the parameters (Adam divides by sqrt(v)).

The cases: pp=2 with the V placement (both neighbours of a rank are the same rank: the case
NCCL's in-order matching makes hard), zbv, v-half, dualpipev, interleaved-zb at pp=4, zbv at
pp=4, vocabulary parallelism, BPipe (activations evicted to the partner rank over NCCL),
activation offload (CUDA copy streams), and a mixture-of-experts model at ep=2 (4 ranks: pp=2 x
dp=2, the all-to-all dispatcher over NCCL). The executor's NCCL strategy is ``channels`` (one
communicator per channel); ``batched`` (Megatron-Core's way) and ``pairwise`` run a subset.
The *busy streams* cases run zbv at pp=2 (and interleaved-zb at pp=4 on a GPU) with every
strategy while other streams are busy as Megatron-LM's tensor-parallel communication overlap
keeps them (:class:`BusyStreams`): NCCL does not promise progress when several communicators of
one GPU are in use at once, and these cases put one more beside the pipeline's.
On CPU (``--cpu``) the same cases run on gloo with NCCL's rules emulated (runtime/nccl_emulation.py).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Any

from megatron_pp_ext.runtime.setup import RunConfig

from .sizes import Mode

__all__ = ["ParityCase", "parity_cases", "parity_worker", "reference_config", "judge", "Probe", "to_cpu",
           "STRATEGIES", "TOLERANCE", "BusyStreams", "stress_label"]

STRATEGIES = ("channels", "batched", "pairwise")
#: (rtol, tensor_rtol) where a run is not bit-exact
TOLERANCE = (1e-5, 1e-4)


@dataclass(frozen=True)
class ParityCase:
    name: str
    kind: str                  # plain | vocab | offload | bpipe
    cfg: RunConfig
    strategy: str
    expect_exact: bool = True
    note: str = ""
    busy: bool = False         # other streams busy, TP-overlap style (BusyStreams)

    @property
    def world(self) -> int:
        return self.cfg.world_size


def _microbatches(name: str, pp: int, chunks: int, preferred: int) -> int:
    """``preferred`` or the next count the schedule builds for (dualpipev: >= 2p)."""
    from megatron_pp_ext.schedule import ScheduleError, build_schedule
    for m in range(preferred, preferred + 4 * pp + 1):
        try:
            build_schedule(name, pp, m, chunks=chunks, with_comm=True)
            return m
        except ScheduleError:
            continue
    raise ValueError(f"{name} builds for no microbatch count near {preferred} at pp={pp}")


def _cfg(mode: Mode, spec, *, schedule, pp: int, m: int, chunks: int = 1, dp: int = 1, ep: int = 1,
         strategy: str = "channels") -> RunConfig:
    return RunConfig(spec=spec, schedule=schedule, pp=pp, dp=dp, ep=ep, chunks=chunks, num_microbatches=m,
                     micro_batch_size=mode.micro_batch_size, seq_length=spec.max_sequence_length, steps=2,
                     eval_iters=1, optimizer="sgd", lr=0.05, p2p=strategy, emulate_nccl=mode.cpu)


def parity_cases(mode: Mode) -> list[ParityCase]:
    """The cases of ``mode`` (quick: the V placement with every strategy, interleaved-zb at pp=4,
    offload and MoE; full: every case with ``channels``, the schedules and MoE with the others)."""
    from megatron_pp_ext.features.bpipe.flags import BPipeScheduleFactory
    from megatron_pp_ext.features.offload.flags import OffloadScheduleFactory

    gpt, llama = mode.parity_spec("gpt"), mode.parity_spec("llama")
    out: list[ParityCase] = []

    def plain(name, spec, schedule, pp, m, chunks=1, strategies=STRATEGIES, quick=False, busy=False):
        """``busy``: beside busy streams standing in for tensor-parallel overlap (BusyStreams)."""
        if mode.quick and not quick:
            return
        m = _microbatches(schedule, pp, chunks, m)
        for s in strategies:
            if mode.quick and s != "channels" and name != "zbv-pp2":
                continue
            out.append(ParityCase(f"{name} [{s}]" + (" busy streams" if busy else ""), "plain",
                                  _cfg(mode, spec, schedule=schedule, pp=pp, m=m, chunks=chunks, strategy=s), s,
                                  busy=busy))

    plain("zbv-pp2", gpt, "zbv", 2, 4, quick=True)
    plain("v-half-pp2", llama, "v-half", 2, 4, strategies=("channels",))
    plain("dualpipev-pp2", llama, "dualpipev", 2, 4)
    plain("interleaved-zb-pp4", gpt, "interleaved-zb", 4, 8, chunks=2, quick=True)
    plain("zbv-pp4", llama, "zbv", 4, 8, strategies=("channels",))
    if not mode.quick:
        out.append(ParityCase("vocab-parallel zbv-pp2 [channels]", "vocab",
                              _cfg(mode, gpt, schedule="zbv", pp=2, m=4), "channels", expect_exact=False,
                              note="vocabulary-parallel softmax: tolerance"))
        out.append(ParityCase("bpipe 1f1b-pp4 [channels]", "bpipe",
                              _cfg(mode, gpt, schedule=BPipeScheduleFactory("1f1b"), pp=4, m=8), "channels"))
    out.append(ParityCase("offload-full zbv-pp2 [channels]", "offload",
                          _cfg(mode, gpt, schedule=OffloadScheduleFactory("zbv", policy="full"), pp=2, m=4),
                          "channels"))
    moe = mode.moe_spec()
    for s in STRATEGIES if not mode.quick else ("channels",):
        out.append(ParityCase(f"moe ep2 zbv-pp2-dp2 [{s}]", "plain",
                              _cfg(mode, moe, schedule="zbv", pp=2, m=4, dp=2, ep=2, strategy=s), s))
    plain("zbv-pp2", gpt, "zbv", 2, 4, quick=True, busy=True)
    if not mode.cpu and not mode.quick:   # (CI: the pp=2 rows carry the path)
        plain("interleaved-zb-pp4", gpt, "interleaved-zb", 4, 8, chunks=2, busy=True)
    return out


def stress_label(case: ParityCase, one_queue: bool) -> str | None:
    """What a hang of ``case`` is a finding about (a result line, not a crash), or None for the
    plain cases, whose hang is a failure: ``"channels hangs under CUDA_DEVICE_MAX_CONNECTIONS=1
    with busy streams"``."""
    conditions = [c for c, on in (("CUDA_DEVICE_MAX_CONNECTIONS=1", one_queue),
                                  ("busy TP-overlap streams", case.busy)) if on]
    return f"{case.strategy} hangs under {' with '.join(conditions)}" if conditions else None


#: parity kinds that are a trainer feature, by the feature's name (its refusals apply to the case)
_FEATURE_OF_KIND = {"vocab": "vocab_parallel", "bpipe": "bpipe", "offload": "activation_offload"}


def one_queue_refusal(case: ParityCase) -> str | None:
    """Why ``case`` is refused under one hardware queue (its feature's ``one_queue_hang``), or None."""
    from megatron_pp_ext.trainer.features import train_features
    name = _FEATURE_OF_KIND.get(case.kind)
    feature = train_features().get(name) if name else None
    why = getattr(feature, "one_queue_hang", None) if feature is not None else None
    if callable(why):   # (vocabulary parallelism: its one-queue mode, what a one-queue run uses, runs)
        why = why(_vocab_config(one_queue=True) if case.kind == "vocab" else None)
    return why


def _vocab_config(one_queue: bool | None = None):
    """The vocabulary-parallel config of the parity cases: Algorithm 2, in the one-queue mode when
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` is set (as ``--vocab-parallel-one-queue auto``)."""
    from megatron_pp_ext.features.vocab.config import VocabParallelConfig
    from megatron_pp_ext.runtime.ncclenv import one_hardware_queue
    return VocabParallelConfig(algorithm=2, one_queue=one_hardware_queue() if one_queue is None else one_queue)


def reference_config(cfg: RunConfig) -> RunConfig:
    """The pp=1 run of ``cfg``: same model, data, dp, ep, loss and optimizer; Megatron-Core's own
    forward-backward function."""
    return cfg.replace(pp=1, schedule=None, chunks=1, memory_budget=None, executor_options={}, record_timings=False,
                       p2p=None, emulate_nccl=False, model_hook=None, executor_factory=None)


# --- worker side --------------------------------------------------------------------------------

def to_cpu(obj: Any) -> Any:
    """A copy of a result with every tensor on the CPU (the parent never makes a CUDA context)."""
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


@dataclass(frozen=True)
class Probe:
    """``run_training``'s ``prepare``: attach a feature runtime (``offload`` / ``bpipe``) to the
    executor, and report what the call ran on (strategy, backend, device, feature figures)."""

    feature: str | None = None
    busy: bool = False

    def __call__(self, tr) -> Any:
        import torch.distributed as dist
        busy = BusyStreams(tr) if self.busy else None
        rt = None
        if self.feature == "offload":
            from megatron_pp_ext.features.offload.runtime import OffloadRuntime
            rt = OffloadRuntime()
        elif self.feature == "bpipe":
            from megatron_pp_ext.features.bpipe.runtime import BPipeRuntime
            rt = BPipeRuntime()
        if rt is not None:
            rt.attach(tr.executor)
            tr.forward_backward = rt.wrap(tr.executor)

        def report() -> dict:
            p = getattr(tr.executor, "last_p2p", None)
            out = {"p2p": getattr(p, "name", None),
                   "comm_model": getattr(p, "comm_model", None), "backend": dist.get_backend(),
                   "device": str(next(tr.model[0].parameters()).device)}
            if busy is not None:
                out["busy"] = {"side_ops": busy.issued}
            if self.feature == "offload":
                out["feature"] = {"offloaded_bytes": int(rt.store.stats.offloaded_bytes),
                                  "peak_offloaded_bytes": int(rt.store.stats.peak_host_bytes),
                                  "copy_streams": int(bool(rt.store.streams))}
            elif self.feature == "bpipe":
                out["feature"] = {"evicted_bytes": int(rt.store.evicted_bytes),
                                  "fetched_bytes": int(rt.store.fetched_bytes),
                                  "peak_partner_bytes": int(rt.peak_partner_bytes)}
            return out
        return report


class BusyStreams:
    """Other streams kept busy the way Megatron-LM's tensor-parallel communication overlap keeps
    them, beside the pipeline's communicators: before every forward op of the executor, a GEMM
    and an all-reduce on a communicator of its own (every rank of the run, as a TP group has
    its own) issued on a side stream without waiting; all of them waited for when the
    forward-backward returns. Every rank runs the same number of forward ops, so the
    all-reduces match (the k-th of every rank). On CPU processes the same calls run under
    NCCL's rules emulated (no streams: the GEMM runs inline). Its communicator is created before
    the run, so what a hang says is about using it beside the pipeline's."""

    def __init__(self, tr):
        import torch
        import torch.distributed as dist
        from megatron_pp_ext.runtime.executor import attach_op_hook
        self.cuda = dist.get_backend() == "nccl"
        dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.group = dist.new_group(list(range(dist.get_world_size())))
        if self.cuda:   # (never a pool stream: it could be a communicator's, docs/gpu.md)
            from megatron_pp_ext.runtime.streams import dedicated_stream
            self.stream = dedicated_stream(dev, "gpu-check-busy")
        else:
            self.stream = None
        n = 1024 if self.cuda else 32
        self.a = torch.randn(n, n, device=dev)
        self.buf = torch.zeros(1 << (20 if self.cuda else 10), device=dev)
        # created and used once here, on every rank before the first step: a communicator created
        # lazily at its first collective, among the executor's first transfers, would be created
        # in different orders on different ranks and hang (docs/gpu.md, lazy communicators)
        dist.all_reduce(self.buf, group=self.group)
        self.works: list = []
        self.issued = 0
        attach_op_hook(tr.executor, self.hook)
        inner = tr.forward_backward

        def forward_backward(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            finally:
                self.drain()
        tr.forward_backward = forward_backward

    def hook(self, op, phase: str) -> None:
        import contextlib
        import torch
        import torch.distributed as dist
        if phase != "before" or op.kind != "F":
            return
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.a @ self.a
            self.works.append(dist.all_reduce(self.buf, group=self.group, async_op=True))
        self.issued += 1

    def drain(self) -> None:
        import torch
        works, self.works = self.works, []
        for w in works:
            w.wait()
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)


_NONDET = re.compile(r"^(\S+) does not have a deterministic implementation")
#: ops that warned they have no deterministic implementation, since the last deterministic_cuda()
_SEEN: list[str] = []
_ORIG_SHOW: list = []


def _show(message, category, filename, lineno, file=None, line=None):
    m = _NONDET.match(str(message))
    if m:
        if m.group(1) not in _SEEN:
            _SEEN.append(m.group(1))
        return
    _ORIG_SHOW[0](message, category, filename, lineno, file, line)


def deterministic_cuda() -> list[str]:
    """Deterministic kernels where CUDA has them (``torch.use_deterministic_algorithms(True,
    warn_only=True)``; the workers' ``CUBLAS_WORKSPACE_CONFIG`` makes cuBLAS deterministic);
    returns the list the names of the ops without one land in (cleared). A no-op on CPU."""
    import torch
    _SEEN.clear()
    if not torch.cuda.is_available():
        return _SEEN
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    if not _ORIG_SHOW:
        _ORIG_SHOW.append(warnings.showwarning)
        warnings.showwarning = _show
        warnings.filterwarnings("always", message=".*does not have a deterministic implementation.*")
    return _SEEN


def parity_worker(kind: str, cfg: RunConfig, busy: bool = False) -> dict:
    """Every rank: one run of ``cfg`` (``kind``: plain, vocab, offload, bpipe; ``busy``: with
    :class:`BusyStreams`); its record on the CPU."""
    seen = deterministic_cuda()
    if kind == "vocab":
        from megatron_pp_ext.testing.vocab import run_vocab_training
        rec = run_vocab_training(cfg, _vocab_config())
    elif kind in ("plain", "offload", "bpipe"):
        from megatron_pp_ext.testing.parity import run_training
        try:
            rec = run_training(cfg, prepare=Probe(None if kind == "plain" or cfg.schedule is None else kind,
                                                  busy=busy) if cfg.schedule is not None else None)
        finally:
            if kind == "bpipe":
                from megatron_pp_ext.features.bpipe.runtime import BPipeGroups
                BPipeGroups.clear_cache()
    else:
        raise ValueError(f"parity kind {kind!r}")
    rec["nondeterministic"] = list(seen)
    return to_cpu(rec)


# --- parent side --------------------------------------------------------------------------------

def merge(kind: str, results: list, cfg: RunConfig) -> dict:
    from megatron_pp_ext.testing.parity import merge_results
    if kind == "vocab":
        from megatron_pp_ext.testing.vocab import merge_vocab_results
        return merge_vocab_results(results, cfg)
    return merge_results(results, cfg)


def judge(case: ParityCase, got: dict, ref: dict, per_rank: list, ref_ranks: list) -> tuple[str, str, dict]:
    """(status, one-line detail, data) of ``case``: bit-exact, or within :data:`TOLERANCE`."""
    from megatron_pp_ext.testing.parity import ParityMismatch, compare_records
    nondet = sorted({op for r in per_rank + ref_ranks for op in r.get("nondeterministic", [])})
    probes = [r["prepared"] for r in per_rank if r.get("prepared")]
    feature: dict = {}
    for p in probes:   # (summed over the ranks)
        for k, v in (p.get("feature") or {}).items():
            feature[k] = feature.get(k, 0) + v
    probe = dict(probes[0], feature=feature) if probes else {}
    data = {"world": case.world, "strategy": case.strategy, "nondeterministic_ops": nondet, "probe": probe,
            "microbatches": case.cfg.num_microbatches, "steps": case.cfg.steps}
    problems = []
    if probes:
        want = case.strategy if not case.cfg.emulate_nccl else f"emulated-{case.strategy}"
        ran = sorted({str(p.get("p2p")) for p in probes})
        if ran != [want]:
            problems.append(f"ran strategy {ran}, not {want}")
        if case.busy and not all((p.get("busy") or {}).get("side_ops") for p in probes):
            problems.append(f"the busy streams issued nothing on some rank ({[p.get('busy') for p in probes]})")
        if case.kind == "offload" and not feature.get("offloaded_bytes"):
            problems.append(f"nothing was offloaded ({feature})")
        if case.kind == "bpipe" and not feature.get("evicted_bytes"):
            problems.append(f"nothing was evicted ({feature})")
        if case.kind == "bpipe" and feature.get("evicted_bytes") != feature.get("fetched_bytes"):
            problems.append(f"evicted {feature.get('evicted_bytes')} B but fetched {feature.get('fetched_bytes')} B")
    # (the vocabulary-parallel harness records no optimizer steps: compared without them, as its tests do)
    without = ("optimizer_steps",) if case.kind == "vocab" else ()
    try:
        compare_records(got, ref, what=case.name, without=without)
        data["exact"] = True
        detail = "bit-exact"
    except ParityMismatch as e:
        data["exact"] = False
        data["first_mismatch"] = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
        rtol, trtol = TOLERANCE
        try:
            worst = compare_records(got, ref, rtol=rtol, tensor_rtol=trtol, what=case.name, without=without)
            data["worst"] = worst
            detail = (f"within rtol {rtol:g} (tensor {trtol:g}), not bit-exact: worst loss {worst['loss']:.1e}, "
                      f"grads {worst['grad']:.1e}")
            if case.expect_exact:
                detail += "; expected bit-exact" + (f" (nondeterministic: {', '.join(nondet)})" if nondet else "")
        except ParityMismatch as e2:
            lines = str(e2).splitlines()
            problems.append(f"outside rtol {rtol:g}: {lines[1].strip() if len(lines) > 1 else lines[0]}")
            detail = ""
    if feature:
        detail += "; " + ", ".join(f"{k}={v}" for k, v in feature.items() if not k.startswith("peak"))
    if case.busy and probes:
        data["busy_side_ops"] = [(p.get("busy") or {}).get("side_ops") for p in probes]
        detail += (f"; beside it {min(data['busy_side_ops'])} GEMM + all-reduce pairs per rank on a side stream and "
                   "a communicator of their own")
    if problems:
        return "fail", "; ".join(problems + ([detail] if detail else [])), data
    return "pass", detail + (f"; {case.note}" if case.note else ""), data
