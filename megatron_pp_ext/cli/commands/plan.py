"""``mppx plan``: choose tp/pp/dp, schedule, microbatch, recomputation and features for a
model on a cluster (a thin wrapper around :mod:`megatron_pp_ext.planner`)."""

from __future__ import annotations

import argparse
import json
import os

from ..core import CLIError, check_writable, int_at_least, is_stdout, name_list, register_command, write_text

_ARCH = {
    "gpt": dict(gated_mlp=False, norm="layernorm", bias=True, position="learned", tied_embeddings=True, dropout=True),
    "llama": dict(gated_mlp=True, norm="rmsnorm", bias=False, position="rope", tied_embeddings=False, dropout=False),
}


def _int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, e.g. 1,2,4") from None
        if not vals or min(vals) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: give positive whole numbers, e.g. 1,2,4")
        return vals
    parse.__name__ = "list"
    return parse


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def configure(p: argparse.ArgumentParser) -> None:
    from ...planner import model_names

    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="NAME", help=f"preset: {', '.join(model_names())}; the flags below override "
                                                   "its fields, or describe a custom model without --model")
    g.add_argument("--arch", choices=sorted(_ARCH), help="architecture family of a custom model: gpt (LayerNorm, "
                   "GeLU, biases, learned positions, tied embeddings) or llama (RMSNorm, SwiGLU, RoPE, no biases)")
    for flag, what in (("layers", "transformer layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads (GQA)"), ("ffn", "FFN hidden size"), ("vocab", "vocabulary"),
                       ("seq", "sequence length")):
        g.add_argument(f"--{flag}", type=int_at_least(1, 8), metavar="N", help=what)
    g.add_argument("--flash-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="fused (flash) attention, no s^2 activations (default: on)")
    g.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=None,
                   help="attention/hidden dropout > 0, whose masks are stored (default: the preset's; a custom gpt: "
                        "on, llama: off)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=None,
                   help="the output layer shares the input embedding (default: the preset's; a custom gpt: on)")
    g.add_argument("--kv-channels", type=int_at_least(1, 128), metavar="N",
                   help="head size, when heads x head size != hidden (Megatron-LM --kv-channels)")
    g.add_argument("--qk-layernorm", action=argparse.BooleanOptionalAction, default=None,
                   help="a norm on queries and keys (Megatron-LM --qk-layernorm)")
    e = p.add_argument_group("mixture of experts (Megatron-LM's flag names; they make or change an MoE model)")
    e.add_argument("--num-experts", type=int_at_least(1, 8), metavar="N", help="routed experts per MoE layer")
    e.add_argument("--moe-router-topk", type=int_at_least(1, 2), metavar="K", help="experts per token (default 2)")
    e.add_argument("--moe-ffn-hidden-size", type=int_at_least(1, 1408), metavar="N",
                   help="FFN size of one expert (default: --ffn)")
    e.add_argument("--moe-shared-expert-intermediate-size", type=int_at_least(0, 2048), metavar="N",
                   help="FFN size of the shared expert(s) (default 0: none)")
    e.add_argument("--moe-layer-freq", metavar="N|PATTERN",
                   help="every N-th layer is MoE (default 1: all), or a 0/1 pattern such as '([0]*3+[1]*58)'")
    e.add_argument("--moe-aux-loss-coeff", type=float, metavar="C", help="load-balancing loss coefficient")
    e.add_argument("--moe-router-load-balancing-type", metavar="T",
                   help="aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none (default aux_loss)")
    e.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), help="default softmax")
    e.add_argument("--moe-router-num-groups", type=int_at_least(1, 8), metavar="G",
                   help="group-limited routing: the experts in G equal groups (with --moe-router-group-topk)")
    e.add_argument("--moe-router-group-topk", type=int_at_least(1, 4), metavar="T",
                   help="group-limited routing: a token's experts in T of the groups (DeepSeek-V3: 4 of 8)")
    e.add_argument("--moe-router-enable-expert-bias", action=argparse.BooleanOptionalAction, default=None,
                   help="aux-loss-free balancing bias (needs the sigmoid score function)")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int_at_least(1, 64), metavar="N", help="number of GPUs")
    c.add_argument("--nodes", type=int_at_least(1, 8), metavar="N", help="number of nodes (instead of --gpus)")
    c.add_argument("--gpus-per-node", type=int_at_least(1, 8), default=8, metavar="N", help="default: 8")
    c.add_argument("--gpu", default="h100", metavar="{a100,h100,h200,b200,gb200}",
                   help="GPU preset from datasheet figures (default: h100; docs/planner.md#gpu-presets)")
    c.add_argument("--memory", type=float, metavar="GiB", help="GPU memory in GiB (overrides the preset)")
    c.add_argument("--peak-tflops", type=float, metavar="TF", help="dense bf16 peak (overrides the preset)")
    c.add_argument("--nvlink-gbps", type=float, metavar="GB/s", help="intra-node collective bandwidth")
    c.add_argument("--net-gbps", type=float, metavar="GB/s", help="inter-node bandwidth per GPU")
    c.add_argument("--host-gbps", type=float, metavar="GB/s", help="device-to-host copy bandwidth (offload)")
    c.add_argument("--calibration", metavar="FILE", help="JSON of measured efficiencies/timings (docs/planner.md)")
    s = p.add_argument_group("search")
    s.add_argument("--global-batch-size", type=int_at_least(1, 1024), required=True, metavar="G",
                   help="sequences per iteration")
    s.add_argument("--schedules", metavar="A,B", help="schedules to consider (default: all registered)")
    s.add_argument("--features", metavar="A,B",
                   help="features to consider: offload, vocab-parallel, bpipe (default: all; 'none' for none)")
    s.add_argument("--require-features", metavar="A,B", help="only plans using all of these features")
    s.add_argument("--tp", type=_int_list("--tp"), metavar="1,2,..", help="tensor-parallel sizes to try")
    s.add_argument("--pp", type=_int_list("--pp"), metavar="1,2,..", help="pipeline-parallel sizes to try")
    s.add_argument("--mbs", type=_int_list("--mbs"), metavar="1,2,..", help="microbatch sizes to try")
    s.add_argument("--ep", type=_int_list("--ep"), metavar="1,2,..",
                   help="expert parallel sizes to try (MoE; default: every divisor of the experts that fits)")
    s.add_argument("--etp", type=_int_list("--etp"), metavar="1,2,..",
                   help="expert tensor-parallel sizes to try (MoE; default: tp and 1)")
    s.add_argument("--cp", type=_int_list("--cp"), metavar="1,2,..",
                   help="context-parallel sizes to try (default: 1): each rank holds seq/cp tokens of a sequence, "
                        "keys and values pass around a ring (Megatron-LM --context-parallel-size)")
    s.add_argument("--uneven-layers", choices=("auto", "on", "off"), default="auto",
                   help="also try stage counts that do not divide the layers (an uneven split); auto: only when no "
                        "pipeline size divides them (default)")
    s.add_argument("--max-vp", type=int_at_least(1, 4), default=None, metavar="V",
                   help="largest interleaved chunk count tried (default: 4)")
    s.add_argument("--vp", type=int_at_least(2, 4), metavar="V",
                   help="model chunks per pipeline rank, pinned: interleaved-1f1b (and every schedule taking "
                        "chunks) runs exactly V, V-shaped schedules 2 (instead of searching 2..--max-vp)")
    s.add_argument("--recompute", type=_names, default=("none", "selective", "full"), metavar="A,B",
                   help="recomputation modes to try (default: none,selective,full)")
    s.add_argument("--budgets", type=_names, default=("fit",), metavar="fit,0.5x",
                   help="v-budget memory budgets: 'fit' (largest that fits) and/or units or fractions of 1F1B")
    s.add_argument("--no-distributed-optimizer", action="store_true", help="plan without the distributed optimizer")
    s.add_argument("--use-megatron-fsdp", action="store_true",
                   help="plan Megatron-FSDP (Megatron-LM's flag; sharding strategy optim_grads_params): parameters, "
                        "gradients and optimizer states sharded over dp, one transformer layer gathered at a time; "
                        "Megatron-Core's own schedules (1f1b, interleaved-1f1b) without features")
    s.add_argument("--precision", choices=("bf16", "fp8", "fp32"), default="bf16",
                   help="bf16 (Megatron-LM's --bf16: bf16 parameters and activations, fp32 gradients and master "
                        "weights), fp8 (bf16 plus Transformer Engine's FP8 GEMMs in the transformer layers: "
                        "--fp8-format hybrid) or fp32 (default: bf16)")
    s.add_argument("--fp8-recipe", metavar="R",
                   help="FP8 scaling recipe with --precision fp8, as Megatron-LM names it: delayed, tensorwise "
                        "(current scaling, NVIDIA's recipes' choice; default), blockwise, mxfp8 (Blackwell)")
    s.add_argument("--fp8-param-gather", action="store_true",
                   help="with --precision fp8: hold and all-gather the GEMM weights as Transformer Engine's FP8 "
                        "parameters (Megatron-LM's flag)")
    s.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce (and hold) gradients in bf16 instead of fp32, as NVIDIA's recipes do (the plan "
                        "then emits no --accumulate-allreduce-grads-in-fp32)")
    s.add_argument("--tp-comm-overlap", action="store_true",
                   help="Transformer Engine's userbuffers overlap the tensor-parallel collectives with the GEMMs "
                        "(Megatron-LM's flag; the hidden share is the efficiency's tp_comm_overlap)")
    s.add_argument("--memory-model", choices=("gpu", "cpu"), default="gpu",
                   help="whose memory to predict: gpu (Megatron-LM on GPUs: the fused softmax kernel, apex's fused "
                        "weight-gradient accumulation; default) or cpu (mppx train on CPU processes: torch's "
                        "softmax, weight gradients delivered through autograd; to check a plan there)")
    from ...planner.timing import FLEX_BACKENDS, TOKEN_DISPATCHERS
    s.add_argument("--moe-token-dispatcher-type", choices=TOKEN_DISPATCHERS, default="alltoall",
                   help="Megatron-Core's token dispatcher the plan runs (MoE): alltoall (NCCL's all-to-all; default) "
                        "or flex (DeepEP's kernels: one copy of a token per remote node over the network, forwarded "
                        "to its experts over NVLink)")
    s.add_argument("--moe-flex-dispatcher-backend", choices=FLEX_BACKENDS, default=None,
                   help="the flex dispatcher's kernels (with --moe-token-dispatcher-type flex): deepep (default) or "
                        "hybridep (keeps the token counts on the device: no host synchronise per MoE layer)")
    s.add_argument("--overlap-moe-expert-parallel-comm", action="store_true",
                   help="also try overlapped forward-backward pairs on MoE models at expert parallel size >= 2 "
                        "(the expert all-to-all hidden behind another microbatch's compute); a paired plan wins "
                        "when it is faster")
    from ...runtime.p2pstrategy import NCCL_STRATEGIES
    s.add_argument("--p2p-strategy", choices=NCCL_STRATEGIES, default="channels",
                   help="the runtime's point-to-point strategy on NCCL (mppx train / Megatron-LM --p2p-strategy): its "
                        "communication model times the pipeline (pairwise and batched simulate every send and "
                        "receive; orders that deadlock under it are rejected) and its communicators count in memory "
                        "(default: channels)")
    s.add_argument("--top", type=int_at_least(1, 10), default=10, metavar="K", help="plans to list (default: 10)")
    s.add_argument("--time-limit", type=float, default=120.0, metavar="S",
                   help="CPU seconds of search before it stops and reports what it has (default: 120)")
    s.add_argument("--no-cache", action="store_true", help="do not read or write the simulation cache")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the result as JSON (flags and SLURM script inside)")
    o.add_argument("--emit-flags", metavar="FILE", help="write the best plan's pretrain_gpt.py flags ('-': stdout)")
    o.add_argument("--emit-slurm", metavar="FILE", help="write a SLURM batch script for the best plan ('-': stdout)")
    o.add_argument("--explain-bpipe", action="store_true",
                   help="also predict whether BPipe (or offload) with a larger microbatch beats 1F1B, and why")
    o.add_argument("--no-baseline", action="store_true",
                   help="skip the comparison with the best Megatron 1F1B/interleaved plan")


_MOE_FIELDS = (("num_experts", "num_experts"), ("moe_router_topk", "moe_topk"), ("moe_ffn_hidden_size", "moe_ffn"),
               ("moe_shared_expert_intermediate_size", "moe_shared_ffn"), ("moe_aux_loss_coeff", "moe_aux_loss_coeff"),
               ("moe_router_load_balancing_type", "moe_load_balancing"),
               ("moe_router_score_function", "moe_score_function"),
               ("moe_router_enable_expert_bias", "moe_expert_bias"), ("moe_router_num_groups", "moe_router_num_groups"),
               ("moe_router_group_topk", "moe_router_group_topk"), ("kv_channels", "kv_channels"),
               ("qk_layernorm", "qk_norm"))


def _moe_changes(args) -> dict:
    """ModelSpec fields set by the MoE / attention-shape flags that were given."""
    from ...planner.presets import parse_moe_layer_freq

    out = {field: getattr(args, flag) for flag, field in _MOE_FIELDS if getattr(args, flag) is not None}
    if args.moe_layer_freq is not None:
        out["moe_layer_freq"] = parse_moe_layer_freq(args.moe_layer_freq)
    return out


def build_request(args):
    """The :class:`PlanRequest` of the parsed flags (errors name the flag)."""
    from ...planner import PlanRequest, PlannerError, get_model, load_calibration, make_cluster, default_efficiency
    from ...planner.presets import ModelSpec

    explicit = {k: getattr(args, k.replace("-", "_")) for k in ("layers", "hidden", "heads", "kv-heads", "ffn",
                                                                 "vocab", "seq")}
    try:
        moe = _moe_changes(args)
        if args.model:
            model = get_model(args.model)
            changes = {f: v for f, v in (("num_layers", explicit["layers"]), ("hidden", explicit["hidden"]),
                                         ("heads", explicit["heads"]), ("kv_heads", explicit["kv-heads"]),
                                         ("ffn", explicit["ffn"]), ("vocab", explicit["vocab"]),
                                         ("seq", explicit["seq"])) if v is not None}
            if explicit["heads"] is not None and explicit["kv-heads"] is None and model.kv_heads == model.heads:
                changes["kv_heads"] = explicit["heads"]
            if args.arch:
                changes.update(_ARCH[args.arch])
            changes.update(moe)
            if changes:
                model = model.with_(name=f"{model.name}*", **changes)
        else:
            missing = [f"--{k}" for k in ("layers", "hidden", "heads") if explicit[k] is None]
            if missing:
                raise CLIError(f"give --model NAME or a custom model ({', '.join(missing)} missing)")
            arch = _ARCH[args.arch or "gpt"]
            h = explicit["hidden"]
            ffn = explicit["ffn"] or (4 * h if not arch["gated_mlp"] else int(8 * h / 3 + 255) // 256 * 256)
            model = ModelSpec("custom", explicit["layers"], h, explicit["heads"],
                              explicit["kv-heads"] or explicit["heads"], ffn, explicit["vocab"] or 50257,
                              explicit["seq"] or 2048, **arch, **moe)
        if args.flash_attention is not None:
            model = model.with_(flash_attention=args.flash_attention)
        if args.dropout is not None:
            model = model.with_(dropout=args.dropout)
        if args.tie_embeddings is not None:
            model = model.with_(tied_embeddings=args.tie_embeddings)
        if args.gpus is None and args.nodes is None:
            raise CLIError("give --gpus N (or --nodes N)")
        cluster = make_cluster(args.gpu, args.gpus, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                               memory_gib=args.memory, peak_tflops=args.peak_tflops, nvlink_gbps=args.nvlink_gbps,
                               net_gbps=args.net_gbps, host_gbps=args.host_gbps)
        if args.fp8_recipe is not None and args.precision != "fp8":
            raise CLIError(f"--fp8-recipe {args.fp8_recipe} needs --precision fp8 (the plan is {args.precision}); add "
                           "--precision fp8 or drop --fp8-recipe")
        eff = default_efficiency(cluster.gpu)
        if args.calibration:
            eff = load_calibration(args.calibration, eff, model, cluster, precision=args.precision)
        from ...planner import feature_names
        from ...schedule import schedule_names
        schedules = name_list(args.schedules, "--schedules", schedule_names(), "schedule")
        features = name_list(args.features, "--features", feature_names(), "feature", none_ok=True)
        required = name_list(args.require_features, "--require-features", feature_names(), "feature") or ()
        uneven = {"auto": None, "on": True, "off": False}[args.uneven_layers]
        if args.moe_flex_dispatcher_backend is not None and args.moe_token_dispatcher_type != "flex":
            raise CLIError(f"--moe-flex-dispatcher-backend {args.moe_flex_dispatcher_backend} chooses the flex "
                           "dispatcher's kernels: add --moe-token-dispatcher-type flex or drop it")
        if args.vp is not None and args.max_vp is not None:
            raise CLIError(f"--vp {args.vp} with --max-vp {args.max_vp}: --vp pins the chunk count, --max-vp bounds "
                           "a search of it; pick one")
        return PlanRequest(model, cluster, args.global_batch_size, efficiency=eff, schedules=schedules,
                           features=features, require_features=required, tp=args.tp, pp=args.pp,
                           mbs=args.mbs, ep=args.ep, etp=args.etp, uneven_layers=uneven,
                           max_vp=4 if args.max_vp is None else args.max_vp, vp=args.vp, cp=args.cp,
                           recompute=args.recompute, budgets=args.budgets,
                           distributed_optimizer=not args.no_distributed_optimizer,
                           megatron_fsdp=args.use_megatron_fsdp, top=args.top,
                           time_limit=args.time_limit, precision=args.precision,
                           fp8_recipe=args.fp8_recipe or "tensorwise", runtime=args.memory_model,
                           fp8_param_gather=args.fp8_param_gather, grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
                           tp_comm_overlap=args.tp_comm_overlap,
                           overlap=args.overlap_moe_expert_parallel_comm, p2p_strategy=args.p2p_strategy,
                           moe_dispatcher=args.moe_token_dispatcher_type,
                           moe_flex_backend=args.moe_flex_dispatcher_backend or "deepep")
    except PlannerError as e:
        raise CLIError(str(e)) from None


def _check_outputs(args) -> None:
    """Standard output carries one document: the JSON, the flags or the SLURM script; the two files
    are different files; each can be written -- all before the search."""
    outs = [(flag, path) for flag, path in (("--emit-flags", args.emit_flags), ("--emit-slurm", args.emit_slurm))
            if path]
    to_stdout = [flag for flag, path in outs if is_stdout(path)]
    files = [(flag, path) for flag, path in outs if not is_stdout(path)]
    if len(files) == 2 and os.path.abspath(files[0][1]) == os.path.abspath(files[1][1]):
        raise CLIError(f"--emit-flags and --emit-slurm both name {files[1][1]}: the script would overwrite the flags; "
                       "give them different files")
    for flag, path in files:
        check_writable(path, flag)
    if args.json and to_stdout:
        raise CLIError(f"{to_stdout[0]} {'-' if '-' in (args.emit_flags, args.emit_slurm) else 'to standard output'} with --json: standard output carries the JSON, which holds the best "
                       "plan's flags (plans[0].megatron_flags) and the SLURM script (slurm_script); give a file name (e.g. "
                       f"{to_stdout[0]} best.{'txt' if to_stdout[0] == '--emit-flags' else 'sbatch'}) or drop --json")
    if len(to_stdout) > 1:
        raise CLIError("--emit-flags - with --emit-slurm -: only one of them can go to standard output; give the "
                       "other a file name")


def run(args) -> int:
    from ...planner import PlannerError, SimCache, bpipe_estimate, format_report, plan, result_to_dict
    from ...planner.emit import flags_text, slurm_script

    _check_outputs(args)
    if args.explain_bpipe and args.use_megatron_fsdp:
        raise CLIError("--explain-bpipe with --use-megatron-fsdp: BPipe and offload run on megatron_pp_ext's executor, "
                       "which does not run Megatron-FSDP; drop one of them")
    req = build_request(args)
    bad = [r for r in req.recompute if r not in ("none", "selective", "full")]
    if bad:
        raise CLIError(f"--recompute {','.join(bad)}: use none, selective and/or full")
    cache = SimCache(disk=False if args.no_cache else None)
    try:
        result = plan(req, cache=cache, baseline=not args.no_baseline)
        verdict = bpipe_estimate(req, cache=cache) if args.explain_bpipe else None
    except PlannerError as e:
        from ...planner.report import nothing_fits_to_dict
        from ...planner.search import NothingFits
        if args.json and isinstance(e, NothingFits):   # the document still says what came closest
            print(json.dumps(nothing_fits_to_dict(req, e), indent=2))
        raise CLIError(str(e)) from None
    if args.emit_flags:
        write_text(args.emit_flags, flags_text(result.best, req), "--emit-flags")
    if args.emit_slurm:
        write_text(args.emit_slurm, slurm_script(result.best, req), "--emit-slurm")
    if args.json:
        print(json.dumps(result_to_dict(result, bpipe=verdict), indent=2))
    elif not any(path and is_stdout(path) for path in (args.emit_flags, args.emit_slurm)):
        print(format_report(result, bpipe=verdict))
    return 0


register_command("plan", "plan tp/pp/dp, schedule, microbatch, recomputation and features for a model", order=60,
                 description="Search tensor/pipeline/data parallelism, pipeline schedule (with chunks and memory "
                             "budget), microbatch size, recomputation and features (offload, vocabulary "
                             "parallelism, BPipe) for a model on a cluster; print the ranked plans (model "
                             "predictions), why the others were rejected, and the matching Megatron-LM flags "
                             "and SLURM script.")(configure, run)
