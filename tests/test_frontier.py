"""`remat frontier` and `remat compare`: JSON schema, the frontier's shape, tables, the plot.

Synthetic profiles (no torch run) for everything but one small real model profiled on the CPU.
"""

from __future__ import annotations

import io
import itertools
import json
import random
import sys
from pathlib import Path

import pytest
from rich.console import Console

from planner.cli import output
from planner.act.api import DEFAULT_HEADROOM, budget_with_headroom, graph_for, usable_budget
from planner.act.frontier import BASELINES, OPTIMAL_SOLVERS, budgets, default_solvers, run_solver
from solvers import SOLVERS
from solvers.cost_model import simulate
from solvers.dp import min_feasible_bytes
from planner.model.synthetic import random_chain, random_dag, synthetic_profile
from tests.conftest import CHAIN_MIN_FEASIBLE_BYTES, invoke
from tests.model_files import TINY_MODEL



POINT_KEYS = {"solver", "budget_bytes", "peak_bytes", "recompute_ms", "status", "checkpointed"}


def _profile(tmp_path: Path, units, name: str = "profile.json") -> Path:
    path = tmp_path / name
    synthetic_profile(units).save(path)
    return path


@pytest.fixture(params=[("chain", 1), ("chain", 2), ("dag", 3), ("dag", 4)], ids=lambda p: f"{p[0]}-{p[1]}")
def any_profile(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    kind, seed = request.param
    rng = random.Random(seed)
    units = random_chain(rng, 10) if kind == "chain" else random_dag(rng, 10)
    return _profile(tmp_path, units)


def _frontier_json(profile: Path, *extra: str) -> dict:
    r = invoke("frontier", "--profile", profile, "--json", "--quiet", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# ----------------------------------------------------------------------------- frontier


def test_frontier_json_schema(profile_path: Path, tmp_path: Path):
    out = tmp_path / "frontier.json"
    r = invoke("frontier", "--profile", profile_path, "--points", "6", "-o", out, "--quiet")
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["kind"] == "remat-frontier" and data["budget_bytes"] is None
    assert data["optimal_solver"] in OPTIMAL_SOLVERS
    assert data["min_feasible_bytes"] <= data["no_checkpoint_peak_bytes"] and data["step_ms"] > 0
    grid = sorted({p["budget_bytes"] for p in data["points"]})
    assert 1 < len(grid) <= 6
    held = [budget_with_headroom(data[k], data["headroom"]) for k in ("min_feasible_bytes", "no_checkpoint_peak_bytes")]
    assert data["headroom"] == DEFAULT_HEADROOM and [grid[0], grid[-1]] == held
    for p in data["points"]:
        assert set(p) == POINT_KEYS, p
        assert p["status"] in ("optimal", "feasible", "infeasible")
    solvers = {p["solver"] for p in data["points"]}
    assert set(BASELINES) <= solvers and {"sqrt", "sqrt-greedy"} <= solvers
    for s in solvers:  # every solver at every budget
        assert sorted(p["budget_bytes"] for p in data["points"] if p["solver"] == s) == grid, s
    assert "wrote" in r.stdout and "budget" in r.stdout  # the table, then the file


def test_optimal_curve_is_monotone_and_within_budget(any_profile: Path):
    data = _frontier_json(any_profile, "--points", "10")
    opt = data["optimal_solver"]
    curve = sorted((p for p in data["points"] if p["solver"] == opt), key=lambda p: p["budget_bytes"])
    fits = [p for p in curve if p["status"] != "infeasible"]
    assert fits, "the optimal solver found nothing at any budget"
    if fits[-1]["status"] == "optimal":  # the top budget is the no-checkpoint peak
        assert fits[-1]["recompute_ms"] == 0.0
    for a, b in itertools.pairwise(fits):
        assert b["recompute_ms"] <= a["recompute_ms"] + 1e-9, f"{opt}: more budget, more recompute: {a} -> {b}"
    # once a budget fits, every larger one does
    first = next(i for i, p in enumerate(curve) if p["status"] != "infeasible")
    assert all(p["status"] != "infeasible" for p in curve[first:]), curve


def test_no_plan_that_claims_to_fit_is_over_its_budget(any_profile: Path):
    data = _frontier_json(any_profile, "--points", "8")
    for p in data["points"]:
        if p["status"] != "infeasible":
            assert p["peak_bytes"] <= p["budget_bytes"], p
        else:
            # a point fits when its peak is within the budget less the headroom (``Tradeoff.headroom``)
            usable, _ = usable_budget(p["budget_bytes"], data["headroom"])
            assert p["peak_bytes"] > usable or p["solver"] in OPTIMAL_SOLVERS, p


def test_frontier_table_and_quiet(profile_path: Path):
    r = invoke("frontier", "--profile", profile_path, "--points", "4")
    assert r.exit_code == 0, r.output
    assert "frontier of" in r.stdout and "lowest feasible" in r.stdout
    assert "recompute ms per step / predicted peak" in r.stdout
    for name in ("none (no checkpointing)", "all (every layer)", "every-2", "% of step"):
        assert name in r.stdout, name
    assert "swept 4 budgets" in r.stderr
    q = invoke("frontier", "--profile", profile_path, "--points", "4", "--quiet")
    assert q.exit_code == 0 and q.stderr == ""


def test_frontier_solvers_option(profile_path: Path):
    data = _frontier_json(profile_path, "--points", "3", "--solvers", "sqrt,all")
    assert {p["solver"] for p in data["points"]} == {"sqrt", *BASELINES}
    r = invoke("frontier", "--profile", profile_path, "--solvers", "dp,bogus")
    assert r.exit_code == 2 and "unknown solver 'bogus'" in r.stderr


def test_frontier_needs_a_model_or_a_profile():
    r = invoke("frontier")
    assert r.exit_code == 2 and "give a model file" in r.stderr


def test_sweep_grid_spans_min_feasible_to_no_checkpoint(profile_path: Path):
    from planner.model.schema import Profile

    g = graph_for(Profile.load(profile_path))
    grid = budgets(g, 5)
    assert grid == sorted(grid) and len(grid) == 5


# ----------------------------------------------------------------------------- compare


def test_compare_table(profile_path: Path):
    r = invoke("compare", "--profile", profile_path, "--budget", "10MB")
    assert r.exit_code == 0, r.output
    assert "budget 10MB = 10485760 bytes (10.00 MiB)" in r.stdout
    optimal = default_solvers()[0]  # whatever is registered: auto once the ILP is, else dp
    for word in ("solver", "status", "peak", "% budget", "recompute ms", "% step", "#ckpt",
                 optimal, "sqrt-greedy", "every-2", f"least recompute within the budget: {optimal}"):
        assert word in r.stdout, word


def test_compare_json(profile_path: Path):
    r = invoke("compare", "--profile", profile_path, "--budget", "10MB", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["kind"] == "remat-compare" and data["budget_bytes"] == 10485760
    names = [p["solver"] for p in data["points"]]
    assert names[0] in OPTIMAL_SOLVERS and set(BASELINES) <= set(names)
    for p in data["points"]:
        assert set(p) == POINT_KEYS and p["budget_bytes"] == 10485760
        assert (p["peak_bytes"] <= 10485760) == (p["status"] != "infeasible"), p
    best = min((p for p in data["points"] if p["status"] != "infeasible"), key=lambda p: p["recompute_ms"])
    assert best["solver"] == data["optimal_solver"] or best["recompute_ms"] == next(
        p["recompute_ms"] for p in data["points"] if p["solver"] == data["optimal_solver"])
    assert "budget 10MB" in r.stderr  # the echo moves to stderr under --json


def test_compare_says_when_nothing_fits(profile_path: Path):
    r = invoke("compare", "--profile", profile_path, "--budget", "1MB")
    assert r.exit_code == 0, r.output
    lowest = budget_with_headroom(CHAIN_MIN_FEASIBLE_BYTES)  # as remat plan says it
    assert f"nothing fits; the lowest feasible budget is {lowest} bytes" in r.stdout


# ----------------------------------------------------------------------------- plot


def test_missing_matplotlib_is_one_line_before_profiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    r = invoke("frontier", model, "--device", "cpu", "--plot", tmp_path / "f.png")
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == [
        "error: --plot needs matplotlib, which is not installed: pip install 'remat[plot]'"]
    assert not (tmp_path / "f.png").exists()


def test_plot_is_a_png(profile_path: Path, tmp_path: Path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "frontier.png"
    r = invoke("frontier", "--profile", profile_path, "--points", "5", "--plot", png, "--quiet")
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in r.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_plot_to_a_missing_folder_fails_before_work(profile_path: Path, tmp_path: Path):
    r = invoke("frontier", "--profile", profile_path, "--plot", tmp_path / "nope" / "f.png")
    assert r.exit_code == 2 and "does not exist" in r.stderr


# ----------------------------------------------------------------------------- real model, progress


def test_frontier_on_a_real_tiny_model(tmp_path: Path):
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    r = invoke("frontier", model, "--device", "cpu", "--steps", "1", "--points", "4", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)  # stdout is JSON only: logs went to stderr
    assert data["model"] == "Sequential" and data["device"].startswith("cpu")
    assert "profiling" in r.stderr and "timing step 1/1" in r.stderr and "swept" in r.stderr


def test_stages_draw_a_bar_on_a_terminal_and_lines_elsewhere():
    buf = io.StringIO()
    tty = Console(file=buf, force_terminal=True, width=100)
    with output.stages(tty, "profiling", total=3) as say:
        for m in ("a", "b", "c", "d"):  # one more stage than announced: the bar grows
            say(m)
    assert "4/4" in buf.getvalue()
    buf = io.StringIO()
    with output.stages(Console(file=buf, force_terminal=False), "profiling", total=3) as say:
        say("warm-up step 1/1")
    assert buf.getvalue().splitlines() == ["profiling", "warm-up step 1/1"]
    buf = io.StringIO()
    with output.counter(Console(file=buf, force_terminal=True, width=100), "sweeping") as tick:
        tick(5, 10)
        tick(10, 10)
    assert "10/10" in buf.getvalue()


def test_a_plan_of_selective_regions_is_drawn_at_its_peak_and_recompute(menu_profile):
    """The DP's plan at a budget between none and every block: with selective regions in it, its point
    has the peak and recompute ``simulate`` gives the whole plan (regions included), within the budget."""
    g = graph_for(menu_profile)
    lo, hi = min_feasible_bytes(g), simulate(g, []).peak_bytes
    for budget in (lo + (hi - lo) * k // 8 for k in range(1, 8)):
        sol = SOLVERS["dp"](g, budget)
        if sol.selective:
            break
    else:
        pytest.fail("no budget gave the DP a plan with selective regions")
    point = run_solver(g, "dp", budget)
    est = simulate(g, sol.checkpointed, sol.selective)
    assert (point.peak_bytes, point.recompute_ms) == (est.peak_bytes, round(est.recompute_ms, 6))
    assert point.peak_bytes <= budget and point.recompute_ms > 0
    assert point.checkpointed == len(sol.checkpointed) + len(sol.selective)
