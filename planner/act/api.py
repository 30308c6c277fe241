"""Python API: from a model (or a saved profile) and a budget to a ``Plan``.

Example::

    import planner
    from examples.gpt2 import build_model, example_inputs

    plan = planner.plan(build_model(), "2GB", inputs=example_inputs(), device="cpu")
    print(plan.checkpoints, plan.predicted.peak_bytes)
    plan.save("plan.json")
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import networkx as nx

from solvers.cost_model import simulate, window_bytes
from solvers.dp import min_feasible_bytes
from planner.errors import BadInput, BudgetInfeasible, SolverError, listed
from planner.model.graph import build_graph
from planner.act.robust import (OPTIMISERS as _OPTIMISERS, canonical, difference_spread_ms, group_search, op_level_stands,
                                simplest_within_spread)
from planner.act.offload_plan import check_offload, check_offload_shapes, host_too_small, offloaded_units, resolve_host_budget
from planner.model.schema import (COMPILED_PLAN_VERSION, OFFLOAD_PLAN_VERSION, OpRef, Plan, Predicted, Profile, RunStamp,
                                  SelectiveRegion, SolverInfo, now_iso)
from planner.optimizers import from_file
from planner.options import check_ceiling, parse_optimizer, parse_sharding
from planner.spec import SOLVE_FIELDS, STEP_FIELDS, SolveSpec, StepSpec, solve_spec, step_spec
from planner.sizes import format_bytes, parse_bytes

# NOTE [ Headroom from evidence ]
#
# The planner plans for the budget less a headroom: the fraction by which the measured peak has
# been seen above the prediction, on the conformance zoo (docs/zoo.md) and its meta-vs-real
# check (benchmarks/meta_margin.py, docs/meta.md), rounded up. ``headroom_for`` picks it from
# how the profile was made; ``--headroom`` overrides it. Update a figure when a wider run moves it.

DEFAULT_HEADROOM = 0.005
"""A profile measured on the device, full precision: the zoo's 26 models x 3 budgets (docs/zoo.md,
``python benchmarks/zoo.py``) were never measured above the prediction (most under-predicted row:
+0.00%, llama at 1/4; worst |error| 1.15%, over-predicted). 0.5% is kept for what the CPU runs
cannot show (a GPU allocator's rounding beyond its 512-byte blocks, a kernel's scratch)."""

AMP_HEADROOM = 0.015
"""A measured profile of an autocast step (bf16, fp16): the zoo's recipe table (docs/zoo.md,
``python benchmarks/zoo.py --recipes all --tiny --fractions 0.5``) has nn.TransformerEncoder under
fp16 measured 1.34% above its prediction, the only row measured above."""

META_HEADROOM = 0.07
"""A profile made on fake tensors (``--device meta``): kernels' own scratch is invisible there. The
examples' meta plans measured on the CPU (``python benchmarks/meta_margin.py``): GPT-2, Llama and
T5 within 0.01%, the U-Net 6.25% above the prediction (its convolutions' workspaces)."""


def headroom_for(profile: Profile) -> float:
    """The default headroom for plans on ``profile`` (NOTE [ Headroom from evidence ])."""
    if profile.device == "meta":
        return META_HEADROOM
    return AMP_HEADROOM if profile.recipe.amp else DEFAULT_HEADROOM

NESTING_SOLVERS = ("ilp", "auto")
"""Solvers that choose among nested candidates; the others get the single level ``granularity``."""


def graph_for(profile: Profile, *, solve: SolveSpec | None = None, **solve_fields: Any) -> nx.DiGraph:
    """The candidate graph ``solve``'s solver works on (``solve_fields`` replace its fields): nested
    levels for the ILP, one level otherwise; with op-level menus (``selective``) where the profile
    has op records, for one process only (``MULTI_RANK_SELECTIVE``)."""
    spec = solve_spec(solve, **solve_fields)
    check_ranks(spec.world_size, spec.sharding)
    nested = spec.granularity > 0 and spec.solver in NESTING_SOLVERS
    one_process = spec.world_size == 1 and spec.sharding == "none"
    return build_graph(profile, granularity=spec.granularity, nested=nested, world_size=spec.world_size,
                       sharding=spec.sharding, selective=spec.selective and (MULTI_RANK_SELECTIVE or one_process))


MULTI_RANK_SELECTIVE = False
"""Plans for DDP or FSDP2 ranks use whole modules only. Under torchrun with DDP, a rank that ran
selective regions aborted when its interpreter exited, after its step and its report ("terminate
called without an active exception"): 1 in 3 runs of tests/test_distributed.py's torchrun check,
against 0 in 5 with whole-module plans. Not yet explained; the applier still enforces a
selective plan given to it on ranks (its gradients match, tests/test_distributed.py)."""


def check_ranks(world_size: int, sharding: str) -> None:
    """Validate a per-rank setting (see docs/distributed.md). Raises ``BadInput``.

    ``sharding="none"`` with ``world_size > 1`` is refused rather than read as "every rank holds
    a full replica and no gradient sync buffers": that is the single-process plan anyway, and a
    DDP or FSDP run planned that way would be told its buckets or all-gathers cost nothing.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise BadInput(f"world size must be an integer >= 1, got {world_size!r}")
    check_ceiling("world_size", world_size)
    parse_sharding(sharding)
    if sharding == "none" and world_size > 1:
        raise BadInput(f"world size {world_size} needs sharding ddp or fsdp: with none every rank holds a "
                       f"full replica and no gradient sync buffers, which is the single-process plan "
                       f"(drop the world size, or say how the ranks train: {{sharding}} ddp|fsdp)",
                       options=("sharding",))


def solve_graph(g: nx.DiGraph, budget_bytes: int, *, solver: str = "auto",
                time_limit_s: float | None = None, host_budget_bytes: int | None = None):
    """Run one solver by name; returns a ``solvers.Solution``. ``host_budget_bytes``: offload allowed
    within it (``OFFLOAD_SOLVERS`` only; see NOTE [ Offload and the DP ] in solvers/auto.py)."""
    from solvers import SOLVERS

    check_offload(host_budget_bytes is not None, solver=solver)
    fn = SOLVERS.get(solver)
    if fn is None:
        choices = ", ".join(["auto", *sorted(k for k in SOLVERS if k != "auto")])
        raise SolverError(f"unknown solver {solver!r}; choose one of: {choices}")
    host = {} if host_budget_bytes is None else {"host_budget_bytes": host_budget_bytes}
    sol = fn(g, budget_bytes, time_limit_s=time_limit_s, **host)  # raises SolverError for a graph it cannot plan
    if sol.status != "infeasible" and not (math.isfinite(sol.recompute_ms) and sol.recompute_ms >= 0
                                           and sol.peak_bytes >= 0):
        raise SolverError(f"solver {sol.solver!r} found a plan with a recompute of {sol.recompute_ms} ms and a peak "
                          f"of {sol.peak_bytes} bytes, which cannot be true: the profile's times or sizes are not "
                          f"finite and positive; re-profile the model")
    return sol


def plan_from_profile(profile: Profile, budget: int | str, *, solve: SolveSpec | None = None,
                      graph: nx.DiGraph | None = None, check: Any = None,
                      progress: Any = None, **solve_fields: Any) -> Plan:
    """Plan on a measured profile. Raises ``BudgetInfeasible`` when nothing fits ``budget``.

    ``solve`` says how (``planner.spec.SolveSpec``: the solver, granularity, time limit, ranks,
    headroom, op-level regions); ``solve_fields`` replace its fields (``solver="ilp"``, ...).
    ``world_size``/``sharding`` plan per rank (see NOTE [ Per-rank memory ]). The solver plans for
    ``budget * (1 - headroom)``; headroom None: ``headroom_for(profile)`` (NOTE [ Headroom from
    evidence ]). ``check``: for a compiled profile, what measures a plan's compiled step
    (``compiled_check.compiled_peak``), so that the plan returned was measured within the budget (NOTE
    [ The compiled plan is checked ]). ``graph``: the candidate graph to plan on, when the caller has
    built it. ``offload``:
    each unit may also move its saved tensors to host memory, within ``host_memory`` (default:
    ``planner.act.offload_plan.resolve_host_budget``; NOTE [ Peak-memory model ], Rule 10).

    Example::

        plan = plan_from_profile(Profile.load("profile.json"), "12GB", solver="ilp", time_limit_s=30)
    """
    profile = as_profile(profile, "plan_from_profile")
    spec = solve_spec(solve, **solve_fields)
    if check is not None and profile.compile is not None:  # NOTE [ The compiled plan is checked ]
        from planner.act.compiled_check import checked_plan

        return checked_plan(profile, budget, check, solve=spec, graph=graph, progress=progress)
    solver = spec.solver
    budget_bytes = parse_bytes(budget)
    check_offload(spec.offload, solver=solver, world_size=spec.world_size, sharding=spec.sharding)
    host_budget = resolve_host_budget(profile, spec.offload, spec.host_memory)
    headroom = headroom_for(profile) if spec.headroom is None else spec.headroom
    usable, headroom_bytes = usable_budget(budget_bytes, headroom)
    g = graph if graph is not None else graph_for(profile, solve=spec)
    t0 = time.perf_counter()
    sol = solve_graph(g, usable, solver=solver, time_limit_s=spec.time_limit_s, host_budget_bytes=host_budget)
    seconds = time.perf_counter() - t0
    if sol.status == "infeasible" and host_budget is not None:
        host_too_small(g, usable, budget_bytes, host_budget, spec.time_limit_s)
    if sol.status == "infeasible":
        raise _no_plan(profile, g, sol, budget_bytes, headroom)
    est = simulate(g, sol.checkpointed, sol.selective, sol.offloaded)  # every call of a module, or none
    if est.selective and solver in _OPTIMISERS:  # NOTE [ Robust choice ], Rules 3, 4 and 1
        est = simplest_within_spread(g, group_search(g, est, usable), usable)
        g, sol, est = _robust_choice(profile, spec, usable, g, sol, est, host_budget)
    if solver in _OPTIMISERS:  # baselines (every-2, sqrt, ...) place their checkpoints by rule
        est = canonical(g, est, usable)  # NOTE [ Robust choice ], Rule 2
    if est.peak_bytes > usable:
        raise SolverError(
            f"internal error: plan from {sol.solver} predicts {est.peak_bytes} bytes over the budget "
            f"{budget_bytes}; please report this with the profile and the traceback")
    from planner.act.frontier import proven_lowest_peak

    return _plan_of(profile, g, est, budget_bytes, headroom_bytes=headroom_bytes, host_budget_bytes=host_budget,
                    solver=SolverInfo(name=sol.solver, status=sol.status, gap=sol.gap, detail=sol.detail),
                    min_feasible=proven_lowest_peak(g, sol, offload=host_budget is not None), seconds=seconds)


def plan_of(profile: Profile, g: nx.DiGraph, est: Any, budget_bytes: int, *, solver: SolverInfo,
            host_budget_bytes: int | None = None) -> Plan:
    """The ``Plan`` of a set chosen by hand (``simulate``'s estimate ``est`` on ``g``), without headroom:
    benchmarks compare fixed rules, such as offloading every block, this way."""
    return _plan_of(profile, g, est, budget_bytes, solver=solver, host_budget_bytes=host_budget_bytes)


def _plan_of(profile: Profile, g: nx.DiGraph, est: Any, budget_bytes: int, *, solver: SolverInfo,
             headroom_bytes: int = 0, host_budget_bytes: int | None = None, min_feasible: int | None = None,
             seconds: float = 0.0) -> Plan:
    """The ``Plan`` of one estimate (``simulate``'s) on ``g``."""
    return Plan(
        fingerprint=profile.fingerprint, fingerprint_digest=profile.fingerprint.digest(),
        budget_bytes=budget_bytes, headroom_bytes=headroom_bytes,
        checkpoints=_fqns(g, est.checkpointed), checkpoint_units=list(est.checkpointed),
        selective=selective_regions(g, est.selective),
        offload=offloaded_units(g, est.offloaded), host_budget_bytes=host_budget_bytes if est.offloaded else None,
        solver=solver,
        predicted=Predicted(
            peak_bytes=est.peak_bytes, params_bytes=est.params_bytes, grads_bytes=est.grads_bytes,
            optimizer_bytes=est.optimizer_bytes, activations_bytes=est.activations_bytes,
            recompute_ms=round(est.recompute_ms, 6), step_ms=round(est.step_ms, 6), peak_at=est.peak_at,
            no_checkpoint_peak_bytes=simulate(g, []).peak_bytes,
            min_feasible_bytes=min_feasible,
            windows={k: v for k, v in window_bytes(g, est.checkpointed, selective=est.selective,
                                                   offloaded=est.offloaded).items() if k.startswith(_WINDOWS)},
            **({"host_peak_bytes": est.host_peak_bytes, "offload_ms": round(est.offload_ms, 6)}
               if est.offloaded else {}),
        ),
        granularity=g.graph["granularity"], device=profile.device, device_name=profile.device_name,
        target=profile.target, dtype=profile.dtype, recipe=profile.recipe, optimizer=profile.optimizer,
        world_size=g.graph["world_size"], sharding=g.graph["sharding"],
        fsdp_units=list(g.graph["fsdp_units"]) if g.graph["sharding"] == "fsdp" else [],
        step_changes=list(profile.step_changes), excluded=list(profile.excluded),
        torch_version=profile.torch_version, remat_version=_version(),
        time_source=profile.time_source, threads=profile.threads, time_calibration=profile.time_calibration,
        created=RunStamp(at=now_iso(), solver_seconds=round(seconds, 6)),
        compile=profile.compile,
        **({"schema_version": COMPILED_PLAN_VERSION} if profile.compile else
           {"schema_version": OFFLOAD_PLAN_VERSION} if est.offloaded else {}),
    )


# NOTE [ Rules that ignore the budget ]
# The baselines and Chen's sqrt(n) rule choose their checkpoints without the budget; when their plan does
# not fit, no time limit would help. They said "found no plan within its limits (no detail) ... raise
# --time-limit", a fix that cannot work (round 17: --solver all at a budget dp fits).

FIXED_RULES = frozenset({"none", "all", "sqrt", "every-2"})
"""Solvers whose plan does not depend on the budget (NOTE [ Rules that ignore the budget ])."""


def _no_plan(profile: Profile, g: nx.DiGraph, sol: Any, budget_bytes: int, headroom: float) -> Exception:
    """The error for an infeasible solution: the solver's limits when a plan exists, else why nothing fits."""
    lowest_peak = sol.min_feasible_bytes if sol.min_feasible_bytes is not None else min_feasible_bytes(g)
    lowest = budget_with_headroom(lowest_peak, headroom)
    if lowest <= budget_bytes and sol.solver in FIXED_RULES:  # NOTE [ Rules that ignore the budget ]
        return SolverError(
            f"solver {sol.solver!r} is a fixed rule that does not look at the budget: its plan peaks at "
            f"{sol.peak_bytes} bytes ({format_bytes(sol.peak_bytes)}), above what the budget leaves after the "
            f"headroom; use {{solver}} auto, which finds plans down to a budget of {lowest} bytes", options=("solver",))
    if lowest <= budget_bytes:
        return SolverError(
            f"solver {sol.solver!r} found no plan within its limits ({sol.detail or 'no detail'}), "
            f"although a plan with a peak of {lowest} bytes exists; "
            f"raise {{time_limit_s}} or use {{solver}} dp",
            options=("time_limit_s", "solver"))
    return infeasible(profile, g, budget_bytes, lowest_peak, headroom)


def _robust_choice(profile: Profile, spec: SolveSpec, usable: int, g: nx.DiGraph, sol: Any,
                   est: Any, host_budget: int | None = None) -> tuple[nx.DiGraph, Any, Any]:
    """The whole-module plan instead of ``est`` (with selective regions) when it fits and costs no more
    recompute (and exposed copies) than the op-level plan saves beyond the spread of the difference and
    the time model's accuracy (NOTE [ Robust choice ], Rule 1)."""
    wg = graph_for(profile, solve=spec.replace(selective=False))
    whole = solve_graph(wg, usable, solver=spec.solver, time_limit_s=spec.time_limit_s, host_budget_bytes=host_budget)
    if whole.status != "infeasible":
        plain = simulate(wg, whole.checkpointed, offloaded=whole.offloaded)
        if plain.peak_bytes <= usable and not op_level_stands(g, est, plain):
            return wg, whole, plain
    return g, sol, est


# NOTE [ Why nothing fits ]
#
# When no checkpoint set fits, the error says what would and what cannot help:
# Rule 1. The minimum feasible budget is the lowest peak any checkpoint set reaches, plus the
#   headroom (``budget_with_headroom``), so that ``remat plan --budget`` of that figure plans.
# Rule 2. When checkpointing cannot lower the peak at all (the lowest peak is the peak without
#   checkpointing: a model that is one fused op such as a single nn.LSTM, a frozen backbone that
#   saves nothing, every candidate excluded, a peak at the optimizer step), it says "no unit can
#   lower this peak" and why, and the smallest feasible budget is the no-checkpoint peak plus the
#   headroom.
# Rule 3. A finer granularity is suggested only when it helps: the next level's candidates are
#   built and their lowest peak is below this one's (its budget is quoted).
# Rule 4. Modules excluded from plans (unsafe to recompute, ``Profile.excluded``) are named with
#   the reason, here as when a plan succeeds.


def infeasible(profile: Profile, g: nx.DiGraph, budget_bytes: int, lowest_peak: int,
               headroom: float) -> BudgetInfeasible:
    """The ``BudgetInfeasible`` of NOTE [ Why nothing fits ] for ``g`` at ``budget_bytes``."""
    base = simulate(g, [])
    lowest = budget_with_headroom(lowest_peak, headroom)
    head = f"no checkpoint plan fits the budget of {budget_bytes} bytes ({format_bytes(budget_bytes)})"
    excluded = _excluded_text(profile)
    if lowest_peak >= base.peak_bytes:
        return BudgetInfeasible(
            f"{head}; no unit can lower this peak: {_why_no_unit(g, profile, base)}. The smallest feasible budget "
            f"is the peak without checkpointing plus the {headroom:.1%} headroom, {lowest} bytes "
            f"({format_bytes(lowest)}): raise {{budget}} or reduce the batch{excluded}",
            budget_bytes=budget_bytes, min_feasible_bytes=lowest, options=("budget",))
    finer = _finer_granularity(profile, g, lowest_peak, headroom)
    advice = "raise {budget}" + (f", use {{granularity}} {finer[0]} (its minimum feasible budget is {finer[1]} "
                                 f"bytes, {format_bytes(finer[1])})" if finer else "") + ", or reduce the batch"
    return BudgetInfeasible(
        f"{head}; the minimum feasible budget is {lowest} bytes ({format_bytes(lowest)}): {advice}{excluded}",
        budget_bytes=budget_bytes, min_feasible_bytes=lowest, options=("budget", "granularity"))


def _why_no_unit(g: nx.DiGraph, profile: Profile, base: Any) -> str:
    """Why checkpointing cannot lower the peak of ``g`` (Rule 2 of NOTE [ Why nothing fits ])."""
    where = f"the peak, {format_bytes(base.peak_bytes)}, is at {base.peak_at}"
    if profile.user_checkpointed:  # NOTE [ Checkpointed twice ]
        from planner.act.existing import user_checkpointed_text

        return f"{where}; {user_checkpointed_text(profile.user_checkpointed)}"
    if g.number_of_nodes() == 0 and profile.excluded:
        return f"every candidate module is excluded from plans; {where}"
    if g.number_of_nodes() == 0:
        return (f"the model has no module to checkpoint below its root (e.g. it is one fused op such as a "
                f"single nn.LSTM); {where}")
    if base.peak_at == "optimizer step":
        return f"{where}, when only parameters, gradients and optimizer state are alive"
    return (f"{where}, and no candidate frees memory there (their saved tensors are not alive at the peak, "
            f"or they save none, as a frozen module does)")


def _finer_granularity(profile: Profile, g: nx.DiGraph, lowest_peak: int, headroom: float) -> tuple[int, int] | None:
    """``(granularity, its minimum feasible budget)`` one level finer, when that level lowers the peak."""
    level = g.graph["granularity"] + 1
    finer = build_graph(profile, granularity=level, world_size=g.graph["world_size"], sharding=g.graph["sharding"])
    if set(finer.nodes) == set(g.nodes) or finer.number_of_nodes() == 0:
        return None
    peak = min_feasible_bytes(finer)
    return (level, budget_with_headroom(peak, headroom)) if peak < lowest_peak else None


def _excluded_text(profile: Profile) -> str:
    """``; 2 modules are excluded from plans: h.0 (why), ...`` (Rule 4), or nothing."""
    if not profile.excluded:
        return ""
    n = len(profile.excluded)
    shown = listed([f"{x.module or '<root>'} ({x.reason})" for x in profile.excluded])
    return f"; {n} module{'s are' if n > 1 else ' is'} excluded from plans: {shown}"


_WINDOWS = ("forward of ", "backward of ", "end of forward", "start of backward")
"""The probes of NOTE [ Peak-memory model ] that are measured windows of the step (``graph.window_peaks``)."""


def usable_budget(budget_bytes: int, headroom: float) -> tuple[int, int]:
    """``(usable bytes, headroom bytes)`` of a budget: a plan fits ``budget_bytes`` when its predicted peak is
    at most the usable bytes. The one place that decides what fits, for ``plan``, ``compare`` and
    ``frontier`` alike (NOTE [ Headroom from evidence ])."""
    if not 0 <= headroom < 0.5:
        raise BadInput(f"headroom must be a fraction in [0, 0.5), got {headroom}; e.g. 0.005 for 0.5%")
    headroom_bytes = int(budget_bytes * headroom)
    return budget_bytes - headroom_bytes, headroom_bytes


def budget_with_headroom(peak_bytes: int, headroom: float = DEFAULT_HEADROOM) -> int:
    """The smallest budget whose usable part (budget less its headroom) holds ``peak_bytes``."""
    b = max(1, int(peak_bytes / (1 - headroom)) - 2)
    while b - int(b * headroom) < peak_bytes:
        b += 1
    return b


def resolve_budget(budget: int | str | None, target: str | None = None) -> tuple[int, str]:
    """The budget in bytes and how to say it: ``budget`` parsed, or without it the usable memory
    of the device spec ``target`` (``usable_bytes``). An unknown ``target`` fails even with a
    budget, before any profiling."""
    from planner.profiling.devices import get_device, usable_bytes

    spec = get_device(target) if target is not None else None
    if budget is not None:
        try:
            return parse_bytes(budget), str(budget)
        except BadInput as e:
            raise BadInput(f"{{budget}}: {e}", options=("budget",)) from None
    if spec is None:
        raise BadInput("the plan needs a budget: give {budget} SIZE (e.g. 12GB), or {target} NAME to plan for a "
                       "device's usable memory (remat devices lists them)", options=("budget", "target"))
    return usable_bytes(spec), f"{spec.name} usable memory"


def check_profile_matches(profile: Profile, model_file: Any) -> None:
    """``PlanMismatch`` unless ``profile`` was made for the model and inputs of ``model_file`` (a
    ``ModelFile``). The model is built on the meta device: nothing runs, a 7B model costs nothing."""
    from planner.model.fingerprint import model_differences
    from planner.errors import PlanMismatch
    from planner.profiling.meta import build_on_meta

    diffs = model_differences(profile.fingerprint, build_on_meta(model_file.build_model), model_file.example_inputs(),
                              "profile")
    if diffs:
        raise PlanMismatch.listing("the profile was made for another model or input shapes", diffs, "re-profile it")


def plan(model_or_profile: Any, budget: int | str | None = None, *, inputs: Any = None,
         buckets: Sequence[Any] | None = None, step: StepSpec | None = None, solve: SolveSpec | None = None,
         **fields: Any) -> Plan:
    """Profile a model (unless given a ``Profile``) and plan for ``budget``.

    Args:
        model_or_profile: an ``nn.Module`` (then ``inputs`` or ``buckets`` is required), a model file
            (``planner.load_model_file``, which gives the inputs and the loss, or its path), a ``Profile``
            (or the path of one saved, a .json), or a
            list of profiles of one model at several input shapes (a bucketed plan). With device
            'meta', build the module with ``planner.profiling.meta.build_on_meta`` (no memory used).
        budget: bytes, or a string such as ``"12GB"`` (GB is read as GiB); None: the usable
            memory of ``step.target`` (``planner.profiling.devices.usable_bytes``).
        inputs: one training batch, as for ``planner.profile``.
        buckets: instead of ``inputs``, one training batch per input shape the job sees (e.g. 128,
            256 and 512 tokens): each is profiled and planned under ``budget``, and the plans go into
            one bucketed plan; ``apply_plan`` runs each batch under the smallest bucket that holds it
            (NOTE [ Bucketed plans ] in planner/act/buckets.py).
        step: the training step and where it runs (``planner.spec.StepSpec``: device, device
            memory cap, optimizer, recipe with amp, steps, threads, loss); its ``target`` gives the
            default budget on any device and the modelled times on 'meta' (see docs/meta.md).
        solve: how to plan (``planner.spec.SolveSpec``: solver, granularity, time limit, ranks,
            headroom, op-level regions).
        **fields: fields of either spec by name (``device="cpu"``, ``solver="ilp"``, ``progress``, ...).
    Returns:
        The ``Plan``; ``plan.save(path)`` writes it atomically.
    Raises:
        BudgetInfeasible: nothing fits; ``.min_feasible_bytes`` says what would.

    Example::

        plan = planner.plan(model, "2GB", inputs=batch, device="cpu", solver="ilp")
    """
    progress = fields.pop("progress", None)
    given = {k: v for k, v in fields.items() if k not in SOLVE_FIELDS}
    spec = step_spec(step, **given)  # BadInput naming an argument of neither spec
    solving = solve_spec(solve, **{k: v for k, v in fields.items() if k in SOLVE_FIELDS})
    budget, _ = resolve_budget(budget, spec.target)  # before minutes of profiling, not after
    n_shapes = len(model_or_profile) if isinstance(model_or_profile, (list, tuple)) else len(buckets or [None])
    check_offload_shapes(solving.offload, n_shapes)
    if isinstance(model_or_profile, (str, os.PathLike)):
        model_or_profile = _load_source(Path(model_or_profile))
    if isinstance(model_or_profile, (list, tuple)):
        profiles = list(model_or_profile)
    elif isinstance(model_or_profile, Profile):
        _refuse_step_fields(model_or_profile, inputs, {**_changed(step), **given})
        profiles = [model_or_profile]
    else:
        from planner.profiling import profile

        if (inputs is None) == (buckets is None) and not _is_model_file(model_or_profile):
            raise BadInput("plan(model, ...) needs inputs=<one training batch> or buckets=[<one batch per shape>]; "
                           "or pass a Profile")
        meta = str(spec.device).strip().lower() == "meta"
        run = spec if meta else spec.replace(target=None)
        profiles = [profile(model_or_profile, batch, step=run, progress=progress)
                    for batch in ([inputs] if buckets is None else buckets)]
        if profiles[0].compile is not None and buckets is None:  # NOTE [ The compiled plan is checked ]
            from planner.act.compiled_check import compiled_peak

            return plan_from_profile(profiles[0], budget, solve=solving, progress=progress,
                                     check=compiled_peak(model_or_profile, step=run, inputs=inputs, progress=progress))
    return plan_buckets(profiles, budget, solve=solving)


def as_profile(profile: Any, caller: str) -> Profile:
    """``profile`` itself, or the profile saved at that path; ``BadInput`` naming what ``caller`` takes otherwise
    (a plan, a dict or None used to end as "AttributeError: ... has no attribute 'device'")."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, (str, os.PathLike)) and not isinstance(profile, bytes):
        return Profile.load(profile)
    hint = "; a plan is made from the profile it was planned on" if isinstance(profile, Plan) else ""
    raise BadInput(f"{caller} takes a Profile (planner.profile(...), Profile.load(path)) or the path of a profile "
                   f"file, got {type(profile).__name__}{hint}")


def _load_source(path: Path) -> Any:
    """``plan("model.py", ...)`` or ``plan("profile.json", ...)``: the model file or the saved profile."""
    if path.suffix == ".py":
        from planner.profiling.model_file import load_model_file

        return load_model_file(path)
    return Profile.load(path)


def _is_model_file(obj: Any) -> bool:
    from planner.profiling.model_file import ModelFile

    return isinstance(obj, ModelFile)


def _changed(step: StepSpec | None) -> dict[str, Any]:
    """The fields of ``step`` that differ from ``StepSpec()``'s."""
    if step is None:
        return {}
    default = StepSpec()
    return {name: getattr(step, name) for name in STEP_FIELDS if getattr(step, name) != getattr(default, name)}


def _refuse_step_fields(prof: Profile, inputs: Any, given: dict[str, Any]) -> None:
    """``plan(profile, ...)`` plans the step the profile measured: refuse what would measure another."""
    ignored = ["inputs"] if inputs is not None else []
    for name, value in given.items():
        if name == "target" or value == getattr(StepSpec(), name):
            continue
        if name == "optimizer":
            if parse_optimizer(value) != parse_optimizer(from_file(prof.optimizer, "profile")):
                ignored.append(f"optimizer ({prof.optimizer} in the profile)")
        elif name == "recipe":
            if value != prof.recipe:
                ignored.append(f"recipe (the profile's: {prof.recipe.describe()})")
        elif name == "compile":
            if value != (prof.compile.backend if prof.compile else None):
                ignored.append(f"compile (the profile measured the {'compiled' if prof.compile else 'eager'} step)")
        else:
            ignored.append(name)
    if ignored:
        raise BadInput(f"plan(profile, ...) plans the step the profile measured; these arguments would change "
                       f"what is measured, and nothing is: {', '.join(ignored)}. Drop them, or profile again")


def plan_buckets(profiles: Sequence[Profile], budget: int | str, *, shapes: Sequence[dict[str, int]] | None = None,
                 **options: Any) -> Plan:
    """One plan per profile (one input shape each) under one ``budget``, as one bucketed plan
    (NOTE [ Bucketed plans ]); one profile gives its plan. ``shapes``: the ``example_inputs()``
    keyword arguments of each profile's batch. ``options``: those of ``plan_from_profile`` (``solve=``
    and its fields).
    Raises ``BudgetInfeasible`` naming the shape that does not fit."""
    from planner.act.buckets import combine

    if not profiles:
        raise BadInput("plan needs at least one profile")
    offload = options["solve"].offload if options.get("solve") is not None else options.get("offload", False)
    check_offload_shapes(bool(offload), len(profiles))
    shapes = list(shapes) if shapes is not None else [{} for _ in profiles]
    plans = []
    for prof, shape in zip(profiles, shapes):
        try:
            plans.append(plan_from_profile(prof, budget, **options))
        except BudgetInfeasible as e:
            if len(profiles) == 1:
                raise
            what = ", ".join(f"{k} {v}" for k, v in shape.items()) or ", ".join(
                f"{s.name} {s.shape}" for s in prof.fingerprint.inputs)
            raise BudgetInfeasible(f"at {what}: {e.template}", budget_bytes=e.budget_bytes,
                                   min_feasible_bytes=e.min_feasible_bytes, options=e.options) from None
    return combine(plans, shapes)


def selective_regions(g: nx.DiGraph, selective: dict[str, int]) -> list[SelectiveRegion]:
    """The plan's ``selective`` entries for the solver's {node: menu index}."""
    from solvers.selective import describe

    out = []
    for n, k in selective.items():
        pol = g.nodes[n]["menu"][k]
        out.append(SelectiveRegion(fqn=g.nodes[n]["fqn"], unit=n, save=[OpRef(op=o, index=i) for o, i in pol.saved],
                                   summary=describe(pol), recompute_ms=round(pol.recompute_ms, 6),
                                   kept_bytes=pol.kept_bytes, keeps_written=pol.keeps_written))
    return out


def _fqns(g: nx.DiGraph, chosen) -> list[str]:
    seen: list[str] = []
    for n in chosen:
        f = g.nodes[n]["fqn"]
        if f not in seen:
            seen.append(f)
    return seen


def _version() -> str:
    from planner import __version__

    return __version__


__all__ = ["AMP_HEADROOM", "budget_with_headroom", "canonical", "check_profile_matches", "check_ranks",
           "DEFAULT_HEADROOM", "difference_spread_ms", "graph_for", "headroom_for", "infeasible",
           "META_HEADROOM", "MULTI_RANK_SELECTIVE", "NESTING_SOLVERS", "plan", "plan_buckets",
           "plan_from_profile", "plan_of", "resolve_budget", "selective_regions", "solve_graph", "usable_budget"]
