"""The runtime shape guard of ``apply_plan`` (NOTE [ Runtime shape guard ]): larger batches than
planned warn once (or raise under guard="error"); equal and smaller ones pass silently."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from planner.act.applier import apply_plan
from planner.errors import BadInput, PlanMismatch
from planner.model.fingerprint import fingerprint
from planner.model.schema import Plan, Predicted, SolverInfo

VOCAB, WIDTH = 64, 16
PLANNED = (4, 32)
"""Batch rows x tokens the plan was made for."""


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def batch(rows: int, tokens: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, tokens), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def planned_model(guard: str = "warn"):
    torch.manual_seed(0)
    model = TinyLM()
    fp = fingerprint(model, batch(*PLANNED))
    predicted = Predicted(peak_bytes=1 << 20, params_bytes=0, grads_bytes=0, optimizer_bytes=0,
                          activations_bytes=1 << 20, recompute_ms=0.0, step_ms=0.0)
    plan = Plan(fingerprint=fp, fingerprint_digest=fp.digest(), budget_bytes=1 << 30, checkpoints=["blocks.0"],
                solver=SolverInfo(name="manual", status="feasible"), predicted=predicted)
    return model, apply_plan(model, plan, guard=guard)


def step(model: nn.Module, rows: int, tokens: int) -> list[str]:
    """One training step's forward and backward (gradients set to None first); the guard's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.zero_grad()
        model(**batch(rows, tokens)).backward()
    return [str(w.message) for w in caught if "remat" in str(w.message)]


@pytest.mark.parametrize("shape", [PLANNED, (2, 32), (4, 8), (1, 1)], ids=["equal", "fewer-rows", "fewer-tokens", "one"])
def test_equal_and_smaller_batches_pass_silently(shape):
    model, handle = planned_model()
    assert step(model, *shape) == []
    assert handle.recompute_count == 1  # the plan is in force


@pytest.mark.parametrize("shape", [(8, 32), (4, 64)], ids=["more-rows", "more-tokens"])
def test_a_larger_batch_warns_once_with_both_shapes(shape):
    model, _ = planned_model()
    (message,) = step(model, *shape)
    assert f"planned {list(PLANNED)}, got {list(shape)}" in message and "input_ids" in message
    assert "largest shape" in message
    assert step(model, *shape) == []  # once


def test_guard_error_raises_on_a_larger_batch_and_not_on_smaller():
    model, _ = planned_model("error")
    assert step(model, 2, 16) == []
    with pytest.raises(PlanMismatch, match=r"input labels: planned \[4, 32\], got \[4, 33\]"):
        model(**batch(4, 33))
    with pytest.raises(PlanMismatch):  # every time, not once
        model(**batch(4, 33))


def test_guard_off_evaluation_and_remove_check_nothing():
    model, handle = planned_model("off")
    assert step(model, 16, 64) == []
    model, handle = planned_model()
    with torch.no_grad():  # evaluation batches may be larger: no backward, no planned peak
        model(**batch(16, 64))
    handle.remove()
    assert step(model, 16, 64) == []


def test_unknown_guard_is_bad_input():
    with pytest.raises(BadInput, match="guard='loud' is unknown"):
        planned_model("loud")


def test_batches_of_the_last_passed_shapes_are_not_bound_again(monkeypatch):
    """Binding the call to forward's signature was most of the hook's cost, every step; a batch of the
    shapes that passed last is known to pass."""
    from planner.act.shape_guard import ShapeGuard

    bound = []
    named = ShapeGuard.named_arguments
    monkeypatch.setattr(ShapeGuard, "named_arguments", lambda self, a, k: bound.append(1) or named(self, a, k))
    model, _ = planned_model()
    for _ in range(3):
        assert step(model, *PLANNED) == []
    assert len(bound) == 1
    (message,) = step(model, 8, 32)  # larger: still seen
    assert "planned [4, 32], got [8, 32]" in message and len(bound) == 2
