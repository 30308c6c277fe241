"""Unit costs from repeated timing steps: clocks, robust statistics, pooled identical units.

The profiler's timing steps (``planner.profiling.profiler``) stamp every unit's forward and backward
with one of the clocks here; ``unit_costs`` turns the samples into the costs the solvers
minimise. See NOTE [ Unit costs ].

Example::

    costs = unit_costs({"h.0": [(1.0, 2.0), (1.1, 2.1)]}, {"h.0": "Block"})
    costs["h.0"].forward_ms
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

# NOTE [ Unit costs ]
# A plan is optimal only if its recompute milliseconds are right, so a unit's cost is built to
# be stable and explainable:
#
# Rule 1. The clock. On the CPU with one intra-op thread, the CPU time of the calling thread
#   (``time.thread_time``, CLOCK_THREAD_CPUTIME_ID): with one thread every kernel of the
#   forward runs inline on the caller, and CPU autograd runs the backward on the thread that
#   called ``backward()``, so the thread's CPU time is the step's work, and time the thread
#   spends preempted by other processes does not count. On CUDA, events on the current stream
#   (``torch.cuda.Event``): device time, not the host's launch time. The profile records the
#   clock (``Profile.time_source``) and the thread count (``Profile.threads``).
#   Why: on a loaded machine the thread CPU time of a block barely moves while its wall time
#   doubles, and at 2 threads swings several-fold (docs/benchmarks.md, "Unit costs").
# Rule 1b. More than one CPU thread (torch's default, the user's setting). The work is spread
#   over the OpenMP pool: neither this thread's CPU time (it misses the workers' share, and
#   counts its own spinning at barriers) nor the process's (workers spin too) is the elapsed
#   time, and the wall clock is the run queue of a shared machine: profiled on the wall clock,
#   three `remat plan` runs of examples/llama.py under load gave three plans. So the profiler
#   times every figure (units, ops, selective dispatch) at one thread on the thread's CPU
#   time, and multiplies it by the measured ratio of the forward's wall time at the user's N
#   threads to its CPU time at one thread (``ScaledCpuClock.calibrate``: least of each over
#   interleaved rounds, kept within [1/N, 1]: above 1 is load, which a burner on a 2-core
#   machine turned into factors of 0.5 to 3 between profiles, while the step on a machine of its
#   own is not slower at N threads than at one; ``Profile.thread_scale``, its spread ``thread_scale_spread``; time
#   source 'cpu-thread-time-scaled'). One factor for every figure, but two: selective
#   checkpointing's dispatch, which is Python, is left unscaled (NOTE [ Selective dispatch
#   cost ], Rule 5), and each cost group's forward gets the factor of its own forward (NOTE
#   [ Thread factor per cost group ]): a block of small ops gains less from threads than a
#   forward that ends in a large head matmul. The milliseconds are the N-thread step's;
#   benchmarks/time_model.py measures their error at N threads. The memory
#   step and the device's own peak run at N threads, as the user's step does.
# Rule 2. Robust statistics. ``steps`` timing steps; a unit's cost is the median of its
#   samples, not their mean: one step descheduled in the middle of one block does not move it.
# Rule 3. Identical units cost the same. Units with the same signature (module type, the
#   shapes and dtypes of its parameters, inputs and outputs, and the sequence of aten ops
#   its forward ran; ``signature``) form a cost group; every member gets the median of the
#   group's pooled samples. Four identical transformer blocks are one price, so the solver's
#   choice among them is a tie, broken deterministically (the solvers' order), not by noise.
# Rule 4. Every figure carries its spread: the interquartile range of the samples its median
#   is taken from (``spread_ms``; ``UnitRecord.forward_spread_ms``, ``backward_spread_ms``, the
#   step's phases, the dispatch figures of NOTE [ Selective dispatch cost ]). A choice that is
#   better only within the spread is noise: NOTE [ Selective menus ], Rule (noise).
#   Rule 4b. The choices weigh a figure's spread as its median's. The interquartile range says how
#   far one sample strays; the price is the median of ``timing_samples`` of them (steps times the
#   cost group's members), which strays by about that range times 1.2533 / sqrt(samples)
#   (``solvers.selective.spread_of_median``, as the dispatch figures are weighed, NOTE [ Selective
#   dispatch cost ], Rule 4). The graph builder puts that on each unit (``NodeAttrs.forward_spread_ms``);
#   the profile keeps the range as measured. On the CPU clock the samples are the thread's own time,
#   so another process's time slices do not tie one member's sample to the next one's. Why: taken as
#   one sample's, the spread of a 4-block group of a burdened profile (3 steps, 12 samples) read
#   2 to 20 times its quiet value between profiles, and with it the choice between op-level and
#   whole modules: on round 14's kept profiles every plan that was not the modal one was an
#   op-level plan predicted 16 to 30 ms cheaper sent to whole modules by spreads of 23 to 38 ms
#   (docs/benchmarks.md, "Same plan every time").
# Rule 5. The profiler's own hooks do not count. Its module and gradient hooks (one pair per
#   submodule call, Python: inputs and outputs walked, gradient hooks registered) ran inside
#   every unit's forward and were counted in it: 1.1 to 1.3 ms of a GPT-2 or Llama block's 20
#   to 35 ms on one CPU thread (3 to 6%), which recomputing the block does not pay. On the CPU
#   clocks the timing steps read a ``HookFreeClock``: it stands still while a hook runs.
# What it leaves out: the recompute of a checkpointed unit runs its forward again inside
#   backward, plus ``torch.utils.checkpoint``'s own work (RNG state save and restore, the
#   saved-tensor hooks), not counted; and the backward of a recomputed unit can run faster than
#   the unit's backward in the plain step (its saved tensors were just written, so they are in
#   the caches): on GPT-2's blocks, 3 to 5 ms of a 34 ms recompute on one CPU thread
#   (docs/benchmarks.md, "Predicted recompute vs measured overhead"). benchmarks/time_model.py
#   measures how far the sum of forward costs is from the measured overhead of a plan.

TIME_SOURCES = {
    "cpu-thread-time": "CPU time of the profiling thread (one intra-op thread): other processes do not count",
    "cpu-thread-time-scaled": "CPU time of the profiling thread at one intra-op thread, times the measured ratio of "
                              "the forward's wall time at the profile's threads to it (NOTE [ Unit costs ], Rule 1b)",
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


class ScaledCpuClock(ThreadCpuClock):
    """The profiler's clock at more than one CPU thread (NOTE [ Unit costs ], Rule 1b): the thread's
    CPU time at one thread, times ``scale``; ``calibrate`` measures the scale, ``timing`` runs the
    timed steps at one thread."""

    source = "cpu-thread-time-scaled"

    def __init__(self, threads: int, scale: float = 1.0, spread: float = 0.0):
        self.threads, self.scale, self.spread = threads, scale, spread
        self.clean_rounds = self.rounds = 0  # of the last calibrate (NOTE [ Clean rounds ])
        self.over_every_round = False  # the last calibrate had too few clean rounds (Rule 2)

    def ms(self, start: float, end: float) -> float:
        return (end - start) * 1e3 * self.scale

    def timing(self) -> contextlib.AbstractContextManager:
        return num_threads(1)

    def calibrate(self, step: Callable[..., Any], rounds: int = 5) -> None:
        """``scale`` = least wall ms of the forward at ``threads`` / least thread CPU ms of it at one
        thread, over ``rounds`` clean interleaved rounds (NOTE [ Clean rounds ]; every round where too
        few were clean); ``spread``: the spread of the per-round ratios."""
        r = thread_rounds(lambda clock: _forward_ms(step, clock), self.threads, rounds)
        self.over_every_round = not r.enough_clean(rounds)
        pairs = r.every if self.over_every_round else r.clean
        self.clean_rounds, self.rounds = len(r.clean), len(r.every)
        if min(r.one) > 0:
            self.scale = thread_factor(min(b for b, _ in pairs), min(r.one), self.threads)
            self.spread = spread_ms([b / a for b, a in pairs if a > 0])

    def note(self) -> str:
        """The profile's note on the last calibrate: its factor and the rounds it was taken over."""
        taken = ", the rest busy: taken over every round" if self.over_every_round else ""
        return (f"thread factor of the whole forward {self.scale:.3f} over {self.clean_rounds} of {self.rounds} "
                f"rounds clean{taken} (NOTE [ Clean rounds ])")


# NOTE [ Clean rounds ]
# A thread factor (Rule 1b above, NOTE [ Thread factor per cost group ]) is the least wall time at N
# threads over the least CPU time at one, over interleaved rounds. The one-thread figure is the
# thread's own CPU time, which another process does not inflate; the N-thread wall time is, by as
# much as the other process holds the cores. The least over a few rounds covers a burst shorter
# than the rounds, not one as long as them: Llama's layers read 0.958 where the whole forward read
# 0.659 (round 12), GPT-2's blocks 1.000 against 0.650 (round 11), each plan predicted up to 69%
# over its measured overhead. Beside a process busy at random (0.05 to 0.4 s on, as long off),
# the largest of 15 to 25 measurements of one block's factor fell with the clean rounds of Rule 1
# in three of four runs (GPT-2 0.875 to 0.752, Llama 1.000 to 0.707 and 0.786 to 0.750) and rose
# in the fourth (GPT-2 0.810 to 1.000): both ways keep outliers that the process's CPU time does
# not see (docs/benchmarks.md, "Thread factors: every round or clean rounds").
# Rule 1. Each N-thread run is timed on ``BusyClock``: the wall clock, and the process's CPU time
#   (every thread's) between the same two stamps. The run had the cores to itself when the
#   process's CPU time was at least ``CLEAN_CPU_SHARE`` of N times its wall time (idle OpenMP
#   workers spin a while before they sleep, so a run on an idle machine reads close to N).
#   Measured on this project's two-core machine, forwards of Llama's and GPT-2's blocks at two
#   threads: 1.78 to 2.04 times the wall time on an idle machine; 1.18 to 1.6 in the rounds
#   beside a busy process that the wall time shows were slowed. A probe matmul before and after
#   each run (tried first) missed half of those: a burst falls between the probes.
# Rule 2. Rounds go on until the wanted number are clean or ``CLEAN_ROUNDS_FACTOR`` times it have
#   run, and stop at the wanted number when none was clean (a machine busy all along, or more
#   threads than cores: the profile takes no longer than before). With fewer than ``CLEAN_MIN_ROUNDS`` clean, the whole forward's factor is taken over every
#   round, as before (there is nothing steadier to fall back on), and a cost group's is not taken
#   (it keeps the whole forward's); the profile's notes give the clean rounds of each.
# Rule 3. One round, unrecorded, comes first: the first call at a thread count pays for its pool.
# A process busy on every core for the whole profile leaves no round clean: the factors are then
# those of every round, near 1, which is also what the user's step gets on that machine.

CLEAN_CPU_SHARE = 0.85
"""A clean N-thread run's process CPU time is at least this share of N x its wall time (Rule 1)."""
CLEAN_ROUNDS_FACTOR = 3
"""At most this many times the wanted rounds are run (Rule 2)."""
CLEAN_MIN_ROUNDS = 3
"""Fewer clean rounds than this (or than wanted): not enough (Rule 2)."""


class BusyClock(WallClock):
    """The wall clock, noting the process's CPU time at each stamp (NOTE [ Clean rounds ], Rule 1):
    ``cpu_ms`` is that between the stamps of the last ``ms(start, end)``."""

    def __init__(self) -> None:
        self._cpu: dict[float, float] = {}
        self.cpu_ms = 0.0

    def stamp(self) -> float:
        cpu = time.process_time()
        t = time.perf_counter()
        self._cpu[t] = cpu
        return t

    def ms(self, start: float, end: float) -> float:
        self.cpu_ms = (self._cpu[end] - self._cpu[start]) * 1e3
        return (end - start) * 1e3

    def clean(self, wall_ms: float, threads: int) -> bool:
        """The last run had ``threads`` cores to itself (Rule 1)."""
        return wall_ms > 0 and self.cpu_ms >= CLEAN_CPU_SHARE * threads * wall_ms


class ThreadRounds(NamedTuple):
    """Interleaved rounds of NOTE [ Clean rounds ]: ``one`` the one-thread CPU ms of every round,
    ``every`` (N-thread wall ms, the round's one-thread ms) of every round, ``clean`` those of clean rounds."""

    one: list[float]
    every: list[tuple[float, float]]
    clean: list[tuple[float, float]]

    def enough_clean(self, wanted: int) -> bool:
        return len(self.clean) >= min(CLEAN_MIN_ROUNDS, wanted)


def thread_rounds(run: Callable[[WallClock], float], threads: int, rounds: int) -> ThreadRounds:
    """``run(clock)`` (ms on ``clock``) at one thread on the thread's CPU time and at ``threads`` on a
    ``BusyClock``, interleaved, until ``rounds`` rounds are clean (NOTE [ Clean rounds ])."""
    with num_threads(1):
        run(ThreadCpuClock())  # Rule 3
    with num_threads(threads):
        run(WallClock())
    out = ThreadRounds([], [], [])
    for _ in range(CLEAN_ROUNDS_FACTOR * rounds):
        with num_threads(1):
            a = run(ThreadCpuClock())
        with num_threads(threads):
            clock = BusyClock()
            b = run(clock)
        out.one.append(a)
        out.every.append((b, a))
        if clock.clean(b, threads):
            out.clean.append((b, a))
            if len(out.clean) >= rounds:
                break
        elif len(out.every) >= rounds and not out.clean:
            break  # Rule 2: busy all along, more rounds would not be cleaner
    return out


def thread_factor(wall_ms: float, cpu_ms: float, threads: int) -> float:
    """``wall_ms`` at ``threads`` over ``cpu_ms`` at one thread, within [1 / threads, 1] (NOTE [ Unit
    costs ], Rule 1b): more threads do not make work more than that many times faster, nor slower
    on a machine they have to themselves; a ratio above 1 is other processes' load."""
    return min(1.0, max(1.0 / threads, wall_ms / cpu_ms))


def _forward_ms(step: Callable[..., Any], clock: WallClock) -> float:
    marks: dict[str, float] = {}
    step(lambda name, _value=None: marks.__setitem__(name, clock.stamp()))
    return clock.ms(marks["step_start"], marks["forward_end"])


def profile_clock(dev: torch.device, threads: int) -> WallClock | CudaEventClock:
    """The profiler's clock (NOTE [ Unit costs ], Rules 1 and 1b); a ``ScaledCpuClock`` to calibrate
    on the CPU above one thread."""
    if dev.type == "cpu" and threads > 1:
        return ScaledCpuClock(threads)
    return pick_clock(dev, threads)


def calibrated(clock: Any, step: Callable[..., Any]) -> ScaledCpuClock | None:
    """Calibrate ``clock`` (or the clock it wraps) when it is a ``ScaledCpuClock``; that clock, or None."""
    inner = getattr(clock, "clock", clock)
    if not isinstance(inner, ScaledCpuClock):
        return None
    inner.calibrate(step)
    return inner


def clock_of(profile: Any, dev: torch.device) -> WallClock | CudaEventClock:
    """The clock ``profile``'s figures were measured on, to measure more of them (its scale included)."""
    if profile.time_source == ScaledCpuClock.source and profile.thread_scale:
        return ScaledCpuClock(profile.threads or torch.get_num_threads(), profile.thread_scale)
    return pick_clock(dev, torch.get_num_threads())


def timing_threads(clock: Any) -> contextlib.AbstractContextManager:
    """Where timed steps run: at one thread under a ``ScaledCpuClock`` (also inside a wrapping
    clock's ``.clock``), as set otherwise."""
    inner = getattr(clock, "clock", clock)
    return inner.timing() if isinstance(inner, ScaledCpuClock) else contextlib.nullcontext()


class ExcludingClock:
    """``clock`` with some of its time left out of every interval: stamps are (the clock's stamp,
    ms excluded so far), and subclasses add to ``excluded_ms`` (HookFreeClock, unplanned.PausingClock)."""

    def __init__(self, clock: Any):
        self.clock = clock
        self.source = clock.source
        self.excluded_ms = 0.0

    def stamp(self) -> tuple[Any, float]:
        return self.clock.stamp(), self.excluded_ms

    def sync(self) -> None:
        self.clock.sync()

    def ms(self, start: tuple[Any, float], end: tuple[Any, float]) -> float:
        return self.clock.ms(start[0], end[0]) - (end[1] - start[1])


class HookFreeClock(ExcludingClock):
    """``clock`` (a CPU clock, or one wrapping it as ``.clock``) standing still while ``hook`` runs
    (NOTE [ Unit costs ], Rule 5)."""

    def __init__(self, clock: Any):
        super().__init__(clock)
        self.hook_start: Any = None
        """The wrapped clock's stamp where the running hook began; None outside hooks."""

    def __getattr__(self, name: str) -> Any:  # pause/resume of a wrapped PausingClock
        return getattr(self.__dict__["clock"], name)

    def stamp(self) -> tuple[Any, float]:
        """A stamp taken inside a hook (a unit's start or end mark is) counts the hook's time so far as
        excluded: intervals are hook-free time, never below zero. Why: it counted the hook whole from
        the next stamp on, so an interval starting inside a hook lost that hook's time before the mark
        (a GPT-2 dropout measured -0.10 ms, an internal error)."""
        now = self.clock.stamp()
        if self.hook_start is None:
            return now, self.excluded_ms
        return now, self.excluded_ms + self.clock.ms(self.hook_start, now)

    def hook(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.hook_start is not None:  # a hook within a hook: the outer one times both
            return fn(*args)
        t0 = self.hook_start = self.clock.stamp()
        try:
            return fn(*args)
        finally:
            self.hook_start = None
            self.excluded_ms += self.clock.ms(t0, self.clock.stamp())

    @staticmethod
    def applies(clock: Any) -> bool:
        """A clock whose stamps cost nothing to read (not CUDA events, which would synchronise)."""
        return isinstance(getattr(clock, "clock", clock), WallClock)


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
    """The clock for measuring whole steps on ``dev`` with ``threads`` intra-op threads, as verify and
    the benchmarks do: the wall clock on the CPU above one thread (NOTE [ Unit costs ], Rule 1);
    the profiler's is ``profile_clock``."""
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


def spread_ms(samples: Sequence[float]) -> float:
    """The spread of NOTE [ Unit costs ], Rule 4: the interquartile range of ``samples`` (inclusive
    quartiles; 0.0 with fewer than two)."""
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return float(q3 - q1)


class UnitCost(NamedTuple):
    """One unit's pooled figures (NOTE [ Unit costs ], Rules 2 to 4)."""

    forward_ms: float
    backward_ms: float
    samples: int
    forward_spread_ms: float = 0.0
    backward_spread_ms: float = 0.0


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
               groups: Mapping[str, str]) -> dict[str, UnitCost]:
    """Unit id -> its ``UnitCost``: the median and spread over the unit's cost group.

    ``samples``: unit id -> its (forward, backward) ms, one pair per timing step it ran in.
    ``groups``: unit id -> signature; a unit without one is its own group.
    """
    pooled: dict[str, list[tuple[float, float]]] = {}
    for uid, pairs in samples.items():
        pooled.setdefault(groups.get(uid) or f"unit:{uid}", []).extend(pairs)
    out = {}
    for uid in samples:
        pairs = pooled[groups.get(uid) or f"unit:{uid}"]
        fwd, bwd = [f for f, _ in pairs], [b for _, b in pairs]
        out[uid] = UnitCost(robust_ms(fwd), robust_ms(bwd), len(pairs), spread_ms(fwd), spread_ms(bwd))
    return out


def time_interleaved(steps: Mapping[str, Callable[[], Any]], *, rounds: int, clock: Any,
                     on_round: Callable[[int], None] | None = None) -> dict[str, tuple[list[float], list[float]]]:
    """Run one step of each of ``steps`` in turn, ``rounds`` times, each round starting one step later;
    name -> (clock ms, wall ms) per round.

    Interleaving puts every variant through the same drift of a shared machine; compare medians.
    ``clock`` is a ``pick_clock`` clock: on the CPU at one thread the thread's CPU time.
    """
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in steps}
    order = list(steps.items())
    for r in range(rounds):
        if on_round is not None:
            on_round(r)
        for name, step in order[r % len(order):] + order[:r % len(order)]:  # none always after the same one
            torch.manual_seed(r)
            clock.sync()
            wall, start = time.perf_counter(), clock.stamp()
            step()
            end = clock.stamp()
            clock.sync()
            out[name][1].append((time.perf_counter() - wall) * 1e3)
            out[name][0].append(clock.ms(start, end))
    return out


__all__ = ["BusyClock", "CLEAN_CPU_SHARE", "CLEAN_MIN_ROUNDS", "CLEAN_ROUNDS_FACTOR", "ThreadRounds", "calibrated",
           "thread_rounds", "clock_of", "CudaEventClock", "describe", "ExcludingClock", "HookFreeClock", "num_threads", "pick_clock",
           "profile_clock", "robust_ms", "ScaledCpuClock", "signature", "spread_ms", "thread_factor", "ThreadCpuClock",
           "time_interleaved", "TIME_SOURCES", "timing_threads", "unit_costs", "UnitCost", "WallClock"]
