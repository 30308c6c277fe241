"""The one validator every solver goes through, and the brute-force oracle."""

from __future__ import annotations

import itertools

import networkx as nx

from solvers.cost_model import check_checkpoint_set, simulate
from solvers.base import Solution


def check_solution(g: nx.DiGraph, sol: Solution, budget_bytes: int) -> None:
    """Contract of ``solvers/__init__.py``; the message names the solver that broke it."""
    who = f"solver {sol.solver!r}"
    assert sol.status in ("optimal", "feasible", "infeasible"), f"{who}: bad status {sol.status}"
    check_checkpoint_set(g, sol.checkpointed, sol.selective)
    est = simulate(g, sol.checkpointed, sol.selective)
    assert est.peak_bytes == sol.peak_bytes, f"{who}: reports peak {sol.peak_bytes}, simulate says {est.peak_bytes}"
    assert abs(est.recompute_ms - sol.recompute_ms) <= 1e-9 * max(1.0, est.recompute_ms), f"{who}: recompute"
    if sol.status != "infeasible":
        assert est.peak_bytes <= budget_bytes, (
            f"{who}: plan is over budget: {est.peak_bytes} > {budget_bytes} ({sol.status})")
    orders = [g.nodes[n]["order"] for n in sol.checkpointed]
    assert orders == sorted(orders), f"{who}: checkpointed not in forward order"


def antichains(g: nx.DiGraph):
    """Every valid checkpoint set (antichains of the candidate tree)."""
    nodes = sorted(g.nodes, key=lambda n: g.nodes[n]["order"])
    for bits in itertools.product((0, 1), repeat=len(nodes)):
        chosen = [n for n, b in zip(nodes, bits) if b]
        try:
            check_checkpoint_set(g, chosen)
        except Exception:
            continue
        yield chosen


def brute_force(g: nx.DiGraph):
    """(peak_bytes, recompute_ms) of every valid checkpoint set."""
    return [(e.peak_bytes, e.recompute_ms) for e in (simulate(g, c) for c in antichains(g))]


def best_recompute(points, budget_bytes: int) -> float | None:
    feasible = [r for p, r in points if p <= budget_bytes]
    return min(feasible) if feasible else None
