"""The planner's data: the request, one candidate configuration, its per-stage costs and its
estimate (memory per rank, time breakdown). Kept apart so that feature estimators
(:mod:`.features`) and the search (:mod:`.search`) share them without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from .memory import RECOMPUTE_MODES, StagePart, StaticMemory
from .presets import ClusterSpec, ModelSpec, PlannerError
from .simcache import PipeResult
from .timing import FLEX_BACKENDS, TOKEN_DISPATCHERS, Efficiency, default_efficiency


#: Megatron-Core's own schedules: they run on an unmodified Megatron-LM without features
MEGATRON_SCHEDULES = ("1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan. ``None`` search ranges mean "everything that makes sense"."""

    model: ModelSpec
    cluster: ClusterSpec
    global_batch: int
    efficiency: Efficiency | None = None            # default: the GPU's preset curve
    schedules: tuple[str, ...] | None = None         # default: every registered schedule
    features: tuple[str, ...] | None = None          # default: every registered feature
    require_features: tuple[str, ...] = ()           # only plans using all of these
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    mbs: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None                 # expert parallel sizes (MoE): default every valid one
    etp: tuple[int, ...] | None = None                # expert tensor-parallel sizes: default tp and 1
    cp: tuple[int, ...] | None = None                 # context-parallel sizes (default 1: no context parallelism)
    uneven_layers: bool | None = None                 # stage counts that do not divide the layers (None: auto)
    max_vp: int = 4                                   # interleaved chunks per rank tried: 2..max_vp
    vp: int | None = None                             # pinned chunks per rank of chunked schedules (not max_vp)
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    budgets: tuple[str, ...] = ("fit",)               # v-budget: "fit" (largest that fits) and/or "0.5x"
    distributed_optimizer: bool = True
    #: --use-megatron-fsdp (data_parallel_sharding_strategy optim_grads_params): parameters, gradients and
    #: optimizer states sharded over the data-parallel group, gathered one transformer layer at a time
    #: (memory.static_memory); Megatron-Core's own schedules only, without features (_check_fsdp)
    megatron_fsdp: bool = False
    precision: str = "bf16"
    #: FP8's scaling recipe (Megatron-LM's --fp8-recipe), with ``precision="fp8"``
    fp8_recipe: str = "tensorwise"
    #: --fp8-param-gather: the GEMM weights held (and all-gathered) as TE's FP8 parameters
    fp8_param_gather: bool = False
    #: gradients reduced (and their buffer held) in fp32 (Megatron-LM --accumulate-allreduce-grads-in-fp32),
    #: or in bf16 as NVIDIA's recipes run
    grad_reduce_in_fp32: bool = True
    #: --tp-comm-overlap: Transformer Engine's userbuffers hide the tensor-parallel all-gathers and
    #: reduce-scatters behind the GEMMs (Efficiency.tp_comm_overlap of them)
    tp_comm_overlap: bool = False
    #: whose exchanges synchronise the device (planner/search.py ``Planner.exchange_sync``):
    #: "megatron" (Megatron-Core's 1F1B), "all", "none"
    exchange_sync: str = "megatron"
    #: whose memory behaviour to predict (planner/stagemem.py): "gpu" -- Megatron-LM on GPUs (the fused
    #: softmax kernel, apex's fused weight-gradient accumulation); "cpu" -- ``mppx train`` on CPU
    #: processes (torch's softmax, weight gradients delivered through autograd), to check a plan there
    runtime: str = "gpu"
    #: also try overlapped forward-backward pairs (--overlap-moe-expert-parallel-comm) on MoE models at
    #: expert parallel size >= 2: the paired schedules compete with the unpaired ones, the faster wins
    overlap: bool = False
    #: Megatron-Core's token dispatcher (--moe-token-dispatcher-type): "alltoall" or "flex"
    #: (timing.flex_dispatch_time), the flex one on ``moe_flex_backend`` (--moe-flex-dispatcher-backend:
    #: "deepep", Megatron-Core's default, or "hybridep")
    moe_dispatcher: str = "alltoall"
    moe_flex_backend: str = "deepep"
    top: int = 10
    time_limit: float = 120.0                         # CPU seconds of search before it stops
    #: the runtime's point-to-point strategy on NCCL (runtime/p2pstrategy.py): its communication
    #: model times the pipeline, its communicators count in memory
    p2p_strategy: str = "channels"

    def __post_init__(self) -> None:
        self._check_precision()
        if self.efficiency is None:
            object.__setattr__(self, "efficiency", default_efficiency(self.cluster.gpu))
        if not (isinstance(self.time_limit, (int, float)) and math.isfinite(self.time_limit) and self.time_limit > 0):
            raise PlannerError(f"--time-limit {self.time_limit!r}: give the CPU seconds the search may take, a "
                               "finite number > 0 (default 120)")
        from ..schedule import ScheduleError, parse_memory_budget
        for spec in self.budgets:
            if spec != "fit":
                try:
                    parse_memory_budget(spec, 1)
                except ScheduleError:
                    raise PlannerError(f"--budgets {spec!r}: give 'fit', units (e.g. 4) or a fraction of 1F1B "
                                       "(e.g. 0.5x), finite and > 0") from None
        from ..runtime.p2pstrategy import NCCL_STRATEGIES
        if self.p2p_strategy not in NCCL_STRATEGIES:
            raise PlannerError(f"--p2p-strategy {self.p2p_strategy!r}: one of {', '.join(NCCL_STRATEGIES)}")
        if self.p2p_strategy != "channels" and self.runtime != "gpu":
            raise PlannerError(f"--p2p-strategy {self.p2p_strategy}: a strategy of NCCL runs, and this plan is for "
                               "a CPU run (--memory-model cpu, gloo's own point-to-point); drop the flag")
        if self.runtime == "gpu":   # (what the communicators' memory is computed from)
            from ..runtime.ncclmem import nccl_memory
            try:
                nccl_memory()
            except ValueError as e:
                raise PlannerError(str(e)) from None
        for name, flag in (("global_batch", "--global-batch-size"), ("top", "--top"), ("max_vp", "--max-vp")):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise PlannerError(f"{flag} {v!r}: must be a whole number >= 1")
        if self.vp is not None and not (isinstance(self.vp, int) and not isinstance(self.vp, bool) and self.vp >= 2):
            raise PlannerError(f"--vp {self.vp!r}: give the model chunks per pipeline rank, a whole number >= 2 "
                               "(one chunk is no interleaving: drop --vp)")
        self._check_experts()
        self._check_context()
        self._check_stage_times()
        self._check_fsdp()

    def _check_fsdp(self) -> None:
        """--use-megatron-fsdp against what contradicts it: megatron_pp_ext's Megatron-LM integration
        refuses Megatron-FSDP with its own schedules and features (megatron_lm/flags.py), so FSDP plans
        run Megatron-Core's 1F1B or interleaved 1F1B without features; Megatron-LM forces the
        distributed optimizer with it; mppx train on CPU processes has no FSDP."""
        if not self.megatron_fsdp:
            return
        if not self.distributed_optimizer:
            raise PlannerError("--use-megatron-fsdp with --no-distributed-optimizer: Megatron-FSDP shards the optimizer "
                               "states itself (Megatron-LM forces --use-distributed-optimizer with it); drop "
                               "--no-distributed-optimizer")
        if self.schedules is not None:
            other = [s for s in self.schedules if s not in MEGATRON_SCHEDULES]
            if other:
                raise PlannerError(f"--use-megatron-fsdp with --schedules {','.join(other)}: megatron_pp_ext runs "
                                   "Megatron-FSDP only on Megatron-Core's own schedules (its executor drives the "
                                   "distributed optimizer's hooks, not Megatron-FSDP's); use --schedules "
                                   f"{','.join(MEGATRON_SCHEDULES)} or drop --use-megatron-fsdp")
        if self.require_features or self.features:
            names = ",".join(self.require_features or self.features)
            flag = "--require-features" if self.require_features else "--features"
            raise PlannerError(f"--use-megatron-fsdp with {flag} {names}: features run on megatron_pp_ext's executor, "
                               f"which does not run Megatron-FSDP; drop {flag} or --use-megatron-fsdp")
        if self.overlap:
            raise PlannerError("--use-megatron-fsdp with --overlap-moe-expert-parallel-comm: overlapped pairs are "
                               "planned on megatron_pp_ext's executor, which does not run Megatron-FSDP; drop "
                               "one of them")
        if self.runtime != "gpu":
            raise PlannerError("--use-megatron-fsdp with --memory-model cpu: mppx train on CPU processes has no "
                               "Megatron-FSDP; drop one of them")

    def _check_precision(self) -> None:
        """--precision and --fp8-recipe against the GPU: FP8 needs FP8 tensor cores, MXFP8 a
        Blackwell GPU."""
        from .timing import FP8_RECIPES, PRECISIONS
        gpu = self.cluster.gpu
        if self.precision not in PRECISIONS:
            raise PlannerError(f"--precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise PlannerError(f"--fp8-recipe {self.fp8_recipe!r}: use one of {', '.join(FP8_RECIPES)} "
                               "(Megatron-LM's names)")
        if self.exchange_sync not in ("megatron", "all", "none"):
            raise PlannerError(f"exchange_sync {self.exchange_sync!r}: one of megatron, all, none")
        if self.precision == "fp32" and self.model.flash_attention and self.runtime == "gpu":
            raise PlannerError("--precision fp32: flash (and Transformer Engine's fused) attention runs in bf16/fp16 "
                               "only; add --no-flash-attention (the unfused attention is planned) or plan --precision "
                               "bf16")
        if self.overlap and not self.model.is_moe:
            raise PlannerError("--overlap-moe-expert-parallel-comm: overlapped pairs hide an MoE model's expert "
                               "all-to-all, and this model is dense; drop the flag or plan an MoE model (--num-experts)")
        if self.fp8_param_gather and self.precision != "fp8":
            raise PlannerError("--fp8-param-gather needs --precision fp8 (the parameters are TE's FP8 weights); add "
                               "--precision fp8 or drop --fp8-param-gather")
        if self.precision != "fp8":
            return
        if not gpu.has_fp8:
            raise PlannerError(f"--precision fp8: the {gpu.name} has no FP8 tensor cores; plan --precision bf16, or "
                               "an FP8 GPU (--gpu h100, h200, b200, gb200)")
        if self.fp8_recipe == "mxfp8" and not gpu.blackwell:
            raise PlannerError(f"--fp8-recipe mxfp8 needs a Blackwell GPU (b200, gb200), not the {gpu.name}; use "
                               "--fp8-recipe tensorwise, delayed or blockwise")

    def _check_context(self) -> None:
        """--cp against the model, by Megatron-Core's rules: the sequence splits into 2*cp chunks
        (load-balanced causal attention), cp divides the attention heads, and the attention runs
        in Transformer Engine's flash (fused) kernels, the only ones with context parallelism."""
        if self.cp is None:
            return
        model = self.model
        if not self.cp or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.cp):
            raise PlannerError(f"--cp {self.cp!r}: give whole numbers >= 1, e.g. --cp 1,2")
        for cp in self.cp:
            if cp == 1:
                continue
            if model.seq % (2 * cp):
                raise PlannerError(f"--cp {cp} does not divide the sequence of {model.seq} tokens into 2 x cp chunks "
                                   f"(Megatron-Core's load-balanced split needs --seq a multiple of {2 * cp}); use "
                                   f"--cp {_cp_sizes(model)}")
            if model.heads % cp:
                raise PlannerError(f"--cp {cp} does not divide the {model.heads} attention heads; use --cp "
                                   f"{_cp_sizes(model)}")
            if not model.flash_attention:
                raise PlannerError(f"--cp {cp}: context parallelism runs in Transformer Engine's flash (fused) "
                                   "attention only; drop --no-flash-attention or use --cp 1")
            if self.runtime != "gpu":
                raise PlannerError(f"--cp {cp}: mppx train on CPU processes (--memory-model cpu) has no context "
                                   "parallelism; use --cp 1 or --memory-model gpu")
            if self.efficiency.stage_times is not None:
                raise PlannerError(f"--cp {cp}: --calibration stage_times were measured without context "
                                   "parallelism (whole sequences per rank); use --cp 1 or calibrate with "
                                   "efficiency fields")

    def _check_stage_times(self) -> None:
        """Measured stage times (--calibration stage_times) hold for one microbatch size and tp
        (and an MoE run's for one ep and etp): the plan searches exactly those, and refuses another
        one (times never stretched)."""
        st = self.efficiency.stage_times
        if st is None:
            return
        pinned = [("mbs", "--mbs", st.mbs, "micro_batch_size"), ("tp", "--tp", st.tp, "tp")]
        if st.expert is not None:
            pinned += [("ep", "--ep", st.expert[2], "ep"), ("etp", "--etp", st.expert[3], "etp")]
        for name, flag, value, key in pinned:
            given = getattr(self, name)
            if given is None:
                object.__setattr__(self, name, (value,))
            elif tuple(given) != (value,):
                raise PlannerError(f"--calibration stage_times.{key}={value}: the times were measured at {name} "
                                   f"{value}, but {flag} {','.join(map(str, given))} is planned; plan {flag} {value} "
                                   f"or measure at the {name} you plan")

    @property
    def comm_model(self) -> str:
        """The model the pipeline is timed under: the p2p strategy's on GPUs, gloo's (eager) on CPU
        processes."""
        from ..runtime.p2pstrategy import comm_model_of
        return comm_model_of(self.p2p_strategy) if self.runtime == "gpu" else "eager"

    def _check_experts(self) -> None:
        """--ep / --etp against the model and the cluster, by Megatron-Core's rules: ep divides
        the experts, etp the expert FFN, and ep*etp the GPUs of a pipeline stage (tp*dp), hence
        the GPU count."""
        model, n = self.model, self.cluster.num_gpus
        if self.moe_dispatcher not in TOKEN_DISPATCHERS:
            raise PlannerError(f"--moe-token-dispatcher-type {self.moe_dispatcher!r}: one of "
                               f"{', '.join(TOKEN_DISPATCHERS)}")
        if self.moe_flex_backend not in FLEX_BACKENDS:
            raise PlannerError(f"--moe-flex-dispatcher-backend {self.moe_flex_backend!r}: one of {', '.join(FLEX_BACKENDS)}")
        if self.moe_dispatcher != "alltoall":
            if not model.is_moe:
                raise PlannerError(f"--moe-token-dispatcher-type {self.moe_dispatcher}: a dispatcher of MoE layers, and "
                                   f"{model.name} is dense; drop it")
            if self.ep is not None and self.etp is not None and max(self.ep) * max(self.etp) < 2:
                raise PlannerError(f"--moe-token-dispatcher-type flex with --ep {','.join(map(str, self.ep))} --etp "
                                   f"{','.join(map(str, self.etp))}: Megatron-Core's flex dispatcher needs expert "
                                   "parallelism (ep x etp > 1); raise --ep or use alltoall")
            st = self.efficiency.stage_times
            if st is not None and st.expert is not None:
                raise PlannerError("--moe-token-dispatcher-type flex with --calibration MoE stage_times: those were "
                                   "measured with the alltoall dispatcher, whose all-to-all they include; plan with "
                                   "alltoall, or calibrate without the MoE stage times")
            if self.overlap:
                raise PlannerError("--overlap-moe-expert-parallel-comm with --moe-token-dispatcher-type flex: "
                                   "megatron_pp_ext's pairs are measured and chosen on Megatron-Core's alltoall "
                                   "dispatcher; use alltoall or drop --overlap-moe-expert-parallel-comm")
        for flag, vals in (("--ep", self.ep), ("--etp", self.etp)):
            if vals is None:
                continue
            if not model.is_moe:
                raise PlannerError(f"{flag}: expert parallelism needs an MoE model (--num-experts N, or a preset "
                                   "such as mixtral-8x7b); drop " + flag)
            if not vals or not all(isinstance(v, int) and v >= 1 for v in vals):
                raise PlannerError(f"{flag} {vals!r}: give whole numbers >= 1")
        if not model.is_moe:
            return
        E = model.num_experts
        for ep in self.ep or ():
            if E % ep:
                ok = ",".join(str(d) for d in divisors(E) if n % d == 0)
                raise PlannerError(f"--ep {ep} does not divide --num-experts {E}; use divisors of {E} "
                                   f"(e.g. --ep {ok})")
            if n % ep:
                raise PlannerError(f"--ep {ep} does not divide the {n} GPUs: Megatron-Core needs ep x etp to divide "
                                   "tp x dp, the GPUs of one pipeline stage; use a divisor of both")
        for etp in self.etp or ():
            if model.expert_ffn % etp:
                raise PlannerError(f"--etp {etp} does not divide --moe-ffn-hidden-size {model.expert_ffn}; use a "
                                   "divisor")
            if model.bias and etp > 1:
                raise PlannerError(f"--etp {etp}: Megatron-Core supports MoE with linear biases only at expert "
                                   "tensor parallelism 1; use --etp 1 or a model without biases")
            if n % etp:
                raise PlannerError(f"--etp {etp} does not divide the {n} GPUs; use a divisor")

    def with_(self, **changes) -> "PlanRequest":
        return replace(self, **changes)

    @property
    def dispatcher(self) -> str:
        """The token dispatcher as the time model tells them apart: "alltoall" (timing.alltoall_time),
        or the flex dispatcher's backend, "deepep" or "hybridep" (timing.flex_dispatch_time)."""
        return self.moe_flex_backend if self.moe_dispatcher == "flex" else "alltoall"

    @property
    def static_options(self) -> dict:
        """How parameters and gradients are held (``layout.rank_static``'s keywords)."""
        return {"precision": self.precision, "grad_reduce_in_fp32": self.grad_reduce_in_fp32,
                "fp8_params": self.fp8_param_gather, "fsdp": self.megatron_fsdp}


@dataclass(frozen=True)
class Candidate:
    """One point of the search space (before feature variants: ``features`` is empty)."""

    tp: int
    pp: int
    dp: int
    vp: int                       # model chunks per rank (1, interleaved v, or 2 for V schedules)
    schedule: str
    mbs: int
    m: int                        # microbatches per iteration
    recompute: str
    budget: float | None = None   # v-budget: activation units per rank
    distributed_optimizer: bool = True
    features: tuple[tuple[str, str], ...] = ()
    ep: int = 1                   # expert parallel size (MoE)
    etp: int | None = None        # expert tensor-parallel size (None: tp, Megatron's default)
    overlap: bool = False         # overlapped forward-backward pairs hide the expert all-to-all
    cp: int = 1                   # context parallel size: each rank holds seq/cp tokens of a microbatch

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    @property
    def stages(self) -> int:
        return self.pp * self.vp

    @property
    def grad_dp(self) -> int:
        """The ranks gradients are reduced over (and the distributed optimizer shards over):
        dp*cp, Megatron-Core's data-parallel group with context parallelism."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel size: the ranks of a stage (tp*cp*dp) over ep*etp."""
        return max(1, self.tp * self.cp * self.dp // (self.ep * self.etp))

    def schedule_placement(self) -> str:
        from ..schedule import schedule_info
        return schedule_info(self.schedule).placement

    def feature(self, name: str) -> str | None:
        for n, opt in self.features:
            if n == name:
                return opt
        return None

    def with_feature(self, name: str, option: str) -> "Candidate":
        return replace(self, features=tuple(sorted(self.features + ((name, option),))))

    def label(self) -> str:
        s = self.schedule + (f"(v={self.vp})" if self.vp > 1 and self.schedule_placement() == "loop" else "")
        if self.budget is not None:
            s += f"@{self.budget:g}" if isinstance(self.budget, (int, float)) else f"@{self.budget}"
        return s + ("+pairs" if self.overlap else "")

    def features_label(self) -> str:
        return ",".join(f"{n}={o}" if o not in ("on", "") else n for n, o in self.features) or "-"

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "vp": self.vp, "ep": self.ep, "etp": self.etp,
                "cp": self.cp,
                "expert_data_parallel": self.edp, "schedule": self.schedule,
                "memory_budget_units": self.budget, "micro_batch_size": self.mbs, "microbatches": self.m,
                "recompute": self.recompute, "distributed_optimizer": self.distributed_optimizer,
                "sequence_parallel": self.tp > 1, "features": dict(self.features), "overlap": self.overlap}


@dataclass
class StageCosts:
    """Per-stage seconds and activation shares (units) for the simulator, plus what the
    memory model needs per stage (placement, parts, extra activation bytes)."""

    placement: tuple[int, ...]          # stage -> rank
    parts: tuple[StagePart, ...]        # stage -> layers / embedding / output layer
    t_f: list[float]
    t_b: list[float]
    t_w: list[float]
    comm: float
    act: list[float]                    # activation units per stage and microbatch
    unit_bytes: float                   # bytes of one unit
    transient: list[float]              # per rank: bytes held only while an op runs, and messages
    detail: dict = field(default_factory=dict)   # per-rank extras for the report (MoE: "alltoall")
    #: per stage: the share of an F's activation only its W frees (planner/stagemem.py: what the B/W
    #: split keeps, inputs and output gradients); None: all of it (the schedule core's default)
    w_share: list[float] | None = None
    #: per stage: seconds of expert all-to-all in one microbatch's F (the same within B); () = none
    a2a: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        by_rank: dict[int, list[int]] = {}
        for s, r in enumerate(self.placement):
            by_rank.setdefault(r, []).append(s)
        self._by_rank = by_rank

    def copy(self) -> "StageCosts":
        return StageCosts(self.placement, self.parts, list(self.t_f), list(self.t_b), list(self.t_w),
                          self.comm, list(self.act), self.unit_bytes, list(self.transient), dict(self.detail),
                          None if self.w_share is None else list(self.w_share), list(self.a2a))

    def stages_of(self, rank: int) -> list[int]:
        return self._by_rank.get(rank, [])

    def rank_work(self, rank: int) -> float:
        """F+B+W seconds of one microbatch on ``rank``."""
        tf, tb, tw = self.t_f, self.t_b, self.t_w
        return sum(tf[s] + tb[s] + tw[s] for s in self._by_rank.get(rank, ()))

    def rank_units(self, rank: int) -> float:
        """Activation units one microbatch leaves on ``rank`` (all its chunks)."""
        return sum(self.act[s] for s in self._by_rank.get(rank, ()))

    def without_a2a(self) -> "StageCosts":
        """These costs with the all-to-all taken out of F and B (what an overlapped pair can hide at
        best: a lower bound of a paired schedule's makespan)."""
        c = self.copy()
        if self.a2a:
            c.t_f = [f - a for f, a in zip(self.t_f, self.a2a)]
            c.t_b = [b - a for b, a in zip(self.t_b, self.a2a)]
        return c

    def lower_bound(self, m: int) -> float:
        """No schedule can beat this makespan: a rank's work for m microbatches plus the
        forwards that must run before its first stage can start."""
        best = 0.0
        for r in set(self.placement):
            first = min(self.stages_of(r))
            head = sum(self.t_f[:first]) + first * self.comm
            best = max(best, m * self.rank_work(r) + head)
        return best


@dataclass
class RankMemory:
    """Bytes of one rank at its peak."""

    static: StaticMemory
    activations: float
    transient: float
    extra: float = 0.0                  # features' buffers (vocab-parallel logits, staging)
    notes: list[str] = field(default_factory=list)
    nccl: float = 0.0                   # the p2p strategy's NCCL communicators (runtime/ncclmem.py)

    @property
    def total(self) -> float:
        return self.static.total + self.activations + self.transient + self.extra + self.nccl

    def to_dict(self) -> dict:
        d = self.static.to_dict()
        d.update(activations=self.activations, transient=self.transient, feature_buffers=self.extra,
                 iteration_peak=self.activations + self.transient + self.extra, nccl_buffers=self.nccl,
                 total=self.total)
        return d


@dataclass
class Estimate:
    """A candidate's predicted iteration: time breakdown (seconds) and memory per rank."""

    candidate: Candidate
    costs: StageCosts
    pipe: PipeResult
    memory: list[RankMemory]
    time: dict[str, float]
    usable_bytes: float
    model_flops: float                  # per iteration
    peak_flops: float                   # cluster peak FLOP/s
    notes: list[str] = field(default_factory=list)

    @property
    def iteration_time(self) -> float:
        return sum(self.time.values())

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.iteration_time * self.peak_flops)

    @property
    def peak_rank(self) -> int:
        return max(range(len(self.memory)), key=lambda r: self.memory[r].total)

    @property
    def peak_bytes(self) -> float:
        return max(m.total for m in self.memory)

    @property
    def overflow(self) -> float:
        """Bytes over the usable memory on the fullest rank (<= 0: fits)."""
        return self.peak_bytes - self.usable_bytes

    @property
    def fits(self) -> bool:
        return self.overflow <= 0

    def copy(self) -> "Estimate":
        mem = [RankMemory(m.static, m.activations, m.transient, m.extra, list(m.notes), m.nccl) for m in self.memory]
        return Estimate(self.candidate, self.costs, self.pipe, mem, dict(self.time), self.usable_bytes,
                        self.model_flops, self.peak_flops, list(self.notes))


def _cp_sizes(model: ModelSpec) -> str:
    """The context-parallel sizes up to 16 that ``model`` takes (they split its sequence into 2*cp
    chunks and divide its heads), as --cp lists them."""
    return ",".join(str(d) for d in range(1, 17) if d == 1 or (model.seq % (2 * d) == 0 and model.heads % d == 0))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def powers_of_two_upto(n: int) -> list[int]:
    return [2 ** k for k in range(int(math.log2(max(n, 1))) + 1)]


__all__ = ["PlanRequest", "Candidate", "StageCosts", "RankMemory", "Estimate", "ceil_div", "divisors",
           "powers_of_two_upto"]
