"""Measure one training step of a model on a real device (CPU, CUDA): what each module call costs.

``profile_real(model, inputs, device)`` (called by ``planner.profiling.profile``) runs the step of ``planner.profiling.measure.make_step`` several times:

1. ``warmup_steps`` plain steps: they create the optimizer state, so what follows is the
   steady state of training;
2. ``steps`` timing steps with module and gradient hooks only (no tracker, so nothing
   slows them down): forward and backward milliseconds per unit, and per step phase, as
   medians, identical units pooled (see NOTE [ Unit costs ] in ``planner/profiling/timing.py``);
3. one memory step under the live-bytes tracker (see NOTE [ Live-bytes tracker ] in
   ``planner/profiling/tracker.py``): sequence numbers, the tensors each unit saves for backward,
   the units' inputs and outputs, when each parameter's gradient appears, and a timeline
   of live memory;
4. one step as the user runs it, with the module and gradient hooks of step 3 but no dispatch
   mode: its events carry the device allocator's live and peak bytes, the timeline the cost
   model calibrates on (NOTE [ Step as run ] in ``planner/profiling/as_run.py``);
5. one plain step measured by the device itself (``planner.profiling.measure.measure_step``).
   The timeline's peak must agree with it within ``RECONCILE_TOLERANCE`` (``reconcile``), and
   the memory step must have run every unit the other steps ran (NOTE [ Worst step ]); a
   profile that fails either is refused with the figures.

The result is a ``schema.Profile``; the solvers and the cost model read nothing else.
Profiling runs the optimizer with lr=0 (see ``make_optimizer``), restores buffers
(BatchNorm statistics), the RNG state and every module's train/eval flag, clears the
gradients and removes every hook, so the model comes back as it went in, moved to the
profiling device and otherwise unchanged.

Example::

    prof = profile_real(model, inputs, torch.device("cpu"), step=StepSpec(steps=3))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from planner.errors import BadInput, ProfileError
from planner.model import schema
from planner.profiling.measure import make_optimizer, make_step, measure_step, to_device
from planner.profiling.model_file import Inputs, check_devices
from planner.profiling.as_run import AsRun, as_run_timeline
from planner.profiling.assemble import assemble_profile
from planner.profiling.op_timing import OP_TIMING_STEPS, op_timing_steps
from planner.profiling.recording import MemoryRecorder, Progress, memory_step, release_grads
from planner.profiling.units import Recorder, StepTimes, UnitCall
from planner.profiling.timing import (
    HookFreeClock, calibrated, num_threads, profile_clock, robust_ms, spread_ms, timing_threads,
    unit_costs,
)
from planner.spec import StepSpec


def profile_real(model: torch.nn.Module, inputs: Inputs, dev: torch.device, *, step: StepSpec,
                 progress: Progress | None = None) -> schema.Profile:
    """Profile one training step of ``step`` on ``dev`` (resolved by ``resolve_device``, not meta); the
    step is checked by ``planner.profiling.check_step`` and documented by ``planner.spec.StepSpec``."""
    check_devices(model, inputs, dev)  # before moving: inputs on another device than the model are a user error
    with restoring_model(model, dev), num_threads(step.threads):
        clock = profile_clock(dev, torch.get_num_threads())
        return measure_profile(model, inputs, dev, step=step, clock=clock, say=progress or (lambda _msg: None))


def measure_profile(model: torch.nn.Module, inputs: Inputs, dev: torch.device, *, step: StepSpec, say: Progress,
                    clock: Any, timing_recorder: Callable[..., TimingRecorder] | None = None,
                    memory_recorder: Callable[..., MemoryRecorder] | None = None) -> schema.Profile:
    """The stages of ``profile_real`` (inside ``restoring_model`` and ``num_threads``).
    planner/profiling/memsafe.py runs them with the candidates checkpointed, its own recorders and
    a clock that leaves out recomputes."""
    recipe = step.recipe
    model.to(dev)
    model.train()
    inputs = to_device(inputs, dev)
    opt = make_optimizer(step.optimizer, model, impl=recipe.optimizer_impl)
    run = make_step(model, inputs, loss_fn=step.loss_fn, optimizer=opt, recipe=recipe)
    for i in range(step.warmup_steps):
        say(f"warm-up step {i + 1}/{step.warmup_steps}")
        run()
    scaled = calibrated(clock, run)  # NOTE [ Unit costs ], Rule 1b
    with timing_threads(clock):
        times = _timing_steps(model, run, clock, step.steps, say, recorder=timing_recorder)
    say("memory step")
    mem = memory_step(model, run, inputs, opt, dev, recipe=recipe, recorder=memory_recorder)
    say("op timing steps")
    with timing_threads(clock):
        runs = op_timing_steps(run, dev, OP_TIMING_STEPS, clock)
    if not mem.recorder.use_op_times(runs):
        mem.recorder.op_time_note = "op times from the memory step only: the op timing steps ran other ops"
    as_run = None
    if memory_recorder is None:  # planner/profiling/memsafe.py reconstructs its timeline from its own step
        say("the step as run")
        as_run = as_run_timeline(model, run, dev, mem, recipe=recipe)
    say("measuring the step's peak")
    release_grads(model, dev, recipe)
    measured = measure_step(run, dev, static_bytes=mem.static_bytes)
    result = assemble_profile(model, inputs, dev, step, times, mem, measured, as_run=as_run)
    if as_run is not None:
        reconcile(result, as_run)
    notes = [*result.notes, scaled.note()] if scaled else result.notes
    return result.model_copy(update={"time_source": clock.source, "notes": notes,
                                     "threads": torch.get_num_threads() if dev.type == "cpu" else None,
                                     "thread_scale": scaled.scale if scaled else None,
                                     "thread_scale_spread": scaled.spread if scaled else 0.0})


RECONCILE_TOLERANCE = 0.02
"""Largest |timeline peak - measured peak| / measured peak a profile may plan on (NOTE [ Step as run ])."""


def reconcile(prof: schema.Profile, as_run: AsRun) -> None:
    """Refuse a profile whose step is not the one the user runs: its memory step skipped units other
    profiled steps ran (NOTE [ Worst step ]), it kept tensors alive that the step as run does not, or its
    timeline peaks away from the plain step's peak as the device measures it (NOTE [ Step as run ],
    Rule 3). Raises ``ProfileError`` with the figures."""
    structure = prof.step_structure
    if skipped := structure.skipped.get("memory step"):
        raise ProfileError(
            f"the model's module calls vary between training steps: the memory step skipped "
            f"{', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}, which other steps ran (stochastic depth "
            f"that remat cannot switch off?); remat plans for the step that runs every unit: make the skipping "
            f"deterministic while profiling, or use the layerdrop attribute Hugging Face models use")
    step = prof.step
    measured = step.measured_peak_bytes
    if measured and as_run.excess_live_bytes > RECONCILE_TOLERANCE * measured:
        raise ProfileError(
            f"the model runs differently under remat's profiler: at {as_run.excess_at} its step kept "
            f"{as_run.excess_live_bytes} bytes more alive than as you run it ({as_run.excess_live_bytes / measured:.2%} "
            f"of its peak), so the tensors remat recorded are not the step's; does the model check for a "
            f"TorchDispatchMode (torch.utils._python_dispatch)?")
    timeline_peak = max((e.peak_bytes for e in prof.timeline), default=0)
    if not measured or abs(timeline_peak - measured) <= RECONCILE_TOLERANCE * measured:
        return
    if step.timeline_source == "as-run":
        why = ("the step's memory differs from one run to the next (a shape or a slice drawn at random, routing "
               "that depends on the data); remat plans one step, so make the step allocate the same each run while "
               "profiling (fix what varies at its largest case), then plan")
    else:
        why = ("the step runs differently under remat's tracker (a dispatch mode), and its module calls "
               "differed between steps, so it could not be measured window by window as run")
    raise ProfileError(
        f"cannot reconcile the profiled timeline with the step as you run it: the timeline ({step.timeline_source}) "
        f"peaks at {timeline_peak} bytes, the device measured {measured} bytes ({step.peak_source}), "
        f"{(timeline_peak - measured) / measured:+.2%}; {why}")


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' -> cuda if available else cpu; checks that CUDA exists when asked for."""
    if isinstance(device, str):
        name = device.strip().lower()
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "meta":
            return torch.device("meta")
        if name != "cpu" and not name.startswith("cuda"):
            raise BadInput(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise BadInput(f"invalid device {device!r}; use auto, cpu, cuda or cuda:N") from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise BadInput(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or a torch.device")
    if dev.type == "meta":
        return dev
    if dev.type not in ("cpu", "cuda"):
        raise BadInput(f"cannot profile on device {dev}; use cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInput(f"device {str(dev)!r} asked for, but CUDA is not available to this PyTorch; use {{device}} "
                           f"cpu", options=("device",))
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= (count := torch.cuda.device_count()):
            raise BadInput(f"device {dev} does not exist: {count} CUDA device(s) visible (CUDA_VISIBLE_DEVICES "
                           f"renumbers them from 0); use {{device}} cuda:0" + (f" to cuda:{count - 1}" if count > 1
                                                                              else ""), options=("device",))
    return dev


# ----------------------------------------------------------------------------- timing steps


class TimingRecorder(Recorder):
    """Stamps on the profile's clock; on the CPU one that leaves the recorder's own hooks out (NOTE
    [ Unit costs ], Rule 5): read intervals with ``self.clock.ms``."""

    def __init__(self, model: torch.nn.Module, clock: Any):
        self.clock = HookFreeClock(clock) if HookFreeClock.applies(clock) else clock
        super().__init__(model)

    def _note(self, kind: str, unit: UnitCall | None) -> Any:
        return self.clock.stamp()

    def _pre(self, *args: Any) -> None:
        return self._hooked(super()._pre, *args)

    def _inputs(self, *args: Any) -> None:
        return self._hooked(super()._inputs, *args)

    def _post(self, *args: Any) -> None:
        return self._hooked(super()._post, *args)

    def _fire_ends(self, *args: Any) -> None:
        return self._hooked(super()._fire_ends, *args)

    def _fire_starts(self, *args: Any) -> None:
        return self._hooked(super()._fire_starts, *args)

    def _hooked(self, fn: Callable[..., None], *args: Any) -> None:
        return self.clock.hook(fn, *args) if isinstance(self.clock, HookFreeClock) else fn(*args)




def _timing_steps(model: torch.nn.Module, step: Callable, clock: Any, steps: int, say: Progress, *,
                  recorder: Callable[..., TimingRecorder] | None = None) -> StepTimes:
    """``steps`` steps under the timing recorder; medians per phase and per unit (NOTE [ Unit costs ])."""
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    times = StepTimes()
    with (recorder or TimingRecorder)(model, clock) as rec:
        clock = rec.clock  # NOTE [ Unit costs ], Rule 5
        for i in range(steps):
            say(f"timing step {i + 1}/{steps}")
            rec.reset()
            step(rec.mark)
            clock.sync()
            m = rec.marks
            phases["forward"].append(clock.ms(m["step_start"], m["forward_end"]))
            phases["backward"].append(clock.ms(m["backward_start"], m["backward_end"]))
            phases["optimizer"].append(clock.ms(m["backward_end"], m["optimizer_end"]))
            times.unit_ids.append([u.id for u in rec.units])
            for u in rec.units:
                fwd = clock.ms(u.fwd_start, u.fwd_end)
                bwd = clock.ms(u.bwd_start, u.bwd_end) if u.bwd_start is not None and u.bwd_end is not None else 0.0
                times.unit_samples.setdefault(u.id, []).append((fwd, max(bwd, 0.0)))
    times.forward_ms, times.backward_ms, times.optimizer_ms = (robust_ms(phases[k]) for k in phases)
    times.unit_ms = {uid: (c.forward_ms, c.backward_ms) for uid, c in unit_costs(times.unit_samples, {}).items()}
    times.phase_spread_ms = {k: spread_ms(v) for k, v in phases.items()}
    return times


@contextlib.contextmanager
def restoring_model(model: torch.nn.Module, dev: torch.device) -> Iterator[None]:
    """Give the model back as it came: train/eval flags, buffers, every RNG's state (NOTE [ Randomness outside
    torch ]); gradients cleared."""
    from planner.profiling import rng

    modes = [(m, m.training) for m in model.modules()]
    with rng.kept(dev), buffers_kept(model):
        try:
            yield
        finally:
            model.zero_grad(set_to_none=True)
            for m, training in modes:
                m.training = training


@contextlib.contextmanager
def buffers_kept(model: torch.nn.Module | None) -> Iterator[None]:
    """``model``'s buffers (BatchNorm's running statistics, counters) as they were, afterwards; by name, a copy
    on the host, so a buffer the step replaced or moved is written back too. ``None``: nothing to keep."""
    buffers = {name: b.detach().to("cpu", copy=True) for name, b in model.named_buffers()} if model is not None else {}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers() if model is not None else ():
                saved = buffers.get(name)
                if saved is not None and saved.shape == b.shape:
                    b.copy_(saved)


__all__ = ["buffers_kept", "measure_profile", "profile_real", "reconcile", "RECONCILE_TOLERANCE", "resolve_device",
           "restoring_model", "TimingRecorder"]
