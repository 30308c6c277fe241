"""Every random number generator a model can draw from: torch's (CPU and CUDA), numpy's global one and
Python's ``random``; seeded together, saved and restored together.

Example::

    with kept("cpu"):
        seed_all(0)                             # torch, numpy and random; put back on exit
"""

from __future__ import annotations

import contextlib
import ctypes
import random
import struct
import sys
from collections.abc import Callable, Iterator
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

# NOTE [ Regions that draw nothing ]
#
# Taking numpy's and Python's states at a region's forward and putting them back around its
# replay cost 1.36 ms per step of examples/llama.py's four checkpointed layers under cProfile
# (eight captures, 0.80 ms; eight restores, 0.56 ms: numpy's ``get_state`` and ``set_state``
# are 34 and 36 us each on a quiet machine), most of remat's own 2.14 ms per step there, and
# Hugging Face's every-layer checkpointing pays none of it. Most regions draw from neither.
# Rule. The forward takes the states before and after the region (``same_as``); when no
# generator moved, the region drew nothing from them, and its replay runs as it is: no capture,
# no restore. The replay runs the same code on the same inputs, so it draws nothing either.
# Where a generator moved, the forward's states are kept and replayed as before. The one case
# this misses: a region that draws and then puts the generator back itself (``set_state`` to what
# it found) moves nothing net, and its replay draws from the state of the replay's time. A region
# that seeds before drawing (a fixed-seed context) replays alike either way.

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


def _same_numpy(a: Any, b: Any) -> bool:
    """Equality of two of numpy's legacy states: ('MT19937', key, pos, has_gauss, cached_gaussian)."""
    if a is None or b is None or a is b:  # one cached state (NOTE [ Reading global states cheaply ])
        return a is b
    return a[0] == b[0] and a[2:] == b[2:] and bool((a[1] == b[1]).all())


def _same(a: Any, b: Any) -> bool:
    """Equality of two generator states: tuples, dicts, arrays (numpy's key), bytes, numbers."""
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy's MT19937 key
        return hasattr(b, "shape") and a.shape == b.shape and bool((a == b).all())
    return type(a) is type(b) and a == b


# NOTE [ Reading global states cheaply ]
#
# ``np.random.get_state()`` copies numpy's global MT19937 state into a new array and tuple (33 us)
# and ``random.getstate()`` Python's into a tuple of 625 ints (7 to 11 us). The applier takes both
# twice per checkpointed forward (NOTE [ Regions that draw nothing ]), where Hugging Face's
# checkpointing takes neither; most steps draw from neither.
# Rule 1. Each generator's C state (624 key words and the position, 2,500 bytes: numpy's
# ``mt19937_state`` at ``bit_generator.ctypes.state_address``; CPython's ``RandomObject`` after
# the object header) is read as bytes (0.5 us) and compared with the bytes read beside the last
# full state; equal bytes give that state back.
# Rule 2. Equal words are not the same state when that state held a cached Gaussian (numpy's
# ``has_gauss``, Python's ``gauss_next``): a normal draw consumes the cache and moves no word. Then,
# and when the bytes differ, the state is read in full (and cached).
# Rule 3. The bytes are trusted only after they were checked once against a full state (the words
# and the position); a layout that does not match (another numpy or Python build, a global numpy
# generator other than MT19937 from ``np.random.set_bit_generator``) reads in full every time.


class _GlobalState:
    """A global generator's state, read in full only when it may have moved (NOTE [ Reading global states
    cheaply ]). One thread's: a draw by another thread between the bytes and the full read fails Rule 3's
    check (then every read is full) or leaves bytes older than the state, which the next read replaces."""

    def __init__(self, words: Callable[[], bytes | None], full: Callable[[], Any],
                 matches: Callable[[bytes, Any], bool], cached_draw: Callable[[Any], bool]):
        self.words_of, self.full_of, self.matches, self.cached_draw = words, full, matches, cached_draw
        self.trusted: bool | None = None  # Rule 3: unknown until checked
        self.words: bytes | None = None
        self.full: Any = None

    def state(self) -> Any:
        words = self.words_of() if self.trusted is not False else None
        if words is not None and words == self.words and not self.cached_draw(self.full):  # Rules 1-2
            return self.full
        full = self.full_of()
        if words is not None and self.trusted is None:
            self.trusted = self.matches(words, full)
        self.words, self.full = (words if self.trusted else None), full
        return full


_MT_BYTES = 4 * 624 + 4
_Words = ctypes.c_char * _MT_BYTES


class _Located:
    """A view of a generator's C state, found again only when the generator object changes: the view's
    ``raw`` is one copy of the bytes, where ``ctypes.string_at`` is a foreign call (14 us a capture in a
    step, 3.6 us in a loop)."""

    def __init__(self, owner: Callable[[], Any], address: Callable[[Any], int | None]):
        self.owner_of, self.address_of = owner, address
        self.owner: Any = None  # held: the view's memory is the owner's
        self.view: Any = None

    def __call__(self) -> bytes | None:
        try:
            owner = self.owner_of()
        except (AttributeError, KeyError):
            return None
        if owner is not self.owner:
            address = self.address_of(owner)
            self.owner, self.view = owner, (_Words.from_address(address) if address is not None else None)
        return self.view.raw if self.view is not None else None


def _numpy_address(bits: Any) -> int | None:
    return bits.ctypes.state_address if type(bits).__name__ == "MT19937" else None  # Rule 3; key[624], pos


def _numpy_matches(words: bytes, full: Any) -> bool:
    return words[:-4] == full[1].tobytes() and struct.unpack("i", words[-4:])[0] == full[2]


def _python_matches(words: bytes, full: Any) -> bool:
    return struct.unpack("i", words[:4])[0] == full[1][-1] and struct.unpack("624I", words[4:]) == full[1][:-1]


_NUMPY = _GlobalState(_Located(lambda: sys.modules["numpy"].random.mtrand._rand._bit_generator, _numpy_address),
                      lambda: sys.modules["numpy"].random.get_state(), _numpy_matches,
                      lambda full: bool(full[3]))
_PYTHON = _GlobalState(_Located(lambda: random._inst, lambda inst: id(inst) + object.__basicsize__),
                       random.getstate, _python_matches, lambda full: full[2] is not None)  # int index, state[624]


@dataclass(frozen=True, slots=True)
class HostRngState:
    """The state of numpy's global generator (when numpy is imported), of Python's ``random`` and of the
    generators a region's modules hold (NOTE [ Generators a model holds ])."""

    numpy: Any
    python: Any
    held: tuple[tuple[Any, Any], ...] = ()

    @staticmethod
    def capture(held: tuple[Any, ...] = ()) -> HostRngState:
        np = sys.modules.get("numpy")
        return HostRngState(_NUMPY.state() if np is not None else None, _PYTHON.state(),
                            tuple((g, _state(g)) for g in held) if held else ())

    def same_as(self, other: HostRngState) -> bool:
        """Whether every generator is where ``other`` found it (NOTE [ Regions that draw nothing ])."""
        return (_same_numpy(self.numpy, other.numpy) and (self.python is other.python or self.python == other.python)
                and len(self.held) == len(other.held)
                and all(g is h and _same(a, b) for (g, a), (h, b) in zip(self.held, other.held)))

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
