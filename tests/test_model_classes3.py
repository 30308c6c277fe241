"""Model classes as their users build them, round 18 (docs/zoo.md): each profiled, planned, applied and verified
with ``tolerance=0``, predicted against measured bytes."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import planner
from planner.act.api import graph_for, plan_of
from planner.act.verify import verify
from planner.model.schema import SolverInfo
from solvers.cost_model import CostModel, simulate
from solvers.replay import replay_stop_seq

pytestmark = pytest.mark.usefixtures("one_thread", "bytes_only")


def _by_hand(model: nn.Module, batch: dict, units: list[str]):
    """The profile of ``model`` and its plan checkpointing ``units`` by hand, twice the unplanned peak its budget
    (``verify`` judges the prediction, gradients and buffers, not a budget the set was not chosen for)."""
    prof = planner.profile(model, batch, device="cpu", optimizer="none", steps=1, threads=1)
    g = graph_for(prof)
    return prof, plan_of(prof, g, simulate(g, units), 2 * simulate(g, []).peak_bytes,
                         solver=SolverInfo(name="by hand", status="optimal"))


REPLAY_TEMPORARY_BYTES = 96
"""What ``WideGate``'s replay is still under by (96 bytes measured, round 19; not traced): ``cat``'s result, alive
while ``repeat`` makes the wide output, is now counted whole (NOTE [ What a replay allocates ]; 16,384 under
before). (8 more: the loss and its gradient, NOTE [ Peak-memory model ], Rule 7.)"""


class WideGate(nn.Module):
    """Two gates and a wide output made from them (``cat`` then ``repeat``: no save), then their product: the
    product's packs are of ``a`` and ``b``, saved before, so the output is made before the block's last pack."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = torch.tanh(self.fc1(x)), torch.sigmoid(self.fc2(x))
        wide = torch.cat([a, b], -1).repeat(1, 1, 4)
        return wide, a * b


class WideGates(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(WideGate(32) for _ in range(3))
        self.downs = nn.ModuleList(nn.Linear(256, 32) for _ in range(3))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, down in zip(self.blocks, self.downs):
            wide, gate = block(x)
            x = down(wide) + gate
        return self.head(x).square().mean()


def _batch():
    return {"x": torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(0))}


def test_a_replay_runs_on_to_a_pack_of_a_tensor_saved_before_and_re_makes_the_output_made_before_it():
    # NOTE [ The replay stops at the last save ], Rule 3: the profile recorded a tensor's first save in a unit
    # only, so the last block's stop was seen at sigmoid's save, before its wide output; its replay runs on to
    # the product's packs and re-makes it: 817,616 predicted, 888,304 measured (-7.96%), verify not ok
    prof, plan = _by_hand(WideGates(), _batch(), ["blocks.2"])
    g = graph_for(prof)
    block = prof.unit("blocks.2")
    (wide, _) = block.output_ids
    assert replay_stop_seq(CostModel.of(g), "blocks.2") == block.last_pack_seq >= prof.tensors[wide].created_seq
    assert simulate(g, ["blocks.2"]).peak_at == "recompute of blocks.2"
    report = verify(WideGates(), plan, inputs=_batch(), device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.predicted_no_plan_peak_bytes == report.measured_no_plan_peak_bytes
    assert 0 <= report.measured_peak_bytes - report.predicted_peak_bytes <= REPLAY_TEMPORARY_BYTES + 8, (
        report.predicted_peak_bytes, report.measured_peak_bytes)


def _mlp(width: int = 32) -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


class Blocks(nn.Module):
    """Three blocks made by ``make``, run by ``step``, and a head; the loss in forward."""

    def __init__(self, make):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(make() for _ in range(3))
        self.head = nn.Linear(32, 1)

    def step(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.step(block, x)
        return self.head(x).square().mean()


class ScaledInPlace(Blocks):
    """Residual MLP blocks whose output the caller scales in place (``h.mul_(0.5)``); a Linear on a 3-D input
    returns a view, so autograd drops the output's node from the graph."""

    def __init__(self):
        super().__init__(_mlp)

    def step(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = block(x)
        h.mul_(0.5)
        return x + h


def _tokens():
    return {"x": torch.randn(2, 32, 32, generator=torch.Generator().manual_seed(0))}


@pytest.mark.parametrize("block", ["blocks.1", "blocks.2"])
def test_a_blocks_backward_starts_where_its_output_written_in_place_gets_its_gradient(block):
    # NOTE [ Outputs written in place ]: the start of each block's backward was never heard, its window folded
    # into the one before; checkpointed, blocks.1 was predicted 345,056 and measured 370,392 (-6.84%, the mid
    # plan, over its budget), blocks.2 370,520 / 419,168 (-11.6%)
    prof, plan = _by_hand(ScaledInPlace(), _tokens(), [block])
    assert prof.unit(block).bwd_start_seq < prof.unit(block + ".3").bwd_end_seq  # its last layer's inside its own
    report = verify(ScaledInPlace(), plan, inputs=_tokens(), device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.predicted_no_plan_peak_bytes == report.measured_no_plan_peak_bytes
    assert 0 <= report.predicted_peak_bytes - report.measured_peak_bytes <= 128, (
        report.predicted_peak_bytes, report.measured_peak_bytes)


def _recurrent_gemma():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=128, lru_width=64, attention_window_size=16, block_types=["recurrent", "recurrent",
                                                                                    "attention"]))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def test_a_tensor_the_replay_stores_on_its_module_is_put_back_so_the_replays_tensors_go_with_its_backward():
    # NOTE [ Tensors a replay stores on modules ]: RG-LRU's replay stored its recurrent state, whose graph held
    # the replay's recomputed saves to the step's end: the two recurrent layers checkpointed (the lowest plan)
    # were predicted 1,100,606 and measured 1,365,150 (-19.4%, over the budget)
    layers = ["model.layers.0", "model.layers.1"]
    _, plan = _by_hand(*_recurrent_gemma(), layers)
    model, batch = _recurrent_gemma()
    report = verify(model, plan, inputs=batch, device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.predicted_no_plan_peak_bytes == report.measured_no_plan_peak_bytes
    assert report.predicted_peak_bytes == report.measured_peak_bytes


def test_the_model_keeps_the_tensor_its_forward_stored_not_the_replays():
    # NOTE [ Tensors a replay stores on modules ], Rule 2: after the step the attribute is the forward's tensor
    _, plan = _by_hand(*_recurrent_gemma(), ["model.layers.0"])
    model, batch = _recurrent_gemma()
    rg_lru = model.model.layers[0].temporal_block.rg_lru
    with planner.apply_plan(model, plan):
        torch.manual_seed(0)
        out = model(**batch)
        stored = rg_lru.recurrent_states
        out.loss.backward()
    assert rg_lru.recurrent_states is stored


class RangeTracked(nn.Module):
    """A residual MLP block tracking its input's range in training, the buffer replaced each forward (I-BERT's
    ``QuantAct``: ``self.x_max = self.x_max * 0.95 + x.max() * 0.05``)."""

    def __init__(self):
        super().__init__()
        self.f = _mlp()
        self.register_buffer("x_max", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.x_max = self.x_max * 0.95 + x.detach().max() * 0.05
        return x + self.f(x)


class RangeTrackedBlocks(Blocks):
    def __init__(self):
        super().__init__(RangeTracked)


def test_a_buffer_the_replay_replaces_is_put_back_so_it_is_updated_once_per_step():
    # NOTE [ Tensors a replay stores on modules ], Rule 4: the replay replaced the buffer a second time, and the
    # validation step, comparing versions, did not see it: buffers 1.5e-3 off the unplanned model's (I-BERT)
    prof, plan = _by_hand(RangeTrackedBlocks(), _tokens(), ["blocks.0", "blocks.1"])
    assert not prof.excluded
    report = verify(RangeTrackedBlocks(), plan, inputs=_tokens(), device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.max_buffer_diff == 0
    assert 0 <= report.predicted_peak_bytes - report.measured_peak_bytes <= 128, (
        report.predicted_peak_bytes, report.measured_peak_bytes)


@functools.lru_cache(maxsize=4)
def _relative_index(n: int) -> torch.Tensor:
    """A process-wide cache as BEiT keeps its relative position index: made once, read by every step."""
    coords = torch.arange(n)
    return (coords[:, None] - coords[None, :]) + n - 1


class RelativeBias(nn.Module):
    """A residual MLP block adding a learned relative position bias, gathered with the cached index (its
    gradient saves the index)."""

    def __init__(self):
        super().__init__()
        self.f = _mlp()
        self.table = nn.Parameter(torch.randn(63) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.table[_relative_index(x.shape[1])]
        return x + self.f(torch.softmax(bias, -1) @ x)


def test_a_tensor_made_before_the_step_and_read_by_it_is_measured_as_the_profile_counts_it():
    # NOTE [ Tensors from before the step ]: the profile counts the cached index (32 x 32 int64, 8,192 bytes)
    # with the buffers; verify's CPU peak left it out, the unplanned step measured 8,192 bytes below its
    # prediction (Data2VecVision and BEiT: 33,800, their lowest plans +2.3% and +2.7%)
    prof, plan = _by_hand(Blocks(RelativeBias), _tokens(), ["blocks.0", "blocks.1"])
    assert any("before the step" in n for n in prof.notes)
    report = verify(Blocks(RelativeBias), plan, inputs=_tokens(), device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.predicted_no_plan_peak_bytes == report.measured_no_plan_peak_bytes
    assert 0 <= report.predicted_peak_bytes - report.measured_peak_bytes <= 128, (
        report.predicted_peak_bytes, report.measured_peak_bytes)
