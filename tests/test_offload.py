"""Offloaded units in the applier (NOTE [ Offloaded units ] in planner/act/offload.py): gradients
bit for bit against the unplanned model, the device bytes the plan frees, the host store's peak."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.act.applier import apply_plan
from planner.act.offload import HostMemoryError
from planner.model.schema import OffloadedUnit
from planner.profiling.measure import _max_running_sum, _profiled
from tests.test_applier import HAS_HF, _file, example_inputs, make_plan, reference, train_step


def _offload(fqns: list[str], **fields) -> list[OffloadedUnit]:
    return [OffloadedUnit(fqn=f, unit=f, host_bytes=0, d2h_ms=0.0, h2d_ms=0.0, exposed_ms=0.0, **fields)
            for f in fqns]


def _check_grads(name: str, checkpoints: list[str], offload: list[str]):
    ref_loss, ref_grads, _, _ = reference(name)
    model = _file(name).build_model()
    inputs = example_inputs(name)
    handle = apply_plan(model, make_plan(model, checkpoints, inputs, offload=_offload(offload)), inputs=inputs)
    assert handle.offloaded == offload and handle.checkpointed == checkpoints
    loss = train_step(name, model)
    assert torch.equal(loss, ref_loss)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[n]), f"{name}: grad of {n} differs"
    store = handle.host_store
    assert store.peak_bytes > 0 and store.live_bytes == 0, "every host buffer is released after backward"
    assert handle.recompute_count == len(checkpoints), "offloaded units are not recomputed"
    handle.remove()
    return store


CASES = {
    "transformer": ([], [f"blocks.{i}" for i in range(6)]),
    "gpt2": (["transformer.h.0"], [f"transformer.h.{i}" for i in range(1, 4)]),
    "llama": (["model.layers.3"], ["model.layers.0", "model.layers.1.mlp", "model.layers.2"]),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.skipif(n != "transformer" and not HAS_HF,
                                                                             reason="transformers not installed")])
                                  for n in CASES])
def test_offloaded_gradients_equal_the_unplanned_models(name: str):
    checkpoints, offload = CASES[name]
    _check_grads(name, checkpoints, offload)


class _Blocks(nn.Module):
    """Blocks whose outputs only the next block saves: offloading all of them frees all but the
    loss's input by the end of forward."""

    def __init__(self, n: int = 4, width: int = 256):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def moved_bytes(rows: int) -> int:
    return 4 * rows * (4 * 2 * 1024 + 3 * 256)


MOVED_BYTES = moved_bytes(64)
"""fp32: each block saves its two hidden tensors (64 x 1024) and its input (64 x 256), except the
first block's input, which is the batch (kept, NOTE [ Offloaded units ], Rule 1)."""


def _live_after_forward(model: nn.Module, x: torch.Tensor) -> tuple[int, list]:
    """Bytes the allocator holds after a forward (its net allocations), and the loss that keeps its graph."""
    kept: list = []
    prof, _ = _profiled(lambda: kept.append((model(x) ** 2).mean()))
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), kept


def test_device_bytes_freed_equal_the_host_bytes():
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(64, 256)
    plain, _ = _live_after_forward(model, x)
    names = [f"blocks.{i}" for i in range(4)]
    handle = apply_plan(model, make_plan(model, [], offload=_offload(names)))
    offloaded, graph = _live_after_forward(model, x)
    store = handle.host_store
    assert store.live_bytes > 0
    assert plain - offloaded == store.live_bytes, (plain, offloaded, store.live_bytes)
    assert store.live_bytes == MOVED_BYTES
    graph.clear()
    assert store.live_bytes == 0, "host buffers of a graph that is dropped unused are released"
    handle.remove()


def test_gradients_bitwise_and_peak_lower_on_a_plain_step():
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(512, 256)  # activations above the gradients: they set the peak
    ref = _Blocks()
    ref.load_state_dict(model.state_dict())
    step = lambda m: (m(x) ** 2).mean().backward()  # noqa: E731
    prof, _ = _profiled(lambda: step(ref))
    plain_peak = _max_running_sum(prof)
    handle = apply_plan(model, make_plan(model, [], offload=_offload([f"blocks.{i}" for i in range(4)])))
    prof, _ = _profiled(lambda: step(model))
    assert _max_running_sum(prof) < plain_peak
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    assert handle.host_store.peak_bytes == moved_bytes(512)
    handle.remove()


def test_host_store_that_cannot_allocate_is_one_line(monkeypatch):
    import numpy as np

    model, x = _Blocks(), torch.randn(8, 256)
    handle = apply_plan(model, make_plan(model, [], offload=_offload(["blocks.0"])))

    def no_memory(*_a, **_k):
        raise MemoryError

    monkeypatch.setattr(np, "empty", no_memory)
    with pytest.raises(HostMemoryError) as e:
        model(x).sum().backward()
    msg = str(e.value)
    assert "\n" not in msg and "cannot allocate" in msg and "--host-memory" in msg
    handle.remove()


def test_plan_larger_than_free_host_memory_is_refused_at_apply():
    model = _Blocks()
    plan = make_plan(model, [], offload=_offload(["blocks.0"]))
    plan.predicted.host_peak_bytes = 1 << 60
    with pytest.raises(HostMemoryError, match="--host-memory"):
        apply_plan(model, plan)


BLOCKS_FILE = '''
import torch
from torch import nn


class Blocks(nn.Module):
    def __init__(self, n=4, width=128):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(n))
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return Blocks()


def example_inputs():
    return torch.randn(256, 128, generator=torch.Generator().manual_seed(0))


def loss_fn(out):
    return out.square().mean()
'''


def test_offload_plan_verifies_device_and_host_peak_against_the_prediction(tmp_path):
    """An offload plan below every layer's lowest peak (where recompute alone has no plan), made and
    verified as a user would: the measured device peak and the host store's peak equal the prediction,
    the gradients equal the unplanned model's bit for bit (NOTE [ Peak-memory model ], Rule 10)."""
    from planner.act.api import budget_with_headroom, headroom_for, plan_from_profile
    from planner.act.frontier import offload_min_feasible_bytes
    from planner.act.verify import verify
    from planner.model.graph import build_graph
    from planner.profiling import profile
    from solvers.dp import min_feasible_bytes

    path = tmp_path / "blocks.py"
    path.write_text(BLOCKS_FILE)
    from planner.profiling.model_file import load_model_file

    mf = load_model_file(path)
    prof = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=1, threads=1)
    g = build_graph(prof)
    host = 1 << 30
    lowest, recompute_lowest = offload_min_feasible_bytes(g, host), min_feasible_bytes(g)
    assert lowest < recompute_lowest, "offload reaches below every recompute-only plan"
    budget = budget_with_headroom((lowest + recompute_lowest) // 2, headroom_for(prof))
    plan = plan_from_profile(prof, budget, offload=True, host_memory=host)
    assert plan.offload and plan.predicted.host_peak_bytes
    report = verify(path, plan, steps=1, threads=1)
    assert report.ok, report.problems
    assert report.max_grad_diff == 0.0, "offloading does not change a gradient bit"
    assert report.measured_host_peak_bytes == report.predicted_host_peak_bytes
    assert abs(report.prediction_error) <= 0.02 and report.measured_peak_bytes <= budget
    assert report.offloaded == [u.fqn for u in plan.offload]
