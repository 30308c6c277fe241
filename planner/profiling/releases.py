"""When the step's code drops the tensors units return (NOTE [ Outputs the caller drops ]), for the memory
step (``recording.py``).

Example::

    watch = Releases(lambda: recorder.seq)
    watch.watch(output, tensor_id)      # in a unit's forward hook
    ...                                  # the caller drops ``output``
    watch.released                       # {tensor_id: seq}
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

# NOTE [ Outputs the caller drops ]
#
# A unit's output that no later unit takes (Hugging Face RoFormer's attention probabilities beside the
# hidden states, ``outs = block(x); x = outs[0]``) lives as long as the caller keeps it: here until the
# next block returns and ``outs`` is rebound. Unplanned, its own softmax saves it, so it is held anyway;
# with its block checkpointed nothing holds it, yet it is alive through the next block's forward, and
# the cost model counted it nowhere: three attention blocks (hidden 32, 64 tokens), the middle one
# checkpointed, peaked in the last block's forward 65,536 bytes (the probabilities) above that window's
# prediction: 980,824 measured against 966,232 predicted (-1.49%), over the plan's budget.
#
# Rule 1. The memory step watches every tensor object a unit returns with a ``weakref``: the pack hook
# keeps a detached alias of what autograd saves (NOTE [ Saved tensors without their graph ]), so the
# object the unit returned dies exactly when the step's code drops its last reference to it (a view the
# caller keeps holds it through ``_base``). The sequence number then is the tensor's release
# (``TensorRecord.released_seq``); several objects on one storage: the last. Watched until backward
# starts: the step drops the model's output before it (``make_step``); an output alive past that (an
# attribute keeps it) has none, and the validation step's retained bytes count it (NOTE [ Peak-memory
# model ], Rule 7).
#
# Rule 2. The graph keeps releases of the outputs no unit takes as input ("dropped", ``build_graph``):
# the others are held by the units that take them, or in flight (Rule 4), or kept by the caller with
# no save holding them (Rule 5). The cost model counts a dropped tensor it does not hold in every
# forward window that sees it alive (NOTE [ Peak-memory model ], Rule 4, kept_i), as it counts
# autocast's cached casts.
#
# Rule 4. Saves of a branch no loss reads. An extra output computed off the hidden states' path
# (``return x + f(x), up(x).softmax(-1)``) is saved by nodes backward never runs; they live until
# the caller drops that output, then go with it. Held "until backward passes them", they were
# counted in every later window; the unplanned step's calibration absorbed that (T is never below
# 0), so a plan that checkpointed the block, dropping the save, was predicted below the measured
# step: three such MLP blocks (hidden 32), the first checkpointed, 403,520 against 436,288 (-7.51%);
# the second, 469,952 against 442,248 (+6.26%). The memory step also watches what its pack hook
# hands autograd (``watch_save``): a save whose every copy dies before backward starts is released
# then (``SaveRecord.released_seq``). ``build_graph`` leaves such saves out (they hold nothing for
# backward, nor does a replay keep them) and counts their tensor like a dropped output until then,
# checkpointed or not: exact for the softmax's own output, the tensor the caller drops; an
# intermediate of a longer such branch would be counted while a checkpointed region has freed it
# (an over-count). A tensor also saved for backward, or taken by a unit, is held as before.
#
# Rule 3. A forward probe is its window's end (``kept_at``): a dropped tensor counts in the probe at
# ``seq`` when made by then and dropped at or after it. Rebinding ``outs`` once the next block has
# returned drops the probabilities just after that block's end, whose last moments still hold them;
# one dropped inside a later window is not counted there, nor one made and dropped inside a window
# (among its measured temporaries). The tail: dropped after the last leaf's end; those dropped right
# at it are in the last window's probe, the same moment.
#
# Rule 5. An input the caller keeps that no save holds. Hugging Face's Swinv2 keeps the patch embeddings
# (``embedding_output``) in its forward's frame until it returns, and its post-norm stage 0 saves a
# windowed copy, not that tensor: unplanned, the embeddings are alive through every window yet held by
# nothing, so each window's calibrated temporaries T absorbed them; with stage 0 checkpointed they are
# its kept input, held, and were counted a second time in every forward window to the frame's return
# and in stage 0's recompute probe: the step's peak, 2,456,912 predicted against 2,391,416 measured
# (+2.74%). Such a tensor (a unit took it, no save holds it, the caller dropped it in the forward) is
# kept like the outputs no unit takes (Rule 2): counted until its release while nothing holds it, and
# left out of T; ``_dropped`` in planner/model/graph.py. The chain recurrence cannot tell whether the
# region keeping it was chosen and counts it as kept whatever is (an over-count, not exact); the ILP
# counts a unit's input so already.


class Releases:
    """Sequence numbers at which the tensor objects units returned died, per tensor id (Rule 1)."""

    def __init__(self, seq: Callable[[], int]):
        self.seq = seq
        self.released: dict[int, int] = {}
        self.refs: list[weakref.ref] = []
        self.watching = True
        self.saves_alive: dict[tuple[int, str], int] = {}
        self.saves_released: dict[tuple[int, str], int] = {}
        """(tensor id, unit) of a save -> when autograd let go of its last copy in the forward (Rule 4)."""

    def watch(self, t: torch.Tensor, tensor_id: int) -> None:
        """Note when ``t``, a tensor a unit returned (tensor id ``tensor_id``), dies."""
        if self.watching:
            self.refs.append(weakref.ref(t, lambda _ref, tid=tensor_id: self._dropped(tid)))

    def watch_save(self, packed: torch.Tensor, key: tuple[int, str]) -> None:
        """Note when ``packed``, what the pack hook gave autograd for save ``key`` (tensor id, unit), dies."""
        if self.watching:
            self.saves_alive[key] = self.saves_alive.get(key, 0) + 1
            self.refs.append(weakref.ref(packed, lambda _ref, key=key: self._save_dropped(key)))

    def _dropped(self, tensor_id: int) -> None:
        if self.watching:
            self.released[tensor_id] = max(self.released.get(tensor_id, -1), self.seq())

    def _save_dropped(self, key: tuple[int, str]) -> None:
        if self.watching:
            self.saves_alive[key] -= 1
            if not self.saves_alive[key]:
                self.saves_released[key] = self.seq()

    def stop(self) -> None:
        """Stop watching (backward starts); a dead ``weakref`` object never calls its callback. A save
        with a copy still alive is held for backward."""
        self.watching = False
        self.refs.clear()
        self.saves_released = {k: v for k, v in self.saves_released.items() if not self.saves_alive[k]}


__all__ = ["Releases"]
