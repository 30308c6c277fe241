"""The validation step (NOTE [ Validation step ]): what checkpointing does not free, and what it must not replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import planner
from planner.act.applier import apply_plan
from planner.model.graph import build_graph
from solvers.cost_model import simulate

WIDTH, HIDDEN, ROWS = 32, 128, 64
HIDDEN_BYTES = ROWS * HIDDEN * 4  # one float32 (ROWS, HIDDEN) activation
RNG_BYTES = torch.get_rng_state().nbytes  # the CPU RNG state every checkpointed region keeps for its replay


class KeepsHidden(nn.Module):
    """Stores an activation on itself (for inspection, say): it outlives a checkpointed region."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        h = torch.relu(self.up(x))
        self.last_hidden = h
        return x + self.down(h)


class Counts(nn.Module):
    """Counts its calls: a replay would count twice."""

    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(WIDTH, WIDTH), 0

    def forward(self, x):
        self.calls += 1
        return x + torch.tanh(self.lin(x))


class ReadsCache(nn.Module):
    """Computes a projection once per step into a cache it is handed, then reads it: the replay saves less."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, cache):
        if "k" not in cache:
            cache["k"] = torch.tanh(self.proj(x))
        return x + self.out(cache["k"] * x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([KeepsHidden() for _ in range(3)])
        self.counts, self.reads, self.head = Counts(), ReadsCache(), nn.Linear(WIDTH, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.reads(self.counts(x), {}))


def _net_and_batch():
    torch.manual_seed(0)
    return Net(), torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))


def _loss(out):
    return out.square().mean()


@pytest.fixture(scope="module")
def profiled():
    model, x = _net_and_batch()
    return planner.profile(model, x, loss_fn=_loss, device="cpu", optimizer="none", steps=1)


def test_retained_bytes_are_measured_per_unit(profiled):
    assert {r.unit: r.nbytes for r in profiled.retained} == {f"blocks.{i}": HIDDEN_BYTES for i in range(3)}
    assert profiled.region_state_bytes == RNG_BYTES
    g = build_graph(profiled)
    assert g.nodes["head"]["retained_bytes"] == RNG_BYTES  # every region keeps the RNG state


def test_unsafe_units_are_excluded_with_a_reason(profiled):
    reasons = {x.module: x.reason for x in profiled.excluded}
    assert set(reasons) == {"counts", "reads"}
    assert "'calls'" in reasons["counts"]
    assert "CheckpointError" in reasons["reads"]
    g = build_graph(profiled)
    assert "counts" not in g and "reads" not in g and "blocks.0" in g
    plan = planner.plan(profiled, 10**9, solver="all")
    assert "counts" not in plan.checkpoints and sorted(x.module for x in plan.excluded) == ["counts", "reads"]


def test_cost_model_counts_retained_bytes(profiled):
    g = build_graph(profiled)
    assert g.nodes["blocks.0"]["retained_bytes"] == HIDDEN_BYTES + RNG_BYTES
    without = profiled.model_copy(update={"retained": []})
    g0 = build_graph(without)
    blocks = [f"blocks.{i}" for i in range(3)]
    # checkpointing frees less than it would if nothing were retained, and never less than measured
    assert simulate(g, blocks).peak_bytes > simulate(g0, blocks).peak_bytes
    plan = planner.plan(profiled, 10**9, solver="all")
    report = planner.verify(_net_and_batch()[0], plan, inputs=_net_and_batch()[1], loss_fn=_loss, steps=1,
                            device="cpu")
    assert report.predicted_peak_bytes >= report.measured_peak_bytes
    assert report.max_grad_diff == 0.0


def test_validation_leaves_the_model_as_it_was():
    model, x = _net_and_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planner.profile(model, x, loss_fn=_loss, device="cpu", optimizer="none", steps=1)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with apply_plan(model, planner.plan(planner.profile(model, x, loss_fn=_loss, device="cpu", optimizer="none",
                                                        steps=1), 10**9, solver="all")):
        _loss(model(x)).backward()  # the plan never checkpoints what would break the step


class WritesItsInput(nn.Module):
    """``nn.Dropout(inplace=True)`` as a unit of its own (Hugging Face's MobileNetV2 head): checkpointed,
    it would write the input its region keeps for the replay, and backward's version check fails."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop, self.head = nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5, inplace=True), nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.head(self.drop(self.lin(x)))  # nothing saves the linear output: fine unplanned


def test_a_unit_writing_its_input_is_excluded():
    torch.manual_seed(0)
    model, x = WritesItsInput(), torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))
    prof = planner.profile(model, x, loss_fn=_loss, device="cpu", optimizer="none", steps=1)
    reasons = {e.module: e.reason for e in prof.excluded}
    assert list(reasons) == ["drop"] and "in place" in reasons["drop"]
    plan = planner.plan(prof, 10**9, solver="all")
    assert "drop" not in plan.checkpoints and plan.checkpoints
    with apply_plan(model, plan):
        _loss(model(x)).backward()
