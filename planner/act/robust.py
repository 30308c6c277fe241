"""Choices robust to measurement noise: NOTE [ Robust choice ]'s rules applied to a solver's plan
(each cost group's plan searched over its canonical plans, identical units arranged by a stated rule,
the spread of an op-level plan's advantage over whole modules).

Example::

    est = group_search(g, est, usable_bytes)       # each cost group's plan searched (Rule 3)
    est = canonical(g, est, usable_bytes)          # identical units arranged in forward order (Rule 2)
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import networkx as nx

from planner.model.schema import LOSS_ID, ROOT_ID
from solvers.cost_model import simulate, tie_groups
from solvers.selective import Policy, choice_spread_ms

# NOTE [ Robust choice ]
# A plan is worth what its worst figure is worth (NOTE [ Unit costs ], Rule 4). The menus take
# only policies that save more than their own spread (NOTE [ Selective menus ], Rule (noise));
# identical units have one price and one menu, so the solvers' deterministic order breaks their
# ties, never noise. One choice is left: op-level regions against whole modules, at one budget.
# Rule. When the solver's plan holds op-level regions, the budget is solved again over whole
# modules only; the op-level plan stands only when it is predicted cheaper than that plan by
# more than the spread of the difference (``difference_spread_ms``: per unit whose choice
# differs, the spread of the difference of its two prices, ``solvers.selective.choice_spread_ms``:
# its forward spread times the difference of the shares of it the two rerun, plus the dispatch
# figures' spreads times the difference of the calls they are paid on; times the micro-batches.
# A unit whole in one plan and op-level in the other counts its forward spread once, times the
# share its policy does not rerun: before, it counted it whole and again inside the policy's
# spread, which sent close cases to whole modules), and by more than ``OP_LEVEL_MIN_GAIN`` (15%)
# of the whole-module plan's overhead. Otherwise the whole-module plan is returned: within the
# noise, or within the time model's own accuracy, the two are the same price, and whole modules
# pay no selective dispatch, whose figures are the noisiest (differences of region times over
# the op calls, NOTE [ Selective dispatch cost ]). Why the second bound: the spreads say how far
# the figures stray, not how far the price of an op-level plan is from its measured step; that
# is the time model's error, asked to be within 15% (issue #30; ``verify``'s recompute check,
# RECOMPUTE_TOLERANCE) and measured -25 to +4% on op-level plans (docs/benchmarks.md,
# "Predicted recompute vs measured overhead"). A gain inside it is not known to be one: on
# fifteen Llama profiles under a burner the op-level plan was predicted 0.6 to 1.9 ms (2 to 5%)
# below whole layers, and the choice went with the spreads of each profile; GPT-2's and Qwen2's
# op-level plans were predicted 33 to 41 ms (40 to 50%) below theirs in every profile.
# Rule 2 (symmetry). Units of one cost group (identical figures, identical menus) are
# interchangeable in price but not in memory (where a held tensor sits changes the peak), and
# which of them a solver picks among equal plans is its search's accident (the ILP's peak
# tie-break has a time limit; on examples/llama.py it gave layers 0 and 2, 0 and 3 or, the DP,
# 0 and 1, at one recompute). So after solving, each group's choices are rearranged over its
# members in forward order: the strongest (full checkpointing, then the policies that keep
# fewest bytes) on the earliest members, or on the latest, whichever peaks lower (the earliest
# on a tie), is the plan when its peak is no higher than the solver's (the recompute is the same
# by construction); else the solver's arrangement stands. Top-level candidates only, not modules
# called more than once.
# Rule 3 (the group's plan, searched). Which members of a cost group a solver makes op-level,
# and on which policies, is its search's accident among near-equal plans: on five GPT-2 profiles
# its mixes (within 0.03% of the budget) held three or four op-level blocks, and the ILP stops at
# a time limit. So before Rule 1, when a group has op-level members, the group is re-chosen over
# its canonical plans: every multiset of choices for its n members (full checkpointing, each
# policy of the menu, none; at least one op-level), arranged strongest first on the earliest
# members or on the latest (Rule 2's arrangements). The one that fits at the least overhead
# (then the lower peak, then the stronger choices, then the earlier arrangement) replaces the
# group's choices; the rest of the plan stays. That is the exact optimum over the group's
# canonical plans, a function of the figures and not of the solver's search. Round 11 searched
# only the uniform plans (n_full members full, n_op on one policy k, the rest none); once Rule
# (material) steadied the menus (NOTE [ Selective menus ]), that restriction no longer bought
# steadiness and cost time: on ten kept profiles each under a burner, Qwen2's plans at the mid
# budget were predicted 51.6 ms on average with it and 42.3 ms with the canonical search (the
# modal plan in 6 of 10 and 7 of 10), GPT-2's 51.2 and 49.2 ms (10 of 10 either way), Llama's
# unchanged (whole layers; docs/benchmarks.md, "Same plan every time").
# Rule 3 (ties): the canonical plans within the spread of their difference from the least
# (``difference_spread_ms``) are one price to the measurement, and of them the group takes the
# one that peaks highest within the budget (then the least overhead): bytes are exact, and more
# bytes kept is less work rerun. Why: under a burner beside other jobs (load 3 to 5), four of five
# GPT-2 profiles had one menu, and their least canonical plans were three different ones; the
# plan least in two of them was within 1.2% of the least in the other two (docs/benchmarks.md,
# "Same plan every time", round 14). Which one the prices made least was noise; the highest
# peak within the spread was that one plan in all four.
# Groups with more than ``CANONICAL_SEARCH_PLANS`` canonical plans (2 C(n + m + 1, n) for a
# menu of m: a 12-layer group with a menu of five has 37,128) keep the solver's choices, which
# are optimal over the whole plan space, uniform plans included; round 11's uniform search for
# them (k x n^2 cost-model runs) could only return a plan the solver's costs no more than. Where
# no canonical plan fits (the solver's mix fits only in its own arrangement), the solver's
# choices stay. ``group_search``; Rule 2 then arranges the group.
# Rule 4 (the simplest choice within the noise). When after Rule 3 a group's op-level members
# run one policy (the one found cheapest at the budget), the menu's other policies and
# full checkpointing cost more time but keep fewer bytes, and where they cost more by less than
# the spread of the difference (``choice_spread_ms`` per member, times the micro-batches) the
# solver's pick was decided by noise: GPT-2's blocks kept 3 matmuls in one profile and 4 in the
# next, or ran whole (docs/benchmarks.md, "Same plan every time"). So the first of full
# checkpointing, then the menu's policies in its order (fewest kept bytes first) up to the
# solver's, that fits the budget within that spread of the solver's overhead replaces it:
# ``simplest_within_spread``. Where the figures separate the choices beyond their spread, the
# solver's choice stands.


OPTIMISERS = ("auto", "dp", "ilp")
"""Solvers that minimise the recompute: the rules of NOTE [ Robust choice ] apply to their plans."""


def canonical(g: nx.DiGraph, est: Any, usable: int) -> Any:
    """``est`` with each cost group's choices arranged by NOTE [ Robust choice ], Rule 2."""
    skip = _skipped(g, est)
    for members in _cost_groups(g):
        ranks = sorted(_rank(g, est, n) for n in members)
        if len(members) < 2 or skip.intersection(members) or ranks[0] == ranks[-1]:
            continue
        trials = [_with_ranks(g, est, dict(zip(members, order)))  # strongest on the earliest members, then
                  for order in (ranks, ranks[::-1])]                # on the latest
        best = min(trials, key=lambda t: t.peak_bytes)  # the earlier-first on a tie
        same_ms = abs(best.recompute_ms - est.recompute_ms) <= 1e-9 * max(1.0, est.recompute_ms)
        if same_ms and best.peak_bytes <= min(usable, est.peak_bytes):
            est = best
    return est


def _with_ranks(g: nx.DiGraph, est: Any, assign: dict[str, int]) -> Any:
    """``simulate`` of ``est`` with the members in ``assign`` given those choices as ranks (``_rank``:
    -1 full checkpointing, k policy k of the menu, the menu's length none), in ``assign``'s order."""
    full = [n for n in est.checkpointed if n not in assign] + [n for n, r in assign.items() if r == -1]
    sel = {n: k for n, k in est.selective.items() if n not in assign}
    sel.update({n: r for n, r in assign.items() if 0 <= r < len(g.nodes[n]["menu"])})
    return simulate(g, full, sel, est.offloaded)


def _rank(g: nx.DiGraph, est: Any, n: str) -> int:
    """A choice as a rank, strongest first: full checkpointing (-1), the menu's policies (fewest kept
    bytes first, the menu's order), no checkpoint (the menu's length)."""
    return -1 if n in est.checkpointed else est.selective.get(n, len(g.nodes[n]["menu"]))


def _top(g: nx.DiGraph, n: str) -> str:
    """The top-level candidate holding graph node ``n``."""
    while g.nodes[n]["parent"] is not None:
        n = g.nodes[n]["parent"]
    return n


def difference_spread_ms(g: nx.DiGraph, ops: Any, whole: Any) -> float:
    """The measured spread of ``ops``'s recompute less ``whole``'s (two ``Estimate`` on ``g``'s units;
    NOTE [ Robust choice ], Rule 1)."""
    def choice(est: Any, n: str) -> Policy | bool:
        return g.nodes[n]["menu"][est.selective[n]] if n in est.selective else n in est.checkpointed

    units = {*ops.checkpointed, *ops.selective, *whole.checkpointed, *whole.selective}
    return g.graph.get("micro_batches", 1) * sum(
        choice_spread_ms(choice(ops, n), choice(whole, n), g.nodes[n].get("forward_spread_ms", 0.0)) for n in units)


OP_LEVEL_MIN_GAIN = 0.15
"""An op-level plan stands against the whole-module plan only when predicted cheaper by more than this
share of the whole-module plan's overhead, and by more than the spread of the difference (NOTE
[ Robust choice ], Rule 1): the time model's accuracy, verify's RECOMPUTE_TOLERANCE."""


def op_level_stands(g: nx.DiGraph, ops: Any, whole: Any) -> bool:
    """Whether the op-level plan ``ops`` stands against the whole-module plan ``whole`` (two ``Estimate``
    on ``g``'s units; NOTE [ Robust choice ], Rule 1)."""
    gain = whole.overhead_ms - ops.overhead_ms
    return gain > difference_spread_ms(g, ops, whole) and gain > OP_LEVEL_MIN_GAIN * whole.overhead_ms


def simplest_within_spread(g: nx.DiGraph, est: Any, usable: int) -> Any:
    """``est`` with each cost group's policy replaced by full checkpointing, or by a policy earlier in
    its menu, where that fits and costs more by no more than the spread of the difference (NOTE
    [ Robust choice ], Rule 4)."""
    skip = _skipped(g, est)
    for members in _cost_groups(g):
        op_level = [n for n in members if n in est.selective]
        if skip.intersection(members) or not op_level or len({est.selective[n] for n in op_level}) > 1:
            continue
        a = g.nodes[op_level[0]]
        menu, k = a["menu"], est.selective[op_level[0]]
        others = {n: j for n, j in est.selective.items() if n not in op_level}
        for alt in (-1, *range(k)):  # full checkpointing, then the menu's order up to the solver's policy
            trial = simulate(g, [*est.checkpointed, *op_level], others, est.offloaded) if alt < 0 else \
                simulate(g, est.checkpointed, {**others, **{n: alt for n in op_level}}, est.offloaded)
            spread = g.graph.get("micro_batches", 1) * len(op_level) * choice_spread_ms(
                menu[k], alt < 0 or menu[alt], a.get("forward_spread_ms", 0.0))
            if trial.peak_bytes <= usable and trial.overhead_ms - est.overhead_ms <= spread:
                est = trial
                break
    return est


def group_search(g: nx.DiGraph, est: Any, usable: int) -> Any:
    """``est`` with each cost group that has op-level members re-chosen over its canonical plans where
    they are at most ``CANONICAL_SEARCH_PLANS`` (NOTE [ Robust choice ], Rule 3)."""
    skip = _skipped(g, est)
    for members in _cost_groups(g):
        if skip.intersection(members) or not any(n in est.selective for n in members):
            continue
        if canonical_plans(g, members) <= CANONICAL_SEARCH_PLANS:
            est = _best_canonical(g, est, usable, members) or est
    return est


CANONICAL_SEARCH_PLANS = 8192
"""Cost groups with up to this many canonical plans (multisets of choices, two arrangements each) are
re-chosen over all of them (Rule 3): about 0.1 ms of cost model each on a 4-layer decoder."""


def canonical_plans(g: nx.DiGraph, members: list[str]) -> int:
    """How many canonical plans a cost group has: multisets of n choices out of m + 2, two arrangements."""
    return 2 * math.comb(len(members) + len(g.nodes[members[0]]["menu"]) + 1, len(members))


def _best_canonical(g: nx.DiGraph, est: Any, usable: int, members: list[str]) -> Any | None:
    """The canonical plan of one cost group (a multiset of choices: full checkpointing -1, policy k of
    the menu, none m; strongest first on the earliest members or on the latest; at least one
    op-level) that fits ``usable`` at the highest peak among those within the spread of their difference
    from the least overhead, then the least overhead, then the stronger choices and the earlier
    arrangement; the rest of ``est`` kept. None when none fits."""
    m = len(g.nodes[members[0]]["menu"])
    found = []
    for ranks in itertools.combinations_with_replacement(range(-1, m + 1), len(members)):
        if all(r in (-1, m) for r in ranks):
            continue  # no op-level member: whole modules are Rule 1's to weigh
        sides = (members, members[::-1]) if ranks[0] != ranks[-1] else (members,)  # one choice: one arrangement
        for side, order in enumerate(sides):
            trial = _with_ranks(g, est, dict(zip(order, ranks)))
            if trial.peak_bytes <= usable:
                found.append(((round(trial.overhead_ms, 9), trial.peak_bytes, ranks, side), trial))
    if not found:
        return None
    key, least = min(found, key=lambda f: f[0])
    near = [f for f in found if f[0][0] - key[0] <= difference_spread_ms(g, f[1], least)]  # Rule 3 (ties)
    return min(near, key=lambda f: (-f[0][1], *f[0]))[1]


def _cost_groups(g: nx.DiGraph) -> list[list[str]]:
    """Top-level candidates with one cost group, forward time and menu, two or more, in forward order."""
    from solvers.base import top_level

    groups: dict[tuple, list[str]] = {}
    for n in top_level(g):
        a = g.nodes[n]
        if a.get("cost_group") and n not in (ROOT_ID, LOSS_ID):
            menu = tuple((p.recompute_ms, p.kept_bytes, p.saved) for p in a["menu"])
            groups.setdefault((a["cost_group"], a["forward_ms"], menu), []).append(n)
    return [members for members in groups.values() if len(members) > 1]


def _skipped(g: nx.DiGraph, est: Any) -> set[str]:
    """Candidates the rules leave as the solver chose: calls of one module, groups with a nested choice,
    offloaded ones (they move with their own copy time)."""
    skip = {n for group in tie_groups(g) for n in group}
    skip |= {_top(g, c) for c in [*est.checkpointed, *est.selective] if g.nodes[c]["parent"] is not None}
    return skip | {_top(g, c) for c in est.offloaded}


__all__ = ["canonical", "canonical_plans", "CANONICAL_SEARCH_PLANS", "difference_spread_ms", "group_search",
           "OP_LEVEL_MIN_GAIN", "op_level_stands", "OPTIMISERS", "simplest_within_spread"]
