"""Tied calls: a module called more than once is one checkpoint decision (NOTE [ Tied calls ]).
Pure Python over the graph; ``solvers.cost_model`` re-exports these.

Example::

    tie_groups(g)                 # (("encoder.layer", "encoder.layer#1"), ...)
    close_ties(g, ["encoder.layer"])
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx


# NOTE [ Tied calls ]
#
# A module called more than once in a step (weights shared across depth as in ALBERT, a block
# reused around a stack) is one graph node per call, but the applier wraps the module's
# forward, so every call is checkpointed or none is. Its calls are one decision: a valid
# checkpoint set holds all of a tie group (graph nodes with one FQN) or none of it, and
# solvers search only such sets (the ILP with x equal across a group, the DP by fixing each
# group's bit). Why not extend a plan to every call after solving: the extension costs the
# recompute of the added calls, which the solver never weighed, and may break the budget.


def tie_groups(g: nx.DiGraph) -> tuple[tuple[str, ...], ...]:
    """Graph nodes that are calls of one module (the same FQN), two or more, in forward order."""
    from solvers.cost_model import CostModel  # it keeps the groups of a graph it was built for

    model = CostModel.attached(g)
    if model is not None:
        return model.tie_groups
    by_fqn: dict[str, list[str]] = {}
    for n in sorted(g.nodes, key=lambda n: g.nodes[n]["order"]):
        by_fqn.setdefault(g.nodes[n]["fqn"], []).append(n)
    return tuple(tuple(ns) for ns in by_fqn.values() if len(ns) > 1)


def is_tied(g: nx.DiGraph, chosen: Iterable[str]) -> bool:
    """True when ``chosen`` holds every call of each module it names, or none (NOTE [ Tied calls ])."""
    s = set(chosen)
    return all(s.isdisjoint(group) or s.issuperset(group) for group in tie_groups(g))


def close_ties(g: nx.DiGraph, chosen: Iterable[str]) -> list[str]:
    """``chosen`` with every call of each module it names, as the applier would checkpoint it
    (see NOTE [ Tied calls ]). A module with a call inside another chosen node is dropped."""
    out = set(chosen)
    for group in tie_groups(g):
        if out.isdisjoint(group):
            continue
        rest = out - set(group)
        fits = all(enclosing(g, n, rest) is None and not any(enclosing(g, m, {n}) for m in rest)
                   for n in group)
        out = rest | set(group) if fits else rest
    return sorted(out, key=lambda n: g.nodes[n]["order"])


def enclosing(g: nx.DiGraph, n: str, among) -> str | None:
    """The nearest ancestor of graph node ``n`` that is in ``among``, or None."""
    p = g.nodes[n]["parent"]
    while p is not None and p not in among:
        p = g.nodes[p]["parent"]
    return p


__all__ = ["close_ties", "enclosing", "is_tied", "tie_groups"]
