"""The reference profiles in profiles/models/ load, and every registered solver plans on them.

They were made by ``benchmarks/make_reference_profiles.py`` (three on fake tensors for an
H100, one measured on the CPU). Nothing here imports torch: planning on a saved profile must
not need it, and a fresh interpreter proves it (``test_planning_never_imports_torch``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.act.api import graph_for, min_feasible_bytes, plan_from_profile, solve_graph
from solvers.cost_model import simulate
from planner.model.schema import Profile
from profiles import MODELS_DIR

ROOT = Path(__file__).resolve().parent.parent
PROFILES = sorted(MODELS_DIR.glob("*.json"))
EXPECTED = {"gpt2-small-h100", "llama2-7b-h100", "resnet50-h100", "gpt2-tiny-cpu"}


def _solvers() -> list[str]:
    from solvers import SOLVERS

    return ["dp", *(name for name in ("ilp", "auto") if name in SOLVERS)]


def _mid_budget(g) -> int:
    """Halfway between the lowest feasible peak and the peak without checkpointing."""
    return (min_feasible_bytes(g) + simulate(g, []).peak_bytes) // 2


def test_the_reference_set_is_there_and_small():
    assert {p.stem for p in PROFILES} >= EXPECTED
    for path in PROFILES:
        assert path.stat().st_size < 5 * 2**20, f"{path.name} is over 5 MB"


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_profile_is_what_its_name_says(path: Path):
    prof = Profile.load(path)
    if path.stem.endswith("-h100"):
        assert (prof.device, prof.target, prof.step.peak_source) == ("meta", "h100-sxm", "tracker")
        assert prof.unit("<root>").flops > 0 and prof.step.step_ms > 0
    else:
        assert prof.device == "cpu" and prof.target is None
    assert prof.step.measured_peak_bytes == simulate(graph_for(prof), []).peak_bytes, \
        "without checkpointing the cost model must reproduce the profiled peak"


@pytest.mark.parametrize("solver", _solvers())
@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_solver_plan_fits_a_mid_budget(path: Path, solver: str):
    prof = Profile.load(path)
    g = graph_for(prof, solver=solver)
    budget = _mid_budget(g)
    sol = solve_graph(g, budget, solver=solver, time_limit_s=30)
    assert sol.status in ("optimal", "feasible"), f"{solver} on {path.stem}: {sol.status} {sol.detail}"
    est = simulate(g, sol.checkpointed, sol.selective)  # op-level policies too: schema 3 profiles have op records
    assert est.peak_bytes <= budget, f"{solver} on {path.stem}: {est.peak_bytes} > {budget}"
    assert est.peak_bytes == sol.peak_bytes, f"{solver} on {path.stem} misreports its peak"


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_plan_from_profile_at_a_mid_budget(path: Path):
    prof = Profile.load(path)
    budget = _mid_budget(graph_for(prof))
    plan = plan_from_profile(prof, budget, solver="dp", headroom=0.0)
    assert plan.predicted.peak_bytes <= budget
    assert plan.target == prof.target


_NO_TORCH = """
import json, sys
sys.path.insert(0, {root!r})
from tests.test_reference_profiles import PROFILES, _mid_budget, _solvers
from planner.act.api import graph_for, solve_graph
from solvers.cost_model import simulate
from planner.model.schema import Profile
out = {{}}
for path in PROFILES:
    prof = Profile.load(path)
    for solver in _solvers():
        g = graph_for(prof, solver=solver)
        budget = _mid_budget(g)
        sol = solve_graph(g, budget, solver=solver, time_limit_s=30)
        out[f"{{path.stem}}/{{solver}}"] = simulate(g, sol.checkpointed, sol.selective).peak_bytes <= budget
print(json.dumps({{"fits": out, "torch": "torch" in sys.modules}}))
"""


def test_planning_never_imports_torch():
    r = subprocess.run([sys.executable, "-c", _NO_TORCH.format(root=str(ROOT))], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(result["fits"].values()), result["fits"]
    assert len(result["fits"]) >= len(EXPECTED)
    assert result["torch"] is False, "planning on a saved profile imported torch"
