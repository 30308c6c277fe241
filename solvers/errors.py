"""The root of remat's error types, torch-free so that solvers and the cost model can raise them.

``planner.errors`` re-exports both and adds the rest; the CLI turns any ``RematError`` into one
line on stderr and its ``exit_code``.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with: 2 bad input, 1 plan/verify failed."""

    exit_code = 2


class SolverError(RematError):
    """An unknown solver, or a solver that cannot handle this graph."""
