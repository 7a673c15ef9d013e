"""B/W split of the backward pass: input gradients now (B), weight gradients later (W).

Zero-bubble schedules split the backward of every linear layer ``y = x Aᵀ`` into
``dx = dy·A`` (B, on the critical path between pipeline stages) and ``dA = dyᵀ·x`` (W, which
can wait and fill bubbles). This package provides that split for stock Megatron-Core, without
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


The package, by concern: :mod:`.store` (the W queue and the guards), :mod:`.linear` (Megatron-Core's
linear layers: the patch, what W computes and delivers, sequence parallelism), :mod:`.te`
(Transformer Engine's own split interface; unverified without CUDA), :mod:`.split` (the scoped
context that turns it on for one iteration).

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

"""

from __future__ import annotations

from .linear import SplitInactiveError, check_split_active, split_active
from .split import split_weight_grads
from .store import (LeftoverWeightGradError, WeightGradStore, check_no_pending_wgrad, format_key,
                    start_grad_sync_after_w)
from .te import TEWgradUnsupportedError, find_te_wgrad_modules, is_te_wgrad_module, te_available

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
