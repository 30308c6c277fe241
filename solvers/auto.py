"""``auto``: the chain DP where its recurrence is exact, the ILP everywhere else.

- No nested candidates, ``chain_terms(g).exact`` and at most ``dp.MAX_TIED_GROUPS`` modules
  called more than once (NOTE [ Tied calls ]): the DP (``solvers/dp.py``), optimal and
  fast (a 200-unit chain in ~0.05 s).
- Otherwise (nested candidates, or tensors held across non-adjacent units, where the DP's
  recurrence over-counts): the ILP (``solvers/ilp/``), optimal when it proves it in time.
  When the time limit stops it with a plan, that plan ("feasible", with its gap); when it
  stops it before any plan, the DP's conservative plan on the graph's leaves (which fits under
  ``simulate`` whenever the DP finds one: its recurrence only over-counts).

``Solution.solver`` is the solver that produced the plan ("dp" or "ilp": 'auto' resolves to
one, as ``planner.model.schema.SolverInfo`` says); ``Solution.detail`` starts with why it was chosen.

Example::

    sol = solve_auto(graph, budget_bytes=2 << 30, time_limit_s=60)   # the DP on chains, the ILP otherwise
"""

from __future__ import annotations

import dataclasses
import time

import networkx as nx

from solvers.chain import chain_terms
from solvers.cost_model import CostModel, tie_groups
from solvers.base import Solution, judged
from solvers.dp import MAX_TIED_GROUPS
from solvers.dp import solve as solve_dp
from solvers.errors import SolverError
from solvers.ilp import solve as solve_ilp


# NOTE [ Offload and the DP ]
#
# Dispatch. With a host budget (``remat plan --offload``, ``frontier --offload``) ``auto`` runs the
# ILP, always; ``dp`` refuses with one line, as do the heuristics (``plan --offload --solver sqrt``
# is bad input: OFFLOAD_SOLVERS in planner/act/api.py). Without one, the rule above is unchanged,
# so plans without offload are byte for byte what they were (benchmarks/reference_plans.py).
# Why the ILP alone: the chain DP could carry offload on a chain without a copy engine, but
# only as a different recurrence, and nothing would be gained:
#   - host memory is a second budget over the whole step (Rule 8's host row): the DP's fronts
#     over (held bytes H, recompute R) per last bit become fronts over (H, R, host bytes), three
#     coordinates, whose size is no longer O(n) on a transformer chain and needs its own
#     discretisation to stay bounded (the host bytes rounded up, as H is today);
#   - with a copy engine (CUDA, meta targets) an offloaded unit's bytes stay on the device through
#     the forward of its sync leaf, the next leaf, and come back at that leaf's backward (NOTE
#     [ Peak-memory model ], Rule 10): leaf i's terms depend on the choices at i-1, i and i+1, where
#     ``chain_terms`` are written for two adjacent bits (``delta[i][c_{i-1}][c_i]``);
#   - the ILP is exact for offload already (its rows equal ``simulate``'s on every
#     keep/recompute/offload mix: tests/test_offload_plan.py) and fast where the DP would apply:
#     on the reference profiles (9 to 36 candidates, chains) an offload plan took 0.00-0.23 s of
#     CPU time against the DP's 0.00-0.08 s for recompute alone (measured 2026-12-02, load ~4).
# The DP's ``min_feasible_bytes`` stays the recompute-only lowest peak; offload's lowest peak is
# the ILP's minimum-peak search (``planner.act.frontier.offload_min_feasible_bytes``).


def solve_auto(g: nx.DiGraph, budget_bytes: int, *, time_limit_s: float | None = None,
               host_budget_bytes: int | None = None, **kw: object) -> Solution:
    """Least-recompute plan within ``budget_bytes``, by the DP or the ILP (see module docstring);
    with ``host_budget_bytes`` (offload allowed) the ILP, as the DP has no offload choice (NOTE
    [ Offload and the DP ])."""
    if host_budget_bytes is not None:
        sol = solve_ilp(g, budget_bytes, time_limit_s=time_limit_s, host_budget_bytes=host_budget_bytes, **kw)
        return _labelled(sol, "ilp: offload is on (the DP has no offload choice, NOTE [ Offload and the DP ])")
    nested = any(not a["leaf"] for _, a in g.nodes(data=True))
    many_tied = len(tie_groups(g)) > MAX_TIED_GROUPS
    if not nested and not many_tied and chain_terms(g).exact:
        sol = solve_dp(g, budget_bytes, **kw)
        return _labelled(sol, "dp: a chain without nested candidates, where the DP's recurrence is exact")
    why = ("nested candidates" if nested else
           f"more than {MAX_TIED_GROUPS} modules called more than once (the DP runs 2^k times)" if many_tied else
           "tensors held across non-adjacent units (the DP would over-count)")
    sol = solve_ilp(g, budget_bytes, time_limit_s=time_limit_s, **kw)
    if sol.status != "infeasible" or sol.stopped != "no_plan_in_time":
        return _labelled(sol, f"ilp: {why}")
    return _dp_fallback(g, budget_bytes, sol, why)


def _labelled(sol: Solution, why: str) -> Solution:
    return dataclasses.replace(sol, detail=f"auto chose {why}; {sol.detail}" if sol.detail else f"auto chose {why}")


def _dp_fallback(g: nx.DiGraph, budget_bytes: int, ilp: Solution, why: str) -> Solution:
    """The ILP found nothing in time: the DP on the leaves, whose plans fit whenever it finds one."""
    t0 = time.perf_counter()
    leaves = leaf_graph(g)
    try:
        dp = solve_dp(leaves, budget_bytes)
    except SolverError:  # too many modules called more than once for the DP: the ILP's answer stands
        return _labelled(ilp, f"ilp: {why}")
    seconds = ilp.seconds + time.perf_counter() - t0
    head = f"auto chose ilp: {why}; it found no plan in time, so the DP's conservative plan on the leaves"
    if dp.status == "infeasible":
        lowest = min((b for b in (ilp.min_feasible_bytes, dp.min_feasible_bytes) if b is not None), default=None)
        return dataclasses.replace(ilp, seconds=seconds, min_feasible_bytes=lowest,
                                   detail=f"{head}: none fits either (minimum feasible budget not proven); "
                                          f"{ilp.detail}")
    return judged("dp", g, dp.checkpointed, budget_bytes, seconds, status_if_fits="feasible",
                  detail=f"{head} (optimality not proven); {ilp.detail}")


def leaf_graph(g: nx.DiGraph) -> nx.DiGraph:
    """``g`` without its non-leaf candidates: the same cost model for plans made of leaves.

    A save is dropped iff a chosen candidate contains it, so for plans of leaves the containers
    that are not leaves never matter; every other probe term is per leaf or per chosen unit.
    """
    h = g.copy()
    h.graph.pop("cost_model", None)
    h.graph["nested"] = False
    h.remove_nodes_from([n for n, a in g.nodes(data=True) if not a["leaf"]])
    for order, n in enumerate(sorted(h.nodes, key=lambda n: g.nodes[n]["order"])):
        h.nodes[n].update(parent=None, order=order)
    h.graph["cost_model"] = CostModel.build(h)
    return h


__all__ = ["leaf_graph", "solve_auto"]
