"""Unit costs from repeated timing steps: clocks, robust statistics, pooled identical units.

The profiler's timing steps (``planner.profiling.profiler``) stamp every unit's forward and backward
with one of the clocks here; ``unit_costs`` turns the samples into the costs the solvers
minimise. See NOTE [ Unit costs ].
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

# NOTE [ Unit costs ]
# A plan is optimal only if its recompute milliseconds are right, so a unit's cost is built to
# be stable and explainable:
#
# Rule 1. The clock. On the CPU with one intra-op thread, the CPU time of the calling thread
#   (``time.thread_time``, CLOCK_THREAD_CPUTIME_ID): with one thread every kernel of the
#   forward runs inline on the caller, and CPU autograd runs the backward on the thread that
#   called ``backward()``, so the thread's CPU time is the step's work, and time the thread
#   spends preempted by other processes does not count. With more threads the work is spread
#   over the OpenMP pool: neither this thread's CPU time (it misses the workers' share, and
#   counts its own spinning at barriers) nor the process's (workers spin too) is the elapsed
#   time, so the clock is the wall clock (``time.perf_counter``), which other processes on
#   the machine slow down. On CUDA, events on the current stream (``torch.cuda.Event``):
#   device time, not the host's launch time. The profile records the clock
#   (``Profile.time_source``) and the thread count (``Profile.threads``).
#   Why: on a loaded machine the thread CPU time of a block barely moves while its wall time
#   doubles, and at 2 threads swings several-fold (docs/benchmarks.md, "Unit costs").
# Rule 2. Robust statistics. ``steps`` timing steps; a unit's cost is the median of its
#   samples, not their mean: one step descheduled in the middle of one block does not move it.
# Rule 3. Identical units cost the same. Units with the same signature (module type, the
#   shapes and dtypes of its parameters, inputs and outputs, and the sequence of aten ops
#   its forward ran; ``signature``) form a cost group; every member gets the median of the
#   group's pooled samples. Four identical transformer blocks are one price, so the solver's
#   choice among them is a tie, broken deterministically (the solvers' order), not by noise.
# What it leaves out: the recompute of a checkpointed unit runs its forward again inside
#   backward, plus ``torch.utils.checkpoint``'s own work (RNG state save and restore, the
#   saved-tensor hooks), not counted; the profiler's own hooks (a few microseconds per
#   submodule) are counted in the forward. benchmarks/time_model.py measures how far the
#   sum of forward costs is from the measured overhead of a plan.

TIME_SOURCES = {
    "cpu-thread-time": "CPU time of the profiling thread (one intra-op thread): other processes do not count",
    "wall-clock": "wall-clock time: load from other processes on the machine counts",
    "cuda-events": "CUDA events on the current stream: device time",
    "roofline": "modelled by the roofline of the target device (no step was run)",
}
"""``Profile.time_source`` values and what each means."""


class WallClock:
    source = "wall-clock"

    def stamp(self) -> float:
        return time.perf_counter()

    def sync(self) -> None:
        pass

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3


class ThreadCpuClock(WallClock):
    """CPU time of the calling thread (see NOTE [ Unit costs ], Rule 1)."""

    source = "cpu-thread-time"

    def stamp(self) -> float:
        return time.thread_time()


class CudaEventClock:
    """Device time between events recorded on the current stream; read after ``sync``."""

    source = "cuda-events"

    def __init__(self, device: torch.device):
        self.device = device

    def stamp(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def ms(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end)


def pick_clock(dev: torch.device, threads: int) -> WallClock | CudaEventClock:
    """The clock for timing steps on ``dev`` with ``threads`` intra-op threads (NOTE [ Unit costs ], Rule 1)."""
    if dev.type == "cuda":
        return CudaEventClock(dev)
    return ThreadCpuClock() if threads == 1 else WallClock()


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` for the duration (nothing when None)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def robust_ms(samples: Sequence[float]) -> float:
    """The statistic of NOTE [ Unit costs ], Rule 2: the median (0.0 without samples)."""
    return float(statistics.median(samples)) if samples else 0.0


def describe(tensors: Iterable[torch.Tensor]) -> str:
    """Shapes, dtypes and requires_grad of ``tensors``, in order: one part of a ``signature``."""
    return ";".join(f"{tuple(t.shape)}:{t.dtype}:{int(t.requires_grad)}" for t in tensors)


def signature(module_type: str, params: str, inputs: str, outputs: str, ops: Iterable[Any]) -> str:
    """Digest of what decides a unit's forward time (NOTE [ Unit costs ], Rule 3): 16 hex digits.

    ``params``, ``inputs``, ``outputs``: ``describe`` of each; ``ops``: the aten ops the forward ran.
    """
    text = "|".join([module_type, params, inputs, outputs, ";".join(str(op) for op in ops)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def unit_costs(samples: Mapping[str, Sequence[tuple[float, float]]],
               groups: Mapping[str, str]) -> dict[str, tuple[float, float, int]]:
    """Unit id -> (forward ms, backward ms, samples pooled): the median over the unit's cost group.

    ``samples``: unit id -> its (forward, backward) ms, one pair per timing step it ran in.
    ``groups``: unit id -> signature; a unit without one is its own group.
    """
    pooled: dict[str, list[tuple[float, float]]] = {}
    for uid, pairs in samples.items():
        pooled.setdefault(groups.get(uid) or f"unit:{uid}", []).extend(pairs)
    out = {}
    for uid in samples:
        pairs = pooled[groups.get(uid) or f"unit:{uid}"]
        out[uid] = (robust_ms([f for f, _ in pairs]), robust_ms([b for _, b in pairs]), len(pairs))
    return out


def time_interleaved(steps: Mapping[str, Callable[[], Any]], *, rounds: int, clock: Any,
                     on_round: Callable[[int], None] | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """Run one step of each of ``steps`` in turn, ``rounds`` times; name -> (clock ms, wall ms) per round.

    Interleaving puts every variant through the same drift of a shared machine; compare medians.
    ``clock`` is a ``pick_clock`` clock: on the CPU at one thread the thread's CPU time.
    """
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in steps}
    for r in range(rounds):
        if on_round is not None:
            on_round(r)
        for name, step in steps.items():
            torch.manual_seed(r)
            clock.sync()
            wall, start = time.perf_counter(), clock.stamp()
            step()
            end = clock.stamp()
            clock.sync()
            out[name][1].append((time.perf_counter() - wall) * 1e3)
            out[name][0].append(clock.ms(start, end))
    return out
