"""The memory-safe profile's reconstruction (NOTE [ Memory-safe profile ]): checkpoint the
candidates while a step is measured, record what the checkpointed step hides, and rebuild the
profile of the *unplanned* step from it. ``planner.profiling.memsafe`` decides when to use it.

Example::

    ckpt = Checkpointing([model.blocks[0], model.blocks[1]])
    with ckpt:
        ...   # measure_profile with CheckpointedTiming / CheckpointedMemory recorders
    prof = as_unplanned(prof, ["blocks.0", "blocks.1"], recompute_ms)
"""

from __future__ import annotations
import contextlib
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any
import torch
import torch.utils.checkpoint as torch_checkpoint
from planner.model import schema
from planner.profiling.profiler import TimingRecorder
from planner.profiling.timing import ExcludingClock
from planner.profiling.recording import MemoryRecorder
from planner.profiling.units import UnitCall, io_tensors
from planner.profiling.tracker import LiveBytesTracker, StorageEntry

Progress = Callable[[str], None]

# NOTE [ Memory-safe profile ]
#
# Why: the profile of NOTE [ Units ] runs the step as it is, and a step that does not fit the
# device cannot run. Checkpointing every candidate makes it fit; the profile must still
# describe the unplanned step, so that the graph, the cost model (and its calibration of the
# temporaries T, NOTE [ Peak-memory model ]) and the solvers work on it unchanged.
#
# Rule 1. What stays exact. Under non-reentrant checkpoint the forward runs the same ops, so
# module calls, tensors, their sizes and creation order, unit inputs and outputs and parameter
# uses are recorded as in a full profile. Saves inside a checkpointed call go to checkpoint's
# own pack hook, which hides them from ours; checkpoint hands each of them, while it exists,
# to its determinism check (``metadata_fn``), and ours records the save there, with the same
# sequence number and unit as a full profile would. Checkpoint's own save of the region's
# inputs (before the region starts) is not a save of the step and is skipped.
#
# Rule 2. Live bytes. live(unplanned) = live(checkpointed) + dropped - kept - duplicated - rng,
# at every event, where
#   dropped: tensors saved inside a checkpointed call that the checkpointed step has already
#     freed (the tracker's weakrefs say when each storage died), of the calls whose recompute
#     has not started: from the recompute on, the recomputed copies are alive as the originals
#     would be, and backward frees them as it would;
#   kept: inputs of checkpointed calls that checkpoint keeps for the recompute but nothing in
#     the step saves, from the event after the one that follows their last use in the forward
#     (known when the forward is over): the unplanned step has freed them by then (GPT-2's
#     dropout input, freed when ``h = self.drop(h)`` rebinds h, after the dropout's post-hook);
#   duplicated: tensors a recompute made again while their original is still alive (kept by a
#     later call's checkpoint as its input: a ResNet block's output); the unplanned step has one;
#   rng: the copy of the CPU RNG state (5056 bytes) each checkpointed call keeps until its
#     backward ends (CPU only: on CUDA it is host memory).
#
# Rule 3. Peaks. Between two events the correction above changes at moments no event marks;
# the peak between them takes its value at the previous event (exact when it does not change,
# as in most of the backward; see timeline()). In the forward of a checkpointed call that
# is loose (a temporary freed before the saves pile up would be counted with all of
# them), so there the peak comes from the call's recompute instead: with early stop off, the
# recompute replays the call's forward with its saves kept, as the unplanned forward keeps
# them, and its module hooks mark the same events. The rise from one event to the next peak is
# taken from the replay and added to the unplanned live bytes of the previous event. The
# recompute itself is not part of the unplanned step: it is cut out of the backward window it
# falls in, which keeps the peak before it (with the call's dropped bytes) and the level after
# it (the recomputed saves, as the unplanned step held them then).
#
# Why the calibration comes out right: the cost model calibrates the temporaries T of each
# window as the measured window peak less its model of the unplanned step in that window
# (NOTE [ Peak-memory model ]). The timeline above is the unplanned step's, event by event, so
# the windows' peaks and hence T are those a full profile would measure; the checkpointed run's
# own peaks (which would give T of the checkpointed step, a different quantity) are never used.
# Measured against full profiles in docs/benchmarks.md (benchmarks/memory_safe.py).
#
# Rule 4. Times. Forward times are measured in the forward; a checkpointed call's forward time
# is the mean of its forward and its recompute. The clock of the timing steps pauses during
# recomputes, so backward times (per unit and of the step) are those of the unplanned step.
#
# Not reconstructed exactly: a few KB per checkpointed call where the RNG copy's release is
# placed at the call's backward end; what a model keeps in its own state across the recompute
# (a KV cache passed to every layer stays alive through the checkpoint frames).

CHECK_KEY = "remat-memory-safe-profile"
"""Prefix of the determinism-check name registered with ``torch.utils.checkpoint`` (Rule 1).
Private to torch: ``torch.utils.checkpoint._allowed_determinism_checks_to_fns``, checked
against torch 2.13."""


# ----------------------------------------------------------------------------- checkpointing


class Checkpointing:
    """Checkpoint ``modules`` (every call) for the duration, with the hooks of NOTE [ Memory-safe profile ].

    ``recorder`` is the recorder of the step now running (timing or memory), or None.
    """

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self.keys = {id(m) for m in modules}
        self.recorder: Any = None
        self.key = f"{CHECK_KEY}-{id(self)}"
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Checkpointing:
        from planner.act.applier import RegionCounts, CheckpointedForward

        checks = torch_checkpoint._allowed_determinism_checks_to_fns
        default_check = checks["default"]

        def on_save(x: torch.Tensor) -> Any:
            if self.recorder is not None:
                self.recorder.on_checkpointed_save(x)
            return default_check(x)  # torch's own determinism check still runs

        checks[self.key] = on_save
        self._stack.callback(checks.pop, self.key, None)
        # the replay must run the whole forward (Rule 3): no early stop
        self._stack.enter_context(torch_checkpoint.set_checkpoint_early_stop(False))
        for m in self.modules:
            previous = m.__dict__.get("forward")
            fwd = CheckpointedForward(m, previous, RegionCounts())
            fwd.options = {"determinism_check": self.key, "context_fn": self._contexts}
            m.forward = fwd
            self._stack.callback(_restore_forward, m, previous)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _contexts(self) -> tuple[Any, Any]:
        """checkpoint's ``context_fn``: called as a checkpointed call starts, in the forward."""
        rec = self.recorder
        if rec is None or not rec.in_forward or not rec.stack:
            return contextlib.nullcontext(), contextlib.nullcontext()
        unit = rec.stack[-1]
        rec.skip_saves = True  # checkpoint saves the region's inputs next (Rule 1)
        return _Forwarding(rec), _Replaying(rec, unit)


def _restore_forward(module: torch.nn.Module, previous: Any) -> None:
    if previous is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = previous


class _Forwarding:
    """checkpoint's forward context: from here on, saves are the region's own."""

    def __init__(self, rec: Any):
        self.rec = rec

    def __enter__(self) -> None:
        self.rec.skip_saves = False
        if hasattr(self.rec, "region_started"):
            self.rec.region_started()

    def __exit__(self, *exc: object) -> None:
        pass


class _Replaying:
    """checkpoint's recompute context: tells the recorder a recompute of ``unit`` runs."""

    def __init__(self, rec: Any, unit: UnitCall):
        self.rec, self.unit = rec, unit

    def __enter__(self) -> None:
        self.rec.recompute_begin(self.unit)

    def __exit__(self, *exc: object) -> None:
        self.rec.recompute_end(self.unit)


class PausingClock(ExcludingClock):
    """A clock whose intervals leave out the time spent recomputing (Rule 4)."""

    def __init__(self, clock: Any):
        super().__init__(clock)
        self._start: Any = None

    def pause(self) -> None:
        self._start = self.clock.stamp()

    def resume(self) -> float:
        end = self.clock.stamp()
        self.clock.sync()
        ms = self.clock.ms(self._start, end)
        self.excluded_ms += ms
        return ms


# ----------------------------------------------------------------------------- recorders


class CheckpointedTiming(TimingRecorder):
    """Timing steps under checkpointing: recomputes are timed apart (Rule 4)."""

    def __init__(self, model: torch.nn.Module, clock: PausingClock, ckpt: Checkpointing):
        self.recompute_ms: dict[str, list[float]] = defaultdict(list)
        self.skip_saves = False
        super().__init__(model, clock)
        ckpt.recorder = self

    def on_checkpointed_save(self, x: torch.Tensor) -> None:
        pass

    def recompute_begin(self, unit: UnitCall) -> None:
        self.clock.pause()

    def recompute_end(self, unit: UnitCall) -> None:
        self.recompute_ms[unit.id].append(self.clock.resume())


class _Replay:
    """The recompute of one checkpointed call: its inner calls, matched to the forward's units."""

    def __init__(self, unit: UnitCall, units: list[UnitCall]):
        self.unit = unit
        self.inner: dict[int, deque[UnitCall]] = defaultdict(deque)
        for u in units[unit.index + 1:]:
            if u.fwd_start > unit.fwd_end:
                break
            if u.key is not None:
                self.inner[u.key].append(u)
        self.stack: list[tuple[int, UnitCall]] = []
        self.made: list[StorageEntry] = []
        """Storages the recompute allocated, in order."""


_REPLAY_KINDS = ("rc_start", "rfwd_start", "rfwd_end", "rc_end")
"""Events of a recompute: they place the replay in the timeline and are not part of the profile."""


class CheckpointedMemory(MemoryRecorder):
    """The memory step under checkpointing, and the unplanned timeline rebuilt from it (Rules 1-3)."""

    def __init__(self, model: torch.nn.Module, tracker: LiveBytesTracker, ckpt: Checkpointing):
        self.ckpt_keys = ckpt.keys
        self.skip_saves = False
        self.dropped: list[tuple[StorageEntry, str]] = []
        """Saved inside a checkpointed call and alive: (entry, the checkpointed call's unit id)."""
        self.dropped_serials: set[int] = set()
        self.dead_bytes: dict[str, int] = defaultdict(int)
        """Checkpointed call -> bytes of its saves that the checkpointed step has freed."""
        self.replayed: set[str] = set()
        self.extra: list[int] = []
        """Per event: bytes the unplanned step holds and the checkpointed one does not (Rule 2)."""
        self.replay: _Replay | None = None
        self.rng_state_bytes = torch.get_rng_state().nbytes if tracker.device_type == "cpu" else 0
        self.kept_inputs: dict[int, StorageEntry] = {}
        """Inputs of checkpointed calls, which checkpoint keeps until the call's backward."""
        self.input_bytes: dict[int, int] = {}
        self.kept_at: list[tuple[int, ...]] = []
        """Per event: the kept inputs alive then (which of them the unplanned step had freed is
        known once the forward is over: their last use)."""
        self.last_use: dict[int, int] = {}
        """Serial of a kept input -> seq of its last use in the forward."""
        self.saved_serials: set[int] = set()
        self.made: list[tuple[int, StorageEntry]] = []
        """(seq, entry) of every storage the forward allocated, in order."""
        self.duplicates: list[tuple[StorageEntry, StorageEntry]] = []
        """(original, recomputed copy): the copy of a tensor whose original is still alive."""
        self.rng_holders: set[str] = set()
        """Checkpointed calls holding a copy of the CPU RNG state (Rule 2)."""
        super().__init__(model, tracker)
        ckpt.recorder = self

    # ------------------------------------------------------------- Rule 1: saves

    def region_started(self) -> None:
        """checkpoint has taken its RNG state copy for the call on top of the stack."""
        if self.stack:
            self.rng_holders.add(self.stack[-1].id)

    def _exit(self, unit: UnitCall, args: tuple, kwargs: dict, output: Any,
              module: torch.nn.Module | None = None) -> None:
        super()._exit(unit, args, kwargs, output, module)
        if unit.id in self.rng_holders and not any(t.requires_grad for t in io_tensors(output)):
            self.rng_holders.discard(unit.id)  # no graph to backward through: checkpoint let go already

    def on_checkpointed_save(self, x: torch.Tensor) -> None:
        if not self.in_forward or self.skip_saves or not self.stack:
            return
        self.pack(x, watch=False)  # checkpoint keeps its own handle, not what pack returns
        e = self.tracker.entry(x)
        if e is None or e.static or e.serial in self.dropped_serials:
            return
        owner = next((u.id for u in self.stack if u.key in self.ckpt_keys), None)
        if owner is not None:
            self.dropped_serials.add(e.serial)
            self.dropped.append((e, owner))

    def pack(self, t: torch.Tensor, watch: bool = True) -> torch.Tensor:
        if self.skip_saves:  # checkpoint keeping the region's inputs: not a save of the step (Rule 2)
            e = self.tracker.entry(t)
            if e is not None and not e.static and e.serial not in self.kept_inputs:
                self.kept_inputs[e.serial] = e
                self.input_bytes[e.serial] = e.nbytes
                self.last_use[e.serial] = self.seq
            return t
        e = self.tracker.entry(t) if self.in_forward else None
        if e is not None:
            self.saved_serials.add(e.serial)
        return super().pack(t, watch)

    def _on_op(self, func: Any, inputs: list[StorageEntry], new: list[StorageEntry]) -> None:
        super()._on_op(func, inputs, new)
        if self.in_forward:
            for e in inputs:
                if e.serial in self.kept_inputs:
                    self.last_use[e.serial] = self.seq
            self.made.extend((self.created[e.serial][0], e) for e in new if e.nbytes)
        elif self.replay is not None:
            self.replay.made.extend(e for e in new if e.nbytes)

    def _duplicated_bytes(self) -> int:
        """Bytes of recomputed tensors whose original is alive too (Rule 2)."""
        self.duplicates = [(o, c) for o, c in self.duplicates if o.ref() is not None and c.ref() is not None]
        return sum(c.nbytes for _, c in self.duplicates)

    def _kept_alive(self) -> tuple[int, ...]:
        """Serials of the checkpointed calls' inputs alive now (checkpoint keeps them)."""
        for serial, e in list(self.kept_inputs.items()):
            if e.ref() is None:
                del self.kept_inputs[serial]
        return tuple(self.kept_inputs)

    def _kept_only_by_checkpoint(self, serials: tuple[int, ...], seq: int) -> int:
        """Bytes of ``serials`` that nothing saves and that the forward used for the last time
        before ``seq``: the unplanned step has freed them by then, checkpoint keeps them (Rule 2)."""
        return sum(self.input_bytes[s] for s in serials if s not in self.saved_serials and self.last_use[s] < seq)

    # ------------------------------------------------------------- Rule 2: events

    def _note(self, kind: str, unit: UnitCall | None) -> int:
        if kind == "bwd_end" and unit is not None:
            self.rng_holders.discard(unit.id)  # the call's backward is done: checkpoint let go of it
        self.kept_at.append(self._kept_alive())
        seq = super()._note(kind, unit)
        self.extra.append(self._dropped_bytes() - self._duplicated_bytes()
                          - self.rng_state_bytes * len(self.rng_holders))
        return seq

    def _dropped_bytes(self) -> int:
        """Bytes of saves the checkpointed step has freed, of the calls whose recompute has not
        started (from then on the recomputed copies stand for them)."""
        alive = []
        for e, owner in self.dropped:
            if e.ref() is None:
                self.dead_bytes[owner] += e.nbytes
            else:
                alive.append((e, owner))
        self.dropped = alive
        return sum(b for c, b in self.dead_bytes.items() if c not in self.replayed)

    def recompute_begin(self, unit: UnitCall) -> None:
        self._note("rc_start", unit)
        self.replayed.add(unit.id)
        self.replay = _Replay(unit, self.units)

    def recompute_end(self, unit: UnitCall) -> None:
        # the recompute made the call's storages again, in the same order: pair them up
        originals = [e for seq, e in self.made if unit.fwd_start < seq < unit.fwd_end]
        for original, copy in zip(originals, self.replay.made):
            if original.nbytes != copy.nbytes:
                break
            if original.ref() is not None and copy.ref() is not None:
                self.duplicates.append((original, copy))
        self.replay = None
        self._note("rc_end", unit)

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        r = self.replay
        if r is None or self.in_forward:
            return super()._pre(module, args, kwargs)
        queue = r.inner.get(id(module))
        if queue:
            u = queue.popleft()
            r.stack.append((id(module), u))
            self._note("rfwd_start", u)

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        r = self.replay
        if r is None or self.in_forward:
            return super()._post(module, args, kwargs, output)
        if r.stack and r.stack[-1][0] == id(module):
            self._note("rfwd_end", r.stack.pop()[1])

    # ------------------------------------------------------------- Rule 3: the unplanned timeline

    def timeline(self) -> list[schema.MemoryEvent]:
        rises = self._replay_rises()
        out: list[schema.MemoryEvent] = []
        carried = 0  # highest unplanned bytes since the last kept event
        prev_live: int | None = None
        prev_extra = 0
        prev_seq = -1
        for ev, extra, kept in zip(self.events, self.extra, self.kept_at):
            # freed after the next event following its last use: the caller holds it through the
            # post-hook of the module that used it last (GPT-2: ``h = self.drop(h)``)
            extra -= self._kept_only_by_checkpoint(kept, prev_seq)
            prev_seq = ev.seq
            # between two events the correction changes when the checkpointed step frees a tensor
            # the unplanned one holds (up: the peak came before, more likely in the backward, where
            # a region's last gradient is computed before checkpoint lets go of it), or when the
            # unplanned step frees a tensor checkpoint keeps (down: the peak came before): the
            # value at the previous event is the one (Rule 3)
            bound, prev_extra = prev_extra, extra
            if ev.kind == "rc_start" or ev.superseded:
                carried = max(carried, ev.peak_bytes + bound)
                continue
            if ev.kind == "rc_end":  # the recompute is cut out; the level after it stays
                carried = max(carried, ev.live_bytes + extra)
                continue
            if ev.kind in _REPLAY_KINDS:
                continue
            live = ev.live_bytes + extra
            rise = rises.get((ev.kind, ev.unit))
            if rise is not None and prev_live is not None:
                peak = prev_live + rise
            else:
                peak = max(carried, ev.peak_bytes + bound)
            out.append(schema.MemoryEvent(seq=ev.seq, kind=ev.kind, unit=ev.unit, live_bytes=live,
                                          peak_bytes=max(peak, live)))
            carried, prev_live = 0, live
        return out

    def _replay_rises(self) -> dict[tuple[str, str | None], int]:
        """(kind, unit) of a forward event inside a checkpointed call -> the rise of memory from
        the previous event to this one's peak, as the call's recompute replayed it."""
        rises: dict[tuple[str, str | None], int] = {}
        prev = None
        for ev in self.events:
            if ev.kind == "rc_start":
                prev = ev
            elif prev is not None and ev.kind in ("rfwd_start", "rfwd_end", "rc_end"):
                kind = "fwd_end" if ev.kind == "rc_end" else ev.kind[1:]
                rises[(kind, ev.unit)] = ev.peak_bytes - prev.live_bytes
                prev = None if ev.kind == "rc_end" else ev
        return rises


# ----------------------------------------------------------------------------- assembling


def as_unplanned(prof: schema.Profile, fqns: list[str], recompute_ms: dict[str, list[float]]) -> schema.Profile:
    """The checkpointed run's profile as the unplanned step's (Rule 4 times, reconstructed peak)."""
    steps = max(prof.step.measured_steps, 1)
    units = []
    for u in prof.units:
        extra = recompute_ms.get(u.id, [])
        if extra:
            u = u.model_copy(update={"forward_ms": (u.forward_ms * steps + sum(extra)) / (steps + len(extra))})
        units.append(u)
    checkpointed_run_peak = prof.step.measured_peak_bytes
    peak = max((e.peak_bytes for e in prof.timeline), default=0)
    step = prof.step.model_copy(update={"measured_peak_bytes": peak, "peak_source": "reconstructed"})
    note = (f"measured with {len(fqns)} modules checkpointed (memory-safe profile): that step peaked at "
            f"{checkpointed_run_peak} bytes [{prof.step.peak_source}]; the unplanned step's timeline and "
            f"its peak of {peak} bytes are reconstructed from it (NOTE [ Memory-safe profile ])")
    return prof.model_copy(update={"units": units, "step": step, "measured_with_checkpoints": fqns,
                                   "notes": [*prof.notes, note]})


__all__ = ["as_unplanned", "CHECK_KEY", "CheckpointedMemory", "CheckpointedTiming", "Checkpointing",
           "PausingClock", "Progress"]
