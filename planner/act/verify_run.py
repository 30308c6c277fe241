"""One run of ``verify``: a copy of the model trained on the batch, with or without the plan, its gradients,
buffers, step times and measured peak (``planner/act/verify.py`` compares two of them).

Example::

    mine = _run(master, batch, loss_fn, plan, dev, steps, clock, planned=True)
    mine.peak.peak_bytes, mine.windows
"""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from planner.act.applier import apply_plan
from planner.act.compare import initialize_lazy, run_copy
from planner.errors import PlanMismatch
from planner.model.graph import window_peaks
from planner.model.schema import Plan
from planner.optimizers import from_file
from planner.profiling import rng
from planner.profiling.measure import Measured, free, make_optimizer, make_step, measure_step, sync, to_device
from planner.profiling.model_file import Inputs
from planner.profiling.recording import memory_step
from planner.profiling.step_changes import install
from planner.profiling.tracker import iter_tensors, storage_bytes

SEED = 1234
"""RNG seed set before the compared step of each run: both draw the same dropout masks."""


@dataclass
class _Run:
    loss: float
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    step_ms: float
    wall_ms: float
    peak: Measured
    checkpointed: list[str]
    skipped: dict[str, str]
    recomputes: int
    windows: dict[str, int | None] = field(default_factory=dict)
    """Measured peak per window (planned run of a plan with predicted windows only)."""
    spread_ms: float = 0.0
    """max - min of the timed steps."""
    bucket: int | None = None
    """The bucket the switch put in force (NOTE [ Bucketed plans ]); None without buckets."""
    offloaded: list[str] = field(default_factory=list)
    host_peak_bytes: int | None = None
    """The host store's peak during the measured step (offload plans only)."""
    first_step_s: float = 0.0
    """Wall seconds of the compared (first) step: under torch.compile, compiling it included."""
    found_bytes: int = 0
    """Bytes alive before the step that it reads, added to a CPU peak (NOTE [ Tensors from before the step ])."""


def _peaks(step: Any, dev: torch.device, static: int, handle: Any) -> tuple[Measured, int | None]:
    """The measured step's device peak and, for an offload plan, its host store's peak."""
    store = handle.host_store if handle else None
    if store is not None:
        store.reset_peak()
    peak = measure_step(step, dev, static_bytes=static)
    return peak, (store.peak_bytes if store is not None else None)


def _steps_run(plan: Plan, steps: int, *, planned: bool, compiled: bool = False, cpu: bool = False) -> int:
    """Steps ``_run`` trains: the compared one, ``steps`` timed, one for the peak, one tracked (eager only: no hook
    runs inside a compiled graph) for the windows (planned) or the tensors from before the step (unplanned, on
    the CPU; NOTE [ Tensors from before the step ])."""
    tracked = plan.predicted.windows if planned else cpu
    return 1 + steps + 1 + (1 if tracked and not compiled else 0)


def _apply(model: torch.nn.Module, plan: Plan, batch: Any) -> Any:
    """``apply_plan`` as verify applies it: the whole plan, so a mismatch advises re-planning (verify has no
    ``strict=False``, which apply_plan's message offers)."""
    try:
        return apply_plan(model, plan, inputs=batch)
    except PlanMismatch as e:
        raise PlanMismatch.listing("the plan was made for another model or input shapes", e.differences,
                                   "re-plan for this model (remat plan MODEL.py ...)") from None


def _run(master: torch.nn.Module, inputs: Inputs, loss_fn: Any, plan: Plan, dev: torch.device,
         steps: int, clock: Any, *, planned: bool, applied: Plan | None = None, compile: str | None = None,
         found_bytes: int | None = None) -> _Run:
    """Train a copy of ``master`` on ``inputs``; ``plan`` is what is predicted for them, ``applied`` (default
    ``plan``) what is applied: a bucketed plan whose bucket for these inputs is ``plan``. With ``compile``
    the step trains ``torch.compile(model, backend=compile)``, compiled afresh."""
    model = run_copy(master).to(dev).train()  # NOTE [ Derived tensor attributes ]
    batch = to_device(inputs, dev)
    initialize_lazy(model, batch, dev)  # NOTE [ Lazy modules ]
    handle = _apply(model, applied or plan, batch) if planned else None
    # the step the plan runs; and, both runs, the step it was planned for (NOTE [ Step changes ], Rule 2)
    changes = install(model, plan.step_changes, say=False, scopes=("measure",) if planned else ("train", "measure"))
    opt = make_optimizer(from_file(plan.optimizer or "adamw", "plan"), model, impl=plan.recipe.optimizer_impl)
    step = make_step(_compiled(model, compile), batch, loss_fn=loss_fn, optimizer=opt, recipe=plan.recipe, finite_loss=False)
    losses: list[float] = []

    def mark(name: str, value: Any) -> None:
        if name == "forward_end":
            losses.append(float(value.detach()))

    rng.seed_all(SEED)
    first_s = _seconds(lambda: step(mark))
    grads = {n: None if p.grad is None else p.grad.detach().to("cpu", copy=True)
             for n, p in model.named_parameters()}
    buffers = {n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()}
    recomputes = handle.recompute_count if handle else 0

    times, walls = [], []
    for i in range(steps):
        rng.seed_all(SEED + 1 + i)
        sync(dev)
        wall, start = time.perf_counter(), clock.stamp()
        step()
        end = clock.stamp()
        sync(dev)
        walls.append((time.perf_counter() - wall) * 1e3)
        times.append(clock.ms(start, end))

    if plan.recipe.zero_grad_set_to_none:
        model.zero_grad(set_to_none=True)  # see measure_step's warning
    gc.collect()  # a recipe with zero_grad(set_to_none=False) starts its steps with the gradients alive
    kept = (p.grad for p in model.parameters() if p.grad is not None)
    static = storage_bytes(itertools.chain(model.parameters(), model.buffers(), kept,
                                           iter_tensors(*opt.state.values()) if opt else (), iter_tensors(batch)))
    rng.seed_all(SEED)
    peak, host_peak = _peaks(step, dev, static, handle)
    windows, found = _tracked(model, step, batch, opt, dev, plan, planned=planned, compiled=compile is not None,
                              cpu=peak.source == "cpu-profiler", found_bytes=found_bytes)
    peak = replace(peak, peak_bytes=peak.peak_bytes + found)  # NOTE [ Tensors from before the step ]
    mine = {*plan.checkpoints, *(r.fqn for r in plan.selective)}  # a bucketed plan's other buckets: not in force
    run = _Run(losses[0], grads, buffers, statistics.median(times), statistics.median(walls), peak,
               [n for n in [*handle.checkpointed, *handle.selective] if n in mine] if handle else [],
               dict(handle.skipped) if handle else {},
               recomputes, windows, max(times) - min(times), handle.bucket if handle else None,
               list(handle.offloaded) if handle else [], host_peak, first_s, found)
    if handle:
        handle.remove()
    changes.remove()
    del model, opt, step, batch
    free(dev)
    return run


# NOTE [ Tensors from before the step ]
#
# Rule 1. On the CPU the measured peak is the static bytes (parameters, buffers, gradients kept, optimizer
# state, the batch) plus the highest running sum of the step's allocations (planner.profiling.measure). A
# tensor made before the step and read by it, held neither by the model's parameters and buffers nor by the
# batch, was in no term: a process-wide cache (Hugging Face BEiT and Data2VecVision with relative position
# bias keep each window size's relative position index, 65 x 65 int64 = 33,800 bytes, in an ``lru_cache``),
# a global, a plain attribute. The profile's live-bytes tracker finds such tensors among the ops' inputs and
# counts them with the buffers (``found_bytes``), so the unplanned step was predicted 33,800 bytes above
# its measurement, and the lowest plans +2.3% (Data2VecVision) and +2.7% (BEiT), past the tolerance.
# Rule 2. So on the CPU the run without the plan takes one more step under the same tracker and adds the bytes
# it finds to its measured peak, and the run with the plan adds the same bytes: the peak counts what the profile
# counts. Found in the planned run, they would count the states of the generators a region holds (NOTE
# [ Generators a model holds ]), which the applier makes in the step outside the dispatcher and the CPU
# profiler counts already (15,168 bytes twice on three such blocks). On CUDA the allocator's own peak holds
# every device tensor; a compiled step runs no hooks, and is left as it was.


def _tracked(model: torch.nn.Module, step: Any, batch: Any, opt: Any, dev: torch.device, plan: Plan, *,
             planned: bool, compiled: bool, cpu: bool, found_bytes: int | None) -> tuple[dict[str, int | None], int]:
    """The measured windows (a planned run of a plan with predicted windows) and the bytes to add to a CPU peak:
    ``found_bytes`` when given (the unplanned run's), else found alive before a step under the live-bytes
    tracker (NOTE [ Tensors from before the step ]); that step runs when one of the two needs it."""
    windows, given = planned and bool(plan.predicted.windows), found_bytes if cpu and found_bytes else 0
    if compiled or not (windows or (cpu and found_bytes is None)):  # no hook runs inside a compiled graph
        return {}, given
    rng.seed_all(SEED)
    record = memory_step(model, step, batch, opt, dev, recipe=plan.recipe)
    leaves = [k[len("forward of "):] for k in plan.predicted.windows if k.startswith("forward of ")]
    found = record.found_bytes if cpu and found_bytes is None else given
    return (window_peaks(record.recorder.timeline(), leaves) if windows else {}), found


def _seconds(run: Callable[[], Any]) -> float:
    """Wall seconds of ``run()``."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _compiled(model: torch.nn.Module, compile: str | None) -> torch.nn.Module:
    """``model``, or ``torch.compile(model, backend=compile)`` compiled afresh."""
    if compile is None:
        return model
    torch._dynamo.reset()
    return torch.compile(model, backend=compile)


__all__ = ["SEED", "_Run", "_run", "_steps_run"]
