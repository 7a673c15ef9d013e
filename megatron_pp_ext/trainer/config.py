"""Flags of ``mppx train``, their validation, and the :class:`Plan` derived from them.

Everything that can be wrong with a request is found here, in the parent process, before any
worker starts: impossible layouts (layers that cannot be placed on ``pp x vp`` stages, a
process count not divisible by ``tp x pp``, heads not divisible by ``tp``, key/value heads that
do not divide the heads, ...), unknown schedules, and memory budgets the schedule cannot meet
(the schedule is built and validated here, with send/recv ops, exactly as the workers will).
Errors are :class:`TrainConfigError` (a ``ValueError``) whose message names the flag and the fix.

Importing this module is cheap (no torch): torch is imported only to resolve ``--device auto``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..runtime.ncclenv import check_nccl_environment
from ..runtime.p2pstrategy import NCCL_STRATEGIES
from .errors import TrainConfigError
from .moe import add_moe_arguments, check_moe, moe_from_args, moe_spec_fields
from .overlap import (MTP_LOSS_SCALING_DEFAULT, add_frontier_arguments, check_frontier, frontier_from_args,
                      mtp_spec_fields)
from .options import add_training_arguments, check_training_options, options_from_args, run_options

__all__ = ["TrainConfig", "TrainConfigError", "Plan", "Launch", "make_plan", "add_arguments",
           "config_from_args", "MCORE", "DEFAULTS"]

#: the largest --timeout (seconds: about 31 years) and --seed (Megatron-Core adds its offsets to the
#: seed, and NumPy's generator takes at most 2^32 - 1)
MAX_TIMEOUT_S = 1e9
MAX_SEED = 2**31 - 1

#: ``--schedule mcore``: Megatron-Core's own forward-backward function (1F1B, or interleaved
#: 1F1B with ``--vp`` > 1): the baseline.
MCORE = "mcore"


@dataclass(frozen=True)
class TrainConfig:
    """The flags of ``mppx train`` (None: derived, see :func:`make_plan`)."""

    # model
    model: str = "gpt"
    layers: int | None = None            # default 8 (or the sum of --layers-per-stage)
    layers_per_stage: tuple[int, ...] | None = None
    pipeline_layout: str | None = None   # Megatron-Core's --pipeline-model-parallel-layout (loop placement)
    hidden: int = 64
    heads: int = 4
    kv_heads: int | None = None          # gpt: heads; llama: heads // 2
    ffn: int | None = None               # gpt: 4 * hidden; llama: 2 * hidden (SwiGLU)
    vocab: int = 256
    tie_embeddings: bool = False
    seq: int = 32
    dropout: float = 0.0
    transformer_impl: str = "auto"       # auto: local (TE's B/W split is not verified on a GPU yet)
    te_wgrad_split: bool = False         # --te-wgrad-split: TE's own B/W split (runtime/te_policy.py)
    # batch and layout
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # default: 2 * pp microbatches per data-parallel rank
    pp: int = 4
    tp: int = 1
    vp: int | None = None                # chunks per rank (V schedules: 2)
    nproc: int | None = None             # local processes; default tp * pp (dp = 1)
    # schedule
    schedule: str = "zbv"
    memory_budget: str | None = None
    costs: str | None = None
    profile_iters: int | None = None     # default 3 with one of our schedules, else 0
    #: --emulate-compute MS: every compute op waits its --costs time (1 unit = MS milliseconds)
    #: instead of computing (runtime/emulate.py); None: real compute
    emulate_compute: float | None = None
    #: --emulate-nccl [STRATEGY]: the executor's NCCL strategy with NCCL's semantics on gloo
    emulate_nccl: str | None = None
    #: --p2p-strategy: the executor's point-to-point strategy on NCCL (None: channels); with
    #: --emulate-nccl the strategy emulated (runtime/p2pstrategy.py)
    p2p_strategy: str | None = None
    # training
    iters: int = 20
    lr: float = 1e-3
    allow_nonfinite_loss: bool = False   # train on past a NaN/inf loss (the run still fails)
    # precision, data parallelism, clipping, recomputation (trainer/options.py; Megatron-LM's flags)
    bf16: bool = False
    fp16: bool = False
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    sequence_parallel: bool = False
    distributed_optimizer: bool = False   # --use-distributed-optimizer
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    clip_grad: float = 0.0
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    seed: int = 1234
    data_path: str | None = None
    # mixture of experts (trainer/moe.py; Megatron-LM's flags)
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_aux_loss_coeff: float = 0.0
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_shared_expert_intermediate_size: int | None = None
    moe_token_dispatcher_type: str = "allgather"
    moe_router_score_function: str = "softmax"
    moe_router_enable_expert_bias: bool = False
    moe_router_pre_softmax: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None   # None: --tp
    # overlapped pairs and multi-token prediction (trainer/overlap.py; Megatron-LM's flags)
    overlap_moe_expert_parallel_comm: bool = False
    a2a_time: float | None = None
    delay_wgrad_compute: bool = False
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = MTP_LOSS_SCALING_DEFAULT
    # run
    device: str = "auto"
    out: str = "mppx-train"
    json_log: str | None = None
    reference_iters: int | None = None   # default: min(--iters, 5)
    threads: int = 1
    log_interval: int = 1
    progress: bool = True
    timeout: float = 86400.0
    # feature plug-ins (trainer/features.py): (name, config) of each one the flags turn on
    features: tuple = ()
    # checkpoints (trainer/checkpoint.py)
    save: str | None = None
    save_interval: int | None = None     # default: save at the end only
    load: str | None = None
    save_overwrite: bool = False         # --save over a directory holding another run's checkpoints
    verify_checkpoint: bool = True       # hash the --load checkpoint's files before any worker starts

    def replace(self, **kw) -> "TrainConfig":
        return dataclasses.replace(self, **kw)


DEFAULTS = TrainConfig()


@dataclass(frozen=True)
class Launch:
    """How the processes of a run come to be.

    ``mode``: "local" (this process starts ``world`` workers itself), "torchrun" or "slurm"
    (this process is one of ``world`` ranks started by the launcher).
    """

    mode: str = "local"
    world: int | None = None
    rank: int = 0
    local_rank: int = 0
    local_world: int | None = None
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def external(self) -> bool:
        return self.mode != "local"


@dataclass(frozen=True)
class Plan:
    """A validated run: the layout, the schedule and the runtime configuration.

    Picklable (it travels to the workers). ``built`` (the schedule and cost model built in the
    parent, for the figure) is dropped by :meth:`for_workers`.
    """

    cfg: TrainConfig
    launch: Launch
    device: str                      # "cpu" or "cuda"
    world: int
    dp: int
    microbatches: int                # per data-parallel rank and iteration
    chunks: int                      # model chunks per pipeline rank
    placement: tuple[int, ...]       # stage -> pipeline rank
    layers_per_stage: tuple[int, ...]
    runtime_schedule: str | None     # registered name run by our executor; None: Megatron-Core's
    figure_schedule: str | None      # registered schedule drawn in the figure (mcore: its equivalent)
    costs: tuple[float, float, float, float]
    memory_budget: float | None      # activation units per rank
    profile_iters: int
    reference_iters: int
    data: str                        # "mock" or the --data-path prefix
    out_dir: str
    json_log: str
    text_log: str
    figure: str
    summary: str
    notes: tuple[str, ...] = ()
    built: Any = field(default=None, compare=False, repr=False)
    resume: Any = None               # checkpoint.Resume when --load found a checkpoint
    transformer_impl: str = "local"  # resolved --transformer-impl
    schedule_factory: Any = None     # a feature's (pp, m) -> (Schedule, CostModel) run instead of the name
    feature_summary: dict = field(default_factory=dict)
    emulation: Any = None            # EmulationPlan with --emulate-compute
    memory_prediction: Any = None    # trainer/memmodel.py: predicted_peak_bytes per pipeline rank, ...
    build_cost: Any = None           # the CostModel a budgeted schedule is built with (memmodel.held_cost)
    #: --overlap-moe-expert-parallel-comm without --a2a-time, with a profiling window: the window
    #: measures the all-to-all and the schedule is paired from it (trainer/profile.py); until
    #: then it runs unpaired
    measure_a2a: bool = False
    #: where the pairs come from (trainer/overlap.py: overlap_plan); empty without the flag
    overlap_info: dict = field(default_factory=dict)

    # -- derived -----------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def kv_heads(self) -> int:
        c = self.cfg
        if c.kv_heads is not None:
            return c.kv_heads
        return max(1, c.heads // 2) if c.model == "llama" else c.heads

    @property
    def ffn(self) -> int:
        c = self.cfg
        if c.ffn is not None:
            return c.ffn
        return 2 * c.hidden if c.model == "llama" else 4 * c.hidden

    @property
    def layers(self) -> int:
        return sum(self.layers_per_stage)

    @property
    def global_microbatches(self) -> int:
        return self.microbatches * self.dp

    @property
    def schedule_label(self) -> str:
        c = self.cfg
        if self.cfg.pp == 1:
            return "none (pp=1: Megatron-Core's forward_backward_no_pipelining)"
        if self.runtime_schedule is None:
            kind = "interleaved 1F1B" if self.chunks > 1 else "1F1B"
            return f"mcore (Megatron-Core's own {kind})"
        return c.schedule

    def for_workers(self) -> "Plan":
        return dataclasses.replace(self, built=None)

    def model_spec(self):
        from ..runtime.model import ModelSpec
        c = self.cfg
        return ModelSpec(c.model, num_layers=self.layers, hidden_size=c.hidden, num_attention_heads=c.heads,
                         num_query_groups=self.kv_heads, ffn_hidden_size=self.ffn, vocab_size=c.vocab,
                         max_sequence_length=c.seq, tie_embeddings=c.tie_embeddings,
                         layers_per_stage=self.layers_per_stage if self.num_stages > 1 else None,
                         transformer_impl=self.transformer_impl, te_wgrad_split=c.te_wgrad_split,
                         **moe_spec_fields(c), **mtp_spec_fields(c))

    def _overrides(self) -> dict:
        d = self.cfg.dropout
        return {"hidden_dropout": d, "attention_dropout": d} if d > 0 else {}

    def run_config(self):
        """The runtime's RunConfig of the main run."""
        from ..runtime.setup import RunConfig
        c = self.cfg
        pipelined = c.pp > 1
        if self.emulation is not None:
            return self._comm(self.emulation.run_config(self))
        run = RunConfig(spec=self.model_spec(), tp=c.tp, pp=c.pp, dp=self.dp,
                         schedule=(self.schedule_factory or self.runtime_schedule) if pipelined else None,
                         chunks=self.chunks if pipelined else 1,
                         memory_budget=self.memory_budget,
                         costs=self.build_cost if self.build_cost is not None else self.costs,
                         num_microbatches=self.microbatches, micro_batch_size=c.micro_batch_size,
                         seq_length=c.seq, steps=c.iters, eval_iters=0, seed=c.seed, lr=c.lr,
                         ep=c.expert_model_parallel_size, etp=c.expert_tensor_parallel_size,
                         overlap_moe=c.overlap_moe_expert_parallel_comm and pipelined and not self.measure_a2a,
                         a2a_time=c.a2a_time,
                         config_overrides=self._overrides(), **run_options(c, tp=c.tp))
        if c.features:
            from .features import feature_run_config
            run = feature_run_config(c.features, run)
        return self._comm(run)

    def _comm(self, run):
        """--p2p-strategy / --emulate-nccl: the strategy (and its emulation) for the executor of the
        main run."""
        if self.cfg.emulate_nccl:
            return run.replace(p2p=self.cfg.emulate_nccl, emulate_nccl=True)
        if self.cfg.p2p_strategy and self.device == "cuda":
            return run.replace(p2p=self.cfg.p2p_strategy)
        return run

    def reference_config(self):
        """The pp=1 run on one process: same model, weights, data (every microbatch), optimizer."""
        from ..runtime.setup import RunConfig
        c = self.cfg
        return RunConfig(spec=dataclasses.replace(self.model_spec(), layers_per_stage=None), tp=1, pp=1, dp=1,
                         schedule=None, chunks=1, num_microbatches=self.global_microbatches,
                         micro_batch_size=c.micro_batch_size, seq_length=c.seq, steps=self.reference_iters,
                         eval_iters=0, seed=c.seed, lr=c.lr, config_overrides=self._overrides(),
                         **run_options(c, tp=1))


# --- validation ---------------------------------------------------------------------------

def _fail(msg: str) -> None:
    raise TrainConfigError(msg)


def _divisors_near(n: int, k: int) -> str:
    lo = (n // k) * k
    cands = [x for x in (lo, lo + k) if x > 0]
    return " or ".join(str(x) for x in cands)


def _check_model(c: TrainConfig, kv: int, ffn: int) -> None:
    if c.hidden % c.heads:
        _fail(f"--hidden {c.hidden} is not divisible by --heads {c.heads}; use e.g. --hidden "
              f"{_divisors_near(c.hidden, c.heads)}")
    if kv > c.heads or c.heads % kv:
        _fail(f"--kv-heads {kv} must divide --heads {c.heads} (grouped-query attention: every key/value "
              f"head serves heads/kv-heads query heads); use one of "
              f"{', '.join(str(d) for d in range(1, c.heads + 1) if c.heads % d == 0)}")
    if c.tp > 1:
        for flag, value in (("--heads", c.heads), ("--kv-heads", kv), ("--ffn", ffn), ("--vocab", c.vocab)):
            if value % c.tp:
                what = "" if flag != "--kv-heads" or c.kv_heads is not None else f" (default for --model {c.model})"
                _fail(f"{flag} {value}{what} is not divisible by --tp {c.tp}: tensor parallelism splits it "
                      f"over the tp ranks; use e.g. {flag} {_divisors_near(value, c.tp)} or a smaller --tp")
    if not 0.0 <= c.dropout < 1.0:
        _fail(f"--dropout {c.dropout} must be in [0, 1)")
    if c.seq < 2:
        _fail(f"--seq {c.seq}: need at least 2 tokens per sequence")
    if c.vocab < 4:
        _fail(f"--vocab {c.vocab}: need at least 4 tokens")
    if not (c.lr > 0 and math.isfinite(c.lr)):
        _fail(f"--lr {c.lr} must be a positive number, e.g. 1e-3")


def _schedule_names() -> list[str]:
    from ..schedule import schedule_names
    return [MCORE] + schedule_names()


def _resolve_transformer_impl(requested: str, device: str) -> str:
    """``--transformer-impl``: auto is the verified path (Megatron-Core's local spec)."""
    from ..runtime.model import transformer_engine_available
    if requested not in ("auto", "local", "transformer_engine"):
        _fail(f"--transformer-impl {requested!r}: use auto, local or transformer_engine")
    if requested == "local":
        return "local"
    if requested == "transformer_engine":
        if device != "cuda":
            _fail("--transformer-impl transformer_engine runs on GPUs only; use --device cuda, or --transformer-impl "
                  "local on CPU")
        if not transformer_engine_available():
            _fail("--transformer-impl transformer_engine: Transformer Engine is not installed (pip install "
                  "transformer_engine[pytorch]); use --transformer-impl local")
        return "transformer_engine"
    # auto: the path that has been verified. Transformer Engine's B/W split (backward_dw) has
    # not run on a GPU in this project yet, so auto stays on the local spec (make_plan says so).
    return "local"


def _te_installed() -> bool:
    from ..runtime.model import transformer_engine_available
    return transformer_engine_available()


def _resolve_device(requested: str, launch: Launch, world: int | None) -> str:
    if requested not in ("auto", "cpu", "cuda"):
        _fail(f"--device {requested!r}: use auto, cpu or cuda")
    if requested == "cpu":
        return "cpu"
    try:
        import torch
        have = torch.cuda.is_available()
        count = torch.cuda.device_count() if have else 0
    except Exception:  # pragma: no cover - torch is a dependency
        have, count = False, 0
    if requested == "cuda" and not have:
        _fail("--device cuda: no CUDA device is available here; use --device cpu (gloo) or auto")
    if not have:
        return "cpu"
    if not launch.external and world is not None and world > count:
        from ..runtime.shared_gpu import SHARE_GPU_ENV, share_gpu_requested
        if share_gpu_requested():
            return "cuda"  # (several ranks per GPU, asked for: runtime/shared_gpu.py)
        if requested == "cuda":
            _fail(f"--device cuda with {world} local processes needs {world} GPUs, but {count} are visible; "
                  f"lower --nproc/--pp/--tp or use --device cpu (or set {SHARE_GPU_ENV}=1 to let ranks share "
                  "a GPU: NCCL checks, timings meaningless)")
        return "cpu"  # auto: not enough GPUs for one per process
    return "cuda"


def _layout_layers(c: TrainConfig, info, pipelined: bool) -> tuple[int, ...]:
    """Layers per stage of ``--pipeline-model-parallel-layout`` (Megatron-Core's string, stage s
    on rank s mod pp): its stage count fixes the chunks per rank; refused with
    ``--layers-per-stage``, with a V placement, or with another chunk count."""
    from ..layer_pattern import parse_layout
    flag = "--pipeline-model-parallel-layout"
    if c.layers_per_stage is not None:
        _fail(f"{flag} and --layers-per-stage both give the layer split; drop one of them")
    try:
        lps = parse_layout(c.pipeline_layout)
    except ValueError as e:
        _fail(f"{flag} {c.pipeline_layout[:60]!r}: {e}")
    S = len(lps)
    if not pipelined:
        if S != 1:
            _fail(f"{flag} has {S} stages but --pp is 1; give --pp P with P dividing {S}, or one stage")
        return lps
    if S % c.pp:
        _fail(f"{flag} has {S} stages, not a multiple of --pp {c.pp}; give pp x chunks stages")
    chunks = S // c.pp
    if info is not None and info.placement == "v":
        _fail(f"{flag} places stage s on rank s mod pp; schedule {c.schedule!r} uses the V placement: give its "
              "split with --layers-per-stage (the form mppx plan prints for V schedules)")
    fixed = info.chunks if info is not None else None
    if fixed is not None and chunks != fixed:
        _fail(f"{flag} has {S} stages = {chunks} chunk(s) per rank, but schedule {c.schedule!r} uses {fixed}")
    if c.vp is not None and c.vp != chunks:
        _fail(f"{flag} has {S} stages = {chunks} chunk(s) per rank at --pp {c.pp}, but --vp is {c.vp}; drop --vp")
    return lps


def make_plan(cfg: TrainConfig, launch: Launch | None = None) -> Plan:
    """Validate ``cfg`` and derive the run (layout, schedule, files). Raises TrainConfigError."""
    from ..schedule import ScheduleError, build_schedule, parse_memory_budget, schedule_info

    c = cfg
    launch = launch or Launch()
    notes: list[str] = []
    for flag, value, lo in (("--layers", c.layers, 1), ("--hidden", c.hidden, 1), ("--heads", c.heads, 1),
                            ("--kv-heads", c.kv_heads, 1), ("--ffn", c.ffn, 1), ("--seq", c.seq, 1),
                            ("--micro-batch-size", c.micro_batch_size, 1),
                            ("--global-batch-size", c.global_batch_size, 1), ("--pp", c.pp, 1),
                            ("--tp", c.tp, 1), ("--vp", c.vp, 1), ("--nproc", c.nproc, 1), ("--iters", c.iters, 1),
                            ("--profile-iters", c.profile_iters, 0), ("--reference-iters", c.reference_iters, 0),
                            ("--threads", c.threads, 1), ("--log-interval", c.log_interval, 1),
                            ("--vocab", c.vocab, 1)):
        if value is not None and value < lo:
            _fail(f"{flag} {value}: must be >= {lo}")
    if c.model not in ("gpt", "llama"):
        _fail(f"--model {c.model!r}: use gpt or llama")
    kv = c.kv_heads if c.kv_heads is not None else (max(1, c.heads // 2) if c.model == "llama" else c.heads)
    ffn = c.ffn if c.ffn is not None else (2 * c.hidden if c.model == "llama" else 4 * c.hidden)
    _check_model(c, kv, ffn)

    # -- precision, data parallelism, clipping, recomputation (Megatron-LM's rules) ---------
    opt_errors, opt_notes = check_training_options(c, tp=c.tp, layers_per_stage=(1,))
    if opt_errors:
        _fail(opt_errors[0])
    notes.extend(opt_notes)

    # -- schedule and chunks -----------------------------------------------------------
    names = _schedule_names()
    if c.schedule not in names:
        _fail(f"unknown schedule {c.schedule!r} (--schedule); available: {', '.join(names)}")
    mcore = c.schedule == MCORE
    pipelined = c.pp > 1
    if c.emulate_nccl and c.p2p_strategy and c.emulate_nccl != c.p2p_strategy:
        _fail(f"--emulate-nccl {c.emulate_nccl} contradicts --p2p-strategy {c.p2p_strategy}: name the strategy "
              f"once (--p2p-strategy {c.p2p_strategy} --emulate-nccl)")
    _check_emulation_env(c)
    if c.emulate_nccl and mcore:
        _fail("--emulate-nccl emulates our executor's NCCL path; --schedule mcore runs Megatron-Core's own "
              "point-to-point: drop one of them")
    if c.p2p_strategy and mcore:
        _fail(f"--p2p-strategy {c.p2p_strategy} picks our executor's point-to-point; --schedule mcore runs "
              "Megatron-Core's own: drop one of them")
    if mcore:
        info = None
        chunks = c.vp or 1
        runtime_schedule = None
        figure_schedule = "interleaved-1f1b" if chunks > 1 else "1f1b"
    else:
        info = schedule_info(c.schedule)
        if info.chunks is not None:
            if c.vp not in (None, info.chunks):
                _fail(f"--vp {c.vp}: schedule {c.schedule!r} always uses {info.chunks} model chunks per rank "
                      f"({info.placement} placement); drop --vp or use --vp {info.chunks}")
            chunks = info.chunks
        else:
            chunks = c.vp or 1
        runtime_schedule = c.schedule
        figure_schedule = c.schedule
    if not pipelined:
        if c.vp not in (None, 1):
            _fail(f"--vp {c.vp} needs --pp > 1 (virtual pipeline stages are chunks of pipeline ranks)")
        if c.memory_budget is not None:
            _fail("--memory-budget needs --pp > 1 (it is the activation budget of a pipeline schedule)")
        if not mcore:
            notes.append(f"--pp 1: no pipeline, so --schedule {c.schedule} does not apply; running Megatron-Core's "
                         "forward_backward_no_pipelining")
        if c.emulate_nccl:
            notes.append("--pp 1: no point-to-point, so --emulate-nccl emulates NCCL's rules for the collectives "
                         "only (tensor and data parallelism; none on one process)")
        chunks, runtime_schedule, figure_schedule = 1, None, None

    # -- processes and batch -----------------------------------------------------------
    mp = c.tp * c.pp
    if launch.external:
        world = launch.world or 1
        if c.nproc is not None and c.nproc != world:
            _fail(f"--nproc {c.nproc}, but the launcher ({launch.mode}) started {world} processes; drop --nproc "
                  "or make them agree")
    else:
        world = c.nproc if c.nproc is not None else mp
    if world % mp:
        src = "--nproc" if not launch.external else f"the {launch.mode} world size"
        _fail(f"{src} {world} is not divisible by --tp x --pp = {c.tp} x {c.pp} = {mp}; the data-parallel size "
              f"is processes / (tp x pp): use {src.split()[0] if not launch.external else 'a world size'} "
              f"{_divisors_near(world, mp)}")
    if not launch.external and world > 64:
        _fail(f"--nproc {world}: more than 64 local processes; use torchrun or srun for large runs")
    dp = world // mp
    gbs = c.global_batch_size if c.global_batch_size is not None else c.micro_batch_size * dp * 2 * c.pp
    if gbs % (c.micro_batch_size * dp):
        _fail(f"--global-batch-size {gbs} is not divisible by --micro-batch-size x data-parallel size = "
              f"{c.micro_batch_size} x {dp}; use e.g. --global-batch-size "
              f"{_divisors_near(gbs, c.micro_batch_size * dp)}")
    m = gbs // (c.micro_batch_size * dp)
    from ..schedule.registry import MAX_OPS
    if m * 3 > MAX_OPS:  # (pipelined runs are refused by the schedule builder too; pp=1 builds none)
        _fail(f"--global-batch-size {gbs}: {m:,} microbatches per data-parallel rank and iteration, more than the "
              f"{MAX_OPS // 3:,} a run may have here; use at most --global-batch-size "
              f"{MAX_OPS // 3 * c.micro_batch_size * dp} (or a larger --micro-batch-size)")

    # -- layers on stages ----------------------------------------------------------------
    given_lps, lps_flag = c.layers_per_stage, "--layers-per-stage"
    if c.pipeline_layout is not None:
        given_lps, lps_flag = _layout_layers(c, info, pipelined), "--pipeline-model-parallel-layout"
        chunks = len(given_lps) // c.pp if pipelined else 1
    S = c.pp * chunks if pipelined else 1
    if given_lps is not None:
        lps = tuple(int(x) for x in given_lps)
        if len(lps) != S:
            _fail(f"--layers-per-stage has {len(lps)} entries, but there are {S} stages (pp {c.pp} x "
                  f"{chunks} chunk(s) per rank); give {S} counts")
        if any(x < 0 for x in lps) or any(x < 1 for x in lps[1:-1]) or sum(lps) < 1:
            _fail(f"{lps_flag} {c.pipeline_layout or ','.join(map(str, lps))}: every stage but the first and "
                  "the last needs at least one layer (the first may hold the embedding alone, the last the "
                  "loss alone)")
        if c.layers is not None and c.layers != sum(lps):
            _fail(f"--layers {c.layers} but {lps_flag} holds {sum(lps)}; drop one of them")
    else:
        layers = c.layers if c.layers is not None else 8
        if layers % S:
            _fail(f"--layers {layers} cannot be split evenly over {S} pipeline stages (pp {c.pp} x {chunks} "
                  f"chunk(s) per rank); use --layers {_divisors_near(layers, S)}, or give an uneven split "
                  f"with --layers-per-stage")
        lps = (layers // S,) * S
    opt_errors, _ = check_training_options(c, tp=c.tp, layers_per_stage=lps)  # (--recompute-num-layers vs stages)
    if opt_errors:
        _fail(opt_errors[0])
    moe_error = check_moe(c, tp=c.tp, dp=dp, layers=sum(lps), ffn=ffn)
    if moe_error:
        _fail(moe_error)
    from .moe import moe_layer_pattern
    frontier_error = check_frontier(c, pp=c.pp, mcore=mcore, layers=sum(lps),
                                    moe_pattern=moe_layer_pattern(c.moe_layer_freq, sum(lps)) if c.num_experts else ())
    if frontier_error:
        _fail(frontier_error)
    overlap = c.overlap_moe_expert_parallel_comm

    # -- placement, schedule (validated now, with send/recv, as the workers will build it) -------
    from ..schedule import loop_placement, v_placement
    if not pipelined:
        placement = (0,)
    elif info is not None and info.placement == "v":
        placement = v_placement(c.pp)
    else:
        placement = loop_placement(c.pp, chunks)
    from ..schedule.costs import parse_costs
    try:
        costs = parse_costs(c.costs)
    except ScheduleError as e:
        _fail(str(e))
    budget = None
    built = None
    if c.memory_budget is not None:
        if mcore:
            _fail("--memory-budget is for our schedules (e.g. v-budget); --schedule mcore runs Megatron-Core's "
                  "1F1B at its natural memory")
        try:
            budget = parse_memory_budget(c.memory_budget, c.pp)
        except ScheduleError as e:
            _fail(str(e))
    if pipelined:
        if mcore and chunks > 1 and (m < c.pp or m % c.pp):
            good = c.pp * max(1, -(-m // c.pp)) * c.micro_batch_size * dp
            _fail(f"--schedule mcore with --vp {chunks}: Megatron-Core's interleaved schedule needs the microbatches "
                  f"per data-parallel rank ({m}) to be a multiple of --pp {c.pp}; use e.g. --global-batch-size {good}")
        build_costs = costs
        if budget is not None and info is not None and info.uses_budget and not c.features:
            # the budget counts every byte a rank holds (trainer/memmodel.py): built with the memory model
            from .memmodel import held_cost
            build_costs = held_cost(c, placement=placement, layers_per_stage=lps, kv_heads=kv, ffn=ffn, costs=costs,
                                    chunks=chunks, split=info.split_backward)
        try:
            built = build_schedule(figure_schedule, c.pp, m, chunks=chunks, costs=build_costs, memory_budget=budget,
                                   with_comm=True, overlap=overlap, a2a_time=c.a2a_time, without_a2a="published")
        except ScheduleError as e:
            msg = str(e).replace("--microbatches", "--global-batch-size (microbatches per iteration)")
            msg = msg.replace("--chunks", "--vp")
            _fail(f"schedule {c.schedule!r} at pp={c.pp}, {m} microbatches per iteration: {msg}")
        if budget is None and built[0].meta.get("memory_budget") is not None and info is not None and info.uses_budget:
            budget = built[0].meta["memory_budget"]
    if c.mtp_num_layers:
        notes.append(f"multi-token prediction: {c.mtp_num_layers} MTP layer(s) and their loss (x "
                     f"{c.mtp_loss_scaling_factor:g}) on the last stage, pipeline rank {placement[-1]}")

    # -- profiling, reference --------------------------------------------------------------
    ours = pipelined and not mcore
    given_a2a = overlap and c.a2a_time is not None
    if c.profile_iters is None:   # (the flag alone: the window measures the all-to-all the pairs hide)
        profile = 3 if ours and c.iters >= 3 + 2 and not given_a2a else 0
    else:
        profile = c.profile_iters
        if profile > 0 and given_a2a:
            _fail(f"--profile-iters {profile} re-generates the schedule from measured milliseconds, and --a2a-time "
                  f"{c.a2a_time:g} is in --costs units: drop --a2a-time to have the window measure the all-to-all "
                  "too, or use --profile-iters 0 to pair by --costs and --a2a-time")
        if profile > 0:
            if not ours:
                _fail("--profile-iters re-generates one of our schedules from measured costs; it does not apply to "
                      + ("--schedule mcore (Megatron-Core's own function)" if mcore else "--pp 1 (no pipeline)")
                      + "; use --profile-iters 0")
            if c.iters < profile + 2:
                _fail(f"--profile-iters {profile} needs --iters >= {profile + 2} (iteration 1 is a warm-up, then "
                      f"{profile} profiled iterations, then at least one with the new schedule)")
    # -- feature plug-ins (offload, BPipe, ...): their passes on the schedule, checked now --------
    factory = None
    feature_summary: dict = {}
    if c.features:
        from .features import PlanContext, plan_features
        ctx = PlanContext(cfg=c, pp=c.pp, chunks=chunks, microbatches=m, schedule=runtime_schedule,
                          mcore=mcore, costs=tuple(costs), memory_budget=budget, built=built)
        try:
            factory, built, feature_notes, feature_summary = plan_features(c.features, ctx)
        except TrainConfigError:
            raise
        except ValueError as e:  # a feature's flag error (names the flag)
            _fail(str(e))
        notes.extend(feature_notes)
        if (factory is not None or built is not ctx.built) and profile:
            if c.profile_iters:
                _fail(f"--profile-iters {profile}: re-generating the schedule from measured costs is not supported "
                      f"together with {', '.join('--' + n for n, _ in c.features)} yet; use --profile-iters 0")
            profile = 0
    # -- emulated compute (runtime/emulate.py): checked now, the schedule it runs fixed now ------------
    emulation = None
    if c.emulate_compute is not None:
        from .emulation import plan_emulation
        emulation, profile = plan_emulation(c, built=built, mcore=mcore, profile=profile, fail=_fail)
    # -- checkpoints (before the reference: a resumed run compares iterations after the resume) ---
    from .checkpoint import check_save, plan_resume
    check_save(c)
    resume, ckpt_notes = plan_resume(c, {"pp": c.pp, "tp": c.tp, "dp": dp, "chunks": chunks,
                                         "placement": list(placement), "layers_per_stage": list(lps)},
                                     {"layers": sum(lps), "kv_heads": kv, "ffn": ffn, "global_batch_size": gbs})
    notes.extend(ckpt_notes)
    left = c.iters - (resume.iteration if resume is not None else 0)
    if resume is not None and profile and left < profile + 2:  # the window counts from the resume
        if c.profile_iters is not None:
            _fail(f"--profile-iters {profile}: the run resumes at iteration {resume.iteration + 1} of --iters {c.iters}, "
                  f"too few left for a warm-up, {profile} profiled iterations and one more; use --profile-iters 0")
        profile = 0
    # -- overlapped pairs without --a2a-time: measured in the window, else the published ones --------
    measure_a2a = False
    overlap_info: dict = {}
    if overlap and pipelined:
        from .overlap import overlap_plan
        from ..schedule.pairs import count_pairs
        measure_a2a = c.a2a_time is None and profile > 0 and ours
        if measure_a2a and count_pairs(built[0]):   # (the window runs unpaired: trainer/profile.py says why)
            try:
                built = build_schedule(figure_schedule, c.pp, m, chunks=chunks, costs=build_costs,
                                       memory_budget=budget, with_comm=True)
            except ScheduleError as e:
                _fail(f"schedule {c.schedule!r} at pp={c.pp}, {m} microbatches per iteration, unpaired for the "
                      f"profiling window: {e}")
        first = (resume.iteration if resume is not None else 0) + 2   # (1-based; one warm-up iteration before)
        note, overlap_info = overlap_plan(c, built[0], measure=measure_a2a, window=(first, first + profile - 1))
        notes.append(note)
    ref = min(left, 5) if c.reference_iters is None else min(c.reference_iters, left)
    if c.num_experts is not None and c.model == "gpt" and ref:
        # (the reference runs on one process, so at expert parallel size 1: see trainer/moe.py)
        if c.reference_iters:
            _fail("--reference-iters with --num-experts and --model gpt: the pp=1 reference runs on one process "
                  "(expert parallel size 1), where Megatron-Core cannot run expert biases; use --reference-iters 0 "
                  "or --model llama")
        notes.append("no pp=1 reference: it would run on one process (expert parallel size 1), where Megatron-Core "
                     "cannot run the gpt model's expert biases (--model llama can)")
        ref = 0
    if c.dropout > 0 and ref and emulation is None:
        # dropout draws its masks per rank and layout: no loss of the pp=1 run could be compared
        if c.reference_iters:
            _fail(f"--reference-iters {c.reference_iters} with --dropout {c.dropout:g}: dropout draws other masks "
                  "under another layout, so the pp=1 losses cannot be compared; use --reference-iters 0")
        notes.append(f"no pp=1 reference: --dropout {c.dropout:g} draws other masks under another layout, so its "
                     "losses could not be compared")
        ref = 0
    if emulation is not None:
        ref = 0  # (no loss is computed: nothing to compare; an explicit --reference-iters is refused above)

    # -- data and files ----------------------------------------------------------------------
    data = "mock"
    if c.data_path is not None:
        prefix = c.data_path[:-4] if c.data_path.endswith((".bin", ".idx")) else c.data_path
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            _fail(f"--data-path {c.data_path}: {', '.join(missing)} not found; give the prefix of a Megatron "
                  "indexed dataset (PREFIX.bin and PREFIX.idx, e.g. from Megatron-LM's tools/preprocess_data.py)")
        from .data import corpus_tokens
        try:
            tokens = corpus_tokens(prefix)
        except Exception as e:  # noqa: BLE001 - a broken index
            _fail(f"--data-path {c.data_path}: not a readable Megatron indexed dataset ({type(e).__name__}: {e})")
        need = c.iters * m * dp * c.micro_batch_size * c.seq + 1
        if tokens < need:
            _fail(f"--data-path {c.data_path}: the corpus holds {tokens} tokens, but {c.iters} iterations of "
                  f"{m * dp * c.micro_batch_size} sequences of {c.seq} tokens need {need}; lower --iters or "
                  "--global-batch-size, or use a larger corpus")
        data = prefix
    if c.threads > 64:
        _fail(f"--threads {c.threads}: at most 64")
    if not (0 < c.timeout <= MAX_TIMEOUT_S):
        _fail(f"--timeout {c.timeout:g}: must be a positive number of seconds, at most {MAX_TIMEOUT_S:g}")
    if not 0 <= c.seed <= MAX_SEED:
        _fail(f"--seed {c.seed}: must be from 0 to {MAX_SEED} (NumPy and Megatron-Core's data seeds are 32-bit)")
    device = _resolve_device(c.device, launch, world)
    if emulation is not None and device == "cuda":
        device = "cpu"  # (--device auto: emulated compute runs on CPU processes, see trainer/emulation.py)
    if c.emulate_nccl and device == "cuda":
        if c.device == "cuda":
            _fail("--emulate-nccl emulates NCCL on CPU processes (gloo); with --device cuda NCCL itself runs: "
                  "drop --emulate-nccl or use --device cpu")
        device = "cpu"
    try:   # (MPPX_NCCL_TIMEOUT, MPPX_EMULATE_NCCL, CUDA_DEVICE_MAX_CONNECTIONS=1 with the features)
        from .features import one_queue_hangs
        check_nccl_environment(gpu=device == "cuda", emulating=bool(c.emulate_nccl),
                               one_queue_hangs=one_queue_hangs(c.features))
    except ValueError as e:
        _fail(str(e))
    strategy = c.emulate_nccl or c.p2p_strategy
    if strategy:   # (the backend can run it; the schedule's proof under its model; mcore refused above)
        from ..runtime.p2pstrategy import StrategyError, check_strategy
        try:
            check_strategy(strategy, *(built if built is not None and pipelined else (None, None)),
                           gpu=device == "cuda", emulate=bool(c.emulate_nccl),
                           flag="--p2p-strategy" if c.p2p_strategy else "--emulate-nccl")
        except StrategyError as e:
            _fail(str(e))
    if device == "cpu" and not launch.external:   # (every process on this machine)
        from .hostmem import check_fits
        check_fits(c, layers=sum(lps), kv_heads=kv, ffn=ffn, dp=dp, fail=_fail)
    if device == "cuda" and not launch.external:
        from ..runtime.shared_gpu import SHARE_GPU_ENV, share_gpu_requested
        if share_gpu_requested():
            notes.append(f"{SHARE_GPU_ENV}=1: local ranks beyond the visible GPUs share them (NCCL over loopback "
                         "sockets, one NCCL_HOSTID per rank): a correctness check, its timings are meaningless")
    impl = _resolve_transformer_impl(c.transformer_impl, device)
    from ..runtime.te_policy import te_split_refusal
    te_error = te_split_refusal(runtime_schedule, transformer_impl=impl, opted_in=c.te_wgrad_split,
                                schedule_flag=f"--schedule {runtime_schedule}", impl_flag="--transformer-impl",
                                opt_in_flag="--te-wgrad-split",
                                doc="docs/train.md#transformer-engine")
    if te_error is not None:
        _fail(te_error)
    if c.transformer_impl == "auto" and device == "cuda" and _te_installed():
        notes.append("--transformer-impl auto: Megatron-Core's local layers; Transformer Engine is installed, but its "
                     "B/W-split path has not been verified on a GPU yet (--transformer-impl transformer_engine "
                     "--te-wgrad-split to try it)")
    if c.te_wgrad_split:
        notes.append("--te-wgrad-split: Transformer Engine's layers defer their weight gradients to W "
                     "(delay_wgrad_compute); this path has not been verified on a GPU yet")
    out = c.out
    json_log = c.json_log if c.json_log is not None else os.path.join(out, "train.jsonl")
    plan = Plan(cfg=c, launch=launch, device=device, world=world, dp=dp, microbatches=m, chunks=chunks,
                placement=tuple(placement), layers_per_stage=lps, runtime_schedule=runtime_schedule,
                figure_schedule=figure_schedule, costs=costs, memory_budget=budget, profile_iters=profile,
                reference_iters=ref, data=data, out_dir=out, json_log=json_log,
                text_log=os.path.join(out, "train.log"), figure=os.path.join(out, "schedule.png"),
                summary=os.path.join(out, "summary.json"), notes=tuple(notes), built=built, resume=resume,
                schedule_factory=factory, feature_summary=feature_summary, transformer_impl=impl,
                emulation=emulation, build_cost=build_costs if pipelined and not isinstance(build_costs, tuple) else None,
                measure_a2a=measure_a2a, overlap_info=overlap_info)
    # what the memory model predicts for this run (trainer/memmodel.py): the JSON log's predicted_peak_bytes
    from .memmodel import predict
    try:
        prediction = predict(plan)
    except Exception as e:  # noqa: BLE001 - a prediction must not stop a run; the log says why
        prediction = {"error": f"{type(e).__name__}: {e}"}
    return dataclasses.replace(plan, memory_prediction=prediction)


# --- command line -------------------------------------------------------------------------

def _int(lo: int, example: int):
    from ..clibase import int_at_least
    return int_at_least(lo, example)


def _float_pos(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    return v


def _int_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, e.g. 1,2,2,1") from None
    return vals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mppx train`` (documented in docs/train.md and docs/cli.md)."""
    d = DEFAULTS
    g = parser.add_argument_group("model")
    g.add_argument("--model", choices=("gpt", "llama"), default=d.model,
                   help="gpt: learned positions, LayerNorm, GeLU, biases; llama: RoPE, RMSNorm, SwiGLU, "
                        "grouped-query attention, no biases (default: gpt)")
    g.add_argument("--layers", type=_int(1, 8), default=None, metavar="N",
                   help="transformer layers, split evenly over the pp x vp stages (default: 8)")
    g.add_argument("--layers-per-stage", "--pipeline-layers-per-stage", type=_int_list, default=None, metavar="A,B,...",
                   help="an uneven split: layers of each pipeline stage, in stage order (the first and the last "
                        "may be 0: the embedding or the loss alone)")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help="Megatron-Core's layout string, e.g. 'E|t*3|t*3|t*2L' or 'E|(t|)*22L' (stage s on rank "
                        "s mod pp; the stage count sets the chunks per rank): what mppx plan prints for loop "
                        "schedules")
    g.add_argument("--hidden", type=_int(1, 64), default=d.hidden, metavar="H", help="hidden size (default: 64)")
    g.add_argument("--heads", type=_int(1, 4), default=d.heads, metavar="A", help="attention heads (default: 4)")
    g.add_argument("--kv-heads", type=_int(1, 2), default=None, metavar="G",
                   help="key/value heads (grouped-query attention); must divide --heads "
                        "(default: --heads for gpt, --heads/2 for llama)")
    g.add_argument("--ffn", type=_int(1, 256), default=None, metavar="F",
                   help="MLP hidden size (default: 4 x hidden for gpt, 2 x hidden for llama's SwiGLU)")
    g.add_argument("--vocab", type=_int(4, 256), default=d.vocab, metavar="V", help="vocabulary size (default: 256)")
    g.add_argument("--tie-embeddings", action="store_true",
                   help="share the input embedding and the output layer (any schedule; under a V placement both "
                        "copies are on rank 0 and their gradients are summed there)")
    g.add_argument("--seq", type=_int(2, 32), default=d.seq, metavar="S", help="sequence length (default: 32)")
    g.add_argument("--dropout", type=_float_pos, default=d.dropout, metavar="P",
                   help="hidden and attention dropout (default: 0; with dropout there is no pp=1 comparison: "
                        "the masks depend on the layout)")
    g.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default=d.transformer_impl,
                   help="layer implementation: Megatron-Core's local spec or the Transformer Engine spec (default "
                        "auto: local, the verified path; TE's B/W split has not run on a GPU here yet)")
    g.add_argument("--te-wgrad-split", action="store_true", default=d.te_wgrad_split,
                   help="with --transformer-impl transformer_engine and a schedule that splits B and W (zb-*, V, "
                        "dualpipev): TE >= 2.3 defers the weight gradients itself (delay_wgrad_compute); not yet "
                        "verified on a GPU, so without it that combination is refused")
    g = parser.add_argument_group("batch and layout")
    g.add_argument("--micro-batch-size", type=_int(1, 1), default=d.micro_batch_size, metavar="B",
                   help="sequences per microbatch (default: 1)")
    g.add_argument("--global-batch-size", type=_int(1, 8), default=None, metavar="G",
                   help="sequences per iteration over all data-parallel ranks; microbatches per rank = "
                        "G / (B x dp) (default: 2 x pp microbatches per rank)")
    g.add_argument("--pp", type=_int(1, 4), default=d.pp, metavar="P", help="pipeline-parallel size (default: 4)")
    g.add_argument("--tp", type=_int(1, 2), default=d.tp, metavar="T", help="tensor-parallel size (default: 1)")
    g.add_argument("--vp", type=_int(1, 2), default=None, metavar="V",
                   help="model chunks per pipeline rank (virtual pipeline): for interleaved-1f1b and mcore; "
                        "the V schedules always use 2 (default: the schedule's own, else 1)")
    g.add_argument("--nproc", type=_int(1, 4), default=None, metavar="N",
                   help="processes to start on this machine; dp = N / (tp x pp) (default: tp x pp; under "
                        "torchrun/srun the launcher's world size)")
    g = parser.add_argument_group("schedule")
    g.add_argument("--schedule", default=d.schedule, metavar="NAME",
                   help="a registered schedule ('mppx schedules'), or mcore: Megatron-Core's own 1F1B / "
                        "interleaved 1F1B, the baseline (default: zbv)")
    g.add_argument("--memory-budget", default=None, metavar="X",
                   help="activation memory per rank for schedules that take a budget (v-budget): units "
                        "(e.g. 3) or a fraction of 1F1B's peak (e.g. 0.5x)")
    g.add_argument("--costs", default=None, metavar="F,B,W[,COMM]",
                   help="relative per-rank costs the initial schedule is built for (default: 1,1,1,0)")
    g.add_argument("--emulate-compute", type=_float_pos, default=None, metavar="MS",
                   help="replace the arithmetic of every compute op (F, B, W, BW and the feature ops) by a wait of "
                        "its --costs time, one unit = MS milliseconds; messages stay real; the JSON log gains "
                        "measured_makespan_s and simulated_makespan_s; no loss is computed (default: off)")
    g.add_argument("--p2p-strategy", default=None, choices=NCCL_STRATEGIES,
                   help="how the executor sends and receives on NCCL: channels (one communicator per sender, "
                        "receiver and message kind: the schedule's own time), pairwise (one per pair of neighbours: "
                        "the fallback if a cluster hangs with several communicators in use at once) or batched (one "
                        "batch_isend_irecv per run of transfers, Megatron-Core's way: the slowest); a schedule that "
                        "deadlocks under it is refused. On CPU processes it needs --emulate-nccl (default: channels)")
    g.add_argument("--emulate-nccl", nargs="?", const=True, default=None, metavar="STRATEGY",
                   choices=NCCL_STRATEGIES,
                   help="run the executor's NCCL point-to-point path on the CPU processes with NCCL's rules "
                        "emulated on gloo (untagged, matched in issue order, one stream per communicator, hangs "
                        "reported in one line): the --p2p-strategy (default channels); --emulate-nccl STRATEGY is "
                        "short for --p2p-strategy STRATEGY --emulate-nccl (default: off)")
    g.add_argument("--profile-iters", type=_int(0, 3), default=None, metavar="K",
                   help="time every op over K iterations after a warm-up one, then re-generate the schedule "
                        "once from the median F/B/W per stage and the measured p2p latency (default: 3 with "
                        "our schedules, 0 = off)")
    g = parser.add_argument_group("training")
    g.add_argument("--iters", type=_int(1, 20), default=d.iters, metavar="N", help="iterations (default: 20)")
    g.add_argument("--lr", type=_float_pos, default=d.lr, metavar="LR", help="Adam learning rate (default: 1e-3)")
    g.add_argument("--allow-nonfinite-loss", action="store_true",
                   help="train on after a NaN/inf loss instead of stopping at it (the run still ends with exit "
                        "status 1 and says so; default: stop, without saving the diverged model)")
    g.add_argument("--seed", type=_int(0, 1234), default=d.seed, metavar="S",
                   help="seed of the initial weights (a function of the seed and each parameter's global "
                        "name) and of the data (default: 1234)")
    g.add_argument("--data-path", default=None, metavar="PREFIX",
                   help="a tokenized corpus: Megatron indexed dataset PREFIX.bin/PREFIX.idx (default: "
                        "Megatron-Core's MockGPTDataset)")
    add_training_arguments(parser)  # precision, distributed optimizer, SP, clipping, recomputation
    add_moe_arguments(parser, _int(1, 4), _float_pos)  # --num-experts, ... (trainer/moe.py)
    add_frontier_arguments(parser, _int(1, 1), _float_pos)  # --overlap-moe-expert-parallel-comm, --mtp-num-layers
    g = parser.add_argument_group("run and output")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device,
                   help="cpu (gloo) or cuda (NCCL, one GPU per process); auto: cuda when there is a GPU "
                        "per process (default: auto)")
    g.add_argument("--out", default=d.out, metavar="DIR",
                   help="directory of the log, the JSON log, the summary and the schedule figure "
                        "(default: mppx-train)")
    g.add_argument("--json-log", default=None, metavar="FILE",
                   help="one JSON object per iteration (default: DIR/train.jsonl)")
    g.add_argument("--reference-iters", type=_int(0, 20), default=None, metavar="K",
                   help="iterations of the pp=1 reference run on one process, compared with the first K "
                        "iterations of the run (default: 5, at most --iters; 0 = skip)")
    g.add_argument("--threads", type=_int(1, 1), default=d.threads, metavar="N",
                   help="torch threads per process (default: 1)")
    g.add_argument("--log-interval", type=_int(1, 1), default=d.log_interval, metavar="N",
                   help="print a log line every N iterations (default: 1)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--timeout", type=_float_pos, default=d.timeout, metavar="SECONDS",
                   help="stop a local run that has not finished after this long (default: 86400)")
    g = parser.add_argument_group("checkpoints (Megatron-Core distributed checkpointing)")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="save model, optimizer, RNG and iteration to DIR/iter_XXXXXXX (Megatron-Core torch_dist "
                        "format) at the end, and every --save-interval iterations")
    g.add_argument("--save-interval", type=_int(1, 5), default=None, metavar="N",
                   help="also save every N iterations (default: at the end only)")
    g.add_argument("--save-overwrite", action="store_true",
                   help="allow --save into a directory that holds the checkpoints of another run (without --load "
                        "of it): iterations this run saves replace that run's, and the tracker names this run's "
                        "latest (default: refused)")
    g.add_argument("--no-verify-checkpoint", action="store_true",
                   help="skip reading and hashing every file of the --load checkpoint against the checksums saved "
                        "with it (default: verified before any process starts; sizes are always checked)")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from the latest checkpoint in DIR (or an iter_XXXXXXX directory); --iters is "
                        "the total; no checkpoint there: start from scratch with a warning, as Megatron-LM does")

    from .features import add_feature_arguments
    add_feature_arguments(parser)  # offload, BPipe, ... (trainer/features.py)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    from .features import features_from_args
    try:
        features = features_from_args(args)
    except ValueError as e:  # a feature's flag error (names the flag and the fix)
        raise TrainConfigError(str(e)) from None
    return _config_from_args(args).replace(features=features)


def _check_emulation_env(c) -> None:
    """MPPX_EMULATE_NCCL (the switch of pretrain_gpt.py runs and test suites) naming another strategy
    than the run's flags is refused: the flags would win without a word."""
    from ..runtime.ncclenv import emulated_strategy
    try:
        env = emulated_strategy()
    except ValueError as e:
        _fail(str(e))
    raw = os.environ.get("MPPX_EMULATE_NCCL", "").strip()
    ours = c.emulate_nccl or c.p2p_strategy
    if env is not None and raw != "1" and ours and ours != env:
        flag = "--emulate-nccl" if c.emulate_nccl else "--p2p-strategy"
        _fail(f"MPPX_EMULATE_NCCL={raw} contradicts {flag} {ours}: mppx train takes the strategy from its flags "
              f"(--emulate-nccl STRATEGY); unset MPPX_EMULATE_NCCL or name the same strategy")


def _strategy_from_args(args: argparse.Namespace) -> dict:
    """``emulate_nccl`` and ``p2p_strategy`` of the config: a bare --emulate-nccl emulates the
    --p2p-strategy (default channels); --emulate-nccl STRATEGY names it itself (make_plan checks
    that the two agree)."""
    emulate, strategy = getattr(args, "emulate_nccl", None), getattr(args, "p2p_strategy", None)
    if emulate is True:
        emulate = strategy or "channels"
    return {"emulate_nccl": emulate, "p2p_strategy": strategy}


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model, layers=args.layers, layers_per_stage=args.layers_per_stage,
        pipeline_layout=args.pipeline_model_parallel_layout, hidden=args.hidden,
        heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, vocab=args.vocab,
        tie_embeddings=args.tie_embeddings, seq=args.seq, dropout=args.dropout, transformer_impl=args.transformer_impl,
        te_wgrad_split=args.te_wgrad_split,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size, pp=args.pp, tp=args.tp,
        vp=args.vp, nproc=args.nproc, schedule=args.schedule, memory_budget=args.memory_budget, costs=args.costs,
        profile_iters=args.profile_iters, emulate_compute=args.emulate_compute,
        **_strategy_from_args(args), iters=args.iters, lr=args.lr,
        allow_nonfinite_loss=args.allow_nonfinite_loss, **options_from_args(args),
        seed=args.seed, data_path=args.data_path, **moe_from_args(args), **frontier_from_args(args),
        device=args.device, out=args.out, json_log=args.json_log, reference_iters=args.reference_iters,
        threads=args.threads, log_interval=args.log_interval, progress=not args.no_progress,
        timeout=args.timeout, save=args.save, save_interval=args.save_interval, load=args.load,
        save_overwrite=args.save_overwrite, verify_checkpoint=not args.no_verify_checkpoint)
