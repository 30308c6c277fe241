"""Optimal dynamic program for chains, under the cost model.

Runs on ``solvers.chain.chain_terms``: the NOTE [ Peak-memory model ] written as a
recurrence along the leaves, where leaf i's checkpoint bit c_i adds ``delta[i][c_{i-1}][c_i]``
held bytes and must satisfy ``H_i + k[i][c_i] <= budget``. The DP keeps, for each value of the
last bit, the Pareto front of (held bytes H, recompute ms R) over all prefixes that respect
every probe so far; the answer is the least-R state that also passes the tail probes.

Exactness: on chains (``terms.exact``) the recurrence equals ``simulate`` and the plan is
optimal. Elsewhere (a tensor held by non-adjacent units: skip connections, an encoder output
read by every decoder block) the recurrence over-counts, so the plan still fits the budget
under ``simulate`` but optimality is not proven: status ``feasible``.

Discretisation: if a front grows past ``max_states`` points, held bytes are rounded *up* to a
grid of budget/max_states, so a returned plan is never over budget; the status is then
``feasible``. Complexity O(n * F) for fronts of F points (F <= max_states); a 200-unit
transformer chain has fronts of O(n) points.

Modules called more than once (NOTE [ Tied calls ] in ``solvers/cost_model.py``): all their
calls share one bit, which a chain recurrence cannot say. The DP runs once per assignment of
the tied bits (2^k runs for k such modules, at most ``MAX_TIED_GROUPS``), each run with those
leaves pinned, and keeps the best: still exact.

``min_feasible_bytes``: the same recurrence with the front over (H, worst probe so far) gives
the lowest peak any plan reaches; it is reported with every solution.

Example::

    sol = solve(graph, 2 << 30)                 # optimal on a chain
    min_feasible_bytes(graph)                  # the lowest peak any plan reaches
"""

from __future__ import annotations

import itertools
import math
import time

import networkx as nx
import numpy as np

from solvers.chain import ChainTerms, chain_terms
from solvers.cost_model import simulate, tie_groups
from solvers.base import Solution, judged, top_level
from solvers.errors import SolverError

MAX_TIED_GROUPS = 8
"""Modules called more than once (see NOTE [ Tied calls ]) the DP takes: it runs once per
assignment of their bits, 2^k runs. Beyond this ``auto`` uses the ILP and ``dp`` refuses."""


def solve(g: nx.DiGraph, budget_bytes: int, *, max_states: int = 1 << 16, host_budget_bytes: int | None = None,
          **_: object) -> Solution:
    """Least-recompute checkpoint set of a chain graph that fits ``budget_bytes``."""
    if host_budget_bytes is not None:
        raise SolverError("the DP has no offload choice: plan offload with the ilp or auto solver")
    t0 = time.perf_counter()
    terms = chain_terms(g)
    runs = tied_assignments(g, terms)
    min_peak = lowest_peak(terms, runs, max_states)
    best, approx = None, False
    for fixed in runs:
        bits, coarse, value = _min_recompute(terms, budget_bytes, max_states, fixed)
        approx |= coarse
        if bits is not None and (best is None or value < best[0]):
            best = (value, bits)
    seconds = time.perf_counter() - t0
    if best is None:
        sol = judged("dp", g, [], budget_bytes, seconds)
        return Solution(**{**sol.__dict__, "status": "infeasible", "min_feasible_bytes": min_peak,
                           "detail": f"no plan fits; the minimum feasible budget is {min_peak} bytes"})
    chosen, selective = terms.plan(best[1])
    proven = terms.exact and not approx
    detail = "exact chain recurrence" if proven else (
        "graph is not a chain: recurrence over-counts shared tensors" if not terms.exact
        else f"fronts discretised to {max_states} states")
    if len(runs) > 1:
        detail += f"; {len(runs)} runs, one per choice for the modules called more than once"
    sol = judged("dp", g, chosen, budget_bytes, seconds, status_if_fits="optimal" if proven else "feasible",
                 detail=detail, selective=selective)
    return Solution(**{**sol.__dict__, "min_feasible_bytes": min_peak})


def tied_assignments(g: nx.DiGraph, terms: ChainTerms) -> list[dict[int, int]]:
    """One ``{leaf index: bit}`` per way of checkpointing the tied groups (NOTE [ Tied calls ]):
    all calls of a module share one bit. ``[{}]`` when no module is called twice."""
    pos = {leaf: i for i, leaf in enumerate(terms.leaves)}
    groups = [[pos[n] for n in group] for group in tie_groups(g)]
    if len(groups) > MAX_TIED_GROUPS:
        raise SolverError(f"solver 'dp' cannot plan this graph: {len(groups)} modules are called more than once; "
                          f"the DP takes at most "
                          f"{MAX_TIED_GROUPS} (2^k runs): use the ILP")
    return [{i: bit for group, bit in zip(groups, bits) for i in group}
            for bits in itertools.product((0, 1), repeat=len(groups))]


def min_feasible_bytes(g: nx.DiGraph) -> int:
    """Lowest predicted peak of any checkpoint set (exact on chains; an upper bound otherwise):
    every top-level candidate checkpointed, or on a graph of leaves the DP's lowest peak."""
    candidates = [simulate(g, top_level(g)).peak_bytes]
    if all(a["leaf"] for _, a in g.nodes(data=True)):
        terms = chain_terms(g)
        try:
            candidates.append(lowest_peak(terms, tied_assignments(g, terms)))
        except SolverError:  # too many modules called more than once for the DP: the bound above
            pass
    return min(candidates)


def lowest_peak(terms: ChainTerms, runs: list[dict[int, int]], max_states: int = 1 << 16) -> int:
    """The lowest peak of any plan that respects ``runs``' tied bits (``min_feasible`` per run)."""
    return min(min_feasible(terms, max_states=max_states, fixed=fixed)[0] for fixed in runs)


class _Front:
    """Pareto front in (held bytes H, value V), plus back-pointers (previous bit, index)."""

    __slots__ = ("h", "v", "prev_bit", "prev_idx")

    def __init__(self, h, v, prev_bit, prev_idx):
        self.h, self.v, self.prev_bit, self.prev_idx = h, v, prev_bit, prev_idx

    @classmethod
    def start(cls, value: float) -> "_Front":
        z = np.zeros(1, dtype=np.int64)
        return cls(z, np.full(1, value, dtype=np.float64), z.copy(), z.copy())

    def __len__(self) -> int:
        return len(self.h)


def _step(fronts: dict[int, _Front], t: ChainTerms, i: int, c: int, value_fn, keep_fn) -> _Front:
    """All extensions of the fronts by bit ``c`` at leaf ``i``, pruned to a Pareto front."""
    hs, vs, pb, pi = [], [], [], []
    for a, f in fronts.items():
        if not len(f):
            continue
        h2 = f.h + t.delta[i][a][c]
        v2 = value_fn(f.v, h2)
        ok = keep_fn(h2, v2)
        idx = np.nonzero(ok)[0]
        hs.append(h2[idx]); vs.append(v2[idx]); pb.append(np.full(len(idx), a)); pi.append(idx)
    if not hs:
        e = np.zeros(0, dtype=np.int64)
        return _Front(e, np.zeros(0), e, e)
    return _pareto(np.concatenate(hs), np.concatenate(vs), np.concatenate(pb), np.concatenate(pi))


def _pareto(h, v, pb, pi) -> _Front:
    order = np.lexsort((v, h))
    h, v, pb, pi = h[order], v[order], pb[order], pi[order]
    keep = np.ones(len(h), dtype=bool)
    if len(h) > 1:
        keep[1:] = v[1:] < np.minimum.accumulate(v)[:-1]
    return _Front(h[keep], v[keep], pb[keep], pi[keep])


def _coarsen(f: _Front, grid: int) -> _Front:
    """Round held bytes up to ``grid`` (over-counting keeps every plan within budget) and re-prune."""
    return _pareto(-(-f.h // grid) * grid, f.v, f.prev_bit, f.prev_idx)


def _backtrack(history: list[dict[int, _Front]], bit: int, idx: int) -> list[int]:
    bits = []
    for fronts in reversed(history):
        f = fronts[bit]
        bits.append(bit)
        bit, idx = int(f.prev_bit[idx]), int(f.prev_idx[idx])
    return bits[::-1]


def _run(t: ChainTerms, value_fn, keep_fn, start_value: float, max_states: int, grid_scale: int,
         fixed: dict[int, int]):
    """The fronts after every leaf; a leaf in ``fixed`` takes only its fixed choice."""
    fronts = {0: _Front.start(start_value)}
    history, approx = [], False
    for i in range(len(t.leaves)):
        new = {}
        for c in range(t.choices(i)):
            allowed = fixed.get(i, c) == c
            f = _step(fronts, t, i, c, lambda v, h, c=c, i=i: value_fn(v, h, i, c),
                      keep_fn(i, c) if allowed else (lambda h2, v2: np.zeros(len(h2), dtype=bool)))
            if len(f) > max_states:
                approx = True
                f = _coarsen(f, max(2, math.ceil(grid_scale(f) / max_states)))
            new[c] = f
        history.append(new)
        fronts = new
    return fronts, history, approx


def _min_recompute(t: ChainTerms, budget: int, max_states: int,
                   fixed: dict[int, int]) -> tuple[list[int] | None, bool, float]:
    """(bits of the least-recompute plan within ``budget`` or None, discretised?, its recompute)."""
    if t.const_bytes > budget:
        return None, False, math.inf
    fronts, history, approx = _run(
        t, lambda v, h, i, c: v + t.cost_ms[i][c],
        lambda i, c: (lambda h2, v2: h2 + t.k[i][c] <= budget), 0.0, max_states, lambda f: budget, fixed)
    best = None
    for a, f in fronts.items():
        if not len(f):
            continue
        total = f.h + t.tail_delta[a]
        ok = np.nonzero(total + t.tail_k <= budget)[0]
        for j in ok:
            key = (float(f.v[j]), int(total[j]), a, int(j))
            if best is None or key[:2] < best[:2]:
                best = key
    if best is None:
        return None, approx, math.inf
    return _backtrack(history, best[2], best[3]), approx, best[0]


def min_feasible(t: ChainTerms, *, max_states: int = 1 << 16,
                 fixed: dict[int, int] | None = None) -> tuple[int, list[int]]:
    """Lowest peak any checkpoint set reaches under the recurrence, and one set that reaches it.

    Fronts over (H, worst probe so far). With discretisation the value is an upper bound.
    ``fixed`` pins leaves to a bit (see ``tied_assignments``).
    """
    fronts, history, _ = _run(
        t, lambda v, h, i, c: np.maximum(v, h + t.k[i][c]),
        lambda i, c: (lambda h2, v2: np.ones(len(h2), dtype=bool)), float(t.const_bytes), max_states,
        lambda f: int(f.h.max()) if len(f) else 1, fixed or {})
    best = None
    for a, f in fronts.items():
        if not len(f):
            continue
        peak = np.maximum(f.v, f.h + t.tail_delta[a] + t.tail_k)
        j = int(np.argmin(peak))
        if best is None or peak[j] < best[0]:
            best = (float(peak[j]), a, j)
    assert best is not None
    return int(best[0]), _backtrack(history, best[1], best[2])


__all__ = ["lowest_peak", "MAX_TIED_GROUPS", "min_feasible", "min_feasible_bytes", "solve",
           "tied_assignments"]
