"""Check a plan against reality: train with and without it, compare memory, time and gradients.

Example::

    from planner.act.verify import verify
    report = verify("examples/gpt2.py", "plan.json", steps=3, device="cpu")
    for label, predicted, measured, check in report.rows():
        print(f"{label:28} {predicted:>12} {measured:>12}  {check}")
    assert report.ok

The model is trained twice from identical copies (built once, deep-copied per run, one run on
the device at a time so neither sees the other's memory): without the plan, then with it. Each
run does the step of ``planner.profiling.measure.make_step`` with the plan's optimizer at lr=0 (its state
is allocated, the weights do not move) and amp setting:

1. one step from the identical starting state with every generator seeded (torch's, numpy's and
   Python's, NOTE [ Randomness outside torch ]), so dropout and SpecAugment draw the same masks: its loss, gradients and buffers (BatchNorm statistics) are compared,
   and it counts the recomputed forwards;
2. ``steps`` timed steps (the median is the step time), at the plan's thread count and on the
   profile's clock (``planner.profiling.timing.pick_clock``: on the CPU at one thread the thread's CPU
   time), so measured and predicted recompute are the same kind of milliseconds;
3. one step measured by ``planner.profiling.measure.measure_step`` (the device's own peak).

The report is ``ok`` when the planned peak fits ``plan.budget_bytes``, the prediction is within
``prediction_tolerance`` of the measured peak (default 2%; past it the report names the window
where prediction and measurement differ most, measured by one more step under the profiler's
recorder), and no gradient or
buffer element differs by more than ``tolerance``. Predictions come from the plan (see
NOTE [ Peak-memory model ] in ``solvers/cost_model.py``); nothing is re-derived here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, Field

from planner.act.applier import PlanAlreadyApplied, planned_modules
from planner.act.buckets import bucket_plans, describe
from planner.act.verify_run import SEED, _Run, _run, _steps_run
from planner.act.compare import max_abs_diff, nonfinite_notes
from planner.errors import BadInput
from planner.options import parse_fraction
from planner.spec import StepSpec, step_spec
from planner.profiling.model_file import Inputs, ModelFile, load_model_file
from planner.profiling.profiler import resolve_device
from planner.model.schema import Plan, Recipe
from planner.profiling import rng
from planner.profiling.timing import num_threads, pick_clock
from planner.sizes import format_bytes

if TYPE_CHECKING:
    from planner.act.verify_ranks import RanksReport

DEFAULT_PREDICTION_TOLERANCE = 0.02
"""``remat verify`` fails when the measured peak is further than this from the prediction (issue 11)."""

PREDICTION_SLACK_BYTES = 16 * 1024
"""A prediction this close in bytes passes at any tolerance: scalars (the loss, a norm) and an op's
scratch are not modelled, and on a toy model of a few hundred KB they alone are 2%."""



class VerifyReport(BaseModel):
    """Predicted (from the plan) vs measured (with and without the plan), and the verdict."""

    model: str = Field(description="Model file path, or the model's class name.")
    device: str
    peak_source: str = Field(description="'cuda-allocator' or 'cpu-profiler' (see planner.profiling.measure).")
    steps: int = Field(description="Timed steps per run.")
    steps_run: int = Field(0, description="Training steps each run really ran: one compared step, the timed "
                                          "steps, one for the peak (and, with the plan, one for the windows).")
    timing_spread_ms: float = Field(0.0, description="Largest max - min of one run's timed steps: how noisy the "
                                                     "timing was (0 with one timed step).")
    recompute_noise: bool = Field(False, description="The measured recompute overhead is below zero or within "
                                                     "timing_spread_ms: noise, not a measurement.")
    budget_bytes: int
    tolerance: float = Field(description="Largest allowed |difference| of any gradient or buffer element.")
    recipe: Recipe = Field(default_factory=Recipe, description="The training step both runs trained with: "
                                                               "the plan's recipe.")
    checkpointed: list[str]
    skipped: dict[str, str] = Field(default_factory=dict, description="Plan modules not applied, and why.")

    predicted_peak_bytes: int
    measured_peak_bytes: int
    predicted_no_plan_peak_bytes: int | None
    measured_no_plan_peak_bytes: int
    predicted_step_ms: float
    measured_step_ms: float
    measured_no_plan_step_ms: float
    predicted_recompute_ms: float
    measured_recompute_ms: float = Field(description="Planned minus unplanned median step time, on time_source.")
    measured_recompute_wall_ms: float = Field(0.0, description="The same on the wall clock (load counts).")
    time_source: str = Field("", description="Clock of the measured step times (planner.profiling.timing.TIME_SOURCES).")
    threads: int | None = Field(None, description="torch intra-op threads of the measured CPU steps.")
    planned_recomputes: int = Field(description="Checkpointed module calls per step the plan names (every "
                                                "micro-batch of its recipe).")
    measured_recomputes: int = Field(description="Forwards recomputed during the compared step.")
    loss: float
    loss_diff: float
    max_grad_diff: float
    max_buffer_diff: float
    prediction_tolerance: float = Field(0.02, description="Largest allowed |predicted - measured| / measured peak.")
    prediction_error: float = Field(0.0, description="(predicted - measured) / measured peak, with the plan.")
    prediction_ok: bool = Field(True, description="Within prediction_tolerance, or PREDICTION_SLACK_BYTES in bytes.")
    worst_window: str | None = Field(None, description="The window of NOTE [ Peak-memory model ] where prediction "
                                                       "and measurement differ most (None for plans without "
                                                       "predicted windows).")
    worst_window_predicted_bytes: int | None = None
    worst_window_measured_bytes: int | None = None
    offloaded: list[str] = Field(default_factory=list, description="Plan modules whose saved tensors went to host "
                                                                   "memory (NOTE [ Offloaded units ]).")
    predicted_offload_ms: float = Field(0.0, description="Exposed copy time the plan predicts, per step.")
    predicted_host_peak_bytes: int | None = Field(None, description="Host memory the plan predicts for its "
                                                                    "offloaded tensors (offload plans only).")
    measured_host_peak_bytes: int | None = Field(None, description="The host store's peak in the measured step.")
    problems: list[str] = Field(default_factory=list, description="Why ok is False; empty when ok.")
    notes: list[str] = Field(default_factory=list, description="Worth knowing, not failures.")
    compile: str | None = Field(None, description="torch.compile backend both runs trained with; None: eager.")
    first_step_s: float = Field(0.0, description="Wall seconds of the planned run's first step (under compile: "
                                                 "compiling it included).")
    no_plan_first_step_s: float = Field(0.0, description="The same without the plan.")
    ok: bool

    def rows(self) -> list[tuple[str, str, str, str]]:
        """``(quantity, predicted, measured, check)`` rows for a table."""
        fits = self.measured_peak_bytes <= self.budget_bytes
        over = format_bytes(self.measured_peak_bytes - self.budget_bytes)
        no_plan = self.predicted_no_plan_peak_bytes
        return [
            ("peak memory", format_bytes(self.predicted_peak_bytes), format_bytes(self.measured_peak_bytes),
             f"fits {format_bytes(self.budget_bytes)}" if fits else f"OVER budget by {over}"),
            ("prediction error", f"<= {self.prediction_tolerance:.1%}", f"{self.prediction_error:+.2%}",
             "ok" if self.prediction_ok else "FAIL"),
            *([] if self.worst_window is None else [(
                f"worst window: {self.worst_window}", format_bytes(self.worst_window_predicted_bytes or 0),
                format_bytes(self.worst_window_measured_bytes or 0), "")]),
            ("peak without the plan", format_bytes(no_plan) if no_plan is not None else "-",
             format_bytes(self.measured_no_plan_peak_bytes), ""),
            *self._host_rows(),
            ("step time", f"{self.predicted_step_ms:.1f} ms", f"{self.measured_step_ms:.1f} ms", self.time_source),
            ("recompute + copies" if self.offloaded else "recompute overhead",
             f"+{self.predicted_recompute_ms + self.predicted_offload_ms:.1f} ms",
             f"{self.measured_recompute_ms:+.1f} ms", _recompute_check(self)),
            ("recompute (wall clock)", "", f"{self.measured_recompute_wall_ms:+.1f} ms",
             f"{self.threads} thread(s)" if self.threads else ""),
            ("recomputed forwards/step", str(self.planned_recomputes),
             "-" if self.compile else str(self.measured_recomputes),
             "eager only" if self.compile else "" if self.measured_recomputes == self.planned_recomputes
             else "differs"),
            ("max |grad diff|", f"<= {self.tolerance:g}", f"{self.max_grad_diff:.3g}",
             "ok" if self.max_grad_diff <= self.tolerance else "FAIL"),
            ("max |buffer diff|", f"<= {self.tolerance:g}", f"{self.max_buffer_diff:.3g}",
             "ok" if self.max_buffer_diff <= self.tolerance else "FAIL"),
            *([] if self.compile is None else [(
                f"first step ({self.compile}, compiling)", "", f"{self.first_step_s:.1f} s",
                f"{self.no_plan_first_step_s:.1f} s without the plan")]),
        ]

    def _host_rows(self) -> list[tuple[str, str, str, str]]:
        """The offload rows: host memory predicted and measured, and the exposed copy time."""
        if self.predicted_host_peak_bytes is None:
            return []
        measured = self.measured_host_peak_bytes or 0
        off = abs(self.predicted_host_peak_bytes - measured) / max(measured, 1)
        return [("host memory (offloaded)", format_bytes(self.predicted_host_peak_bytes), format_bytes(measured),
                 "ok" if off <= self.prediction_tolerance else f"FAIL ({off:+.2%})"),
                ("copies (exposed)", f"+{self.predicted_offload_ms:.1f} ms", "", f"{len(self.offloaded)} unit(s)")]


def verify(model_file_or_model: str | Path | ModelFile | torch.nn.Module, plan: Plan | str | Path, *,
           inputs: Inputs | None = None, step: StepSpec | None = None, tolerance: float = 1e-5,
           prediction_tolerance: float = DEFAULT_PREDICTION_TOLERANCE, progress: Callable[[str], None] | None = None,
           **step_fields: Any) -> VerifyReport | BucketsReport | RanksReport:
    """Train with and without ``plan`` and report predicted vs measured memory, time and gradients.

    A per-rank plan (made with ``world_size``/``sharding``) is verified on its ranks by
    ``planner.act.verify_ranks.verify_ranks``, which returns a ``RanksReport``.

    Args:
        model_file_or_model: a model file (``build_model()``, ``example_inputs()``, optional
            ``loss_fn``), a loaded ``ModelFile`` (``load_model_file``, ``load_hf_config``), or an ``nn.Module`` without a plan (it is deep-copied, never changed;
            then ``inputs`` is required).
        plan: a ``Plan`` or the path of a plan file.
        step: how to run (``planner.spec.StepSpec``; default device 'cpu'): ``steps``, timed steps
            per run (>= 1); ``device``, 'cpu', 'cuda', 'cuda:1', 'auto' or a ``torch.device``;
            ``threads``, torch intra-op threads for the timed steps (default the plan's, the
            profile's); ``loss_fn``, for an ``nn.Module``; ``compile``, a ``torch.compile``
            backend: both runs train ``torch.compile(model)``, the plan applied first (default:
            the plan's own, ``plan.compile``, else eager). The step itself is the plan's recipe.
        tolerance: largest allowed absolute difference of any gradient or buffer element after
            the compared step. On the CPU the difference is 0 (recomputation is bitwise); on
            CUDA nondeterministic kernels (atomic adds in embedding or scatter backward) differ
            slightly between any two runs.
        prediction_tolerance: largest allowed |predicted - measured| / measured peak with the
            plan; beyond it the report is not ok and names the window that differs most.
        inputs: for an ``nn.Module``; a model file brings its own. For a bucketed plan,
            ``inputs`` is a list of one batch per bucket, smallest first; a model file makes them
            with ``example_inputs(**bucket.shape)``.
        progress: called with a short message as each run starts.
        **step_fields: ``StepSpec`` fields replacing ``step``'s (``device="cuda"``, ``steps=1``).

    Returns:
        A ``VerifyReport``; ``.ok`` is False when the measured peak is over ``plan.budget_bytes``
        or gradients/buffers differ by more than ``tolerance``; ``.rows()`` for printing. For a
        bucketed plan a ``BucketsReport``: one ``VerifyReport`` per bucket, each batch trained with
        the whole plan applied (its switch must pick the bucket), against that bucket's prediction.

    Raises:
        PlanMismatch: the plan was made for another model or input shapes.
        PlanAlreadyApplied: the model given already carries a plan.
        BadInput, ModelLoadError, ProfileError: bad arguments, model file or training step.
    """
    spec = step_spec(step or StepSpec(device="cpu"), **step_fields)
    steps, device, threads, loss_fn = spec.steps, spec.device, spec.threads, spec.loss_fn
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    if plan.sharding != "none" or plan.pipeline is not None or plan.tensor_parallel > 1:
        return _per_rank(model_file_or_model, plan, steps=steps, device=str(device), progress=progress)
    if steps < 1:
        raise BadInput(f"verify needs steps >= 1, got {steps}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise BadInput(f"tolerance must be a finite number >= 0 (the largest gradient difference), got {tolerance!r}")
    prediction_tolerance = parse_fraction(prediction_tolerance, "prediction_tolerance", below=1)  # '2%' too
    master, batches, loss_fn, label = _load(model_file_or_model, inputs, loss_fn, plan)
    dev = resolve_device(device)
    if dev.type == "meta":
        raise BadInput("verify trains the model for real, which fake tensors cannot: use {device} cpu or cuda "
                       "(a plan made with {device} meta is verified on the device it was made for)",
                       options=("device",))
    say = progress or (lambda _msg: None)
    threads = threads or (plan.threads if dev.type == "cpu" else None)
    compile, under = _compile_of(spec, plan)
    reports = []
    for index, (one, batch) in enumerate(zip(bucket_plans(plan), batches)):
        where = f" ({describe(plan.buckets[index])})" if plan.buckets else ""
        with num_threads(threads), rng.kept(dev):  # the caller's generators as they were (NOTE [ Randomness outside torch ])
            clock = pick_clock(dev, torch.get_num_threads())
            say(f"training {_steps_run(one, steps, planned=False, compiled=bool(compile), cpu=dev.type == 'cpu')} "
                f"steps without the plan{where}{under}")
            base = _run(master, batch, loss_fn, one, dev, steps, clock, planned=False, compile=compile)
            say(f"training {_steps_run(one, steps, planned=True, compiled=bool(compile))} steps with the plan"
                f"{where}{under}")
            mine = _run(master, batch, loss_fn, one, dev, steps, clock, planned=True, applied=plan, compile=compile,
                        found_bytes=base.found_bytes)
            used = torch.get_num_threads() if dev.type == "cpu" else None
            # inside the threads' context: the noise note reads the thread count the steps ran with
            report = _report(one, master, label, dev, steps, tolerance, base, mine, prediction_tolerance,
                             compile)
        if mine.bucket != (index if plan.buckets else None):
            report.problems.append(f"the batch of bucket {index} ran bucket {mine.bucket}")
        reports.append(report.model_copy(update={"time_source": clock.source, "threads": used, "compile": compile,
                                                 "first_step_s": round(mine.first_step_s, 3),
                                                 "no_plan_first_step_s": round(base.first_step_s, 3),
                                                 "ok": not report.problems}))
    if not plan.buckets:
        return reports[0]
    return BucketsReport(buckets=[describe(b) for b in plan.buckets], reports=reports,
                         problems=[f"bucket {describe(b)}: {p}" for b, r in zip(plan.buckets, reports)
                                   for p in r.problems],
                         ok=all(r.ok for r in reports))


def _per_rank(model_file_or_model: Any, plan: Plan, *, steps: int, device: str,
              progress: Callable[[str], None] | None) -> RanksReport:
    """``verify`` of a per-rank plan: on processes of their own, from the model file."""
    if plan.buckets:
        raise BadInput("verify of a per-rank plan with buckets is not supported yet: verify the plan of each "
                       "shape alone (remat plan with one --seq-len)")
    source = getattr(model_file_or_model, "path", model_file_or_model)  # a loaded ModelFile: its file
    if isinstance(source, torch.nn.Module) or Path(str(source)).suffix != ".py":
        raise BadInput("a per-rank plan is verified on processes of their own, which import the model: "
                       "pass the model file (model.py) it was made from")
    from planner.act.verify_ranks import verify_ranks

    return verify_ranks(source, plan, steps=steps, device=device, progress=progress)


def _compile_of(spec: StepSpec, plan: Plan) -> tuple[str | None, str]:
    """The backend both runs compile with (``spec.compile``, else the plan's own; None: eager) and its words."""
    from planner.options import parse_compile

    compile = parse_compile(spec.compile) or (plan.compile.backend if plan.compile else None)
    if compile is not None and plan.buckets:
        raise BadInput("verify of a bucketed plan under torch.compile is not supported: verify each shape's plan")
    return compile, f" under torch.compile ({compile})" if compile else ""


class BucketsReport(BaseModel):
    """``verify`` of a bucketed plan: each bucket's batch trained with and without the plan (the
    whole plan applied, so its switch picks the bucket; NOTE [ Bucketed plans ])."""

    buckets: list[str] = Field(description="Each bucket in words ('seq_len 128, batch 8'), smallest first.")
    reports: list[VerifyReport] = Field(description="One report per bucket, in the same order.")
    problems: list[str] = Field(default_factory=list, description="Every bucket's problems, prefixed by it.")
    ok: bool


# ----------------------------------------------------------------------------- loading and offload


def _load(source: Any, inputs: Inputs | list[Inputs] | None, loss_fn: Any,
          plan: Plan) -> tuple[torch.nn.Module, list[Inputs], Any, str]:
    """The model, one batch per bucket of ``plan`` (one without buckets), the loss and a label."""
    n = max(len(plan.buckets), 1)
    if isinstance(source, torch.nn.Module):
        if inputs is None:
            raise BadInput("verify(model, plan) needs inputs=<one training batch>; or pass a model file")
        if planned_modules(source):
            raise PlanAlreadyApplied("verify needs the model without a plan (it trains a copy with and one "
                                     "without); call .remove() on the handle apply_plan returned")
        batches = list(inputs) if plan.buckets and isinstance(inputs, list) else [inputs]
        if len(batches) != n:
            raise BadInput(f"the plan has {n} buckets: pass inputs=[...] with one training batch per bucket, "
                           f"smallest first; or pass the model file")
        return source, batches, loss_fn, type(source).__name__
    mf = source if isinstance(source, ModelFile) else load_model_file(source)
    batches = [mf.example_inputs(**b.shape) for b in plan.buckets] if plan.buckets else [mf.example_inputs()]
    return mf.build_model(), batches, mf.loss_fn, str(mf.path if isinstance(source, ModelFile) else source)


def _host_problems(p: Any, mine: _Run, prediction_tolerance: float) -> list[str]:
    """An offload plan's host peak off the measured one by more than the tolerance: one problem."""
    if p.host_peak_bytes is None:
        return []
    host = mine.host_peak_bytes or 0
    if abs(p.host_peak_bytes - host) <= max(prediction_tolerance * host, PREDICTION_SLACK_BYTES):
        return []
    return [f"predicted host memory {p.host_peak_bytes} bytes is off the measured {host} bytes "
            f"(tolerance {prediction_tolerance:.1%})"]


def _offload_fields(p: Any, mine: _Run) -> dict[str, Any]:
    return {"offloaded": mine.offloaded, "predicted_offload_ms": p.offload_ms or 0.0,
            "predicted_host_peak_bytes": p.host_peak_bytes, "measured_host_peak_bytes": mine.host_peak_bytes}


# ----------------------------------------------------------------------------- the report


RECOMPUTE_TOLERANCE = 0.15
"""The recompute check of ``rows``: within max(15% of the measured overhead, RECOMPUTE_FLOOR_MS)."""
RECOMPUTE_FLOOR_MS = 3.0


def _recompute_notes(measured: int, planned: int, compile: str | None) -> list[str]:
    """What the recompute count says: nothing under compile (the replay runs inside the compiled backward)."""
    if compile is not None:
        return ["recomputed forwards are counted in eager mode only: under torch.compile the replay runs inside "
                "the compiled backward"]
    if measured != planned:
        return [f"{measured} forwards recomputed, {planned} planned: a region that saves no tensor for backward "
                f"is never recomputed"]
    return []


def _noise_note(measured_ms: float, spread_ms: float, steps: int, dev: torch.device, threads: int) -> str:
    """Why a measured recompute overhead is noise, how noisy the run was, and how to measure better."""
    what = "below zero" if measured_ms < 0 else "within the timing noise"
    how = (f"the timed steps of one run varied by up to {spread_ms:.1f} ms" if steps > 1
           else "one timed step per run gives no spread to judge it by")
    if steps > 1 and -measured_ms > spread_ms:  # beyond what one run varied: the two runs ran at different speeds
        how = (f"more than the timed steps of one run varied (up to {spread_ms:.1f} ms), so the machine ran at "
               f"another speed during one of the two runs (other processes, frequency scaling)")
    hint = "rerun with --threads 1 (each thread's CPU time, which other processes do not slow down), " \
        if dev.type == "cpu" and threads != 1 else "rerun "
    return (f"the measured recompute overhead ({measured_ms:+.1f} ms) is {what}: {how}; so it is noise, not a "
            f"measurement; {hint}with more --steps, on an idle machine")


def _recompute_check(r: VerifyReport) -> str:
    """Whether predicted recompute is near the measured one (a hint, not a failure: timing is noisy)."""
    if r.recompute_noise:
        return f"noise (spread {r.timing_spread_ms:.1f} ms)"
    off = r.predicted_recompute_ms + r.predicted_offload_ms - r.measured_recompute_ms
    if abs(off) <= max(RECOMPUTE_TOLERANCE * abs(r.measured_recompute_ms), RECOMPUTE_FLOOR_MS):
        return "close"
    return f"off by {off:+.1f} ms"


def _planned_recomputes(plan: Plan, applied: list[str]) -> int:
    """Checkpointed calls per step: the plan's unit ids (one per call) of the applied FQNs."""
    units = [*plan.checkpoint_units, *(r.unit for r in plan.selective)]
    if not units:
        return len(applied) * plan.recipe.grad_accum
    calls = sum(1 for u in units if u.split("#", 1)[0] in applied)
    return calls * plan.recipe.grad_accum


def _worst_window(plan: Plan, measured: dict[str, int | None]) -> tuple[str, int, int] | None:
    """(window, predicted, measured) where the two differ most, over the windows measured."""
    pairs = [(k, v, measured[k]) for k, v in plan.predicted.windows.items() if measured.get(k) is not None]
    return max(pairs, key=lambda p: abs(p[1] - p[2]), default=None)  # type: ignore[arg-type,return-value]


def _report(plan: Plan, master: torch.nn.Module, label: str, dev: torch.device, steps: int, tolerance: float,
            base: _Run, mine: _Run, prediction_tolerance: float = DEFAULT_PREDICTION_TOLERANCE,
            compile: str | None = None) -> VerifyReport:
    p = plan.predicted
    grad_diff = max_abs_diff(base.grads, mine.grads)
    buffer_diff = max_abs_diff(base.buffers, mine.buffers)  # type: ignore[arg-type]
    planned = _planned_recomputes(plan, mine.checkpointed)
    problems, notes = [], []
    if mine.peak.peak_bytes > plan.budget_bytes:
        problems.append(f"measured peak {format_bytes(mine.peak.peak_bytes)} is over the budget "
                        f"{format_bytes(plan.budget_bytes)}")
    error = (p.peak_bytes - mine.peak.peak_bytes) / max(mine.peak.peak_bytes, 1)
    worst = _worst_window(plan, mine.windows)
    prediction_ok = abs(p.peak_bytes - mine.peak.peak_bytes) <= max(prediction_tolerance * mine.peak.peak_bytes,
                                                                     PREDICTION_SLACK_BYTES)
    if not prediction_ok:
        where = (f"; they differ most at {worst[0]}: predicted {worst[1]} bytes, measured {worst[2]} bytes"
                 if worst else "")
        problems.append(f"predicted peak {p.peak_bytes} bytes is {error:+.2%} off the measured {mine.peak.peak_bytes} "
                        f"bytes (tolerance {prediction_tolerance:.1%}){where}")
    problems += _host_problems(p, mine, prediction_tolerance)
    if grad_diff > tolerance:
        problems.append(f"gradients differ from the unplanned model's by up to {grad_diff:.3g} "
                        f"(tolerance {tolerance:g})")
    notes += nonfinite_notes(base.grads, base.loss)
    if buffer_diff > tolerance:
        problems.append(f"buffers (e.g. BatchNorm statistics) differ by up to {buffer_diff:.3g} "
                        f"(tolerance {tolerance:g})")
    if mine.skipped:
        notes.append("not applied: " + ", ".join(f"{n} ({why})" for n, why in mine.skipped.items()))
    measured_ms = mine.step_ms - base.step_ms
    spread = max(base.spread_ms, mine.spread_ms)
    noise = measured_ms < 0 or abs(measured_ms) <= spread
    if noise:
        notes.append(_noise_note(measured_ms, spread, steps, dev, torch.get_num_threads()))
    notes += _recompute_notes(mine.recomputes, planned, compile)
    if any(p.device.type == dev.type for p in master.parameters()) and dev.type != "cpu":
        notes.append(f"the model given lives on {dev}: its own memory is in both measured peaks")
    if dev.type != (plan.device or dev.type) and plan.device != "meta":
        notes.append(f"the plan was made on {plan.device}, verified on {dev.type}")
    return VerifyReport(
        model=label, device=str(dev), peak_source=mine.peak.source, steps=steps,
        steps_run=_steps_run(plan, steps, planned=True, compiled=bool(compile)), timing_spread_ms=spread,
        recompute_noise=noise,
        budget_bytes=plan.budget_bytes, tolerance=tolerance, recipe=plan.recipe,
        checkpointed=mine.checkpointed, skipped=mine.skipped,
        predicted_peak_bytes=p.peak_bytes, measured_peak_bytes=mine.peak.peak_bytes,
        predicted_no_plan_peak_bytes=p.no_checkpoint_peak_bytes, measured_no_plan_peak_bytes=base.peak.peak_bytes,
        predicted_step_ms=p.step_ms, measured_step_ms=mine.step_ms, measured_no_plan_step_ms=base.step_ms,
        predicted_recompute_ms=p.recompute_ms, measured_recompute_ms=measured_ms,
        measured_recompute_wall_ms=mine.wall_ms - base.wall_ms,
        planned_recomputes=planned, measured_recomputes=mine.recomputes,
        loss=mine.loss, loss_diff=abs(mine.loss - base.loss),
        max_grad_diff=grad_diff, max_buffer_diff=buffer_diff,
        prediction_tolerance=prediction_tolerance, prediction_error=error, prediction_ok=prediction_ok,
        worst_window=worst[0] if worst else None, worst_window_predicted_bytes=worst[1] if worst else None,
        worst_window_measured_bytes=worst[2] if worst else None,
        **_offload_fields(p, mine), problems=problems, notes=notes, ok=not problems,
    )


__all__ = ["BucketsReport", "DEFAULT_PREDICTION_TOLERANCE", "PREDICTION_SLACK_BYTES",
           "RECOMPUTE_FLOOR_MS", "RECOMPUTE_TOLERANCE", "SEED", "verify", "VerifyReport"]
