"""A compiled plan is compiled and measured before it is returned (NOTE [ The compiled plan is checked ]).

Example::

    prof = planner.profile(model_file, compile="inductor")
    plan = checked_plan(prof, "2GB", compiled_peak(model_file))   # the chosen set compiled once, measured
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import networkx as nx

from planner.errors import BudgetInfeasible, SolverError
from planner.model.schema import CompiledPeak, Plan, Profile, SolverInfo
from planner.sizes import format_bytes, parse_bytes
from planner.spec import SolveSpec, StepSpec, solve_spec

# NOTE [ The compiled plan is checked ]
#
# A compiled profile predicts every checkpoint set from two measured compiles, the step as it is
# and the repeated blocks checkpointed (NOTE [ Compiled profile ]). Every other set compiles to a
# fused backward of its own, whose buffers inductor plans: measured on examples/llama.py, two
# sets with the same saves peak 6 to 9 MB apart by inductor's code alone (docs/benchmarks.md,
# "Where the compiled backward peaks"), which no per-model figure can follow. So a compiled plan
# is measured before it is returned, as the eager profile's validation step proves its figures:
# Rule 1. The chosen set's compiled step is measured as ``remat verify --compile`` measures it
#   (``apply_plan`` on a copy, ``torch.compile`` afresh, the peak of one step), unless the profile
#   or an earlier check measured that set (``CompileInfo.measured``: the profile's two compiles).
#   On the CPU its kernels are not built: only its memory is measured (NOTE [ Memory-only compiles ]).
# Rule 2. A measured set is predicted at its measurement: ``peak_bytes`` and ``activations_bytes``
#   move by the difference, ``peak_at`` names the check (``CHECKED_AT``); the cost model's own
#   figure is what the solver chose by. Within the usable budget (the budget less its headroom)
#   the plan stands.
# Rule 3. Above the usable budget: the cost model under-predicts that set by e bytes. The solver
#   plans again for the usable budget less the largest e seen (asked as the budget whose usable
#   part that is), so the next set is one the cost model puts e lower; the set that failed cannot
#   come back (its prediction plus e is its measurement, over). At most ``CHECKS`` compiles.
# Rule 4. A set measured within the usable budget that needs less recompute than the plan found
#   (a set of the profile's compiles the cost model put over the budget) is the plan; when no
#   plan is found within ``CHECKS`` compiles, the measured set within the budget with the least
#   recompute is; with none, ``BudgetInfeasible`` names the measured peaks and a budget the
#   lowest of them fits.
# Rule 5. When the cost model puts no set within the budget (at once, or after Rule 3 lowered it),
#   its lowest plans are compiled and measured: a set can measure below the cost model's floor (the
#   wide Llama: every set predicted at 540.33 MiB or more, layers 0 and 1 whole measured 536.33 MiB in
#   round 12), and within the budget it is the plan. Two plans, as the model's two kinds of figure
#   are off differently under compile: its plan at its own lowest budget (op by op where the solver
#   may choose it; measured 1.1 to 6.0% off, either side), then its lowest plan of whole modules
#   (within 0.2% on whole layers). A set measured before is not compiled again. Otherwise the cost
#   model's ``BudgetInfeasible`` stands, saying what its lowest plan measured.
# Rule 6. The plan records every set measured (``compile.measured``). A plan made from a saved
#   profile without the model is not checked (nothing to compile): ``remat verify --compile``
#   measures it, and ``remat show`` says which.
# Rule 7. A plan measured well under the usable budget spends the margin: the cost model put that
#   set ``d`` bytes above its measurement (op-level figures: 1.1 to 6.0% high), so the solver plans
#   again for the usable budget plus ``d``, and the plan it finds, when it needs less recompute, is
#   compiled and measured; within the usable budget it is the plan, and spends what it leaves in
#   turn. ``d`` differs from set to set (the wide Llama: 27.06 MiB with three layers op by op, 5.99
#   MiB with two), so the cheaper plan can measure over. Then the next try plans for the secant
#   between the two measured sets: the cost model's peak at which the measurement would meet the
#   usable budget, were the error linear between them (``_spend_ask``). At most ``SPENDS`` compiles.
#   Measured on the wide Llama at the peak of compile's budget 0.7 (557.40 MiB): three layers op by op
#   measured 521.17 MiB (548.22 modelled); the first try, two layers, 566.14 (572.13), over; the
#   secant (567.48 MiB) gave two layers keeping less, 554.14 (560.13): 174.8 ms of predicted
#   recompute against 239.2. "Well under": a margin of ``SPEND_AT`` of the budget or more, as each
#   try is one compile of the step (on examples/llama.py 18.5 s of the 69.7 s ``remat plan
#   --compile`` takes; at 85MB that plan's margin is 1.1%, and compile's budget 0.7 left remat's
#   plans 2.0 to 5.0% under, round 18).
#   And only for a plan worth that compile: one whose predicted recompute is ``SPEND_GAIN`` of the
#   found plan's or more below it. Why 10%: compiled recompute measured 5 to 24% of its price on
#   examples/gpt2.py and examples/llama.py under the eager shares (round 20, runs A and C in
#   docs/benchmarks.md) and still below it under the replayed kernels' (run D: GPT-2 -19.7 to
#   -1.3 ms against 7.6 to 84.9 predicted), so a smaller predicted saving is no saving the cost
#   model can tell. Measured on examples/llama.py at 85MB (margin
#   4.0%): the cheaper plan kept one more matmul in one layer (34.19 ms against 37.69 predicted,
#   9.3%; measured recompute there is about a tenth of the prediction, some 0.3 ms a step), and
#   its compile took ``remat plan --compile`` from 73.9 to 86.1 s, 3.5 times the model's first
#   compiled step (24.7 s).

CHECKS = 3
"""Compiles the check may run for one plan (Rule 3): each is one compile and three steps."""

SPEND_AT = 0.02
"""The margin under the usable budget, as a fraction of the budget, that a measured plan spends (Rule 7)."""

SPEND_GAIN = 0.10
"""The fraction of the found plan's predicted recompute a cheaper plan must save to be compiled (Rule 7)."""

SPENDS = 2
"""Compiles Rule 7 may run to spend a margin: the first at the found set's error, then by the secant."""

CHECKED_AT = "the compiled step (measured)"

Measure = Callable[[Plan], int]
"""The compiled step's measured peak with a plan applied (``compiled_peak``)."""


def checked_plan(profile: Profile, budget: int | str, measure: Measure, *, solve: SolveSpec | None = None,
                 graph: nx.DiGraph | None = None, progress: Callable[[str], None] | None = None) -> Plan:
    """The plan for ``budget`` whose compiled step was measured within it (Rules 1-7); ``measure``
    compiles and measures one plan. ``profile`` is a compiled profile (``Profile.compile``)."""
    from planner.act.api import budget_with_headroom, graph_for, plan_from_profile

    say = progress or (lambda _msg: None)
    spec = solve_spec(solve)
    g = graph if graph is not None else graph_for(profile, solve=spec)
    known = {_key(m): m for m in profile.compile.measured}
    budget_bytes, usable, headroom_bytes = _usable(profile, spec, budget)
    lowered, over, found, refused, modelled = 0, [], None, None, 0
    for _ in range(CHECKS):
        try:  # the budget whose usable part is ``lowered`` less (Rule 3)
            asked = budget_with_headroom(max(1, usable - lowered), _headroom(profile, spec)) if lowered else budget
            plan = plan_from_profile(profile, asked, solve=spec, graph=g)
        except (BudgetInfeasible, SolverError) as e:  # nothing predicted below the (lowered) budget
            refused = e
            break
        modelled = plan.predicted.peak_bytes
        plan = _for_budget(_measured(plan, known, measure, say), budget_bytes, headroom_bytes)
        if plan.predicted.peak_bytes <= usable:
            found = plan
            break
        over.append(plan)
        lowered = max(lowered, plan.predicted.peak_bytes - modelled)
    if found is not None and not over:  # Rule 7
        found = _spent(profile, found, modelled, budget, spec, g, known, measure, say)
    if found is None and isinstance(refused, BudgetInfeasible):  # Rule 5
        found = _at_the_floor(profile, budget, spec, g, known, measure, say)
    plans = [p for p in (found, *_measured_plans(profile, g, spec, budget, list(known.values()))) if p is not None]
    if plans:
        return min(plans, key=lambda p: p.predicted.recompute_ms)  # the first of equals: the solver's (Rule 4)
    if refused is not None and not over:
        raise _with_floor(refused, list(known.values()), profile)
    raise _nothing_fits(parse_bytes(budget), over, list(known.values()), profile)


def _measured(plan: Plan, known: dict[tuple, CompiledPeak], measure: Measure, say: Callable[[str], None]) -> Plan:
    """``plan`` predicted at its compiled step's measurement, compiled and measured unless ``known`` has it
    (Rules 1 and 2); ``known`` gains it."""
    key = _key(plan)
    if key not in known:
        say(f"checking the plan: compiling the step with {len(plan.checkpoints) + len(plan.selective)} modules "
            f"checkpointed")
        known[key] = CompiledPeak(checkpoints=list(plan.checkpoints), selective=list(plan.selective),
                                  peak_bytes=measure(plan))
    return with_check(plan, list(known.values()))


def _at_the_floor(profile: Profile, budget: int | str, spec: SolveSpec, g: nx.DiGraph,
                  known: dict[tuple, CompiledPeak], measure: Measure, say: Callable[[str], None]) -> Plan | None:
    """Rule 5: the cost model's plan at its lowest budget, then its lowest plan of whole modules, measured;
    the first whose measurement fits ``budget`` is the plan for it."""
    from planner.act.api import graph_for

    budget_bytes, usable, headroom_bytes = _usable(profile, spec, budget)
    whole = spec.replace(selective=False)
    for how, graph in ((spec, g), (whole, g if not spec.selective else graph_for(profile, solve=whole))):
        plan = _floor_plan(profile, how, graph, budget)
        if plan is None:
            continue
        plan = _measured(plan, known, measure, say)
        if plan.predicted.peak_bytes <= usable:
            return _for_budget(plan, budget_bytes, headroom_bytes)
        if not spec.selective:
            break
    return None


def _floor_plan(profile: Profile, spec: SolveSpec, g: nx.DiGraph, budget: int | str) -> Plan | None:
    """The cost model's plan for ``budget`` on ``g``, or where it has none its plan at its own lowest
    budget; None: no plan at all."""
    from planner.act.api import plan_from_profile

    try:
        return plan_from_profile(profile, budget, solve=spec, graph=g)
    except BudgetInfeasible as e:
        floor = e.min_feasible_bytes
    except SolverError:
        return None
    try:
        return plan_from_profile(profile, floor, solve=spec, graph=g) if floor is not None else None
    except (BudgetInfeasible, SolverError):
        return None


def _spent(profile: Profile, found: Plan, modelled: int, budget: int | str, spec: SolveSpec, g: nx.DiGraph,
           known: dict[tuple, CompiledPeak], measure: Measure, say: Callable[[str], None]) -> Plan:
    """Rule 7: ``found`` (the cost model put it at ``modelled``), or the plan needing the least recompute of
    those the solver finds above the usable budget by the cost model's over-prediction whose compiled
    steps measure within the budget; at most ``SPENDS`` of them compiled."""
    from planner.act.api import budget_with_headroom, plan_from_profile

    budget_bytes, usable, headroom_bytes = _usable(profile, spec, budget)
    found_at, over = modelled, None  # the cost model's peak of ``found``; (modelled, measured) of a set over
    for _ in range(SPENDS):
        ask = _spend_ask(usable, (found_at, found.predicted.peak_bytes), over)
        if ask is None or usable - found.predicted.peak_bytes < SPEND_AT * budget_bytes:
            break
        try:  # the budget whose usable part is ``ask``
            cheaper = plan_from_profile(profile, budget_with_headroom(ask, _headroom(profile, spec)), solve=spec,
                                        graph=g)
        except (BudgetInfeasible, SolverError):
            break
        saved_ms = found.predicted.recompute_ms - cheaper.predicted.recompute_ms
        if _key(cheaper) == _key(found) or saved_ms <= 0 or saved_ms < SPEND_GAIN * found.predicted.recompute_ms:
            break
        at = cheaper.predicted.peak_bytes
        say(f"the plan measured {format_bytes(usable - found.predicted.peak_bytes)} under the budget: a plan "
            f"recomputing {cheaper.predicted.recompute_ms:.1f} ms, not {found.predicted.recompute_ms:.1f}, may fit")
        cheaper = _measured(cheaper, known, measure, say)
        if cheaper.predicted.peak_bytes > usable:
            over = (at, cheaper.predicted.peak_bytes)
            continue
        found, found_at = _for_budget(cheaper, budget_bytes, headroom_bytes), at
    return with_check(found, list(known.values()))


def _spend_ask(usable: int, fits: tuple[int, int], over: tuple[int, int] | None) -> int | None:
    """The usable budget Rule 7 plans for next, from the (cost model's, measured) peaks of the cheapest set
    that fits and of the cheaper set that measured over; None: nothing to spend."""
    (fit_modelled, fit_bytes), (over_modelled, over_bytes) = fits, over or (0, 0)
    if fit_bytes >= fit_modelled:
        return None  # the cost model did not over-predict the set that fits
    if over is None:
        return usable + fit_modelled - fit_bytes  # its error, taken for every set
    if over_modelled <= fit_modelled or over_bytes <= fit_bytes:
        return None
    return fit_modelled + (usable - fit_bytes) * (over_modelled - fit_modelled) // (over_bytes - fit_bytes)  # secant


def _with_floor(refused: Exception, measured: list[CompiledPeak], profile: Profile) -> Exception:
    """The cost model's refusal, saying what its lowest plan measured when Rule 5 compiled it."""
    floor = measured[len(profile.compile.measured):]
    if not isinstance(refused, BudgetInfeasible) or not floor:
        return refused
    what = _named(floor[0].checkpoints + [r.fqn + " (op by op)" for r in floor[0].selective])
    return BudgetInfeasible(f"{refused.template}; the cost model's lowest plan ({what}) was compiled and measured "
                            f"at {floor[0].peak_bytes} bytes", budget_bytes=refused.budget_bytes,
                            min_feasible_bytes=refused.min_feasible_bytes, options=refused.options)


def _for_budget(plan: Plan, budget_bytes: int, headroom_bytes: int) -> Plan:
    """``plan`` as the plan for the budget asked (the solver may have planned it for a lowered or raised one)."""
    return plan.model_copy(update={"budget_bytes": budget_bytes, "headroom_bytes": headroom_bytes})


def _usable(profile: Profile, spec: SolveSpec, budget: int | str) -> tuple[int, int, int]:
    """``(budget bytes, usable bytes, headroom bytes)`` as ``plan_from_profile`` reads them."""
    from planner.act.api import usable_budget

    budget_bytes = parse_bytes(budget)
    usable, headroom_bytes = usable_budget(budget_bytes, _headroom(profile, spec))
    return budget_bytes, usable, headroom_bytes


def _headroom(profile: Profile, spec: SolveSpec) -> float:
    """The headroom fraction ``plan_from_profile`` plans with."""
    from planner.act.api import headroom_for

    return headroom_for(profile) if spec.headroom is None else spec.headroom


def with_check(plan: Plan, measured: list[CompiledPeak]) -> Plan:
    """``plan`` recording the compiles ``measured``, predicted at its own set's measurement when that is
    among them (Rules 2 and 6)."""
    update: dict[str, Any] = {"compile": plan.compile.model_copy(update={"measured": list(measured)})}
    mine = [m.peak_bytes for m in measured if _key(m) == _key(plan)]  # measured_of, before they are recorded
    if mine and mine[0] != plan.predicted.peak_bytes:
        p, moved = plan.predicted, mine[0] - plan.predicted.peak_bytes
        update["predicted"] = p.model_copy(update={"peak_bytes": mine[0], "peak_at": CHECKED_AT,
                                                   "activations_bytes": p.activations_bytes + moved})
    return plan.model_copy(update=update)


def _measured_plans(profile: Profile, g: nx.DiGraph, spec: SolveSpec, budget: int | str,
                    measured: list[CompiledPeak]) -> list[Plan]:
    """A plan for each measured set whose measurement fits the usable budget (Rule 4)."""
    from planner.act.api import _plan_of
    from solvers.cost_model import simulate

    budget_bytes, usable, headroom_bytes = _usable(profile, spec, budget)
    out = []
    for m in (m for m in measured if not m.selective):  # whole units only: no menu index to rebuild
        units = [n for n in g.nodes if g.nodes[n].get("fqn") in set(m.checkpoints)]
        if m.peak_bytes > usable or len({g.nodes[n]["fqn"] for n in units}) != len(set(m.checkpoints)):
            continue
        est = simulate(g, units)
        est = est.model_copy(update={"peak_bytes": m.peak_bytes, "peak_at": CHECKED_AT,
                                     "activations_bytes": est.activations_bytes + m.peak_bytes - est.peak_bytes})
        plan = _plan_of(profile, g, est, budget_bytes, headroom_bytes=headroom_bytes,
                        solver=SolverInfo(name="measured", status="feasible", detail="a compiled step measured "
                                          "within the budget (NOTE [ The compiled plan is checked ], Rule 4)"))
        out.append(with_check(plan, measured))
    return out


def measured_of(plan: Plan) -> CompiledPeak | None:
    """The measurement of ``plan``'s own compiled step among those it records (Rule 6); None: not measured."""
    return next((m for m in plan.compile.measured if _key(m) == _key(plan)), None) if plan.compile else None


def _key(s: Plan | CompiledPeak) -> tuple[frozenset, frozenset]:
    """What identifies a compiled step: the modules checkpointed whole, and op by op with what each keeps."""
    return frozenset(s.checkpoints), frozenset((r.fqn, tuple((o.op, o.index) for o in r.save)) for r in s.selective)


def _nothing_fits(budget_bytes: int, over: list[Plan], measured: list[CompiledPeak],
                  profile: Profile) -> BudgetInfeasible:
    """Rule 4's error: the plans whose compiled steps measured over the budget, and the budget the lowest
    measured compiled peak fits."""
    from planner.act.api import budget_with_headroom, headroom_for

    tried = "; ".join(f"{_named(p.checkpoints + [r.fqn + ' (op by op)' for r in p.selective])} measured {p.predicted.peak_bytes} bytes" for p in over)
    lowest = min(measured, key=lambda m: m.peak_bytes)
    fits = budget_with_headroom(lowest.peak_bytes, headroom_for(profile))
    return BudgetInfeasible(
        f"no checkpoint plan fits the budget of {budget_bytes} bytes ({format_bytes(budget_bytes)}) under "
        f"torch.compile: the compiled step of each plan the cost model put within it peaked above it ({tried}); "
        f"the lowest compiled peak measured is {lowest.peak_bytes} bytes, with {_named(lowest.checkpoints)}: raise "
        f"{{budget}} to {fits} bytes ({format_bytes(fits)}) or more", budget_bytes=budget_bytes,
        min_feasible_bytes=fits, options=("budget",))


def _named(fqns: list[str]) -> str:
    """A checkpoint set in words: 'model.layers.0, model.layers.1 checkpointed', or 'nothing checkpointed'."""
    return f"{', '.join(fqns)} checkpointed" if fqns else "nothing checkpointed"


def compiled_peak(source: Any, *, step: StepSpec | None = None, inputs: Any = None,
                  progress: Callable[[str], None] | None = None) -> Measure:
    """``Measure`` for the model file or ``nn.Module`` ``source`` (with ``inputs``), trained as ``step``
    says (device, threads, loss): each plan applied to a copy, compiled with the plan's backend and
    measured as ``verify`` measures it (Rule 1), its kernels unbuilt where ``peak_only`` may (what it
    measures again is said to ``progress``)."""
    import torch

    from planner.act.verify import _load
    from planner.act.verify_run import _run
    from planner.profiling import rng, step_changes
    from planner.profiling.profiler import resolve_device
    from planner.profiling.timing import num_threads, pick_clock
    from planner.profiling.unbuilt import peak_only

    run_as = step or StepSpec(device="cpu")

    def measure(plan: Plan) -> int:
        master, batches, fn, _label = _load(source, inputs, run_as.loss_fn, plan)
        dev = resolve_device(run_as.device)
        with num_threads(run_as.threads or (plan.threads if dev.type == "cpu" else None)), rng.kept(dev), \
                _quiet(step_changes.logger), _quiet(logging.getLogger("torch._higher_order_ops.wrap")):
            # the profile said the step changes already; torch's advice on op-level policies is the applier's
            # (NOTE [ Compiled profile ], Rule 7: no in-place op is kept), not the user's
            clock = pick_clock(dev, torch.get_num_threads())
            run = peak_only(lambda: _run(master, batches[0], fn, plan, dev, 1, clock, planned=True,  # memory only
                                         compile=plan.compile.backend),
                            dev, say=progress)  # NOTE [ Memory-only compiles ]
        return run.peak.peak_bytes

    return measure


@contextlib.contextmanager
def _quiet(logger: logging.Logger) -> Iterator[None]:
    """``logger`` silent for the duration."""
    before, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = before


__all__ = ["CHECKED_AT", "CHECKS", "SPEND_AT", "Measure", "checked_plan", "compiled_peak", "measured_of", "with_check"]
