"""Parallelism planner: pick tp/pp/dp (and ep/etp for MoE models), pipeline schedule, chunks,
memory budget, microbatch size, recomputation and features (offload, vocabulary parallelism,
BPipe) for a model on a cluster, from a memory model that mirrors Megatron-Core's
allocations, a FLOP-based time model and the schedule core's simulator.

Pure Python: imports the schedule core, never torch. Entry points::

    from megatron_pp_ext.planner import PlanRequest, get_model, make_cluster, plan
    result = plan(PlanRequest(get_model("llama2-70b"), make_cluster("h100", 64), 1024))
    print(format_report(result))

See docs/planner.md.
"""

from .bpipe import BPipeVerdict, bpipe_estimate
from .candidates import Candidate, Estimate, PlanRequest, RankMemory, StageCosts
from .emit import megatron_flags, slurm_script
from .features import (BaseFeature, BPipeEstimator, FeatureEstimator, OffloadEstimator, VocabParallelEstimator,
                       feature_names, get_feature, register_feature)
from .memory import (StagePart, StaticMemory, activation_bytes_per_microbatch, buffer_numel, layer_activation,
                     layer_param_numels, model_active_params, model_num_params, stage_param_numels,
                     stage_param_tensors, static_memory)
from .presets import (GPU_PRESETS, MODEL_PRESETS, ClusterSpec, GPUSpec, ModelSpec, PlannerError, get_gpu,
                      get_model, make_cluster, model_names)
from .report import format_report, result_to_dict
from .search import Planner, PlanResult, Rejections, plan
from .simcache import PipeResult, SimCache
from .timing import Efficiency, default_efficiency, layer_times, load_calibration

__all__ = [
    "BPipeVerdict", "bpipe_estimate", "Candidate", "Estimate", "PlanRequest", "RankMemory", "StageCosts",
    "megatron_flags", "slurm_script", "BaseFeature", "BPipeEstimator", "FeatureEstimator", "OffloadEstimator",
    "VocabParallelEstimator", "feature_names", "get_feature", "register_feature", "StagePart", "StaticMemory",
    "activation_bytes_per_microbatch", "buffer_numel", "layer_activation", "layer_param_numels",
    "model_active_params", "model_num_params", "stage_param_tensors",
    "stage_param_numels", "static_memory", "GPU_PRESETS", "MODEL_PRESETS", "ClusterSpec", "GPUSpec", "ModelSpec",
    "PlannerError", "get_gpu", "get_model", "make_cluster", "model_names", "format_report", "result_to_dict",
    "Planner", "PlanResult", "Rejections", "plan", "PipeResult", "SimCache", "Efficiency", "default_efficiency",
    "layer_times", "load_calibration",
]
