"""The sequential relaxation of the ILP: a lower bound on recompute, and often the optimum
(NOTE [ Sequential relaxation ], above ``sequential_bound``).

Example::

    bound = sequential_bound(build_program(g), budget_bytes)
    bound.recompute_ms, bound.plan     # no plan within the budget has less; a plan reaching it
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from solvers.ilp.program import Lin, Program

_MAX_PAIRS = 1 << 22
"""(state, option) pairs tried per block at most; fronts are coarsened to stay under it."""


@dataclass(frozen=True)
class Bound:
    """What the sequential relaxation found for one cap."""

    recompute_ms: float  # no plan within the cap has less; inf: no plan fits at all
    plan: tuple[str, ...]  # a plan reaching it in the relaxation (check it with simulate)
    relaxed_ors: int  # OR variables replaced by a lower bound
    states: int  # largest front
    coarsened: bool  # W was rounded down somewhere
    seconds: float


# NOTE [ Sequential relaxation ]
#
# Why: on transformer-like graphs the program of NOTE [ ILP formulation ] is a knapsack over
# near-identical blocks (per block: checkpoint it, or some of its parts, or nothing). Its LP
# bound sits a fraction of one block below the optimum and every branch has a twin one block
# further on, so branch-and-bound proves nothing in minutes (500 candidates: the LP bound
# stays at 104.80 ms after 30 000 nodes; the optimum is 105.16 ms). A dynamic program over the
# top-level blocks finds the same optimum in a fraction of a second, and is a valid bound on
# any graph if it works on a relaxation:
#
#   1. Every OR variable y is replaced by one of its lower bounds (the one on the earliest
#      candidates). y enters every probe with a non-negative coefficient (in-flight tensors
#      cancel exactly), so each probe can only get smaller: a relaxation.
#   2. Each probe row r is affine in x. Let k(r) be the last top-level block with a candidate
#      in r. The DP walks the blocks in forward order, with states (recompute, W); choosing
#      option o (an antichain of the block's subtree) for block j checks the rows with
#      k(r) = j as  W + max_r (row r restricted to block j, at o) + const_r <= cap, and adds
#      m_j(o) = min over the rows r with k(r) > j of (row r restricted to block j, at o) to W.
#      A row sees each earlier block through at least that minimum: a relaxation again.
#   3. States are Pareto-pruned on (recompute, W). Past ``max_states`` states W is rounded
#      down to a grid, which only loosens the relaxation further.
#
# So no plan that fits the budget has less recompute than the DP's optimum: a lower bound. It
# is exact (and its plan fits under simulate) when no y was relaxed and a block's effect on
# later probes does not depend on which later probe it is, as in chains of blocks, where the
# held bytes a block leaves behind are the same for every later probe. The caller checks the
# plan with simulate: if it fits, it is optimal; if not, the bound is a cut for the ILP.
#
# Cost: O(B * F * O) for B top-level blocks, F states (<= max_states) and O options per block.


def sequential_bound(program: Program, cap_bytes: int, *, max_states: int = 1 << 15,
                     max_options: int = 4096) -> Bound | None:
    """Lower bound on the least recompute of a plan with peak <= ``cap_bytes``; see NOTE.

    Returns None where the relaxation does not apply (a block with more than ``max_options``
    antichains).
    """
    t0 = time.perf_counter()
    pg = program
    scale = pg.scale_bytes
    cap = (cap_bytes + 0.5) / scale
    tol = 1e-9 * max(1.0, abs(cap))
    index = {v: i for i, v in enumerate(pg.nodes)}
    blocks, block_of = _blocks(pg)
    options = [_options(pg, b, max_options) for b in blocks]
    if any(o is None for o in options):
        return None
    low = _relax_ors(pg, block_of)
    rows, consts = _dense_rows(pg, low, index)
    if np.any(consts[~np.any(rows != 0, axis=1)] > cap + tol):  # a probe no plan changes
        return Bound(math.inf, (), len(pg.ors), 0, False, time.perf_counter() - t0)
    owner = _row_blocks(rows, np.array([block_of[v] for v in pg.nodes]))
    fwd = np.array([pg.forward_ms[v] for v in pg.nodes])
    cost, held = np.zeros(1), np.zeros(1)
    history, states, coarsened = [], 1, False
    for j, (members, opts) in enumerate(zip(blocks, options)):
        cols = np.array([index[v] for v in members])
        mat = np.zeros((len(opts), len(cols)))
        for k, opt in enumerate(opts):
            mat[k, [members.index(v) for v in opt]] = 1.0
        f = mat @ fwd[cols]
        later = rows[owner > j][:, cols]
        m = (mat @ np.unique(later, axis=0).T).min(axis=1) if len(later) else np.zeros(len(opts))
        own = owner == j
        need = ((mat @ rows[own][:, cols].T) + consts[own]).max(axis=1) if own.any() else np.full(len(opts), -np.inf)
        s_idx, o_idx = np.nonzero(held[:, None] + need[None, :] <= cap + tol)
        if not len(s_idx):
            return Bound(math.inf, (), len(pg.ors), states, coarsened, time.perf_counter() - t0)
        cost, held, s_idx, o_idx = _pareto(cost[s_idx] + f[o_idx], held[s_idx] + m[o_idx], s_idx, o_idx)
        limit = max_states if j + 1 == len(blocks) else min(max_states, max(256, _MAX_PAIRS // len(options[j + 1])))
        if len(cost) > limit:
            cost, held, keep = _coarsen(cost, held, limit)
            s_idx, o_idx = s_idx[keep], o_idx[keep]
            coarsened = True
        history.append((s_idx, o_idx))
        states = max(states, len(cost))
    best = int(np.argmin(cost))
    plan: list[str] = []
    for (s_idx, o_idx), opts in zip(reversed(history), reversed(options)):
        plan.extend(opts[o_idx[best]])
        best = int(s_idx[best])
    plan.sort(key=index.__getitem__)
    return Bound(float(cost.min()), tuple(plan), len(pg.ors), states, coarsened, time.perf_counter() - t0)


def _blocks(pg: Program) -> tuple[list[list[str]], dict[str, int]]:
    """Top-level subtrees in forward order (members in forward order), and node -> block."""
    top: dict[str, str] = {}
    for v in pg.nodes:  # forward order: a parent comes before its children
        p = pg.parent[v]
        top[v] = v if p is None else top[p]
    blocks: dict[str, list[str]] = {}
    for v in pg.nodes:
        blocks.setdefault(top[v], []).append(v)
    order = {t: i for i, t in enumerate(blocks)}
    return list(blocks.values()), {v: order[top[v]] for v in pg.nodes}


def _options(pg: Program, members: list[str], cap: int) -> list[tuple[str, ...]] | None:
    """Antichains of one top-level subtree (the empty one first), or None past ``cap``."""
    kids: dict[str | None, list[str]] = {}
    policy_vars = {pv for a in pg.alternatives.values() for pv in a}
    for v in members:
        if v not in policy_vars:  # a policy is an alternative to its candidate, not a child
            kids.setdefault(pg.parent[v] if pg.parent[v] in members else None, []).append(v)

    def of(v: str) -> list[tuple[str, ...]] | None:
        below: list[tuple[str, ...]] = [()]
        for c in kids.get(v, []):
            sub = of(c)
            if sub is None or len(below) * len(sub) > cap:
                return None
            below = [a + b for a in below for b in sub]
        return below + [(v,)] + [(pv,) for pv in pg.alternatives.get(v, ())]

    out: list[tuple[str, ...]] = [()]
    for root in kids[None]:
        sub = of(root)
        if sub is None or len(out) * len(sub) > cap:
            return None
        out = [a + b for a in out for b in sub]
    return out


def _relax_ors(pg: Program, block_of: dict[str, int]) -> list[Lin]:
    """Each y as one of its lower bounds, affine in x: the one on the earliest blocks."""
    low: list[Lin] = []
    for lows in pg.ors:
        forms = []
        for lo in lows:
            form: Lin = {}
            for k, c in lo.items():
                if isinstance(k, int):
                    for k2, c2 in low[k].items():
                        form[k2] = form.get(k2, 0.0) + c * c2
                else:
                    form[k] = form.get(k, 0.0) + c
            forms.append(form)
        low.append(min(forms, key=lambda fm: (max((block_of[k] for k, c in fm.items() if k is not None and c),
                                                  default=-1), -fm.get(None, 0.0))))
    return low


def _dense_rows(pg: Program, low: list[Lin], index: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Every probe as (coefficients over x, constant) in multiples of ``scale_bytes``, y replaced by ``low``."""
    n_buckets = max([*pg.delta, *(p.bucket or 0 for p in pg.probes), 0]) + 1
    n = len(pg.nodes)

    def dense(form: Lin) -> tuple[np.ndarray, float]:
        vec, const = np.zeros(n), 0.0
        for k, c in form.items():
            if k is None:
                const += c
            elif isinstance(k, int):
                for k2, c2 in low[k].items():
                    if k2 is None:
                        const += c * c2
                    else:
                        vec[index[k2]] += c * c2
            else:
                vec[index[k]] += c
        return vec, const

    d = np.zeros((n_buckets, n))
    dc = np.zeros(n_buckets)
    for b, form in pg.delta.items():
        d[b], dc[b] = dense(form)
    cum, cumc = np.cumsum(d, axis=0), np.cumsum(dc)
    rows = np.zeros((len(pg.probes), n))
    consts = np.zeros(len(pg.probes))
    for r, p in enumerate(pg.probes):
        vec, const = dense(p.extra)
        if p.bucket is not None:
            vec += cum[p.bucket]
            const += cumc[p.bucket]
        rows[r], consts[r] = vec, const + p.const_bytes / pg.scale_bytes
    rows[np.abs(rows) < 1e-12] = 0.0
    return rows, consts


def _row_blocks(rows: np.ndarray, block_of: np.ndarray) -> np.ndarray:
    """The last block with a candidate in each row (-1: none)."""
    masked = np.where(rows != 0, block_of[None, :], -1)
    return masked.max(axis=1) if rows.shape[1] else np.full(len(rows), -1)


def _pareto(cost, held, *extra):
    order = np.lexsort((held, cost))
    cost, held = cost[order], held[order]
    keep = np.ones(len(cost), dtype=bool)
    if len(cost) > 1:
        keep[1:] = held[1:] < np.minimum.accumulate(held)[:-1]
    return (cost[keep], held[keep], *(e[order][keep] for e in extra))


def _coarsen(cost, held, target: int):
    """Round W down to a grid so that about ``target`` states remain (a looser relaxation)."""
    span = float(held.max() - held.min()) or 1.0
    grid = span / target
    rounded = np.floor((held - held.min()) / grid) * grid + held.min()
    idx = np.arange(len(cost))
    c2, h2, keep = _pareto(cost, rounded, idx)
    return c2, h2, keep


__all__ = ["Bound", "sequential_bound"]
