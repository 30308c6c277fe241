"""Profile a training step that does not fit the device: measure it with the candidates checkpointed.

``profile_within(model, inputs, device_memory_bytes=M)`` (``remat plan --device-memory M``) profiles
as ``planner.profiling.profile`` does when the step fits. When it does not (a fake-tensor pass
predicts a peak above M, or the step runs out of memory), it measures the step with every
default candidate checkpointed, then with their children, and returns a profile of the
*unplanned* step, as a full profile would have measured it (NOTE [ Memory-safe profile ], rebuilt by ``planner.profiling.unplanned``).
Only when neither fits does it fall back to fake tensors (``--device meta``), with a note.

Example::

    prof = profile_within(model, inputs, step=StepSpec(device="cuda", device_memory_bytes=16 << 30))
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from planner.model import schema
from planner.errors import BadInput, ProfileError
from planner.profiling.measure import is_oom
from planner.profiling.model_file import Inputs, check_devices
from planner.profiling import profile_as_run
from planner.profiling.profiler import measure_profile, restoring_model, resolve_device
from planner.profiling.timing import num_threads, profile_clock
from planner.profiling.unplanned import (CheckpointedMemory, CheckpointedTiming, Checkpointing, PausingClock,
                                         as_unplanned)
from planner.spec import StepSpec, step_spec

Progress = Callable[[str], None]

def profile_within(model: torch.nn.Module, inputs: Inputs, *, step: StepSpec | None = None,
                   progress: Progress | None = None, **step_fields: Any) -> schema.Profile:
    """Profile one training step of ``model``; under checkpointing when it does not fit the device.

    Without ``step.device_memory_bytes`` the step is run as ``planner.profiling.profile_as_run`` runs it,
    and only running out of memory leads to the memory-safe profile. With it, a fake-tensor pass
    (``planner.profiling.meta``, following this device's rules) predicts the unplanned peak first; on
    CUDA the cap is also enforced (``torch.cuda.set_per_process_memory_fraction``); on the CPU
    run this in a process whose address space is capped (``planner.profiling.capped``) to enforce it.
    ``step_fields`` replace fields of ``step`` (``planner.spec.StepSpec``), as for ``planner.profile``.

    Returns a profile of the unplanned step; ``measured_with_checkpoints`` lists what was
    checkpointed while measuring (empty for a full profile). See NOTE [ Memory-safe profile ].

    Raises:
        ProfileError: user code failed, or nothing fits and no fake-tensor fallback exists.
    """
    from planner.model.fingerprint import module_fqns
    from planner.profiling import check_step, with_built_modules
    from planner.profiling.measure import kept_input_grads
    from planner.profiling.step_changes import profiled_with_step_changes

    spec = step_spec(step, **step_fields)
    check_step(spec)
    built = module_fqns(model)  # before any pass runs the model (NOTE
    # [ Modules made by the first step ]); see NOTE [ Step changes ]: every path below (the full profile,
    # the checkpointed one, the fake-tensor ones) profiles the step the plan will run; ``profile_as_run``
    # finds the same changes already installed
    with profiled_with_step_changes(model) as changes, kept_input_grads(inputs):
        prof = _profile_within(model, inputs, spec, progress)
    return with_built_modules(prof.model_copy(update={"step_changes": changes}), built)


def _validated(model: torch.nn.Module, inputs: Inputs, prof: schema.Profile, step: StepSpec, dev: torch.device,
               progress: Progress | None) -> schema.Profile:
    """``prof`` with the validation step's retained bytes and excluded units (NOTE [ Validation step ]), as
    ``profile`` measures them: the validation step runs with the candidates checkpointed, so it fits
    where the checkpointed profile did."""
    from planner.profiling.measure import to_device
    from planner.profiling.sac_cost import measure_sac_cost, with_sac_cost
    from planner.profiling.timing import clock_of, timing_threads
    from planner.profiling.validate import validate

    loss_fn, amp = step.loss_fn, step.recipe.amp
    (progress or (lambda _msg: None))("validation step: what checkpointing frees")
    try:
        found = validate(model, to_device(inputs, dev), prof, loss_fn=loss_fn, amp=amp, dev=dev)
    except (ProfileError, RuntimeError, MemoryError) as e:
        if not _out_of_memory(e):
            raise
        _free(model, dev)
        return prof.model_copy(update={"notes": [*prof.notes, f"validation step skipped: {_first_line(e)}"]})
    prof = prof.model_copy(update=found._asdict())
    if not prof.ops:
        return prof
    (progress or (lambda _msg: None))("timing selective checkpointing's dispatch")
    try:  # keeping every op output may not fit where the checkpointed profile did
        clock = clock_of(prof, dev)
        with timing_threads(clock):
            cost = measure_sac_cost(model, to_device(inputs, dev), prof, loss_fn=loss_fn, amp=amp, dev=dev,
                                    clock=clock)
    except (ProfileError, RuntimeError, MemoryError) as e:
        if not _out_of_memory(e):
            raise
        _free(model, dev)
        return prof.model_copy(update={"notes": [*prof.notes, "selective checkpointing's dispatch cost not "
                                                                f"measured (0): {_first_line(e)}"]})
    return with_sac_cost(prof, cost)


def _profile_within(model: torch.nn.Module, inputs: Inputs, step: StepSpec,
                    progress: Progress | None) -> schema.Profile:
    dev = resolve_device(step.device)
    device_memory_bytes = step.device_memory_bytes
    step = step.replace(device=dev)
    if dev.type == "meta":
        raise BadInput("device 'meta' runs nothing, so there is nothing to keep within a device's memory; "
                       "use planner.profile(..., device='meta', target=...)")
    say = progress or (lambda _msg: None)
    check_devices(model, inputs, dev)
    with _cuda_cap(dev, device_memory_bytes):
        estimate = None
        why = ""
        if device_memory_bytes is not None:
            estimate = _fake_profile(model, inputs, dev, step)
            predicted = estimate.step.measured_peak_bytes or 0
            if predicted > device_memory_bytes:
                why = (f"the unplanned step needs {predicted} bytes (fake-tensor pass), more than the "
                       f"device's {device_memory_bytes}")
        if not why:
            try:
                return profile_as_run(model, inputs, step=step, progress=progress)
            except (ProfileError, RuntimeError, MemoryError) as e:
                if not _out_of_memory(e):
                    raise
                why = f"the unplanned step ran out of memory ({_first_line(e)})"
            _free(model, dev)
        say(f"memory-safe profile: {why}")
        if estimate is None:
            estimate = _fake_profile(model, inputs, dev, step)
        tried = []
        for level in (0, 1):
            fqns = candidate_modules(estimate, level)
            if not fqns or fqns in tried:
                continue
            tried.append(fqns)
            say(f"profiling with {len(fqns)} modules checkpointed")
            try:
                prof = profile_checkpointed(model, inputs, checkpointed=fqns, step=step, progress=progress)
            except (ProfileError, RuntimeError, MemoryError) as e:
                if not _out_of_memory(e):
                    raise
                why += f"; with {len(fqns)} modules checkpointed it ran out of memory too"
                prof = None
            if prof is None:
                _free(model, dev)  # outside the except block: the failed step's frames are gone
                continue
            return prof.model_copy(update={"notes": [*prof.notes, f"memory-safe profile: {why}"]})
    return _meta_fallback(model, inputs, dev, why, step)


def profile_checkpointed(model: torch.nn.Module, inputs: Inputs, *, checkpointed: Sequence[str],
                         step: StepSpec | None = None, progress: Progress | None = None,
                         **step_fields: Any) -> schema.Profile:
    """Measure the step with the modules ``checkpointed`` (FQNs) checkpointed; return the
    profile of the unplanned step (NOTE [ Memory-safe profile ]). ``step`` and ``step_fields``
    as for ``profile_within``.

    The modules must not nest (one inside another). Every call of each is checkpointed. The step
    runs with the model's step changes (NOTE [ Step changes ]), as ``profile_within`` runs it.
    """
    from planner.profiling.step_changes import profiled_with_step_changes

    spec = step_spec(step, **step_fields)
    with profiled_with_step_changes(model) as changes:  # nothing new (and nothing said) under profile_within
        prof = _profile_checkpointed(model, inputs, checkpointed, spec, progress)
    return prof.model_copy(update={"step_changes": changes})


def _profile_checkpointed(model: torch.nn.Module, inputs: Inputs, checkpointed: Sequence[str], step: StepSpec,
                          progress: Progress | None) -> schema.Profile:
    dev = resolve_device(step.device)
    if dev.type == "meta":
        raise BadInput("a checkpointed profile runs the step; use cpu or cuda")
    fqns = list(dict.fromkeys(checkpointed))
    modules = dict(model.named_modules())
    unknown = [f for f in fqns if f not in modules]
    if unknown:
        raise BadInput(f"cannot checkpoint {unknown[:3]}: not modules of the model")
    for a in fqns:
        for b in fqns:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise BadInput(f"checkpointed modules must not nest: {a or '<root>'!r} contains {b!r}")
    check_devices(model, inputs, dev)
    say = progress or (lambda _msg: None)
    ckpt = Checkpointing([modules[f] for f in fqns])
    timing: list[CheckpointedTiming] = []

    def timing_recorder(m: torch.nn.Module, clock: Any) -> CheckpointedTiming:
        timing.append(CheckpointedTiming(m, clock, ckpt))
        return timing[-1]

    with restoring_model(model, dev), num_threads(step.threads), ckpt:
        prof = measure_profile(model, inputs, dev, step=step, say=say,
                        clock=PausingClock(profile_clock(dev, torch.get_num_threads())),
                        timing_recorder=timing_recorder,
                        memory_recorder=lambda m, tracker: CheckpointedMemory(m, tracker, ckpt))
    prof = as_unplanned(prof, fqns, timing[-1].recompute_ms if timing else {})
    return _validated(model, inputs, prof, step, dev, progress)


def candidate_modules(prof: schema.Profile, granularity: int = 0) -> list[str]:
    """FQNs of the graph's candidates at ``granularity`` (0: the repeated blocks and the modules
    around them; 1: their children), the modules a memory-safe profile checkpoints."""
    from planner.model.graph import candidate_levels, unit_children

    units = {u.id: u for u in prof.units}
    level = candidate_levels(units, unit_children(prof.units), granularity)[-1]
    return list(dict.fromkeys(units[uid].fqn for uid in level if uid not in (schema.ROOT_ID, schema.LOSS_ID)))


# ----------------------------------------------------------------------------- helpers


def _fake_profile(model: torch.nn.Module, inputs: Inputs, dev: torch.device, step: StepSpec) -> schema.Profile:
    """The unplanned step on fake tensors with ``dev``'s rules: its bytes and its module calls.

    The roofline's times (for whichever spec) are not used."""
    from planner.profiling.devices import load_devices
    from planner.profiling.meta import profile_meta

    spec = this_gpu(dev, load_devices()[0])
    return profile_meta(model, inputs, step=_fake_step(step, spec), device_type=dev.type,
                        fake_device="cpu" if dev.type == "cpu" else None)


def _fake_step(step: StepSpec, spec: Any) -> StepSpec:
    """``step`` on fake tensors with times for device spec ``spec``: its loss, optimizer and recipe."""
    return StepSpec(device="meta", target=spec, loss_fn=step.loss_fn, optimizer=step.optimizer, recipe=step.recipe)


def _meta_fallback(model: torch.nn.Module, inputs: Inputs, dev: torch.device, why: str,
                   step: StepSpec) -> schema.Profile:
    """Neither the step nor its checkpointed versions fit: fake tensors, with this GPU's spec."""
    from planner.profiling.meta import profile_meta

    spec = this_gpu(dev)
    if spec is None:
        raise ProfileError(f"the step does not fit this device even with its candidates checkpointed ({why}); "
                           f"plan without running it: {{device}} meta {{target}} NAME (remat devices lists them)",
                           options=("device", "target"))
    prof = profile_meta(model, inputs, step=_fake_step(step, spec), device_type=dev.type)
    return prof.model_copy(update={"notes": [*prof.notes, f"memory-safe profile fell back to fake tensors: {why}"]})


def this_gpu(dev: torch.device, fallback: Any = None) -> Any:
    """The device spec of the GPU ``dev`` (``match_device`` on the name it reports), else ``fallback``,
    with this GPU's compute capability (its cuBLAS workspaces: NOTE [ cuBLAS workspaces ]); on the
    CPU ``fallback`` as it is."""
    from planner.profiling.devices import match_device

    if dev.type != "cuda":
        return fallback
    spec = match_device(torch.cuda.get_device_name(dev)) or fallback
    capability = "{}.{}".format(*torch.cuda.get_device_capability(dev))
    return None if spec is None else spec.model_copy(update={"compute_capability": capability})


@contextlib.contextmanager
def _cuda_cap(dev: torch.device, device_memory_bytes: int | None) -> Iterator[None]:
    """On CUDA, let this process allocate at most ``device_memory_bytes`` for the duration."""
    if dev.type != "cuda" or device_memory_bytes is None:
        yield
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    if device_memory_bytes > total:
        raise BadInput(f"device memory {device_memory_bytes} bytes is more than {dev} has ({total} bytes)")
    before = torch.cuda.get_per_process_memory_fraction(dev)
    torch.cuda.set_per_process_memory_fraction(device_memory_bytes / total, dev)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, dev)


def _out_of_memory(e: BaseException) -> bool:
    return is_oom(e) or (e.__cause__ is not None and is_oom(e.__cause__))


def _first_line(e: BaseException) -> str:
    cause = e.__cause__ if e.__cause__ is not None and is_oom(e.__cause__) else e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"[:200]


def _free(model: torch.nn.Module, dev: torch.device) -> None:
    """Release what the failed attempt held (its frames are gone once its exception is)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


__all__ = ["candidate_modules", "profile_checkpointed", "profile_within", "Progress", "this_gpu"]
