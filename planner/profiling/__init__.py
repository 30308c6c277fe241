"""Profiling: run one training step and record what each module call costs (``schema.Profile``).

``profile`` chooses how (``planner.spec.profiling_path``): on a real device (``profiler.py``,
measured; ``memsafe.py`` when the step may not fit; ``capped.py`` for a CPU with a memory cap), or
on fake tensors with times modelled for a target device (``meta.py``). All record the step with
``units.py`` (module calls) and ``recording.py`` (the memory step), ``as_run.py`` replays it as the
user runs it and ``assemble.py`` builds the Profile; ``tracker.py`` counts live bytes, ``measure.py`` builds and measures the step,
``model_file.py`` loads a user's model.py and ``devices.py`` holds the accelerator specs.
Importing this package does not import torch (``devices`` is torch-free).

Example::

    prof = profile(model, batch, step=StepSpec(device="cpu", steps=1))
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from planner.errors import BadInput

if TYPE_CHECKING:
    import torch

    from planner.model import schema
    from planner.profiling.model_file import Inputs, ModelFile
    from planner.spec import StepSpec

Progress = Callable[[str], None]


def profile(
    model: torch.nn.Module | ModelFile,
    inputs: Inputs | None = None,
    *,
    step: StepSpec | None = None,
    progress: Progress | None = None,
    **step_fields: Any,
) -> schema.Profile:
    """Profile one training step of ``model`` on ``inputs``, measured the way ``step`` allows.

    The step is ``step.recipe``'s (``planner.profiling.measure.make_step``): by default
    ``zero_grad(set_to_none=True)`` -> forward -> ``loss_fn`` -> ``backward()`` ->
    ``optimizer.step()``; with gradient accumulation the units and the memory timeline are
    those of the last micro-batch, the one with the others' gradients alive. See
    ``planner.profiling.profiler`` for what runs and NOTE [ Units ] for what a unit is.

    How it is measured (``planner.spec.profiling_path``): on fake tensors for device 'meta'
    (``planner.profiling.meta``); on the CPU with ``step.device_memory_bytes``, in a child process
    whose address space is capped (``planner.profiling.capped``; it imports a model file, so pass
    one); otherwise as it runs, a plain loop (amp aside) through the memory-safe profile, which
    measures under checkpointing a step that does not fit the cap or runs out of memory
    (NOTE [ Memory-safe profile ]).

    Args:
        model: the model, moved to the device in place and left there (profiled in train mode;
            its modules' train/eval flags are restored afterwards); or a model file
            (``planner.load_model_file``, or the path of a .py), which builds it (on the meta device for 'meta') and
            gives ``inputs`` and ``loss_fn`` unless they are given.
        inputs: a tensor (``model(x)``), a tuple (``model(*args)``) or a dict
            (``model(**kwargs)``); moved to the device.
        step: the step and where it runs (``planner.spec.StepSpec``); default a plain loop on 'auto'.
        progress: called with a short message as each stage starts.
        **step_fields: ``StepSpec`` fields replacing ``step``'s (``device="cpu"``, ``steps=1``, ...).

    Returns:
        The ``schema.Profile``, with the device's own peak in ``step.measured_peak_bytes``.

    Raises:
        BadInput: an unknown device, optimizer or target, fewer than one timing step,
            device='meta' without a target or a target with another device, a cap on the
            meta device, on a recipe other than the plain loop, or on the CPU without a model file.
        ModelLoadError: parameters on the meta device or on several devices.
        ProfileError: the model, ``loss_fn`` or the optimizer raised (the message shows
            the user's frames), the loss is not a scalar, or the device ran out of memory.

    Example::

        prof = planner.profile(model, batch, step=StepSpec(device="cpu", steps=1))
    """
    from planner.profiling.model_file import ModelFile
    from planner.spec import profiling_path, step_spec

    if isinstance(model, (str, os.PathLike)) and str(model).endswith(".py"):  # profile("model.py")
        from planner.profiling.model_file import load_model_file

        model = load_model_file(model)
    spec = step_spec(step, **step_fields)
    dev = check_step(spec)
    how = profiling_path(spec, dev.type)
    model_file = model if isinstance(model, ModelFile) else None
    if how == "capped":
        return _capped(model_file, inputs, spec, progress)
    if model_file is not None:
        model, inputs, spec = _built(model_file, inputs, spec, meta=how == "meta")
    elif not isinstance(model, _module_type()):
        raise BadInput(f"profile(model, ...) takes a torch.nn.Module or a model file (planner.load_model_file), "
                       f"got {type(model).__name__}")
    elif inputs is None:
        raise BadInput("profile(model, ...) needs inputs=<one training batch>, or a model file "
                       "(planner.load_model_file) in place of the model")
    else:
        from planner.profiling.model_file import check_trainable

        check_trainable(model, f"the {type(model).__name__} given to profile()")
    if how == "memory-safe":
        from planner.profiling.memsafe import profile_within

        return profile_within(model, inputs, step=spec, progress=progress)
    return profile_as_run(model, inputs, step=spec, progress=progress)


def _module_type() -> type:
    import torch

    return torch.nn.Module


def check_step(step: StepSpec) -> torch.device:
    """Validate ``step`` before anything runs; returns its device. Raises ``BadInput``."""
    from planner.optimizers import check_impl
    from planner.options import parse_optimizer
    from planner.profiling.profiler import resolve_device

    dev = resolve_device(step.device)
    check_impl(parse_optimizer(step.optimizer), step.recipe.optimizer_impl)
    if step.steps < 1 or step.warmup_steps < 0:
        raise BadInput(f"need steps >= 1 and warmup_steps >= 0, got steps={step.steps}, "
                       f"warmup_steps={step.warmup_steps}")
    threads = step.threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BadInput(f"threads must be an integer >= 1, got {threads!r}")
    if dev.type != "meta" and step.target is not None:
        raise BadInput(f"target={step.target!r} models times for device='meta'; on {dev} the times are measured")
    if dev.type == "meta" and step.target is None:
        from planner.profiling.devices import load_devices

        names = ", ".join(s.name for s in load_devices())
        raise BadInput(f"device 'meta' models times for a target device: give {{target}} NAME (one of: {names})",
                       options=("target",))
    _check_cap(step, dev)
    _check_compile(step, dev)
    return dev


def _check_compile(step: StepSpec, dev: torch.device) -> None:
    from planner.options import parse_compile

    if parse_compile(step.compile) is None:
        return
    if dev.type == "meta":
        raise BadInput("a compiled step cannot be profiled on device 'meta' (nothing runs there); drop "
                       "{compile} or profile on a real device", options=("compile", "device"))
    if step.device_memory_bytes is not None:
        raise BadInput("{device_memory_bytes} profiles a step under checkpointing when it does not fit; the "
                       "compiled step ({compile}) is profiled as it is: drop one",
                       options=("device_memory_bytes", "compile"))
    if step.recipe.grad_accum > 1:
        raise BadInput("profiling the compiled step supports grad_accum 1 only; drop {grad_accum} or {compile}",
                       options=("grad_accum", "compile"))


def _check_cap(step: StepSpec, dev: torch.device) -> None:
    from planner.spec import is_plain

    cap = step.device_memory_bytes
    if cap is None:
        return
    if isinstance(cap, bool) or not isinstance(cap, int) or cap <= 0:
        raise BadInput(f"{{device_memory_bytes}} must be a positive number of bytes, got {cap!r}",
                       options=("device_memory_bytes",))
    if dev.type == "meta":
        raise BadInput("{device_memory_bytes} caps a device that runs the step; {device} meta runs nothing (drop one)",
                       options=("device_memory_bytes", "device"))
    if not is_plain(step.recipe):
        raise BadInput("{device_memory_bytes} measures the plain training step (with amp) for now; drop it, or "
                       "make the recipe the plain loop (no accumulation, clipping, fused or foreach optimizer, "
                       "zero_grad(set_to_none=True))", options=("device_memory_bytes",))


def _built(model_file: ModelFile, inputs: Inputs | None, step: StepSpec,
           meta: bool) -> tuple[torch.nn.Module, Inputs, StepSpec]:
    """The model, the inputs and the step of a model file (its loss unless ``step`` has one)."""
    from planner.profiling.meta import build_on_meta

    net = build_on_meta(model_file.build_model) if meta else model_file.build_model()
    inputs = model_file.example_inputs() if inputs is None else inputs
    return net, inputs, step if step.loss_fn is not None else step.replace(loss_fn=model_file.loss_fn)


def _capped(model_file: ModelFile | None, inputs: Inputs | None, step: StepSpec,
            progress: Progress | None) -> schema.Profile:
    from planner.profiling.capped import profile_capped

    if model_file is None or inputs is not None or step.loss_fn is not None:
        raise BadInput("{device_memory_bytes} on the CPU profiles a model file in a child process: pass "
                       "planner.load_model_file(path) as the model, with neither inputs nor a loss_fn "
                       "(the file gives them)", options=("device_memory_bytes",))
    if model_file.path.suffix != ".py":  # the child process imports a model file
        raise BadInput("{device_memory_bytes} on the CPU profiles a model file in a child process; with a Hugging "
                       "Face config, write a model.py that builds the model (or drop the cap)",
                       options=("device_memory_bytes",))
    return profile_capped(model_file.path, step=step, quiet=progress is None)


def profile_as_run(model: torch.nn.Module, inputs: Inputs, *, step: StepSpec,
                   progress: Progress | None = None) -> schema.Profile:
    """Profile the step as it runs (``profile``'s plain and meta paths; ``step`` checked by ``check_step``)."""
    from planner.model.fingerprint import module_fqns
    from planner.profiling.measure import kept_input_grads
    from planner.profiling.profiler import profile_real, resolve_device
    from planner.profiling.step_changes import profiled_with_step_changes

    dev = resolve_device(step.device)
    built = module_fqns(model)  # NOTE [ Modules made by the first step ]
    # see NOTE [ Step changes ]: profile the step the plan will run
    with profiled_with_step_changes(model) as changes, kept_input_grads(inputs):
        if dev.type == "meta":
            from planner.profiling.meta import profile_meta

            result = profile_meta(model, inputs, step=step, progress=progress)
        else:
            result = profile_real(model, inputs, dev, step=step, progress=progress)
            result = _validated(model, inputs, result, step, dev, progress)
            result = _with_host_link(result, step, dev)
            if step.compile is not None:
                from planner.profiling.compiled import profile_compiled

                result = profile_compiled(model, inputs, result, step=step, progress=progress)
    result.step_changes = changes
    return with_built_modules(result, built)


# NOTE [ Modules made by the first step ]
#
# A model may rebuild part of itself in its first training forward: Hugging Face's BigBird, given
# sequences too short for block-sparse attention, swaps every layer's attention module for a full
# one (``set_attention_type``), with a dropout module the block-sparse one lacks. The profile sees the
# model after that step, but a training job applies the plan to the model as built, before its first
# step: against the profiled module list alone it was refused (``PlanMismatch``: modules "in the plan
# but not in the model"). So the profile's fingerprint keeps the module list as built too
# (``Fingerprint.built_modules``, only when it differs), and a model matching either list matches.
# The units the first step made are excluded from plans: the model as built has no such module to
# checkpoint (its plan would name a module that does not exist yet, and the module it would wrap is
# replaced when the step runs).

def with_built_modules(result: schema.Profile, built: list[str]) -> schema.Profile:
    """``result`` knowing the model's modules as built, and with the units its first step made excluded
    (NOTE [ Modules made by the first step ])."""
    from planner.model.schema import ExcludedUnit

    if built in (result.fingerprint.modules, result.fingerprint.built_modules):  # nothing made, or known
        return result
    made = set(result.fingerprint.modules) - set(built)
    excluded = [*result.excluded, *(ExcludedUnit(module=fqn, reason="the model's first training step made it: "
                                                        "the model as built has no such module")
                                    for fqn in dict.fromkeys(u.fqn for u in result.units if u.fqn in made))]
    return result.model_copy(update={"fingerprint": result.fingerprint.model_copy(update={"built_modules": built}),
                                     "excluded": excluded})


def _validated(model: torch.nn.Module, inputs: Inputs, result: schema.Profile, step: StepSpec, dev: torch.device,
               progress: Progress | None) -> schema.Profile:
    """``result`` with the validation step's findings and the selective dispatch cost."""
    from planner.profiling.group_scale import least_group_scales, measure_group_scales, with_group_scales
    from planner.profiling.measure import to_device
    from planner.profiling.sac_cost import measure_sac_cost, with_sac_cost
    from planner.profiling.timing import clock_of, num_threads, timing_threads
    from planner.profiling.validate import validate

    say = progress or (lambda _msg: None)
    say("validation step: what checkpointing frees")
    amp = step.recipe.amp
    found = validate(model, to_device(inputs, dev), result, loss_fn=step.loss_fn, amp=amp, dev=dev)
    result.retained, result.excluded, result.region_state_bytes, result.checkpointed_windows = found
    if not result.ops or step.compile is not None:  # op-level policies are eager only (NOTE [ Compiled profile ])
        return result
    on_dev = to_device(inputs, dev)

    def group_scales(when: str):  # NOTE [ Thread factor per cost group ], Rule 5: two windows, the dispatch between
        if result.thread_scale:
            say(f"timing each cost group's thread factor ({when} the dispatch)")
        return measure_group_scales(model, on_dev, result, loss_fn=step.loss_fn, amp=amp, threads=result.threads or 1)

    with num_threads(step.threads):
        before = group_scales("before")
        say("timing selective checkpointing's dispatch")
        clock = clock_of(result, dev)
        with timing_threads(clock):
            cost = measure_sac_cost(model, on_dev, result, loss_fn=step.loss_fn, amp=amp, dev=dev, clock=clock)
        after = group_scales("after")
    return with_group_scales(with_sac_cost(result, cost), least_group_scales(before, after))


def _with_host_link(result: schema.Profile, step: StepSpec, dev: torch.device) -> schema.Profile:
    """``result`` with the bandwidth offloaded tensors would move at (NOTE [ Peak-memory model ], Rule 10)."""
    from planner.profiling.measure import measure_host_link
    from planner.profiling.timing import num_threads

    with num_threads(step.threads):
        result.host_link_bytes_per_s, result.copy_engine = measure_host_link(dev)
    return result


__all__ = ["Progress", "check_step", "profile", "profile_as_run"]
