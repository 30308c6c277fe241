"""The training step's recipe: accumulation, zero_grad, amp (+GradScaler), clipping, optimizer implementation.

Each recipe is profiled, planned at a budget between checkpointing everything and nothing, and
verified: the measured peak fits the budget, the prediction is within 2% of it, and the
gradients equal the unplanned model's. See NOTE [ Peak-memory model ], "Recipe".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from planner.act.api import budget_with_headroom, graph_for, headroom_for, min_feasible_bytes, plan_from_profile
from planner.act.verify import verify
from planner.cli.app import app
from planner.model.schema import Plan, Profile, Recipe
from planner.profiling import profile
from planner.profiling.measure import make_optimizer, make_step
from solvers.cost_model import simulate
from tests.model_files import TINY_MODEL

pytestmark = pytest.mark.usefixtures("one_thread", "bytes_only")
"""What these tests check is bytes, gradients and the recipe: one intra-op thread and the fewest dispatch-timing rounds (tests/conftest.py)."""

PREDICTION_TOLERANCE = 0.02


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(128, 384), nn.GELU(), nn.Linear(384, 128)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(128, 8))


def _inputs() -> torch.Tensor:
    return torch.randn(1024, 128, generator=torch.Generator().manual_seed(0))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


RECIPES = {
    "accumulation 4": Recipe(grad_accum=4),
    "zero_grad(set_to_none=False)": Recipe(zero_grad_set_to_none=False),
    "bf16 autocast": Recipe(amp="bf16"),
    "fp16 + GradScaler, clipping": Recipe(amp="fp16", clip_grad_norm=1.0),
    "all together, fused": Recipe(grad_accum=2, amp="bf16", clip_grad_norm=0.5, optimizer_impl="fused"),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_is_predicted_and_fits(name: str):
    recipe = RECIPES[name]
    model, x = _mlp(), _inputs()
    prof = profile(model, x, loss_fn=_loss, device="cpu", optimizer="adamw", recipe=recipe, steps=1)
    assert prof.recipe == recipe
    g = graph_for(prof)
    budget = budget_with_headroom((simulate(g, []).peak_bytes + min_feasible_bytes(g)) // 2, headroom_for(prof))
    plan = plan_from_profile(prof, budget)
    assert plan.recipe == recipe and (plan.checkpoints or plan.selective)
    report = verify(model, plan, inputs=x, loss_fn=_loss, device="cpu", steps=1)
    assert report.measured_peak_bytes <= budget, report.rows()
    error = abs(report.predicted_peak_bytes - report.measured_peak_bytes) / report.measured_peak_bytes
    assert error <= PREDICTION_TOLERANCE, (name, report.predicted_peak_bytes, report.measured_peak_bytes)
    assert report.max_grad_diff == 0.0 and report.ok, report.problems
    assert report.recipe == recipe and report.measured_recomputes == report.planned_recomputes


def test_accumulated_gradients_alive_in_every_window_of_the_model():
    """With accumulation every probe counts all gradients; the plain step's forward counts none."""
    model, x = _mlp(), _inputs()
    plain = graph_for(profile(model, x, loss_fn=_loss, device="cpu", optimizer="none", steps=1))
    accum = graph_for(profile(model, x, loss_fn=_loss, device="cpu", optimizer="none", steps=1,
                              recipe=Recipe(grad_accum=3)))
    est_plain, est_accum = simulate(plain, []), simulate(accum, [])
    assert est_accum.grads_bytes == accum.graph["grads_bytes"]
    assert est_accum.peak_bytes >= est_plain.peak_bytes + accum.graph["grads_bytes"] // 2
    assert est_accum.recompute_ms == 0 and accum.graph["micro_batches"] == 3


def test_accumulation_of_one_batch_gives_the_plain_gradients():
    """loss / N over N equal micro-batches (N a power of two) sums to the plain step's gradients exactly."""
    grads = {}
    for recipe in (Recipe(), Recipe(grad_accum=4)):
        model = _mlp()
        calls = []
        model[0].register_forward_hook(lambda *_: calls.append(1))
        make_step(model, _inputs(), loss_fn=_loss, recipe=recipe)()
        grads[recipe.grad_accum] = [p.grad.clone() for p in model.parameters()]
        assert len(calls) == recipe.grad_accum
    assert all(torch.equal(a, b) for a, b in zip(grads[1], grads[4]))


def test_zero_grad_set_to_none_false_keeps_gradients():
    model = _mlp()
    opt = make_optimizer("sgd", model)
    step = make_step(model, _inputs(), loss_fn=_loss, optimizer=opt, recipe=Recipe(zero_grad_set_to_none=False))
    step()
    first = model[0][0].weight.grad
    step()
    assert model[0][0].weight.grad is first  # zeroed in place, never freed


def test_optimizer_implementation_flags():
    model = _mlp()
    assert make_optimizer("adamw", model, impl="fused").param_groups[0]["fused"] is True
    assert make_optimizer("adamw", model, impl="foreach").param_groups[0]["foreach"] is True


def test_recipe_describe_and_differences():
    assert Recipe().describe() == ("grad_accum 1, zero_grad(set_to_none=True), no amp, no clipping, "
                                   "default optimizer")
    diffs = Recipe(grad_accum=4, amp="fp16").differences(Recipe(clip_grad_norm=1.0))
    assert diffs == ["grad_accum: plan has 4, training uses 1", "amp: plan has 'fp16', training uses None",
                     "clip_grad_norm: plan has None, training uses 1.0"]
    assert Recipe().differences(Recipe()) == []
    assert Recipe(clip_grad_norm=1.0).differences(Recipe(clip_grad_norm=0.5)) == []  # the norm: same kernels
    assert Recipe().flags() == []
    assert Recipe(grad_accum=4, zero_grad_set_to_none=False, amp="bf16", clip_grad_norm=1.0,
                  optimizer_impl="fused").flags() == ["--grad-accum 4", "--no-zero-grad-set-to-none", "--amp bf16",
                                                      "--clip-grad-norm 1", "--fused"]


def test_version_1_files_load_as_the_default_recipe(tmp_path: Path):
    ref = Path(__file__).resolve().parents[1] / "profiles" / "models" / "gpt2-tiny-cpu.json"
    data = json.loads(ref.read_text())
    assert data["schema_version"] == 1 and "recipe" not in data
    data["amp"] = "bf16"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    prof = Profile.load(path)
    assert prof.recipe == Recipe(amp="bf16") and prof.amp == "bf16"
    plan = plan_from_profile(prof, 10**12)
    assert Plan.model_validate_json(plan.to_json()).recipe == Recipe(amp="bf16")


runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recipe") / "model.py"
    path.write_text(TINY_MODEL)
    return path


def test_cli_records_prints_and_verifies_the_recipe(tiny_model: Path, tmp_path: Path):
    plan_file, prof_file = tmp_path / "plan.json", tmp_path / "profile.json"
    flags = ["--grad-accum", "2", "--no-zero-grad-set-to-none", "--clip-grad-norm", "1", "--foreach"]
    r = runner.invoke(app, ["profile", str(tiny_model), "--device", "cpu", "--steps", "1", "-o", str(prof_file),
                            *flags])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["plan", "--budget", "1GB", "--profile", str(prof_file), "-o", str(plan_file)])
    assert r.exit_code == 0, r.output
    assert "step: adamw, grad_accum 2, zero_grad(set_to_none=False), no amp, clip_grad_norm 1, foreach" in r.output
    plan = Plan.load(plan_file)
    assert plan.recipe == Recipe(grad_accum=2, zero_grad_set_to_none=False, clip_grad_norm=1.0,
                                 optimizer_impl="foreach")
    r = runner.invoke(app, ["show", str(plan_file)])
    assert "grad_accum 2" in r.output
    r = runner.invoke(app, ["verify", str(tiny_model), str(plan_file), "--device", "cpu", "--steps", "1"])
    assert r.exit_code == 0, r.output
    assert "step: grad_accum 2, zero_grad(set_to_none=False)" in r.output
    r = runner.invoke(app, ["plan", "--budget", "1GB", "--profile", str(prof_file), "--grad-accum", "4"])
    assert r.exit_code == 2 and "measured for another training step: --grad-accum 4 (the profile has 2)" in r.output


@pytest.mark.parametrize("flags, needle", [
    (["--fused", "--foreach"], "--fused and --foreach"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive, finite max norm"),
    (["--clip-grad-norm", "inf"], "drop it for a step without clipping"),
    (["--optimizer", "none", "--fused"], "--optimizer is none"),
    (["--grad-accum", "0"], "--grad-accum"),
])
def test_cli_refuses_bad_recipes(tiny_model: Path, flags: list[str], needle: str):
    r = runner.invoke(app, ["plan", "--budget", "1GB", str(tiny_model), *flags])
    assert r.exit_code == 2 and needle in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("seed", range(12))
def test_ilp_program_is_the_cost_model_with_the_recipe_terms(seed: int):
    """Gradients alive and autocast's casts: the ILP's probes equal simulate's on every antichain,
    and the DP's recurrence never under-counts (NOTE [ Peak-memory model ], "Recipe")."""
    import random

    from planner.model.graph import build_graph
    from planner.model.synthetic import random_dag, synthetic_profile
    from solvers.chain import chain_terms
    from solvers.cost_model import CostModel
    from solvers.dp import solve as dp_solve
    from solvers.ilp import build_program, probe_values
    from tests.solver_checks import antichains

    rng = random.Random(seed)
    prof = synthetic_profile(random_dag(rng, rng.randint(2, 6), p_nested=0.4))
    io = {t for u in prof.units for t in (*u.input_ids, *u.output_ids)}
    saved = sorted({s.tensor_id for s in prof.saves} - io)  # a parameter's cast lives inside a module
    casts = set(rng.sample(saved, k=len(saved) // 2))
    prof = prof.model_copy(update={
        "tensors": [t.model_copy(update={"autocast_cached": t.id in casts}) for t in prof.tensors],
        "recipe": Recipe(grad_accum=rng.choice([1, 4]), amp="bf16"), "amp": "bf16"})
    g = build_graph(prof, granularity=1, nested=True)
    program = build_program(g)
    for chosen in map(frozenset, antichains(g)):
        mine = probe_values(program, chosen)
        for name, total, *_ in CostModel.of(g).probes(chosen):
            assert mine[name] == pytest.approx(total, abs=1e-6), (name, sorted(chosen))
    flat = build_graph(prof)
    assert not chain_terms(flat).exact or not casts
    for budget in (simulate(flat, []).peak_bytes, (simulate(flat, []).peak_bytes + min_feasible_bytes(flat)) // 2):
        sol = dp_solve(flat, budget)
        if sol.status != "infeasible":
            assert simulate(flat, sol.checkpointed).peak_bytes <= budget
