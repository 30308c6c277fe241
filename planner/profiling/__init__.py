"""Profiling: run one training step and record what each module call costs (``schema.Profile``).

``profile`` chooses how: on a real device (``profiler.py``, measured), or on fake tensors with
times modelled for a target device (``meta.py``). Both record the step with ``recording.py``;
``tracker.py`` counts live bytes, ``measure.py`` builds and measures the step, ``model_file.py``
loads a user's model.py and ``devices.py`` holds the accelerator specs. Importing this package
does not import torch (``devices`` is torch-free).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from planner.model import schema
    from planner.profiling.model_file import Inputs

Progress = Callable[[str], None]


def profile(
    model: torch.nn.Module,
    inputs: Inputs,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str | torch.device = "auto",
    optimizer: str = "adamw",
    warmup_steps: int = 1,
    steps: int = 3,
    amp: str | None = None,
    recipe: schema.Recipe | None = None,
    target: str | Any | None = None,
    threads: int | None = None,
    progress: Progress | None = None,
) -> schema.Profile:
    """Profile one training step of ``model`` on ``inputs``.

    The step is ``recipe``'s (``planner.profiling.measure.make_step``): by default
    ``zero_grad(set_to_none=True)`` -> forward -> ``loss_fn`` -> ``backward()`` ->
    ``optimizer.step()``; with gradient accumulation the units and the memory timeline are
    those of the last micro-batch, the one with the others' gradients alive. See
    ``planner.profiling.profiler`` for what runs and NOTE [ Units ] for what a unit is.

    Args:
        model: the model; moved to ``device`` in place and left there. It is profiled in
            train mode; its modules' train/eval flags are restored afterwards.
        inputs: a tensor (``model(x)``), a tuple (``model(*args)``) or a dict
            (``model(**kwargs)``); moved to ``device``.
        loss_fn: ``loss_fn(output) -> scalar tensor``; default ``model_file.default_loss``.
        device: 'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:1', a
            ``torch.device``, or 'meta': nothing runs, fake tensors give the bytes and a
            roofline for ``target`` the times (``planner.profiling.meta.profile_meta``; build the model
            with ``planner.profiling.meta.build_on_meta`` so that it takes no memory).
        optimizer: 'adamw', 'adam', 'sgd' (momentum 0.9) or 'none'.
        warmup_steps: plain steps before measuring (they create the optimizer state).
        steps: timing steps; times are medians over them (NOTE [ Unit costs ]).
        amp: None, 'bf16' or 'fp16': forward and loss under ``torch.autocast`` (short for
            ``recipe=Recipe(amp=...)``).
        recipe: the training step (``schema.Recipe``): gradient accumulation, zero_grad,
            amp with a GradScaler for fp16, clipping, the optimizer's implementation.
        target: with device='meta' (required there), the device spec or its name
            (``planner.profiling.devices``) the times are modelled for. Measured devices refuse it.
        threads: torch's intra-op threads while profiling (restored afterwards); None: as
            set now (``torch.get_num_threads()``). On the CPU, 1 times with the thread's CPU
            time, which load from other processes does not change (NOTE [ Unit costs ] in
            ``planner/profiling/timing.py``).
        progress: called with a short message as each stage starts.

    Returns:
        The ``schema.Profile``, with the device's own peak in ``step.measured_peak_bytes``.

    Raises:
        BadInput: an unknown device, optimizer, amp or target, fewer than one timing step,
            device='meta' without a target or a target with another device.
        ModelLoadError: parameters on the meta device or on several devices.
        ProfileError: the model, ``loss_fn`` or the optimizer raised (the message shows
            the user's frames), the loss is not a scalar, or the device ran out of memory.
    """
    from planner.errors import BadInput
    from planner.profiling.measure import resolve_recipe, to_device
    from planner.options import parse_amp, parse_optimizer
    from planner.profiling.profiler import profile_real, resolve_device
    from planner.profiling.step_changes import profiled_with_step_changes
    from planner.profiling.validate import validate
    from planner.profiling.sac_cost import measure_sac_cost, with_sac_cost
    from planner.profiling.timing import clock_of, num_threads, timing_threads
    import torch

    dev = resolve_device(device)
    parse_optimizer(optimizer)
    parse_amp(amp)
    if steps < 1 or warmup_steps < 0:
        raise BadInput(f"need steps >= 1 and warmup_steps >= 0, got steps={steps}, warmup_steps={warmup_steps}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BadInput(f"threads must be an integer >= 1, got {threads!r}")
    recipe = resolve_recipe(recipe, amp)
    if dev.type != "meta" and target is not None:
        raise BadInput(f"target={target!r} models times for device='meta'; on {dev} the times are measured")
    # see NOTE [ Step changes ]: profile the step the plan will run
    with profiled_with_step_changes(model) as changes:
        if dev.type == "meta":
            result = _profile_meta(model, inputs, target, loss_fn=loss_fn, optimizer=optimizer, recipe=recipe,
                                   progress=progress)
        else:
            result = profile_real(model, inputs, dev, loss_fn=loss_fn, optimizer=optimizer,
                                  warmup_steps=warmup_steps, steps=steps, recipe=recipe, threads=threads,
                                  progress=progress)
            (progress or (lambda _msg: None))("validation step: what checkpointing frees")
            found = validate(model, to_device(inputs, dev), result, loss_fn=loss_fn, amp=recipe.amp, dev=dev)
            result.retained, result.excluded, result.region_state_bytes = found
            if result.ops:
                (progress or (lambda _msg: None))("timing selective checkpointing's dispatch")
                with num_threads(threads):
                    clock = clock_of(result, dev)
                    with timing_threads(clock):
                        cost = measure_sac_cost(model, to_device(inputs, dev), result, loss_fn=loss_fn,
                                                amp=recipe.amp, dev=dev, clock=clock)
                result = with_sac_cost(result, cost)
    result.step_changes = changes
    return result


def _profile_meta(model: torch.nn.Module, inputs: Inputs, target: Any, **kwargs: Any) -> schema.Profile:
    from planner.errors import BadInput
    from planner.profiling.devices import load_devices
    from planner.profiling.meta import profile_meta

    if target is None:
        names = ", ".join(s.name for s in load_devices())
        raise BadInput(f"device 'meta' models times for a target device: give {{target}} NAME (one of: {names})",
                       options=("target",))
    return profile_meta(model, inputs, target=target, **kwargs)


__all__ = ["Progress", "profile"]
