"""The ``Solution`` every solver returns, and helpers shared by the solvers.

Example::

    sol = SOLVERS["dp"](graph, 2 << 30)
    sol.status, sol.checkpointed, sol.peak_bytes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import networkx as nx

from solvers.contract import Status, StopReason
from solvers.cost_model import close_ties, simulate


@dataclass(frozen=True)
class Solution:
    """What a solver found. ``checkpointed`` is in forward order; ``stopped`` says why the solver
    stopped (``detail`` says it in words, for people: no caller reads it)."""

    solver: str
    checkpointed: tuple[str, ...]
    status: Status
    seconds: float
    peak_bytes: int
    recompute_ms: float
    gap: float | None = None
    min_feasible_bytes: int | None = None
    detail: str = ""
    extra: dict = field(default_factory=dict)
    selective: dict[str, int] = field(default_factory=dict)
    """Selective regions: node id -> index into its ``menu`` (op-level policies)."""
    stopped: StopReason = "finished"
    offloaded: tuple[str, ...] = ()
    """Offloaded units, forward order (NOTE [ Peak-memory model ], Rule 10)."""
    offload_ms: float = 0.0
    """Their exposed copy time per step; the solvers minimise recompute_ms + offload_ms."""
    host_peak_bytes: int = 0


def top_level(g: nx.DiGraph) -> list[str]:
    """Graph nodes without a graph parent, in forward order."""
    return sorted((n for n, a in g.nodes(data=True) if a["parent"] is None), key=lambda n: g.nodes[n]["order"])


def judged(name: str, g: nx.DiGraph, chosen: Iterable[str], budget_bytes: int, seconds: float,
           *, status_if_fits: Status = "feasible", detail: str = "",
           selective: dict[str, int] | None = None) -> Solution:
    """A ``Solution`` for ``chosen`` (and ``selective`` regions) as ``simulate`` sees it:
    infeasible when over budget.

    ``chosen`` is first extended to every call of the modules it names (``close_ties``): what
    the applier would run. The exact solvers choose tied sets themselves; for the heuristics,
    which pick calls by position, this is their plan as it would train.
    """
    return judged_offload(name, g, (chosen, selective, ()), budget_bytes, seconds, status_if_fits=status_if_fits,
                          detail=detail)


def judged_offload(name: str, g: nx.DiGraph, plan: tuple[Iterable[str], dict[str, int] | None, Iterable[str]],
                   budget_bytes: int, seconds: float, *, status_if_fits: Status = "feasible", detail: str = "",
                   host_budget_bytes: int | None = None) -> Solution:
    """``judged`` for ``plan`` = (checkpointed, selective, offloaded): infeasible also when its host
    memory is over ``host_budget_bytes`` (NOTE [ Peak-memory model ], Rule 10)."""
    chosen, selective, offloaded = plan
    est = simulate(g, close_ties(g, chosen), selective, offloaded)
    fits = est.peak_bytes <= budget_bytes and (host_budget_bytes is None or est.host_peak_bytes <= host_budget_bytes)
    return Solution(
        solver=name, checkpointed=tuple(est.checkpointed), status=status_if_fits if fits else "infeasible",
        seconds=seconds, peak_bytes=est.peak_bytes, recompute_ms=est.recompute_ms, detail=detail,
        selective=dict(est.selective), offloaded=tuple(est.offloaded), offload_ms=est.offload_ms,
        host_peak_bytes=est.host_peak_bytes,
    )


__all__ = ["judged", "judged_offload", "Solution", "top_level"]
