"""The split of Megatron-Core's own linear layers (``ColumnParallelLinear``, ``RowParallelLinear``):
a scoped patch of their ``_forward_impl`` that routes a call through an autograd function whose
backward computes the input gradient (B) and queues the weight gradient (W).

Gradient semantics (what W writes, and when DDP sees it)
--------------------------------------------------------
The split layer's autograd function does *not* have the weight as an autograd input (it gets
a detached alias; the Parameter itself travels in a side structure), so B never touches the
weight's gradient accumulator: in particular Megatron-Core DDP's per-parameter grad-ready hook
(registered on the parameter's ``AccumulateGrad`` node) does **not** fire in B. (Returning
``None`` for the weight instead would still run that node and fire the hook with no gradient,
which would let DDP's bucket reduction start before W; tests/test_wgrad.py shows it.)

At W the closure computes ``dW = dyᵀ·x`` exactly as Megatron-Core's backward does (same
tensors, same reshapes, same GEMM) and delivers it the way autograd would have, by running the
autograd engine on the parameter itself (``torch.autograd.backward(param, grad)``). That runs
the parameter's ``AccumulateGrad`` node and therefore every hook on it: the gradient lands in
``param.grad`` (plain accumulation), and Megatron-Core DDP's backward post-hook then adds it
into ``param.main_grad``, clears ``param.grad`` and, with ``overlap_grad_reduce``, registers the
parameter as grad-ready. DDP's bucket reduction therefore sees each weight only *after its
W has run* (with ``overlap_grad_reduce``, mind the ``no_sync`` protocol below).

* ``gradient_accumulation_fusion`` on and the parameter has ``main_grad`` (what Megatron-Core
  DDP provides): W accumulates ``dW`` straight into ``main_grad`` with the fused
  ``fused_weight_gradient_mlp_cuda`` kernel when it is importable and the tensors are on CUDA,
  otherwise with a plain GEMM and ``main_grad.add_`` (the CPU emulation; inputs in a lower
  precision than ``main_grad`` are up-cast first, like the fused kernel's fp32 accumulation).
  Megatron-FSDP parameters (``__fsdp_param__``) follow Megatron-Core's own branch. As in
  Megatron-Core, when the parameter carries ``grad_added_to_main_grad`` (it does under DDP) W
  sets it and delivers a dummy gradient (zeros if ``zero_out_wgrad``, else uninitialised) so
  DDP's hook fires (grad-ready) without adding anything twice.
* Otherwise (fusion off, or no ``main_grad``): ``dW`` is delivered through autograd to
  ``param.grad`` as described above.
* Weights shared along a path: each use of a weight queues its own W item and each item
  delivers once; nothing is added twice. The output layer that shares its weight with the word
  embedding (``share_embeddings_and_output_weights``; Megatron-Core passes
  ``shared_embedding_or_output_weight()`` to ``output_layer`` as ``weight=``) is split like any
  other ColumnParallelLinear: the embedding's contribution arrives in B, the output layer's at W,
  both into the same Parameter. With pipeline parallelism the two copies live on different
  stages (the last stage's copy is only used by the output layer); Megatron's
  ``_allreduce_word_embedding_grads`` inside ``finalize_model_grads`` must run after the flush
  (step 4). At pp=1 the tied weight gets two grad-ready hook calls per microbatch instead of
  one (embedding in B, output layer in W).
* DDP with ``overlap_grad_reduce=True`` (with it off, ``finish_grad_sync`` reduces
  synchronously and there is nothing to coordinate beyond step 4). Two protocols:

  - *Overlapped* (megatron-core >= 0.16, whose buckets count grad-ready hook calls per
    parameter and learn the expected counts in the first iteration): as Megatron's own
    schedules do, run everything under ``no_sync()`` except from the last microbatch's B on
    (leave ``no_sync`` before it). Each bucket's reduction is then dispatched right after the
    last B or W that contributes to it, overlapping the cooldown. The hook-call pattern must
    be the same every iteration (use the split from the first iteration on).
  - *After the flush* (any version; required for megatron-core 0.15, whose buckets accept one
    grad-ready call per parameter while sync is enabled and assert "Cannot set grad twice",
    which two W ops after the last B violate): run the whole schedule under ``no_sync()``,
    flush W, leave ``no_sync``, call :func:`start_grad_sync_after_w` (checks step 4, then
    ``start_grad_sync()`` on each chunk), then ``finalize_model_grads`` as usual. The DP
    reduction then does not overlap the pipeline cooldown.
* Megatron's own ``defer_embedding_wgrad_compute`` (the ``grad_output_buffer`` path of the
  output layer), frozen weights, non-leaf weights, and calls whose output would not require
  grad are left to Megatron-Core's original code (computed in B).

Exactness: for each linear layer, B returns bit-for-bit the input and bias gradients of
Megatron-Core's unsplit backward, and W adds bit-for-bit the same ``dW``; the only thing that
changes is *when* it is added, i.e. the order in which per-microbatch contributions are summed.
A call with ``output_dtype`` (Megatron-LM main's ``--output-logit-dtype fp32``: fp32 logits from a
bf16 output layer) runs Megatron-Core's own GEMM function in F (:func:`megatron_pp_ext.compat.linear_output_gemm`),
and B casts the output gradient to the input's dtype first, as that Megatron-Core's backward does.


Sequence parallelism
--------------------
A sequence-parallel ColumnParallelLinear all-gathers its input along the sequence. Megatron-Core
does not keep the gathered input from the forward; it re-gathers it in the backward for the
weight gradient. Here the re-gather moves with the W closure. ``sp_gather`` chooses where:

* ``"w"`` (default): the closure keeps only the local 1/tp shard of the input and re-gathers it
  at W time. Same communication volume as the unsplit backward, lowest memory; the W op then
  contains a TP all-gather (all TP ranks run the same W ops in the same order, so collectives
  match).
* ``"b"``: B gathers the input (as the unsplit backward does) and the closure keeps the gathered
  tensor until W: ``tp`` times the memory of that input per queued item, but W is pure compute
  (no collective), which makes it easier to place anywhere in a bubble.

The reduce-scatter of the input gradient stays in B (it is part of dx).

"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .store import WeightGradStore


class SplitInactiveError(RuntimeError):
    """A linear layer that the B/W split should split computed its weight gradient in B (or
    cannot be split exactly): a zero-bubble schedule would silently lose its W ops."""


# ------------------------------------------------------------------------------------------
# Local (non-TE) Megatron-Core linear layers
# ------------------------------------------------------------------------------------------


def _layers():
    from megatron.core.tensor_parallel import layers as _l

    return _l


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    # Exactly Megatron-Core's prepare_input_tensors_for_wgrad_compute reshape (one tensor).
    t = t.contiguous()
    if t.dim() == 3:
        t = t.view(t.shape[0] * t.shape[1], t.shape[2])
    return t


def _all_gather_seq(inp: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 over ``group`` into a fresh tensor (not the global buffer)."""
    size = list(inp.size())
    size[0] *= group.size()
    out = torch.empty(size, dtype=inp.dtype, device=inp.device)
    _layers().dist_all_gather_func(out, inp.contiguous(), group=group)
    return out


def _autocast_state() -> Optional[torch.dtype]:
    """The CUDA autocast dtype if CUDA autocast is on (custom_bwd restores it in backward)."""
    try:
        if torch.is_autocast_enabled("cuda"):
            return torch.get_autocast_dtype("cuda")
    except TypeError:  # older torch: no device argument
        if torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
    return None


def _accumulate_main_grad(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """main_grad += grad_outputᵀ · total_input (both 2-D), fused kernel when available."""
    kernel = getattr(_layers(), "fused_weight_gradient_mlp_cuda", None)
    if kernel is not None and main_grad.is_cuda and total_input.is_cuda:
        if main_grad.dtype == torch.float32:
            kernel.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
            return
        if main_grad.dtype in (torch.float16, torch.bfloat16):
            kernel.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
            return
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
    # Emulation (CPU, or no apex): one GEMM then an add, in main_grad's precision.
    if grad_output.dtype != main_grad.dtype:
        grad_output = grad_output.to(main_grad.dtype)
        total_input = total_input.to(main_grad.dtype)
    main_grad.add_(grad_output.t().matmul(total_input))


def _deliver_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate ``grad`` into ``param`` exactly as autograd's AccumulateGrad would,
    running every hook registered on the parameter's gradient accumulator (DDP's grad-ready
    hook included)."""
    torch.autograd.backward(param, grad)


class _LinearWGrad:
    """The deferred W of one forward call of one split linear layer."""

    __slots__ = ("param", "grad_output", "input", "input_version", "gather_group",
                 "fused", "main_grad", "autocast_dtype", "name")

    def __init__(self, param, grad_output, inp, gather_group, fused, main_grad, autocast_dtype,
                 name):
        self.param = param
        self.grad_output = grad_output
        self.input = inp
        self.input_version = inp._version
        self.gather_group = gather_group      # not None: re-gather the input at W (sp_gather="w")
        self.fused = fused
        self.main_grad = main_grad
        self.autocast_dtype = autocast_dtype
        self.name = name

    def __call__(self) -> None:
        param = self.param
        if self.input is None:
            raise RuntimeError(f"W of {self.name} already ran")
        if self.input._version != self.input_version:
            raise RuntimeError(
                f"W of {self.name}: the saved input of this linear layer was modified in place "
                "between B and W; its weight gradient would be wrong")
        ac = (torch.autocast("cuda", dtype=self.autocast_dtype)
              if self.autocast_dtype is not None else contextlib.nullcontext())
        deliver = None
        with torch.no_grad(), ac:
            total_input = self.input
            if self.gather_group is not None:
                total_input = _all_gather_seq(total_input, self.gather_group)
            grad_output, total_input = _layers().prepare_input_tensors_for_wgrad_compute(
                self.grad_output, total_input)
            if self.fused:
                param.main_grad = self.main_grad   # as Megatron-Core's backward does
                if hasattr(param, "__fsdp_param__"):
                    param.main_grad = param.get_main_grad()
                    torch.matmul(grad_output.t(), total_input, out=param.main_grad)
                else:
                    _accumulate_main_grad(total_input, grad_output, param.main_grad)
                if hasattr(param, "grad_added_to_main_grad"):
                    shape = param.main_grad.shape
                    if getattr(param, "zero_out_wgrad", False):
                        deliver = torch.zeros(shape, dtype=self.input.dtype, device=param.main_grad.device)
                    else:
                        deliver = torch.empty(shape, dtype=self.input.dtype, device=param.main_grad.device)
                    param.grad_added_to_main_grad = True
            else:
                deliver = grad_output.t().matmul(total_input)
        # Release the activations before the (possibly hook-running) delivery.
        self.input = None
        self.grad_output = None
        del grad_output, total_input
        if deliver is not None:
            _deliver_grad(param, deliver)

    def __repr__(self) -> str:
        return f"<W {self.name}>"


@dataclass
class _LinearMeta:
    param: torch.Tensor
    name: str
    use_bias: bool
    fused: bool
    main_grad: Optional[torch.Tensor]
    allreduce_dgrad: bool
    sequence_parallel: bool
    tp_group: Any
    sp_gather: str
    output_dtype: Optional[torch.dtype] = None   # Megatron's widening GEMM (fp32 logits), or None
    gemm: Optional[Callable] = None              # ... and Megatron's function that runs it
    grad_to_input_dtype: bool = False            # B casts dY to the input's dtype (as Megatron does)


class _SplitLinearFunction(torch.autograd.Function):
    """Megatron-Core's LinearWithGradAccumulationAndAsyncCommunication, with W deferred.

    Inputs: ``input``, ``weight`` (a detached alias of the Parameter, so that autograd does not
    route anything to the Parameter in B; saved for autograd's in-place-modification check),
    ``bias`` and the non-tensor ``meta``. The forward is Megatron-Core's op for op (with an
    ``output_dtype``, e.g. fp32 logits from a bf16 model, Megatron's own GEMM function runs); the
    backward casts dy to the input's dtype where this Megatron-Core's does (``output_dtype``
    releases), returns dx and the bias gradient and queues dW.

    The GEMMs use the Parameter itself (``meta.param``), not the detached alias: ATen's matmul
    of a 3-D by a 2-D tensor picks its folding strategy from ``requires_grad`` of the operands,
    and the two strategies can round differently, so only the very same operands give
    Megatron-Core's bits. (Grad mode is off in forward/backward: no graph is recorded.)
    """

    @staticmethod
    def forward(ctx, input, weight, bias, meta):  # noqa: A002 - mirrors Megatron's signature
        ctx.meta = meta
        ctx.save_for_backward(input, weight)
        if meta.sequence_parallel:
            total_input = _all_gather_seq(input, meta.tp_group)
        else:
            total_input = input
        if meta.output_dtype is not None:
            return meta.gemm(total_input, meta.param, bias, meta.output_dtype)
        output = torch.matmul(total_input, meta.param.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        meta: _LinearMeta = ctx.meta
        input, _ = ctx.saved_tensors  # noqa: A001  (unpacking checks in-place modification)
        weight = meta.param
        if meta.grad_to_input_dtype:
            grad_output = grad_output.to(input.dtype)   # (a no-op unless the output dtype differs)
        kept_input = input.detach()
        gather_group = None
        if meta.sequence_parallel:
            if meta.sp_gather == "b":
                kept_input = _all_gather_seq(kept_input, meta.tp_group)
            else:
                gather_group = meta.tp_group
        grad_input = grad_output.matmul(weight)
        handle = None
        if meta.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=meta.tp_group, async_op=True)
        if meta.sequence_parallel:
            sub_grad_input = torch.empty(input.size(), dtype=input.dtype, device=input.device)
            handle = _layers().dist_reduce_scatter_func(
                sub_grad_input, grad_input, group=meta.tp_group, async_op=True)
        # Megatron-Core: grad_output.contiguous(), viewed 2-D when 3-D, then .sum(dim=0).
        grad_output = grad_output.contiguous()
        grad_bias = _as_2d(grad_output).sum(dim=0) if meta.use_bias else None

        work = _LinearWGrad(meta.param, grad_output.detach(), kept_input, gather_group,
                            meta.fused, meta.main_grad, _autocast_state(), meta.name)
        state = _STATE
        store = state.store if state is not None else None
        if store is not None:
            store.put(work)
        else:  # forward ran under the patch, backward after it: no deferral
            work()
        if handle is not None:
            handle.wait()
        if meta.sequence_parallel:
            return sub_grad_input, None, grad_bias, None
        return grad_input, None, grad_bias, None


def _wrap_amp(fn_cls) -> None:
    """Apply Megatron-Core's custom_fwd/custom_bwd (CUDA autocast bookkeeping) like its own op."""
    l = _layers()
    fwd = getattr(l, "custom_fwd", None)
    bwd = getattr(l, "custom_bwd", None)
    if fwd is not None and not getattr(fn_cls, "_mppx_amp", False):
        fn_cls.forward = staticmethod(fwd(fn_cls.__dict__["forward"].__func__))
        fn_cls.backward = staticmethod(bwd(fn_cls.__dict__["backward"].__func__))
        fn_cls._mppx_amp = True


def _bind_linear_args(args: tuple, kwargs: dict) -> dict:
    # the call's arguments after (input, weight), bound with the signature of this
    # megatron-core's linear_with_grad_accumulation_and_async_allreduce (megatron_pp_ext.compat)
    from ...compat import bind_linear_call
    return bind_linear_call(args, kwargs)


class _SplitState:
    def __init__(self, store: WeightGradStore, module_ids: Optional[set], sp_gather: str):
        self.store = store
        self.module_ids = module_ids
        self.sp_gather = sp_gather
        self.names: Dict[int, str] = {}
        #: per module id: forwards seen (a hook), forwards split, and why others were not
        self.seen: Dict[int, int] = {}
        self.split: Dict[int, int] = {}
        self.exempt: Dict[int, str] = {}
        self.hooks: list = []

    def applies_to(self, module) -> bool:
        return self.module_ids is None or id(module) in self.module_ids


_STATE: Optional[_SplitState] = None
_ORIGINALS: Dict[type, Callable] = {}


def split_active() -> bool:
    """Whether a :func:`split_weight_grads` context is active in this process."""
    return _STATE is not None


def _make_split_forward_impl(orig: Callable) -> Callable:
    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002
        state = _STATE
        if state is None or not state.applies_to(self) or not torch.is_grad_enabled():
            return orig(self, input, weight, *args, **kwargs)
        try:
            a = _bind_linear_args(args, kwargs)
        except RuntimeError as e:   # compat.LinearCallError: never a silent fallback to W in B
            raise SplitInactiveError(
                f"B/W split: {state.names.get(id(self), type(self).__name__)}: {e}; its weight gradient "
                "cannot be deferred exactly. Use a schedule without a B/W split (1f1b, interleaved-1f1b) "
                "or a supported megatron-core (megatron_pp_ext.compat.SUPPORTED_TEXT)") from None
        bias = a["bias"]
        reason = None
        if not isinstance(weight, torch.Tensor) or not weight.requires_grad:
            reason = "frozen weight"
        elif not weight.is_leaf:
            reason = "non-leaf weight"
        elif a["grad_output_buffer"] is not None:
            reason = "defer_embedding_wgrad_compute (Megatron-Core defers it itself)"
        elif not (input.requires_grad or (bias is not None and bias.requires_grad)):
            reason = "no input gradient"
        if reason is not None:
            state.store.stats["fallback"] += 1
            state.exempt[id(self)] = reason
            return orig(self, input, weight, *args, **kwargs)
        main_grad = getattr(weight, "main_grad", None) if a["gradient_accumulation_fusion"] else None
        sp = bool(a["sequence_parallel"])
        ar = bool(a["allreduce_dgrad"])
        tp_group = a["tp_group"]
        if (sp or ar) and tp_group is None:
            from megatron.core.utils import get_tensor_model_parallel_group_if_none

            tp_group = get_tensor_model_parallel_group_if_none(tp_group)
        meta = _LinearMeta(
            param=weight, name=state.names.get(id(self), type(self).__name__),
            use_bias=bias is not None, fused=main_grad is not None, main_grad=main_grad,
            allreduce_dgrad=ar, sequence_parallel=sp, tp_group=tp_group, sp_gather=state.sp_gather,
            grad_to_input_dtype=bool(a.get("grad_to_input_dtype")))
        if a.get("output_dtype") is not None:
            from ...compat import linear_output_gemm
            meta.output_dtype, meta.gemm = a["output_dtype"], linear_output_gemm()
        state.store.stats["split"] += 1
        state.split[id(self)] = state.split.get(id(self), 0) + 1
        return _SplitLinearFunction.apply(input, weight.detach(), bias, meta)

    _forward_impl._mppx_split = True  # type: ignore[attr-defined]
    _forward_impl.__wrapped__ = orig  # type: ignore[attr-defined]
    return _forward_impl


def check_split_active(where: str = "") -> None:
    """Raise :class:`SplitInactiveError` if a linear layer of the split's model chunks ran a
    forward with grad enabled inside :func:`split_weight_grads` without being split (its weight
    gradient then ran in B: the zero-bubble schedule would silently lose its W ops). Layers
    with a reason not to be split (a frozen weight, Megatron's own deferred embedding wgrad)
    are exempt. Call it inside the context, after the backward ops (the executor does, every
    training call)."""
    state = _STATE
    if state is None or state.module_ids is None:
        return
    bad = [state.names.get(i, "?") for i, n in state.seen.items()
           if n and not state.split.get(i) and i not in state.exempt]
    if bad:
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        raise SplitInactiveError(
            f"B/W split inactive{' ' + where if where else ''}: {', '.join(bad[:4])}{more} ran a forward "
            "without the split (their weight gradients would run in B, not in W): this megatron-core's "
            "linear layers do not go through the patched _forward_impl. Use a schedule without a B/W split "
            "(1f1b, interleaved-1f1b) or a supported megatron-core (docs/compatibility.md)")


def _count_forward(state: "_SplitState"):
    def hook(module, args):
        if torch.is_grad_enabled():
            state.seen[id(module)] = state.seen.get(id(module), 0) + 1
    return hook


def _local_linear_classes() -> List[type]:
    l = _layers()
    return [l.ColumnParallelLinear, l.RowParallelLinear]


def _install_local_patch() -> None:
    _wrap_amp(_SplitLinearFunction)
    for cls in _local_linear_classes():
        orig = cls.__dict__.get("_forward_impl")
        if orig is None:
            raise RuntimeError(
                f"{cls.__module__}.{cls.__qualname__} has no _forward_impl: the B/W split cannot hook this "
                "megatron-core's linear layers (see docs/compatibility.md for the supported versions)")
        if getattr(orig, "_mppx_split", False):
            raise RuntimeError("split_weight_grads: patch already installed")
        _ORIGINALS[cls] = orig
        cls._forward_impl = _make_split_forward_impl(orig)


def _remove_local_patch() -> None:
    for cls, orig in list(_ORIGINALS.items()):
        cls._forward_impl = orig
        del _ORIGINALS[cls]




def local_linear_modules(models: Sequence[torch.nn.Module]) -> Tuple[List[torch.nn.Module], Dict[int, str]]:
    """Megatron-Core's local linear layers inside ``models`` and a readable name for each
    (``chunkI.path``), for the split's messages."""
    local = tuple(_local_linear_classes())
    mods: List[torch.nn.Module] = []
    names: Dict[int, str] = {}
    for i, model in enumerate(models):
        for name, mod in model.named_modules():
            if isinstance(mod, local):
                mods.append(mod)
                names[id(mod)] = f"chunk{i}.{name}" if name else f"chunk{i}"
    return mods, names


def install_split(store, modules: Optional[Sequence[torch.nn.Module]], names: Dict[int, str],
                  sp_gather: str) -> "_SplitState":
    """Patch the local linear classes so that the forwards of ``modules`` (None: every local
    linear layer) queue their weight gradients in ``store``; one split at a time per process.
    Undo with :func:`uninstall_split`, also after an exception."""
    global _STATE
    if _STATE is not None:
        raise RuntimeError("split_weight_grads is already active (it is not re-entrant)")
    module_ids = None if modules is None else {id(m) for m in modules}
    state = _SplitState(store, module_ids, sp_gather)
    state.names = names
    try:
        _install_local_patch()
        hook = _count_forward(state)
        state.hooks = [m.register_forward_pre_hook(hook) for m in (modules or ())]
    except BaseException:
        _remove_local_patch()
        for h in state.hooks:
            h.remove()
        raise
    _STATE = state
    return state


def uninstall_split(state: "_SplitState") -> None:
    """Restore the linear classes and remove ``state``'s hooks; W work still queued stays in
    its store."""
    global _STATE
    _STATE = None
    _remove_local_patch()
    for h in state.hooks:
        h.remove()
