"""A ``Program`` (NOTE [ ILP formulation ]) as a PuLP problem, reusable across objectives and caps.

Example::

    model = build_model(g, budget_bytes)      # min recompute, P <= budget
    model.set_cap(None)                       # lift the cap
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import networkx as nx
import pulp

from solvers.ilp.program import Lin, Program, build_program


def _variable(prob: pulp.LpProblem, name: str, low: float | None, up: float | None = None,
              cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    """A new variable: PuLP 3's ``add_variable`` (PuLP 4 requires it), ``LpVariable`` before."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat)
    return pulp.LpVariable(name, low, up, cat)


def row_named(prob: pulp.LpProblem, name: str) -> pulp.LpConstraint | None:
    """A row by name: PuLP 3's ``get_constraint_by_name``, the constraints dict before."""
    if hasattr(prob, "get_constraint_by_name"):
        return prob.get_constraint_by_name(name)
    return prob.constraints.get(name)


def _sanitize(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", s)


@dataclass
class IlpModel:
    """A ``Program`` as a PuLP problem, reusable across objectives and caps."""

    program: Program
    prob: pulp.LpProblem
    x: dict[str, pulp.LpVariable]
    peak: pulp.LpVariable
    recompute: pulp.LpAffineExpression
    stats: dict

    def set_cap(self, cap_bytes: int | None) -> None:
        """P <= cap (None: no cap). Probes are whole bytes: half a byte of slack is exact."""
        self.peak.upBound = None if cap_bytes is None else (cap_bytes + 0.5) / self.program.scale_bytes

    def set_host_cap(self, cap_bytes: int | None) -> None:
        """Host memory <= cap (Rule 8); None switches the row off."""
        row = row_named(self.prob, "host_memory")
        if row is not None:
            total = sum(self.program.host.values()) + 1
            row.constant = -((total if cap_bytes is None else cap_bytes + 0.5) / self.program.scale_bytes)

    def recompute_row(self, name: str, sense: int, rhs: float | None) -> None:
        """Set the row ``recompute <= rhs`` (sense LE) or ``>= rhs`` (GE); None switches it off.

        Rows are switched off, not deleted (PuLP has no public way to delete a row).
        """
        row = row_named(self.prob, name)
        if row is None:
            if rhs is None:
                return
            row = pulp.LpConstraint(self.recompute, sense, name, 0.0)
            self.prob.addConstraint(row, name)
        off = sum(self.program.forward_ms.values()) + 1.0 if sense == pulp.LpConstraintLE else -1.0
        row.constant = -(off if rhs is None else rhs)


def build_model(g: nx.DiGraph, budget_bytes: int | None = None, program: Program | None = None,
                host_budget_bytes: int | None = None) -> IlpModel:
    """The PuLP problem of NOTE [ ILP formulation ]: min recompute, P <= budget when given (and the
    host memory <= ``host_budget_bytes`` when the program offloads)."""
    pg = program or build_program(g)
    prob = pulp.LpProblem("remat_checkpoint", pulp.LpMinimize)
    x = {v: _variable(prob, f"x{i}_{_sanitize(v)}", 0, 1, pulp.LpBinary) for i, v in enumerate(pg.nodes)}
    y: list[pulp.LpVariable] = []

    def expr(form: Lin) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression(
            [((y[k] if isinstance(k, int) else x[k]), c) for k, c in form.items() if k is not None and c],
            constant=form.get(None, 0.0))

    for path in pg.paths:
        prob.addConstraint(pulp.lpSum(x[v] for v in path) <= 1, f"antichain_{_sanitize(path[0])}")
    for group in pg.ties:  # every call of a module, or none (NOTE [ Tied calls ])
        for v in group[1:]:
            prob.addConstraint(x[v] - x[group[0]] == 0, f"tied_{_sanitize(v)}")
    for k, lows in enumerate(pg.ors):
        y.append(_variable(prob, f"y{k}", 0, 1))
        for j, lo in enumerate(lows):
            prob.addConstraint(y[k] - expr(lo) >= 0, f"or_{k}_{j}")
    # H_b: running sum of the deltas, a variable wherever a delta has variables
    held: dict[int, pulp.LpAffineExpression] = {}
    running = pulp.LpAffineExpression()
    n_held = 0
    for b in range(max([*pg.delta, *(p.bucket or 0 for p in pg.probes), 0]) + 1):
        d = pg.delta.get(b)
        if d:
            if any(k is not None for k in d):
                hv = _variable(prob, f"H{b}", 0)
                prob.addConstraint(hv - running - expr(d) == 0, f"held_{b}")
                running = pulp.LpAffineExpression(hv)
                n_held += 1
            else:
                running = running + d[None]
        held[b] = running
    peak = _variable(prob, "P", 0)
    for i, p in enumerate(pg.probes):
        h = held[p.bucket] if p.bucket is not None else pulp.LpAffineExpression()
        e = h + expr(p.extra)
        e = pulp.LpAffineExpression({v: c for v, c in e.items() if c != 0}, constant=e.constant)
        prob.addConstraint(e - peak <= -p.const_bytes / pg.scale_bytes, f"p{i}_{_sanitize(p.name)}")
    _host_row(prob, pg, x)
    recompute = pulp.lpSum(pg.forward_ms[v] * x[v] for v in pg.nodes)
    prob.setObjective(recompute)
    stats = {**pg.stats, "binaries": len(x), "held_variables": n_held,
             "variables": len(x) + len(y) + n_held + 1, "constraints": prob.numConstraints()}
    model = IlpModel(pg, prob, x, peak, recompute, stats)
    model.set_cap(budget_bytes)
    model.set_host_cap(host_budget_bytes)
    return model


def _host_row(prob: pulp.LpProblem, pg: Program, x: dict[str, pulp.LpVariable]) -> None:
    """Rule 8's host row: sum of S_v * f <= the host cap (``IlpModel.set_host_cap`` sets it)."""
    if pg.host:
        terms = [(x[f], nbytes / pg.scale_bytes) for f, nbytes in pg.host.items()]
        prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, "host_memory",
                                             0.0), "host_memory")


__all__ = ["IlpModel", "build_model", "row_named"]
