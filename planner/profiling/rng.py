"""Every random number generator a model can draw from: torch's (CPU and CUDA), numpy's global one and
Python's ``random``; seeded together, saved and restored together.

Example::

    with kept("cpu"):
        seed_all(0)                             # torch, numpy and random; put back on exit
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


# NOTE [ Randomness outside torch ]
#
# Models draw random numbers outside torch: Wav2Vec2's SpecAugment picks the time and feature
# spans it masks with ``np.random``, its adapter's layerdrop with ``np.random.random()``. Three
# places must treat those generators as they treat torch's:
#   - ``remat verify`` compares the planned and the unplanned step from the same state, so it
#     seeds them all (``seeded``) before each compared step: seeded with torch alone, a
#     Wav2Vec2's two runs masked different frames and their gradients differed;
#   - profiling and verifying leave the caller's generators as they found them (``kept``);
#   - a checkpointed region's recompute replays the draws of its forward: torch's
#     ``checkpoint(preserve_rng_state=True)`` does it for torch's generators, the applier does
#     it for numpy's and Python's (``HostRngState``, planner/act/applier.py), or a region whose
#     forward draws from numpy would recompute other masks than it saved: silently wrong
#     gradients. The saved state is host memory (about 2.5 KB for numpy's, one per region
#     call until its backward), not device memory.
# Generators a model creates for itself (``np.random.default_rng()``, a ``torch.Generator``) are
# its own business: remat can neither seed nor see them.

@dataclass(frozen=True)
class HostRngState:
    """The state of numpy's global generator (when numpy is imported) and of Python's ``random``."""

    numpy: Any
    python: Any

    @staticmethod
    def capture() -> HostRngState:
        np = sys.modules.get("numpy")
        return HostRngState(np.random.get_state() if np is not None else None, random.getstate())

    def restore(self) -> None:
        np = sys.modules.get("numpy")
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)
        random.setstate(self.python)


@contextlib.contextmanager
def kept(device: torch.device | str | None = None) -> Iterator[None]:
    """Restore every generator of NOTE [ Randomness outside torch ] on exit (torch's CUDA one of
    ``device`` when it is a CUDA device)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    host = HostRngState.capture()
    cuda = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            yield
    finally:
        host.restore()


def seed_all(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), numpy's global generator and Python's ``random``."""
    torch.manual_seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)
    random.seed(seed)


__all__ = ["HostRngState", "kept", "seed_all"]
