"""The memory step: one training step under the live-bytes tracker, shared by real profiling
(``profiler.py``) and fake-tensor profiling (``meta.py``). It records the tensors each unit
(``units.py``) saves for backward, its inputs and outputs, the op records and a timeline of live
memory; ``as_run.py`` replays the step as the user runs it and ``assemble.py`` builds the
``schema.Profile``.

Example::

    mem = memory_step(model, step, inputs, opt, dev, recipe=recipe)
    mem.recorder.events[-1].live_bytes
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from planner.model import schema
from planner.profiling.model_file import Inputs
from planner.profiling.roofline import op_work
from planner.profiling.ctx_held import ctx_tensors
from planner.profiling.releases import Releases
from planner.profiling.tracker import LiveBytesTracker, StorageEntry, iter_tensors, storage_bytes
from planner.profiling.units import Recorder, UnitCall, io_tensors
from planner.profiling.timing import describe, signature

Progress = Callable[[str], None]

_TO_COPY = torch.ops.aten._to_copy.default
"""What autocast's ``cached_cast`` runs to cast a parameter (below autocast, so the tracker sees it)."""

_ROUND_TO = {"cuda": 512}
"""Allocation granularity per device type: the CUDA caching allocator rounds to 512 bytes."""


# ----------------------------------------------------------------------------- memory step


@dataclass
class Event:
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
    moved_bytes: int = 0
    """Bytes the op reads and writes (NOTE [ Op work ])."""
    writes_after_read: bool = False
    """An op other than its writers read the output before a write (NOTE [ Op records ])."""


_SAC_IGNORED_OPS = getattr(torch.utils.checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})
"""Ops selective checkpointing neither counts nor caches (see NOTE [ Op records ])."""


# NOTE [ Saved tensors without their graph ]
#
# The memory step records saves with a ``saved_tensors_hooks`` pack hook. A pack hook that
# returns the tensor itself makes a reference cycle when the tensor is an output of the node
# saving it (``tanh``, ``softmax``, ``gelu`` save their results): node -> packed tensor ->
# ``grad_fn`` -> node. Without hooks autograd stores such outputs without the reference. Backward
# breaks the cycle as it frees each node's saves, so the live branch never noticed; a branch
# the loss does not use (a pooler output beside the hidden states the loss reads, SigLIP's
# attention-pooling head, any output tuple half used) is never backwarded, and under the hook it
# stayed alive until Python's garbage collector ran, where the step as run frees it when the
# model's output is dropped. The profile was then refused ("the model runs differently under
# remat's profiler ... kept 163840 bytes more alive"). The hook keeps ``t.detach()``: the same
# storage and version counter, no graph; taken outside the tracker, which would otherwise see
# an op the model did not run.

def _without_graph(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, outside every dispatch mode (NOTE [ Saved tensors without their graph ])."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return t.detach()


# NOTE [ Outputs without a gradient ]
#
# When backward reaches a checkpointed unit c, its replay runs beside the gradients of c's outputs
# (NOTE [ Peak-memory model ], Rule 4, G_c). Only some outputs have one then: those that code after
# c differentiates through. An output the caller keeps but no loss reads through (Hugging Face
# RoFormer's attention probabilities, ``outs = block(x); x = outs[0]``), or one that takes no
# gradient at all (a mask, an index), has none; its gradient from inside c (the probabilities
# feed c's own matmul) is made after the replay. Counted for every output, the replay's probe was
# over by the bytes of the outputs without one: a plan checkpointing the middle of three attention
# blocks that return their probabilities (131,072 bytes each; hidden 64, 64 tokens) was predicted
# 2,377,680 and measured 2,279,640 (+4.30%), now 2,279,640; Hugging Face RoFormer (hidden 64, two
# layers), its first layer checkpointed, 1,776,328 / 1,720,024 (+3.27%), now 1,720,024; its second,
# 2,504,656 / 2,374,560 (+5.48%), now 2,373,584 (-0.04%, 976 bytes, not traced).
# The rule, from the profiled graph: when the forward ends, the nodes backward will run are those
# reachable from the loss's ``grad_fn``; an output receives a gradient from outside c when one of
# them was made after c's outputs (autograd's sequence numbers grow as nodes are made) and takes
# the output's gradient edge (``grad_fn``, ``output_nr``). Nodes made inside c that backward runs
# come before its last output (they lead to one), unless c stores a tensor that later code uses
# (then the gradient is counted: the safe side); a leaf output that requires grad is counted as
# receiving one, an output that requires none as not. Recorded per unit
# (``UnitRecord.grad_output_ids``; None in older profiles, read as every output) and read by
# ``CostModel.replay_in_flight``.

def gradient_takers(loss: torch.Tensor) -> dict[tuple[int, int], float]:
    """``(node sequence number, output_nr) -> the latest node that takes that gradient``, over the
    nodes backward from ``loss`` runs; the loss's own edge maps above every node (NOTE [ Outputs without
    a gradient ]). Leaves (``AccumulateGrad``) are not keys."""
    root = loss.grad_fn
    if root is None:
        return {}
    out: dict[tuple[int, int], float] = {(root._sequence_nr(), loss.output_nr): math.inf}
    seen, stack = {id(root)}, [root]
    kept = [root]  # keeps each wrapper alive, so that ``id`` stays unique during the walk
    while stack:
        node = stack.pop()
        made = node._sequence_nr()
        for nxt, nr in node.next_functions:
            if nxt is None or hasattr(nxt, "variable"):
                continue
            key = (nxt._sequence_nr(), nr)
            out[key] = max(out.get(key, -1), made)
            if id(nxt) not in seen:
                seen.add(id(nxt))
                kept.append(nxt)
                stack.append(nxt)
    return out


def counted_op(func: Any) -> bool:
    """An op selective checkpointing counts; the profiler's own markers (``record_function``,
    which only the measuring steps run) are not ops of the model."""
    return func not in _SAC_IGNORED_OPS and getattr(func, "namespace", "") != "profiler"


class MemoryRecorder(Recorder):
    """Sequence numbers, tensors, saves, parameter uses and the timeline of one step."""

    kept_output_bytes = 0
    """The model's output the step holds through the optimizer step (NOTE [ The output kept through backward ])."""

    def __init__(self, model: torch.nn.Module, tracker: LiveBytesTracker):
        self.tracker = tracker
        self.seq = 0
        self.events: list[Event] = []
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
        self.signatures: dict[str, str] = {}  # unit id -> ``timing.signature`` (NOTE [ Unit costs ], Rule 3)
        self.releases = Releases(lambda: self.seq)  # NOTE [ Outputs the caller drops ]
        self.ctx_held: set[int] = set()  # tensor ids custom autograd nodes keep on ``ctx`` (NOTE [ Tensors on ctx ])
        super().__init__(model)
        tracker.observer = self._on_op
        tracker.work_of = op_work

    def reset(self) -> None:
        super().reset()
        self.output_edges: list[tuple[UnitCall, int, list[tuple[int, int | None, int]]]] = []
        """Per call of ``units`` (a reset empties both): its latest output node, its outputs' gradient edges."""
        self.packed_by: dict[int, UnitCall] = {}  # id of a packed tensor -> the call that packed it
        self.calls: dict[str, UnitCall] = {}

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def _note(self, kind: str, unit: UnitCall | None) -> int:
        seq = self._next()
        live = self.tracker.live_bytes
        peak = max(self.tracker.mark(), live)
        self._fold_highs(kind, unit, live, peak)
        if kind == "bwd_start" and unit is not None and unit.bwd_start_live is None:
            unit.bwd_start_live = live
        if kind == "bwd_end" and unit is not None:
            if unit.bwd_end_event is not None:
                self.events[unit.bwd_end_event].superseded = True
            unit.bwd_end_event = len(self.events)
        self.events.append(Event(seq, kind, unit.id if unit else None, live, peak))
        if self.on_event is not None:
            self.on_event(seq)
        return seq

    def _fold_highs(self, kind: str, unit: UnitCall | None, live: int, peak: int) -> None:
        """Each running call's (live bytes at its forward's start, most live since), the peak before this event
        folded in (NOTE [ What a replay allocates ] in solvers/replay.py)."""
        for u in self.stack:
            if u is unit and kind == "fwd_start":
                u.fwd_high = (live, live)
            elif u.fwd_high is not None:
                u.fwd_high = (u.fwd_high[0], max(u.fwd_high[1], peak))

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
        return self.tracker.last_op_ms, self.tracker.last_op_work[0]

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
                                self.forward_ops, torch.Tag.dynamic_output_shape in tags, writes,
                                moved_bytes=self.tracker.last_op_work[1]))

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
                                moved_bytes=op.moved_bytes,
                                random=op.random, inplace=op.inplace, view=op.view, mutated=op.mutated,
                                data_dependent=op.data_dependent, writes=op.writes,
                                read_between_writes=op.writes_after_read)
                for op in self.op_calls]

    def register_op_outputs(self) -> None:
        """Give every op output a tensor record (before the ids are numbered)."""
        for op in self.op_calls:
            for e in op.new:
                self._tensor_id(e)

    def pack(self, t: torch.Tensor, watch: bool = True) -> torch.Tensor:
        """``saved_tensors_hooks`` pack hook: note the save, keep the tensor without its graph
        (NOTE [ Saved tensors without their graph ]); ``watch=False``: autograd does not keep what it returns."""
        if not self.in_forward:
            return t
        packed = self._pack(t, watch)
        if self.stack:  # every pack counts where a replay stops (NOTE [ The replay stops at the last save ], Rule 3)
            self.stack[-1].last_pack_seq = self.seq
            now = max(self.tracker.peak_bytes, self.tracker.live_bytes)
            for u in self.stack:  # NOTE [ What a replay allocates ] in solvers/replay.py
                u.last_pack_high = None if u.fwd_high is None else max(u.fwd_high[1], now)
            if packed is not t:
                self.packed_by[id(packed)] = self.stack[-1]
        return packed

    def _pack(self, t: torch.Tensor, watch: bool) -> torch.Tensor:
        e = self.tracker.entry(t)
        if e is None or e.static:  # parameters, their views, buffers, the batch: not new memory
            return t
        if not self.stack:
            self.unattributed_saves += 1
            return _without_graph(t)
        unit = self.stack[-1].id
        tid = self._tensor_id(e)
        if (tid, unit) not in self.saved_pairs:
            self.saved_pairs.add((tid, unit))
            self.saves.append((tid, self._next(), unit))
        packed = _without_graph(t)
        if watch:
            self.releases.watch_save(packed, (tid, unit))  # NOTE [ Outputs the caller drops ], Rule 4
        return packed

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        """``saved_tensors_hooks`` unpack hook: the first unpack of each call and its callers notes what their
        backward allocated before it (NOTE [ What a replay allocates ], Rule 4)."""
        u = self.packed_by.get(id(t))
        while u is not None:
            if u.bwd_before_replay is None and u.bwd_start_live is not None:
                u.bwd_before_replay = max(0, self.tracker.live_bytes - u.bwd_start_live)
            u = self.calls.get(u.parent)
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
        self.calls[unit.id] = unit
        unit.input_ids, unit.input_bytes = self._io(args, kwargs)
        if unit.key is not None:
            if unit.key not in self.param_bytes_cache:
                params = self.modules[unit.key].parameters()
                self.param_bytes_cache[unit.key] = storage_bytes(params, round_to=self.tracker.round_to)
            unit.param_bytes = self.param_bytes_cache[unit.key]

    def _on_outputs(self, unit: UnitCall, output: Any) -> None:
        unit.output_ids, unit.output_bytes = self._io(output)
        for t in io_tensors(output):
            e = self.tracker.entry(t)
            if e is not None and not e.static:
                self.releases.watch(t, self._tensor_id(e))
        self.output_edges.append((unit, *self.gradient_edges(output)))
        start, inputs = self.op_start.pop(unit.id)
        params = describe(self.modules[unit.key].parameters()) if unit.key is not None else ""
        self.signatures[unit.id] = signature(unit.module_type, params, inputs, describe(io_tensors(output)),
                                             self.ops[start:])

    def gradient_edges(self, output: Any) -> tuple[int, list[tuple[int, int | None, int]]]:
        """``(made, edges)`` of a unit's output (NOTE [ Outputs without a gradient ]): ``made``, the
        sequence number of the latest autograd node among the outputs (-1: none); ``edges``, per
        output that requires grad, ``(tensor id, its node's sequence number or None for a leaf,
        output_nr)``."""
        made, edges = -1, []
        for t in io_tensors(output):
            e = self.tracker.entry(t)
            if e is None or e.static or not t.requires_grad:
                continue
            node = None if t.grad_fn is None else t.grad_fn._sequence_nr()
            made = max(made, -1 if node is None else node)
            edges.append((self._tensor_id(e), node, t.output_nr))
        return made, edges

    def mark(self, name: str, value: Any = None) -> None:
        super().mark(name, value)
        if name == "backward_start":
            self.releases.stop()
        if name == "backward_end" and value is not None:  # NOTE [ The output kept through backward ], Rule 2
            held = (self.tracker.entry(t) for t in io_tensors(value))
            self.kept_output_bytes = sum({id(e): e.nbytes for e in held if e is not None and not e.static}.values())
        if name == "forward_end" and isinstance(value, torch.Tensor) and value.requires_grad:
            entries = (self.tracker.entry(t) for t in ctx_tensors(value))
            self.ctx_held = {self._tensor_id(e) for e in entries if e is not None and not e.static}
            taken = gradient_takers(value)
            for unit, made, edges in self.output_edges:
                unit.grad_output_ids = list(dict.fromkeys(
                    tid for tid, node, nr in edges if node is None or taken.get((node, nr), -1) > made))

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
class MemoryRecord:
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
    untracked_bytes: int = 0
    """On CUDA, the allocator's bytes at the step's start beyond ``static_bytes``: cuBLAS's workspaces and
    whatever else the process holds there (NOTE [ cuBLAS workspaces ])."""


def memory_step(model: torch.nn.Module, step: Callable, inputs: Inputs,
                 opt: torch.optim.Optimizer | None, dev: torch.device, *, recipe: schema.Recipe,
                 round_to: int | None = None,
                 recorder: Callable[[torch.nn.Module, LiveBytesTracker], MemoryRecorder] | None = None) -> MemoryRecord:
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
    from planner.profiling.as_run import allocator_view  # it reads this module's Event

    with allocator_view(dev) as view, rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), \
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
    transient = optimizer_transient_bytes(rec.events, rec.kept_output_bytes)
    static = params_bytes + buffers_bytes + optimizer_bytes + batch_bytes + kept_grads_bytes + tracker.found_bytes
    return MemoryRecord(rec, params_bytes, buffers_bytes, batch_bytes, optimizer_bytes, grads_bytes, tracker.found_bytes,
                        transient, static, records, unused, view.untracked_bytes(static))


def optimizer_transient_bytes(events: list[Event], kept_output_bytes: int = 0) -> int:
    """What ``optimizer.step()`` (with clipping and unscaling) allocates above the end of backward, on
    ``events``' timeline: the memory step's, or the as-run step's once it has its bytes (NOTE [ Step as run ]);
    with the model's output the step still holds (NOTE [ The output kept through backward ], Rule 2)."""
    ends = {e.kind: e for e in events if e.unit is None}
    return max(ends["optimizer_end"].peak_bytes - ends["backward_end"].live_bytes + kept_output_bytes, 0)


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


__all__ = ["Event", "MemoryRecord", "MemoryRecorder", "optimizer_transient_bytes", "Progress", "counted_op",
           "memory_step", "release_grads"]
