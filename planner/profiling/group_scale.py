"""The thread factor of each cost group's forward, measured on one region of the group alone.

Example::

    scales = measure_group_scales(model, inputs, prof, loss_fn=loss_fn, amp=None, dev=dev, threads=2)
    prof = with_group_scales(prof, scales)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from planner.model.schema import Profile
from planner.profiling.timing import ScaledCpuClock, num_threads, spread_ms, thread_factor, thread_rounds

# NOTE [ Thread factor per cost group ]
# Above one CPU thread every figure is a one-thread CPU time times the thread factor of the
# model's whole forward (NOTE [ Unit costs ], Rule 1b). A recompute reruns a block, not the
# whole forward, and the two do not speed up alike: GPT-2's forward holds a head matmul over a
# 50k vocabulary that two threads nearly halve, its blocks many small ops that they do not, so
# at 2 threads the whole forward ran at 0.62 to 0.69 of its one-thread time and the blocks'
# recompute at about 0.8, and every whole-module plan was predicted 11 to 34% under its
# measured overhead (docs/benchmarks.md, "Predicted recompute vs measured overhead").
# Rule 1. So each cost group's factor is measured on the group: one region per group (the
# regions of NOTE [ Selective dispatch cost ], Rule 2: top-level candidates called once, a
# tenth of the largest one's op calls or more) runs its forward alone on the inputs it got in
# a plain step, ``GROUP_ROUNDS`` interleaved rounds at one thread (the thread's CPU time) and
# at the profile's threads (wall time), after one round unrecorded; the factor is the least
# wall time over the least CPU time, kept within [1/N, 1] as for the whole forward
# (``thread_factor``), and its spread that of the per-round ratios.
# Rule 2. The group's members, the units inside them and their op calls are rescaled from the
# whole forward's factor to the group's (forward times and spreads; ``UnitRecord.thread_scale``
# records it); the backward and the rest of the step keep the whole forward's. Selective
# dispatch is Python and unscaled either way (NOTE [ Selective dispatch cost ], Rule 5).
# Rule 3. A group whose region cannot run alone keeps the whole forward's factor.
# Rule 4. Only clean rounds count (NOTE [ Clean rounds ] in planner/profiling/timing.py): a group
# with too few keeps the whole forward's factor (as Rule 3), and the profile's note says so.
# Rule 5. Two windows, seconds apart: the rounds run before and again after the selective dispatch
# timing, and each group takes the lesser factor of the two (``least_group_scales``). Some slow
# spells are not another process on the cores: in them every two-thread run of Llama's layer ran
# at 0.72 to 0.83 of its one-thread time for the whole of one window (against 0.56 to 0.74 in the
# next), with the process's CPU time at two threads and no page faults; the group read 0.719 to
# 0.771 in such profiles and 0.956 in one run of benchmarks/time_model.py (the whole forward:
# 0.62 to 0.74), so the layers' recompute was predicted 43% over its measured overhead. The least
# of two windows is wrong only when both fall in such a spell.

GROUP_ROUNDS = 7
"""Clean interleaved rounds wanted per cost group (Rules 1 and 4)."""


class GroupScale(NamedTuple):
    """The thread factor of one cost group's forward, its spread and its clean rounds (Rules 1 and 4);
    ``scale`` is None where too few rounds were clean (the group keeps the whole forward's factor)."""

    fqn: str
    scale: float | None
    spread: float
    clean_rounds: int = GROUP_ROUNDS
    rounds: int = GROUP_ROUNDS


def measure_group_scales(model: nn.Module, inputs: Any, prof: Profile, *, loss_fn: Callable[[Any], Any] | None,
                         amp: str | None, threads: int, rounds: int = GROUP_ROUNDS) -> list[GroupScale]:
    """One ``GroupScale`` per region of NOTE [ Thread factor per cost group ], Rule 1 (none at one thread,
    on a clock other than the scaled one, or where the regions cannot run alone)."""
    from planner.profiling.profiler import restoring_model

    if threads <= 1 or prof.time_source != ScaledCpuClock.source:
        return []
    with restoring_model(model, torch.device("cpu")):
        try:
            return _measure(model, inputs, prof, loss_fn, amp, threads, rounds)
        except Exception:  # noqa: BLE001 - regions that cannot run alone keep the whole factor (Rule 3)
            return []


def _measure(model: nn.Module, inputs: Any, prof: Profile, loss_fn: Callable[[Any], Any] | None, amp: str | None,
             threads: int, rounds: int) -> list[GroupScale]:
    from planner.profiling.measure import AMP_DTYPES, make_step
    from planner.profiling.sac_cost import _recorded_inputs, _regions

    modules = dict(model.named_modules())
    fqns = [fqn for fqn, _ in _regions(prof, model)]
    mods = [modules[fqn] for fqn in fqns]
    step = make_step(model, inputs, loss_fn=loss_fn, optimizer=None, amp=amp)
    with num_threads(1):
        calls = _recorded_inputs(step, mods)
    autocast = (lambda: torch.autocast("cpu", dtype=AMP_DTYPES[amp])) if amp else contextlib.nullcontext
    out = []
    for fqn, m, call in zip(fqns, mods, calls):
        try:
            r = thread_rounds(lambda clock, m=m, call=call: _forward_ms(m, call, clock, autocast), threads, rounds)
        except Exception:  # noqa: BLE001 - a region that cannot run alone keeps the whole factor (Rule 3)
            continue
        if min(r.one) <= 0:
            continue
        if not r.enough_clean(rounds):
            out.append(GroupScale(fqn, None, 0.0, len(r.clean), len(r.every)))
            continue
        out.append(GroupScale(fqn, thread_factor(min(b for b, _ in r.clean), min(r.one), threads),
                              spread_ms([b / a for b, a in r.clean if a > 0]), len(r.clean), len(r.every)))
    model.zero_grad(set_to_none=True)
    return out


def _forward_ms(m: nn.Module, call: tuple[tuple, dict], clock: Any, autocast: Callable[[], Any]) -> float:
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.clone() if t.is_floating_point() else t, call)
    t0 = clock.stamp()
    with autocast():
        out = m(*args, **kwargs)
    t1 = clock.stamp()
    del out
    return clock.ms(t0, t1)


def least_group_scales(*windows: list[GroupScale]) -> list[GroupScale]:
    """Per group, the window's ``GroupScale`` of the lesser factor (Rule 5), its clean rounds and rounds
    summed over the windows; a group no window could time keeps the whole forward's factor."""
    out: dict[str, GroupScale] = {}
    for s in (s for w in windows for s in w):
        seen = out.get(s.fqn)
        if seen is None:
            out[s.fqn] = s
            continue
        best = min((x for x in (seen, s) if x.scale is not None), key=lambda x: x.scale, default=seen)
        out[s.fqn] = best._replace(clean_rounds=seen.clean_rounds + s.clean_rounds, rounds=seen.rounds + s.rounds)
    return list(out.values())


def with_group_scales(prof: Profile, scales: list[GroupScale]) -> Profile:
    """``prof`` with each measured group's forward figures rescaled to its own factor (Rule 2)."""
    if not scales or prof.time_source != ScaledCpuClock.source or not prof.thread_scale:
        return prof
    by_fqn = {u.fqn: u for u in prof.units}
    factor = {by_fqn[s.fqn].cost_group or s.fqn: s.scale for s in scales if s.fqn in by_fqn and s.scale is not None}
    ranges = [(u.fwd_start_seq, u.fwd_end_seq, factor[key] / prof.thread_scale)
              for u in prof.units if (key := u.cost_group or u.fqn) in factor]

    def ratio_of(lo: int, hi: int) -> float | None:
        return next((r for a, b, r in ranges if a <= lo and hi <= b), None)

    units = [u if (ratio := ratio_of(u.fwd_start_seq, u.fwd_end_seq)) is None else u.model_copy(update={
        "forward_ms": u.forward_ms * ratio, "forward_spread_ms": u.forward_spread_ms * ratio,
        "thread_scale": prof.thread_scale * ratio}) for u in prof.units]
    ops = [o if (ratio := ratio_of(o.seq, o.seq)) is None else o.model_copy(update={"forward_ms": o.forward_ms * ratio})
           for o in prof.ops]
    notes = [*prof.notes, "thread factor per cost group (NOTE [ Thread factor per cost group ]): " + ", ".join(
        f"{s.fqn}'s group {s.scale:.3f} (spread {s.spread:.3f}, {s.clean_rounds} of {s.rounds} rounds clean)"
        if s.scale is not None else f"{s.fqn}'s group: the whole forward's ({s.clean_rounds} of {s.rounds} rounds clean, "
        f"the cores were busy)" for s in scales) + f"; whole forward {prof.thread_scale:.3f}"]
    return prof.model_copy(update={"units": units, "ops": ops, "notes": notes})


__all__ = ["GROUP_ROUNDS", "GroupScale", "least_group_scales", "measure_group_scales", "with_group_scales"]
