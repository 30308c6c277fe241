"""``solve``: the ILP's steps, from a graph and a budget to a ``Solution``.

How ``solve`` proceeds:

1. Checkpointing nothing fits: done, optimal.
2. The sequential relaxation (``solvers/ilp/bound.py``, NOTE [ Sequential relaxation ]): a
   lower bound on recompute and a plan reaching it. If that plan fits under ``simulate`` it is
   optimal. On stacks of near-identical blocks this is the common case, where branch-and-bound
   alone often cannot close the last fraction of a percent.
3. Otherwise branch-and-bound on the program, with the bound as a cut (HiGHS only, see
   ``solve``). A plan a solver accepts within its tolerances but ``simulate`` puts over budget
   is excluded and the solve repeated (``_Run.fitting``).
4. No plan fits: the same program minimising the peak gives ``min_feasible_bytes``.
5. Among plans of the optimal recompute, a short search for a lower peak (``prefer_low_peak``).
6. The returned plan is judged by ``simulate`` (``solvers.base.judged``); a plan over budget
   there would be a bug, and is reported as such (a RuntimeWarning, status "infeasible").

Each step is a method of ``_Run`` (one call of ``solve``: the model, the clock, the notes for
``Solution.detail``); each returns the ``Solution`` when it decides the call.

Example::

    sol = solve(g, budget_bytes, time_limit_s=30)   # also solvers.ilp.solve and solvers.SOLVERS["ilp"]
    sol.status, sol.stopped, sol.checkpointed
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Iterable, Literal

import networkx as nx
import pulp

from solvers.base import Solution, judged_offload
from solvers.contract import Status, StopReason
from solvers.cost_model import Estimate, close_ties, is_tied, simulate
from solvers.errors import SolverError
from solvers.ilp.backends import (CBC_TERM_BITS, DEFAULT_BACKEND, Backend, Outcome, highs_available,
                                  solve_model)
from solvers.ilp.bound import Bound, sequential_bound
from solvers.ilp.model import IlpModel, build_model, row_named
from solvers.ilp.program import Program, build_program, simulate_vars, split_vars


_MAX_REPAIRS = 20
"""Re-solves allowed when the solver's plan is over budget under simulate (see ``_fitting``)."""


def solve(g: nx.DiGraph, budget_bytes: int, *, time_limit_s: float | None = None,
          backend: Backend | None = None, mip_gap: float = 0.0, prefer_low_peak: bool = True,
          use_relaxation: bool = True, threads: int | None = None, **options: object) -> Solution:
    """Least-recompute checkpoint set that fits ``budget_bytes``, on any candidate graph.

    Args:
        g: a graph from ``planner.model.graph.build_graph`` (nested candidates allowed).
        budget_bytes: peak memory allowed, per NOTE [ Peak-memory model ].
        time_limit_s: wall-clock limit for all solves together (None: none).
        backend: "highs" (default, needs highspy) or "cbc"; None means the default.
        mip_gap: relative gap at which the solver may stop (0: prove optimality).
        prefer_low_peak: among plans of least recompute, look for the lowest peak, with a
            quarter of the time spent so far (the recompute stays optimal either way).
        use_relaxation: first try NOTE [ Sequential relaxation ] (False: the ILP alone).
        threads: solver threads (None: the solver's default).
        options: ``host_budget_bytes``: with a value, every candidate not tied may also be
            offloaded, its saved tensors kept in at most this much host memory (NOTE [ ILP
            formulation ], Rule 8; the keyword every solver of ``solvers.SOLVERS`` takes, the DP to
            refuse it); absent or None: keep or recompute only. Other keywords are ignored, as the
            registry passes every solver the same ones.

    Returns:
        A ``Solution``: "optimal" when proven, "feasible" with ``gap`` when the time limit
        stopped the search, "infeasible" with ``min_feasible_bytes`` (the lowest peak any plan
        reaches; proven unless ``detail`` says otherwise).
    """
    host_budget_bytes = options.get("host_budget_bytes")
    run = _Run(g, budget_bytes, time_limit_s, *_pick_backend(backend), mip_gap, threads, prefer_low_peak)
    run.host_budget = None if host_budget_bytes is None else int(host_budget_bytes)
    if simulate(g, []).peak_bytes <= budget_bytes:  # step 1 of the module docstring
        return run.finish([], "optimal", "checkpointing nothing fits")
    run.program = build_program(g, term_bits=CBC_TERM_BITS if run.backend == "cbc" else 24,
                                offload=host_budget_bytes is not None)
    decided = run.by_relaxation() if use_relaxation else None
    return decided if decided is not None else run.branch_and_bound()


def _below(ms: float) -> float:
    """A bound in ms made safe against the summation order of the same floats."""
    return ms - 1e-12 * max(1.0, abs(ms))


def _pick_backend(backend: Backend | None) -> tuple[Backend, list[str]]:
    name = backend or DEFAULT_BACKEND
    if name not in ("highs", "cbc"):
        raise SolverError(f"unknown ILP backend {name!r}; choose 'highs' or 'cbc'")
    if name == "highs" and not highs_available():
        return "cbc", ["highspy is not installed: using CBC (pip install highspy for HiGHS)"]
    return name, []


def _stats_line(model: IlpModel) -> str:
    stats = model.stats
    return (f"{stats['binaries']} binaries, {stats['variables'] - stats['binaries']} continuous, "
            f"{stats['constraints']} rows")


class _Run:
    """One call of ``solve``, as the steps of the module docstring: the model, the clock, the
    notes for ``detail``. Each step returns the ``Solution`` when it decides the call."""

    def __init__(self, g: nx.DiGraph, budget_bytes: int, time_limit_s: float | None, backend: Backend,
                 notes: list[str], mip_gap: float, threads: int | None, prefer_low_peak: bool = True) -> None:
        self.g, self.budget, self.backend, self.mip_gap, self.threads = g, budget_bytes, backend, mip_gap, threads
        self.time_limit_s, self.prefer_low_peak = time_limit_s, prefer_low_peak
        self.t0 = time.perf_counter()
        self.deadline = None if time_limit_s is None else self.t0 + time_limit_s
        self.notes = [f"backend {backend}", *notes]
        self.program: Program | None = None
        self.model: IlpModel | None = None
        self.bound: Bound | None = None
        self.n_cuts = 0
        self.host_budget: int | None = None  # offload allowed within it (Rule 8); None: no offload

    # --- the model and the clock

    def left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())

    def build(self) -> None:
        if self.model is None:
            self.model = build_model(self.g, self.budget, self.program, self.host_budget)
            self.notes.append(_stats_line(self.model))

    def host_fits(self, est: Estimate) -> bool:
        return self.host_budget is None or est.host_peak_bytes <= self.host_budget

    def fits(self, est: Estimate) -> bool:
        """Within the budget and the host budget under ``simulate``."""
        return est.peak_bytes <= self.budget and self.host_fits(est)

    def program_cost(self, chosen: Iterable[str]) -> float:
        """The objective at ``chosen``, in the program's terms."""
        return sum(self.program.forward_ms[v] for v in chosen)

    def tops(self) -> frozenset[str]:
        """Every top-level candidate (with its tied calls): the plan of last resort."""
        return frozenset(close_ties(self.g, (n for n, a in self.g.nodes(data=True) if a["parent"] is None)))

    def objective(self, kind: Literal["recompute", "peak"]) -> None:
        m = self.model
        if kind == "recompute":
            m.prob.setObjective(m.recompute)
        else:  # every x listed (at 0): PuLP's MPS writer needs each known column somewhere
            m.prob.setObjective(pulp.LpAffineExpression([(m.peak, 1), *((v, 0) for v in m.x.values())]))

    # --- step 2: the sequential relaxation decides, or bounds

    def by_relaxation(self) -> Solution | None:
        """The Solution when NOTE [ Sequential relaxation ] decides the budget; else keeps its bound."""
        bound = self.bound = sequential_bound(self.program, self.budget)
        if bound is not None and bound.recompute_ms == math.inf:
            self.notes.append("the sequential relaxation admits no plan (NOTE [ Sequential relaxation ])")
            return self.infeasible()
        if bound is None or not is_tied(self.g, bound.plan):  # it ignores ties (a relaxation still)
            return None
        if self.fits(simulate_vars(self.g, bound.plan)):
            self.notes.append("proven by the sequential relaxation: its plan fits, and no plan has less recompute "
                              "(NOTE [ Sequential relaxation ])")
            chosen = self.lower_peak(frozenset(bound.plan)) if self.prefer_low_peak else bound.plan
            return self.finish(chosen, "optimal")
        return None

    # --- step 3: branch and bound, plans over budget under simulate cut off

    def branch_and_bound(self) -> Solution:
        self.build()
        bound = self.bound
        if bound is not None and self.backend == "highs":
            self.notes.append(f"sequential relaxation bound {bound.recompute_ms:.6g} ms used as a cut")
            self.model.recompute_row("recompute_lower_bound", pulp.LpConstraintGE, _below(bound.recompute_ms))
        # not for CBC 2.10.3: with that row (parallel to the objective) its restart after reduced-cost
        # fixing "found" a 552.1 ms plan below the root bound and stopped at a wrong "optimal"
        out = self.fitting(self.budget)
        if out.state == "infeasible":
            return self.infeasible()
        if out.state == "none":
            return self.no_plan_in_time()
        chosen = self.lower_peak(out.chosen) if self.prefer_low_peak else out.chosen
        if out.state == "optimal":
            return self.finish(chosen, "optimal")
        return self.finish(chosen, "feasible", "time limit reached: best plan found, optimality not proven",
                           gap=_gap(out.objective, out.bound), stopped="time_limit")

    def fitting(self, cap_bytes: int | None, limit: float | None = None, gap: float | None = None) -> Outcome:
        """Solve with P <= cap; a plan simulate puts over the cap is cut off and the solve repeated.

        The solver accepts x within its integrality tolerance (1e-6 in HiGHS): x_c = 6e-7 times
        a recompute of 2 MB "saves" a byte. Rounded, such a plan may be a byte or so over the
        cap; it is truly infeasible, so excluding it (a no-good cut) loses nothing.
        """
        m = self.model
        m.set_cap(cap_bytes)
        for _ in range(_MAX_REPAIRS + 1):
            out = solve_model(m, self.backend, self.left() if limit is None else limit,
                         self.mip_gap if gap is None else gap, self.threads)
            if out.note:
                self.notes.append(out.note)
            if out.state in ("infeasible", "none") or cap_bytes is None:
                return out
            est = simulate_vars(self.g, out.chosen)
            over = est.peak_bytes - cap_bytes
            if over <= 0 and self.host_fits(est):
                return out
            self.n_cuts += 1
            cut = pulp.lpSum(1 - x if v in out.chosen else x for v, x in m.x.items())
            m.prob.addConstraint(cut >= 1, f"exclude_{self.n_cuts}")
            self.notes.append(f"solver tolerance: excluded a plan {over} bytes over, re-solved")
            if limit is not None:
                limit = max(0.05, limit - out.seconds)
        _loud(f"ILP: {_MAX_REPAIRS} plans in a row were over budget under simulate")
        return out

    def no_plan_in_time(self) -> Solution:
        """The solver stopped before its first plan: checkpointing every top-level candidate, if
        that fits ("feasible", gap against the relaxation's bound, or 100 % without one)."""
        tops = sorted(self.tops(), key=lambda n: self.g.nodes[n]["order"])
        est = simulate(self.g, tops)
        if est.peak_bytes > self.budget:
            self.notes.append(f"time limit ({self.time_limit_s} s) reached before any plan was found")
            return self.infeasible(search=False, stopped="no_plan_in_time")
        lower = self.bound.recompute_ms if self.bound is not None else 0.0
        return self.finish(tops, "feasible", f"time limit ({self.time_limit_s} s) reached before the solver found "
                           "a plan: checkpointing every top-level candidate fits (optimality not proven)",
                           gap=_gap(est.recompute_ms, lower), stopped="no_plan_in_time")

    # --- step 4: no plan fits: the lowest peak

    def infeasible(self, *, search: bool = True, stopped: StopReason = "finished") -> Solution:
        """No plan fits: the lowest peak any plan reaches is ``min_feasible_bytes``."""
        g = self.g
        best, proven = self.lowest_peak() if search else (self.tops(), False)
        est = simulate_vars(g, best)
        if not proven:
            self.notes.append("min_feasible_bytes is the best peak found in time, not proven minimal")
            stopped = "time_limit" if stopped == "finished" else stopped
        self.notes.append(f"no plan fits; the minimum feasible budget is {est.peak_bytes} bytes")
        sol = judged_offload("ilp", g, split_vars(best), self.budget, time.perf_counter() - self.t0,
                             host_budget_bytes=self.host_budget)
        if search and sol.status != "infeasible":
            _loud(f"ILP found budget {self.budget} infeasible, but simulate fits {sorted(best)} "
                  f"at {est.peak_bytes} bytes (the program and simulate disagree: a bug)")
        return Solution(**{**sol.__dict__, "status": "infeasible", "min_feasible_bytes": est.peak_bytes,
                           "detail": "; ".join(self.notes), "extra": self.extra(), "stopped": stopped})

    def lowest_peak(self) -> tuple[frozenset[str], bool]:
        """The plan of least peak (every top-level candidate if none is found), and whether proven."""
        g, best = self.g, self.tops()
        self.build()
        self.drop_cuts()
        self.model.recompute_row("recompute_lower_bound", pulp.LpConstraintGE, None)
        self.objective("peak")
        out = self.fitting(None)
        proven = out.state == "optimal"
        if out.state in ("optimal", "feasible"):
            best = out.chosen
        # the solver's optimum may sit a byte or so under the rounded plan's peak (see
        # ``fitting``): unless its bound rules it out, ask for a plan one byte lower
        peak = simulate_vars(g, best).peak_bytes
        scale = self.model.program.scale_bytes
        while proven and not (out.bound is not None and out.bound * scale > peak - 1 + 1e-6 * scale):
            out = self.fitting(peak - 1)
            if out.state == "infeasible":
                break
            if out.state != "optimal" and out.state != "feasible":
                proven = False
                break
            best, peak = out.chosen, simulate_vars(g, out.chosen).peak_bytes
        self.objective("recompute")
        return best, proven

    def drop_cuts(self) -> None:
        """Switch the no-good cuts off: a plan over one cap may fit under another."""
        for k in range(1, self.n_cuts + 1):
            # the row is (terms) + constant >= 0 and the terms are >= -len(x): never binding
            row_named(self.model.prob, f"exclude_{k}").constant = float(len(self.model.x) + 1)

    # --- step 5: among plans of least recompute, a lower peak

    def lower_peak(self, chosen: frozenset[str]) -> frozenset[str]:
        """Tie-break: the lowest peak among plans no slower than ``chosen`` (kept only if so).

        Gets a quarter of the time spent so far (at least 0.2 s): the recompute is already
        optimal, this only picks among equals.
        """
        first = simulate_vars(self.g, chosen)
        limit = self.tie_break_seconds()
        if limit < 0.1 or first.overhead_ms == 0:
            return chosen
        self.build()
        bound = self.program_cost(chosen)
        self.model.recompute_row("tie_break_recompute", pulp.LpConstraintLE, bound + 1e-12 * max(1.0, bound))
        self.objective("peak")
        try:
            second = self.fitting(self.budget, limit=limit, gap=0.0)
        finally:
            self.model.recompute_row("tie_break_recompute", pulp.LpConstraintLE, None)
            self.objective("recompute")
        if second.state not in ("optimal", "feasible"):
            return chosen
        est = simulate_vars(self.g, second.chosen)
        if est.overhead_ms <= first.overhead_ms and est.peak_bytes < first.peak_bytes and self.host_fits(est):
            self.notes.append(f"peak tie-break: {first.peak_bytes} -> {est.peak_bytes} bytes at equal recompute")
            return second.chosen
        return chosen

    def tie_break_seconds(self) -> float:
        """A quarter of the time spent so far, at least 0.2 s, within the time left."""
        limit = max(0.2, 0.25 * (time.perf_counter() - self.t0))
        spare = self.left()
        return limit if spare is None else min(limit, spare)

    # --- step 6: the Solution, judged by simulate

    def finish(self, chosen, status: Status, note: str | None = None, *, gap: float | None = None,
               stopped: StopReason = "finished") -> Solution:
        if note:
            self.notes.append(note)
        sol = judged_offload("ilp", self.g, split_vars(chosen), self.budget, time.perf_counter() - self.t0,
                             status_if_fits=status, host_budget_bytes=self.host_budget)
        if sol.status == "infeasible":
            _loud(f"ILP plan {sorted(chosen)} is over budget under simulate: {sol.peak_bytes} > {self.budget} "
                  "bytes (the program and simulate disagree: a bug)")
            self.notes.append("BUG: the program's plan is over budget under simulate")
        return Solution(**{**sol.__dict__, "gap": gap, "detail": "; ".join(self.notes), "extra": self.extra(),
                           "stopped": stopped})

    def extra(self) -> dict:
        stats = dict(self.model.stats if self.model is not None else
                     self.program.stats if self.program is not None else {})
        if self.bound is not None:
            b = self.bound
            stats.update(bound_ms=b.recompute_ms, bound_seconds=b.seconds, bound_states=b.states,
                         bound_relaxed_ors=b.relaxed_ors, bound_coarsened=b.coarsened)
        return {**stats, "backend": self.backend, "repairs": self.n_cuts}


def _loud(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _gap(objective: float | None, bound: float | None) -> float | None:
    if objective is None or bound is None:
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


__all__ = ["solve"]
