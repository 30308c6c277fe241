"""Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", on module units.

Chen keeps a few activations ("checkpoints" in the paper) and recomputes the rest; here a
unit either keeps its saved tensors or is recomputed (checkpointed, in PyTorch's wording).

- ``solve``: the sqrt(n) rule: cut the n top-level units into ceil(sqrt(n)) segments and keep
  the last unit of each segment; recompute the others.
- ``solve_greedy``: the paper's budget-driven variant (its Algorithm 1 with a search over the
  threshold b): walk the units accumulating their saved bytes; a unit that takes the running
  sum over b is kept and resets it, the others are recomputed. Every distinct threshold is
  tried and the plan with the least recompute that fits the budget under ``simulate`` wins.

Neither is optimal under the cost model; the status is ``feasible`` when the plan fits.
O(n) per plan; the greedy variant evaluates O(n) thresholds, O(n S log S) in all.

Example::

    solve(graph, 2 << 30)                      # Chen et al.: about sqrt(n) evenly spaced blocks
"""

from __future__ import annotations

import math
import time

import networkx as nx

from solvers.base import Solution, judged, top_level


def solve(g: nx.DiGraph, budget_bytes: int, **_: object) -> Solution:
    t0 = time.perf_counter()
    units = top_level(g)
    n = len(units)
    seg = max(1, math.ceil(math.sqrt(n))) if n else 1
    chosen = [u for i, u in enumerate(units) if (i + 1) % seg != 0 and i != n - 1]
    return judged("sqrt", g, chosen, budget_bytes, time.perf_counter() - t0, detail=f"segment length {seg}")


def _chen_threshold(g: nx.DiGraph, units: list[str], b: int) -> list[str]:
    chosen, temp = [], 0
    for u in units:
        temp += g.nodes[u]["saved_bytes"]
        if temp > b:
            temp = 0
        else:
            chosen.append(u)
    return chosen


def solve_greedy(g: nx.DiGraph, budget_bytes: int, **_: object) -> Solution:
    t0 = time.perf_counter()
    units = top_level(g)
    sizes = sorted({g.nodes[u]["saved_bytes"] for u in units})
    prefix, thresholds = 0, {-1}
    for s in sizes:
        prefix += s
        thresholds.update((s, prefix))
    best: Solution | None = None
    seen: set[tuple[str, ...]] = set()
    for b in sorted(thresholds):
        chosen = tuple(_chen_threshold(g, units, b))
        if chosen in seen:
            continue
        seen.add(chosen)
        sol = judged("sqrt-greedy", g, chosen, budget_bytes, 0.0, detail=f"threshold {b} bytes")
        if sol.status == "infeasible":
            continue
        if best is None or (sol.recompute_ms, sol.peak_bytes) < (best.recompute_ms, best.peak_bytes):
            best = sol
    if best is None:  # nothing fits: report the lowest-peak attempt
        best = judged("sqrt-greedy", g, units, budget_bytes, 0.0)
    return Solution(**{**best.__dict__, "seconds": time.perf_counter() - t0})


__all__ = ["solve", "solve_greedy"]
