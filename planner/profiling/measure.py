"""The training step remat plans for, and its peak memory as the device itself reports it.

``make_step`` builds the one training step everything measures: the profiler (with its
hooks), ``measure_step`` here (without), ``verify`` and the benchmarks (with a plan applied).
``measure_step`` knows nothing of the profiler: it runs a step function and asks the
device's allocator, so a planned model is measured exactly like a plain one.

Example::

    step = make_step(model, inputs, loss_fn=loss_fn, optimizer=make_optimizer("adamw", model), recipe=Recipe())
    measured = measure_step(step, torch.device("cpu"), static_bytes=0)
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from planner.crashes import recursion_room, recursion_said
from planner.errors import OOM_HINT, BadInput, ProfileError, RematError
from planner.optimizers import build_optimizer, check_impl
from planner.options import parse_amp, parse_optimizer
from planner.profiling.model_file import (Inputs, call_model, called_exit, check_grads_reached, check_loss, compute_loss,
                                          loss_arity, user_frames)
from planner.model.schema import Recipe

Mark = Callable[[str, Any], None]
"""``mark(name, value)``: called by a step at each of ``STEP_MARKS``."""


class Step(Protocol):
    def __call__(self, mark: Mark | None = None) -> None: ...


STEP_MARKS = ("step_start", "loss_start", "forward_end", "backward_start", "backward_end", "optimizer_end")
"""The points at which a step calls ``mark``, in order. ``value`` is the model output at
'loss_start', the loss at 'forward_end', the output the step still holds at 'backward_end' and
'optimizer_end' (None unless ``Recipe.keep_output``), None elsewhere (see ``make_step``)."""

AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def make_optimizer(name: str, model: torch.nn.Module, *, lr: float = 0.0,
                   impl: str = "default") -> torch.optim.Optimizer | None:
    """The optimizer spec ``name`` names ('adamw', 'sgd:momentum=0', 'adafactor', a dotted path;
    NOTE [ Optimizer specs ] in planner/optimizers.py) over the trainable parameters.

    ``lr`` defaults to 0: every kernel of ``step()`` runs, allocating the same state and
    temporaries, but the weights do not change, so profiling leaves the user's model as it was.
    ``impl`` is ``Recipe.optimizer_impl``: 'default' (torch's choice for the device), 'foreach'
    or 'fused'.
    """
    check_impl(parse_optimizer(name), impl)
    return build_optimizer(name, [p for p in model.parameters() if p.requires_grad], lr=lr, impl=impl)


SCALER_INIT_SCALE = 1.0
"""The fp16 step's GradScaler starts at scale 1 (torch's default is 2**16). Memory is the same at any
scale; from 2**16 the first steps overflow and are skipped while the scale settles, so the warm-up
step would not create the optimizer's state and the compared gradients would be inf."""


# NOTE [ The output kept through backward ]
#
# Hugging Face's documented loop, ``outputs = model(**batch); loss = outputs.loss; loss.backward()``,
# holds the model's output (the logits, which a cross-entropy over them does not save) until backward
# returns; remat's step drops it once the loss is made, so a plan of that step fell short of the loop's
# peak by the output's size (the docs' GPT-2 at 12 MB: 10,788,056 bytes measured, 10,273,976 predicted).
# Rule 1. ``Recipe(keep_output=True)`` (``remat plan --keep-output``) is that loop: the step holds the
#   output through backward and the optimizer step (the loop's ``outputs`` is bound until the next
#   forward returns), in the profile, the meta profile and ``verify`` alike.
# Rule 2. The output, held by no save, is alive through every backward window of the measured step,
#   so each window's calibrated temporaries carry it (NOTE [ Peak-memory model ], Rule 6), planned or
#   not; the releases the profiler watches stop when backward starts (NOTE [ Outputs the caller
#   drops ], Rule 1). The optimizer step's temporaries are measured above the end of backward, where
#   it is alive: the step hands it to the ``backward_end`` mark, and its bytes there count among
#   them. Held through the optimizer step only, a tiny Llama's plan (the step's peak there) was
#   41,711,720 bytes against 42,760,288 measured (+2.51%, the 1 MiB of logits).
# Rule 3 (left). A loop at module level also holds the last step's output through the next forward,
#   until that forward returns: not modelled (the forward's probes do not count it).
# Rule 4. Only the loop knows whether it holds the output: a Lightning ``training_step`` returning
#   ``{"loss": out.loss, "logits": out.logits}`` (for metrics) keeps the logits through backward,
#   detached, as a Trainer subclass keeping its outputs would (the GPT-2 at 12 MB: 10,788,060
#   bytes against 10,273,976 predicted, +5.0%). The callbacks do not compare ``keep_output``
#   (``refuse_other_recipe`` takes the plan's), where they refused a plan made for it; the step
#   guard reads the output at run time and reports a loop holding it only under a plan whose step
#   drops it (NOTE [ The step as the loop runs it ], Rule 3). A plan that keeps it, run by a loop
#   that drops it, predicts the output's bytes above that loop's peak: within the budget, not reported.
def make_step(model: torch.nn.Module, inputs: Inputs, *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
              optimizer: torch.optim.Optimizer | None = None, amp: str | None = None,
              recipe: Recipe | None = None, finite_loss: bool = True) -> Step:
    """One training step of ``recipe`` (default: ``Recipe(amp=amp)``, a plain loop).

    ``zero_grad(set_to_none=recipe.zero_grad_set_to_none)``, then ``recipe.grad_accum``
    micro-batches on ``inputs``, each as a new batch (NOTE [ Inputs that take a gradient ]; forward and loss
    under autocast when ``recipe.amp``; backward of ``loss / grad_accum``, scaled by a GradScaler under fp16), then, once, unscaling,
    ``clip_grad_norm_`` when ``recipe.clip_grad_norm`` and ``optimizer.step()``.

    The model output is dropped once the loss is computed, as torchtitan's loop does (``del pred``):
    autograd keeps what it needs. ``recipe.keep_output`` holds the last micro-batch's through backward
    and the optimizer step, as Hugging Face's loop does (NOTE [ The output kept through backward ]).

    The returned ``step(mark=None)`` calls ``mark(name, value)`` at each point of ``STEP_MARKS`` in the
    *last* micro-batch: the worst one, with the others' gradients alive (NOTE [ Peak-memory model ]). User
    code raising, running out of memory, or a NaN loss (NOTE [ A loss that is not finite ]): ``ProfileError``.
    """
    arity = loss_arity(loss_fn)  # a loss_fn that cannot be called fails here, before any step
    recipe = resolve_recipe(recipe, amp)
    device_type = _device_type(model)
    amp_dtype = _amp_dtype(recipe.amp)
    scaler = torch.amp.GradScaler(device_type, init_scale=SCALER_INIT_SCALE) if recipe.amp == "fp16" else None
    params = [p for p in model.parameters() if p.requires_grad]
    fresh = grad_leaves(inputs)
    n = recipe.grad_accum
    unchecked = [finite_loss and not _fake()]  # NOTE [ A loss that is not finite ]: the first step's losses are read, once

    def autocast() -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if amp_dtype is None else torch.autocast(device_type, dtype=amp_dtype)

    def micro_batch(mark: Mark, last: bool) -> Any:
        for t in fresh:
            t.grad = None
        mark("step_start", None)
        with user_code("the model's forward"), autocast():
            output = call_model(model, inputs)
        mark("loss_start", output)
        with user_code("loss_fn"), autocast():
            loss = check_loss(compute_loss(loss_fn, output, inputs, arity=arity), finite=unchecked[0], amp=recipe.amp,
                              params=params)
        mark("forward_end", loss)
        output = output if recipe.keep_output else None  # dropped, or held: NOTE [ The output kept through backward ]
        mark("backward_start", None)
        with user_code("backward"):
            scaled = loss / n if n > 1 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        del loss, scaled
        mark("backward_end", output)
        return output if last else None

    def step(mark: Mark | None = None) -> None:
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=recipe.zero_grad_set_to_none)
        else:
            model.zero_grad(set_to_none=recipe.zero_grad_set_to_none)
        for k in range(n):
            kept = micro_batch((mark or _no_mark) if k == n - 1 else _no_mark, k == n - 1)
        unchecked[0] = unchecked[0] and check_grads_reached(params)  # NOTE [ A loss that is not finite ], Rule 5
        with user_code("optimizer.step()"):
            if scaler is not None and optimizer is not None:
                scaler.unscale_(optimizer)
            if recipe.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, recipe.clip_grad_norm)
            if scaler is not None and optimizer is not None and not _fake():
                scaler.step(optimizer)
            elif optimizer is not None:  # fake tensors: GradScaler.step reads found_inf's value; same kernels
                optimizer.step()
            if scaler is not None and optimizer is not None:
                scaler.update()
        (mark or _no_mark)("optimizer_end", kept)  # the output kept goes at the return

    return step


# NOTE [ Inputs that take a gradient ]
# A batch tensor made with ``requires_grad=True`` (input attributions, adversarial steps) is a
# leaf: its backward writes ``.grad`` on it, and the next step of a training loop gets a new
# batch without one. The profiler and ``verify`` run every step on one batch, so from the second
# step on that tensor's ``.grad`` of the step before was held from the step's start: the
# profile counted it, verify's measured steps did not, +32,768 B (the batch's size, +1.55%) on a
# small MLP. Each micro-batch therefore starts with those leaves' ``.grad`` cleared, as a new
# batch's is, and ``kept_input_grads`` gives the user's tensors back the ``.grad`` they came with.


def grad_leaves(inputs: Any) -> list[torch.Tensor]:
    """The tensors of ``inputs`` (tuples, lists and dicts of them, as the fingerprint walks them) that are
    leaves taking a gradient."""
    from planner.model.fingerprint import input_tensors

    return [t for _, t in input_tensors(inputs) if t.requires_grad and t.is_leaf]


@contextlib.contextmanager
def kept_input_grads(inputs: Any) -> Iterator[None]:
    """Give each input leaf that takes a gradient back the ``.grad`` it had (NOTE [ Inputs that take a gradient ])."""
    kept = [(t, t.grad) for t in grad_leaves(inputs)]
    try:
        yield
    finally:
        for t, grad in kept:
            t.grad = grad


def resolve_recipe(recipe: Recipe | None, amp: str | None) -> Recipe:
    """``recipe``, or the plain loop with ``amp``; both given must agree."""
    name = parse_amp(amp)
    if recipe is None:
        return Recipe(amp=name)
    if name is not None and name != recipe.amp:
        raise BadInput(f"amp {amp!r} differs from the recipe's amp {recipe.amp!r}; give one of them")
    return recipe


def _fake() -> bool:
    """Running on fake tensors (``--device meta``, planner/profiling/meta.py)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


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
    name = parse_amp(amp)
    return None if name is None else AMP_DTYPES[name]


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Turn an exception raised in ``what`` (user code) into a ``ProfileError`` a user can act on; with room for
    remat's frames below it (NOTE [ Models nested deep ] in ``planner/crashes.py``)."""
    try:
        with recursion_room():
            yield
    except (KeyboardInterrupt, RematError):
        raise
    except SystemExit as e:
        raise ProfileError(f"{what} {called_exit(e)}; return a value or raise an exception instead") from None
    except BaseException as e:
        if is_oom(e):
            raise ProfileError(f"out of memory in {what}: {OOM_HINT}") from e
        lines = str(e).strip().splitlines()
        text = "\n".join(lines[:3]) + (" ..." if len(lines) > 3 else "")
        frames = user_frames(e, limit=5)
        where = f"\n{frames}" if frames else ""
        raise ProfileError(f"{what} raised {type(e).__name__}: {text}{_dtype_hint(e)}{recursion_said(e)}{where}") from e


_DTYPE_ERRORS = re.compile(r"must have the same dtype|type \(.*\) should be the same|to have one of the following "
                           r"scalar types|expected scalar type|expected .*dtype", re.IGNORECASE)


def _dtype_hint(e: BaseException) -> str:
    """The fix of a dtype mismatch between a model and its inputs, torch's message naming neither."""
    if not (isinstance(e, RuntimeError) and _DTYPE_ERRORS.search(str(e))):
        return ""
    return ("\n(the model and its inputs differ in dtype: example_inputs() must give what the model takes, e.g. "
            "floats of its parameters' dtype, integer token ids (torch.long); for mixed precision keep the model "
            "in float32 and pass --amp bf16)")


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


def measure_step(step_fn: Callable[[], Any], device: str | torch.device, *, static_bytes: int = 0,
                 repeats: int = 1) -> Measured:
    """Run ``step_fn()`` ``repeats`` times and return the lowest peak memory the device reports for one run
    (NOTE [ Late frees on gloo's threads ]: timing can only add to a step's peak, never take from it).

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
    if device.type == "cpu" and _CPU_COUNTING:
        measurer = _measure_cpu_total
    if measurer is None:
        raise BadInput(f"cannot measure a step on device {device}; measure_step supports {', '.join(_MEASURERS)}")
    runs = [measurer(step_fn, device, static_bytes) for _ in range(max(1, repeats))]
    return min(runs, key=lambda m: m.peak_bytes)


def _measure_cuda(step_fn: Callable[[], Any], device: torch.device, static_bytes: int) -> Measured:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    step_fn()
    torch.cuda.synchronize(device)
    ms = (time.perf_counter() - start) * 1e3
    return Measured(int(torch.cuda.max_memory_allocated(device)), ms, "cuda-allocator")


def _measure_cpu(step_fn: Callable[[], Any], device: torch.device, static_bytes: int) -> Measured:
    prof, ms = _profiled(step_fn)
    return Measured(static_bytes + _max_running_sum(prof), ms, "cpu-profiler")


def _profiled(step_fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``step_fn()`` under the CPU profiler with memory events: (the profiler, wall ms)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_stderr():  # kineto prints "profiler_start/stop" lines to fd 2
        prof.__enter__()
    try:
        start = time.perf_counter()
        step_fn()
        ms = (time.perf_counter() - start) * 1e3
    finally:
        with quiet_stderr():
            prof.__exit__(None, None, None)
    return prof, ms


def _max_running_sum(prof: Any) -> int:
    running = peak = 0
    for _, nbytes in cpu_allocations(prof):
        running += nbytes
        peak = max(peak, running)
    return peak


# NOTE [ Blocks from before the run ]
#
# The CPU allocator's reporter remembers the size of every block allocated while a profiler
# records memory, and reports its free whenever a later recording session sees it. A tensor a
# module keeps across steps (``self.last_hidden = h``), allocated in an earlier profiled step
# and replaced in this one, thus shows up as the free of a block this run never allocated;
# the measurement's base (``static_bytes``: parameters, optimizer state, batch) does not hold
# it, so counting that free reads the step one such tensor per module lower than it is (three
# hidden activations, 19%, on tests/test_validate.py's model). Frees are therefore paired with
# the allocations of this run by address: a free of a block allocated before the run is left
# out, as the reporter already leaves out blocks allocated while no profiler recorded.


def cpu_allocations(prof: Any) -> list[tuple[int, int]]:
    """(time ns, bytes) of every CPU allocation (positive) and free (negative) recorded by ``prof`` (a finished
    ``torch.profiler.profile`` with ``profile_memory=True``), in time order, without the frees of blocks
    allocated before it started (NOTE [ Blocks from before the run ])."""
    from torch._C._profiler import _EventType

    nodes, stack = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # pre-order, so the stable sort below keeps the recorded order of events at one instant
        node = stack.pop()
        stack.extend(reversed(node.children))
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            nodes.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    nodes.sort(key=lambda n: n[0])
    alive: set[int] = set()
    out = []
    for t, ptr, nbytes in nodes:
        if nbytes > 0:
            alive.add(ptr)
        elif ptr in alive:
            alive.discard(ptr)
        else:
            continue
        out.append((t, nbytes))
    return out


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
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


# ----------------------------------------------------------------------------- CPU peaks across threads

# NOTE [ CPU peaks across threads ]
#
# ``_measure_cpu`` sums the allocator events the profiler records, and the profiler records
# them only on threads it profiles. Under torch.distributed on the CPU, gloo's worker threads
# hold the last reference to a collective's tensors often enough (an all-gather output that
# FSDP2 has already dropped), so their frees go unrecorded and the running sum drifts up by
# a block's parameters a step (measured: 793,088 bytes a step on a 4-block transformer).
# PyTorch's CPU memory reporter can instead count every allocation and free in every thread:
# with its flag ``caffe2_report_cpu_memory_usage`` on, each event the profiler does record
# carries the process-wide total ("Total Allocated"). ``count_cpu_allocations`` turns the flag
# on; it must be on before the tensors to be counted are allocated (set it first thing in a
# process). ``measure_step`` then reports the highest total seen during the step: absolute,
# static memory included, like CUDA's ``max_memory_allocated``.

# NOTE [ Late frees on gloo's threads ]
#
# That total also counts what a finished collective still holds: gloo runs each collective on a
# worker thread, and its work object (with the tensors and staging buffers it copied into) dies
# on that thread a moment after the rank's wait returns. When the worker waits for a core (more
# rank threads than cores, as on a 2-core CI machine running 4 ranks), the rank's step goes on
# allocating first, and its measured peak gains those buffers: a tp 2 x pp 2 rank measured
# 11.93 MiB once in CI and 12,115,040 bytes (11.55 MiB) in five runs here, the same plan; the
# difference is about three sequence-sharded activations of 131,072 bytes. Such timing only adds
# to a peak, so a rank's check measures ``DISTRIBUTED_PEAK_REPEATS`` identical steps and keeps the
# lowest (``measure_rank_step``); on CUDA, NCCL stages in its own buffers and one step suffices.

DISTRIBUTED_PEAK_REPEATS = 3
"""Measured steps a distributed rank's check takes the lowest peak of (NOTE [ Late frees on gloo's threads ])."""


def measure_rank_step(step_fn: Callable[[], Any], device: torch.device) -> Measured:
    """``measure_step`` for one rank of a distributed check: on the CPU (gloo) the lowest peak of
    ``DISTRIBUTED_PEAK_REPEATS`` steps, on CUDA one step (NOTE [ Late frees on gloo's threads ])."""
    return measure_step(step_fn, device, repeats=DISTRIBUTED_PEAK_REPEATS if device.type == "cpu" else 1)

_CPU_COUNTING = False


def count_cpu_allocations() -> bool:
    """Count CPU allocations process-wide from now on (see NOTE [ CPU peaks across threads ]).

    Returns True when the flag could be set (it is a symbol of ``libc10``), False otherwise;
    ``measure_step`` then falls back to the per-thread event sum.
    """
    global _CPU_COUNTING
    import ctypes

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    try:
        ctypes.c_bool.in_dll(ctypes.CDLL(lib), "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError):
        return False
    _CPU_COUNTING = True
    return True


def _measure_cpu_total(step_fn: Callable[[], Any], device: torch.device, static_bytes: int) -> Measured:
    import json
    import tempfile

    prof, ms = _profiled(step_fn)
    with tempfile.TemporaryDirectory(prefix="remat_trace_") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0]
    return Measured(int(max(totals, default=static_bytes)), ms, "cpu-allocator-total")


HOST_LINK_PROBE_BYTES = 32 << 20
"""Bytes copied to time the host link (``measure_host_link``): large enough that a copy's fixed
cost is noise, small enough to take milliseconds."""


def measure_host_link(dev: torch.device, *, repeats: int = 5) -> tuple[float, bool]:
    """(bytes/s one way, copy engine) between ``dev`` and host memory, as offloading copies them
    (NOTE [ Offloaded units ] in planner/act/offload.py): on the CPU a memcpy into a numpy buffer on
    this thread, on CUDA an asynchronous copy into pinned memory. The best of ``repeats`` copies. Host buffers are made
    on the host by name, whatever torch's default device (Rule 5 of NOTE [ Offloaded units ])."""
    import numpy as np

    if dev.type == "cuda":
        src = torch.empty(HOST_LINK_PROBE_BYTES, dtype=torch.uint8, device=dev)
        dst = torch.empty(HOST_LINK_PROBE_BYTES, dtype=torch.uint8, device="cpu", pin_memory=True)
    else:
        src = torch.ones(HOST_LINK_PROBE_BYTES, dtype=torch.uint8, device="cpu")
        dst = torch.from_numpy(np.empty(HOST_LINK_PROBE_BYTES, dtype=np.uint8))
    best = float("inf")
    for _ in range(repeats):
        sync(dev)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=dev.type == "cuda")
        sync(dev)
        best = min(best, time.perf_counter() - start)
    return HOST_LINK_PROBE_BYTES / max(best, 1e-9), dev.type == "cuda"


__all__ = ["AMP_DTYPES", "count_cpu_allocations", "cpu_allocations", "DISTRIBUTED_PEAK_REPEATS", "free",
           "HOST_LINK_PROBE_BYTES", "is_oom", "make_optimizer", "make_step", "Mark", "measure_host_link",
           "measure_rank_step", "measure_step", "Measured", "quiet_stderr", "resolve_recipe",
           "SCALER_INIT_SCALE", "Step", "STEP_MARKS", "sync", "to_device", "user_code"]
