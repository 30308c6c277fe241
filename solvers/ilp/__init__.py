"""Optimal checkpoint sets on any graph (DAGs, nested candidates): an exact integer program.

The program is NOTE [ Peak-memory model ] (``solvers/cost_model.py``) written linearly, with
nothing approximated: a checkpoint set fits the budget in the program iff it fits under
``simulate`` (NOTE [ ILP formulation ] above ``build_program``; ``tests/test_ilp.py`` compares
every probe).

One module per concern:

- ``program``: NOTE [ ILP formulation ], the program as plain data (``build_program``,
  ``probe_values``);
- ``model``: the program as a PuLP problem (``build_model``);
- ``backends``: HiGHS and CBC through PuLP, one solve each (``solve_model``);
- ``bound``: NOTE [ Sequential relaxation ], a lower bound on recompute and often the optimum;
- ``steps``: ``solve``, the steps from a budget to a ``Solution``.

Example::

    from solvers.ilp import solve
    sol = solve(g, budget_bytes, time_limit_s=30, backend="highs")
"""

from solvers.ilp.backends import CBC_TERM_BITS, DEFAULT_BACKEND, Backend
from solvers.ilp.model import IlpModel, build_model
from solvers.ilp.program import Program, Probe, build_program, offload_var, probe_values
from solvers.ilp.steps import solve

__all__ = ["Backend", "CBC_TERM_BITS", "DEFAULT_BACKEND", "IlpModel", "Probe", "Program", "build_model",
           "build_program", "offload_var", "probe_values", "solve"]
