"""What a Bridge ``ConfigContainer`` plus our ``mppx`` settings will run, and what is refused
(torch-free): the Megatron-LM integration's rules (:mod:`megatron_pp_ext.megatron_lm.flags`) on
the container seen under Megatron-LM's names, plus the two things only Bridge has."""

from __future__ import annotations

from typing import Any

from ..megatron_lm.flags import MegatronLMFlagError, MegatronPlan, check_megatron_args, prevalidate, resolve
from .options import BridgeConfigError, bridge_message, megatron_args, options_namespace

__all__ = ["plan_for"]


def plan_for(cfg: Any, settings: dict[str, Any], world_size: int | None = None) -> MegatronPlan:
    """The run ``cfg`` (a Bridge ``ConfigContainer``) with ``settings`` (``mppx`` keys) asks for,
    checked as the Megatron-LM integration checks its flags (the schedule is built once here, so
    a size it cannot run at fails now). Raises :class:`BridgeConfigError` with one line naming the
    Bridge key (``model.mtp_num_layers``, ``mppx.schedule``) and the fix."""
    try:
        opts = resolve(options_namespace(settings))
        args = megatron_args(cfg, world_size)
        if opts.active and getattr(getattr(cfg, "dist", None), "use_decentralized_pg", False):
            raise BridgeConfigError(f"{opts.flag} cannot be combined with dist.use_decentralized_pg=true (the "
                                    "schedule's loss hand-over uses Megatron-Core's parallel_state groups); drop one "
                                    "of them")
        if opts.active:   # (Megatron-LM's pretrain_gpt.py and mppx train run them; not yet run through Bridge)
            if getattr(args, "mtp_num_layers", None):
                raise BridgeConfigError(f"{opts.flag}: multi-token prediction (--mtp-num-layers) is not supported "
                                        "through Megatron-Bridge yet (Megatron-LM's pretrain_gpt.py runs it); drop "
                                        "--mtp-num-layers")
            if getattr(args, "overlap_moe_expert_parallel_comm", False):
                raise BridgeConfigError(f"{opts.flag} cannot be combined with --overlap-moe-expert-parallel-comm "
                                        "through Megatron-Bridge yet (Megatron-LM's pretrain_gpt.py runs the pairs); "
                                        "drop one of them")
        from ..runtime.te_policy import splits_on_te
        if splits_on_te(opts.schedule, args.transformer_impl):   # (no opt-in through Bridge: runtime/te_policy.py)
            raise BridgeConfigError(
                f"{opts.flag} splits every backward into B and W, which Transformer Engine's layers (Bridge's "
                "default layer spec with Transformer Engine installed) do through TE's delay_wgrad_compute, not "
                "yet verified on a GPU nor set up through Megatron-Bridge: use a schedule without the split (1f1b, "
                "interleaved-1f1b), or set model.transformer_layer_spec = local_layer_spec "
                "(megatron.bridge.models.gpt_provider) in the recipe")
        if opts.needs_install and not callable(getattr(cfg.model, "provide", None)):
            raise BridgeConfigError(f"{type(cfg.model).__name__} is built by a ModelBuilder, not a model provider's "
                                    "provide(): megatron_pp_ext places the model chunks of provider configs (the "
                                    "recipes' GPTModelProvider); drop the mppx settings for this model")
        lps = prevalidate(args, opts) if opts.needs_install else None
        if lps is not None:   # (Megatron-LM derives the chunk count from the layout string it validates)
            chunks = len(lps) // args.pipeline_model_parallel_size
            args.virtual_pipeline_model_parallel_size = chunks if chunks > 1 else None
        plan = check_megatron_args(args, opts, lps)
        plan.notes[:] = [bridge_message(n) for n in plan.notes]
        return plan
    except (MegatronLMFlagError, BridgeConfigError) as e:
        raise BridgeConfigError(bridge_message(str(e))) from None
