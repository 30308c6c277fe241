"""Solvers: pure functions over the candidate graph. No torch import.

The contract every solver meets::

    solve(graph, budget_bytes, *, time_limit_s=None) -> Solution

- ``graph`` is built by ``planner.model.graph.build_graph``; solvers read node attributes by name.
- The returned checkpoint set is an antichain of graph node ids (see
  ``solvers.cost_model.check_checkpoint_set``).
- ``status == "optimal"``: no other valid checkpoint set fits ``budget_bytes`` with less
  recompute under ``solvers.cost_model.simulate`` (see NOTE [ Peak-memory model ]).
  ``"feasible"``: it fits, optimality not proven. ``"infeasible"``: nothing this solver found
  fits; ``min_feasible_bytes`` then says what would.
- A plan whose status is not ``"infeasible"`` is never over budget under ``simulate``.

``SOLVERS`` maps the CLI names to these functions; ``solve(name, ...)`` dispatches.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from solvers.base import Solution

# ``SOLVERS``, ``Solution`` and ``available`` load on first use (PEP 562), so importing one
# torch-free piece (``solvers.cost_model``, ``solvers.errors``) does not import PuLP.


@functools.cache
def _registry() -> dict[str, Callable[..., Solution]]:
    from solvers.auto import solve_auto
    from solvers.baselines import solve_all, solve_every_k, solve_none
    from solvers.dp import solve as solve_dp
    from solvers.ilp import solve as solve_ilp
    from solvers.sqrt_n import solve as solve_sqrt
    from solvers.sqrt_n import solve_greedy as solve_sqrt_greedy

    return {
        "dp": solve_dp,
        "ilp": solve_ilp,
        "auto": solve_auto,
        "sqrt": solve_sqrt,
        "sqrt-greedy": solve_sqrt_greedy,
        "all": solve_all,
        "every-2": lambda g, b, **kw: solve_every_k(g, b, k=2, **kw),
        "none": solve_none,
    }


def available() -> list[str]:
    """Solver names, 'auto' first, each once."""
    return list(dict.fromkeys(["auto", *_registry()]))


def __getattr__(name: str):
    if name == "SOLVERS":
        return _registry()
    if name == "Solution":
        from solvers.base import Solution

        return Solution
    raise AttributeError(f"module 'solvers' has no attribute {name!r}")


__all__ = ["SOLVERS", "Solution", "available"]
