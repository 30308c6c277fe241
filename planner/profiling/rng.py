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
# Generators a model creates for itself remat cannot seed; verify compares two fresh models, which
# seed their own alike. A region's replay must still draw what its forward drew from them, or its
# gradients are silently wrong (a block drawing its dropout mask from ``self.gen``, a
# ``torch.Generator``, gave gradients 3e-3 off the unplanned model's): NOTE [ Generators a
# model holds ].

# NOTE [ Generators a model holds ]
#
# The generators a checkpointed region's modules hold as attributes (``self.gen =
# torch.Generator()``, a ``np.random.Generator`` or ``RandomState``, a ``random.Random``), found by
# ``held_generators`` when the region first runs, are captured with numpy's and Python's global
# ones (``HostRngState.capture(held)``) and replayed like them. A ``torch.Generator``'s state is
# kept as bytes, outside torch's allocator: as a tensor it was 5,056 bytes of CPU device memory
# per region call until its backward, which the cost model does not count (measured 0.36% above
# the prediction). A generator reached otherwise (a global, a closure, one passed as an argument)
# is not seen: its draws differ in the replay.

_HELD = (torch.Generator, random.Random)


def held_generators(module: torch.nn.Module) -> tuple[Any, ...]:
    """The generators ``module`` and its submodules hold as attributes (NOTE [ Generators a model holds ])."""
    np = sys.modules.get("numpy")
    kinds = _HELD + ((np.random.Generator, np.random.RandomState) if np is not None else ())
    found = {id(v): v for m in module.modules() for v in vars(m).values() if isinstance(v, kinds)}
    return tuple(found.values())


def _state(gen: Any) -> Any:
    if isinstance(gen, torch.Generator):  # as bytes: a state tensor kept to the region's backward is device memory
        return gen.get_state().numpy().tobytes()
    if isinstance(gen, random.Random):
        return gen.getstate()
    return gen.get_state() if hasattr(gen, "get_state") else gen.bit_generator.state  # RandomState, Generator


def _set_state(gen: Any, state: Any) -> None:
    if isinstance(gen, torch.Generator):
        gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    elif isinstance(gen, random.Random):
        gen.setstate(state)
    elif hasattr(gen, "set_state"):
        gen.set_state(state)
    else:
        gen.bit_generator.state = state


@dataclass(frozen=True)
class HostRngState:
    """The state of numpy's global generator (when numpy is imported), of Python's ``random`` and of the
    generators a region's modules hold (NOTE [ Generators a model holds ])."""

    numpy: Any
    python: Any
    held: tuple[tuple[Any, Any], ...] = ()

    @staticmethod
    def capture(held: tuple[Any, ...] = ()) -> HostRngState:
        np = sys.modules.get("numpy")
        return HostRngState(np.random.get_state() if np is not None else None, random.getstate(),
                            tuple((g, _state(g)) for g in held))

    def restore(self) -> None:
        np = sys.modules.get("numpy")
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)
        random.setstate(self.python)
        for gen, state in self.held:
            _set_state(gen, state)


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


__all__ = ["held_generators", "HostRngState", "kept", "seed_all"]
