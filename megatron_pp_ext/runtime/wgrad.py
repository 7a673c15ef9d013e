"""B/W split of the backward pass: input gradients now (B), weight gradients later (W).

Zero-bubble schedules split the backward of every linear layer ``y = x Aᵀ`` into
``dx = dy·A`` (B, on the critical path between pipeline stages) and ``dA = dyᵀ·x`` (W, which
can wait and fill bubbles). This module provides that split for stock Megatron-Core, without
a fork and without editing megatron-core's files:

* :class:`WeightGradStore` holds the deferred W work, keyed by whatever the executor uses
  (normally ``(stage, microbatch)``);
* :func:`split_weight_grads` is a scoped, reversible patch: only inside it do Megatron-Core's
  own :class:`~megatron.core.tensor_parallel.layers.ColumnParallelLinear` and
  :class:`~megatron.core.tensor_parallel.layers.RowParallelLinear` (the local layer spec:
  ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``, ``output_layer``) queue their
  weight-gradient GEMM instead of running it; on exit the classes are exactly as before;
* Transformer Engine layers, when TE is installed, go through TE's own
  ``delay_wgrad_compute`` + ``backward_dw()`` interface (see "Transformer Engine" below);
* :func:`check_no_pending_wgrad` is the guard the executor calls before DP gradient reduction
  and before the optimizer step.

Everything that is not the weight of such a linear layer (norms, biases, embeddings,
position embeddings, TE norms) keeps computing its gradient in B, unchanged.

Calling protocol (executor)
---------------------------
::

    store = WeightGradStore()
    with split_weight_grads(store, model_chunks):        # whole schedule of one iteration
        ...
        # F op:  output = forward_step(...)                (nothing special)
        # B op:  with store.collect((stage, mb)):
        #            torch.autograd.backward(output, grad)  # dgrad + bias/norm/embedding grads;
        #                                                   # W closures queue under (stage, mb)
        # W op:  store.run((stage, mb))                     # weight grads of that stage/microbatch
        # BW op (a combined backward, e.g. 1F1B cooldown): backward *without* collect(); the
        #        W work then runs at once, inside that backward (same result, no deferral)
        ...
        store.flush()            # optional: run whatever W is still queued (e.g. at the end)
        check_no_pending_wgrad(store, "before gradient reduction")
    # then: finalize_model_grads / model.finish_grad_sync(), optimizer.step()

1. Enter :func:`split_weight_grads` around the whole schedule (forwards included: the patch
   must be active when the forward of a layer runs, because that is when the layer records
   which autograd function it uses). Passing ``models`` (the model chunks of this rank)
   restricts the split to their layers and is needed to handle Transformer Engine layers.
2. For every B op, run the backward inside ``store.collect(key)`` (or ``store.begin(key)`` /
   ``store.end(key)``). With activation recomputation the recomputed forward and its backward
   run inside B, so the W closures of recomputed layers are captured under the same key.
3. For every W op, call ``store.run(key)``: it runs all W work queued under ``key``, in the
   order it was queued, and returns how many items ran (0 if none was queued: a stage without
   linear layers has no W work). W ops of different keys may run in any order.
4. Before data-parallel gradient reduction (``finalize_model_grads``, ``finish_grad_sync``),
   before the tied-embedding all-reduce between the first and last stage, and before
   ``optimizer.step()``, every W must have run: call :func:`check_no_pending_wgrad` (or
   :meth:`WeightGradStore.assert_empty`), which raises :class:`LeftoverWeightGradError`
   naming every (stage, microbatch) whose W is still queued. ``store.flush()`` runs them all.

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

Transformer Engine
------------------
TE linear modules (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear`` and
Megatron-Core's wrappers around them) are handled through TE's public split-backward interface:
the module must have been built with ``delay_wgrad_compute=True`` (Megatron-Core passes
``config.delay_wgrad_compute`` through; TE >= 2.3), so TE's backward stores its wgrad GEMM in
the module's own queue, and ``module.backward_dw()`` runs it. Inside :func:`split_weight_grads`
each TE module's forward registers a hook on its output; when B reaches that module the hook
records the module under the current key, and ``store.run(key)`` calls ``backward_dw()`` once
per recorded backward. A TE module's queue is FIFO per module, so if W ops of one stage run in a
different order than their B ops, ``backward_dw()`` computes the oldest queued microbatch: the
sum over an iteration is the same, only the attribution to keys differs. Delay is enabled on
entry and the module's previous setting restored on exit. For DDP to see TE weight gradients
after ``backward_dw()``, build DDP with ``DistributedDataParallelConfig(delay_wgrad_compute=True)``
(its hook is then registered through ``register_wgrad_accumulation_and_reduce_hooks``, which TE
calls at the end of ``backward_dw()``). A TE linear module that cannot defer raises
:class:`TEWgradUnsupportedError` saying what to change: a TE version without ``backward_dw``
(< 2.3), a module built without ``delay_wgrad_compute``, or a Megatron-Core TE wrapper whose
``config.delay_wgrad_compute`` is False (the wrapper's ``backward_dw()`` is then a no-op).
``te=False`` leaves TE modules alone (their weight gradients stay in B, as configured).
This path cannot be exercised without CUDA and is **untested here**: only the detection,
validation and bookkeeping logic is tested (with stand-in modules).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Sequence, Union

import torch

__all__ = [
    "WeightGradStore",
    "split_weight_grads",
    "split_active",
    "check_no_pending_wgrad",
    "start_grad_sync_after_w",
    "LeftoverWeightGradError",
    "SplitInactiveError",
    "check_split_active",
    "TEWgradUnsupportedError",
    "te_available",
    "is_te_wgrad_module",
    "find_te_wgrad_modules",
    "format_key",
]


# ------------------------------------------------------------------------------------------
# Errors and key formatting
# ------------------------------------------------------------------------------------------


class LeftoverWeightGradError(RuntimeError):
    """W work is still queued where none may be (before DP reduction / the optimizer step).

    ``keys`` lists the keys with queued work, in queueing order; ``counts`` the number of
    items queued under each.
    """

    def __init__(self, message: str, keys: Sequence[Hashable], counts: Sequence[int]):
        super().__init__(message)
        self.keys = list(keys)
        self.counts = list(counts)


class TEWgradUnsupportedError(RuntimeError):
    """A Transformer Engine module cannot defer its weight gradient (version or config)."""


class SplitInactiveError(RuntimeError):
    """A linear layer that the B/W split should split computed its weight gradient in B (or
    cannot be split exactly): a zero-bubble schedule would silently lose its W ops."""


def format_key(key: Hashable) -> str:
    """Human-readable key: ``(stage, microbatch)`` tuples print as ``stage=s, microbatch=m``."""
    if isinstance(key, tuple):
        if len(key) == 2 and all(isinstance(k, int) for k in key):
            return f"stage={key[0]}, microbatch={key[1]}"
        if len(key) == 3 and isinstance(key[0], str) and all(isinstance(k, int) for k in key[1:]):
            return f"{key[0]}: stage={key[1]}, microbatch={key[2]}"
    for a, b in (("stage", "microbatch"), ("stage", "mb")):
        if hasattr(key, a) and hasattr(key, b):
            return f"stage={getattr(key, a)}, microbatch={getattr(key, b)}"
    return repr(key)


# ------------------------------------------------------------------------------------------
# The store
# ------------------------------------------------------------------------------------------


class WeightGradStore:
    """Queued weight-gradient (W) work, keyed by the executor's (stage, microbatch).

    Keys are any hashable; ``(stage, microbatch)`` tuples give the clearest error messages.
    A store is used by one thread (the one running the schedule); the autograd engine may
    queue into it from its device threads during a backward started by that thread.

    ``require_key``: if True, a split layer whose backward runs while no key is being collected
    raises instead of computing its weight gradient at once (catches a B op the executor forgot
    to wrap in :meth:`collect`).
    """

    def __init__(self, *, require_key: bool = False) -> None:
        self.require_key = require_key
        self._queues: "OrderedDict[Hashable, List[Callable[[], None]]]" = OrderedDict()
        self._key: Optional[Hashable] = None
        self._collecting = False
        #: Counters, for diagnostics and tests: split forwards, unsplit (fallback) forwards,
        #: W items queued, queued W items run, W items run at once (backward outside
        #: collect()), TE backward_dw calls.
        self.stats: Dict[str, int] = dict(split=0, fallback=0, queued=0, run=0, immediate=0, te=0)
        #: called with every W item queued (a memory meter looks at what it keeps: for the local
        #: layers a ``_LinearWGrad`` with ``grad_output`` and ``input``); None: nobody looks
        self.observer: Optional[Callable[[Any], None]] = None

    # -- collecting (B) --------------------------------------------------------------------
    def begin(self, key: Hashable) -> None:
        """Start collecting: W work produced by backward from now on is queued under ``key``."""
        if self._collecting:
            raise RuntimeError(
                f"WeightGradStore.begin({format_key(key)}): already collecting for "
                f"{format_key(self._key)}; call end() first")
        hash(key)
        self._key = key
        self._collecting = True

    def end(self, key: Optional[Hashable] = None) -> None:
        """Stop collecting (``key``, if given, must be the one passed to :meth:`begin`)."""
        if not self._collecting:
            raise RuntimeError("WeightGradStore.end(): not collecting")
        if key is not None and key != self._key:
            raise RuntimeError(
                f"WeightGradStore.end({format_key(key)}): collecting for {format_key(self._key)}")
        self._key = None
        self._collecting = False

    @contextlib.contextmanager
    def collect(self, key: Hashable) -> Iterator["WeightGradStore"]:
        """Context: run a B op's backward inside it to queue its W work under ``key``."""
        self.begin(key)
        try:
            yield self
        finally:
            self.end(key)

    @property
    def collecting(self) -> bool:
        return self._collecting

    @property
    def current_key(self) -> Optional[Hashable]:
        """The key being collected, or None."""
        return self._key if self._collecting else None

    def put(self, work: Callable[[], None], key: Optional[Hashable] = None) -> None:
        """Queue ``work`` under ``key`` (default: the key being collected).

        With no key (not collecting and none given) the work runs at once, unless
        ``require_key`` is set, in which case this raises.
        """
        if key is None:
            if not self._collecting:
                if self.require_key:
                    raise RuntimeError(
                        "a split linear layer ran its backward outside WeightGradStore.collect(); "
                        "wrap every B op in store.collect((stage, microbatch))")
                self.stats["immediate"] += 1
                work()
                return
            key = self._key
        self._queues.setdefault(key, []).append(work)
        self.stats["queued"] += 1
        if self.observer is not None:
            self.observer(work)

    # -- running (W) -----------------------------------------------------------------------
    def run(self, key: Hashable) -> int:
        """Run all W work queued under ``key`` (in queueing order); return how many items ran.

        Returns 0 if nothing is queued under ``key``. Items are removed before they run, so a
        failing item is not retried by a later :meth:`run`.
        """
        items = self._queues.pop(key, None)
        if not items:
            return 0
        n = 0
        try:
            while items:
                work = items.pop(0)
                work()
                n += 1
                self.stats["run"] += 1
        finally:
            if items:  # an item raised: keep the rest queued, visible to assert_empty()
                self._queues[key] = items + self._queues.pop(key, [])
        return n

    def flush(self) -> int:
        """Run all queued W work, key by key in the order keys were first queued."""
        n = 0
        while self._queues:
            key = next(iter(self._queues))
            n += self.run(key)
        return n

    def discard(self, key: Optional[Hashable] = None) -> int:
        """Drop queued work without running it (all keys, or one); return how many items.

        For error recovery only: the dropped weight gradients are lost.
        """
        if key is None:
            n = sum(len(v) for v in self._queues.values())
            self._queues.clear()
            return n
        return len(self._queues.pop(key, []))

    # -- inspection ------------------------------------------------------------------------
    def pending(self) -> "OrderedDict[Hashable, int]":
        """Keys with queued W work -> number of items, in queueing order."""
        return OrderedDict((k, len(v)) for k, v in self._queues.items() if v)

    def has_pending(self, key: Optional[Hashable] = None) -> bool:
        if key is None:
            return any(self._queues.values())
        return bool(self._queues.get(key))

    def __len__(self) -> int:
        return sum(len(v) for v in self._queues.values())

    def assert_empty(self, where: str = "") -> None:
        """Raise :class:`LeftoverWeightGradError` if any W work is queued (names every key)."""
        pend = self.pending()
        if not pend and not self._collecting:
            return
        at = f" {where}" if where else ""
        if not pend:
            raise LeftoverWeightGradError(
                f"W check{at}: a B op is still collecting for {format_key(self._key)} "
                "(store.end() not called)", [self._key], [0])
        parts = [f"({format_key(k)}: {n} item{'s' if n != 1 else ''})" for k, n in pend.items()]
        raise LeftoverWeightGradError(
            f"weight-gradient (W) work still queued{at} for {len(pend)} "
            f"(stage, microbatch) key{'s' if len(pend) != 1 else ''}: " + ", ".join(parts)
            + ". Run store.run(key) for each (or store.flush()) before DP gradient reduction "
            "and the optimizer step.", list(pend.keys()), list(pend.values()))

    def __repr__(self) -> str:
        return (f"WeightGradStore(pending={dict((format_key(k), n) for k, n in self.pending().items())}, "
                f"collecting={format_key(self._key) if self._collecting else None})")


def start_grad_sync_after_w(store: WeightGradStore, model_chunks: Sequence[torch.nn.Module],
                            where: str = "before DP gradient reduction") -> None:
    """The version-independent DP-reduction protocol: check that no W is queued, then dispatch
    the gradient reduction of every Megatron-Core DDP chunk (``start_grad_sync()``).

    Use it when the whole schedule (all F, B and W ops) ran inside DDP's ``no_sync()``: leave
    ``no_sync``, call this, then ``finalize_model_grads`` / ``finish_grad_sync()`` as usual.
    Do not use it after the overlapped protocol (grad sync enabled before the last B), where
    DDP has already dispatched the buckets itself. Chunks without ``start_grad_sync`` (not
    wrapped in DDP) are skipped.
    """
    check_no_pending_wgrad(store, where)
    for chunk in model_chunks:
        fn = getattr(chunk, "start_grad_sync", None)
        if callable(fn):
            fn()


def check_no_pending_wgrad(store: WeightGradStore, where: str = "") -> None:
    """Raise :class:`LeftoverWeightGradError` if ``store`` still holds W work.

    The executor calls it before DP gradient reduction (``finalize_model_grads``) and before
    the optimizer step; ``where`` ("before optimizer step", ...) goes into the message.
    """
    store.assert_empty(where)


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
    from ..compat import bind_linear_call
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
            from ..compat import linear_output_gemm
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


# ------------------------------------------------------------------------------------------
# Transformer Engine
# ------------------------------------------------------------------------------------------

_TE_LINEAR_NAMES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")


def te_available() -> bool:
    """Whether Transformer Engine's PyTorch API can be imported in this process."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a CUDA/driver error on import
        return False
    return True


def _te_version() -> str:
    try:
        from importlib.metadata import version

        for dist in ("transformer-engine", "transformer_engine", "transformer-engine-cu12"):
            try:
                return version(dist)
            except Exception:
                continue
    except Exception:
        pass
    return "unknown"


def _is_te_class(cls: type) -> bool:
    return any(getattr(c, "__module__", "").startswith("transformer_engine") for c in cls.__mro__)


def _is_te_linear_class(cls: type) -> bool:
    return any(getattr(c, "__module__", "").startswith("transformer_engine")
               and c.__name__ in _TE_LINEAR_NAMES for c in cls.__mro__)


def is_te_wgrad_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a Transformer Engine module whose weight gradient TE can defer
    (it has ``backward_dw``), or a TE linear module (``Linear``, ``LayerNormLinear``,
    ``LayerNormMLP``, ``GroupedLinear``, or a subclass such as Megatron-Core's wrappers) of a
    version too old to do so. TE norms and other modules without weights are not."""
    cls = type(module)
    if not _is_te_class(cls):
        return False
    return callable(getattr(module, "backward_dw", None)) or _is_te_linear_class(cls)


def _te_delay_flag(ws) -> Optional[bool]:
    """TE WeightGradStore's enabled flag (None if unreadable)."""
    f = getattr(ws, "delay_wgrad_compute", None)
    if callable(f):
        return bool(f())
    if hasattr(ws, "enabled"):
        return bool(ws.enabled)
    return None


def _te_plan(module: torch.nn.Module, name: str) -> Optional[str]:
    """Decide how to handle one TE module inside the split.

    Returns None (leave it alone: nothing to defer), "use" (its weight gradient is already
    deferred by TE: record its backwards and call backward_dw() at W), or "enable" (TE can defer
    but is switched off: switch it on for the duration of the split). Raises
    TEWgradUnsupportedError for a TE linear module that cannot defer."""
    cls = type(module)
    linear = _is_te_linear_class(cls)
    how_to = ("Build the model with config.delay_wgrad_compute = True (Megatron-Core forwards it "
              "to TE; its TransformerConfig check ties the flag to "
              "overlap_moe_expert_parallel_comm, so set the attribute after creating the config "
              "and before building the model) and wrap it in DDP with "
              "DistributedDataParallelConfig(delay_wgrad_compute=True); or pass te=False to keep "
              "TE weight gradients in B.")
    if not callable(getattr(module, "backward_dw", None)):
        if linear:
            raise TEWgradUnsupportedError(
                f"Transformer Engine module {name} ({cls.__name__}) has no backward_dw(): TE "
                f"{_te_version()} cannot defer weight gradients. Upgrade to Transformer Engine "
                ">= 2.3 (delay_wgrad_compute) or use the local layer spec "
                "(get_gpt_layer_local_spec) for zero-bubble schedules.")
        return None
    cfg = getattr(module, "config", None)
    if cfg is not None and getattr(cfg, "delay_wgrad_compute", None) is False:
        # Megatron-Core's TE wrappers only forward backward_dw() when the config flag is set.
        if linear:
            raise TEWgradUnsupportedError(
                f"Transformer Engine module {name} ({cls.__name__}): config.delay_wgrad_compute "
                "is False, so Megatron-Core's wrapper ignores backward_dw(). " + how_to)
        return None
    need = getattr(module, "need_backward_dw", None)
    if callable(need) and need():
        return "use"
    ws = getattr(module, "wgrad_store", None)
    if ws is not None and getattr(ws, "context", None) is not None \
            and callable(getattr(ws, "enable_delay_wgrad_compute", None)):
        return "enable"
    if callable(need) and not linear:
        return None   # a TE module that does not defer and is not a linear layer
    raise TEWgradUnsupportedError(
        f"Transformer Engine module {name} ({cls.__name__}) was built without "
        "delay_wgrad_compute, so its backward computes the weight gradient at once. " + how_to)


def find_te_wgrad_modules(models: Union[torch.nn.Module, Iterable[torch.nn.Module]]
                          ) -> List[tuple]:
    """``[(name, module)]`` of the TE modules with deferrable weight gradients in ``models``."""
    if isinstance(models, torch.nn.Module):
        models = [models]
    out = []
    seen = set()
    for i, model in enumerate(models):
        for name, mod in model.named_modules():
            if id(mod) in seen or not is_te_wgrad_module(mod):
                continue
            seen.add(id(mod))
            out.append((f"chunk{i}.{name}" if name else f"chunk{i}", mod))
    return out


class _TEBackwardDW:
    """W of one backward of one TE module: ``module.backward_dw()``."""

    __slots__ = ("module", "name", "store")

    def __init__(self, module, name, store):
        self.module = module
        self.name = name
        self.store = store

    def __call__(self) -> None:
        self.store.stats["te"] += 1
        self.module.backward_dw()

    def __repr__(self) -> str:
        return f"<W te {self.name}>"


class _TEState:
    """Forward hooks on TE modules that record, per B, which modules need backward_dw()."""

    def __init__(self, store: WeightGradStore, modules: List[tuple]):
        self.store = store
        self.handles: list = []
        self.restore: list = []
        plans = [(name, mod, _te_plan(mod, name)) for name, mod in modules]  # validate all first
        for name, mod, plan in plans:
            if plan is None:
                continue
            if plan == "enable":
                mod.wgrad_store.enable_delay_wgrad_compute()
                self.restore.append(mod.wgrad_store)
            self.handles.append(mod.register_forward_hook(self._make_hook(name)))

    def _make_hook(self, name: str):
        store = self.store

        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return None
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(_te_grad_hook(module, name, store))
                    break
            return None

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for ws in reversed(self.restore):
            ws.disable_delay_wgrad_compute()
        self.restore.clear()


def _te_grad_hook(module, name, store):
    def hook(grad):
        work = _TEBackwardDW(module, name, store)
        if store.collecting:
            store.put(work)
        elif store.require_key:
            store.put(work)  # raises with the explanation
        else:
            # No B key: finish this module's W at the end of the running backward (its wgrad
            # is queued by TE only after this hook returns).
            store.stats["immediate"] += 1
            torch.autograd.Variable._execution_engine.queue_callback(work)
        return None

    return hook


# ------------------------------------------------------------------------------------------
# The context manager
# ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def split_weight_grads(store: WeightGradStore,
                       models: Union[None, torch.nn.Module, Sequence[torch.nn.Module]] = None,
                       *, sp_gather: str = "w", te: Union[str, bool] = "auto"
                       ) -> Iterator[WeightGradStore]:
    """Split the backward of linear layers into B (now) and W (queued in ``store``).

    Args:
        store: where W work is queued (see :class:`WeightGradStore` for the protocol).
        models: the model chunks this split applies to (a module or a list). None: every
            Megatron-Core ColumnParallelLinear / RowParallelLinear in the process (TE modules
            are then not handled). Given: only the local linear layers inside them, and the
            TE modules inside them are switched to TE's ``backward_dw`` path.
        sp_gather: ``"w"`` (re-gather the sequence-parallel input at W; keeps 1/tp of it) or
            ``"b"`` (gather in B, keep the gathered input until W; no collective in W).
        te: ``"auto"`` (handle TE modules when Transformer Engine is importable and ``models``
            is given), True (always scan ``models`` for TE modules), False (never: TE modules
            then compute their weight gradients in B as configured).

    The patch is process-wide but scoped: on exit (normal or exception) the layer classes
    and TE modules are restored; W work still queued stays in ``store`` (run it, or it will be
    reported by :func:`check_no_pending_wgrad`). Not re-entrant.
    """
    global _STATE
    if sp_gather not in ("w", "b"):
        raise ValueError(f"sp_gather must be 'w' or 'b', not {sp_gather!r}")
    if te not in ("auto", True, False):
        raise ValueError(f"te must be 'auto', True or False, not {te!r}")
    if _STATE is not None:
        raise RuntimeError("split_weight_grads is already active (it is not re-entrant)")
    if isinstance(models, torch.nn.Module):
        models = [models]
    module_ids = None
    names: Dict[int, str] = {}
    local_mods: list = []
    if models is not None:
        models = list(models)
        local = tuple(_local_linear_classes())
        module_ids = set()
        for i, model in enumerate(models):
            for name, mod in model.named_modules():
                if isinstance(mod, local):
                    module_ids.add(id(mod))
                    local_mods.append(mod)
                    names[id(mod)] = f"chunk{i}.{name}" if name else f"chunk{i}"
    if te is True and models is None:
        raise ValueError("te=True needs the model chunks (models=...) to find the TE modules")
    use_te = (te is True) or (te == "auto" and models is not None and te_available())
    te_state = None
    if use_te and models is not None:
        te_state = _TEState(store, find_te_wgrad_modules(models))
    state = _SplitState(store, module_ids, sp_gather)
    state.names = names
    try:
        _install_local_patch()
        hook = _count_forward(state)
        state.hooks = [m.register_forward_pre_hook(hook) for m in local_mods]
    except BaseException:
        _remove_local_patch()
        for h in state.hooks:
            h.remove()
        if te_state is not None:
            te_state.close()
        raise
    _STATE = state
    try:
        yield store
    finally:
        _STATE = None
        _remove_local_patch()
        for h in state.hooks:
            h.remove()
        if te_state is not None:
            te_state.close()
