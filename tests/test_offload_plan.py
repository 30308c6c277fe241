"""Offload as a third choice in the cost model and the ILP (NOTE [ Peak-memory model ], Rule 10;
NOTE [ ILP formulation ], Rule 8), and the plan, API and CLI around it. Torch-free: planning runs on
the reference CPU profile, given a host link."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from planner.act.api import plan_from_profile
from planner.errors import BadInput, BudgetInfeasible
from planner.model.graph import build_graph
from planner.model.schema import Plan, Profile
from planner.sizes import format_bytes
from profiles import MODELS_DIR
from solvers.cost_model import CostModel, simulate, window_bytes
from solvers.errors import SolverError
from solvers.ilp import build_program, offload_var, probe_values, solve
from tests.conftest import invoke

LINK = 10e9
"""Bytes/s one way given to the reference profile (it predates the field)."""


def _profile(copy_engine: bool = False) -> Profile:
    prof = Profile.load(MODELS_DIR / "gpt2-tiny-cpu.json")
    return prof.model_copy(update={"host_link_bytes_per_s": LINK, "copy_engine": copy_engine})


def _graph(copy_engine: bool = False):
    return build_graph(_profile(copy_engine))


def _blocks(g) -> list[str]:
    return [n for n in g.graph["leaves"] if ".h." in n]


@pytest.mark.parametrize("copy_engine", [False, True])
def test_program_rows_equal_simulate_with_offload(copy_engine: bool):
    """Rule 8 is exact: every probe of the program equals simulate's on keep/recompute/offload mixes."""
    g = _graph(copy_engine)
    pg = build_program(g, offload=True)
    rng = random.Random(0)
    leaves = g.graph["leaves"]
    for _ in range(25):
        pick = {n: rng.choice("kco") for n in leaves}
        full = [n for n in leaves if pick[n] == "c"]
        off = [n for n in leaves if pick[n] == "o"]
        ours = probe_values(pg, frozenset(full + [offload_var(n) for n in off]))
        theirs = window_bytes(g, full, offloaded=off)
        assert {k: round(ours[k]) for k in theirs} == theirs, pick


def test_offload_terms_on_the_cpu():
    """No copy engine: nothing in transfer, both copies exposed; the host holds the distinct storages."""
    g = _graph()
    model = CostModel.of(g)
    blocks = _blocks(g)
    est = simulate(g, [], None, blocks)
    assert est.offloaded == blocks and est.recompute_ms == 0
    nbytes = [model.offload_bytes(b) for b in blocks]
    assert est.host_peak_bytes == model.host_bytes(blocks) == sum(nbytes)  # no storage saved by two blocks
    assert est.offload_ms == pytest.approx(sum(2 * b / LINK * 1e3 for b in nbytes))
    assert est.step_ms == pytest.approx(g.graph["step_ms"] + est.offload_ms)
    assert est.peak_bytes < simulate(g, blocks).peak_bytes < simulate(g, []).peak_bytes


def test_copy_engine_holds_the_transfer_and_hides_the_copy():
    g = _graph(copy_engine=True)
    model = CostModel.of(g)
    b = _blocks(g)[0]
    s = model.sync_leaf(b)
    fwd, bwd = model.hidden_ms(b)
    a = g.nodes[g.graph["leaves"][s]]
    assert (fwd, bwd) == (a["forward_ms"], a["backward_ms"])
    copy = model.copy_ms(b)
    assert model.exposed_ms(b) == pytest.approx(max(0, copy - fwd) + max(0, copy - bwd))
    on_cpu = window_bytes(_graph(), [], offloaded=[b])
    held = window_bytes(g, [], offloaded=[b])
    sync_leaf = g.graph["leaves"][s]
    assert held[f"forward of {sync_leaf}"] - on_cpu[f"forward of {sync_leaf}"] == model.offload_bytes(b)
    assert held[f"backward of {sync_leaf}"] - on_cpu[f"backward of {sync_leaf}"] == model.offload_bytes(b)


def test_ilp_with_offload_is_optimal_by_brute_force():
    """Over the blocks and the final norm (3^5 plans, the rest kept): the ILP's cost is the least."""
    g = _graph()
    units = [*_blocks(g), "transformer.ln_f"]
    budget = int(simulate(g, _blocks(g)).peak_bytes * 1.02)
    best = None
    for pick in itertools.product("kco", repeat=len(units)):
        full = [u for u, c in zip(units, pick) if c == "c"]
        off = [u for u, c in zip(units, pick) if c == "o"]
        est = simulate(g, full, None, off)
        if est.peak_bytes <= budget and (best is None or est.overhead_ms < best):
            best = est.overhead_ms
    sol = solve(g, budget, host_budget_bytes=1 << 40)
    assert sol.status == "optimal"
    assert sol.recompute_ms + sol.offload_ms <= best + 1e-6
    assert simulate(g, sol.checkpointed, sol.selective, sol.offloaded).peak_bytes == sol.peak_bytes <= budget


def test_below_every_layer_only_offload_fits():
    g = _graph()
    budget = int(simulate(g, _blocks(g)).peak_bytes * 0.97)
    assert solve(g, budget).status == "infeasible"
    sol = solve(g, budget, host_budget_bytes=1 << 40)
    assert sol.status == "optimal" and sol.offloaded and sol.peak_bytes <= budget
    tight = solve(g, budget, host_budget_bytes=sol.host_peak_bytes // 2)
    assert tight.status == "infeasible" or tight.host_peak_bytes <= sol.host_peak_bytes // 2


def test_plan_file_marks_offload_and_plans_without_it_are_unchanged(tmp_path):
    prof = _profile()
    g = build_graph(prof)
    budget = int(simulate(g, _blocks(g)).peak_bytes * 0.97 / (1 - 0.005)) + 1
    plan = plan_from_profile(prof, budget, offload=True, host_memory="1GB")
    assert plan.offload and plan.predicted.host_peak_bytes and plan.host_budget_bytes == 1 << 30
    u = plan.offload[0]
    assert u.host_bytes > 0 and u.d2h_ms == pytest.approx(u.host_bytes / LINK * 1e3, rel=1e-5)
    assert Plan.model_validate_json(plan.to_json()) == plan
    plain = plan_from_profile(prof, 10 * budget)
    text = plain.to_json()
    assert '"offload"' not in text and "host_" not in text and "offload_ms" not in text
    old = json.loads(text)
    assert Plan.model_validate(old).offload == []


def test_bad_offload_input_is_one_line():
    prof = _profile()
    with pytest.raises(BadInput) as e:
        plan_from_profile(prof, "1GB", host_memory="1GB")
    assert str(e.value) == "host_memory is the host budget of offloaded activations: add offload, or drop it"
    with pytest.raises(BadInput, match="has none: re-profile"):
        plan_from_profile(prof.model_copy(update={"host_link_bytes_per_s": None}), "1GB", offload=True)
    with pytest.raises(BadInput, match="needs host_memory SIZE"):
        plan_from_profile(prof.model_copy(update={"device": "meta", "target": "h100-sxm"}), "1GB", offload=True)
    with pytest.raises(BadInput, match="no offload choice"):
        plan_from_profile(prof, "1GB", offload=True, host_memory="1GB", solver="dp")
    g = build_graph(prof)
    budget = int(simulate(g, _blocks(g)).peak_bytes * 0.97 / (1 - 0.005)) + 1
    with pytest.raises(BudgetInfeasible, match="raise host_memory or budget") as e:
        plan_from_profile(prof, budget, offload=True, host_memory="1MB")
    assert "\n" not in str(e.value)


def test_dp_refuses_offload():
    with pytest.raises(SolverError, match="no offload choice"):
        from solvers.dp import solve as solve_dp

        solve_dp(_graph(), 1 << 30, host_budget_bytes=1 << 30)


def test_cli_plan_with_offload(tmp_path):
    path = tmp_path / "profile.json"
    _profile().save(path)
    g = build_graph(_profile())
    budget = int(simulate(g, _blocks(g)).peak_bytes * 0.97 / (1 - 0.005)) + 1
    r = invoke("plan", "--profile", path, "--budget", str(budget), "--offload", "--host-memory", "1GB",
               "-o", tmp_path / "plan.json")
    assert r.exit_code == 0, r.output
    assert "offload" in r.output and "host memory" in r.output
    assert Plan.load(tmp_path / "plan.json").offload
    r = invoke("show", tmp_path / "plan.json")
    assert r.exit_code == 0 and "offloaded" in r.output and "host memory" in r.output
    r = invoke("plan", "--profile", path, "--budget", "1GB", "--host-memory", "1GB")
    assert r.exit_code == 2 and "--offload" in r.output


def _offload_plan() -> Plan:
    prof = _profile()
    g = build_graph(prof)
    budget = int(simulate(g, _blocks(g)).peak_bytes * 0.97 / (1 - 0.005)) + 1
    return plan_from_profile(prof, budget, offload=True, host_memory="1GB")


def test_schema_version_rises_only_for_offload_plans(tmp_path):
    """An offload plan is written as version 5; every other plan keeps its version (3, or 4 bucketed)."""
    from planner.model.schema import OFFLOAD_PLAN_VERSION, PLAN_SCHEMA_VERSION, SINGLE_SHAPE_PLAN_VERSION

    plan = _offload_plan()
    assert json.loads(plan.to_json())["schema_version"] == OFFLOAD_PLAN_VERSION <= PLAN_SCHEMA_VERSION  # 6: compile
    plain = plan_from_profile(_profile(), 10 * plan.budget_bytes)
    assert json.loads(plain.to_json())["schema_version"] == SINGLE_SHAPE_PLAN_VERSION
    path = plan.save(tmp_path / "plan.json")
    assert Plan.load(path) == plan


@pytest.mark.parametrize("path, value, says", [
    ("offload.0.host_bytes", -1, "offload.0.host_bytes"),
    ("offload.0.exposed_ms", float("nan"), "offload.0.exposed_ms"),
    ("predicted.host_peak_bytes", 1 << 62, "predicted.host_peak_bytes"),
    ("offload.0.fqn", "no.such.module", "is not in the model"),
])
def test_offload_numbers_are_checked_on_load(tmp_path, path, value, says):
    """The offload fields join NOTE [ Numbers in files ]: one line naming the field."""
    from planner.errors import PlanFileError

    data = json.loads(_offload_plan().to_json())
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if key.isdigit() else node[key]
    node[last] = value
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=says.replace(".", r"\.")) as e:
        Plan.load(bad)
    assert "\n" not in str(e.value)


def test_offload_with_buckets_is_refused():
    from planner.act.api import plan_buckets

    prof = _profile()
    with pytest.raises(BadInput, match="plans one input shape"):
        plan_buckets([prof, prof], "1GB", offload=True, host_memory="1GB")


def test_why_explains_offloaded_units():
    """--why simulates the plan with its offloaded units, and says what each one's copies cost."""
    from planner.act.why import explain

    plan = _offload_plan()
    g = build_graph(_profile())
    lines = explain(g, plan)
    assert lines[0].startswith(f"peak {format_bytes(plan.predicted.peak_bytes)} ")
    for u in plan.offload:
        line = next(x for x in lines if x.startswith(f"{u.unit}: "))
        assert f"offloaded, {format_bytes(u.host_bytes)} to host memory" in line and "ms exposed" in line


# ----------------------------------------------------------------------------- remat frontier --offload


def _frontier(tmp_path, *extra: str) -> dict:
    path = tmp_path / "profile.json"
    _profile().save(path)
    r = invoke("frontier", "--profile", path, "--points", "5", "--json", "--quiet", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_frontier_with_offload_is_three_way(tmp_path):
    """The offload series starts below every recompute-only plan, and at every budget where both fit it
    costs no more than the optimal recompute-only plan (it may choose recompute too)."""
    from planner.act.frontier import OFFLOAD_BASELINE, OFFLOAD_SERIES

    data = _frontier(tmp_path, "--offload", "--host-memory", "1GB")
    assert data["host_budget_bytes"] == 1 << 30
    assert data["offload_min_feasible_bytes"] < data["min_feasible_bytes"]  # below every layer: only offload fits
    opt = data["optimal_solver"]
    by = {(p["solver"], p["budget_bytes"]): p for p in data["points"]}
    grid = sorted({p["budget_bytes"] for p in data["points"]})
    series = [by[(OFFLOAD_SERIES, b)] for b in grid]
    assert all(p["status"] == "optimal" and p["peak_bytes"] <= p["budget_bytes"] for p in series)
    assert by[(opt, grid[0])]["status"] == "infeasible" and series[0]["offloaded"] > 0
    for a, b in zip(series, series[1:]):
        assert b["recompute_ms"] + b["offload_ms"] <= a["recompute_ms"] + a["offload_ms"] + 1e-9
    for b in grid:
        mine, theirs = by[(OFFLOAD_SERIES, b)], by[(opt, b)]
        if theirs["status"] == "optimal":
            assert mine["recompute_ms"] + mine["offload_ms"] <= theirs["recompute_ms"] + 1e-6, b
        assert mine["host_peak_bytes"] <= 1 << 30
    every = by[(OFFLOAD_BASELINE, grid[-1])]
    assert every["offloaded"] == 4 and every["recompute_ms"] == 0 and every["offload_ms"] > 0


def test_frontier_without_offload_writes_no_offload_fields(tmp_path):
    data = _frontier(tmp_path)
    assert "host_budget_bytes" not in data and "offload_min_feasible_bytes" not in data
    assert all("offload_ms" not in p and "offloaded" not in p for p in data["points"])
    assert {p["solver"] for p in data["points"]}.isdisjoint({"ilp+offload", "offload-all"})


def test_frontier_offload_table_plot_and_bad_input(tmp_path):
    path = tmp_path / "profile.json"
    _profile().save(path)
    r = invoke("frontier", "--profile", path, "--points", "3", "--offload", "--host-memory", "1GB")
    assert r.exit_code == 0, r.output
    assert "ilp+offload" in r.stdout and "lowest feasible peak" in r.stdout and "offload-all" in r.stdout
    r = invoke("frontier", "--profile", path, "--host-memory", "1GB")
    assert r.exit_code == 2 and "--offload" in r.stderr and "\n" not in r.stderr.strip()
    r = invoke("frontier", "--profile", path, "--offload", "--world-size", "2", "--sharding", "ddp")
    assert r.exit_code == 2 and "one process" in r.stderr
    r = invoke("frontier", "--profile", MODELS_DIR / "gpt2-tiny-cpu.json", "--offload", "--host-memory", "1GB")
    assert r.exit_code == 2 and "re-profile" in r.stderr  # a profile without the host link
    pytest.importorskip("matplotlib")
    png = tmp_path / "f.png"
    r = invoke("frontier", "--profile", path, "--points", "3", "--offload", "--host-memory", "1GB", "--plot", png,
               "--quiet")
    assert r.exit_code == 0, r.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offload_is_refused_for_a_compiled_step(tmp_path):
    """A compiled step does not run saved-tensor hooks, so an offload plan for it would keep every tensor
    on the device it promised to move: refused before profiling (CLI) and on a compiled profile (API)."""
    from planner.act.offload_plan import OFFLOAD_EAGER
    from planner.model.schema import CompileInfo

    r = invoke("plan", "examples/llama.py", "--budget", "1GB", "--compile", "--offload", "-o", tmp_path / "p.json")
    assert r.exit_code == 2 and "profiling" not in r.output and not (tmp_path / "p.json").exists(), r.output
    assert r.stderr.strip() == "error: " + OFFLOAD_EAGER.format(offload="--offload", compile="--compile")
    compiled = _profile().model_copy(update={"compile": CompileInfo(backend="inductor", torch_version="2.13.0")})
    with pytest.raises(BadInput, match="saved-tensor hooks"):
        plan_from_profile(compiled, "1GB", offload=True, host_memory="1GB")
