"""The training step remat plans for, and its peak memory as the device itself reports it.

``make_step`` builds the one training step everything measures: the profiler (with its
hooks), ``measure_step`` here (without), ``verify`` and the benchmarks (with a plan applied).
``measure_step`` knows nothing of the profiler: it runs a step function and asks the
device's allocator, so a planned model is measured exactly like a plain one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from planner.errors import OOM_HINT, BadInput, ProfileError, RematError
from planner.profiling.model_file import Inputs, call_model, check_loss, default_loss, user_frames

Mark = Callable[[str, Any], None]
"""``mark(name, value)``: called by a step at each of ``STEP_MARKS``."""


class Step(Protocol):
    def __call__(self, mark: Mark | None = None) -> None: ...


STEP_MARKS = ("step_start", "loss_start", "forward_end", "backward_start", "backward_end", "optimizer_end")
"""The points at which a step calls ``mark``, in order. ``value`` is the model output at
'loss_start', the loss at 'forward_end', None elsewhere (see ``make_step``)."""

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter], float], torch.optim.Optimizer] | None] = {
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "none": None,
}
"""Optimizer name -> factory (torch.optim defaults: foreach on CUDA, for-loop on CPU)."""

AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def make_optimizer(name: str, model: torch.nn.Module, *, lr: float = 0.0) -> torch.optim.Optimizer | None:
    """The optimizer ``name`` ('adamw', 'adam', 'sgd' with momentum 0.9, 'none') over the trainable parameters.

    ``lr`` defaults to 0: every kernel of ``step()`` runs, allocating the same state and
    temporaries, but the weights do not change, so profiling leaves the user's model as it was.
    """
    key = name.lower()
    if key not in OPTIMIZERS:
        raise BadInput(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    factory = OPTIMIZERS[key]
    if factory is None:
        return None
    return factory([p for p in model.parameters() if p.requires_grad], lr)


def make_step(
    model: torch.nn.Module,
    inputs: Inputs,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    amp: str | None = None,
) -> Step:
    """One training step: zero_grad(set_to_none) -> forward -> loss -> backward -> optimizer.step().

    The model output is dropped once the loss is computed, before backward, as torchtitan's
    train loop does (``del pred``): autograd keeps what it needs, and holding e.g. the logits
    through backward would add their size to the peak of every step.

    The returned ``step(mark=None)`` calls ``mark(name, value)`` at each point of ``STEP_MARKS``.
    Exceptions from user code become ``ProfileError`` showing the user's frames; running out
    of memory becomes ``ProfileError`` with advice.
    """
    loss_fn = loss_fn or default_loss
    device_type = _device_type(model)
    amp_dtype = _amp_dtype(amp)

    def autocast() -> contextlib.AbstractContextManager:
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=amp_dtype)

    def step(mark: Mark | None = None) -> None:
        mark = mark or _no_mark
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        mark("step_start", None)
        with user_code("the model's forward"), autocast():
            output = call_model(model, inputs)
        mark("loss_start", output)
        with user_code("loss_fn"), autocast():
            loss = check_loss(loss_fn(output))
        mark("forward_end", loss)
        del output
        mark("backward_start", None)
        with user_code("backward"):
            loss.backward()
        del loss
        mark("backward_end", None)
        if optimizer is not None:
            with user_code("optimizer.step()"):
                optimizer.step()
        mark("optimizer_end", None)

    return step


def to_device(obj: Any, dev: torch.device) -> Any:
    """``obj`` (a tensor, or tuples, lists and dicts of them) with every tensor moved to ``dev``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, dev) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, dev) for k, v in obj.items()}
    return obj


def sync(dev: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so wall-clock times are real."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev: torch.device) -> None:
    """Collect garbage and, on CUDA, hand cached blocks back, so the next measurement starts clean."""
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _no_mark(_name: str, _value: Any) -> None:
    pass


def _device_type(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _amp_dtype(amp: str | None) -> torch.dtype | None:
    if amp is None or amp.lower() in ("", "none", "off"):
        return None
    if amp.lower() not in AMP_DTYPES:
        raise BadInput(f"unknown amp {amp!r}; use bf16, fp16 or none")
    return AMP_DTYPES[amp.lower()]


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Turn an exception raised in ``what`` (user code) into a ``ProfileError`` a user can act on."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, RematError):
        raise
    except BaseException as e:
        if is_oom(e):
            raise ProfileError(f"out of memory in {what}: {OOM_HINT}") from e
        lines = str(e).strip().splitlines()
        text = "\n".join(lines[:3]) + (" ..." if len(lines) > 3 else "")
        frames = user_frames(e, limit=5)
        where = f"\n{frames}" if frames else ""
        raise ProfileError(f"{what} raised {type(e).__name__}: {text}{where}") from e


def is_oom(e: BaseException) -> bool:
    """The device ran out of memory: CUDA's ``OutOfMemoryError``, the CPU allocator's
    ``RuntimeError: DefaultCPUAllocator: can't allocate memory``, or Python's ``MemoryError``
    (an address-space cap, ``planner.profiling.capped``, also fails Python's own allocations)."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return (isinstance(e, (oom, MemoryError))
            or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)))


# ----------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Measured:
    peak_bytes: int
    """Highest memory in use during the step, static memory included."""
    step_ms: float
    """Wall time of the step (on the CPU it includes the profiler's overhead)."""
    source: str
    """'cuda-allocator' or 'cpu-profiler'."""


def measure_step(step_fn: Callable[[], Any], device: str | torch.device, *, static_bytes: int = 0) -> Measured:
    """Run ``step_fn()`` once and return its peak memory as the device reports it.

    CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak: absolute, it counts
    everything on the device (``static_bytes`` is ignored). CPU: the allocator's
    ``[memory]`` events from ``torch.profiler`` (``profile_memory=True``), sorted by time;
    peak = ``static_bytes`` + the highest running sum of their byte deltas.

    Warning:
        The CPU profiler sees only allocations made while it runs: a tensor allocated
        before the step and freed during it (last step's gradients, when the step starts
        with ``zero_grad(set_to_none=True)``) would read as still live. Free such memory
        before calling (``model.zero_grad(set_to_none=True)``) and pass what stays live
        (parameters, buffers, optimizer state, the batch) as ``static_bytes``.
    """
    device = torch.device(device)
    measurer = _MEASURERS.get(device.type)
    if measurer is None:
        raise BadInput(f"cannot measure a step on device {device}; measure_step supports {', '.join(_MEASURERS)}")
    return measurer(step_fn, device, static_bytes)


def _measure_cuda(step_fn: Callable[[], Any], device: torch.device, static_bytes: int) -> Measured:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    step_fn()
    torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    return Measured(int(torch.cuda.max_memory_allocated(device)), ms, "cuda-allocator")


def _measure_cpu(step_fn: Callable[[], Any], device: torch.device, static_bytes: int) -> Measured:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # kineto prints "profiler_start/stop" lines to fd 2
        prof.__enter__()
    try:
        start = time.perf_counter()
        step_fn()
        ms = (time.perf_counter() - start) * 1e3
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    return Measured(static_bytes + _max_running_sum(prof), ms, "cpu-profiler")


def _max_running_sum(prof: Any) -> int:
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    events.sort(key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        running += e.nbytes()
        peak = max(peak, running)
    return peak


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (C++ logging) for the duration; a no-op where it cannot."""
    try:
        fd = sys.stderr.fileno()
        saved = os.dup(fd)
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        sys.stderr.flush()
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            try:
                yield
            finally:
                os.dup2(saved, fd)
    finally:
        os.close(saved)


_MEASURERS: dict[str, Callable[[Callable[[], Any], torch.device, int], Measured]] = {
    "cuda": _measure_cuda,
    "cpu": _measure_cpu,
}
