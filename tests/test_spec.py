"""StepSpec and SolveSpec (planner/spec.py): one object per stage, and the profiling path the
library picks from it, so that the Python API does what the CLI does (a device-memory cap included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import planner
from planner.errors import BadInput
from planner.model.schema import Recipe
from planner.spec import SolveSpec, StepSpec, profiling_path, solve_spec, step_spec
from tests.model_files import TINY_MODEL


@pytest.mark.parametrize("step, device_type, path", [
    (StepSpec(), "cpu", "memory-safe"),
    (StepSpec(recipe=Recipe(amp="bf16")), "cuda", "memory-safe"),
    (StepSpec(recipe=Recipe(grad_accum=2)), "cpu", "plain"),
    (StepSpec(device="meta", target="h100"), "meta", "meta"),
    (StepSpec(device_memory_bytes=1 << 20), "cpu", "capped"),
    (StepSpec(device_memory_bytes=1 << 20), "cuda", "memory-safe"),
])
def test_the_library_picks_the_profiling_path(step, device_type, path):
    assert profiling_path(step, device_type) == path


def test_specs_are_frozen_and_name_unknown_fields():
    step = StepSpec(device="cpu")
    with pytest.raises(AttributeError):
        step.device = "cuda"  # type: ignore[misc]
    assert step_spec(step, steps=1) == StepSpec(device="cpu", steps=1)
    assert solve_spec(None, solver="ilp") == SolveSpec(solver="ilp")
    with pytest.raises(BadInput, match=r"unknown StepSpec field\(s\) amp \(amp is a field of the recipe: "
                                       r"recipe=Recipe\(amp=...\)\)"):
        step_spec(None, amp="bf16")
    with pytest.raises(BadInput, match=r"unknown SolveSpec field\(s\) budget;"):
        solve_spec(None, budget=1)
    assert StepSpec(recipe=None).recipe == Recipe()  # None: the plain loop, as the keyword always meant


def _tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(TINY_MODEL)
    return path


def test_a_cap_is_refused_where_it_cannot_hold(tmp_path):
    mf = planner.load_model_file(_tiny(tmp_path))
    model, inputs = mf.build_model(), mf.example_inputs()
    with pytest.raises(BadInput, match=r"device_memory_bytes on the CPU profiles a model file in a child process: "
                                       r"pass planner.load_model_file\(path\)"):
        planner.profile(model, inputs, step=StepSpec(device="cpu", device_memory_bytes=1 << 30))
    with pytest.raises(BadInput, match="measures the plain training step"):
        planner.profile(mf, step=StepSpec(device="cpu", device_memory_bytes=1 << 30, recipe=Recipe(grad_accum=2)))
    with pytest.raises(BadInput, match="device meta runs nothing"):
        planner.profile(mf, step=StepSpec(device="meta", target="h100", device_memory_bytes=1 << 30))


def test_the_python_api_plans_within_a_cpu_memory_cap(tmp_path):
    """What ``remat plan --device cpu --device-memory`` does, from Python: the model file is
    profiled in a capped child process, and the plan is made on that profile."""
    mf = planner.load_model_file(_tiny(tmp_path))
    plan = planner.plan(mf, "64MB", step=StepSpec(device="cpu", device_memory_bytes=512 << 20, steps=1, threads=1),
                        solver="dp")
    assert plan.device == "cpu" and plan.solver.name == "dp" and plan.threads == 1
    full = planner.profile(mf, step=StepSpec(device="cpu", steps=1, threads=1))
    assert plan.fingerprint == full.fingerprint


def test_a_model_file_gives_the_inputs_and_the_loss(tmp_path):
    mf = planner.load_model_file(_tiny(tmp_path))
    prof = planner.profile(mf, step=StepSpec(device="cpu", steps=1))
    torch.manual_seed(0)
    same = planner.profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=1)
    assert prof.fingerprint == same.fingerprint
    assert [u.id for u in prof.units] == [u.id for u in same.units]
