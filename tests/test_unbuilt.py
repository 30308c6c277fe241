"""Memory-only compiles (NOTE [ Memory-only compiles ]): a step compiled with its CPU kernels unbuilt
allocates as the built step, and nothing of it outlives the compile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._inductor.async_compile import AsyncCompile

import planner
from planner.profiling.compiled import measure_compiled
from planner.profiling.unbuilt import peak_only, unbuilt_kernels
from planner.spec import StepSpec

CPU = torch.device("cpu")


class _Net(nn.Module):
    """Embedding, norms (a BatchNorm's running statistics are written by a kernel), attention with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm = nn.Embedding(64, 32), nn.LayerNorm(32)
        self.attn = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
        self.bn, self.drop, self.head = nn.BatchNorm1d(32), nn.Dropout(0.1), nn.Linear(32, 64)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(input_ids))
        h = h + self.drop(self.attn(h, h, h, need_weights=False)[0])
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        logits = self.head(nn.functional.gelu(h))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.roll(1, dims=1)}


def test_an_unbuilt_compile_allocates_as_the_built_one_and_leaves_nothing_behind():
    torch.manual_seed(0)
    model, batch = _Net(), _batch()
    eager = planner.profile(model, batch, device="cpu", threads=1, steps=1)
    step = StepSpec(device="cpu", compile="inductor", threads=1, steps=1)
    kept = {n: b.clone() for n, b in model.named_buffers()}

    def measure():
        return measure_compiled(model, batch, eager, step=step, progress=lambda _m: None, checkpointed=["attn"],
                                timed=False)[0]

    unbuilt = peak_only(measure, CPU, model)
    assert all(torch.equal(b, kept[n]) for n, b in model.named_buffers())  # Rule 3: a stand-in zeroed them
    built = measure()
    assert not all(torch.equal(b, kept[n]) for n, b in model.named_buffers())  # the built step moved them
    figures = ("forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes", "peak_bytes")
    assert {f: getattr(unbuilt, f) for f in figures} == {f: getattr(built, f) for f in figures}
    assert unbuilt.peak_bytes > eager.step.params_bytes  # a measured step, not the static bytes

    # Rule 3: a later compile of the same code in this process runs real kernels
    fresh = copy.deepcopy(model).eval()
    with torch.no_grad():
        want = fresh(**batch)
        with unbuilt_kernels():
            assert float(torch.compile(fresh)(**batch)) == 0.0  # what a stand-in computes: zeros
        got = torch.compile(fresh)(**batch)
    torch._dynamo.reset()
    assert float(want) > 0 and torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _counted(fn):
    """``fn`` compiled and run by a measure that records whether its kernels were stand-ins."""
    runs: list[bool] = []

    def measure():
        runs.append(AsyncCompile.cpp_pybinding is not _BUILT)
        try:
            return torch.compile(fn)(torch.ones(8, 8))
        finally:
            torch._dynamo.reset()

    return measure, runs


_BUILT = AsyncCompile.cpp_pybinding


def test_a_value_dependent_graph_break_is_measured_again_built():
    def picks(x):
        y = torch.relu(x * 2.0 - 1.0)
        return y[y > 0].sum() * 3.0  # a shape from the values a kernel computed

    measure, runs = _counted(picks)
    out = peak_only(measure, CPU)
    assert runs == [True, False] and float(out) == pytest.approx(8 * 8 * 3.0)


def test_a_step_that_raises_on_zeros_is_measured_again_built():
    def factor(x):
        return torch.linalg.cholesky(x @ x.T * 0.5 + torch.eye(8))  # the stand-ins' zeros are not positive definite

    measure, runs = _counted(factor)
    out = peak_only(measure, CPU)
    assert runs == [True, False] and torch.isfinite(out).all()


def test_values_in_shapes_inside_a_graph_are_never_unbuilt():
    measure, runs = _counted(lambda x: torch.relu(x) + 1.0)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        peak_only(measure, CPU)
    assert runs == [False]
    peak_only(measure, CPU)
    assert runs == [False, True]


def test_why_it_is_measured_again_is_said():
    said: list[str] = []
    measure, runs = _counted(lambda x: torch.linalg.cholesky(x @ x.T * 0.5 + torch.eye(8)))
    peak_only(measure, CPU, say=said.append)
    assert runs == [True, False] and said == ["measuring again with inductor's kernels built: it raised "
                                              "LinAlgError on the stand-ins' zeros"]


class _Sided(nn.Module):
    """A block whose forward mutates a list outside it (as transformers' output capture does), so dynamo
    runs its checkpoint eagerly ("HOP: Unsafe side effect"); ``routed`` picks rows by their values."""

    def __init__(self, routed: str | None) -> None:
        super().__init__()
        self.lin, self.routed, self.calls = nn.Linear(8, 8), routed, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(1)
        y = torch.relu(self.lin(x))
        if self.routed == "index":
            return y[y > 0].sum()
        if self.routed == "tolist":  # the rows to keep counted in Python
            return y[:max(1, sum(v > 0 for v in y.detach().flatten().tolist()) // 8)].sum()
        if self.routed == "numpy":
            return y[:max(1, int((y.detach().numpy() > 0).sum()) // 8)].sum()
        return y.sum()


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("routed", ["index", "tolist", "numpy", None], ids=["index", "tolist", "numpy", "dense"])
def test_a_checkpoint_run_eagerly_is_watched_for_values(routed, use_reentrant):
    inner = _Sided(routed)
    outer = nn.Linear(8, 8)

    def step(x):
        return torch.utils.checkpoint.checkpoint(inner, torch.relu(outer(x)), use_reentrant=use_reentrant)

    runs: list[bool] = []

    def measure():
        runs.append(AsyncCompile.cpp_pybinding is not _BUILT)
        try:
            out = torch.compile(step)(torch.ones(4, 8, requires_grad=True))
            out.backward()
            return out.detach()
        finally:
            torch._dynamo.reset()

    said: list[str] = []
    peak_only(measure, CPU, say=said.append)
    assert len(inner.calls) >= 2 * len(runs)  # forward and recompute ran eagerly each time
    if routed:  # the stand-ins' zeros would route no row: measured again built, and said why
        assert runs == [True, False]
        assert said == ["measuring again with inductor's kernels built: a checkpoint run eagerly read values the "
                        f"stand-ins made ({routed})"]
    else:  # the side effect alone reads no value: the memory-only run stands
        assert runs == [True] and said == []
    assert torch.utils.checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"  # put back
    assert all(n not in torch.Tensor.__dict__ for n in ("tolist", "numpy"))  # the methods put back too
