"""The memory/recompute trade-off: solvers and baselines swept over budgets, or side by side.

``frontier`` sweeps budgets from the minimum feasible peak to the no-checkpoint peak; the
profile and graph are built once and the DP's chain recurrence is computed once (cached on the
graph), so a sweep costs little more than one plan. ``compare`` is one budget, every solver.
With a host budget (``remat frontier --offload``) the sweep is three-way: one more series, the
ILP choosing keep, recompute or offload per unit (``OFFLOAD_SERIES``), and one more baseline,
every layer offloaded (``OFFLOAD_BASELINE``); the budgets start at the lower of the two lowest
feasible peaks, and every point's cost is its overhead (recompute plus exposed copies).

Example::

    g = sweep_graph(Profile.load("profile.json"))
    points = frontier(g, points=12)          # every solver and baseline at 12 budgets
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Literal

import networkx as nx
from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from planner.act.api import budget_with_headroom, graph_for, min_feasible_bytes, usable_budget
from planner.errors import BadInput
from planner.model.schema import Profile
from solvers.contract import Status
from solvers.cost_model import simulate

BASELINES = ("none", "all", "every-2", "every-3", "every-4")
"""Fixed rules: nothing, every layer (Hugging Face's gradient_checkpointing_enable), every k-th layer
(torchtitan's selective option)."""

OPTIMAL_SOLVERS = ("auto", "ilp", "dp")
"""Solvers that minimise recompute under the budget; the sweep's frontier is drawn from one of them."""

OFFLOAD_SERIES = "ilp+offload"
"""The three-way series of ``remat frontier --offload``: the ILP choosing keep, recompute or offload per
unit within the host budget (NOTE [ ILP formulation ], Rule 8), minimising recompute plus exposed copies."""
OFFLOAD_BASELINE = "offload-all"
"""Every repeated block offloaded, nothing recomputed: what ``save_on_cpu`` around every layer does."""


class _OffloadFieldsOptional(BaseModel):
    """Leaves its ``_OFFLOAD_FIELDS`` out of the JSON when None: a sweep without offload is written as before."""

    _OFFLOAD_FIELDS: tuple[str, ...] = ()

    @model_serializer(mode="wrap")
    def _drop_unset_offload(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        for key in self._OFFLOAD_FIELDS:
            if data.get(key, 0) is None:
                del data[key]
        return data


class FrontierPoint(_OffloadFieldsOptional):
    _OFFLOAD_FIELDS = ("offload_ms", "offloaded", "host_peak_bytes")

    solver: str
    budget_bytes: int
    peak_bytes: int = Field(description="Predicted peak of the solver's plan (also when over budget).")
    recompute_ms: float
    status: Status
    checkpointed: int = Field(description="Number of checkpointed units, selective regions included.")
    offload_ms: float | None = Field(None, description="Exposed copy time of the offloaded units per step "
                                                       "(sweeps with --offload only).")
    offloaded: int | None = Field(None, description="Number of offloaded units (sweeps with --offload only).")
    host_peak_bytes: int | None = Field(None, description="Host memory the offloaded tensors take "
                                                          "(sweeps with --offload only).")

    @property
    def overhead_ms(self) -> float:
        """What the plan adds to the step: its recompute and its exposed copies."""
        return self.recompute_ms + (self.offload_ms or 0.0)


class Tradeoff(_OffloadFieldsOptional):
    """A sweep (``frontier``) or a side-by-side (``compare``) with what it is relative to: what
    ``remat frontier -o`` and ``remat compare --json`` write."""

    kind: Literal["remat-frontier", "remat-compare"]
    model: str = Field(description="Model class the profile was made for.")
    device: str = Field(description="Device the profile was measured (or modelled) on.")
    budget_bytes: int | None = Field(None, description="The one budget of a comparison; None for a sweep.")
    no_checkpoint_peak_bytes: int = Field(description="Predicted peak without checkpointing.")
    min_feasible_bytes: int = Field(description="Lowest predicted peak of any checkpoint set.")
    step_ms: float = Field(description="Predicted step without recompute; recompute_ms is relative to it.")
    headroom: float = Field(0.0, description="Part of each budget kept free, as remat plan keeps it: a point fits "
                                             "when its peak is within the budget less this share.")
    optimal_solver: str | None = Field(None, description="The solver whose points are the frontier.")
    seconds: float = Field(0.0, description="Wall-clock seconds the solvers took, all points together.")
    host_budget_bytes: int | None = Field(None, description="The host memory offloaded tensors may take (sweeps "
                                                            "with --offload only).")
    offload_min_feasible_bytes: int | None = Field(None, description="Lowest predicted peak with offload within "
                                                                     "the host budget (sweeps with --offload only).")
    points: list[FrontierPoint]

    _OFFLOAD_FIELDS = ("host_budget_bytes", "offload_min_feasible_bytes")


def tradeoff(g: nx.DiGraph, points: list[FrontierPoint], *, kind: str, model: str, device: str,
             budget_bytes: int | None = None, seconds: float = 0.0, headroom: float = 0.0) -> Tradeoff:
    """Wrap ``frontier``/``compare`` output with the no-checkpoint peak, the minimum and the step time."""
    base = simulate(g, [])
    optimal = next((p.solver for p in points if p.solver in OPTIMAL_SOLVERS), None)
    return Tradeoff(kind=kind, model=model, device=device, budget_bytes=budget_bytes,
                    no_checkpoint_peak_bytes=base.peak_bytes, min_feasible_bytes=min_feasible_bytes(g),
                    step_ms=round(base.step_ms, 6), optimal_solver=optimal, seconds=round(seconds, 6),
                    headroom=headroom, points=points)


def with_offload(report: Tradeoff, g: nx.DiGraph, host_budget_bytes: int | None, *,
                 time_limit_s: float | None = 30.0) -> Tradeoff:
    """``report`` of a sweep with ``host_budget_bytes`` (``frontier --offload``): the host budget and
    offload's lowest peak added; unchanged without one."""
    if host_budget_bytes is None:
        return report
    lowest = offload_min_feasible_bytes(g, host_budget_bytes, time_limit_s=time_limit_s)
    return report.model_copy(update={"host_budget_bytes": host_budget_bytes, "offload_min_feasible_bytes": lowest})


_LOWEST_SEARCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _lowest_peak_search(g: nx.DiGraph, host_budget_bytes: int | None, time_limit_s: float | None) -> tuple[int, object]:
    """The ILP's minimum-peak search on ``g``: a solve asked for half the lowest peak ``min_feasible_bytes``
    bounds, which no plan fits, so the ILP minimises the peak. That bound and the search's solution, cached per
    graph, host budget and time limit (a plan's summary and the offload frontier ask again for the same graph)."""
    cache = _LOWEST_SEARCHES.setdefault(g, {})
    key = (host_budget_bytes, time_limit_s)
    if key not in cache:
        from planner.act.api import solve_graph

        upper = min_feasible_bytes(g)
        cache[key] = upper, solve_graph(g, max(1, upper // 2), solver="ilp", time_limit_s=time_limit_s,
                                        host_budget_bytes=host_budget_bytes)
    return cache[key]


def offload_min_feasible_bytes(g: nx.DiGraph, host_budget_bytes: int, *, time_limit_s: float | None = 30.0) -> int:
    """The lowest peak of any keep/recompute/offload plan within ``host_budget_bytes`` (the ILP's
    minimum-peak search, as when no plan fits; cached per graph and host budget)."""
    lowest, sol = _lowest_peak_search(g, host_budget_bytes, time_limit_s)
    found = sol.min_feasible_bytes if sol.status == "infeasible" else sol.peak_bytes
    return min(lowest, found) if found is not None else lowest


LOWEST_PEAK_SEARCH_S = 5.0
"""Seconds the ILP's minimum-peak search may take for a plan's "lowest feasible" figure (``proven_lowest_peak``)."""


def proven_lowest_peak(g: nx.DiGraph, sol: object, *, offload: bool) -> int | None:
    """The lowest peak any plan of ``g`` reaches, for a plan's summary ("lowest feasible"): the solver's own where
    it gave one (the DP computes it with its plan), else, for the ILP's plans without offload, the ILP's
    minimum-peak search where it proves it within ``LOWEST_PEAK_SEARCH_S`` (0.05 to 0.25 s of CPU time on
    five zoo models); None otherwise, since a bound found in time is not the lowest. Why: the ILP's plans
    printed no "lowest feasible" (round 25 probe: 7 of 13 zoo plans), so a user had to ask for a budget
    nothing fits to learn it."""
    given = getattr(sol, "min_feasible_bytes", None)
    if given is not None or getattr(sol, "solver", None) != "ilp" or offload:
        return given
    _, search = _lowest_peak_search(g, None, LOWEST_PEAK_SEARCH_S)
    return search.min_feasible_bytes if search.status == "infeasible" and search.stopped == "finished" else None


def default_solvers() -> list[str]:
    from solvers import SOLVERS

    optimal = [s for s in OPTIMAL_SOLVERS if s in SOLVERS]
    return optimal[:1] + [s for s in ("sqrt-greedy", "sqrt") if s in SOLVERS]


def sweep_graph(profile: Profile, solvers: list[str] | None = None, *, granularity: int = 0, world_size: int = 1,
                sharding: str = "none") -> nx.DiGraph:
    """One candidate graph for all ``solvers`` of a sweep (None: ``default_solvers()``): nested
    only when every solver handles it. ``BadInput`` when the DP is asked to plan nested candidates."""
    names = solvers if solvers is not None else default_solvers()
    optimal = next((n for n in names if n in OPTIMAL_SOLVERS), "dp")
    graph = graph_for(profile, solver=optimal, granularity=granularity, world_size=world_size, sharding=sharding)
    if "dp" in names and any(not a["leaf"] for _, a in graph.nodes(data=True)):  # the DP runs on chains
        raise BadInput(f"{{granularity}} {granularity} with {optimal} gives nested candidates, which dp cannot "
                       f"plan; drop dp from {{solvers}} or use {{granularity}} 0", options=("granularity", "solvers"))
    return graph


def run_solver(g: nx.DiGraph, name: str, budget_bytes: int, *, time_limit_s: float | None = None,
               headroom: float = 0.0, host_budget_bytes: int | None = None) -> FrontierPoint:
    """One solver or baseline at one budget, as a ``FrontierPoint``: a plan fits when its peak is within the
    budget less ``headroom`` (``usable_budget``, as ``remat plan`` decides). ``host_budget_bytes``: the
    sweep offloads (``OFFLOAD_SERIES`` and ``OFFLOAD_BASELINE`` need it; every point gets the offload fields)."""
    from planner.act.api import solve_graph
    from solvers import SOLVERS
    from solvers.base import judged_offload
    from solvers.baselines import solve_every_k

    usable, _ = usable_budget(budget_bytes, headroom)
    if name in (OFFLOAD_SERIES, OFFLOAD_BASELINE) and host_budget_bytes is None:
        raise BadInput(f"{name} offloads: it needs a host budget ({{offload}})", options=("offload",))
    if name == OFFLOAD_SERIES:
        sol = solve_graph(g, usable, solver="ilp", time_limit_s=time_limit_s, host_budget_bytes=host_budget_bytes)
    elif name == OFFLOAD_BASELINE:
        sol = judged_offload(name, g, ([], None, offloadable_blocks(g)), usable, 0.0,
                             host_budget_bytes=host_budget_bytes)
    elif name.startswith("every-") and name not in SOLVERS:
        sol = solve_every_k(g, usable, k=int(name.split("-", 1)[1]))
    else:
        sol = solve_graph(g, usable, solver=name, time_limit_s=time_limit_s)
    est = simulate(g, sol.checkpointed, sol.selective, sol.offloaded)  # the whole plan: regions, offloads
    offload = {} if host_budget_bytes is None else {
        "offload_ms": round(est.offload_ms, 6), "offloaded": len(est.offloaded), "host_peak_bytes": est.host_peak_bytes}
    return FrontierPoint(solver=name, budget_bytes=budget_bytes, peak_bytes=est.peak_bytes,
                         recompute_ms=round(est.recompute_ms, 6), status=sol.status,
                         checkpointed=len(sol.checkpointed) + len(sol.selective), **offload)


def offloadable_blocks(g: nx.DiGraph) -> list[str]:
    """``OFFLOAD_BASELINE``'s units: the repeated blocks (``indexed_blocks``) that save something and are
    called once (tied calls are never offloaded, NOTE [ Peak-memory model ], Rule 10)."""
    from solvers.baselines import indexed_blocks
    from solvers.cost_model import CostModel, tie_groups

    model = CostModel.of(g)
    tied = {n for group in tie_groups(g) for n in group}
    return [n for n in indexed_blocks(g) if n not in tied and model.offload_bytes(n) > 0]


def budgets(g: nx.DiGraph, points: int, headroom: float = 0.0, lowest_bytes: int | None = None) -> list[int]:
    """``points`` budgets evenly spaced from the one that holds the minimum feasible peak (or
    ``lowest_bytes``: offload's) to the one that holds the no-checkpoint peak, each with ``headroom``
    kept free (``budget_with_headroom``)."""
    lo, hi = lowest_bytes if lowest_bytes is not None else min_feasible_bytes(g), simulate(g, []).peak_bytes
    peaks = [hi] if points <= 1 or hi <= lo else sorted({lo + (hi - lo) * i // (points - 1) for i in range(points)})
    return sorted({budget_with_headroom(p, headroom) for p in peaks})


def frontier(g: nx.DiGraph, *, points: int = 12, solvers: Iterable[str] | None = None,
             baselines: Iterable[str] = BASELINES, time_limit_s: float | None = 30.0, headroom: float = 0.0,
             progress: Callable[[int, int], None] | None = None,
             host_budget_bytes: int | None = None) -> list[FrontierPoint]:
    """Every solver and baseline at every budget of ``budgets(g, points, headroom)``; with
    ``host_budget_bytes``, the three-way sweep (``OFFLOAD_SERIES``, ``OFFLOAD_BASELINE``) from offload's
    lowest feasible peak."""
    names = list(solvers if solvers is not None else default_solvers())
    lowest = None
    if host_budget_bytes is not None:
        names.append(OFFLOAD_SERIES)
        lowest = offload_min_feasible_bytes(g, host_budget_bytes, time_limit_s=time_limit_s)
    names += list(baselines) + ([OFFLOAD_BASELINE] if host_budget_bytes is not None else [])
    grid = budgets(g, points, headroom, lowest)
    out, total = [], len(grid) * len(names)
    for i, b in enumerate(grid):
        for j, name in enumerate(names):
            out.append(run_solver(g, name, b, time_limit_s=time_limit_s, headroom=headroom,
                                  host_budget_bytes=host_budget_bytes))
            if progress:
                progress(i * len(names) + j + 1, total)
    return out


def compare(g: nx.DiGraph, budget_bytes: int, *, solvers: Iterable[str] | None = None,
            baselines: Iterable[str] = BASELINES, time_limit_s: float | None = 30.0,
            headroom: float = 0.0) -> list[FrontierPoint]:
    """All solvers and baselines side by side at one budget, ``headroom`` of it kept free."""
    names = list(solvers if solvers is not None else default_solvers()) + list(baselines)
    return [run_solver(g, n, budget_bytes, time_limit_s=time_limit_s, headroom=headroom) for n in names]


__all__ = ["BASELINES", "budgets", "compare", "default_solvers", "frontier", "FrontierPoint", "OFFLOAD_BASELINE",
           "OFFLOAD_SERIES", "offload_min_feasible_bytes", "offloadable_blocks", "OPTIMAL_SOLVERS", "run_solver",
           "sweep_graph", "Tradeoff", "tradeoff", "with_offload"]
