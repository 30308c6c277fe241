"""Models whose step is not one fixed step: those that run differently under a dispatch mode (NOTE
[ Step as run ]) and those that skip layers at random (NOTE [ Worst step ])."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import planner
from planner.act.api import budget_with_headroom, graph_for, headroom_for, min_feasible_bytes, plan_from_profile
from planner.act.applier import apply_plan
from planner.act.verify import verify
from planner.errors import ProfileError
from planner.profiling.measure import make_optimizer, make_step, measure_step
from planner.profiling.assemble import step_structure
from planner.profiling.rng import HostRngState
from planner.profiling.tracker import storage_bytes
from solvers.cost_model import simulate

WIDTH, ROWS, LAYERS = 64, 256, 4
SCRATCH_ELEMENTS = ROWS * WIDTH * 64
"""The scratch a mode-sensitive layer allocates under a dispatch mode: 64 activations, 4 MiB, more than
the whole step, so a plan calibrated on the tracked step would be far off."""


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _batch() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH * 4), nn.Linear(WIDTH * 4, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class ScratchUnderAMode(Block):
    """Allocates (and frees) a large scratch buffer whenever a Python dispatch mode is active, as a Hugging
    Face Mamba's CPU scan accumulates one more gradient buffer per token under any mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _get_current_dispatch_mode() is not None:
            torch.zeros(SCRATCH_ELEMENTS).add_(1.0)
        return super().forward(x)


class KeepsMoreUnderAMode(Block):
    """Saves one more large tensor for backward under a dispatch mode: the tensors a profile records are
    not the step's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if _get_current_dispatch_mode() is not None:
            wide = x.repeat(1, 16)  # saved by the product below until backward: 1 MiB
            y = y + (wide * wide).mean(1, keepdim=True)
        return y


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], layerdrop: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(block() for _ in range(LAYERS))
        self.layerdrop = layerdrop  # as Hugging Face's encoders keep it (BartEncoder, Wav2Vec2Adapter, ...)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and self.layerdrop > 0.0 and torch.rand([]) < self.layerdrop:
                continue  # the layer is skipped in this step
            x = layer(x)
        return x


def _plan_between(prof, fraction: float = 0.5):
    """A plan at the budget ``fraction`` of the way from the lowest feasible peak to none."""
    g = graph_for(prof, solver="auto")
    lo, hi = min_feasible_bytes(g), simulate(g, []).peak_bytes
    return plan_from_profile(prof, budget_with_headroom(lo + int((hi - lo) * fraction), headroom_for(prof)),
                             solver="auto", graph=g)


def test_a_step_that_changes_under_a_dispatch_mode_is_measured_as_run():
    model = Stack(ScratchUnderAMode)
    prof = planner.profile(model, _batch(), loss_fn=_loss, device="cpu", optimizer="none", steps=1)
    assert prof.step.timeline_source == "as-run"
    # the tracked step peaked in a forward window, with the scratch; the timeline is the step as run
    assert prof.step.tracked_peak_bytes > prof.step.measured_peak_bytes + SCRATCH_ELEMENTS * 4 // 2
    assert max(e.peak_bytes for e in prof.timeline) == prof.step.measured_peak_bytes
    assert any("runs differently under remat's tracker" in n for n in prof.notes)
    plan = _plan_between(prof)
    assert plan.checkpoints
    report = verify(Stack(ScratchUnderAMode), plan, inputs=_batch(), loss_fn=_loss, device="cpu", steps=1,
                    tolerance=0.0)
    assert abs(report.prediction_error) <= 0.02, report.problems
    assert report.ok, report.problems


def test_a_model_that_keeps_more_under_a_dispatch_mode_is_refused_with_the_difference():
    with pytest.raises(ProfileError, match=r"runs differently under remat's profiler: at .* kept \d+ bytes more"):
        planner.profile(Stack(KeepsMoreUnderAMode), _batch(), loss_fn=_loss, device="cpu", optimizer="none",
                        steps=1)


def test_layerdrop_is_planned_for_the_step_with_every_layer():
    # layerdrop 0.9: most steps skip most layers, so the memory step would be an unlucky one; remat
    # switches it off while it measures and says so
    model = Stack(Block, layerdrop=0.9)
    torch.manual_seed(1)
    prof = planner.profile(model, _batch(), loss_fn=_loss, device="cpu", optimizer="none", steps=2)
    assert model.layerdrop == 0.9  # restored
    (change,) = prof.step_changes
    assert (change.kind, change.module, change.scope) == ("hf_layerdrop_off", "", "measure")
    assert [u for u in prof.step_structure.units_seen if u.count(".") == 1] == [f"layers.{i}" for i in range(LAYERS)]
    assert prof.step_structure.skipped == {}
    plan = _plan_between(prof)
    assert plan.checkpoints and plan.step_changes == prof.step_changes

    # the step with every layer running, measured by hand: the plan's prediction holds there
    planned = Stack(Block, layerdrop=0.0)
    handle = apply_plan(planned, plan, inputs=_batch())
    assert planned.layerdrop == 0.0  # apply_plan makes no 'measure' change
    step = make_step(planned, _batch(), loss_fn=_loss, optimizer=make_optimizer("none", planned))
    step()
    planned.zero_grad(set_to_none=True)
    static = storage_bytes([*planned.parameters(), _batch()])
    peak = measure_step(step, "cpu", static_bytes=static).peak_bytes
    handle.remove()
    assert abs(plan.predicted.peak_bytes - peak) <= 0.02 * peak

    # and remat verify measures that step too, gradients bit for bit
    model = Stack(Block, layerdrop=0.9)
    report = verify(model, plan, inputs=_batch(), loss_fn=_loss, device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert model.layerdrop == 0.9


class SkipsUnderAMode(Stack):
    """Skips its first layer whenever a dispatch mode is active: the memory step (under the tracker) is the
    unlucky one, the timing steps and the step as run are not; nothing remat knows switches it off."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i == 0 and _get_current_dispatch_mode() is not None:
                continue
            x = layer(x)
        return x


def test_a_memory_step_that_skipped_a_unit_is_refused():
    with pytest.raises(ProfileError, match=r"the memory step skipped layers\.0, layers\.0\.up, layers\.0\.down"):
        planner.profile(SkipsUnderAMode(Block), _batch(), loss_fn=_loss, device="cpu", optimizer="none", steps=1)


def test_step_structure_merges_the_steps_in_forward_order():
    s = step_structure({"timing step 1": ["<root>", "a", "c"], "memory step": ["<root>", "b", "c"]})
    assert s.units_seen == ["<root>", "b", "a", "c"] or s.units_seen == ["<root>", "a", "b", "c"]
    assert s.skipped == {"timing step 1": ["b"], "memory step": ["a"]}


# ----------------------------------------------------------------------------- randomness outside torch


class MasksFromNumpy(Block):
    """Replaces a span of rows by a learned embedding, the span drawn from numpy's global generator, as
    Wav2Vec2's SpecAugment masks time steps (NOTE [ Randomness outside torch ])."""

    def __init__(self):
        super().__init__()
        self.masked = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        start = int(np.random.randint(0, ROWS - 16))
        keep = torch.ones(ROWS, 1)
        keep[start:start + 16] = 0.0
        return super().forward(x * keep + self.masked * (1 - keep))


class MaskedStack(Stack):
    def __init__(self):
        super().__init__(Block)
        self.layers[1] = MasksFromNumpy()


def test_numpy_masks_are_seeded_by_verify_and_replayed_by_the_recompute(monkeypatch):
    import random

    import numpy as np

    prof = planner.profile(MaskedStack(), _batch(), loss_fn=_loss, device="cpu", optimizer="none", steps=1)
    plan = _plan_between(prof, 0.0)
    assert "layers.1" in plan.checkpoints  # the masking layer is recomputed in backward
    np.random.seed(7)
    random.seed(7)
    np_before, py_before = np.random.get_state()[1].copy(), random.getstate()
    report = verify(MaskedStack(), plan, inputs=_batch(), loss_fn=_loss, device="cpu", steps=1, tolerance=0.0)
    # the same masks in both runs, and the recompute drew the forward's: gradients bit for bit
    assert report.max_grad_diff == 0.0 and report.ok, report.problems
    assert (np.random.get_state()[1] == np_before).all() and random.getstate() == py_before  # restored

    # the recompute alone: a step of the planned model equals the plain model's from one seed
    restores, restore = [], HostRngState.restore
    monkeypatch.setattr(HostRngState, "restore", lambda self: restores.append(self) or restore(self))
    grads = []
    for planned in (False, True):
        model = MaskedStack()
        handle = apply_plan(model, plan, inputs=_batch()) if planned else None
        np.random.seed(3)
        _loss(model(_batch())).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert handle.recompute_count == len(plan.checkpoints) >= 2  # every region replayed, and only the masking
    assert len(restores) == 2  # layer's took the generators back, before and after (NOTE [ Regions that draw nothing ])



class GaussianScale(Block):
    """Scales its input (which its first linear saves) by a normal draw from numpy's and from Python's
    global generator: in a stack of these, every second block takes the Gaussian the block before it
    cached (numpy's ``has_gauss``, Python's ``gauss_next``) and moves no word of either generator
    (NOTE [ Reading global states cheaply ])."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import random

        import numpy as np

        return super().forward(x * (1.0 + 0.1 * float(np.random.normal()) + 0.1 * random.gauss(0.0, 1.0)))


def test_a_region_taking_a_cached_gaussian_replays_it():
    import random

    import numpy as np

    prof = planner.profile(Stack(GaussianScale), _batch(), loss_fn=_loss, device="cpu", optimizer="none", steps=1)
    plan = _plan_between(prof, 0.0)
    assert "layers.1" in plan.checkpoints  # a region whose only draws are cached ones
    grads = []
    for planned in (False, True):
        model = Stack(GaussianScale)
        handle = apply_plan(model, plan, inputs=_batch()) if planned else None
        np.random.seed(3)
        random.seed(3)
        _loss(model(_batch())).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert handle.recompute_count == len(plan.checkpoints)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_taking_states_that_did_not_move_reads_neither_in_full(monkeypatch):
    import random

    import numpy as np

    from planner.profiling import rng

    first = HostRngState.capture()  # a full read of each, checked against the bytes (Rule 3)
    reads = []
    monkeypatch.setattr(rng._NUMPY, "full_of", lambda: reads.append("numpy") or np.random.get_state())
    monkeypatch.setattr(rng._PYTHON, "full_of", lambda: reads.append("python") or random.getstate())
    assert rng._NUMPY.trusted and rng._PYTHON.trusted  # this build's layouts were recognized
    again = HostRngState.capture()
    assert reads == [] and again.same_as(first)  # nothing drawn: the cached states, no copy
    np.random.rand()
    random.random()
    moved = HostRngState.capture()
    assert reads == ["numpy", "python"] and not moved.same_as(first)
