"""Every solver through one validator; the DP against brute force; hypothesis over random graphs."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solvers.chain import chain_terms
from solvers.cost_model import close_ties, simulate, tie_groups
from solvers.errors import SolverError
from planner.model.graph import build_graph
from planner.model.synthetic import SynUnit, random_chain, random_dag, random_tied, synthetic_profile
from solvers import SOLVERS
from solvers.dp import min_feasible
from tests.solver_checks import best_recompute, brute_force, check_solution

HEURISTICS = ("none", "all", "sqrt", "sqrt-greedy", "every-2")


def _budgets(points):
    lo = min(p for p, _ in points)
    hi = max(p for p, _ in points)
    return [lo - 1, lo, lo + (hi - lo) // 3, (lo + hi) // 2, hi]


@functools.cache
def _contract_case(kind: str, seed: int):
    """A small graph of each shape the solvers meet, with every checkpoint set's (peak, recompute)."""
    rng = random.Random(seed)
    if kind == "chain":
        g = build_graph(synthetic_profile(random_chain(rng, 7)))
    elif kind == "dag":  # skip connections: tensors held across non-adjacent blocks
        g = build_graph(synthetic_profile(random_dag(rng, 7, p_skip=0.5)))
    else:  # blocks and their parts are both candidates
        g = build_graph(synthetic_profile(random_dag(rng, 3, p_nested=0.8)), granularity=1, nested=True)
    return g, brute_force(g)


@pytest.mark.parametrize("name", sorted(SOLVERS))
@pytest.mark.parametrize("kind", ["chain", "dag", "nested"])
@pytest.mark.parametrize("seed", range(4))
def test_every_solver_meets_the_contract(name, kind, seed):
    """The contract of solvers/__init__.py on chains, general DAGs and nested candidates; a plan
    called optimal has the least recompute of all checkpoint sets that fit. Only the DP may refuse
    a graph (nested candidates), with a SolverError."""
    g, points = _contract_case(kind, seed)
    for budget in _budgets(points):
        try:
            sol = SOLVERS[name](g, budget)
        except SolverError:
            assert name == "dp" and g.graph.get("nested"), f"{name} refused a {kind} graph"
            continue
        check_solution(g, sol, budget)
        if sol.status == "optimal":
            best = best_recompute(points, budget)
            assert best is not None and abs(sol.recompute_ms - best) <= 1e-9 * max(1.0, best), (
                f"{name} on a {kind} graph at {budget}: 'optimal' recompute {sol.recompute_ms}, least is {best}")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 12))
def test_dp_is_optimal_on_chains(seed, n):
    rng = random.Random(seed)
    g = build_graph(synthetic_profile(random_chain(rng, n)))
    assert chain_terms(g).exact
    points = brute_force(g)
    lowest = min(p for p, _ in points)
    for budget in _budgets(points):
        sol = SOLVERS["dp"](g, budget)
        check_solution(g, sol, budget)
        best = best_recompute(points, budget)
        if best is None:
            assert sol.status == "infeasible"
        else:
            assert sol.status == "optimal"
            assert sol.recompute_ms == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert sol.min_feasible_bytes == lowest


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 9))
def test_chain_recurrence_never_undercounts(seed, n):
    """On DAGs the DP's recurrence may over-count, never under-count: its plans always fit."""
    rng = random.Random(seed)
    g = build_graph(synthetic_profile(random_dag(rng, n)))
    points = brute_force(g)
    for budget in _budgets(points):
        sol = SOLVERS["dp"](g, budget)
        check_solution(g, sol, budget)
        if chain_terms(g).exact and best_recompute(points, budget) is not None:
            assert sol.status == "optimal"


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 10))
def test_optimal_beats_heuristics_and_is_monotone(seed, n):
    rng = random.Random(seed)
    g = build_graph(synthetic_profile(random_chain(rng, n)))
    points = brute_force(g)
    prev = None
    for budget in sorted(_budgets(points)):
        opt = SOLVERS["dp"](g, budget)
        if opt.status == "infeasible":
            continue
        for name in HEURISTICS:
            h = SOLVERS[name](g, budget)
            if h.status != "infeasible":
                assert opt.recompute_ms <= h.recompute_ms + 1e-9, name
        if prev is not None:
            assert opt.recompute_ms <= prev + 1e-9, "more budget needed more recompute"
        prev = opt.recompute_ms


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 30))
def test_solvers_are_deterministic(seed, n):
    rng = random.Random(seed)
    g = build_graph(synthetic_profile(random_dag(rng, n)))
    budget = (simulate(g, []).peak_bytes + min_feasible(chain_terms(g))[0]) // 2
    for name, fn in SOLVERS.items():
        a, b = fn(g, budget), fn(g, budget)
        assert (a.checkpointed, a.status, a.peak_bytes) == (b.checkpointed, b.status, b.peak_bytes), name


def test_chain_recurrence_equals_simulate_on_chains():
    rng = random.Random(7)
    for _ in range(30):
        g = build_graph(synthetic_profile(random_chain(rng, rng.randrange(1, 8))))
        t = chain_terms(g)
        for chosen in _all_subsets(t.leaves):
            bits = [int(x in chosen) for x in t.leaves]
            assert _recurrence_peak(t, bits) == simulate(g, chosen).peak_bytes


def test_dp_min_feasible_matches_uniform_closed_form():
    """n identical blocks that save their input x and an internal tensor s. A block's replay runs
    beside the output's gradient (G_c in NOTE [ Peak-memory model ]); it stops at the block's last save,
    s, and the output, made after it (``output_saved`` False: the block ends like a Linear or a residual
    add), is never re-made (NOTE [ The replay stops at the last save ]). So checkpointing the last block,
    replayed as soon as backward starts, only adds the gradient: the lowest peak checkpoints all the others."""
    units = [SynUnit(name=f"h.{i}", saves=[1000], saves_inputs=True, output_bytes=100) for i in range(8)]
    g = build_graph(synthetic_profile(units, batch_bytes=0))
    lowest, bits = min_feasible(chain_terms(g))
    assert bits == [1] * 7 + [0]
    assert lowest == simulate(g, g.graph["leaves"][:7]).peak_bytes
    none = simulate(g, []).peak_bytes
    # held without checkpointing: 7 block inputs (100 B each; h.0 takes the batch) + 8 x 1000
    assert none == 7 * 100 + 8 * 1000
    # h.6's replay, once h.7's backward has freed h.7's input and saves: 6 inputs held, its 1000 B
    # recomputed and the output's gradient (the output is not re-made: the replay stops at s); the same
    # as h.7's own backward before it, 7 inputs held and h.7's 1000 B
    assert lowest == 6 * 100 + 1000 + 100
    # all checkpointed: h.7's replay beside the 7 inputs and its output's gradient
    assert simulate(g, g.graph["leaves"]).peak_bytes == 7 * 100 + 1000 + 100
    # a block whose last op saves its output (a ReLU) re-makes it: replay beside output and gradient
    saved = [SynUnit(name=f"h.{i}", saves=[1000], saves_inputs=True, output_bytes=100, output_saved=True)
             for i in range(8)]
    gs = build_graph(synthetic_profile(saved, batch_bytes=0))
    assert simulate(gs, gs.graph["leaves"]).peak_bytes == 7 * 100 + 1000 + 2 * 100


def _all_subsets(items):
    import itertools

    for bits in itertools.product((0, 1), repeat=len(items)):
        yield [x for x, b in zip(items, bits) if b]


def _recurrence_peak(t, bits):
    h, peak, prev = 0, t.const_bytes, 0
    for i, c in enumerate(bits):
        h += t.delta[i][prev][c]
        peak = max(peak, h + t.k[i][c])
        prev = c
    return max(peak, h + t.tail_delta[prev] + t.tail_k)


# ----------------------------------------------------------------------------- tied calls

EXACT = ("dp", "ilp", "auto")


@pytest.mark.parametrize("seed", range(8))
def test_modules_called_twice_are_one_decision_for_every_solver(seed):
    """NOTE [ Tied calls ]: every solver returns all calls of a module or none (check_solution
    refuses the rest), and the exact ones reach brute force's optimum over such sets."""
    rng = random.Random(seed)
    g = build_graph(synthetic_profile(random_tied(rng, 4, shared=2)))
    assert tie_groups(g)
    points = brute_force(g)  # tied sets only: check_checkpoint_set refuses the others
    for budget in _budgets(points):
        best = best_recompute(points, budget)
        for name, solve in SOLVERS.items():
            sol = solve(g, budget)
            check_solution(g, sol, budget)
            if name not in EXACT or (name == "dp" and not chain_terms(g).exact):
                continue
            if best is None:
                assert sol.status == "infeasible", name
            else:
                assert sol.status == "optimal", name
                assert sol.recompute_ms == pytest.approx(best, rel=1e-9, abs=1e-12), name


def test_shared_module_around_blocks_is_planned_as_one_unit():
    """Issue #11: ``s`` called before and after 4 blocks. Its first call is cheap to recompute
    (1 ms), its second is not (50 ms). Planning calls separately picked ``s`` and extended the
    plan to ``s#1`` afterwards (51 ms, labelled optimal) while one block alone fits at 5 ms."""
    from planner.act.api import budget_with_headroom, plan_from_profile

    shared = dict(module_type="Shared", saves=[6000], saves_inputs=True, param_bytes=64)
    units = [SynUnit(name="s", forward_ms=1.0, **shared),
             *(SynUnit(name=f"h.{i}", forward_ms=5.0, saves=[5000], saves_inputs=True) for i in range(4)),
             SynUnit(name="s#1", forward_ms=50.0, **shared)]
    prof = synthetic_profile(units)
    g = build_graph(prof)
    assert tie_groups(g) == (("s", "s#1"),)
    budget = max(simulate(g, ["h.0"]).peak_bytes, simulate(g, ["s", "s#1"]).peak_bytes)  # both fit
    for name in EXACT:
        sol = SOLVERS[name](g, budget)
        check_solution(g, sol, budget)
        assert (sol.status, sol.recompute_ms) == ("optimal", 5.0), name
    plan = plan_from_profile(prof, budget_with_headroom(budget))
    assert plan.solver.status == "optimal" and plan.predicted.recompute_ms == 5.0
    assert "s" not in plan.checkpoints


def test_heuristics_checkpoint_every_call_of_what_they_pick():
    rng = random.Random(3)
    g = build_graph(synthetic_profile(random_tied(rng, 6, shared=1)))
    calls = tie_groups(g)[0]
    for name in HEURISTICS:
        sol = SOLVERS[name](g, simulate(g, []).peak_bytes)
        assert set(calls) <= set(sol.checkpointed) or not set(calls) & set(sol.checkpointed), name


def test_a_split_tie_is_refused_by_the_cost_model():
    units = [SynUnit(name="s", module_type="S"), SynUnit(name="h.0"), SynUnit(name="h.1"),
             SynUnit(name="s#1", module_type="S")]
    g = build_graph(synthetic_profile(units))
    with pytest.raises(SolverError, match="calls of module 's'"):
        simulate(g, ["s"])
    assert close_ties(g, ["s", "h.0"]) == ["s", "h.0", "s#1"]
