"""A small ``pretrain_gpt.py`` for the training loop that the megatron-core wheel carries.

The megatron-core 0.19 wheel ships Megatron-LM's training loop (``megatron.training``:
``pretrain``, the arguments, checkpointing) but not the repository's ``pretrain_gpt.py``. This
script drives that loop the way core_v0.19.0's ``pretrain_gpt.py`` does -- arguments through
``parse_and_validate_args``, the model from ``gpt_config_from_args`` (built by Megatron-LM's
``GPTModelBuilder``), ``pretrain(cfg_container, ...)`` -- for GPT pretraining on mock or indexed
data, without the SFT, FIM, packed-sequence, distillation and ModelOpt paths. CI runs the
Megatron-LM integration tests with it (tests/test_megatron_lm_integration.py); the same tests
run a real checkout's ``pretrain_gpt.py`` when ``MEGATRON_LM_DIR`` is set.

Run it like the real one: ``torchrun ... -m megatron_pp_ext.launch tests/megatron_lm_wheel/pretrain_gpt.py ARGS``.
"""

from functools import partial

import torch

from megatron.core import mpu
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
from megatron.training import get_args, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

KEYS = ("attention_mask", "labels", "loss_mask", "position_ids", "tokens")


def get_batch(data_iterator, vp_stage=None, config=None):
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return {k: None for k in KEYS}
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {k: (batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None) for k in KEYS}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=config is not None and mtp_on_this_rank(config.pipeline_model_parallel_layout,
                                                                 config.mtp_num_layers, ignore_virtual=False,
                                                                 vp_stage=vp_stage),
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(), is_pipeline_last_stage=mpu.is_pipeline_last_stage())
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core.utils import get_attr_wrapped_model, get_model_config
    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"), get_model_config(model))
    inputs = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if return_schedule_plan:   # --overlap-moe-expert-parallel-comm: the fine-grained plan, as pretrain_gpt.py
        assert get_args().overlap_moe_expert_parallel_comm, "the schedule plan needs --overlap-moe-expert-parallel-comm"
        plan = model.build_schedule_plan(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"])
        return plan, partial(loss_func, batch["loss_mask"])
    out = model(*inputs, labels=batch["labels"], loss_mask=batch["loss_mask"])
    return out, partial(loss_func, batch["loss_mask"])


def datasets_provider(num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus)
    built_here = partial(lambda vp: mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp),
                         vp_stage)
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    return BlendedMegatronDatasetBuilder(MockGPTDataset if args.mock_data else GPTDataset, num_samples, built_here,
                                         config).build()


def get_embedding_ranks(pp_ranks):
    args = get_args()
    ranks = [pp_ranks[0]]
    if len(pp_ranks) > 1 and not args.untie_embeddings_and_output_weights:
        ranks.append(pp_ranks[-1])
    return sorted(set(ranks))


if __name__ == "__main__":
    datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), datasets_provider,
             ModelType.encoder_or_decoder, forward_step, get_embedding_ranks=get_embedding_ranks)
