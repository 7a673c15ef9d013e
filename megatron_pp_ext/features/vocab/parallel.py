"""Vocabulary-parallel layers across ranks: process groups, asynchronous reduction channels and
the per-microbatch passes that the schedule's vocabulary ops run.

One :class:`VocabParallel` per rank owns shard ``pp_rank * tp + tp_rank`` of the output layer
(and of the input embedding; one tensor when tied) and runs, per microbatch ``m``:

* ``hand_off(m, x, labels, g)`` (last-stage ranks, inside F of the last stage): starts the
  broadcast of the final-norm output x, the targets and g (the gradient of the loss with
  respect to each token's loss) to the ranks of its pipeline line;
* ``s_pass(m)`` (every rank): waits for x, computes the shard's statistics (and Algorithm 2's
  A_i, B_i), and launches the reduction: an all-gather of the statistics over all pp*tp ranks,
  then (Algorithm 2, training) the all-reduce of the input-gradient terms;
* ``t_pass(m)`` (every rank, training): waits for the reduced statistics, accumulates the
  shard's weight gradient and (Algorithm 1) launches the all-reduce of the partial input
  gradient;
* ``loss(m)`` (last-stage ranks): the per-token loss as a differentiable function of x whose
  backward returns the reduced input gradient times the gradient autograd hands it;
* ``emb_forward(m)`` / ``emb_input(m)`` / ``embedding_output(ids)`` / ``emb_backward(m)``: the
  input embedding: partial lookups summed into the first stage (reduce over the pipeline line,
  then all-reduce over the first stage's tensor-parallel ranks), the gradient of the first
  stage broadcast back and added into each shard.

Reductions run on dedicated process groups, one per *channel* (x broadcast, statistics, input
gradient, embedding sum, embedding gradient), so that the collectives of a channel are issued
in microbatch order on every rank whatever the interleaving of the passes. Each channel is
asynchronous: a thread of the channel runs its collectives one after another (waiting for each
on the host, never with a stream wait; on a GPU inside the channel's own CUDA stream) while the
main thread computes (:mod:`.channels` says why). Every rank hands all the broadcasts of an
iteration to their channel when it begins (a broadcast is a tree or a ring: a receiver gets
microbatch m's data only once every receiver has posted m).

**One-queue mode** (``VocabParallelConfig(one_queue=True)``, what one hardware queue needs:
``CUDA_DEVICE_MAX_CONNECTIONS=1``): no channel threads and nothing posted ahead. Each pass
leaves what it produced for its collective; the schedule's proved post points
(``meta["vocab_posts"]``, :func:`~.one_queue.hook_points`, taken by :meth:`VocabParallel.set_posts`)
are run by the executor's op hook (:meth:`VocabParallel.op_hook`): the main thread issues each
collective there with ``async_op=True`` on group m mod k of its channel (Algorithm 2's all-reduce
on the ``dx`` groups), and waits for it where the schedule says, before the op that reads it
(on a GPU ``work.wait()``, a stream wait; on CPU the host blocks): x before VS, the statistics
before the first of VT / VLOSS, Algorithm 2's all-reduce or Algorithm 1's before B(L, m) (in the
loss's backward), the embedding sum before VEIN, the embedding gradient before VEB. A consumer
whose wait was not at a hook point waits when it reads; a collective nobody on this rank reads
(a send) is waited for on the host at :meth:`VocabParallel.end_iteration`.

The grid and its groups are :mod:`.groups`, the channels :mod:`.channels`, the shard parameters
:mod:`.shards`; this module is the engine that runs the passes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from . import kernels as K
from .channels import Channel, Pending, wait_host
from .config import VocabConfigError, VocabParallelConfig, VocabPartition
from .groups import VocabGroups
from .shards import VocabShards, accumulate_grad

__all__ = ["VocabGroups", "Channel", "VocabShards", "VocabParallel", "accumulate_grad"]


# --- the engine -------------------------------------------------------------------------------

@dataclass
class _MB:
    """Per-microbatch state on this rank."""

    x: torch.Tensor | None = None          # last stage: x with its graph (for loss)
    x_local: torch.Tensor | None = None    # [n, h] detached x used by the S pass
    g: torch.Tensor | None = None          # [n] fp32
    target: torch.Tensor | None = None     # [n] long
    x_wait: Pending | None = None          # receive of the x broadcast
    s: K.SState | None = None
    stats_wait: Pending | None = None      # -> (Combined, Alg. 2 input-gradient factor or None)
    combined: K.Combined | None = None
    dfactor: torch.Tensor | None = None    # reduced input gradient per unit of g [n, h] fp32
    dx_wait: Pending | None = None         # Alg. 1
    emb_wait: Pending | None = None
    emb_ready: torch.Tensor | None = None
    embgrad_wait: Pending | None = None
    backward_pending: bool = False
    m: int = -1
    done: set = field(default_factory=set)


@dataclass
class _Posted:
    """One-queue mode: a collective the main thread issued (``work``: its handle, None when
    nothing is exchanged), its buffer and what turns the buffer into the result."""

    work: object
    value: object
    finish: Callable | None
    sink: bool = False        # nobody on this rank reads it (a send): waited for at the end
    waited: bool = False
    result: object = None


class _LossFn(torch.autograd.Function):
    """Per-token loss [b, s] as a function of x [s, b, h]; backward: g * reduced dX factor."""

    @staticmethod
    def forward(ctx, x, values, engine, m):
        ctx.engine, ctx.m = engine, m
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        eng: VocabParallel = ctx.engine
        s, b, h = ctx.shape
        g = grad.t().reshape(-1).float()
        factor = eng._input_grad_factor(ctx.m, g)
        dx = (factor * g.unsqueeze(1)).view(s, b, h).to(ctx.dtype)
        return dx, None, None, None


class VocabParallel:
    """The vocabulary-parallel output layer, cross entropy and input embedding of this rank.

    Args:
        config: :class:`VocabParallelConfig` (algorithm, label smoothing, input embedding).
        vocab_size, hidden_size: of the model (the vocabulary is padded to a multiple of pp*tp).
        groups: :class:`VocabGroups` (``VocabGroups.from_parallel_state()`` inside Megatron).
        tied: one tensor for the input embedding and the output layer.
        dtype, device: of the shard parameters (and of the matmuls).
    """

    def __init__(self, config: VocabParallelConfig, vocab_size: int, hidden_size: int, groups: VocabGroups, *,
                 tied: bool = False, dtype: torch.dtype = torch.float32, device=None):
        self.config = config
        self.groups = groups
        self.part = VocabPartition(vocab_size, groups.size, groups.shard)
        self.vocab_size = vocab_size
        self.hidden = hidden_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.shards = VocabShards(self.part, hidden_size, tied=tied, input_embedding=config.input_embedding,
                                  dtype=dtype, device=self.device)
        #: one-queue mode (``config.one_queue``): no channel threads; the main thread issues each
        #: collective at the schedule's post points (:meth:`set_posts`, :meth:`op_hook`)
        self.one_queue = bool(config.one_queue)
        self.channels = ({} if self.one_queue else
                         {name: Channel(name, self.device) for name in ("x", "stats", "dx", "emb", "embgrad")})
        self._points: dict = {}                  # one-queue: (phase, op) -> [(post|wait, channel, m)]
        self._works: dict = {}                   # one-queue: (channel, m) -> _Posted
        self._ready: dict = {}                   # one-queue: (channel, m) -> what its post sends
        self._points_cache: dict = {}
        self._mb: dict[int, _MB] = {}
        self._m = 0
        self._shape: tuple[int, int] | None = None      # (micro batch, sequence)
        self._tokens: Callable[[int], torch.Tensor] | None = None
        self.forward_only = False
        self._next_final = 0      # next microbatch handed off by the last stage's F (FIFO)
        self._next_emb_out = 0    # next microbatch read by the first stage's embedding
        self._x_posted = 0
        self._embgrad_posted = 0
        self._pending_backward: dict[int, _MB] = {}
        self.wait_time = 0.0                    # seconds the passes spent waiting for reductions
        self._labels: list = []                 # stashed by the last stage's forward (model surgery)
        self._deferred: dict = {}               # m -> what finishing the loss needs (executor hook)
        self._outstanding: list[Pending] = []   # sends nobody on this rank waits for
        self.iterations = 0

    # -- iteration -------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.shards.output_weight.dtype

    def begin_iteration(self, num_microbatches: int, micro_batch_size: int, seq_length: int, *,
                        tokens: Sequence[torch.Tensor] | Callable[[int], torch.Tensor] | None = None,
                        forward_only: bool = False) -> None:
        """Start an iteration of ``num_microbatches``; ``tokens``: the input ids [b, s] of each
        microbatch (a list or a function of the microbatch index), needed on every rank for the
        vocabulary-parallel input embedding."""
        self._labels.clear()
        self._deferred.clear()
        if self._mb:
            left = sorted(self._mb)
            raise RuntimeError(f"vocabulary parallel: microbatches {left[:8]} of the previous iteration were "
                               "not finished (missing ops in the schedule?)")
        if self.config.input_embedding and tokens is None:
            raise VocabConfigError("the vocabulary-parallel input embedding needs the input ids of every "
                                   "microbatch on every rank (begin_iteration(tokens=...)); load the batch on all "
                                   "ranks, or pass --no-vocab-parallel-input-embedding")
        self._m = int(num_microbatches)
        self._shape = (int(micro_batch_size), int(seq_length))
        self._tokens = (tokens if callable(tokens) or tokens is None else (lambda i, _t=list(tokens): _t[i]))
        self.forward_only = bool(forward_only)
        self._next_final = self._next_emb_out = 0
        self._x_posted = self._embgrad_posted = 0
        self._mb = {m: _MB(m=m) for m in range(self._m)}
        # Every rank joins every broadcast of the iteration now: a broadcast is a tree (gloo) or
        # a ring (NCCL), so a receiver gets microbatch m's data only once *all* receivers have
        # posted m; posting late would make one rank's S pass wait for another rank's progress.
        if self.one_queue:
            self._works.clear()
            self._ready.clear()
            return
        for _ in range(self._m):
            self._post_x()
            if self.config.input_embedding and not forward_only:
                self._post_embgrad()

    def end_iteration(self) -> None:
        """Wait for this rank's outstanding sends; check that every microbatch went through
        every pass this rank owes."""
        for p in self._outstanding:
            p.wait()
        self._outstanding.clear()
        if self.one_queue:
            self._oq_end()
        if self._pending_backward:
            raise RuntimeError(f"vocabulary parallel: the losses of microbatches {sorted(self._pending_backward)[:8]} "
                               "were computed but never back-propagated")
        if self._mb:
            raise RuntimeError(f"vocabulary parallel: microbatches {sorted(self._mb)[:8]} not finished on rank "
                               f"{dist.get_rank()} (passes done for microbatch {min(self._mb)}: "
                               f"{sorted(self._mb[min(self._mb)].done)})")
        self.iterations += 1

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def _wait(self, pending: Pending):
        t0 = time.perf_counter()
        try:
            return pending.wait()
        finally:
            self.wait_time += time.perf_counter() - t0

    # -- one-queue mode: the main thread issues the collectives at the schedule's points ------
    def set_posts(self, sched) -> None:
        """One-queue mode: take this iteration's post and wait points from ``sched`` (a schedule
        built with ``VocabParallelConfig(one_queue=True)``: ``meta["vocab_posts"]``); the
        executor's op hook then calls :meth:`op_hook` around every op."""
        if not self.one_queue:
            return
        key = id(sched)
        cached = self._points_cache.get(key)
        if cached is None or cached[0] is not sched:
            from .one_queue import hook_points
            r = self.groups.pp_rank
            ops = sched.ops[r]
            pts = {(phase, ops[i]): list(items) for (phase, i), items in hook_points(sched)[r].items()}
            cached = self._points_cache[key] = (sched, pts)
        self._points = cached[1]

    def op_hook(self, op, phase: str) -> None:
        """The executor's ``op_hook`` in one-queue mode: the posts and waits of the schedule at
        ``(phase, op)`` ("before": after the op's receive waits; "after")."""
        items = self._points.get((phase, op))
        if not items:
            return
        for what, ch, m in items:
            if what == "post":
                self._oq_post(ch, m)
            else:
                self._oq_wait(ch, m)

    def _oq_trivial(self, ch: str) -> bool:
        g = self.groups
        return g.size == 1 if ch in ("stats", "stats2", "dx") else g.pp == 1

    def _oq_post(self, ch: str, m: int) -> None:
        """Issue collective ``(ch, m)`` with ``async_op=True`` on its communicator (group m mod k)."""
        key = (ch, m)
        if key in self._works:
            raise RuntimeError(f"vocabulary parallel (one queue): {ch} of microbatch {m} posted twice")
        g = self.groups
        work, value, finish, sink = None, None, None, False
        if ch == "stats2" and key not in self._ready and ("stats", m) in self._works:
            self._oq_wait("stats", m)   # (the schedule posts it after the stats wait)
        if ch == "x":
            sink = g.is_last
            if g.is_last:
                value = self._take_ready(key)
            else:
                nl, ng, nx = self._payload_sizes()
                value = torch.empty(nl + ng + nx, dtype=torch.uint8, device=self.device)
                finish = self._unpack
            if not self._oq_trivial(ch):
                work = dist.broadcast(value, src=g.last_rank, group=g.comm("x", m), async_op=True)
        elif ch == "stats":
            stats, sstate = self._take_ready(key)
            P, order = g.size, g.order
            parts = [torch.empty_like(stats) for _ in range(P)] if P > 1 else [stats]
            if P > 1:
                work = dist.all_gather(parts, stats, group=g.comm("stats", m), async_op=True)
            cfg = self.config
            V, ls, shard = self.vocab_size, cfg.label_smoothing, self.part.shard

            def finish(parts, _m=m, _sstate=sstate):
                gathered = torch.empty(P, *parts[0].shape, dtype=parts[0].dtype, device=parts[0].device)
                for j, t in enumerate(parts):
                    gathered[order[j] if P > 1 else 0] = t
                comb = K.combine(gathered, V, ls)
                if _sstate is not None:   # Alg. 2 (training): the input-gradient terms, all-reduced by stats2
                    self._ready[("stats2", _m)] = K.alg2_term(_sstate, comb, shard, V, ls)
                return comb
            value = parts
            sink = self.forward_only and not g.is_last
        elif ch in ("stats2", "dx"):
            value = self._take_ready(key)
            if not self._oq_trivial(ch):
                work = dist.all_reduce(value, group=g.comm("dx", m), async_op=True)
            sink = not g.is_last
        elif ch == "emb":
            value = self._take_ready(key)
            if g.pp > 1:
                work = dist.reduce(value, dst=g.first_rank, group=g.comm("emb", m), async_op=True)
            if g.is_first:
                tp_grp, tp = g.emb_tp, g.tp

                def finish(partial):
                    if tp > 1:   # every tensor rank of the first stage is here (the same op list)
                        dist.all_reduce(partial, group=tp_grp)
                    return partial
            sink = not g.is_first
        elif ch == "embgrad":
            sink = g.is_first
            if g.is_first:
                value = self._take_ready(key)
            else:
                b, s = self._shape
                value = torch.empty((b, s, self.hidden), dtype=self.dtype, device=self.device)
            if not self._oq_trivial(ch):
                work = dist.broadcast(value, src=g.first_rank, group=g.comm("embgrad", m), async_op=True)
        else:
            raise RuntimeError(f"vocabulary parallel (one queue): unknown channel {ch!r}")
        self._release_sent()
        self._works[key] = _Posted(work, value, finish, sink)

    def _release_sent(self) -> None:
        """Drop the buffers of the ended collectives nobody on this rank reads (the last stage's x
        payloads: one [n, h] each), as the channel threads do once a job ran; the others are
        waited for at the end of the iteration."""
        for w in self._works.values():
            if w.sink and not w.waited and (w.work is None or w.work.is_completed()):
                w.waited = True
                w.work = w.value = w.finish = None

    def _take_ready(self, key):
        try:
            return self._ready.pop(key)
        except KeyError:
            raise RuntimeError(f"vocabulary parallel (one queue): rank {dist.get_rank()} posts {key[0]} of microbatch "
                               f"{key[1]} before the pass that makes it ran (post points of the schedule)") from None

    def _oq_wait(self, ch: str, m: int):
        """Wait for collective ``(ch, m)`` where the model reads it (on a GPU a stream wait:
        ``work.wait()``); returns its result (once)."""
        key = (ch, m)
        w = self._works.get(key)
        if w is None:
            if self._oq_trivial(ch) and key in self._ready:   # nothing to exchange: post it now
                self._oq_post(ch, m)
                w = self._works[key]
            else:
                raise RuntimeError(f"vocabulary parallel (one queue): rank {dist.get_rank()} waits for {ch} of "
                                   f"microbatch {m}, which it has not posted (post points of the schedule)")
        if not w.waited:
            t0 = time.perf_counter()
            try:
                if w.work is not None:
                    w.work.wait()
                w.result = w.finish(w.value) if w.finish is not None else w.value
            finally:
                self.wait_time += time.perf_counter() - t0
            w.waited = True
            w.work = w.value = w.finish = None
        return w.result

    def _oq_end(self) -> None:
        """End of an iteration: every collective posted, the ones nobody here reads ended."""
        for w in self._works.values():
            if not w.waited and w.work is not None:
                wait_host(w.work)
        self._works.clear()
        if self._ready:
            left = sorted(self._ready, key=lambda k: (k[1], k[0]))
            self._ready.clear()
            raise RuntimeError(f"vocabulary parallel (one queue): {left[0][0]} of microbatch {left[0][1]} (and "
                               f"{len(left) - 1} more) made but never posted (post points of the schedule)")

    def _state(self, m: int) -> _MB:
        st = self._mb.get(m)
        if st is None:
            raise RuntimeError(f"vocabulary parallel: microbatch {m} is not in flight (begin_iteration not called, "
                               "or its passes already finished)")
        return st

    def _owed(self) -> set:
        owed = {"s"}
        if not self.forward_only:
            owed.add("t")
        g = self.groups
        if g.is_last:
            owed.add("loss")
        if self.config.input_embedding:
            owed.add("emb_f")
            if g.is_first:
                owed.add("emb_in")
            if not self.forward_only:
                owed.add("emb_b")
        return owed

    def _finish(self, m: int, what: str) -> None:
        st = self._mb[m]
        if what in st.done:
            raise RuntimeError(f"vocabulary parallel: pass {what!r} of microbatch {m} ran twice")
        st.done.add(what)
        if st.done >= self._owed():
            del self._mb[m]

    @property
    def n(self) -> int:
        b, s = self._shape
        return b * s

    # -- output layer: last stage hand-off --------------------------------------------------
    def _payload_sizes(self) -> tuple[int, int, int]:
        n = self.n
        esize = torch.empty((), dtype=self.dtype).element_size()
        return 8 * n, 4 * n, n * self.hidden * esize

    def _post_x(self) -> None:
        """Post the receive of the next x broadcast (ranks that are not the last stage)."""
        m = self._x_posted
        if m >= self._m:
            return
        self._x_posted += 1
        g = self.groups
        if g.is_last or g.pp == 1:
            return
        nl, ng, nx = self._payload_sizes()
        src, grp, dev = g.last_rank, g.x, self.device

        def job():   # the buffer is allocated when the broadcast starts (CPU: on the channel thread)
            buf = torch.empty(nl + ng + nx, dtype=torch.uint8, device=dev)
            wait_host(dist.broadcast(buf, src=src, group=grp, async_op=True))
            return buf

        self._state(m).x_wait = self.channels["x"].submit(job)

    def _unpack(self, buf: torch.Tensor):
        nl, ng, nx = self._payload_sizes()
        b, s = self._shape
        target = buf[:nl].view(torch.int64)
        g = buf[nl:nl + ng].view(torch.float32)
        x = buf[nl + ng:].view(self.dtype).view(s * b, self.hidden)
        return x, g, target

    def hand_off(self, m: int | None, x: torch.Tensor, labels: torch.Tensor, g: torch.Tensor | None) -> int:
        """Last stage: the final-norm output ``x`` [s, b, h] (with its graph), the targets
        ``labels`` [b, s] and ``g`` [b, s] (d loss / d per-token loss; None for forward only) of
        microbatch ``m`` (None: the next one). Starts the broadcast; returns m."""
        g_ = self.groups
        if not g_.is_last:
            raise RuntimeError("hand_off runs on the last pipeline stage only")
        if m is None:
            m = self._next_final
        if m != self._next_final:
            raise RuntimeError(f"vocabulary parallel: the last stage handed off microbatch {m}, expected "
                               f"{self._next_final} (forward ops of the last stage must run in microbatch order)")
        self._next_final += 1
        st = self._state(m)
        s, b, h = x.shape
        if (b, s) != self._shape or h != self.hidden:
            raise RuntimeError(f"vocabulary parallel: final hidden state of shape {tuple(x.shape)}, expected "
                               f"[{self._shape[1]}, {self._shape[0]}, {self.hidden}] (the whole sequence: under sequence parallelism the output-layer stub gathers it)")
        if labels is None:
            raise VocabConfigError("vocabulary parallelism computes the loss itself: the last stage's forward "
                                   "must be given labels (it cannot return logits)")
        st.x = x
        xd = x.detach().reshape(s * b, h)
        if xd.dtype != self.dtype:
            xd = xd.to(self.dtype)
        target = labels.detach().t().reshape(-1).to(torch.int64)
        gg = (torch.zeros(s * b, dtype=torch.float32, device=xd.device) if g is None
              else g.detach().t().reshape(-1).float())
        st.x_local, st.g, st.target = xd, gg, target
        if g_.pp > 1:
            nl, ng, nx = self._payload_sizes()
            payload = torch.empty(nl + ng + nx, dtype=torch.uint8, device=xd.device)
            payload[:nl].view(torch.int64).copy_(target)
            payload[nl:nl + ng].view(torch.float32).copy_(gg)
            payload[nl + ng:].view(self.dtype).view(s * b, h).copy_(xd)
            if self.one_queue:   # broadcast by the post after F(L, m) (op_hook)
                self._ready[("x", m)] = payload
                return m
            src, grp = g_.last_rank, g_.x

            def job(payload):
                wait_host(dist.broadcast(payload, src=src, group=grp, async_op=True))

            self._outstanding.append(self.channels["x"].submit(job, payload))
        return m

    def stash_labels(self, labels) -> None:
        """Last stage, inside the model's forward: keep the labels for the hand-off."""
        self._labels.append(labels)

    def take_labels(self):
        if not self._labels:
            raise VocabConfigError("vocabulary parallelism computes the loss itself: the last stage's forward must "
                                   "be given labels (it cannot return logits)")
        return self._labels.pop(0)

    def defer(self, m: int, what) -> None:
        self._deferred[m] = what

    def take_deferred(self, m: int):
        try:
            return self._deferred.pop(m)
        except KeyError:
            raise RuntimeError(f"vocabulary parallel: VLOSS of microbatch {m} before the last stage's forward") from None

    # -- S pass ---------------------------------------------------------------------------
    def s_pass(self, m: int) -> None:
        st = self._state(m)
        if st.x_local is None:
            if st.x_wait is None and not self.one_queue:
                raise RuntimeError(f"vocabulary parallel: S pass of microbatch {m} before its x was posted")
            if self.one_queue:
                st.x_local, st.g, st.target = self._oq_wait("x", m)
            else:
                st.x_local, st.g, st.target = self._unpack(self._wait(st.x_wait))
            st.x_wait = None
        cfg = self.config
        w = self.shards.output_weight.detach()
        keep = not self.forward_only
        with torch.no_grad():
            st.s = K.s_pass(st.x_local, w, st.target, self.part, algorithm=cfg.algorithm,
                            label_smoothing=cfg.label_smoothing, keep=keep)
        stats, sstate = st.s.stats, st.s
        if self.one_queue:   # gathered by the post after VS(m) (op_hook)
            self._ready[("stats", m)] = (stats, sstate if (cfg.algorithm == 2 and keep) else None)
            st.stats_wait = True
            if not keep:
                st.s = None
            self._finish(m, "s")
            return
        grp, order, P, shard = self.groups.stats, self.groups.order, self.groups.size, self.part.shard
        V, ls, alg2 = self.vocab_size, cfg.label_smoothing, (cfg.algorithm == 2 and keep)

        def job(stats, sstate):
            parts = [torch.empty_like(stats) for _ in range(P)]
            if P > 1:
                wait_host(dist.all_gather(parts, stats, group=grp, async_op=True))
                gathered = torch.empty(P, *stats.shape, dtype=stats.dtype, device=stats.device)
                for j, t in enumerate(parts):
                    gathered[order[j]] = t
            else:
                gathered = stats.unsqueeze(0)
            comb = K.combine(gathered, V, ls)
            factor = None
            if alg2:
                factor = K.alg2_term(sstate, comb, shard, V, ls)
                if P > 1:
                    wait_host(dist.all_reduce(factor, group=grp, async_op=True))
            return comb, factor

        st.stats_wait = self.channels["stats"].submit(job, stats, sstate)
        if not keep:
            st.s = None
        self._finish(m, "s")

    def _combined(self, st: _MB) -> K.Combined:
        if st.combined is None and self.one_queue:
            st.combined = self._oq_wait("stats", st.m)
            if st.s is not None:
                st.s.a = st.s.b = st.s.c = None
        if st.combined is None:
            st.combined, factor = self._wait(st.stats_wait)
            if factor is not None:
                st.dfactor = factor
            if st.s is not None:  # Alg. 2's A_i, B_i are folded into the reduction now
                st.s.a = st.s.b = st.s.c = None
        return st.combined

    # -- T pass ---------------------------------------------------------------------------
    def t_pass(self, m: int) -> None:
        st = self._state(m)
        if st.s is None:
            raise RuntimeError(f"vocabulary parallel: T pass of microbatch {m} before its S pass")
        comb = self._combined(st)
        cfg = self.config
        w = self.shards.output_weight.detach()
        with torch.no_grad():
            dw, dx = K.t_pass(st.s, comb, st.g, self.part.shard, self.part, w, algorithm=cfg.algorithm,
                              label_smoothing=cfg.label_smoothing)
        accumulate_grad(self.shards.output_weight, dw)
        if cfg.algorithm == 1:
            if self.one_queue:   # all-reduced by the post after VT(m) (op_hook)
                self._ready[("dx", m)] = dx
            elif self.groups.size > 1:
                grp = self.groups.dx

                def job(dx):
                    wait_host(dist.all_reduce(dx, group=grp, async_op=True))
                    return dx

                st.dx_wait = self.channels["dx"].submit(job, dx)
            else:
                st.dfactor = dx
        st.s = None
        self._finish(m, "t")

    # -- loss (last stage) -----------------------------------------------------------------
    def loss(self, m: int) -> torch.Tensor:
        """The per-token loss [b, s] of microbatch ``m`` (last stage), differentiable in the x
        handed off (its backward returns the reduced input gradient)."""
        if not self.groups.is_last:
            raise RuntimeError("the vocabulary-parallel loss lives on the last pipeline stage")
        st = self._state(m)
        if st.stats_wait is None:
            raise RuntimeError(f"vocabulary parallel: loss of microbatch {m} before its S pass")
        comb = self._combined(st)
        b, s = self._shape
        values = comb.loss.view(s, b).t()
        x = st.x
        st.x = None
        if x is not None and x.requires_grad and torch.is_grad_enabled() and not self.forward_only:
            out = _LossFn.apply(x, values, self, m)
            st.backward_pending = True
            self._pending_backward[m] = st   # kept until the backward consumed its input gradient
        else:
            out = values.clone()
        self._finish(m, "loss")
        return out

    def _input_grad_factor(self, m: int, g: torch.Tensor) -> torch.Tensor:
        st = self._pending_backward.pop(m, None)
        if st is None:
            raise RuntimeError(f"vocabulary parallel: backward of microbatch {m}'s loss ran twice or "
                               "without its loss")
        if st.g is not None and not torch.allclose(g, st.g, rtol=1e-5, atol=1e-12):
            raise RuntimeError(
                f"vocabulary parallel: the gradient reaching the per-token losses of microbatch {m} differs from "
                "the one the weight gradients were computed with (the loss function must be linear in the "
                "per-token losses, as Megatron's are: sum(loss * mask) / ...); max difference "
                f"{(g - st.g).abs().max().item():.3e}")
        if self.one_queue and st.dfactor is None:
            st.dfactor = self._oq_wait("dx" if self.config.algorithm == 1 else "stats2", m)
        if self.config.algorithm == 1 and st.dfactor is None:
            if st.dx_wait is None:
                raise RuntimeError(f"vocabulary parallel: backward of microbatch {m}'s loss before its T pass "
                                   "(Algorithm 1 needs every rank's T pass first)")
            st.dfactor = self._wait(st.dx_wait)
        factor = st.dfactor
        if factor is None:
            raise RuntimeError(f"vocabulary parallel: no input gradient for microbatch {m}")
        st.dfactor = st.dx_wait = None
        st.backward_pending = False
        return factor

    # -- input embedding --------------------------------------------------------------------
    def _tokens_of(self, m: int) -> torch.Tensor:
        t = self._tokens(m)
        if tuple(t.shape) != self._shape:
            raise RuntimeError(f"vocabulary parallel: input ids of microbatch {m} have shape {tuple(t.shape)}, "
                               f"expected {self._shape}")
        return t.to(self.device)

    def emb_forward(self, m: int) -> None:
        st = self._state(m)
        w = self.shards.input_weight.detach()
        with torch.no_grad():
            partial = K.embedding_partial(self._tokens_of(m), w, self.part)
        g = self.groups
        if g.pp == 1 and g.tp == 1:
            st.emb_wait = Pending.of(partial)
        elif self.one_queue:   # reduced by the post after VEF(m) (op_hook)
            self._ready[("emb", m)] = partial
            st.emb_wait = True
        else:
            dst, grp, tp_grp, first, tp = g.first_rank, g.emb, g.emb_tp, g.is_first, g.tp

            def job(partial):
                if g.pp > 1:
                    wait_host(dist.reduce(partial, dst=dst, group=grp, async_op=True))
                if first and tp > 1:
                    wait_host(dist.all_reduce(partial, group=tp_grp, async_op=True))
                return partial if first else None

            pending = self.channels["emb"].submit(job, partial)
            if g.is_first:
                st.emb_wait = pending
            else:
                self._outstanding.append(pending)
        self._finish(m, "emb_f")

    def emb_input(self, m: int) -> None:
        """First stage: wait for the summed embedding of microbatch ``m`` (before its F)."""
        st = self._state(m)
        if st.emb_wait is None:
            raise RuntimeError(f"vocabulary parallel: embedding of microbatch {m} requested before its partial "
                               "lookup (EMB_F) ran on this rank")
        st.emb_ready = self._oq_wait("emb", m) if st.emb_wait is True else self._wait(st.emb_wait)
        st.emb_wait = None
        self._finish(m, "emb_in")

    def embedding_output(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the first stage's word embedding returns: the summed lookup [b, s, h] of the next
        microbatch (checked against ``input_ids``), wired so that its gradient is broadcast."""
        m = self._next_emb_out
        st = self._mb.get(m)
        if st is None or st.emb_ready is None:
            raise RuntimeError(f"vocabulary parallel: the first stage's forward of microbatch {m} ran before its "
                               "embedding was reduced (EMB_IN must come before F(0, m))")
        self._next_emb_out += 1
        if not torch.equal(input_ids.to(self.device), self._tokens_of(m)):
            raise RuntimeError(f"vocabulary parallel: the first stage read other input ids than the ones given for "
                               f"microbatch {m} (begin_iteration(tokens=...) must match the data iterator)")
        emb, st.emb_ready = st.emb_ready, None
        if self.forward_only or not torch.is_grad_enabled():
            return emb
        leaf = emb.detach().requires_grad_(True)
        return _GradTap.apply(leaf, self, m)

    def _on_embedding_grad(self, m: int, grad: torch.Tensor) -> None:
        """First stage, inside the backward of F(0, m): broadcast the embedding gradient."""
        st = self._mb.get(m)
        if st is None:
            raise RuntimeError(f"vocabulary parallel: embedding gradient of microbatch {m} after it finished")
        grad = grad.detach().contiguous()
        g = self.groups
        if g.pp > 1 and self.one_queue:   # broadcast by the post after B(0, m) (op_hook)
            self._ready[("embgrad", m)] = grad
        elif g.pp > 1:
            src, grp = g.first_rank, g.embgrad

            def job(grad):
                wait_host(dist.broadcast(grad, src=src, group=grp, async_op=True))
                return grad

            self._outstanding.append(self.channels["embgrad"].submit(job, grad))
        st.embgrad_wait = Pending.of(grad)

    def _post_embgrad(self) -> None:
        m = self._embgrad_posted
        if m >= self._m:
            return
        self._embgrad_posted += 1
        g = self.groups
        if g.is_first or g.pp == 1:
            return
        b, s = self._shape
        shape, dtype, dev = (b, s, self.hidden), self.dtype, self.device
        src, grp = g.first_rank, g.embgrad

        def job():
            buf = torch.empty(shape, dtype=dtype, device=dev)
            wait_host(dist.broadcast(buf, src=src, group=grp, async_op=True))
            return buf

        self._state(m).embgrad_wait = self.channels["embgrad"].submit(job)

    def emb_backward(self, m: int) -> None:
        st = self._state(m)
        if self.one_queue and not self.groups.is_first and self.groups.pp > 1:
            grad = self._oq_wait("embgrad", m)
        else:
            if st.embgrad_wait is None:
                raise RuntimeError(f"vocabulary parallel: embedding backward of microbatch {m} before the first "
                                   "stage's backward produced its gradient")
            grad = self._wait(st.embgrad_wait)
        st.embgrad_wait = None
        w = self.shards.input_weight
        acc = torch.zeros(self.part.rows, self.hidden, dtype=torch.float32, device=self.device)
        K.embedding_grad(self._tokens_of(m), grad, self.part, acc)
        accumulate_grad(w, acc)
        self._finish(m, "emb_b")


class _GradTap(torch.autograd.Function):
    """Identity whose backward hands the gradient to the engine (and stops there)."""

    @staticmethod
    def forward(ctx, x, engine, m):
        ctx.engine, ctx.m = engine, m
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.engine._on_embedding_grad(ctx.m, grad)
        return None, None, None
