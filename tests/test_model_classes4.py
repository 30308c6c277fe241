"""Model classes as their users build them, round 19 (docs/zoo.md): each profiled, planned, applied and verified
with ``tolerance=0``, predicted against measured bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import planner
from planner.act.api import graph_for, min_feasible_bytes, plan_of
from planner.act.verify import verify
from planner.model.schema import SolverInfo
from solvers.cost_model import simulate
from tests.test_model_classes3 import WideGates, _batch, _by_hand

pytestmark = pytest.mark.usefixtures("one_thread", "bytes_only")


def _vitdet():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.VitDetModel(transformers.VitDetConfig(
        image_size=32, pretrain_image_size=32, patch_size=4, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        mlp_ratio=2, use_relative_position_embeddings=True, window_size=4, window_block_indices=[0, 2]))
    return model, {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}


def _mean_out(out) -> torch.Tensor:
    return out.last_hidden_state.square().mean()


def _verify(model, plan, batch, loss_fn=None):
    report = verify(model, plan, inputs=batch, loss_fn=loss_fn, device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.predicted_no_plan_peak_bytes == report.measured_no_plan_peak_bytes
    return report


def test_a_replay_runs_beside_what_its_forward_allocated_up_to_its_last_pack():
    # NOTE [ What a replay allocates ], Rules 1-2: VitDet's global-attention layer replays to two 131,072-byte
    # broadcast adds (its decomposed relative position bias) before the saves the probe counted in their place:
    # 1,876,696 predicted, 1,929,376 measured (-2.73%); Rule 4, a 32,768-byte gradient its backward made before
    # the replay began: 1,896,576 with Rule 2 alone
    model, batch = _vitdet()
    prof = planner.profile(model, batch, loss_fn=_mean_out, device="cpu", optimizer="none", steps=1, threads=1)
    g = graph_for(prof)
    layer = g.nodes["encoder.layer.1"]
    assert layer["replay_rise_bytes"] > layer["saved_bytes"] and layer["bwd_before_replay_bytes"] > 0
    plan = plan_of(prof, g, simulate(g, ["encoder.layer.1"]), 2 * simulate(g, []).peak_bytes,
                   solver=SolverInfo(name="by hand", status="optimal"))
    report = _verify(_vitdet()[0], plan, batch, _mean_out)
    assert 0 <= report.measured_peak_bytes - report.predicted_peak_bytes <= 64, (
        report.predicted_peak_bytes, report.measured_peak_bytes)


def test_the_lowest_plan_of_a_model_whose_replay_peaks_mid_block_fits_its_budget():
    # NOTE [ What a replay allocates ]: VitDet's lowest plan (layers 0 and 1) was predicted 1,418,648 and
    # measured 1,471,328 (-3.58%), over its budget
    model, batch = _vitdet()
    prof = planner.profile(model, batch, loss_fn=_mean_out, device="cpu", optimizer="none", steps=1, threads=1)
    budget = int(min_feasible_bytes(graph_for(prof)) * 1.01)
    plan = planner.plan(prof, budget)
    report = _verify(_vitdet()[0], plan, batch, _mean_out)
    assert report.measured_peak_bytes <= budget
    assert 0 <= report.measured_peak_bytes - report.predicted_peak_bytes <= 64, (
        report.predicted_peak_bytes, report.measured_peak_bytes)


def test_a_temporary_before_the_last_pack_is_counted_whole_in_the_replay():
    # NOTE [ What a replay allocates ], Rule 2: WideGate's cat (32,768 bytes), alive while repeat makes the wide
    # output, was counted less the product made after the last pack: 871,912 predicted, 888,304 measured
    prof, plan = _by_hand(WideGates(), _batch(), ["blocks.2"])
    report = _verify(WideGates(), plan, _batch())
    assert 0 <= report.measured_peak_bytes - report.predicted_peak_bytes <= 128, (
        report.predicted_peak_bytes, report.measured_peak_bytes)


class Gate(nn.Module):
    """Two gates of the input, returned as their sum and product: what they save is alive as locals until the
    block returns, checkpointed or not."""

    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = torch.tanh(self.fc1(x)), torch.sigmoid(self.fc2(x))
        return a + b, a * b


class Gates(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Gate(128) for _ in range(4))
        self.head = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h, g = block(x)
            x = h + g
        return self.head(x).square().mean()


def _wide_rows():
    return {"x": torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0))}


def test_a_checkpointed_blocks_own_forward_window_is_counted_as_it_runs_checkpointed():
    # NOTE [ Checkpointed forward windows ]: the last block checkpointed by hand, its own forward the step's peak,
    # was predicted 1,522,568 and measured 1,582,532 (-3.79%): the window's temporaries came from the step
    # without checkpointing, whose window end held the block's saves
    prof, plan = _by_hand(Gates(), _wide_rows(), ["blocks.3"])
    assert prof.checkpointed_windows
    assert simulate(graph_for(prof), ["blocks.3"]).peak_at == "forward of blocks.3"
    report = _verify(Gates(), plan, _wide_rows())
    assert report.predicted_peak_bytes == report.measured_peak_bytes


def _prophetnet():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ProphetNetForConditionalGeneration(transformers.ProphetNetConfig(
        vocab_size=128, hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4, max_position_embeddings=64,
        ngram=2, num_buckets=8, relative_max_distance=16))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids.clone()}


def test_a_replay_runs_beside_the_gradients_backward_holds_when_the_region_starts_its_backward():
    # NOTE [ What a replay allocates ], Rules 2 and 6: ProphetNet's first decoder layer checkpointed (the mid plan)
    # was predicted 4,687,392 and measured 4,609,592 (+1.69%), the leaf's calibrated forward temporaries above its
    # replay's; the replay's rise alone was 16,440 bytes under: the gradient of the encoder's output, which the
    # second decoder layer's cross-attention made, waits there for the first's
    model, batch = _prophetnet()
    prof = planner.profile(model, batch, device="cpu", optimizer="none", steps=1, threads=1)
    g = graph_for(prof)
    assert g.nodes["prophetnet.decoder.layers.0"]["bwd_start_extra_bytes"] >= 16_384
    plan = plan_of(prof, g, simulate(g, ["prophetnet.decoder.layers.0"]), 2 * simulate(g, []).peak_bytes,
                   solver=SolverInfo(name="by hand", status="optimal"))
    report = _verify(_prophetnet()[0], plan, batch)
    assert 0 <= report.measured_peak_bytes - report.predicted_peak_bytes <= 64, (
        report.predicted_peak_bytes, report.measured_peak_bytes)
