"""Unit costs (NOTE [ Unit costs ] in planner/profiling/timing.py) and the roofline's calibration.

No timing thresholds: the checks are on what the costs are made of (pooling, medians, the
clock and thread count recorded), not on how fast anything ran.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import planner.profiling.devices
from planner.act.api import graph_for, plan_from_profile
from planner.profiling.devices import get_device, load_calibration
from planner.profiling.meta import profile_meta
from planner.errors import BadInput
from planner.profiling.roofline import fit_calibration
from planner.profiling import profile
from planner.cli.render import time_line
from planner.profiling.timing import spread_ms, unit_costs


def _sum(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _stack() -> nn.Module:
    """An input projection, then three identical blocks: one cost group."""
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))  # noqa: E731
    return nn.Sequential(nn.Linear(64, 64), block(), block(), block())


def test_costs_are_medians_pooled_over_the_group():
    samples = {"a": [(1.0, 10.0), (100.0, 10.0)], "b": [(2.0, 20.0), (3.0, 20.0)], "c": [(5.0, 1.0), (7.0, 3.0)]}
    costs = unit_costs(samples, {"a": "g", "b": "g"})
    assert costs["a"] == costs["b"] and costs["a"][:3] == (2.5, 15.0, 4)  # one outlier (100) does not move the median
    assert costs["c"][:3] == (6.0, 2.0, 2)  # its own group
    # the spread (NOTE [ Unit costs ], Rule 4): interquartile range, inclusive quartiles
    assert costs["a"].forward_spread_ms == 27.25 - 1.75 and costs["a"].backward_spread_ms == 10.0
    assert costs["c"].forward_spread_ms == 1.0 and spread_ms([4.0]) == 0.0


def test_identical_blocks_get_one_price_on_the_thread_clock():
    before = torch.get_num_threads()
    prof = profile(_stack(), torch.randn(16, 64), loss_fn=_sum, device="cpu", steps=2, threads=1)
    assert torch.get_num_threads() == before  # restored
    assert (prof.time_source, prof.threads) == ("cpu-thread-time", 1)
    blocks = [prof.unit(u) for u in ("1", "2", "3")]
    assert len({b.cost_group for b in blocks}) == 1 and blocks[0].cost_group
    assert len({(b.forward_ms, b.backward_ms) for b in blocks}) == 1
    assert all(b.timing_samples == 3 * 2 for b in blocks)
    assert prof.unit("0").cost_group != blocks[0].cost_group  # its input is the batch: no input gradient
    plan = plan_from_profile(prof, prof.step.measured_peak_bytes * 10)
    assert (plan.time_source, plan.threads) == ("cpu-thread-time", 1)
    assert "cpu-thread-time at 1 thread" in time_line(plan.time_source, plan.threads, plan.time_calibration)


def test_calibration_refits_the_roofline_to_the_measured_units(tmp_path, monkeypatch):
    """With CPU rules the faked step is the real one, so a CPU-measured profile can stand in for
    a GPU's: after the fit, the roofline's candidate-unit total equals the measured total."""
    monkeypatch.setattr(planner.profiling.devices, "CALIBRATION_DIR", tmp_path)
    spec = get_device("h100")
    x = torch.randn(16, 64)
    real = profile(_stack(), x, loss_fn=_sum, device="cpu", steps=1)
    fake = profile_meta(_stack(), x, loss_fn=_sum, target=spec, device_type="cpu")
    assert fake.time_source == "roofline" and fake.time_calibration is None
    assert any("UNCALIBRATED" in n for n in fake.notes)
    assert "UNCALIBRATED" in time_line(fake.time_source, fake.threads, fake.time_calibration)

    with pytest.raises(BadInput, match=r"no candidate unit is modelled at 2.0 ms or more \(the longest: 0.0"):
        fit_calibration([(real, fake)], measured_on="cpu stand-in", models=["stack"])  # an H100 runs it in us
    cal = fit_calibration([(real, fake)], measured_on="cpu stand-in", models=["stack"], min_unit_ms=0.0)
    (tmp_path / f"{spec.name}.json").write_text(cal.model_dump_json())
    assert load_calibration(spec) == cal
    refit = profile_meta(_stack(), x, loss_fn=_sum, target=spec, device_type="cpu")
    assert refit.time_calibration == f"profiles/devices/calibration/{spec.name}.json"
    assert any("calibrated by" in n for n in refit.notes)

    def total(p, nodes):
        return sum(p.unit(n).forward_ms + p.unit(n).backward_ms for n in nodes)

    nodes = list(graph_for(real).nodes)
    assert cal.matmul_efficiency < 1 and cal.bandwidth_efficiency < 1  # a CPU is far below an H100's roofline
    assert total(refit, nodes) == pytest.approx(total(real, nodes), rel=1e-6)
    with pytest.raises(Exception, match="uncalibrated"):
        fit_calibration([(real, refit)], measured_on="x", models=["stack"])


def test_more_threads_time_at_one_thread_and_scale():
    """NOTE [ Unit costs ], Rule 1b: above one thread the figures are the one-thread CPU times times
    the measured wall-to-CPU ratio of the forward, within [1/N, 1] (above 1 is load)."""
    from planner.profiling.timing import thread_factor

    assert (thread_factor(30.0, 10.0, 2), thread_factor(3.0, 10.0, 2), thread_factor(7.0, 10.0, 2)) == (1.0, 0.5, 0.7)
    before = torch.get_num_threads()
    prof = profile(_stack(), torch.randn(16, 64), loss_fn=_sum, device="cpu", steps=2, threads=2)
    assert torch.get_num_threads() == before  # restored
    assert (prof.time_source, prof.threads) == ("cpu-thread-time-scaled", 2)
    assert prof.thread_scale is not None and 0.5 <= prof.thread_scale <= 1.0 and prof.thread_scale_spread >= 0
    blocks = [prof.unit(u) for u in ("1", "2", "3")]
    assert len({(b.forward_ms, b.backward_ms, b.forward_spread_ms) for b in blocks}) == 1
    ops = [[o.forward_ms for o in prof.ops if o.unit.startswith(f"{u}.") or o.unit == u] for u in ("1", "2", "3")]
    assert ops[0] and ops[0] == ops[1] == ops[2]  # op times pooled over the cost group (NOTE [ Op records ])
    assert "cpu-thread-time-scaled at 2 threads" in time_line(prof.time_source, prof.threads, prof.time_calibration)


def test_a_thread_factor_counts_only_the_rounds_the_threads_were_ours(monkeypatch):
    """NOTE [ Clean rounds ]: an N-thread run counts when the process's CPU time over it was close to N
    times its wall time; rounds go on until enough are clean, at most three times as many; too few
    clean, and the whole forward's factor is taken over every round. Scripted runs, and one real clock."""
    from planner.profiling import timing

    clock = timing.BusyClock()
    time.sleep(0.1)  # workers of an earlier parallel region stop spinning
    t0 = clock.stamp()
    while time.perf_counter() - t0 < 0.02:  # one thread busy: its CPU time is at most the wall time
        pass
    wall_ms = clock.ms(t0, clock.stamp())
    assert 0 < clock.cpu_ms and not clock.clean(wall_ms, 2)

    busy = iter([False, True, True, False, True, False, False] + [True] * 30)
    state = {"busy": False}

    def run(clock):  # 10 ms at one thread; at two, 6 ms, or 12 ms when another process had a core
        if isinstance(clock, timing.ThreadCpuClock):
            state["busy"] = next(busy, True)  # the N-thread run that follows sees this
            return 10.0
        return 12.0 if state["busy"] else 6.0

    monkeypatch.setattr(timing.BusyClock, "clean", lambda self, wall_ms, threads: not state["busy"])
    r = timing.thread_rounds(run, threads=2, rounds=3)
    # the unrecorded round (Rule 3) took the first draw; then busy, busy, clean, busy, clean, clean: stop
    assert [b for b, _ in r.every] == [12.0, 12.0, 6.0, 12.0, 6.0, 6.0] and len(r.clean) == 3
    assert r.enough_clean(3) and {b for b, _ in r.clean} == {6.0}
    monkeypatch.setattr(timing.BusyClock, "clean", lambda self, wall_ms, threads: False)
    r = timing.thread_rounds(lambda clock: 10.0 if isinstance(clock, timing.ThreadCpuClock) else 12.0, threads=2, rounds=3)
    assert (len(r.every), len(r.clean), r.enough_clean(3)) == (3, 0, False)  # none clean: the wanted rounds only
    state["busy"] = False
    flips = iter([True, False] + [True] * 30)  # one clean round among the first three: on, up to 3 x 3
    monkeypatch.setattr(timing.BusyClock, "clean", lambda self, wall_ms, threads: not next(flips))
    r = timing.thread_rounds(lambda clock: 10.0 if isinstance(clock, timing.ThreadCpuClock) else 12.0, threads=2, rounds=3)
    assert (len(r.every), len(r.clean)) == (9, 1)


def test_the_whole_forwards_factor_says_which_rounds_it_was_taken_over(monkeypatch):
    """NOTE [ Clean rounds ], Rule 2: ``calibrate`` takes the clean rounds when enough were clean, every
    round otherwise, and the profile's note (``ScaledCpuClock.note``) says which."""
    from planner.profiling import timing

    clean = timing.ThreadRounds(one=[10.0] * 4, every=[(6.0, 10.0), (9.0, 10.0), (6.5, 10.0), (7.0, 10.0)],
                                clean=[(6.0, 10.0), (6.5, 10.0), (7.0, 10.0)])
    monkeypatch.setattr(timing, "thread_rounds", lambda run, threads, rounds: clean)
    clock = timing.ScaledCpuClock(2)
    clock.calibrate(lambda: None, rounds=3)
    assert (clock.scale, clock.over_every_round) == (0.6, False)
    assert clock.note() == "thread factor of the whole forward 0.600 over 3 of 4 rounds clean (NOTE [ Clean rounds ])"
    busy = clean._replace(every=[(9.0, 10.0), (8.0, 10.0), (9.5, 10.0)], one=[10.0] * 3, clean=[(9.0, 10.0)])
    monkeypatch.setattr(timing, "thread_rounds", lambda run, threads, rounds: busy)
    clock.calibrate(lambda: None, rounds=3)
    assert (clock.scale, clock.over_every_round) == (0.8, True)
    assert clock.note() == ("thread factor of the whole forward 0.800 over 1 of 3 rounds clean, the rest busy: "
                            "taken over every round (NOTE [ Clean rounds ])")


def test_the_profilers_own_hooks_do_not_count(monkeypatch):
    """NOTE [ Unit costs ], Rule 5: on the CPU clocks a unit's forward leaves out the time the
    recorder's own hooks take (its own and its submodules'). Here each hook's bookkeeping takes
    2 s on a clock that moves only when told; each child's work 1 s: the parent reads 3 s, not 11 s."""
    from planner.profiling import units
    from planner.profiling.profiler import TimingRecorder
    from planner.profiling.timing import WallClock

    class Clock(WallClock):
        now = 0.0

        def stamp(self):
            return self.now

    clock = Clock()

    class Work(nn.Module):
        def forward(self, x):
            clock.now += 1.0
            return x

    monkeypatch.setattr(units.Recorder, "_on_inputs", lambda *_: setattr(clock, "now", clock.now + 2.0))
    model = nn.Sequential(Work(), Work(), Work())
    with TimingRecorder(model, clock) as rec:
        rec.mark("step_start")
        model(torch.ones(2))
        rec.mark("forward_end")
    ms = {u.id: rec.clock.ms(u.fwd_start, u.fwd_end) for u in rec.units}
    assert ms == {"<root>": 3000.0, "0": 1000.0, "1": 1000.0, "2": 1000.0}
    assert rec.clock.ms(rec.marks["step_start"], rec.marks["forward_end"]) == 3000.0


def test_a_mark_taken_inside_a_hook_counts_only_hook_free_time():
    """HookFreeClock.stamp: a unit's start mark is taken inside the recorder's hook; the hook's time
    before the mark is left out as well as after it (it was left out whole from the next stamp on, so
    a small unit read below zero: -0.10 ms on a GPT-2 dropout, an internal error)."""
    from planner.profiling.timing import HookFreeClock, WallClock

    class Clock(WallClock):
        now = 0.0

        def stamp(self):
            return self.now

    raw = Clock()
    clock = HookFreeClock(raw)
    marks = {}

    def hook(name):
        raw.now += 2.0  # bookkeeping before the mark
        marks[name] = clock.stamp()
        raw.now += 1.0  # and after it
        clock.hook(lambda: setattr(raw, "now", raw.now + 5.0))  # a nested hook: timed by the outer one

    clock.hook(hook, "start")
    raw.now += 1.0  # the unit's own work
    clock.hook(hook, "end")
    assert clock.ms(marks["start"], marks["end"]) == 1000.0
