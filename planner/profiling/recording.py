"""Recording one training step, shared by real profiling (``profiler.py``) and fake-tensor
profiling (``meta.py``): the module-call bookkeeping (NOTE [ Units ]), the memory step under
the live-bytes tracker, and assembling the ``schema.Profile`` from what was recorded.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import platform
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import Self

from planner.model import schema
from planner.model.fingerprint import fingerprint
from planner.model.schema import LOSS_ID, ROOT_ID
from planner.profiling.measure import OPTIMIZERS, Measured
from planner.profiling.model_file import Inputs
from planner.profiling.tracker import LiveBytesTracker, StorageEntry, iter_tensors, storage_bytes
from planner.profiling.timing import UnitCost, WallClock, describe, signature, unit_costs
from planner.spec import StepSpec

Progress = Callable[[str], None]

_TO_COPY = torch.ops.aten._to_copy.default
"""What autocast's ``cached_cast`` runs to cast a parameter (below autocast, so the tracker sees it)."""
OP_TIMING_STEPS = 2
"""Extra steps timing each forward op (NOTE [ Op records ]); each op keeps its least time."""

_ROUND_TO = {"cuda": 512}
"""Allocation granularity per device type: the CUDA caching allocator rounds to 512 bytes."""


# ----------------------------------------------------------------------------- units


# NOTE [ Units ]
#
# A unit is one call of a module: the candidate for checkpointing. Its id is the module's
# FQN ('<root>' for the model itself), with '#k' appended for the k-th call (k >= 1) of the
# same module in the step (a shared block, a tied embedding). ``loss_fn`` runs as the
# pseudo-unit '<loss>'. Units are listed in the order their forward started; ``parent`` is
# the innermost unit running when the call started.
#
# Backward boundaries come from gradient hooks registered during the forward:
# ``bwd_start`` is when the gradient of the first of the unit's outputs is complete;
# ``bwd_end`` is when the gradients of all its inputs that require grad are complete (the
# last such hook to fire). A unit whose inputs need no gradient (an embedding of token ids,
# the first conv on images) ends its backward when the gradients of its parameters are
# complete, if its call is their first use in the step; otherwise ``bwd_end`` stays None.
# An input also consumed by a later sibling (q/k/v projections of one tensor) completes its
# gradient only after that sibling's backward, so the earlier sibling's ``bwd_end`` is late.

class UnitCall:
    """One module call while a step runs. ``fwd_*``/``bwd_*`` hold clock stamps or seqs."""

    __slots__ = (
        "bwd_end",
        "bwd_end_event",
        "bwd_start",
        "call_index",
        "depth",
        "fqn",
        "fwd_end",
        "fwd_start",
        "has_input_grads",
        "id",
        "index",
        "input_bytes",
        "input_ids",
        "key",
        "module_type",
        "output_bytes",
        "output_ids",
        "param_bytes",
        "parent",
    )

    def __init__(self, uid: str, fqn: str, call_index: int, module_type: str, parent: str | None,
                 depth: int, key: int | None, index: int):
        self.id, self.fqn, self.call_index, self.module_type = uid, fqn, call_index, module_type
        self.parent, self.depth, self.key, self.index = parent, depth, key, index
        self.fwd_start = self.fwd_end = self.bwd_start = self.bwd_end = None
        self.bwd_end_event: int | None = None
        self.has_input_grads = False
        self.input_ids: list[int] = []
        self.output_ids: list[int] = []
        self.input_bytes = self.output_bytes = self.param_bytes = 0


@dataclass
class _Point:
    """One gradient that units listen to (see NOTE [ Gradient points ])."""

    ref: weakref.ref
    node: int | None
    """Sequence number of the tensor's grad_fn when hooked; it changes if modified in place."""
    units: list[UnitCall]


class Recorder:
    """Module-call bookkeeping shared by the timing and the memory step (see NOTE [ Units ]).

    Subclasses say what a point in time is (``_note``: a clock stamp, or a seq plus a
    timeline event) and may look at each unit's inputs and outputs.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.named = list(model.named_modules())
        self.names = {id(m): name for name, m in self.named}
        self.modules = {id(m): m for _, m in self.named}
        self.handles: list[Any] = []
        self.grad_handles: list[Any] = []
        self.reset()

    def reset(self) -> None:
        self._remove(self.grad_handles)
        self.units: list[UnitCall] = []
        self.stack: list[UnitCall] = []
        self.calls: dict[int, int] = {}
        self.first_use: dict[torch.nn.Parameter, int] = {}
        self.end_points: dict[int, _Point] = {}
        self.start_points: dict[int, _Point] = {}
        self.marks: dict[str, Any] = {}
        self.in_forward = False

    def __enter__(self) -> Self:
        try:
            for _, m in self.named:
                self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
                self.handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        except BaseException:
            self._remove(self.handles)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove(self.handles)
        self._remove(self.grad_handles)

    @staticmethod
    def _remove(handles: list[Any]) -> None:
        while handles:
            handles.pop().remove()

    # ------------------------------------------------------------- step marks

    def mark(self, name: str, value: Any = None) -> None:
        """The step's ``mark`` callback (``planner.profiling.measure.STEP_MARKS``)."""
        if name == "step_start":
            self.in_forward = True
            self.marks[name] = self._note(name, None)
        elif name == "loss_start":
            self._enter(None, LOSS_ID, LOSS_ID, "loss_fn", (value,), {})
        elif name == "forward_end":
            if self.stack and self.stack[-1].key is None:
                self._exit(self.stack[-1], (), {}, value)
            self.in_forward = False
            self.marks[name] = self._note(name, None)
        else:
            self.marks[name] = self._note(name, None)

    # ------------------------------------------------------------- module hooks

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.in_forward:  # e.g. recomputation by the model's own checkpointing
            return
        fqn = self.names[id(module)]
        unit = self._enter(id(module), fqn or ROOT_ID, fqn, type(module).__name__, args, kwargs)
        for p in module.parameters(recurse=False):
            self.first_use.setdefault(p, unit.index)

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.stack and self.stack[-1].key == id(module):
            self._exit(self.stack[-1], args, kwargs, output, module)

    def _enter(self, key: int | None, base: str, fqn: str, module_type: str, args: tuple, kwargs: dict) -> UnitCall:
        k = self.calls.get(key, 0) if key is not None else 0
        if key is not None:
            self.calls[key] = k + 1
        parent = self.stack[-1] if self.stack and key is not None else None
        unit = UnitCall(base if k == 0 else f"{base}#{k}", fqn, k, module_type,
                     parent.id if parent else None, len(self.stack) if key is not None else 0, key, len(self.units))
        self.units.append(unit)
        self.stack.append(unit)
        unit.fwd_start = self._note("fwd_start", unit)
        self._on_inputs(unit, args, kwargs)
        # Hooked now, before forward runs: an in-place module (ReLU(inplace=True)) would
        # otherwise hand us its input already turned into its output.
        for t in io_tensors(args, kwargs):
            if t.requires_grad:
                unit.has_input_grads = True
                self._listen_end(t, unit)
        return unit

    def _exit(self, unit: UnitCall, args: tuple, kwargs: dict, output: Any,
              module: torch.nn.Module | None = None) -> None:
        self.stack.pop()
        self._on_outputs(unit, output)
        unit.fwd_end = self._note("fwd_end", unit)
        for t in io_tensors(output):
            if t.requires_grad:
                self._listen_start(t, unit)
        if not unit.has_input_grads and module is not None:
            # NOTE [ Units ]: parameters first used in this call complete their gradient
            # when this call's backward is done.
            for p in module.parameters():
                if p.requires_grad and self.first_use.get(p, -1) >= unit.index:
                    self._listen_end(p, unit)

    # NOTE [ Gradient points ]
    # Units nest and share tensors: a block's input is its first child's input, its output
    # its last child's output, one unit's output the next one's input. Autograd runs the
    # hooks on one gradient in the order they were registered, which is not the order of
    # the units' backward. So each gradient gets one hook (a "point") that notes every unit
    # listening to it in backward order: ends innermost and latest-called first, then starts
    # outermost first. Ends hook the tensor and starts the node that made it; autograd runs
    # a node's tensor hooks before its node hooks, so when one unit's output is the next
    # one's input, the next unit's backward ends before this one's starts.

    def _listen_end(self, t: torch.Tensor, unit: UnitCall) -> None:
        self._listen(self.end_points, t, unit, self._fire_ends, lambda t, fn: t.register_hook(fn))

    def _listen_start(self, t: torch.Tensor, unit: UnitCall) -> None:
        def register(t: torch.Tensor, fn: Callable[[Any], None]) -> Any:
            return t.register_hook(fn) if t.grad_fn is None else t.grad_fn.register_prehook(fn)

        self._listen(self.start_points, t, unit, self._fire_starts, register)

    def _listen(self, points: dict[int, _Point], t: torch.Tensor, unit: UnitCall,
                fire: Callable[[list[UnitCall], Any], None], register: Callable[..., Any]) -> None:
        node = t.grad_fn._sequence_nr() if t.grad_fn is not None else None
        point = points.get(id(t))
        if point is None or point.ref() is not t or point.node != node:  # new, or modified in place
            point = points[id(t)] = _Point(weakref.ref(t), node, [])
            self.grad_handles.append(register(t, functools.partial(fire, point.units)))
        if unit not in point.units:
            point.units.append(unit)

    def _fire_ends(self, units: list[UnitCall], _grad: Any) -> None:
        for unit in sorted(units, key=lambda u: -u.index):
            if unit.bwd_start is None:  # an identity (shortcut, loss_fn returning its input)
                unit.bwd_start = self._note("bwd_start", unit)
            unit.bwd_end = self._note("bwd_end", unit)  # the last gradient to complete wins

    def _fire_starts(self, units: list[UnitCall], _grads: Any) -> None:
        for unit in sorted(units, key=lambda u: u.index):
            if unit.bwd_start is None:
                unit.bwd_start = self._note("bwd_start", unit)

    # ------------------------------------------------------------- subclass points

    def _note(self, kind: str, unit: UnitCall | None) -> Any:
        raise NotImplementedError

    def _on_inputs(self, unit: UnitCall, args: tuple, kwargs: dict) -> None:
        pass

    def _on_outputs(self, unit: UnitCall, output: Any) -> None:
        pass


def io_tensors(*trees: Any) -> Iterator[torch.Tensor]:
    """Tensors among a module's inputs or outputs: pytree knows ``ModelOutput`` and friends;
    containers it does not know are searched as plain tuples, lists and dicts."""
    for leaf in pytree.tree_leaves(trees):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif isinstance(leaf, (tuple, list)):
            yield from io_tensors(*leaf)
        elif isinstance(leaf, Mapping):
            yield from io_tensors(*leaf.values())


@dataclass
class StepTimes:
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    unit_ms: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Unit id -> (forward ms, backward ms), medians over the steps it appeared in."""
    unit_ids: list[list[str]] = field(default_factory=list)
    """The unit ids of each timing step, to check the steps called the same modules."""
    unit_samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Unit id -> its (forward ms, backward ms) in each step, for pooling (NOTE [ Unit costs ])."""
    phase_spread_ms: dict[str, float] = field(default_factory=dict)
    """'forward', 'backward', 'optimizer' -> the spread of the phase's times (NOTE [ Unit costs ], Rule 4)."""



# ----------------------------------------------------------------------------- memory step


@dataclass
class _Event:
    seq: int
    kind: str
    unit: str | None
    live_bytes: int
    peak_bytes: int
    superseded: bool = False


@dataclass
class _Tensor:
    id: int
    nbytes: int
    created_seq: int
    producer: str | None


@dataclass
class _OpCall:
    seq: int
    unit: str
    name: str
    new: list[StorageEntry]
    ms: float
    flops: float
    random: bool
    inplace: bool
    view: bool
    ordinal: int
    """Position among all counted forward ops of the step (``counted_op``), units or not."""
    data_dependent: bool = False
    writes: int | None = None
    """Seq of the op that allocated the storage this in-place op writes."""
    mutated: bool = False
    read_since_alloc: bool = False
    writes_after_read: bool = False
    """An op other than its writers read the output before a write (NOTE [ Op records ])."""


_SAC_IGNORED_OPS = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})
"""Ops selective checkpointing neither counts nor caches (see NOTE [ Op records ])."""


def counted_op(func: Any) -> bool:
    """An op selective checkpointing counts; the profiler's own markers (``record_function``,
    which only the measuring steps run) are not ops of the model."""
    return func not in _SAC_IGNORED_OPS and getattr(func, "namespace", "") != "profiler"


class _OpTimer(TorchDispatchMode):
    """Time of every counted op of the forward, in order, on the profile's clock (NOTE [ Op
    records ]): a few extra steps give each op the least of its times, which noise on a shared
    machine only raises."""

    def __init__(self, clock: Any, sync: Callable[[], None] | None):
        super().__init__()
        self.clock, self.sync = clock, sync
        self.ms: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.sync is not None:
            self.sync()
        t0 = self.clock.stamp()
        out = func(*args, **(kwargs or {}))
        if self.sync is not None:
            self.sync()
        if counted_op(func):
            self.ms.append(self.clock.ms(t0, self.clock.stamp()))
        return out


def op_timing_steps(step: Callable, dev: torch.device, steps: int, clock: Any | None = None) -> list[list[float]]:
    """Per step, the forward's counted op times (``_OpTimer``) on ``clock`` (the profile's; on CUDA
    and by default the wall clock, synchronised around each op on CUDA)."""
    sync = functools.partial(torch.cuda.synchronize, dev) if dev.type == "cuda" else None
    if clock is None or dev.type == "cuda":
        clock = WallClock()
    runs = []
    for _ in range(steps):
        timer = _OpTimer(clock, sync)

        def mark(name: str, _value: Any = None, timer: _OpTimer = timer) -> None:
            if name == "step_start":
                timer.__enter__()
            elif name == "forward_end":
                timer.__exit__(None, None, None)

        step(mark)
        runs.append(timer.ms)
    return runs


class MemoryRecorder(Recorder):
    """Sequence numbers, tensors, saves, parameter uses and the timeline of one step."""

    def __init__(self, model: torch.nn.Module, tracker: LiveBytesTracker):
        self.tracker = tracker
        self.seq = 0
        self.events: list[_Event] = []
        self.created: dict[int, tuple[int, str | None]] = {}
        """Storage serial -> (seq, innermost unit) when it was allocated in the forward."""
        self.tensors: dict[int, _Tensor] = {}
        """Storage serial -> its TensorRecord, for storages that are saved or unit inputs/outputs."""
        self.saves: list[tuple[int, int, str]] = []
        self.saved_pairs: set[tuple[int, str]] = set()
        self.unattributed_saves = 0
        self.param_last_use: dict[int, int] = {}
        """Storage serial of a parameter -> seq of the last forward op that read it."""
        self.param_bytes_cache: dict[int, int] = {}
        self.autocast = False
        """The step runs its forward under autocast (``torch.is_autocast_enabled`` reads False down here)."""
        self.autocast_cached: set[int] = set()
        """Tensor ids of the casts of parameters autocast made (and cached) in the forward."""
        self.op_calls: list[_OpCall] = []
        """Ops run inside units during the forward (NOTE [ Op records ])."""
        self.forward_ops = 0
        """Counted forward ops so far, inside units or not (``_OpCall.ordinal``)."""
        self.op_of_serial: dict[int, int] = {}
        """Storage serial -> index in ``op_calls`` of the op that allocated it."""
        self.op_time_note = ""
        self.on_event: Callable[[int], None] | None = None
        """Called with each event's seq, so the device's allocator view can mark the moment."""
        self.ops: list[Any] = []
        """The aten ops of the forward, in order (for the units' signatures)."""
        self.op_start: dict[str, tuple[int, str]] = {}
        """Unit id -> (index into ``ops`` when it started, ``describe`` of its inputs)."""
        self.signatures: dict[str, str] = {}
        """Unit id -> ``planner.profiling.timing.signature`` (NOTE [ Unit costs ], Rule 3)."""
        super().__init__(model)
        tracker.observer = self._on_op

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _note(self, kind: str, unit: UnitCall | None) -> int:
        seq = self._next()
        live = self.tracker.live_bytes
        peak = max(self.tracker.mark(), live)
        if kind == "bwd_end" and unit is not None:
            if unit.bwd_end_event is not None:
                self.events[unit.bwd_end_event].superseded = True
            unit.bwd_end_event = len(self.events)
        self.events.append(_Event(seq, kind, unit.id if unit else None, live, peak))
        if self.on_event is not None:
            self.on_event(seq)
        return seq

    def _on_op(self, func: Any, inputs: list[StorageEntry], new: list[StorageEntry]) -> None:
        ms, flops = self._op_cost()
        if not self.in_forward:
            return
        self.ops.append(func)
        producer = self.stack[-1].id if self.stack else None
        if counted_op(func):
            if producer is not None:
                self._record_op(func, inputs, new, ms, flops)
            self.forward_ops += 1
        for e in new:
            self.created[e.serial] = (self._next(), producer)
        if self.autocast and func is _TO_COPY and len(new) == 1 and inputs and inputs[0].serial in self.param_last_use:
            # NOTE [ Peak-memory model ], autocast: the cast is cached until the forward's autocast
            # region exits, whether or not anything saves it.
            self.autocast_cached.add(self._tensor_id(new[0]))
        for e in inputs:
            if e.serial in self.param_last_use:
                self.param_last_use[e.serial] = self.seq

    # NOTE [ Op records ]
    # Every aten op that runs inside a unit during the forward is recorded, in order, as
    # ``torch.utils.checkpoint``'s selective checkpointing sees it (a dispatch mode below
    # autograd; its ignored ops, such as ``aten.detach``, left out), so that "the k-th
    # ``aten.mm.default`` in the forward of unit u" names the same op call here and in the
    # applier's policy (planner/act/applier.py). Per op: the storages it allocated (its outputs:
    # what keeping it costs), its time (the least over the op timing steps, on the profile's
    # clock: on the CPU the same clock as the units' forward times, so that their difference is
    # the forward's Python work; the wall time synchronised around the op on CUDA; the roofline
    # on meta; the memory step's wall time if no timing step ran the same ops), pooled like unit
    # costs: the op at the same place in every unit of one cost group gets the least of their
    # times, so identical units get identical menus (NOTE [ Unit costs ], Rule 3), whether it draws random numbers, writes an input in
    # place, returns a view, or has an output written in place later: such an output can be
    # kept only together with every op that writes it (then none of them reruns, and the kept
    # storage holds the final values), and only if no other op reads it between its allocation
    # and a write (that reader, recomputed, would see the final values instead). The CPU's
    # dropout is such a group: ``empty_like``, ``bernoulli_``, ``div_``, read by ``mul``. Which tensors backward needs is
    # known per storage from the saves, as for units; attributing a save to one op would be a
    # guess, since autograd packs an op's inputs before the op runs and its outputs after.

    def _op_cost(self) -> tuple[float, float]:
        """(ms, FLOPs) of the op the tracker just ran; the meta recorder reads its roofline."""
        return self.tracker.last_op_ms, 0.0

    def _record_op(self, func: Any, inputs: list[StorageEntry], new: list[StorageEntry], ms: float,
                   flops: float) -> None:
        written = {e.serial for e in self.tracker.last_written}
        writes = None
        for serial in written:
            k = self.op_of_serial.get(serial)
            if k is not None:
                alloc = self.op_calls[k]
                alloc.mutated = True
                alloc.writes_after_read |= alloc.read_since_alloc
                writes = alloc.seq if writes is None else writes
        for e in inputs:
            k = self.op_of_serial.get(e.serial)
            if k is not None and e.serial not in written:
                self.op_calls[k].read_since_alloc = True
        for e in new:
            self.op_of_serial[e.serial] = len(self.op_calls)
        tags = getattr(func, "tags", ())
        self.op_calls.append(_OpCall(self._next(), self.stack[-1].id, str(func), list(new), ms, flops,
                                torch.Tag.nondeterministic_seeded in tags, func._schema.is_mutable, func.is_view,
                                self.forward_ops, torch.Tag.dynamic_output_shape in tags, writes))

    def use_op_times(self, runs: list[list[float]]) -> bool:
        """Each op's least time over ``runs`` (those that ran the same ops as the memory step), pooled
        over the op calls at the same place in the units of one cost group (NOTE [ Op records ]);
        False, and the memory step's wall times kept, when no run matched."""
        runs = [r for r in runs if len(r) == self.forward_ops]
        if not runs:
            return False
        for op in self.op_calls:
            op.ms = min(r[op.ordinal] for r in runs)
        self._pool_op_times()
        return True

    def _pool_op_times(self) -> None:
        """The least time of each op over the members of its unit's cost group, at the same index
        among the unit's own op calls (the signature holds the op sequence, so they align)."""
        by_unit: dict[str, list[_OpCall]] = {}
        for op in self.op_calls:
            by_unit.setdefault(op.unit, []).append(op)
        groups: dict[str, list[list[_OpCall]]] = {}
        for uid, ops in by_unit.items():
            if sig := self.signatures.get(uid):
                groups.setdefault(sig, []).append(ops)
        for members in groups.values():
            if len(members) < 2 or len({len(m) for m in members}) != 1:
                continue
            for same in zip(*members):
                if len({o.name for o in same}) == 1:
                    least = min(o.ms for o in same)
                    for o in same:
                        o.ms = least

    def op_records(self, remap: dict[int, int]) -> list[schema.OpRecord]:
        return [schema.OpRecord(seq=op.seq, unit=op.unit, name=op.name,
                                output_ids=[remap[self.tensors[e.serial].id] for e in op.new],
                                output_bytes=sum(e.nbytes for e in op.new), forward_ms=op.ms, flops=op.flops,
                                random=op.random, inplace=op.inplace, view=op.view, mutated=op.mutated,
                                data_dependent=op.data_dependent, writes=op.writes,
                                read_between_writes=op.writes_after_read)
                for op in self.op_calls]

    def register_op_outputs(self) -> None:
        """Give every op output a tensor record (before the ids are numbered)."""
        for op in self.op_calls:
            for e in op.new:
                self._tensor_id(e)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` pack hook: note the save, keep the tensor as it is."""
        if not self.in_forward:
            return t
        e = self.tracker.entry(t)
        if e is None or e.static:  # parameters, their views, buffers, the batch: not new memory
            return t
        if not self.stack:
            self.unattributed_saves += 1
            return t
        unit = self.stack[-1].id
        tid = self._tensor_id(e)
        if (tid, unit) not in self.saved_pairs:
            self.saved_pairs.add((tid, unit))
            self.saves.append((tid, self._next(), unit))
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _tensor_id(self, e: StorageEntry) -> int:
        rec = self.tensors.get(e.serial)
        if rec is None:
            seq, producer = self.created.get(e.serial, (self.seq, self.stack[-1].id if self.stack else None))
            rec = self.tensors[e.serial] = _Tensor(len(self.tensors), e.nbytes, seq, producer)
        return rec.id

    def _io(self, *trees: Any) -> tuple[list[int], int]:
        seen: set[int] = set()
        ids: list[int] = []
        total = 0
        for t in io_tensors(*trees):
            e = self.tracker.entry(t)
            if e is None:
                continue
            if e.serial in seen:
                continue
            seen.add(e.serial)
            total += e.nbytes
            if not e.static:
                ids.append(self._tensor_id(e))
        return ids, total

    def _on_inputs(self, unit: UnitCall, args: tuple, kwargs: dict) -> None:
        self.op_start[unit.id] = (len(self.ops), describe(io_tensors(args, kwargs)))
        unit.input_ids, unit.input_bytes = self._io(args, kwargs)
        if unit.key is not None:
            if unit.key not in self.param_bytes_cache:
                params = self.modules[unit.key].parameters()
                self.param_bytes_cache[unit.key] = storage_bytes(params, round_to=self.tracker.round_to)
            unit.param_bytes = self.param_bytes_cache[unit.key]

    def _on_outputs(self, unit: UnitCall, output: Any) -> None:
        unit.output_ids, unit.output_bytes = self._io(output)
        start, inputs = self.op_start.pop(unit.id)
        params = describe(self.modules[unit.key].parameters()) if unit.key is not None else ""
        self.signatures[unit.id] = signature(unit.module_type, params, inputs, describe(io_tensors(output)),
                                             self.ops[start:])

    def timeline(self) -> list[schema.MemoryEvent]:
        """The events, a superseded ``bwd_end`` folded into the next kept event's peak."""
        out: list[schema.MemoryEvent] = []
        carried = 0
        for ev in self.events:
            if ev.superseded:
                carried = max(carried, ev.peak_bytes)
                continue
            out.append(schema.MemoryEvent(seq=ev.seq, kind=ev.kind, unit=ev.unit, live_bytes=ev.live_bytes,
                                          peak_bytes=max(ev.peak_bytes, carried)))
            carried = 0
        return out


@dataclass
class _Memory:
    recorder: MemoryRecorder
    params_bytes: int
    buffers_bytes: int
    batch_bytes: int
    optimizer_bytes: int
    grads_bytes: int
    found_bytes: int
    optimizer_transient_bytes: int
    static_bytes: int
    """What was live before the step: parameters, buffers, optimizer state, batch, found tensors."""
    param_records: list[schema.ParamRecord]
    unused_params: int


def memory_step(model: torch.nn.Module, step: Callable, inputs: Inputs,
                 opt: torch.optim.Optimizer | None, dev: torch.device, *, recipe: schema.Recipe,
                 round_to: int | None = None,
                 recorder: Callable[[torch.nn.Module, LiveBytesTracker], MemoryRecorder] | None = None) -> _Memory:
    """One step under the tracker. ``round_to`` (default: ``dev``'s) and ``recorder`` are
    for planner/profiling/meta.py, whose fake CPU tensors follow CUDA's rules and whose recorder also
    notes the roofline's clock. Gradients a ``zero_grad(set_to_none=False)`` recipe keeps
    from the last step are static here (alive before the step, as in training)."""
    release_grads(model, dev, recipe)
    round_to = _ROUND_TO.get(dev.type, 1) if round_to is None else round_to
    tracker = LiveBytesTracker(device_type=dev.type, round_to=round_to)
    params = [p for p in model.parameters()]
    params_bytes = tracker.register_static(params)
    buffers_bytes = tracker.register_static(model.buffers())
    optimizer_bytes = tracker.register_static(_optimizer_tensors(opt))
    batch_bytes = tracker.register_static(iter_tensors(inputs))
    kept_grads_bytes = tracker.register_static(p.grad for p in params if p.grad is not None)
    rec = (recorder or MemoryRecorder)(model, tracker)
    rec.autocast = recipe.amp is not None
    serials: dict[str, int] = {}
    for name, p in model.named_parameters():
        e = tracker.entry(p)
        if e is not None and p.requires_grad:
            serials[name] = e.serial
            rec.param_last_use[e.serial] = -1
    with _allocator_view(dev) as view, rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), \
            tracker:
        rec.on_event = view.note
        step(rec.mark)
    view.apply(rec.events, params_bytes + buffers_bytes + optimizer_bytes + batch_bytes + kept_grads_bytes
               + tracker.found_bytes)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grads_bytes = storage_bytes(grads, round_to=tracker.round_to)
    records: list[schema.ParamRecord] = []
    forward_end = rec.marks["forward_end"]
    unused = 0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            unused += 1
            continue
        last = rec.param_last_use.get(serials.get(name, -1), -1)
        records.append(schema.ParamRecord(name=name, nbytes=tracker.round_bytes(p.numel() * p.element_size()),
                                          grad_seq=last if last >= 0 else forward_end))
    events = {e.kind: e for e in rec.events if e.unit is None}
    transient = events["optimizer_end"].peak_bytes - events["backward_end"].live_bytes
    static = params_bytes + buffers_bytes + optimizer_bytes + batch_bytes + kept_grads_bytes + tracker.found_bytes
    return _Memory(rec, params_bytes, buffers_bytes, batch_bytes, optimizer_bytes, grads_bytes, tracker.found_bytes,
                   max(transient, 0), static, records, unused)


# NOTE [ Step as run ]
#
# The live-bytes tracker is a ``TorchDispatchMode``, and PyTorch runs some steps differently
# while any Python dispatch mode is active: every tensor counts as "subclass-like" then, which
# turns off autograd's in-place accumulation of gradients (each accumulation allocates a new
# buffer). Most models never notice; a Hugging Face Mamba's reference CPU scan accumulates the
# gradient of its whole scan input once per token, and its backward peaks one scan input
# (batch x channels x tokens x state) higher under the tracker than as the user runs it.
#
# Rule 1. The memory step under the tracker gives the step's *structure*: module calls,
# tensors, saves, op records. The forward's allocations do not change under a mode.
# Rule 2. Its *timeline* (the live and peak bytes of every event, from which the cost model
# calibrates its temporaries) comes from one more step run as the user runs it: the same
# module and gradient hooks mark the same events (``as_run_timeline``), with no dispatch mode
# and no saved-tensor hooks, and the device allocator reports the bytes (``_allocator_view``).
# ``StepRecord.timeline_source`` is then 'as-run', and ``tracked_peak_bytes`` keeps the tracked
# step's peak beside the measured one.
# Rule 3. When that step's events are not the memory step's (its module calls changed: data-
# dependent control flow) or the device has no allocator view, the tracked timeline is kept
# ('tracked'). Either way the timeline's peak must agree with the peak the device measures on
# the plain step (``measure_step``) within ``RECONCILE_TOLERANCE``: a plan calibrated on a
# timeline that is not the user's step is refused, with both figures
# (``planner.profiling.profiler.reconcile``).


class _TrackerView:
    """The timeline as the tracker saw it (fake tensors; or no allocator view available)."""

    def note(self, seq: int) -> None:
        pass

    def apply(self, events: list[_Event], static_bytes: int) -> bool:
        """Set the events' live and peak bytes from the allocator; False when it could not."""
        return False


class _CudaAllocatorView(_TrackerView):
    """Live and peak bytes of every event from the CUDA caching allocator itself.

    The tracker sees tensor storages; the allocator also sees cuBLAS/cuDNN workspaces and its
    own block rounding, which are real memory. ``memory_allocated`` is host-side bookkeeping,
    exact at launch time without a synchronisation.
    """

    def __init__(self, dev: torch.device):
        self.dev, self.points = dev, {}
        torch.cuda.reset_peak_memory_stats(dev)

    def note(self, seq: int) -> None:
        self.points[seq] = (torch.cuda.memory_allocated(self.dev), torch.cuda.max_memory_allocated(self.dev))
        torch.cuda.reset_peak_memory_stats(self.dev)

    def apply(self, events: list[_Event], static_bytes: int) -> bool:
        for ev in events:
            if ev.seq in self.points:
                ev.live_bytes, ev.peak_bytes = self.points[ev.seq]
        return True


class _CpuAllocatorView(_TrackerView):
    """Live and peak bytes of every event from the CPU allocator's own events.

    ``torch.profiler`` with ``profile_memory=True`` records every CPU allocation and free,
    scratch memory inside kernels included (CPU convolution backward allocates megabytes the
    tracker cannot see); a ``record_function`` marker per event places the events among them
    in time (nanosecond timestamps of the same clock).
    """

    PREFIX = "remat::event::"

    def __init__(self, prof: Any):
        self.prof = prof

    def note(self, seq: int) -> None:
        with torch.autograd.profiler.record_function(f"{self.PREFIX}{seq}"):
            pass

    def apply(self, events: list[_Event], static_bytes: int) -> bool:
        from planner.profiling.measure import cpu_allocations

        kev = self.prof.profiler.kineto_results.events()
        mem = cpu_allocations(self.prof)
        marks = {int(e.name()[len(self.PREFIX):]): e.start_ns() for e in kev if e.name().startswith(self.PREFIX)}
        if len(marks) < len(events):
            return False  # the profiler lost markers: keep the tracker's view
        running = peak = 0
        i = 0
        for ev in events:
            t = marks[ev.seq]
            while i < len(mem) and mem[i][0] <= t:
                running += mem[i][1]
                peak = max(peak, running)
                i += 1
            ev.live_bytes = static_bytes + running
            ev.peak_bytes = static_bytes + max(peak, running)
            peak = running
        return True


class _AsRunRecorder(Recorder):
    """The memory step's events, marked in the allocator's view with nothing else running (NOTE [ Step as run ])."""

    def __init__(self, model: torch.nn.Module, view: _TrackerView):
        self.view = view
        self.events: list[_Event] = []
        super().__init__(model)

    def _note(self, kind: str, unit: UnitCall | None) -> int:
        seq = len(self.events)
        self.events.append(_Event(seq, kind, unit.id if unit else None, 0, 0))
        self.view.note(seq)
        return seq


@dataclass
class AsRun:
    """What ``as_run_timeline`` saw."""

    unit_ids: list[str]
    """The units of the as-run step (NOTE [ Worst step ])."""
    matched: bool
    """Its events were the memory step's and the allocator gave their bytes: the memory step's events now
    carry the as-run live and peak bytes."""
    tracked_peak_bytes: int = 0
    """The memory step's peak before its events took the as-run bytes."""
    excess_live_bytes: int = 0
    """The most the memory step had alive beyond the as-run step at one event (NOTE [ Step as run ], Rule 3)."""
    excess_at: str = ""
    """That event, e.g. 'fwd_end of h.0'."""


def as_run_timeline(model: torch.nn.Module, step: Callable, dev: torch.device, mem: _Memory, *,
                    recipe: schema.Recipe) -> AsRun:
    """Run the step as the user runs it and, when its events are the memory step's, give those events the
    allocator's live and peak bytes of this run (NOTE [ Step as run ])."""
    release_grads(model, dev, recipe)
    with _allocator_view(dev) as view, _AsRunRecorder(model, view) as rec:
        step(rec.mark)
    events = mem.recorder.events
    ids = [u.id for u in rec.units]
    if [(e.kind, e.unit) for e in rec.events] != [(e.kind, e.unit) for e in events]:
        return AsRun(ids, False)
    if not view.apply(rec.events, mem.static_bytes):
        return AsRun(ids, False)
    tracked = max((e.peak_bytes for e in events), default=0)
    excess, at = max(((mine.live_bytes - theirs.live_bytes, f"{mine.kind} of {mine.unit}" if mine.unit else mine.kind)
                      for mine, theirs in zip(events, rec.events)), default=(0, ""), key=lambda x: x[0])
    for mine, theirs in zip(events, rec.events):
        mine.live_bytes, mine.peak_bytes = theirs.live_bytes, theirs.peak_bytes
    return AsRun(ids, True, tracked, excess, at)


@contextlib.contextmanager
def _allocator_view(dev: torch.device) -> Iterator[_TrackerView]:
    """The device allocator's view of the memory step's timeline (see the view classes)."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None:  # planner/profiling/meta.py: fake tensors allocate nothing; the tracker is exact
        yield _TrackerView()
        return
    if dev.type == "cuda":
        yield _CudaAllocatorView(dev)
        return
    if dev.type != "cpu":
        yield _TrackerView()
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from planner.profiling.measure import quiet_stderr

    prof = torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():
        prof.__enter__()
    try:
        yield _CpuAllocatorView(prof)
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)


def _optimizer_tensors(opt: torch.optim.Optimizer | None) -> Iterator[torch.Tensor]:
    if opt is None:
        return
    for state in opt.state.values():
        yield from iter_tensors(state)


def release_grads(model: torch.nn.Module, dev: torch.device, recipe: schema.Recipe | None = None) -> None:
    """Free the last step's gradients (and, on CUDA, its cyclic garbage) before a measured step.

    ``max_memory_allocated`` is absolute, so garbage still holding device memory would count
    in the CUDA peak. The tracker and the CPU profiler see only what the step allocates, so
    on the CPU a full ``gc.collect()`` (0.1 s and more) would buy nothing. A recipe with
    ``zero_grad(set_to_none=False)`` keeps its gradients: they are alive when its steps start.
    """
    if recipe is None or recipe.zero_grad_set_to_none:
        model.zero_grad(set_to_none=True)
    if dev.type != "cpu":
        gc.collect()


# ----------------------------------------------------------------------------- assembling


def assemble_profile(model: torch.nn.Module, inputs: Inputs, dev: torch.device, step: StepSpec, times: StepTimes,
                     mem: _Memory, measured: Measured, *, as_run: AsRun | None = None) -> schema.Profile:
    """The ``schema.Profile`` of what the steps recorded, for ``step`` run on ``dev``: ``mem`` (the memory
    step's recorder), the timing steps' ``times``, the device's ``measured`` peak and ``as_run``, what
    ``as_run_timeline`` saw, if it ran."""
    rec = mem.recorder
    notes = _profile_notes(mem, times, measured, step.optimizer, as_run)
    rec.register_op_outputs()
    # Ids in creation order, so reading the list follows the step.
    order = sorted(rec.tensors.values(), key=lambda t: (t.created_seq, t.id))
    remap = {t.id: i for i, t in enumerate(order)}
    tensors = [schema.TensorRecord(id=remap[t.id], nbytes=t.nbytes, created_seq=t.created_seq, producer=t.producer,
                                   autocast_cached=t.id in rec.autocast_cached)
               for t in order]
    costs = _pooled_costs(times, rec.signatures)
    units = [_unit_record(u, costs.get(u.id, UnitCost(0.0, 0.0, 0)), rec.signatures.get(u.id, ""), remap) for u in rec.units]
    saves = [schema.SaveRecord(tensor_id=remap[tid], seq=seq, unit=unit) for tid, seq, unit in rec.saves]
    structure = step_structure({**{f"timing step {i + 1}": ids for i, ids in enumerate(times.unit_ids)},
                                "memory step": [u.id for u in rec.units],
                                **({"as-run step": as_run.unit_ids} if as_run else {})})
    return schema.Profile(
        fingerprint=fingerprint(model, inputs),
        device=dev.type,
        device_name=_device_name(dev),
        dtype=_dtype(model),
        recipe=step.recipe,
        optimizer=step.optimizer.lower(),
        torch_version=torch.__version__,
        created_at=schema.now_iso(),
        units=units,
        tensors=tensors,
        saves=saves,
        params=mem.param_records,
        ops=rec.op_records(remap),
        timeline=rec.timeline(),
        step=_step_record(mem, times, measured, step, as_run),
        step_structure=structure,
        notes=notes,
    )


def _profile_notes(mem: _Memory, times: StepTimes, measured: Measured, optimizer: str,
                   as_run: AsRun | None) -> list[str]:
    """What a reader of the profile should know about how its step ran."""
    rec = mem.recorder
    notes: list[str] = []
    if opt_note := _OPTIMIZER_NOTE.get(optimizer.lower()):
        notes.append(opt_note)
    memory_ids = [u.id for u in rec.units]
    if any(ids != memory_ids for ids in times.unit_ids):
        notes.append("the module calls differed between steps (data-dependent control flow?); "
                     "times are matched to units by id")
    if mem.found_bytes:
        notes.append(f"{mem.found_bytes} bytes of tensors held outside parameters and buffers (plain attributes, "
                     f"globals) were live before the step; counted in buffers_bytes")
    if mem.unused_params:
        notes.append(f"{mem.unused_params} trainable parameter(s) got no gradient (not used in the forward)")
    if rec.op_time_note:
        notes.append(rec.op_time_note)
    if rec.unattributed_saves:
        notes.append(f"{rec.unattributed_saves} tensor(s) saved for backward outside any module call were ignored")
    timeline_peak = max((e.peak_bytes for e in rec.events), default=0)
    matched = as_run is not None and as_run.matched
    if matched and abs(as_run.tracked_peak_bytes - timeline_peak) > 0.02 * max(timeline_peak, 1):
        notes.append(f"the step runs differently under remat's tracker (NOTE [ Step as run ]): it peaked at "
                     f"{as_run.tracked_peak_bytes} bytes there and at {timeline_peak} bytes as run; the timeline is "
                     f"the step as run")
    if measured.peak_bytes and abs(measured.peak_bytes - timeline_peak) > 0.02 * measured.peak_bytes:
        notes.append(f"{'as-run' if matched else 'tracked'} peak {timeline_peak} bytes differs from the "
                     f"{measured.source} peak {measured.peak_bytes} bytes by more than 2%")
    return notes


def _step_record(mem: _Memory, times: StepTimes, measured: Measured, step: StepSpec,
                 as_run: AsRun | None) -> schema.StepRecord:
    rec = mem.recorder
    matched = as_run is not None and as_run.matched
    return schema.StepRecord(
        params_bytes=mem.params_bytes,
        buffers_bytes=mem.buffers_bytes + mem.found_bytes,
        batch_bytes=mem.batch_bytes,
        grads_bytes=mem.grads_bytes,
        optimizer_bytes=mem.optimizer_bytes,
        optimizer_step_transient_bytes=mem.optimizer_transient_bytes,
        forward_ms=times.forward_ms,
        backward_ms=times.backward_ms,
        optimizer_ms=times.optimizer_ms,
        forward_spread_ms=times.phase_spread_ms.get("forward", 0.0),
        backward_spread_ms=times.phase_spread_ms.get("backward", 0.0),
        step_ms=step.recipe.grad_accum * (times.forward_ms + times.backward_ms) + times.optimizer_ms,
        forward_end_seq=rec.marks["forward_end"],
        backward_start_seq=rec.marks["backward_start"],
        measured_peak_bytes=measured.peak_bytes,
        peak_source=measured.source,
        warmup_steps=step.warmup_steps,
        measured_steps=step.steps,
        timeline_source="as-run" if matched else "tracked",
        tracked_peak_bytes=as_run.tracked_peak_bytes if matched else None,
    )


# NOTE [ Worst step ]
#
# Some models run a different set of modules from one step to the next: stochastic depth
# (Hugging Face's ``layerdrop`` in Wav2Vec2, HuBERT and others, on by default) skips whole
# layers at random. A profile of a step that skipped layer 0 never offers it to the solver, and
# every step that runs it peaks above the prediction.
#
# Rule 1. remat plans for the worst step the model can take: every layer running. It gets
# there by switching stochastic depth off while it measures (a 'measure' step change, NOTE
# [ Step changes ], Rule 2: Hugging Face's ``layerdrop``, as a module attribute or in the
# config, is 0 while profiling, in the validation step and in ``remat verify``, and restored
# after), not by profiling until every layer happened to run: a forced step is reached in one
# step, every time, and its change is recorded where the user reads it.
# Rule 2. The step's structure is part of the profile (``Profile.step_structure``): every
# unit seen in some profiled step (timing steps, memory step, as-run step), and which step
# skipped which. Skipping that remat cannot switch off shows there; when the memory step (the
# one the plan is made from) skipped a unit another step ran, the profile is refused
# (``planner.profiling.profiler.reconcile``) instead of planning for a lucky step.


def step_structure(steps: Mapping[str, list[str]]) -> schema.StepStructure:
    """Every unit seen in ``steps`` (step name -> unit ids in forward order), in forward order, and what
    each step skipped (NOTE [ Worst step ])."""
    seen: list[str] = []
    for ids in steps.values():
        at = 0
        for uid in ids:
            if uid in seen:
                at = seen.index(uid) + 1
            else:
                seen.insert(at, uid)
                at += 1
    ran = {name: set(ids) for name, ids in steps.items()}
    skipped = {name: [u for u in seen if u not in ran[name]] for name in steps}
    return schema.StepStructure(units_seen=seen, skipped={k: v for k, v in skipped.items() if v})


_OPTIMIZER_NOTE = {
    name: f"{name} ran with lr=0: same state, kernels and temporaries as training, weights unchanged"
    for name in OPTIMIZERS if name != "none"
}


def _pooled_costs(times: StepTimes, signatures: dict[str, str]) -> dict[str, UnitCost]:
    """Unit id -> its ``UnitCost``: pooled over cost groups when the steps were timed (NOTE [ Unit
    costs ], Rule 3); as given otherwise (the roofline's one modelled step: no spread)."""
    if times.unit_samples:
        return unit_costs(times.unit_samples, signatures)
    return {uid: UnitCost(f, b, 1) for uid, (f, b) in times.unit_ms.items()}


def _unit_record(u: UnitCall, cost: UnitCost, group: str, remap: dict[int, int]) -> schema.UnitRecord:
    return schema.UnitRecord(
        id=u.id, fqn=u.fqn, call_index=u.call_index, module_type=u.module_type, parent=u.parent, depth=u.depth,
        fwd_start_seq=u.fwd_start, fwd_end_seq=u.fwd_end, bwd_start_seq=u.bwd_start, bwd_end_seq=u.bwd_end,
        forward_ms=cost.forward_ms, backward_ms=cost.backward_ms, cost_group=group, timing_samples=cost.samples,
        forward_spread_ms=cost.forward_spread_ms, backward_spread_ms=cost.backward_spread_ms,
        input_ids=[remap[i] for i in u.input_ids], output_ids=[remap[i] for i in u.output_ids],
        input_bytes=u.input_bytes, output_bytes=u.output_bytes, param_bytes=u.param_bytes,
    )


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine() or "cpu"


def _dtype(model: torch.nn.Module) -> str:
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return str(max(sizes, key=sizes.__getitem__)).removeprefix("torch.") if sizes else "float32"


__all__ = ["as_run_timeline", "AsRun", "assemble_profile", "counted_op", "io_tensors", "memory_step",
           "MemoryRecorder", "OP_TIMING_STEPS", "op_timing_steps", "Progress", "Recorder", "release_grads",
           "step_structure", "StepTimes", "UnitCall"]
