"""Time of every forward op, on the profile's clock (NOTE [ Op records ] in ``recording.py``): a few extra
steps under a dispatch mode, each op keeping its least time.

Example::

    runs = op_timing_steps(run, dev, OP_TIMING_STEPS, clock)   # per step, the counted ops' ms in order
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from planner.profiling.recording import counted_op
from planner.profiling.timing import WallClock

OP_TIMING_STEPS = 2
"""Extra steps timing each forward op (NOTE [ Op records ]); each op keeps its least time."""


class _OpTimer(TorchDispatchMode):
    """Time of every counted op of the forward, in order, on the profile's clock (NOTE [ Op
    records ]): a few extra steps give each op the least of its times, which noise on a shared
    machine only raises."""

    def __init__(self, clock: Any, sync: Callable[[], None] | None):
        super().__init__()
        self.clock, self.sync = clock, sync
        self.ms: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.sync is not None:
            self.sync()
        t0 = self.clock.stamp()
        out = func(*args, **(kwargs or {}))
        if self.sync is not None:
            self.sync()
        if counted_op(func):
            self.ms.append(self.clock.ms(t0, self.clock.stamp()))
        return out


def op_timing_steps(step: Callable, dev: torch.device, steps: int, clock: Any | None = None) -> list[list[float]]:
    """Per step, the forward's counted op times (``_OpTimer``) on ``clock`` (the profile's; on CUDA
    and by default the wall clock, synchronised around each op on CUDA)."""
    sync = functools.partial(torch.cuda.synchronize, dev) if dev.type == "cuda" else None
    if clock is None or dev.type == "cuda":
        clock = WallClock()
    runs = []
    for _ in range(steps):
        timer = _OpTimer(clock, sync)

        def mark(name: str, _value: Any = None, timer: _OpTimer = timer) -> None:
            if name == "step_start":
                timer.__enter__()
            elif name == "forward_end":
                timer.__exit__(None, None, None)

        step(mark)
        runs.append(timer.ms)
    return runs


__all__ = ["OP_TIMING_STEPS", "op_timing_steps"]
