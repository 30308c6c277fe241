"""Baselines: checkpoint nothing, everything, or every k-th block.

"Every layer" is what Hugging Face's ``gradient_checkpointing_enable()`` does; "every k-th
layer" is torchtitan's selective option. They take no decision from the budget; the status
only says whether the result fits. O(S log S) each (one ``simulate``).

Example::

    solve_every_k(graph, 2 << 30, k=2)        # every other block, judged by the cost model
"""

from __future__ import annotations

import time

import networkx as nx

from solvers.base import Solution, judged, top_level


def solve_none(g: nx.DiGraph, budget_bytes: int, **_: object) -> Solution:
    """Checkpoint nothing: the fastest step and the highest peak."""
    t0 = time.perf_counter()
    return judged("none", g, [], budget_bytes, time.perf_counter() - t0)


def solve_all(g: nx.DiGraph, budget_bytes: int, **_: object) -> Solution:
    """Checkpoint every top-level candidate."""
    t0 = time.perf_counter()
    return judged("all", g, top_level(g), budget_bytes, time.perf_counter() - t0)


def indexed_blocks(g: nx.DiGraph) -> list[str]:
    """Top-level candidates that belong to the largest group of repeated blocks (same class,
    indexed names), in forward order; all top-level candidates when there is no such group."""
    tops = top_level(g)
    groups: dict[tuple[str, str], list[str]] = {}
    for n in tops:
        a = g.nodes[n]
        head, _, last = a["fqn"].rpartition(".")
        if last.isdigit():
            groups.setdefault((head, a["module_type"]), []).append(n)
    blocks = [ids for ids in groups.values() if len(ids) >= 2]
    if not blocks:
        return tops
    return sorted((n for ids in blocks for n in ids), key=lambda n: g.nodes[n]["order"])


def solve_every_k(g: nx.DiGraph, budget_bytes: int, *, k: int = 2, **_: object) -> Solution:
    """Checkpoint every k-th repeated block (blocks 0, k, 2k, ...)."""
    t0 = time.perf_counter()
    chosen = indexed_blocks(g)[::k]
    return judged(f"every-{k}", g, chosen, budget_bytes, time.perf_counter() - t0)


__all__ = ["indexed_blocks", "solve_all", "solve_every_k", "solve_none"]
