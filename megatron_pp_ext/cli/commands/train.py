"""``mppx train``: pretrain a Megatron-Core GPT/LLaMA-style model with any pipeline schedule.

Thin: the flags, the validation, the launch and the training loop live in
:mod:`megatron_pp_ext.trainer` (docs/train.md).
"""

from __future__ import annotations

import sys

from ..core import CLIError, register_command


def configure(parser):
    from ...trainer.config import add_arguments
    add_arguments(parser)


def run(args) -> int:
    import warnings

    # Megatron-Core warns that Transformer Engine / apex are missing (expected on CPU)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex|TE).*")
    from ...compat import UnsupportedMegatronError, check_supported
    from ...trainer.config import TrainConfigError, config_from_args
    from ...trainer.errors import RunFailure
    from ...trainer.launcher import TrainRunError, train

    try:
        check_supported()       # (one line before anything starts: the supported megatron-core range)
        return train(config_from_args(args))
    except UnsupportedMegatronError as e:
        raise CLIError(str(e)) from None
    except TrainConfigError as e:
        raise CLIError(str(e)) from None
    except RunFailure as e:   # (the launcher's own writes: one line, the run failed)
        print(f"mppx: error: {e}", file=sys.stderr)
        return 1
    except TrainRunError as e:
        if e.details:
            print(e.details, file=sys.stderr)
        print(f"mppx: error: {e}", file=sys.stderr)
        return e.status


register_command(
    "train", "pretrain a GPT/LLaMA model with a pipeline schedule (CPU processes, GPUs, torchrun, srun)",
    order=70,
    description="Pretrain a GPT or LLaMA-style model built from Megatron-Core (DDP, the Megatron optimizer, "
                "Megatron-Core's mock GPT dataset or an indexed corpus) with any registered schedule or "
                "Megatron-Core's own (--schedule mcore), on local processes it starts itself or under "
                "torchrun/srun; logs loss, gradient norm, time and per-rank activation peak per iteration, "
                "draws the schedule and compares the losses with a pp=1 run of the same initial weights. "
                "With no flags: a tiny GPT on 4 CPU processes, pp=4, zbv, 20 iterations.")(configure, run)
