"""Set up a Megatron-Core training run under any layout and schedule: the run's configuration
(:class:`RunConfig`), Megatron's parallel state, the model chunks of the schedule's placement
(:mod:`.model`) in Megatron-Core DDP, the Megatron optimizer and the forward-backward function --
Megatron-Core's own (``schedule=None``: ``get_forward_backward_func()``) or ours
(:class:`~megatron_pp_ext.runtime.executor.ScheduleExecutor`).

``mppx train`` (trainer/loop.py) and the parity checks of :mod:`megatron_pp_ext.testing` both
build on :func:`setup_training`, so what the tests compare is what users run.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from . import nccl_rules
from .precision import precision_dtype, precision_overrides, wrap_float16
from .tied import tied_pairs, v_embedding_ranks, with_tied_sum
from .model import ModelSpec, build_model_chunks, make_config, param_meta, wrap_ddp

__all__ = ["RunConfig", "Training", "setup_training", "check_expert_layout", "make_batch", "forward_step",
           "optimizer_step", "optimizer_config", "recompute_overrides"]


@dataclass(frozen=True)
class RunConfig:
    """One training run. ``num_microbatches`` is per data-parallel rank.

    ``schedule``: None for Megatron-Core's own forward-backward function (1F1B, or
    interleaved when ``chunks > 1``), a registered schedule name, or a picklable factory
    ``(pp, num_microbatches) -> Schedule``.
    ``loss``: "per_token" (3-tuple loss, Megatron's num_tokens path), "per_token_global"
    (the same with ``calculate_per_token_loss``) or "legacy" (2-tuple, mean per microbatch).
    """

    spec: ModelSpec = field(default_factory=ModelSpec)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    #: expert model parallel size (MoE): experts split over ``ep`` ranks of the tp x dp ranks of a stage
    ep: int = 1
    #: expert tensor parallel size (MoE; None: tp, as Megatron-LM's default); 1 or tp here
    etp: int | None = None
    schedule: Any = None
    chunks: int = 1
    memory_budget: float | str | None = None
    costs: tuple = (1.0, 1.0, 1.0, 0.0)
    num_microbatches: int = 4
    micro_batch_size: int = 1
    seq_length: int = 16
    steps: int = 3
    eval_iters: int = 1              # forward-only iterations after training (new data)
    forward_only: bool = False
    loss: str = "per_token"
    seed: int = 1234
    lr: float = 1e-2
    optimizer: str = "adam"          # or "sgd" (no per-element normalisation: see the tests)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False   # with the distributed optimizer only (as in Megatron-LM)
    distributed_optimizer: bool = False  # Megatron's DistributedOptimizer (optimizer state sharded over dp)
    sequence_parallel: bool = False
    #: "fp32", "bf16" or "fp16": Megatron-LM's --bf16 / --fp16 (Float16Module, fp32 main params and
    #: gradients, fp16 with a loss scaler: dynamic unless ``loss_scale`` is given)
    precision: str = "fp32"
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    clip_grad: float = 0.0               # Megatron's --clip-grad (0: no clipping)
    #: parity checks of clipping: the gradient norm each optimizer step clips with, instead of the
    #: one it computes (a sum of squares whose order depends on the layout); the computed one is
    #: still reported (``optimizer_steps[i]["computed_grad_norm"]``)
    grad_norm_override: tuple | None = None
    #: activation recomputation, Megatron-LM's --recompute-granularity / -method / -num-layers;
    #: ``recompute=True`` is the old spelling of full / uniform / 1
    recompute: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    deallocate_pipeline_outputs: bool = True
    record_timings: bool = False
    #: the executor's point-to-point strategy (runtime/p2p.py; None: the backend's default) and,
    #: on gloo, NCCL's semantics emulated for it (runtime/nccl_emulation.py)
    p2p: str | None = None
    emulate_nccl: bool = False
    #: overlapped forward-backward pairs (--overlap-moe-expert-parallel-comm, runtime/overlap.py) and
    #: the expert all-to-all time per microbatch and rank they hide, in the units of ``costs``
    overlap_moe: bool = False
    a2a_time: float | None = None
    config_overrides: dict = field(default_factory=dict, hash=False)
    executor_options: dict = field(default_factory=dict, hash=False)
    #: feature hooks (picklable): ``model_hook(chunks, config, cfg) -> extra`` runs on the bare
    #: chunks before DDP wraps them (e.g. vocabulary parallelism replaces layers there);
    #: ``executor_factory(cfg, extra, **executor_kwargs) -> executor`` replaces the plain
    #: ScheduleExecutor (same call signature).
    model_hook: Any = field(default=None, hash=False)
    #: where the chunks live: "cpu", "cuda" (the current CUDA device), or None: cuda when the
    #: default process group is NCCL. Chunks are built on the CPU (weights from the seed and
    #: their global names) and moved before the hook, DDP and the optimizer see them.
    device: str | None = None
    executor_factory: Any = field(default=None, hash=False)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def replace(self, **kw) -> "RunConfig":
        return dataclasses.replace(self, **kw)


# --- data ----------------------------------------------------------------------------------

def make_batch(seed: int, step: int, microbatch: int, mbs: int, seq: int, vocab: int) -> dict:
    """Deterministic microbatch ``microbatch`` (global index) of iteration ``step``."""
    digest = hashlib.sha256(f"data:{seed}:{step}:{microbatch}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
    loss_mask = (torch.rand(mbs, seq, generator=g) < 0.85).float()
    loss_mask[:, 0] = 1.0  # never an all-masked microbatch
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, seq).contiguous(),
    }


from .model import unwrap_model as _core


def _loss_per_token(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def _loss_legacy(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.clone().detach()}


def forward_step(data_iterator, model, *, loss: str = "per_token", return_schedule_plan: bool = False):
    """Megatron-style forward step: the first stage reads tokens, the last labels and mask. With
    ``return_schedule_plan`` (overlapped pairs, runtime/overlap.py) it returns Megatron-Core's
    fine-grained schedule plan of the forward instead of running it, as Megatron-LM's does."""
    core = _core(model)
    batch = next(data_iterator) if (core.pre_process or core.post_process) else None
    mtp = getattr(core, "mtp_process", False)   # (multi-token prediction embeds the next tokens)
    tokens = batch["tokens"] if core.pre_process or mtp else None
    position_ids = batch["position_ids"] if core.pre_process or mtp else None
    labels = batch["labels"] if core.post_process else None
    kw = {"loss_mask": batch["loss_mask"]} if mtp else {}
    if return_schedule_plan:
        output = core.build_schedule_plan(tokens, position_ids, None, labels=labels, **kw)
    else:
        output = model(tokens, position_ids, None, labels=labels, **kw)
    fn = _loss_legacy if loss == "legacy" else _loss_per_token
    return output, partial(fn, batch["loss_mask"] if core.post_process else None)


# --- the run -------------------------------------------------------------------------------

RECOMPUTE_GRANULARITIES = ("full", "selective")


def recompute_overrides(cfg: RunConfig) -> dict:
    """TransformerConfig fields of Megatron-LM's --recompute-granularity / -method / -num-layers."""
    gran, method, num = cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers
    if cfg.recompute and gran is None:
        gran, method, num = "full", "uniform", 1
    if gran is None:
        return {}
    if gran not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity {gran!r}: use one of {RECOMPUTE_GRANULARITIES}")
    if gran == "selective":
        return {"recompute_granularity": "selective"}
    return {"recompute_granularity": "full", "recompute_method": method or "uniform",
            "recompute_num_layers": 1 if num is None else num}


def optimizer_config(cfg: RunConfig):
    """Megatron-Core's OptimizerConfig for ``cfg`` (as Megatron-LM builds it from its flags)."""
    from megatron.core.optimizer import OptimizerConfig
    dtype = precision_dtype(cfg.precision)
    return OptimizerConfig(optimizer=cfg.optimizer, lr=cfg.lr, weight_decay=0.01, clip_grad=cfg.clip_grad,
                           adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, bf16=cfg.precision == "bf16",
                           fp16=cfg.precision == "fp16", params_dtype=dtype, loss_scale=cfg.loss_scale,
                           initial_loss_scale=cfg.initial_loss_scale, min_loss_scale=cfg.min_loss_scale,
                           loss_scale_window=cfg.loss_scale_window, hysteresis=cfg.hysteresis,
                           use_distributed_optimizer=cfg.distributed_optimizer,
                           overlap_param_gather=cfg.overlap_param_gather)


def check_expert_layout(cfg: RunConfig) -> None:
    """Refuse expert-parallel layouts Megatron-Core cannot build (one line, naming the fields).

    Megatron-Core's rule: the ranks of one pipeline stage (tp x dp) split into expert tensor
    parallel x expert parallel x expert data parallel groups, so ``etp * ep`` must divide
    ``tp * dp``; ``num_experts`` must be a multiple of ``ep``. Here ``etp`` is 1 or tp."""
    spec = cfg.spec
    if not spec.is_moe:
        if cfg.ep != 1 or cfg.etp not in (None, 1, cfg.tp):
            raise ValueError(f"expert parallelism (ep={cfg.ep}, etp={cfg.etp}) needs a mixture-of-experts "
                             "model: set ModelSpec.num_experts")
        return
    etp = cfg.expert_tp
    if cfg.ep < 1:
        raise ValueError(f"ep={cfg.ep}: the expert model parallel size must be >= 1")
    if etp not in (1, cfg.tp):
        raise ValueError(f"etp={etp}: the expert tensor parallel size must be 1 or tp={cfg.tp} here")
    if (cfg.tp * cfg.dp) % (etp * cfg.ep):
        raise ValueError(f"ep={cfg.ep} x etp={etp} must divide tp x dp = {cfg.tp * cfg.dp} (the ranks of one "
                         "pipeline stage), as in Megatron-Core")
    if spec.num_experts % cfg.ep:
        raise ValueError(f"num_experts={spec.num_experts} must be a multiple of ep={cfg.ep}")
    if spec.variant == "gpt" and (etp > 1 or cfg.ep == 1):
        # (etp > 1: TransformerConfig refuses expert biases; ep = etp = 1: the expert MLP adds its bias
        # in place to the view its row-parallel layer's reduction returns, which autograd forbids)
        raise ValueError(f"the gpt variant's MoE layers (expert biases) run in Megatron-Core only with expert "
                         f"parallel size >= 2 and expert tensor parallel size 1 (here ep={cfg.ep}, etp={etp}): "
                         "use the llama variant (no biases) or ep >= 2 with etp=1")
    if cfg.tp > 1 and not cfg.sequence_parallel:
        raise ValueError(f"MoE at tp={cfg.tp} needs sequence parallelism (Megatron-Core refuses MoE training with "
                         "tensor parallelism without it)")


def _placement(cfg: RunConfig):
    from ..schedule import loop_placement, v_placement
    if cfg.schedule is None:
        return loop_placement(cfg.pp, cfg.chunks)
    if not isinstance(cfg.schedule, str):  # a factory (pp, m) -> Schedule: ask it
        sched = cfg.schedule(cfg.pp, cfg.num_microbatches)
        sched = sched[0] if isinstance(sched, tuple) else sched
        return tuple(sched.placement)
    from ..schedule.registry import schedule_info
    info = schedule_info(cfg.schedule)
    if info.placement == "v":
        return v_placement(cfg.pp)
    return loop_placement(cfg.pp, info.chunks if info.chunks is not None else cfg.chunks)


@dataclass
class Training:
    """What :func:`setup_training` built on this rank."""

    cfg: RunConfig
    config: Any                 # TransformerConfig (shared by the chunks)
    model: list                 # DDP-wrapped chunks, in chunk order
    optimizer: Any
    forward_backward: Any       # Megatron's function or a ScheduleExecutor
    executor: Any               # the ScheduleExecutor, or None
    placement: tuple
    meta: dict                  # global name -> (tp partition dim, GLU fc1)
    extra: Any = None           # what cfg.model_hook returned (e.g. the vocabulary engine)

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_rank()

    @property
    def device(self) -> torch.device:
        """Where the chunks live (``RunConfig.device``)."""
        p = next((p for chunk in self.model for p in chunk.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    def batches(self, step: int) -> list[dict]:
        """This rank's microbatches of iteration ``step``, on the model's device (made on the CPU
        from the seed: the same data whatever the device)."""
        c, m = self.cfg, self.cfg.num_microbatches
        out = [make_batch(c.seed, step, self.dp_rank * m + i, c.micro_batch_size, c.seq_length,
                          c.spec.vocab_size) for i in range(m)]
        dev = self.device
        if dev.type != "cpu":
            out = [{k: v.to(dev) for k, v in b.items()} for b in out]
        return out

    def step(self, step: int, *, forward_only: bool | None = None, iters: list | None = None) -> list:
        """One forward-backward (and nothing else); returns the forward-backward result."""
        c = self.cfg
        forward_only = c.forward_only if forward_only is None else forward_only
        if iters is None:
            batches = self.batches(step)
            iters = [iter(batches) for _ in self.model]
        if not forward_only:
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
        single = len(self.model) == 1 and self.executor is None
        return self.forward_backward(
            forward_step_func=partial(forward_step, loss=c.loss), data_iterator=iters[0] if single else iters,
            model=self.model[0] if single else self.model, num_microbatches=c.num_microbatches,
            seq_length=c.seq_length, micro_batch_size=c.micro_batch_size, forward_only=forward_only)


def setup_training(cfg: RunConfig) -> Training:
    """Parallel state, model chunks (DDP), Megatron optimizer and forward-backward function for
    ``cfg`` on this rank (torch.distributed already initialised with tp*pp*dp ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if dist.get_world_size() != cfg.world_size:
        raise ValueError(f"world size {dist.get_world_size()} != tp*pp*dp = {cfg.world_size}")
    check_expert_layout(cfg)
    if nccl_rules.wanted(cfg.emulate_nccl) and nccl_rules.active() is None:
        nccl_rules.install()   # (before any group exists: each communicator is created at its first op)
    placement = _placement(cfg)
    v = len(placement) // cfg.pp
    # (the default group is gloo already on CPU: no extra gloo copies of the dp groups)
    gloo_default = dist.get_backend() == "gloo"
    v_shape = cfg.pp > 1 and placement[0] == placement[-1]
    extra_groups = {"get_embedding_ranks": v_embedding_ranks} if v_shape else {}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp, pipeline_model_parallel_size=cfg.pp,
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
        expert_model_parallel_size=cfg.ep, expert_tensor_parallel_size=cfg.expert_tp,
        create_gloo_process_groups=not gloo_default, **extra_groups)
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)

    overrides = dict(cfg.config_overrides)
    overrides.setdefault("sequence_parallel", cfg.sequence_parallel)
    overrides.setdefault("deallocate_pipeline_outputs", cfg.deallocate_pipeline_outputs)
    if cfg.schedule is None and v > 1:
        # Megatron's interleaved schedule with batched p2p swaps messages on gloo when both
        # neighbours are the same rank (pp=2): use its unbatched p2p there.
        overrides.setdefault("batch_p2p_comm", False)
    if cfg.loss == "per_token_global":
        overrides.setdefault("calculate_per_token_loss", True)
    overrides.update(recompute_overrides(cfg))
    overrides.update(precision_overrides(cfg.precision))
    config = make_config(cfg.spec, tp=cfg.tp, pp=cfg.pp, placement=placement if cfg.pp > 1 else None,
                         ep=cfg.ep, etp=cfg.expert_tp, **overrides)
    chunks = build_model_chunks(cfg.spec, config, placement if cfg.pp > 1 else None, seed=cfg.seed)
    device = cfg.device or ("cuda" if dist.get_backend() == "nccl" else "cpu")
    if device == "cuda":  # Module.to keeps the Parameter objects and their Megatron attributes
        chunks = [c.to(torch.device("cuda", torch.cuda.current_device())) for c in chunks]
    elif device != "cpu":
        raise ValueError(f"RunConfig.device {device!r}: use 'cpu', 'cuda' or None")
    if cfg.overlap_param_gather and not cfg.distributed_optimizer:
        raise ValueError("overlap_param_gather (--overlap-param-gather) needs the distributed optimizer "
                         "(--use-distributed-optimizer), as in Megatron-LM")
    extra = cfg.model_hook(chunks, config, cfg) if cfg.model_hook is not None else None
    pairs = tied_pairs(chunks) if v_shape else []   # tied embeddings, both copies on this rank
    meta = param_meta(chunks, cfg.spec)
    if cfg.precision != "fp32":
        # Megatron-LM's get_model(): Float16Module casts the chunk (same Parameter objects, so the
        # stage and tp attributes stay) and the first stage's input / last stage's output.
        chunks = wrap_float16(chunks, config)
    model = wrap_ddp(chunks, config, overlap_grad_reduce=cfg.overlap_grad_reduce,
                     overlap_param_gather=cfg.overlap_param_gather, align_param_gather=cfg.overlap_param_gather,
                     use_distributed_optimizer=cfg.distributed_optimizer,
                     grad_reduce_in_fp32=cfg.precision != "fp32",  # Megatron-LM's default with --bf16/--fp16
                     average_in_collective=False, delay_wgrad_compute=cfg.spec.te_wgrad_split)
    optimizer = get_megatron_optimizer(optimizer_config(cfg), model, use_gloo_process_groups=not gloo_default)

    config.finalize_model_grads_func = with_tied_sum(finalize_model_grads, pairs) if pairs else finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    if cfg.overlap_grad_reduce:
        config.grad_sync_func = [m.start_grad_sync for m in model] if len(model) > 1 else model[0].start_grad_sync
    if cfg.overlap_param_gather:  # (align_param_gather, Megatron-LM's default)
        config.param_sync_func = [m.start_param_sync for m in model] if len(model) > 1 else model[0].start_param_sync

    executor = None
    if cfg.schedule is None:
        if cfg.executor_factory is not None:
            raise ValueError("RunConfig.executor_factory needs one of our schedules (schedule=None runs Megatron-Core's)")
        fb = get_forward_backward_func()
    else:
        from .executor import ScheduleExecutor
        make = ScheduleExecutor if cfg.executor_factory is None else partial(cfg.executor_factory, cfg, extra)
        comm = {k: v for k, v in (("p2p", cfg.p2p), ("emulate_nccl", cfg.emulate_nccl),
                                  ("overlap_moe", cfg.overlap_moe), ("a2a_time", cfg.a2a_time)) if v}
        executor = make(cfg.schedule, chunks=cfg.chunks, memory_budget=cfg.memory_budget, costs=cfg.costs,
                        record_timings=cfg.record_timings, **comm, **cfg.executor_options)
        if cfg.spec.tie_embeddings and v_shape and hasattr(executor, "allow_tied_v"):
            executor.allow_tied_v = True   # (the copies are summed after finalize_model_grads: runtime.tied)
        fb = executor
    return Training(cfg, config, model, optimizer, fb, executor, tuple(placement), meta, extra)


def optimizer_step(optimizer, grad_norm_override: float | None = None) -> dict:
    """``optimizer.step()``; what it reports: whether it updated (fp16 skips a step whose
    gradients overflowed), the gradient norm (before clipping, as Megatron logs it; None where
    the optimizer computes none) and the loss scale (fp16 only). ``grad_norm_override``: the
    norm to clip with instead of the computed one (see RunConfig.grad_norm_override)."""
    computed: list[float] = []
    if grad_norm_override is None:
        ok, grad_norm, _ = optimizer.step()
    else:
        from megatron.core.optimizer import optimizer as mopt
        orig = mopt.get_grad_norm_fp32

        def forced(*args, **kwargs):
            computed.append(float(orig(*args, **kwargs)))
            return grad_norm_override

        mopt.get_grad_norm_fp32 = forced
        try:
            ok, grad_norm, _ = optimizer.step()
        finally:
            mopt.get_grad_norm_fp32 = orig
    scale = float(optimizer.get_loss_scale().item()) if optimizer.config.fp16 else None
    rec = {"update_successful": bool(ok), "grad_norm": None if grad_norm is None else float(grad_norm),
           "loss_scale": scale}
    if computed:
        rec["computed_grad_norm"] = computed[-1]
    return rec
