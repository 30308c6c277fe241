"""Live-bytes tracking at the dispatcher: how much tensor memory exists after every op.

Example::

    with LiveBytesTracker(device_type="cpu") as tracker:
        step()
    tracker.peak_bytes
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import Self

_FRESH_OPS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})
"""Ops whose input is a tensor just made outside the dispatcher (``torch.tensor([...])``)."""


class StorageEntry:
    """What the tracker knows about one live storage."""

    __slots__ = ("nbytes", "ref", "serial", "static")

    def __init__(self, serial: int, nbytes: int, static: bool, ref: weakref.ref):
        self.serial = serial
        """Unique for the tracker's life, never reused (``id()`` of a dead storage is)."""
        self.nbytes = nbytes
        self.static = static
        """True when it existed before tracking (registered or found), False when allocated."""
        self.ref = ref


Observer = Callable[[Any, list[StorageEntry], list[StorageEntry]], None]
"""``observer(func, input_entries, new_entries)``, called after every op."""


# NOTE [ Live-bytes tracker ]
#
# A ``TorchDispatchMode`` sees every aten op below autograd, forward and backward, including
# the ops autograd runs for gradients and the optimizer's foreach kernels. Memory belongs to
# *storages*, not tensors: views (``x.t()``, ``x[1:]``, ``split``) share their base's storage
# and cost nothing. So the tracker keys everything by untyped storage, as
# ``torch.distributed._tools.mem_tracker`` does:
#
# * after each op, a storage of an output seen for the first time is counted as allocated
#   (``nbytes``) and gets a ``weakref.ref(storage, callback)``; the callback subtracts it when
#   the storage dies. PyTorch keeps one Python object per live storage (PyObject
#   preservation), so the weakref dies exactly when the memory is freed, not when Python
#   drops its last handle;
# * storages that existed before tracking started (parameters, buffers, optimizer state, the
#   batch) are registered by the caller as *static*: known, counted in ``live_bytes``, never
#   mistaken for an allocation when an op returns them (in-place ops, views);
# * a storage seen first among an op's *inputs* also predates tracking (a tensor kept in a
#   plain attribute, a global constant): it is added to the static set as *found*, not
#   counted as an allocation of that op.
#
# What it cannot see: temporaries an op allocates and frees inside its kernel, allocator
# rounding and fragmentation (``round_to`` mimics the CUDA caching allocator's 512-byte
# blocks), and ``UntypedStorage.resize_`` called outside the dispatcher (FSDP). On the CPU,
# ``planner.profiling.measure.measure_step`` reads the allocator's own events to check the figures.
#
# The tracker also works under ``FakeTensorMode`` (``--device meta``): fake tensors have
# storages with the real ``nbytes``. Enter the tracker *inside* the fake mode, so it sees the
# fake tensors and not the meta tensors the fake mode computes with.

class LiveBytesTracker(TorchDispatchMode):
    """Count the bytes of live tensor storages on one device type, op by op.

    Single use: entering starts counting from the registered static storages; leaving
    detaches every weakref, so the figures freeze and no callback outlives the tracker.

    Args:
        device_type: count only storages of tensors on this device type ('cpu', 'cuda',
            ...; for fake tensors, the device they pretend to be on). None counts all.
        round_to: round each storage up to a multiple of this many bytes (512 mimics the
            CUDA caching allocator).
        observer: called after every op with the entries of its inputs and of the storages
            it allocated; the profiler uses it to date allocations and parameter uses.

    Example::

        tracker = LiveBytesTracker(device_type="cpu")
        tracker.register_static(model.parameters())
        with tracker:
            loss = model(x).sum()
            loss.backward()
        print(tracker.live_bytes, tracker.peak_bytes)
    """

    def __init__(self, *, device_type: str | None = None, round_to: int = 1, observer: Observer | None = None):
        super().__init__()
        self.device_type = device_type
        self.round_to = max(1, int(round_to))
        self.observer = observer
        self.live_bytes = 0
        """Bytes of all live storages known to the tracker, static ones included."""
        self.peak_bytes = 0
        """Highest ``live_bytes`` since the last ``mark()`` (or since tracking started)."""
        self.static_bytes = 0
        """Bytes of live storages that existed before tracking (registered or found)."""
        self.found_bytes = 0
        """Part of ``static_bytes`` discovered among op inputs rather than registered."""
        self._entries: dict[int, StorageEntry] = {}
        self._serials = itertools.count()
        self._closed = False
        self.last_op_ms = 0.0
        self.work_of: Callable[..., tuple[float, int]] | None = None
        """(func, args, kwargs, out) -> (FLOPs, bytes moved) of an op, for the observer (NOTE [ Op work ])."""
        self.last_op_work: tuple[float, int] = (0.0, 0)
        self.last_written: tuple[StorageEntry, ...] = ()
        """Entries of the tensors the last op wrote in place, for the observer."""
        """Wall time of the last op's kernel call (synchronised on CUDA), for the observer."""
        self._sync = torch.cuda.synchronize if device_type == "cuda" and torch.cuda.is_available() else None

    # ----------------------------------------------------------------- public

    def register_static(self, tensors: Iterable[torch.Tensor]) -> int:
        """Register pre-existing tensors' storages; return the bytes newly added."""
        added = 0
        for t in tensors:
            entry = self._add(t, static=True) if self.entry(t) is None else None
            added += entry.nbytes if entry is not None else 0
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return added

    def entry(self, t: torch.Tensor) -> StorageEntry | None:
        """The entry of ``t``'s storage, or None if untracked (unknown, other device, no storage)."""
        st = _storage(t)
        return None if st is None else self._entries.get(id(st))

    def live_entries(self) -> list[StorageEntry]:
        """The entries of every storage alive now."""
        return list(self._entries.values())

    def mark(self) -> int:
        """Return the peak since the previous mark, and start a new peak window at ``live_bytes``."""
        peak, self.peak_bytes = self.peak_bytes, self.live_bytes
        return peak

    def nbytes(self, t: torch.Tensor) -> int:
        """Bytes of ``t``'s whole storage as this tracker counts them (0 without a storage)."""
        st = _storage(t)
        return 0 if st is None else self.round_bytes(st.nbytes())

    # ----------------------------------------------------------------- mode

    def __enter__(self) -> Self:
        if self._closed:
            raise RuntimeError("a LiveBytesTracker is single-use; create a new one")
        self.peak_bytes = self.live_bytes
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._closed = True
            self._entries.clear()  # a dead weakref object never calls its callback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs: list[StorageEntry] = []
        if func not in _FRESH_OPS:
            for t in iter_tensors(args, kwargs):
                entry = self.entry(t)
                if entry is None and _counts(t, self.device_type):
                    entry = self._add(t, static=True, found=True)
                if entry is not None:
                    inputs.append(entry)
        sync = self._sync
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if sync is not None:
            sync()
        self.last_op_ms = (time.perf_counter() - t0) * 1e3
        if self.work_of is not None:
            self.last_op_work = self.work_of(func, args, kwargs, out)
        new: list[StorageEntry] = []
        for t in iter_tensors(out):
            st = _storage(t)
            if st is None:
                continue
            entry = self._entries.get(id(st))
            if entry is None:
                if _counts(t, self.device_type):
                    new.append(self._add(t, static=False))
            elif entry.nbytes != self.round_bytes(st.nbytes()):  # resize_ through the dispatcher
                self._resize(entry, self.round_bytes(st.nbytes()))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.last_written = self._written(func, args, kwargs) if func._schema.is_mutable else ()
        if self.observer is not None:
            self.observer(func, inputs, new)
        return out

    # ----------------------------------------------------------------- internals

    def _written(self, func: Any, args: tuple, kwargs: dict) -> tuple[StorageEntry, ...]:
        """Entries of the arguments a mutable op writes (``add_``'s self, ``out=``)."""
        out = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only else None)
            for t in iter_tensors(value):
                e = self.entry(t)
                if e is not None:
                    out.append(e)
        return tuple(out)

    def round_bytes(self, n: int) -> int:
        """``n`` rounded up to the tracker's allocation granularity."""
        r = self.round_to
        return n if r == 1 else -(-n // r) * r

    def _add(self, t: torch.Tensor, *, static: bool, found: bool = False) -> StorageEntry | None:
        st = _storage(t)
        if st is None or not _counts(t, self.device_type):
            return None
        key = id(st)
        ref = weakref.ref(st, lambda _ref, key=key: self._free(key, _ref))
        entry = StorageEntry(next(self._serials), self.round_bytes(st.nbytes()), static, ref)
        self._entries[key] = entry
        self.live_bytes += entry.nbytes
        if static:
            self.static_bytes += entry.nbytes
            if found:
                self.found_bytes += entry.nbytes
        return entry

    def _free(self, key: int, ref: weakref.ref) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.ref is not ref:
            return
        del self._entries[key]
        self.live_bytes -= entry.nbytes
        if entry.static:
            self.static_bytes -= entry.nbytes

    def _resize(self, entry: StorageEntry, nbytes: int) -> None:
        delta = nbytes - entry.nbytes
        entry.nbytes = nbytes
        self.live_bytes += delta
        if entry.static:
            self.static_bytes += delta


def storage_bytes(tensors: Iterable[torch.Tensor], *, round_to: int = 1) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = _storage(t)
        if st is None or id(st) in seen:
            continue
        seen.add(id(st))
        n = st.nbytes()
        total += n if round_to <= 1 else -(-n // round_to) * round_to
    return total


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functorch wrappers
        return None


def _counts(t: torch.Tensor, device_type: str | None) -> bool:
    return device_type is None or t.device.type == device_type


def iter_tensors(*trees: Any) -> Iterator[torch.Tensor]:
    """Tensors in (nested) tuples, lists and dicts: a faster ``tree_leaves`` for op arguments."""
    for obj in trees:
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, (tuple, list)):
            yield from iter_tensors(*obj)
        elif isinstance(obj, dict):
            yield from iter_tensors(*obj.values())


__all__ = ["iter_tensors", "LiveBytesTracker", "Observer", "storage_bytes", "StorageEntry"]
