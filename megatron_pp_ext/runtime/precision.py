"""Mixed precision as Megatron-LM's ``--bf16`` / ``--fp16`` sets it up, for any stage placement.

Megatron-LM wraps every model chunk in :class:`~megatron.core.transformer.module.Float16Module`,
which casts the chunk to bf16/fp16, casts the *first stage's* inputs to that dtype and the *last
stage's* outputs back to fp32. It finds the first and last stage from the pipeline rank and the
virtual-stage index in Megatron's loop order (last stage = last rank, last chunk). Under a V
placement that is wrong: the last stage lives on rank 0 and the chunk Megatron takes for it (rank
p-1, chunk 1) is the turn-around stage, whose fp32 output would then be sent to a rank that
receives in bf16 (a collective size mismatch on gloo, silent garbage on NCCL).
:class:`StageFloat16Module` asks the chunk itself instead: Megatron-Core's ``GPTModel`` knows
whether it computes the first (``pre_process``) and the last (``post_process``) stage.
"""

from __future__ import annotations

import torch

__all__ = ["PRECISIONS", "precision_dtype", "precision_overrides", "StageFloat16Module", "stage_float16_module_class",
           "wrap_float16"]

PRECISIONS = ("fp32", "bf16", "fp16")


def precision_dtype(precision: str) -> torch.dtype:
    """The parameter / activation dtype of a precision name."""
    try:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    except KeyError:
        raise ValueError(f"precision {precision!r}: use one of {PRECISIONS}") from None


def precision_overrides(precision: str) -> dict:
    """TransformerConfig fields of Megatron-LM's --bf16 / --fp16 (parameters and p2p in that dtype)."""
    dtype = precision_dtype(precision)
    if precision == "fp32":
        return {}
    return {"bf16": precision == "bf16", "fp16": precision == "fp16", "params_dtype": dtype,
            "pipeline_dtype": dtype}


def _stage_flags(module) -> tuple[bool | None, bool | None]:
    inner = module
    while not hasattr(inner, "pre_process") and hasattr(inner, "module"):
        inner = inner.module
    return getattr(inner, "pre_process", None), getattr(inner, "post_process", None)


def _float16_module_class():
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16

    class StageFloat16Module(Float16Module):
        """Float16Module whose first/last-stage casts follow the chunk's own stage (any placement)."""

        def forward(self, *inputs, fp32_output: bool = True, **kwargs):
            first, last = _stage_flags(self.module)
            if first is None or last is None:  # not a GPTModel-like chunk: Megatron's own rule
                return super().forward(*inputs, fp32_output=fp32_output, **kwargs)
            if first:
                inputs = fp32_to_float16(inputs, self.float16_convertor)
            outputs = self.module(*inputs, **kwargs)
            if last and fp32_output is True:
                outputs = float16_to_fp32(outputs)
            return outputs

    return StageFloat16Module


_CLASS = None


def stage_float16_module_class() -> type:
    """The :class:`StageFloat16Module` class (a subclass of Megatron-Core's ``Float16Module``, so
    ``isinstance`` checks in Megatron-LM still hold); e.g. to replace ``Float16Module`` in
    Megatron-LM's ``training`` namespace."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _float16_module_class()
    return _CLASS


def StageFloat16Module(config, module):  # noqa: N802 - a class, built lazily (megatron import)
    """``Float16Module(config, module)`` with stage-aware casts (see the module doc)."""
    return stage_float16_module_class()(config, module)


def wrap_float16(chunks: list, config) -> list:
    """Every chunk in a :func:`StageFloat16Module` (the same Parameter objects, cast in place, so
    the stage and tensor-parallel attributes stay)."""
    return [StageFloat16Module(config, c) for c in chunks]
