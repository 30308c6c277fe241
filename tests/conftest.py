"""Shared test configuration and fixtures: hypothesis profiles, the CLI in-process (``invoke``),
the synthetic chain most CLI tests plan on (``profile_path``) with its lowest feasible peak, a
small model profiled under bf16 with two micro-batches whose blocks have op-level menus
(``menu_profile``), and for tests that check bytes the fewest dispatch-timing rounds (``bytes_only``)
and one intra-op thread (``one_thread``); torch's compile settings a kept plan changes are put back after
each test."""

from __future__ import annotations

import contextlib
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from typer.testing import CliRunner

from cli import app
from planner.model.synthetic import random_chain, synthetic_profile

# CI runs a fixed set of examples (a red CI must be reproducible, not a lucky draw); a developer's
# run draws new ones, so the property tests keep searching. HYPOTHESIS_PROFILE=ci reproduces CI.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))

# NOTE [ Inherited SIGINT ]
# A suite started in the background by a non-interactive shell (`cmd &`, nohup) inherits SIGINT
# ignored, and an ignored signal stays ignored across exec: the CLI children that the fault tests
# interrupt with SIGINT would then run on as if never interrupted (Python installs its
# KeyboardInterrupt handler only where SIGINT is not ignored). remat rightly keeps an ignored
# SIGINT ignored, as every Unix tool does; the tests want a Ctrl-C, so the suite takes SIGINT back:
# a handled signal is reset to its default in each exec'd child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

CHAIN_MIN_FEASIBLE_BYTES = 7197536 - 170501
"""The cost model's lowest feasible peak of ``profile_path``'s chain (no headroom): h.1, h.2, h.3, h.5 and h.6
checkpointed, the peak at h.5's recompute. h.5 makes its output (170,501 bytes) after its last save and does not
save it, so its replay stops before re-making it (NOTE [ The replay stops at the last save ]); counted as re-made,
the peak was 7,197,536."""

_runner = CliRunner()


@pytest.fixture(autouse=True)
def compile_settings_of_a_fresh_process() -> Iterator[None]:
    """torch's process-wide compile settings that ``apply_plan`` of a compiled plan changes until its handle is
    removed (NOTE [ CSE across checkpointed regions ], NOTE [ Side effects in a checkpointed region ]) are put
    back after each test: a test that applies a plan and keeps it, as a training job does, is its own job."""
    from planner.profiling.aot_cse import settings_now

    restore = settings_now()
    yield
    restore.remove()


def invoke(*args: str | Path):
    """``remat ARGS...`` through typer's CliRunner: ``.exit_code``, ``.stdout``, ``.stderr``, ``.output``."""
    return _runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    """An 8-block synthetic chain saved as a profile: fits 10MB with one checkpoint, needs at least
    ``CHAIN_MIN_FEASIBLE_BYTES`` without headroom."""
    path = tmp_path / "profile.json"
    synthetic_profile(random_chain(random.Random(0), 8)).save(path)
    return path


@pytest.fixture
def plan_path(tmp_path: Path, profile_path: Path) -> Path:
    """A plan of ``profile_path``'s chain at 10MB, saved."""
    path = tmp_path / "plan.json"
    assert invoke("plan", "--budget", "10MB", "--profile", profile_path, "-o", path, "-q").exit_code == 0
    return path


def signal_when_marked(cmd: list[str], marker: Path, sig: int, *, env: dict, cwd: Path,
                       timeout: float = 90) -> tuple[int, str]:
    """Run ``cmd``, send ``sig`` once ``marker`` exists (the model file makes it), return (exit code, stderr)."""
    import subprocess
    import time

    proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the marked point was never reached"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr


@contextlib.contextmanager
def fewest_dispatch_rounds() -> Iterator[None]:
    """Profiles made inside time selective checkpointing's dispatch over one round (``measure_sac_cost`` with
    ``rounds=1``), not as many as fit ``SAC_CPU_SECONDS`` (NOTE [ Selective dispatch cost ], Rule 4), nor
    ``SAC_ROUNDS`` rounds of whole steps where the regions cannot run alone: up to 10 CPU seconds a profile,
    or 108 steps, whose figures a test of bytes does not read. Every byte is recorded as before."""
    import functools

    from planner.profiling import sac_cost

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sac_cost, "measure_sac_cost", functools.partial(sac_cost.measure_sac_cost, rounds=1))
        yield


@pytest.fixture
def bytes_only() -> Iterator[None]:
    """For a test that checks bytes, not times: ``fewest_dispatch_rounds`` while it runs."""
    with fewest_dispatch_rounds():
        yield


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """torch at one intra-op thread inside (as benchmarks/zoo.py runs): CPU profiles made there time the
    thread's CPU time and measure no thread factors (NOTE [ Unit costs ], Rule 1b), whose rounds run on while
    the machine's other load keeps them from being clean (NOTE [ Clean rounds ]). For tests of bytes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """``one_intra_op_thread`` while the test runs."""
    with one_intra_op_thread():
        yield


@pytest.fixture(scope="session")
def menu_profile():
    """Three residual MLP blocks profiled on the CPU under bf16 autocast with two micro-batches:
    autocast's cached casts, gradients alive all step, op records. Selective checkpointing's
    dispatch cost is set aside, so that every block has a menu of op-level policies."""
    import torch
    from torch import nn

    from planner.model.schema import Recipe
    from planner.profiling import profile

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.out = nn.Linear(16, 64), nn.Linear(64, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.out(torch.relu(self.fc(x)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), *(Block() for _ in range(3)), nn.Linear(16, 4))
    inputs = torch.randn(1024, 8, generator=torch.Generator().manual_seed(0))  # activations outweigh parameters
    prof = profile(model, inputs, loss_fn=lambda out: out.float().square().mean(), device="cpu", steps=1,
                   recipe=Recipe(amp="bf16", grad_accum=2))
    # and every spread: under a loaded full suite the spreads exceeded a block's saving and emptied the
    # menus 3 runs of 4 (NOTE [ Selective menus ], Rule (noise)), which the cases using this are not about
    units = [u.model_copy(update={"forward_spread_ms": 0.0, "backward_spread_ms": 0.0}) for u in prof.units]
    return prof.model_copy(update={"sac_recomputed_op_ms": 0.0, "sac_kept_op_ms": 0.0, "units": units,
                                   "sac_recomputed_op_spread_ms": 0.0, "sac_kept_op_spread_ms": 0.0})
