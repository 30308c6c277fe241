"""Offloaded units: a planned module's saved tensors go to host memory after its forward and come
back for its backward, through ``torch.autograd.graph.saved_tensors_hooks``.

``apply_plan`` installs an ``OffloadedForward`` on each module of ``plan.offload``; all of them
share one ``HostStore`` per handle (``AppliedPlan.host_store``), which owns the host buffers and
measures their peak. See NOTE [ Offloaded units ].

Example::

    handle = apply_plan(model, "offload-plan.json")   # a plan made with remat plan --offload
    loss_fn(model(batch)).backward()
    print(handle.offloaded, handle.host_store.peak_bytes)
"""

# NOTE [ Offloaded units ]
#
# Rule 1. What moves. Each call of an offloaded module runs its forward under a pack/unpack
# hook pair. A saved tensor moves to host memory unless it is a parameter, a buffer or the
# batch (their storages are alive all step: moving them frees nothing; the profiler leaves them
# out of the saves for the same reason), already on the host of a CUDA run, not strided, or a
# tensor subclass (DTensor): those are kept as they are. The unit of transfer is the whole
# storage, once per call of the module however many saved tensors view it (keyed by a weak
# reference to the storage, so an address reused after a free is never confused with it): the
# cost model counts bytes per storage (NOTE [ Peak-memory model ], Rule 3), and the views come
# back as views of one restored storage, as autograd saved them. Two calls that save one storage
# (Llama's rotary cos and sin, saved by every layer) each copy it: each call's backward then
# restores its own, as the model counts it (Rule 10).
#
# Rule 2. When it comes back. On the first unpack of any tensor of a call (its backward has
# started) every storage of that call is restored at once, as a checkpointed unit recomputes
# everything at once; each restored storage is referenced only by the saved-tensor handles
# that view it, so it is freed when backward passes its last use (the model's R term, Rule 10).
# The host copy is released as soon as it is restored.
#
# Rule 3. The CPU. There is no copy engine: the device-to-host copy is a memcpy on the compute
# thread into a numpy buffer, outside torch's allocator, so the allocator's peak (what remat
# measures on the CPU) shows exactly what the plan frees; the host store's own counter measures
# the host side. The restore allocates the storage again through torch's allocator.
#
# Rule 4. CUDA. Copies run on two side streams (one per direction, as the GPU has one copy engine
# each way) into pinned host buffers (``pin_memory=True``; they count against the host budget).
# Device-to-host: the copy waits for the compute stream's work so far (an event), and the
# device storage stays referenced until the forward of the plan's ``sync_fqn`` module (the next
# leaf) ends, where the compute stream waits for the copy: what the model holds on the device
# during the transfer. Host-to-device: when backward reaches ``sync_fqn`` (a gradient hook on its
# outputs) this unit's storages are prefetched on the other side stream; the first unpack waits
# for that copy. With no ``sync_fqn`` (the last leaf) both happen at the end of forward and on
# the first unpack.
# Rule 5. Host buffers are made on the host by name (``device="cpu"``), not on torch's default device: a training
# script or model file that calls ``torch.set_default_device("cuda")`` (many LLM scripts do) made the pinned buffer,
# allocated in the pack hook during forward where the default applies, a GPU tensor, which torch refuses ("Only dense
# CPU tensors can be pinned", its ``empty_cuda``): an offload plan failed in the user's first forward. Round 19 had no
# GPU: this path was read, not run. (The default does not reach the unpack hook: autograd's engine runs it without
# the default-device mode.) ``measure_host_link`` (``planner/profiling/measure.py``) makes its host buffers the same
# way; there ``torch.device("meta")`` as the default stands in for a GPU in the test.

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from planner.act.applier import AppliedPlan, CheckpointedForward, RegionCounts
from planner.errors import RematError
from planner.model.schema import Plan
from planner.profiling.devices import available_host_bytes
from planner.sizes import format_bytes

try:  # torch's weak reference to a storage (StorageImpl), stable since torch 1.x
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover
    StorageWeakRef = None  # type: ignore[assignment,misc]


class HostMemoryError(RematError):
    """The host store cannot allocate a buffer for an offloaded tensor."""

    exit_code = 1


def host_memory_fix(needed_bytes: int, available_bytes: int | None) -> str:
    """The one-line message for a host store that cannot hold what a plan offloads."""
    have = f"; {format_bytes(available_bytes)} is available" if available_bytes is not None else ""
    return (f"the host store cannot allocate {format_bytes(needed_bytes)} for offloaded activations{have}: "
            f"make a plan with a smaller --host-memory (host_memory= in Python), or free host memory")


class HostStore:
    """Host buffers of the offloaded storages of one applied plan, and their measured peak."""

    def __init__(self) -> None:
        self.static: set[int] = set()  # data_ptrs of parameters, buffers and the batch (Rule 1), per forward
        self.on_cuda = False  # the model's parameters are on CUDA: tensors on the host stay there (Rule 1)
        self.live_bytes = 0
        self.peak_bytes = 0
        self.copies = 0  # storages moved since reset
        self._streams: tuple[Any, Any] | None = None

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.copies = 0

    def streams(self) -> tuple[Any, Any]:
        """(device-to-host, host-to-device) side streams, made on first use (Rule 4)."""
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def allocate(self, nbytes: int, pinned: bool) -> Any:
        try:
            buf = (torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True) if pinned  # Rule 5
                   else np.empty(nbytes, dtype=np.uint8))
        except (MemoryError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and "memory" not in str(e).lower():
                raise
            raise HostMemoryError(host_memory_fix(self.live_bytes + nbytes, available_host_bytes())) from None
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.copies += 1
        return buf

    def release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def keeps_on_device(self, t: torch.Tensor) -> bool:
        """Rule 1: tensors that are not moved."""
        if type(t) is not torch.Tensor and not isinstance(t, nn.Parameter) or t.layout != torch.strided:
            return True
        if t.device.type not in ("cpu", "cuda") or (t.device.type == "cpu" and self.on_cuda):
            return True
        return t.untyped_storage().data_ptr() in self.static or t.untyped_storage().nbytes() == 0


class _Entry:
    """One storage moved to host: its buffer there, and once back, the restored device storage."""

    __slots__ = ("store", "nbytes", "device", "host", "pending", "copied", "restored", "ready", "__weakref__")

    def __init__(self, store: HostStore, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        self.host: Any = None
        self.store, self.nbytes, self.device = store, storage.nbytes(), t.device
        device_bytes = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
        self.restored: Any = None
        self.ready: Any = None  # CUDA: the prefetch's event
        if t.device.type == "cpu":  # Rule 3: a memcpy into numpy memory
            self.host = store.allocate(self.nbytes, pinned=False)
            torch.from_numpy(self.host).copy_(device_bytes)
            self.pending, self.copied = None, None
        else:  # Rule 4: an asynchronous copy into pinned memory
            self.host = store.allocate(self.nbytes, pinned=True)
            d2h, _ = store.streams()
            d2h.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(d2h):
                self.host.copy_(device_bytes, non_blocking=True)
                self.copied = torch.cuda.Event()
                self.copied.record(d2h)
            self.pending = device_bytes  # the device storage lives until the copy is waited for

    def settle(self) -> None:
        """CUDA: the compute stream waits for the device-to-host copy; the device storage may go."""
        if self.pending is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied)
            self.pending = None

    def restore(self, stream: Any = None) -> None:
        """Copy back to the device (on ``stream`` when given: a prefetch) and release the host buffer."""
        if self.restored is not None or self.host is None:
            return
        self.settle()
        if self.device.type == "cpu":
            back = torch.empty(self.nbytes, dtype=torch.uint8)
            back.copy_(torch.from_numpy(self.host))
        elif stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                back = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                back.copy_(self.host, non_blocking=True)
                self.ready = torch.cuda.Event()
                self.ready.record(stream)
        else:
            back = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            back.copy_(self.host, non_blocking=True)
        self.restored = back  # a uint8 tensor over the restored storage
        self.host = None
        self.store.release(self.nbytes)

    def storage(self) -> Any:
        if self.ready is not None:  # a prefetch: the compute stream waits for it, then owns the memory
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.ready)
            self.restored.record_stream(stream)  # allocated on the prefetch stream, now used on this one
            self.ready = None
        return self.restored.untyped_storage()

    def __del__(self) -> None:
        if self.host is not None:  # never restored (a forward without backward)
            self.store.release(self.nbytes)


class _Group:
    """One call of an offloaded module: the storages it moved (weakly: the handles own them)."""

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.entries: list[weakref.ref[_Entry]] = []
        self.by_storage: dict[int, tuple[Any, weakref.ref[_Entry]]] = {}  # data_ptr -> weak (storage, entry)
        self.restored = False
        self.prefetched = False

    def pack(self, t: torch.Tensor) -> Any:
        store = self.store
        if store.keeps_on_device(t):
            return t
        key = t.untyped_storage().data_ptr()
        known = self.by_storage.get(key)
        entry = known[1]() if known is not None and not known[0].expired() else None
        if entry is None:
            entry = _Entry(store, t)
            self.by_storage[key] = (StorageWeakRef(t.untyped_storage()), weakref.ref(entry))
            self.entries.append(weakref.ref(entry))
        return (self, entry, t.dtype, t.storage_offset(), tuple(t.shape), t.stride(), t.requires_grad)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        group, entry, dtype, offset, shape, stride, _ = packed
        if not group.restored:
            group.restore_all()
        return torch.empty(0, dtype=dtype, device=entry.device).set_(entry.storage(), offset, shape, stride)

    def live(self) -> list[_Entry]:
        return [e for e in (r() for r in self.entries) if e is not None]

    def restore_all(self, stream: Any = None) -> None:
        self.restored = True
        for e in self.live():
            e.restore(stream)

    def settle(self) -> None:
        for e in self.live():
            e.settle()

    def on_cuda(self) -> bool:
        return any(e.device.type == "cuda" for e in self.live())

    def prefetch(self) -> None:
        if not self.restored and self.on_cuda():
            self.restore_all(self.store.streams()[1])


class StaticRecorder:
    """Root forward pre-hook: the storages of the parameters, buffers and batch of this forward, never
    moved (Rule 1). Read at every forward, as the model may have moved (``.to``, ``fully_shard``)
    since ``apply_plan``."""

    _remat_hook = True  # for planner.remove_plan (NOTE [ Plans carried without a handle ])

    def __init__(self, store: HostStore) -> None:
        self.store = store

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            params = [*module.parameters(), *module.buffers()]
            self.store.on_cuda = any(p.device.type == "cuda" for p in params)
            self.store.static = {t.untyped_storage().data_ptr() for t in [*params, *_tensors((args, kwargs))]}


class SyncPoint:
    """CUDA: the forward-end hook of a ``sync_fqn`` module, or of the root for the last units (Rule 4):
    waits for the device-to-host copies of the offloaded calls before it, and arms their prefetch
    on its outputs' gradients."""

    _remat_hook = True  # for planner.remove_plan (NOTE [ Plans carried without a handle ])

    def __init__(self, store: HostStore) -> None:
        self.store = store
        self.waiting: list[_Group] = []

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        groups, self.waiting = [g for g in self.waiting if g.on_cuda()], []
        if not groups or not torch.is_grad_enabled():
            return
        for group in groups:
            group.settle()
        outs = [t for t in _tensors(output) if t.requires_grad]
        if outs:
            torch.autograd.graph.register_multi_grad_hook(outs, _Prefetch(groups), mode="any")


class _Prefetch:
    """Gradient hook on a sync module's outputs: backward has reached it, prefetch the calls before it."""

    def __init__(self, groups: list[_Group]) -> None:
        self.groups = groups

    def __call__(self, _grad: Any) -> None:
        for group in self.groups:
            group.prefetch()


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    if hasattr(tree, "to_tuple"):  # Hugging Face ModelOutput
        return _tensors(tree.to_tuple())
    return []


# ----------------------------------------------------------------------------- in apply_plan


class OffloadedForward(CheckpointedForward):
    """The instance-level ``forward`` of an offloaded module: its saved tensors go to host memory
    (NOTE [ Offloaded units ]). Nothing is recomputed."""

    def __init__(self, module: nn.Module, previous: Any, counts: RegionCounts, store: HostStore,
                 sync: SyncPoint):
        super().__init__(module, previous, counts, norms=[])
        self.store, self.sync = store, sync

    def __reduce__(self) -> tuple:
        return type(self), (self.module, self.previous, self.counts, self.store, self.sync)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return self.inner(*args, **kwargs)  # nothing saved; or traced, where hooks do not run
        self.counts.calls += 1
        group = _Group(self.store)
        with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
            out = self.inner(*args, **kwargs)
        if group.entries:
            self.sync.waiting.append(group)
        return out


def check_host_memory(plan: Plan) -> None:
    """An offload plan whose host store would not fit this machine's free memory: one line, the fix."""
    need = plan.predicted.host_peak_bytes
    have = available_host_bytes()
    if plan.offload and need and have is not None and need > have:
        raise HostMemoryError(host_memory_fix(need, have))


def offload_store(model: nn.Module, plan: Plan, modules: dict[str, nn.Module],
                  handle: AppliedPlan) -> dict[str, Any]:
    """The handle's host store, the root's static hook, one ``SyncPoint`` per ``sync_fqn`` (Rule 4; None
    is the root's forward end), and per offloaded FQN the function that wraps its module."""
    store = handle.host_store = HostStore()
    handle._hooks.append(model.register_forward_pre_hook(StaticRecorder(store), with_kwargs=True))
    syncs: dict[str | None, SyncPoint] = {}
    for u in plan.offload:
        if u.sync_fqn not in syncs:
            syncs[u.sync_fqn] = SyncPoint(store)
            target = modules.get(u.sync_fqn, model) if u.sync_fqn is not None else model
            handle._hooks.append(target.register_forward_hook(syncs[u.sync_fqn]))

    def wrapper(sync: SyncPoint) -> Any:
        return lambda module: OffloadedForward(module, module.__dict__.get("forward"), RegionCounts(), store, sync)

    return {u.fqn: wrapper(syncs[u.sync_fqn]) for u in plan.offload}


__all__ = ["HostMemoryError", "HostStore", "OffloadedForward", "StaticRecorder", "SyncPoint", "check_host_memory",
           "host_memory_fix", "offload_store"]
