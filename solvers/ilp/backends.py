"""The ILP's backends, through PuLP: HiGHS (in-process, needs highspy; the default) and CBC
(bundled with PuLP; an MPS file and a process per solve, guarded against wrong "optimal" answers,
see ``run_cbc``). ``solve_model`` runs one solve of an ``IlpModel`` and says what it found as an
``Outcome``. docs/benchmarks.md compares them (``benchmarks/ilp_scaling.py``).

Example::

    out = solve_model(build_model(g, budget_bytes), "highs", time_limit_s=10, mip_gap=0.0, threads=None)
    out.state, sorted(out.chosen)
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pulp

from solvers.ilp.model import IlpModel

Backend = Literal["highs", "cbc"]

DEFAULT_BACKEND: Backend = "highs"
"""See the module docstring: equal or faster than CBC in ``benchmarks/ilp_scaling.py``."""


@dataclass(frozen=True)
class Outcome:
    state: Literal["optimal", "feasible", "infeasible", "none"]  # "none": no solution in time
    chosen: frozenset[str]
    objective: float | None
    bound: float | None
    seconds: float
    note: str = ""  # something worth saying in Solution.detail


def highs_available() -> bool:
    return bool(pulp.HiGHS().available())


@functools.cache
def _swallow_highs_banner() -> None:
    """highspy prints a banner to the C-level stdout when the first ``Highs`` is made, which
    would corrupt machine-readable output (``--json``): make that first one into /dev/null."""
    import highspy

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no usable stdout: nothing to protect
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


CBC_TERM_BITS = 16
"""CBC's program counts memory in units that keep every term below 2^16 (HiGHS's: 2^24, as the
plans on file were made). With terms up to 2^24 (whole bytes on a 10 MB step), CBC 2.10.3 called a
worse plan optimal in 5 of 7,225 programs of tests/test_ilp.py's nested DAGs, under each set of
options tried (default, heuristics and cuts off, strong branching off too); in nested_dag(220) its
branch and bound dropped nodes holding the optimum whose LPs, solved afresh, are feasible. With
terms below 2^16: none. Half a byte stays above CBC's primal tolerance (1e-9) for steps up to 2^44
bytes: plans stay byte-exact. ``python benchmarks/cbc_check.py`` (docs/benchmarks.md)."""

CBC_PROOF_OPTIONS = ["heur off", "cuts off"]
"""CBC options of the re-solve that checks an answer ``_cbc_distrust`` rejects: heuristics and cuts
off avoided both bugs it names on every case seen; "heur off" alone once called a feasible model
infeasible."""


def solve_model(model: IlpModel, backend: Backend, time_limit_s: float | None, mip_gap: float,
           threads: int | None) -> Outcome:
    t0 = time.perf_counter()
    limit = None if time_limit_s is None else max(0.05, time_limit_s)
    if backend == "highs":
        state, objective, bound, note = run_highs(model.prob, limit, mip_gap, threads)
        return Outcome(state, _chosen(model, state), objective, bound, time.perf_counter() - t0, note)
    state, objective, bound, note = run_cbc(model.prob, limit, mip_gap, threads, [])
    chosen = _chosen(model, state)
    if not note:
        return Outcome(state, chosen, objective, bound, time.perf_counter() - t0, note)
    # See _cbc_distrust: the answer is a plan (when there is one) but no proof; CBC_PROOF_OPTIONS re-solves.
    first = (state if state in ("optimal", "feasible") else "none", chosen, objective)
    left = None if limit is None else limit - (time.perf_counter() - t0)
    if left is not None and left <= 0.05:
        state, bound = ("feasible", None) if first[0] != "none" else ("none", None)
        return Outcome(state, chosen, objective, bound, time.perf_counter() - t0, note)
    state, objective, bound, again = run_cbc(model.prob, left, mip_gap, threads, CBC_PROOF_OPTIONS)
    chosen = _chosen(model, state)
    note += "; re-solved with CBC's heuristics and cuts off"
    if again and state == "optimal":  # still untrusted: a plan, but no proof
        state, bound = "feasible", None
        note += f", which was untrusted too ({again})"
    if first[0] != "none" and (state not in ("optimal", "feasible") or first[2] < objective - _tolerance(objective)):
        note += f"; kept the first plan ({first[2]:.6g}), the re-solve said {state} ({objective})"
        state, chosen, objective, bound = "feasible", first[1], first[2], None
    return Outcome(state, chosen, objective, bound, time.perf_counter() - t0, note)


def _chosen(model: IlpModel, state: str) -> frozenset[str]:
    if state not in ("optimal", "feasible"):
        return frozenset()
    return frozenset(v for v, var in model.x.items() if (var.varValue or 0) > 0.5)


def run_highs(prob: pulp.LpProblem, limit: float | None, mip_gap: float, threads: int | None):
    from highspy import HighsModelStatus as ms

    _swallow_highs_banner()
    prob.solve(pulp.HiGHS(msg=False, timeLimit=limit, gapRel=mip_gap, gapAbs=1e-9, threads=threads))
    h = prob.solverModel
    st, info = h.getModelStatus(), h.getInfo()
    has_sol = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if st == ms.kOptimal:
        state = "optimal"
    elif st in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        state = "infeasible"
    else:
        state = "feasible" if has_sol else "none"
    found = state in ("optimal", "feasible")
    return (state, info.objective_function_value if found else None, info.mip_dual_bound if found else None, "")


def run_cbc(prob: pulp.LpProblem, limit: float | None, mip_gap: float, threads: int | None, extra: list[str]):
    """CBC through PuLP, with its log read back for the bound and for a known CBC 2.10.3 bug.

    The bug: after "Reduced cost fixing - restarting search", the restarted search may report
    an "Integer solution" below the root bound (494.7 ms with the root at 596.95) and end the
    whole search with a worse plan called optimal (597.263 where 597.119 exists). Any integer
    solution in the log below the returned objective marks such a run; the note says so.
    """
    with tempfile.TemporaryDirectory(prefix="remat_cbc_") as tmp:
        log = os.path.join(tmp, "cbc.log")
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC for PuLP 4
            warnings.simplefilter("ignore", DeprecationWarning)
            # A plan within half a byte of the budget is 5e-8 of a 1e7-byte row. With CBC's
            # default tolerances (1e-7) it returned worse plans as "optimal"; its preprocessing
            # (Cgl) did too even with tight tolerances ("Cbc3007W No integer variables").
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, gapRel=mip_gap, gapAbs=1e-9, threads=threads,
                                       logPath=log, options=["integerT 1e-9", "primalT 1e-9", "preprocess off",
                                                             *extra])
            solver.tmpDir = tmp  # PuLP's MPS and solution files go where every exit path removes them
            with _cbc_ends_with_us():
                prob.solve(solver)
        text = Path(log).read_text() if os.path.exists(log) else ""
    has_sol = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if prob.status == pulp.LpStatusInfeasible:
        state = "infeasible"
    elif prob.sol_status == pulp.LpSolutionOptimal and prob.status == pulp.LpStatusOptimal:
        state = "optimal"
    else:
        state = "feasible" if has_sol else "none"
    objective = pulp.value(prob.objective) if state in ("optimal", "feasible") else None
    bound = _cbc_bound(text, objective) if state == "feasible" else objective
    return state, objective, bound, _cbc_distrust(text, objective)


@contextlib.contextmanager
def _cbc_ends_with_us() -> Iterator[None]:
    """CBC's process ends with the solve, however the solve ends: PuLP waits for it, but an interrupt or SIGTERM
    (a KeyboardInterrupt, NOTE [ Signals and children ] in planner/children.py) left it running, orphaned,
    for up to the time limit. PuLP starts it with ``subprocess.Popen`` in ``pulp.apis.coin_api``: that module
    sees a ``Popen`` that records it while the solve runs, and a running one is terminated, then killed."""
    from pulp.apis import coin_api

    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    real = coin_api.subprocess
    coin_api.subprocess = types.SimpleNamespace(**{**vars(subprocess), "Popen": Recorded})
    try:
        yield
    finally:
        coin_api.subprocess = real
        for proc in started:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _cbc_distrust(log: str, objective: float | None) -> str:
    """Why CBC's answer is not to be trusted (empty when nothing in its log says so).

    Two CBC 2.10.3 bugs end the search with a plan called optimal that is not proven so:
    - a search restarted after reduced-cost fixing reports an "Integer solution" below the answer;
    - after the feasibility pump, "The LP relaxation is infeasible or too expensive" stops the root
      node although its cuts left the bound below the pump's answer (14.08 against 16.457, 0 nodes).
    """
    if objective is None:
        return ""
    tol = 1e-6 * max(1.0, abs(objective))
    reported = [float(v) for v in re.findall(r"Integer solution of\s*([-+0-9.eE]+)", log)]
    if reported and min(reported) < objective - tol:
        return f"CBC reported a spurious solution ({min(reported):.6g} below its answer {objective:.6g}) after a restart"
    root = re.findall(r"Cuts at root node changed objective from\s*[-+0-9.eE]+\s*to\s*([-+0-9.eE]+)", log)
    if "LP relaxation is infeasible or too expensive" in log and root and float(root[-1]) < objective - tol:
        return (f"CBC stopped its root node at bound {float(root[-1]):.6g} below its answer {objective:.6g} "
                "(LP relaxation reported infeasible)")
    return ""


def _tolerance(ms: float) -> float:
    """Two sums of the same recompute times in another order differ by about this much."""
    return 1e-9 * max(1.0, abs(ms))


def _cbc_bound(log: str, objective: float | None) -> float | None:
    """Best bound from CBC's log ("Lower bound: ..." or "best possible ...")."""
    for pat in (r"Lower bound:\s*([-+0-9.eE]+)", r"best possible\s*([-+0-9.eE]+)"):
        found = re.findall(pat, log)
        if found:
            return float(found[-1])
    return None


__all__ = ["Backend", "CBC_PROOF_OPTIONS", "CBC_TERM_BITS", "DEFAULT_BACKEND", "Outcome", "highs_available",
           "run_cbc", "run_highs", "solve_model"]
