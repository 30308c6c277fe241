"""How remat's checkpointed regions compile (planner/profiling/aot_cse.py): AOTAutograd's CSE off (NOTE [ CSE
across checkpointed regions ]) and a region's forward side effects run once (NOTE [ Side effects in a
checkpointed region ]): each premise on a small model, and apply_plan's settings and their undo."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.act.applier import apply_plan
from planner.model.schema import CompileInfo
from planner.profiling.aot_cse import SIDE_EFFECT_SETTING, regions_apart
from planner.profiling.compiled import checkpointing
from planner.profiling.compiled_graphs import ModuleNames, capturing, saved_storages

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Block(nn.Module):
    """Reads a constant every block makes alike, as a decomposed attention makes its zeros and its mask."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.full((8, 64, 64), 0.5)  # alike in every block: one node after CSE
        return torch.relu(self.fc(x)) * scale + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _saved_bytes(apart: bool) -> int:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(8, 64, 64, requires_grad=True)
    torch._dynamo.reset()
    with capturing("inductor") as (backend, graphs), checkpointing(model, ["blocks.0", "blocks.1", "blocks.2"]), \
            regions_apart(apart):
        torch.compile(model, backend=backend)(x).sum().backward()
    torch._dynamo.reset()
    saved, _ = saved_storages(graphs, ModuleNames(model))
    return sum(s.nbytes for s in saved)


def test_cse_across_regions_makes_the_compiled_forward_save_a_shared_constant():
    merged, apart = _saved_bytes(False), _saved_bytes(True)
    constant = 8 * 64 * 64 * 4
    assert merged - apart >= constant  # the first block's constant, read by the later regions, is saved


@pytest.fixture(scope="module")
def eager_plan():
    import planner

    torch.manual_seed(0)
    return planner.plan(Net(), "1TB", inputs=torch.randn(8, 64, 64, requires_grad=True), device="cpu",
                        threads=1, steps=1, solver="all", loss_fn=lambda out: out.sum())


def test_apply_plan_turns_cse_off_for_a_compiled_plan_that_says_so_and_remove_restores_it(eager_plan, caplog):
    assert torch._functorch.config.cse and eager_plan.checkpoints
    info = CompileInfo(backend="inductor", torch_version=torch.__version__)
    for compile_info, during in ((info.model_copy(update={"aot_cse": False}), False), (info, True), (None, True)):
        handle = apply_plan(Net(), eager_plan.model_copy(update={"compile": compile_info}))
        assert handle.checkpointed and torch._functorch.config.cse is during
        handle.remove()
        assert torch._functorch.config.cse
    assert "torch._functorch.config.cse=False" in caplog.text


class Capturing(Block):
    """Writes a list outside itself in its forward, as transformers' output capture writes its context variable."""

    def __init__(self, seen: list) -> None:
        super().__init__()
        self.seen = seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.shape)
        return torch.relu(self.fc(x)) + x


def _breaks_and_calls(apart: bool) -> tuple[int, int]:
    from torch._dynamo.utils import counters

    seen: list = []
    model = Net()
    model.blocks = nn.ModuleList(Capturing(seen) for _ in range(3))
    torch._dynamo.reset()
    before = sum(counters["graph_break"].values())
    with checkpointing(model, ["blocks.0", "blocks.1", "blocks.2"]), regions_apart(apart):
        torch.compile(model)(torch.randn(8, 64, 64, requires_grad=True)).sum().backward()
    torch._dynamo.reset()
    return sum(counters["graph_break"].values()) - before, len(seen)


def test_a_region_with_a_forward_side_effect_compiles_in_the_graph_and_runs_it_once():
    breaks, calls = _breaks_and_calls(False)
    assert breaks >= 1 and calls == 6  # "HOP: Unsafe side effect": run eagerly, the side effect replayed
    assert _breaks_and_calls(True) == (0, 3)  # traced: no break, the side effect once


def test_apply_plan_runs_side_effects_once_for_a_plan_that_says_so_and_remove_restores_it(eager_plan, caplog):
    assert getattr(torch._dynamo.config, SIDE_EFFECT_SETTING) is False and eager_plan.checkpoints
    info = CompileInfo(backend="inductor", torch_version=torch.__version__)
    for compile_info, during in ((info.model_copy(update={"fwd_side_effects_replayed": False}), True),
                                 (info, False), (None, False)):
        handle = apply_plan(Net(), eager_plan.model_copy(update={"compile": compile_info}))
        assert handle.checkpointed and getattr(torch._dynamo.config, SIDE_EFFECT_SETTING) is during
        assert torch._functorch.config.cse  # the other setting is the plan's own
        handle.remove()
        assert getattr(torch._dynamo.config, SIDE_EFFECT_SETTING) is False
    assert f"torch._dynamo.config.{SIDE_EFFECT_SETTING}=True" in caplog.text
