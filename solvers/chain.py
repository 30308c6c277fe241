"""The cost model as a chain recurrence along the leaves (``ChainTerms``): what the DP runs on.

On a graph without nested candidates, NOTE [ Peak-memory model ] (``solvers/cost_model.py``)
decomposes into per-leaf terms: the held bytes each window adds given the choices of the leaf
and its predecessor, and each window's largest probe on top of them. Exact on chains; where a
tensor is held by non-adjacent leaves every term over-counts, so a plan that fits under the
recurrence fits under ``simulate``.

Example::

    terms = chain_terms(g)               # computed once per graph, cached on its CostModel
    terms.exact, terms.choices(0)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import networkx as nx

from solvers.cost_model import ALIVE_SEQ, CostModel
from solvers.kept import kept_at
from solvers.errors import SolverError


@dataclass(frozen=True)
class ChainTerms:
    """The model of NOTE [ Peak-memory model ] on a graph without nesting, as a chain recurrence.

    Each leaf i takes a choice c_i: 0 = not checkpointed, 1 = checkpointed, 2 + j = selective
    with policy j of its ``menu`` (Rule 9; ``choices(i)`` in all). With
    H_i = sum_{j<=i} delta[j][c_{j-1}][c_i] (c_{-1} = 0), the peak is max(const_bytes,
    max_i H_i + k[i][c_i], H_{n-1} + tail_delta[c_{n-1}] + tail_k); the recompute is
    sum_i cost_ms[i][c_i]. Exact when ``exact``; otherwise every term over-counts (a tensor
    held by two non-adjacent leaves is counted twice), so a plan that fits under the
    recurrence fits under ``simulate``.
    """

    leaves: tuple[str, ...]
    forward_ms: tuple[float, ...]
    delta: tuple[tuple[tuple[int, ...], ...], ...]  # delta[i][prev][cur]
    k: tuple[tuple[int, ...], ...]  # k[i][cur]
    tail_delta: tuple[int, ...]
    tail_k: int
    const_bytes: int
    exact: bool
    cost_ms: tuple[tuple[float, ...], ...]  # cost_ms[i][cur]: the recompute of that choice (one micro-batch)

    def choices(self, i: int) -> int:
        return len(self.k[i])

    def plan(self, picks: list[int]) -> tuple[list[str], dict[str, int]]:
        """(checkpointed leaves, selective {leaf: policy}) of one choice per leaf."""
        full = [x for x, c in zip(self.leaves, picks) if c == 1]
        return full, {x: c - 2 for x, c in zip(self.leaves, picks) if c >= 2}


def chain_terms(g: nx.DiGraph) -> ChainTerms:
    """Decompose the cost model along the leaves; the DP solver runs on this.

    Computed once per graph (``CostModel.chain_terms``), so budget sweeps pay for it once.
    """
    return CostModel.of(g).chain_terms


# A holding of a tensor, for the chain recurrence: (window, leaf index or None, kind). kind 0 is a
# save (None: glue code outside every leaf, or autocast's cast or an output the caller keeps (NOTE [
# Outputs the caller drops ]) kept as if held), dropped when its
# leaf is a region; kind 1 is the input a region keeps; kind 2 + j an output policy j keeps.
_Holding = tuple[int, "int | None", int]


def build_chain_terms(model: CostModel) -> ChainTerms:
    """The recurrence of ``model`` (``CostModel.chain_terms`` calls this once per graph)."""
    g = model.graph
    if any(not a["leaf"] for _, a in g.nodes(data=True)):
        raise SolverError("the chain recurrence needs a graph without nested candidates (nested=False)")
    hold, exact_holdings = _chain_holdings(model)
    delta, tail_delta, exact_deltas = _chain_deltas(model, hold)
    # autocast's casts no one holds stay alive to the forward's end (NOTE [ Peak-memory model ], Rule 8), the
    # outputs no unit takes until the step's code drops them (NOTE [ Outputs the caller drops ]):
    # (made, dropped, bytes, tensor)
    # a kept input of a region the caller keeps too (Rule 5 there) counts as kept whatever is chosen: an over-count
    unsaved_casts = ([(c, ALIVE_SEQ, model.tensor_bytes[t], t) for c, t in model.casts if t not in hold]
                     + [(c, r, model.tensor_bytes[t], t) for c, t, r in model.dropped])
    exact_holdings = exact_holdings and not any(t in hold for _, t, _ in model.dropped)
    last_end = model.leaf_end_seq[-1] if model.leaves else -1
    menus = [_menu(g, x) for x in model.leaves]
    return ChainTerms(
        leaves=model.leaves,
        forward_ms=tuple(g.nodes[x]["forward_ms"] for x in model.leaves),
        delta=tuple(tuple(tuple(row) for row in d) for d in delta),
        k=_chain_peaks(model, hold, unsaved_casts), tail_delta=tuple(tail_delta),
        tail_k=max(model.tail_forward_base_bytes + sum(b for c, r, b, _ in unsaved_casts
                                                             if kept_at(c, r, ALIVE_SEQ, last_end)),
                   model.tail_backward_base_bytes),
        const_bytes=model.rank.opt_static_bytes, exact=exact_holdings and exact_deltas,
        cost_ms=tuple((0.0, g.nodes[x]["forward_ms"], *(p.recompute_ms for p in m))
                      for x, m in zip(model.leaves, menus)),
    )


def _menu(g: nx.DiGraph, node: str) -> tuple[Any, ...]:
    """The node's selective policies (``solvers.selective.Policy``), empty without op records."""
    return tuple(g.nodes[node].get("menu", ()))


def _in_force(h: _Holding, c: int) -> bool:
    """Whether holding ``h`` holds its tensor when its leaf's choice is ``c`` (ChainTerms)."""
    _, leaf, kind = h
    if leaf is None:
        return True
    return c == 0 if kind == 0 else c >= 1 if kind == 1 else c == kind


def _chain_holdings(model: CostModel) -> tuple[dict[int, list[_Holding]], bool]:
    """Every tensor's holdings (NOTE [ Peak-memory model ], Rule 3), by window; False when
    autocast's casts or outputs the caller keeps are kept as if held (the recurrence over-counts them)."""
    window = lambda seq: bisect.bisect_left(model.leaf_end_seq, seq)  # noqa: E731  (len(leaves) = tail)
    leaf_pos = {x: i for i, x in enumerate(model.leaves)}
    hold: dict[int, list[_Holding]] = {}
    exact = True
    for seq, t, containers in model.saves:
        leaf = leaf_pos[containers[0]] if containers else None
        if (t in model.cast_ids or t in model.dropped_ids) and leaf is not None:
            leaf, exact = None, False  # kept as if held: the recurrence over-counts them
        hold.setdefault(t, []).append((window(seq), leaf, 0))
    for i, x in enumerate(model.leaves):
        for t in model.graph.nodes[x]["input_ids"]:
            hold.setdefault(t, []).append((i, i, 1))
        for j, pol in enumerate(_menu(model.graph, x)):
            for seq, t in pol.cached:
                hold.setdefault(t, []).append((window(seq), i, 2 + j))
    return hold, exact


def _chain_deltas(model: CostModel, hold: dict[int, list[_Holding]]) -> tuple[list, list[int], bool]:
    """The held bytes each window adds, delta[w][previous choice][choice], and the tail's; exact unless
    a tensor is held by two non-adjacent leaves (then it is counted twice: an over-count)."""
    n = len(model.leaves)
    nch = [2 + len(_menu(model.graph, x)) for x in model.leaves]
    delta = [[[0] * nch[w] for _ in range(nch[w - 1] if w else 2)] for w in range(n)]
    tail_delta = [0] * (nch[n - 1] if n else 2)
    exact = True
    for t, hs in hold.items():
        b = model.tensor_bytes[t]
        for w in sorted({h[0] for h in hs}):
            here = [h for h in hs if h[0] == w]
            before = [h for h in hs if h[0] < w]
            if any(h[1] is None for h in before):
                continue  # a glue holding earlier is always in force: counted there
            far = [h for h in before if h[1] is not None and h[1] < w - 1]
            prev = [h for h in before if h[1] == w - 1]
            for a_prev in range(nch[w - 1] if w else 2):  # before leaf 0 the choice is 0: rows equal
                exact = exact and not far  # counted again although a far leaf may hold it
                if any(_in_force(h, a_prev) for h in prev):
                    continue
                if w == n:  # the tail window holds glue holdings only: always in force
                    tail_delta[a_prev] += b
                    continue
                for cur in range(nch[w]):
                    if any(_in_force(h, cur) for h in here):
                        delta[w][a_prev][cur] += b
    return delta, tail_delta, exact


def _chain_peaks(model: CostModel, hold: dict[int, list[_Holding]],
                 unsaved_casts: list[tuple[int, int, int, int]]) -> tuple[tuple[int, ...], ...]:
    """k[i][choice]: window i's largest probe on top of the held bytes (forward with its in-flight
    tensors and the unheld casts made so far, backward, and for a region the leaf's recompute)."""
    k = []
    for i, (x, end) in enumerate(zip(model.leaves, model.leaf_end_seq)):
        recs = [0, model.recomputed_bytes(x, end)] + [model.recomputed_bytes(x, end, pol.cached_ids)
                                                       for pol in _menu(model.graph, x)]
        terms = []
        in_flight = model.graph.nodes[x]["in_flight_ids"]
        # kept tensors in flight are counted as such, as ``CostModel.probes`` counts them
        kept = sum(b for c, r, b, t in unsaved_casts if kept_at(c, r, end) and t not in in_flight)
        for cur, rec in enumerate(recs):
            out_extra = sum(model.tensor_bytes[t] for t in in_flight
                            if not any(h[0] <= i and _in_force(h, cur) for h in hold.get(t, ())))
            fwd = model.forward_base(i, cur == 1) + out_extra + kept  # NOTE [ Checkpointed forward windows ]
            bwd = model.backward_base_bytes[i] + rec
            rcp = (model.recompute_static_bytes(x) + rec + model.replay_in_flight(x)
                   + model.recompute_transient_bytes(x)) if cur else 0
            terms.append(max(fwd, bwd, rcp))
        k.append(tuple(terms))
    return tuple(k)


__all__ = ["ChainTerms", "build_chain_terms", "chain_terms"]
