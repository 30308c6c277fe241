"""The memory/recompute trade-off: solvers and baselines swept over budgets, or side by side.

``frontier`` sweeps budgets from the minimum feasible peak to the no-checkpoint peak; the
profile and graph are built once and the DP's chain recurrence is computed once (cached on the
graph), so a sweep costs little more than one plan. ``compare`` is one budget, every solver.

Example::

    g = sweep_graph(Profile.load("profile.json"))
    points = frontier(g, points=12)          # every solver and baseline at 12 budgets
"""

from __future__ import annotations

from typing import Callable, Iterable, Literal

import networkx as nx
from pydantic import BaseModel, Field

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


class FrontierPoint(BaseModel):
    solver: str
    budget_bytes: int
    peak_bytes: int = Field(description="Predicted peak of the solver's plan (also when over budget).")
    recompute_ms: float
    status: Status
    checkpointed: int = Field(description="Number of checkpointed units, selective regions included.")


class Tradeoff(BaseModel):
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
    points: list[FrontierPoint]


def tradeoff(g: nx.DiGraph, points: list[FrontierPoint], *, kind: str, model: str, device: str,
             budget_bytes: int | None = None, seconds: float = 0.0, headroom: float = 0.0) -> Tradeoff:
    """Wrap ``frontier``/``compare`` output with the no-checkpoint peak, the minimum and the step time."""
    base = simulate(g, [])
    optimal = next((p.solver for p in points if p.solver in OPTIMAL_SOLVERS), None)
    return Tradeoff(kind=kind, model=model, device=device, budget_bytes=budget_bytes,
                    no_checkpoint_peak_bytes=base.peak_bytes, min_feasible_bytes=min_feasible_bytes(g),
                    step_ms=round(base.step_ms, 6), optimal_solver=optimal, seconds=round(seconds, 6), headroom=headroom,
                    points=points)


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
               headroom: float = 0.0) -> FrontierPoint:
    """One solver or baseline at one budget, as a ``FrontierPoint``: a plan fits when its peak is within the
    budget less ``headroom`` (``usable_budget``, as ``remat plan`` decides)."""
    from solvers import SOLVERS
    from solvers.baselines import solve_every_k

    usable, _ = usable_budget(budget_bytes, headroom)
    if name.startswith("every-") and name not in SOLVERS:
        sol = solve_every_k(g, usable, k=int(name.split("-", 1)[1]))
    else:
        from planner.act.api import solve_graph

        sol = solve_graph(g, usable, solver=name, time_limit_s=time_limit_s)
    est = simulate(g, sol.checkpointed, sol.selective)  # selective regions are part of the plan
    return FrontierPoint(solver=name, budget_bytes=budget_bytes, peak_bytes=est.peak_bytes,
                         recompute_ms=round(est.recompute_ms, 6), status=sol.status,
                         checkpointed=len(sol.checkpointed) + len(sol.selective))


def budgets(g: nx.DiGraph, points: int, headroom: float = 0.0) -> list[int]:
    """``points`` budgets evenly spaced from the one that holds the minimum feasible peak to the one that
    holds the no-checkpoint peak, each with ``headroom`` kept free (``budget_with_headroom``)."""
    lo, hi = min_feasible_bytes(g), simulate(g, []).peak_bytes
    peaks = [hi] if points <= 1 or hi <= lo else sorted({lo + (hi - lo) * i // (points - 1) for i in range(points)})
    return sorted({budget_with_headroom(p, headroom) for p in peaks})


def frontier(g: nx.DiGraph, *, points: int = 12, solvers: Iterable[str] | None = None,
             baselines: Iterable[str] = BASELINES, time_limit_s: float | None = 30.0, headroom: float = 0.0,
             progress: Callable[[int, int], None] | None = None) -> list[FrontierPoint]:
    """Every solver and baseline at every budget of ``budgets(g, points, headroom)``."""
    names = list(solvers if solvers is not None else default_solvers()) + list(baselines)
    grid = budgets(g, points, headroom)
    out, total = [], len(grid) * len(names)
    for i, b in enumerate(grid):
        for j, name in enumerate(names):
            out.append(run_solver(g, name, b, time_limit_s=time_limit_s, headroom=headroom))
            if progress:
                progress(i * len(names) + j + 1, total)
    return out


def compare(g: nx.DiGraph, budget_bytes: int, *, solvers: Iterable[str] | None = None,
            baselines: Iterable[str] = BASELINES, time_limit_s: float | None = 30.0,
            headroom: float = 0.0) -> list[FrontierPoint]:
    """All solvers and baselines side by side at one budget, ``headroom`` of it kept free."""
    names = list(solvers if solvers is not None else default_solvers()) + list(baselines)
    return [run_solver(g, n, budget_bytes, time_limit_s=time_limit_s, headroom=headroom) for n in names]


__all__ = ["BASELINES", "budgets", "compare", "default_solvers", "frontier", "FrontierPoint",
           "OPTIMAL_SOLVERS", "run_solver", "sweep_graph", "Tradeoff", "tradeoff"]
