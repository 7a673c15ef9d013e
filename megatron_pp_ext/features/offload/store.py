"""The activation store: saved tensors of a forward moved to host memory and back.

Built on :func:`torch.autograd.graph.saved_tensors_hooks`. Inside :meth:`ActivationStore.hooks`
(entered once around a whole training step) every tensor autograd saves for backward goes
through the store; :meth:`begin_forward` / :meth:`end_forward` name the group it belongs to
(normally ``(stage, microbatch)``; outside a forward tensors pass through untouched). Then:

* :meth:`offload(key) <ActivationStore.offload>` copies the group's device storages into
  pooled host buffers and drops the device references, so the device memory is freed as soon
  as nothing else holds it; :meth:`reload(key) <ActivationStore.reload>` copies them back. On a
  CUDA device the copies run on two dedicated streams (device-to-host, host-to-device) into
  *pinned* buffers, ordered with events: the D2H copy waits for the end of the forward, the
  H2D copy for the D2H copy, the compute stream waits
  for the H2D copy only when backward unpacks the tensor (``record_stream`` keeps the caching
  allocator from reusing memory a copy still reads). On a CPU the same code path runs with
  plain host-to-host copies and no streams.
* a saved tensor that backward needs before its group was reloaded is reloaded on demand
  (counted in :attr:`StoreStats.on_demand_reloads`);
* what is *not* moved: parameters (and views of them, e.g. the ``weight.t()`` a linear layer
  saves: register the model with :meth:`register_parameters`), leaves that require grad (the
  pipeline input of a stage is held by the schedule anyway), tensors on another device,
  non-strided tensors, and tensors under ``min_tensor_bytes``. Views of a storage already in the
  group are not copied twice: the store copies each storage once (the byte range its views
  span) and rebuilds every view from it;
* optional recomputation of cheap ops (:meth:`enable_cheap_op_recompute`): the outputs of norms,
  activation-function modules and dropout (with its RNG state saved) are not stored: backward
  recomputes them from their (stored) input, bit for bit;
* host buffers come from a :class:`PinnedHostPool` and are reused across iterations;
* exception safety: :meth:`reset` (called by :meth:`step` on any exception) waits for the
  copies in flight, returns every host buffer to the pool and forgets every group, so no
  pinned buffer leaks and the next step starts clean.

Accounting: :meth:`sample` measures the device bytes of the storages the store has seen that
are still alive (held by anyone, through weak storage references), the "device-resident
activation bytes"; host bytes are the buffers in use. Peaks are kept in :attr:`stats`.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ...runtime.streams import dedicated_stream

__all__ = ["ActivationStore", "PinnedHostPool", "StoreStats", "DiscardedActivationError", "default_cheap_op"]

ALIGN = 64


class DiscardedActivationError(RuntimeError):
    """Backward needed a saved tensor whose group the store already discarded (a failed step)."""


# --- host buffer pool -------------------------------------------------------------------------

class PinnedHostPool:
    """Pool of host byte buffers (pinned when CUDA is available), reused across iterations.

    ``acquire(n)`` returns a uint8 tensor of at least ``n`` bytes (size classes of
    ``granularity`` bytes); ``release(buf, event)`` gives it back, reusable once ``event`` (the
    copy reading it) has completed.
    """

    def __init__(self, pin_memory: bool | None = None, granularity: int = 4096):
        self.pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.granularity = int(granularity)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._in_use: dict[int, int] = {}
        self.allocations = 0
        self.allocated_bytes = 0
        self.hits = 0
        self.peak_in_use_bytes = 0

    def _size_class(self, nbytes: int) -> int:
        g = self.granularity
        return max(g, (int(nbytes) + g - 1) // g * g)

    def _reclaim(self, wait: bool = False) -> None:
        keep = []
        for ev, buf in self._pending:
            if ev is None or wait or ev.query():
                if ev is not None and wait:
                    ev.synchronize()
                self._free[buf.numel()].append(buf)
            else:
                keep.append((ev, buf))
        self._pending = keep

    def acquire(self, nbytes: int) -> torch.Tensor:
        size = self._size_class(nbytes)
        if not self._free.get(size) and self._pending:
            self._reclaim()
        lst = self._free.get(size)
        if lst:
            buf = lst.pop()
            self.hits += 1
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
            self.allocated_bytes += size
        self._in_use[id(buf)] = size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf

    def release(self, buf: torch.Tensor, event=None) -> None:
        if self._in_use.pop(id(buf), None) is None:
            return  # already released
        if event is None:
            self._free[buf.numel()].append(buf)
        else:
            self._pending.append((event, buf))

    def synchronize(self) -> None:
        """Wait for every copy that still reads a released buffer."""
        self._reclaim(wait=True)

    def trim(self) -> None:
        """Free the idle buffers."""
        self.synchronize()
        for size, lst in self._free.items():
            self.allocated_bytes -= size * len(lst)
        self._free.clear()

    @property
    def in_use_count(self) -> int:
        return len(self._in_use)

    @property
    def in_use_bytes(self) -> int:
        return sum(self._in_use.values())

    def stats(self) -> dict:
        return {"allocations": self.allocations, "allocated_bytes": self.allocated_bytes, "hits": self.hits,
                "in_use_count": self.in_use_count, "in_use_bytes": self.in_use_bytes,
                "peak_in_use_bytes": self.peak_in_use_bytes, "pinned": self.pin}


# --- records ----------------------------------------------------------------------------------

@dataclass
class StoreStats:
    """Counters of an :class:`ActivationStore` (bytes are device storage bytes)."""

    packed: int = 0                 # saved tensors taken over
    passed_through: int = 0         # saved tensors left alone (outside a forward)
    skipped_params: int = 0
    skipped_small: int = 0
    skipped_other: int = 0
    deduplicated_views: int = 0     # saved views of a storage already in the group
    recomputed: int = 0             # cheap-op outputs not stored (recomputed in backward)
    offloaded_bytes: int = 0        # copied device -> host (cumulative)
    reloaded_bytes: int = 0         # copied host -> device (cumulative)
    on_demand_reloads: int = 0      # reloads triggered by backward itself (not prefetched)
    peak_device_bytes: int = 0      # peak of sample(): saved activation bytes alive on the device
    peak_host_bytes: int = 0        # peak of the offloaded bytes held in host buffers
    peak_device_bytes_by_key: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d.pop("peak_device_bytes_by_key")
        return d


class _Record:
    """One device storage saved by one forward group (its views share it)."""

    __slots__ = ("group", "device", "full", "nbytes", "lo", "hi", "base", "host", "state", "refs",
                 "d2h_event", "h2d_event", "synced", "__weakref__")

    def __init__(self, group: "_Group", storage_tensor: torch.Tensor, nbytes: int):
        self.group = group
        self.device = storage_tensor.device
        self.full = storage_tensor        # uint8 view over the whole storage, or the reloaded range
        self.nbytes = nbytes
        self.lo, self.hi = nbytes, 0     # byte range spanned by the saved views
        self.base = 0                    # byte offset of ``full`` within the original storage
        self.host: torch.Tensor | None = None
        self.state = "device"            # device | host | released
        self.refs = 0
        self.d2h_event = None
        self.h2d_event = None
        self.synced = True               # the compute stream already waits for h2d_event


class _Group:
    __slots__ = ("key", "records", "fwd_event", "offloaded", "__weakref__")

    def __init__(self, key: Hashable):
        self.key = key
        self.records: dict[tuple, _Record] = {}
        self.fwd_event = None
        self.offloaded = False


class _Packed:
    """What autograd keeps instead of a saved tensor."""

    __slots__ = ("store", "rec", "dtype", "size", "stride", "offset", "__weakref__")

    def __init__(self, store: "ActivationStore", rec: _Record, t: torch.Tensor):
        self.store = store
        self.rec = rec
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.offset = t.storage_offset()
        rec.refs += 1

    def __del__(self):
        rec = self.rec
        rec.refs -= 1
        if rec.refs <= 0 and rec.state != "released":
            try:
                self.store._drop(rec)
            except Exception:  # interpreter shutdown
                pass


class _Recompute:
    """A cheap op's output: recomputed from its (stored) input in backward."""

    __slots__ = ("store", "module", "inp", "rng", "size", "stride", "delta", "dtype")

    def __init__(self, store, module, inp, rng, t: torch.Tensor, out_offset: int):
        self.store = store
        self.module = module
        self.inp = inp
        self.rng = rng
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())
        self.delta = t.storage_offset() - out_offset
        self.dtype = t.dtype


_CHEAP_TYPES: tuple = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.GELU, torch.nn.SiLU, torch.nn.ReLU,
                       torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Mish, torch.nn.Hardswish, torch.nn.Dropout)
if hasattr(torch.nn, "RMSNorm"):
    _CHEAP_TYPES = _CHEAP_TYPES + (torch.nn.RMSNorm,)


def default_cheap_op(module: torch.nn.Module) -> bool:
    """Norms (any class whose name ends in ``Norm``: LayerNorm, RMSNorm, Megatron's FusedLayerNorm /
    WrappedTorchNorm / TENorm), activation-function modules and dropout."""
    return isinstance(module, _CHEAP_TYPES) or type(module).__name__.endswith("Norm")


_ITEMSIZE: dict = {}


def _itemsize(dtype: torch.dtype) -> int:
    n = _ITEMSIZE.get(dtype)
    if n is None:
        n = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def _storage_key(t: torch.Tensor) -> tuple:
    st = t.untyped_storage()
    return (t.device.type, t.device.index, st.data_ptr())


# --- the store --------------------------------------------------------------------------------

class ActivationStore:
    """Saved-tensor store with offload to (pinned) host memory; see the module docstring.

    Args:
        device: the compute device (default: the current CUDA device, else CPU). Only tensors
            on it are managed.
        pool: a :class:`PinnedHostPool` (shared pools are fine).
        min_tensor_bytes: smaller saved tensors stay where they are.
        use_streams: copy on dedicated CUDA streams (default: when ``device`` is CUDA).
    """

    def __init__(self, *, device: torch.device | str | None = None, pool: PinnedHostPool | None = None,
                 min_tensor_bytes: int = 1024, use_streams: bool | None = None):
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.pool = pool if pool is not None else PinnedHostPool(pin_memory=self.cuda)
        self.min_tensor_bytes = int(min_tensor_bytes)
        self.streams = self.cuda if use_streams is None else (bool(use_streams) and self.cuda)
        # streams of their own: a pooled one may be a communicator's (runtime/streams.py)
        self.d2h_stream = dedicated_stream(self.device, "offload-d2h") if self.streams else None
        self.h2d_stream = dedicated_stream(self.device, "offload-h2d") if self.streams else None
        self.stats = StoreStats()
        self._groups: dict[Hashable, _Group] = {}
        self._key: Hashable | None = None
        self._group: _Group | None = None
        self._param_keys: set = set()
        self._tracked: dict[int, tuple] = {}  # id -> (StorageWeakRef, nbytes, key)
        self._next_id = 0
        self._cheap: dict[tuple, tuple] = {}
        self._cheap_handles: list = []
        self._rng_pending: dict[int, tuple] = {}
        self._hooks_depth = 0
        self._orphans: list[_Group] = []

    # -- configuration ---------------------------------------------------------------------
    def register_parameters(self, modules: torch.nn.Module | Iterable[torch.nn.Module]) -> None:
        """Never move the storages of these modules' parameters and buffers (nor views of them)."""
        mods = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        for mod in mods:
            # (nn.Module's methods: Megatron's DDP wrapper shadows ``buffers`` with its grad buffers)
            for t in list(torch.nn.Module.parameters(mod)) + list(torch.nn.Module.buffers(mod)):
                self._param_keys.add(_storage_key(t))
                main = getattr(t, "main_grad", None)
                if isinstance(main, torch.Tensor):
                    self._param_keys.add(_storage_key(main))

    def enable_cheap_op_recompute(self, modules: torch.nn.Module | Iterable[torch.nn.Module],
                                  predicate: Callable[[torch.nn.Module], bool] = default_cheap_op) -> int:
        """Recompute the outputs of the cheap submodules of ``modules`` in backward instead of
        storing them. Returns how many modules were hooked; :meth:`disable_cheap_op_recompute`
        removes the hooks."""
        mods = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        n = 0
        for root in mods:
            for mod in root.modules():
                if predicate(mod):
                    self._cheap_handles.append(mod.register_forward_pre_hook(self._cheap_pre))
                    self._cheap_handles.append(mod.register_forward_hook(self._cheap_post))
                    n += 1
        return n

    def disable_cheap_op_recompute(self) -> None:
        for h in self._cheap_handles:
            h.remove()
        self._cheap_handles.clear()

    # -- scoping ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def hooks(self) -> Iterator["ActivationStore"]:
        """Route saved tensors through the store (enter once around a step)."""
        self._hooks_depth += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._hooks_depth -= 1

    @contextlib.contextmanager
    def step(self) -> Iterator["ActivationStore"]:
        """:meth:`hooks` for one training step; on an exception :meth:`reset` (no buffer leaks)."""
        try:
            with self.hooks():
                yield self
        except BaseException:
            self.reset()
            raise
        self.finish()

    def begin_forward(self, key: Hashable) -> None:
        """Tensors saved from now on belong to group ``key`` (until :meth:`end_forward`)."""
        old = self._groups.pop(key, None)
        if old is not None:  # the same key again (a second forward): keep the old one alive
            self._orphans.append(old)
        self._key = key
        self._group = self._groups[key] = _Group(key)

    def end_forward(self) -> None:
        g = self._group
        self._key = None
        self._group = None
        self._cheap.clear()
        self._rng_pending.clear()
        if g is not None and self.streams:
            g.fwd_event = torch.cuda.Event()
            g.fwd_event.record(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def forward_context(self, key: Hashable) -> Iterator["ActivationStore"]:
        """Hooks and group ``key`` around one forward (standalone use)."""
        with self.hooks():
            self.begin_forward(key)
            try:
                yield self
            finally:
                self.end_forward()

    # -- pack / unpack ---------------------------------------------------------------------
    def _skip_reason(self, t: torch.Tensor) -> str | None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return "other"   # tensor subclasses (FP8, DTensor, fake tensors) manage themselves
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return "param"
        if t.device != self.device or t.layout != torch.strided or t.is_sparse or t.is_nested:
            return "other"
        base = t._base
        if base is not None and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)):
            return "param"
        sk = _storage_key(t)
        if sk in self._param_keys:
            return "param"
        if self._group is not None and sk in self._group.records:
            return None  # a view of a storage already in the group: rebuilt from it
        if t.untyped_storage().nbytes() < self.min_tensor_bytes:
            return "small"
        return None

    def _pack(self, t: torch.Tensor):
        g = self._group
        if g is None or not isinstance(t, torch.Tensor):
            self.stats.passed_through += 1
            return t
        why = self._skip_reason(t)
        if why is not None:
            if why == "param":
                self.stats.skipped_params += 1
            elif why == "small":
                self.stats.skipped_small += 1
            else:
                self.stats.skipped_other += 1
            return t
        if self._cheap:
            got = self._recompute_handle(t)
            if got is not None:
                return got
        return self._pack_tensor(g, t)

    def _pack_tensor(self, g: _Group, t: torch.Tensor) -> _Packed:
        sk = _storage_key(t)
        rec = g.records.get(sk)
        if rec is None:
            st = t.untyped_storage()
            full = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
            rec = _Record(g, full, st.nbytes())
            g.records[sk] = rec
            self._track(full, st.nbytes(), g.key)
        else:
            self.stats.deduplicated_views += 1
        isz = t.element_size()
        if t.numel() > 0:
            span = 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride()) if n > 0)
            lo = t.storage_offset() * isz
            rec.lo = min(rec.lo, lo)
            rec.hi = max(rec.hi, lo + span * isz)
        self.stats.packed += 1
        if rec.state == "host":  # saved again after its group was offloaded (a later forward)
            self._reload_record(rec, on_demand=True)
        return _Packed(self, rec, t)

    def _unpack(self, p):
        if isinstance(p, _Packed):
            return self._materialize(p)
        if isinstance(p, _Recompute):
            return self._recompute(p)
        return p

    def _materialize(self, p: _Packed) -> torch.Tensor:
        rec = p.rec
        if rec.state == "released":
            raise DiscardedActivationError(
                f"backward needs a saved activation of {rec.group.key!r} that the activation store discarded "
                "(an earlier exception reset the step); run the forward again")
        if rec.state == "host":
            self._reload_record(rec, on_demand=True)
        if self.streams and not rec.synced:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(rec.h2d_event)
            rec.full.record_stream(cur)
            rec.synced = True
        isz = _itemsize(p.dtype)
        out = torch.empty(0, dtype=p.dtype, device=rec.device)
        out.set_(rec.full.untyped_storage(), (p.offset * isz - rec.base) // isz, p.size, p.stride)
        return out

    # -- moving ----------------------------------------------------------------------------
    def offload(self, key: Hashable) -> int:
        """Copy group ``key`` to host buffers and drop its device references; returns the bytes
        copied. Asynchronous on CUDA (D2H stream), synchronous on CPU."""
        g = self._groups.get(key)
        if g is None or g.offloaded:
            return 0
        g.offloaded = True
        moved = 0
        stream_ctx = torch.cuda.stream(self.d2h_stream) if self.streams else contextlib.nullcontext()
        with stream_ctx:
            if self.streams:
                if g.fwd_event is not None:
                    self.d2h_stream.wait_event(g.fwd_event)
                else:
                    self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            for rec in g.records.values():
                if rec.state != "device" or rec.hi <= rec.lo:
                    continue
                lo = rec.lo // ALIGN * ALIGN
                hi = rec.hi
                n = hi - lo
                buf = self.pool.acquire(n)
                src = rec.full[lo - rec.base: hi - rec.base]
                buf[:n].copy_(src, non_blocking=self.streams)
                if self.streams:
                    rec.full.record_stream(self.d2h_stream)
                    rec.d2h_event = torch.cuda.Event()
                    rec.d2h_event.record(self.d2h_stream)
                rec.host = buf
                rec.base = lo
                rec.full = None
                rec.state = "host"
                moved += n
        self.stats.offloaded_bytes += moved
        self._note_host()
        return moved

    def reload(self, key: Hashable) -> int:
        """Copy group ``key`` back to the device (prefetch before its backward); returns the bytes."""
        g = self._groups.get(key)
        if g is None:
            return 0
        moved = 0
        for rec in list(g.records.values()):
            if rec.state == "host":
                moved += self._reload_record(rec)
        g.offloaded = False
        return moved

    def _reload_record(self, rec: _Record, on_demand: bool = False) -> int:
        buf = rec.host
        n = rec.hi - rec.base
        if self.streams:
            with torch.cuda.stream(self.h2d_stream):
                if rec.d2h_event is not None:
                    self.h2d_stream.wait_event(rec.d2h_event)
                dev = torch.empty(n, dtype=torch.uint8, device=self.device)
                dev.copy_(buf[:n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.h2d_stream)
            rec.h2d_event = ev
            rec.synced = False
            self.pool.release(buf, ev)
        else:
            dev = torch.empty(n, dtype=torch.uint8, device=self.device)
            dev.copy_(buf[:n])
            self.pool.release(buf)
        rec.full = dev
        rec.host = None
        rec.state = "device"
        self._track(dev, n, rec.group.key)
        self.stats.reloaded_bytes += n
        if on_demand:
            self.stats.on_demand_reloads += 1
        return n

    # -- recompute of cheap ops --------------------------------------------------------------
    def _cheap_pre(self, module, args):
        if self._group is None:
            return
        if isinstance(module, torch.nn.Dropout) and module.training and module.p > 0:
            state = (torch.get_rng_state(), torch.cuda.get_rng_state(self.device) if self.cuda else None)
            self._rng_pending[id(module)] = state

    def _cheap_post(self, module, args, output):
        if self._group is None:
            return
        rng = self._rng_pending.pop(id(module), None)
        if not (isinstance(output, torch.Tensor) and type(output) is torch.Tensor and len(args) == 1
                and isinstance(args[0], torch.Tensor) and output.is_contiguous()
                and output.device == self.device):
            return
        inp = args[0]
        if _storage_key(inp) == _storage_key(output):
            return  # in place (or the identity): nothing to recompute from
        self._cheap[_storage_key(output)] = (module, inp, inp._version, output._version,
                                             StorageWeakRef(output.untyped_storage()), output.storage_offset(), rng)

    def _recompute_handle(self, t: torch.Tensor):
        ent = self._cheap.get(_storage_key(t))
        if ent is None:
            return None
        module, inp, in_version, out_version, weak, out_offset, rng = ent
        if weak.expired() or inp._version != in_version or t._version != out_version:
            return None  # modified in place since: store it
        inp_handle = self._pack(inp)
        self.stats.recomputed += 1
        return _Recompute(self, module, inp_handle, rng, t, out_offset)

    def _recompute(self, h: _Recompute) -> torch.Tensor:
        inp = self._unpack(h.inp)
        with torch.no_grad():
            if h.rng is not None:
                devices = [self.device] if self.cuda else []
                with torch.random.fork_rng(devices=devices):
                    torch.set_rng_state(h.rng[0])
                    if h.rng[1] is not None:
                        torch.cuda.set_rng_state(h.rng[1], self.device)
                    out = h.module(inp)
            else:
                out = h.module(inp)
        return out.as_strided(h.size, h.stride, out.storage_offset() + h.delta)

    # -- lifetime ----------------------------------------------------------------------------
    def _drop(self, rec: _Record) -> None:
        """All saved views of ``rec`` are gone (autograd freed them): forget it."""
        if rec.host is not None:
            self.pool.release(rec.host, rec.d2h_event if self.streams else None)
            rec.host = None
        rec.full = None
        rec.state = "released"
        g = rec.group
        for k, r in list(g.records.items()):
            if r is rec:
                del g.records[k]
        if not g.records and self._groups.get(g.key) is g and g is not self._group:
            del self._groups[g.key]

    def _release_group(self, g: _Group) -> None:
        for rec in list(g.records.values()):
            if rec.host is not None:
                self.pool.release(rec.host, None)
                rec.host = None
            rec.full = None
            rec.state = "released"
        g.records.clear()

    def release(self, key: Hashable) -> None:
        """Forget group ``key`` now (its saved tensors can no longer be unpacked)."""
        g = self._groups.pop(key, None)
        if g is not None:
            if self.streams:
                self.synchronize()
            self._release_group(g)

    def synchronize(self) -> None:
        if self.streams:
            self.d2h_stream.synchronize()
            self.h2d_stream.synchronize()
        self.pool.synchronize()

    def reset(self) -> None:
        """After a failure: wait for the copies in flight, return every host buffer, forget
        every group. Saved tensors of the failed step can no longer be unpacked."""
        try:
            self.synchronize()
        finally:
            for g in list(self._groups.values()) + self._orphans:
                self._release_group(g)
            self._groups.clear()
            self._orphans.clear()
            self._key = None
            self._group = None
            self._cheap.clear()
            self._rng_pending.clear()

    def finish(self) -> None:
        """End of a step: groups whose saved tensors were all unpacked and freed are gone
        already; whatever is left (e.g. a forward-only step) is released."""
        self.reset()

    # -- accounting --------------------------------------------------------------------------
    def _track(self, t: torch.Tensor, nbytes: int, key: Hashable) -> None:
        self._next_id += 1
        self._tracked[self._next_id] = (StorageWeakRef(t.untyped_storage()), int(nbytes), key)

    def device_bytes(self, by_key: bool = False):
        """Bytes of the saved-activation storages still alive on the device (whoever holds them)."""
        total, per = 0, defaultdict(int)
        dead = []
        for i, (w, n, key) in self._tracked.items():
            if w.expired():
                dead.append(i)
            else:
                total += n
                per[key] += n
        for i in dead:
            del self._tracked[i]
        return (total, dict(per)) if by_key else total

    def host_bytes(self) -> int:
        return sum(rec.hi - rec.base for g in self._groups.values() for rec in g.records.values()
                   if rec.state == "host")

    def _note_host(self) -> None:
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.host_bytes())

    def sample(self) -> int:
        """Measure the device-resident saved-activation bytes now; update the peaks."""
        total, per = self.device_bytes(by_key=True)
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, total)
        pk = self.stats.peak_device_bytes_by_key
        for k, n in per.items():
            if n > pk.get(k, 0):
                pk[k] = n
        self._note_host()
        return total

    def reset_peaks(self) -> None:
        self.stats = StoreStats()
        self.pool.peak_in_use_bytes = self.pool.in_use_bytes

    @property
    def groups(self) -> list:
        return list(self._groups)
