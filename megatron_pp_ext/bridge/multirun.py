"""Several Bridge launches in one set of processes, with their exact losses (tests, checks).

Importing Megatron-Bridge costs tens of CPU seconds per process, far more than a tiny model's
training, so the checks run the launcher (:func:`megatron_pp_ext.bridge.launch.run`: the whole
path from the command line to Bridge's ``pretrain()``) on the ranks of a
:class:`~megatron_pp_ext.runtime.pool.WorkerPool` forked after Bridge was imported once::

    from megatron_pp_ext.bridge.multirun import bridge_pool, launch
    with bridge_pool(4) as pool:
        runs = launch(pool, 2, ["--recipe", "vanilla_gpt_pretrain_config", "mppx.schedule=zbv", ...])

Each rank returns what Bridge's loop logged and printed: per iteration the loss dict handed to
``training_log`` and the gradient norm (exact floats, ``float.hex``), the evaluations'
losses as ``evaluate_and_print_results`` got them, the lines it printed (Bridge's iteration
log, ``megatron_pp_ext:`` lines), how many times our schedule ran (``schedule_calls``: training
steps and evaluations), and the exit status of a refused run.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import time
from typing import Any, Iterator, Sequence

__all__ = ["PRELOAD", "TINY_GPT", "bridge_pool", "launch", "run_rank"]

#: the CPU checks' model as Bridge overrides of ``vanilla_gpt_pretrain_config``: a tiny GPT (8
#: layers, hidden 32, 4 heads, sequence 16, vocabulary 200; the recipe's tied embeddings), batches of
#: 8 one-sample microbatches from mock data, fp32, no dropout, no fused CUDA kernels, a constant
#: learning rate, one evaluation iteration, a log line per iteration, nothing written to disk
TINY_GPT = tuple("""--recipe vanilla_gpt_pretrain_config
model.num_layers=8 model.hidden_size=32 model.num_attention_heads=4 model.ffn_hidden_size=128
model.seq_length=16 dataset.seq_length=16 tokenizer.vocab_size=200 model.attention_dropout=0.0
model.hidden_dropout=0.0 model.gradient_accumulation_fusion=false model.masked_softmax_fusion=false
model.bias_activation_fusion=false model.bias_dropout_fusion=false model.persist_layer_norm=false
model.apply_rope_fusion=false train.global_batch_size=8 train.micro_batch_size=1 validation.eval_iters=1
validation.eval_interval=1000 logger.log_interval=1 logger.tensorboard_dir=null checkpoint.save=null
mixed_precision=null optimizer.bf16=false optimizer.lr=1e-3 optimizer.min_lr=1e-3 scheduler.lr_warmup_iters=0
dataset.num_workers=0""".split())

#: imported in the pool's parent before its workers are forked (the launcher's imports)
PRELOAD = ("megatron_pp_ext.bridge.integration", "megatron.bridge.training.pretrain",
           "megatron.bridge.recipes", "megatron.bridge.training.gpt_step",
           "megatron.bridge.training.utils.omegaconf_utils")
_KEPT = ("iteration ", "validation loss", "megatron_pp_ext")


def _hex(v: Any) -> str | None:
    if v is None:
        return None
    try:
        return float(v.item() if hasattr(v, "item") else v).hex()
    except (TypeError, ValueError):
        return None


def _floats(d: dict | None) -> dict:
    return {k: h for k, h in ((k, _hex(v)) for k, v in (d or {}).items()) if h is not None}


@contextlib.contextmanager
def _recording(rec: dict) -> Iterator[None]:
    """Bridge's ``training_log`` and ``evaluate`` (as its printing calls it) record what they get."""
    from .. import compat
    from ..megatron_lm import state as _st
    train = importlib.import_module("megatron.bridge.training.train")
    ev = importlib.import_module("megatron.bridge.training.eval")
    log0, eval0 = train.training_log, ev.evaluate

    def training_log(*args: Any, **kwargs: Any):
        bound = compat.bind_call(log0, args, kwargs)
        if bound is not None:
            rec["train"].append(_floats(bound.arguments.get("loss_dict")))
            rec["grad_norm"].append(_hex(bound.arguments.get("grad_norm")))
        return log0(*args, **kwargs)

    def evaluate(*args: Any, **kwargs: Any):
        out = eval0(*args, **kwargs)
        rec["eval"].append(_floats(out[0]) if isinstance(out, tuple) else {})
        return out

    train.training_log, ev.evaluate = training_log, evaluate
    try:
        yield
    finally:
        train.training_log, ev.evaluate = log0, eval0
        st = _st.current
        rec["schedule_calls"] = st.fb.calls if st is not None and st.fb is not None else 0


def run_rank(argv: Sequence[str]) -> dict:
    """One rank of a launch (a pool configuration: ``torch.distributed`` is initialised): runs
    :func:`~megatron_pp_ext.bridge.launch.run` with ``argv`` and returns this rank's record."""
    import torch

    from .launch import LaunchError, run
    rec: dict[str, Any] = {"rank": torch.distributed.get_rank(), "train": [], "grad_norm": [], "eval": [],
                           "exit": 0, "lines": [], "schedule_calls": 0}
    buf = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            run(list(argv), hooks=lambda: _recording(rec))
    except LaunchError as e:
        rec["exit"], rec["error"] = e.code, e.msg
    except SystemExit as e:
        rec["exit"] = e.code
    rec["seconds"] = time.perf_counter() - t0
    rec["lines"] = [ln for ln in buf.getvalue().splitlines() if any(k in ln for k in _KEPT)]
    return rec


def bridge_pool(size: int, **kwargs: Any):
    """A :class:`~megatron_pp_ext.runtime.pool.WorkerPool` of ``size`` workers forked after the
    launcher's imports (:data:`PRELOAD`); keywords go to the pool (``timeout``, ...)."""
    import megatron_pp_ext  # noqa: F401 - the import shims, before Megatron-Bridge is imported

    from ..runtime.pool import DEFAULT_PRELOAD, WorkerPool
    kwargs.setdefault("preload", DEFAULT_PRELOAD + PRELOAD)
    return WorkerPool(size, **kwargs)


def launch(pool: Any, nproc: int, argv: Sequence[str], *, timeout: float | None = None) -> list[dict]:
    """Run the launcher with ``argv`` on ``nproc`` ranks of ``pool``; the records, by rank."""
    return pool.run(run_rank, nproc, timeout=timeout, argv=list(argv))
