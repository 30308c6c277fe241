"""The step as the user runs it (NOTE [ Step as run ]): the memory step's events again, with no
dispatch mode, their bytes read from the device allocator.

Example::

    as_run = as_run_timeline(model, step, dev, mem, recipe=recipe)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from planner.model import schema
from planner.profiling.units import Recorder, UnitCall
from planner.profiling.recording import Event, MemoryRecord, optimizer_transient_bytes, release_grads


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
# and no saved-tensor hooks, and the device allocator reports the bytes (``allocator_view``).
# ``StepRecord.timeline_source`` is then 'as-run', and ``tracked_peak_bytes`` keeps the tracked
# step's peak beside the measured one.
# Rule 3. When that step's events are not the memory step's (its module calls changed: data-
# dependent control flow) or the device has no allocator view, the tracked timeline is kept
# ('tracked'). Either way the timeline's peak must agree with the peak the device measures on
# the plain step (``measure_step``) within ``RECONCILE_TOLERANCE``: a plan calibrated on a
# timeline that is not the user's step is refused, with both figures
# (``planner.profiling.profiler.reconcile``).
# Rule 4. The optimizer step's temporaries (``StepRecord.optimizer_step_transient_bytes``, the
# cost model's optimizer-step probe) come from the same timeline as the events. Under the
# tracker's mode the Adam family's step held 8 bytes more of per-parameter scalars at its peak
# than as run (AdamW with the peak in ``optimizer.step()``: predicted 971,204, measured 971,196).


class _TrackerView:
    """The timeline as the tracker saw it (fake tensors; or no allocator view available)."""

    def note(self, seq: int) -> None:
        pass

    def apply(self, events: list[Event], static_bytes: int) -> bool:
        """Set the events' live and peak bytes from the allocator; False when it could not."""
        return False

    def untracked_bytes(self, static_bytes: int) -> int:
        """Device memory alive at the step's start beyond the tracked ``static_bytes``; 0 where the view's bytes
        are relative to the step (NOTE [ cuBLAS workspaces ])."""
        return 0


class _CudaAllocatorView(_TrackerView):
    """Live and peak bytes of every event from the CUDA caching allocator itself.

    The tracker sees tensor storages; the allocator also sees cuBLAS/cuDNN workspaces and its
    own block rounding, which are real memory. ``memory_allocated`` is host-side bookkeeping,
    exact at launch time without a synchronisation.
    """

    def __init__(self, dev: torch.device):
        self.dev, self.points = dev, {}
        torch.cuda.reset_peak_memory_stats(dev)
        self.start_bytes = torch.cuda.memory_allocated(dev)

    def untracked_bytes(self, static_bytes: int) -> int:
        return max(0, self.start_bytes - static_bytes)

    def note(self, seq: int) -> None:
        self.points[seq] = (torch.cuda.memory_allocated(self.dev), torch.cuda.max_memory_allocated(self.dev))
        torch.cuda.reset_peak_memory_stats(self.dev)

    def apply(self, events: list[Event], static_bytes: int) -> bool:
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

    def apply(self, events: list[Event], static_bytes: int) -> bool:
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
        self.events: list[Event] = []
        super().__init__(model)

    def _note(self, kind: str, unit: UnitCall | None) -> int:
        seq = len(self.events)
        self.events.append(Event(seq, kind, unit.id if unit else None, 0, 0))
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


def as_run_timeline(model: torch.nn.Module, step: Callable, dev: torch.device, mem: MemoryRecord, *,
                    recipe: schema.Recipe) -> AsRun:
    """Run the step as the user runs it and, when its events are the memory step's, give those events the
    allocator's live and peak bytes of this run (NOTE [ Step as run ])."""
    release_grads(model, dev, recipe)
    with allocator_view(dev) as view, _AsRunRecorder(model, view) as rec:
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
    mem.optimizer_transient_bytes = optimizer_transient_bytes(events, mem.recorder.kept_output_bytes)  # Rule 4
    return AsRun(ids, True, tracked, excess, at)


@contextlib.contextmanager
def allocator_view(dev: torch.device) -> Iterator[_TrackerView]:
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


__all__ = ["allocator_view", "as_run_timeline", "AsRun"]
