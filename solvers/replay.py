"""Where a checkpointed region's replay in backward stops, so which of its outputs it re-makes
(NOTE [ The replay stops at the last save ]; NOTE [ Peak-memory model ], Rule 4, G_c). Torch-free, like
every solver module.

Example::

    replay_stop_seq(CostModel.of(g), "h.3")   # the seq of h.3's last pack: outputs made after it stay unmade
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from solvers.cost_model import CostModel

# NOTE [ The replay stops at the last save ]
#
# Rule 1. torch's non-reentrant ``torch.utils.checkpoint`` (``early_stop=True``, its default) stops a
# region's replay in backward once every tensor the region's forward packed is re-made: the pack hook
# of the replay raises ``_StopRecomputationError`` at the last one. What the region makes after its
# last save, typically its output (a residual add, a Linear's result: autograd packs an op's inputs
# before its kernel runs, its result after), is never re-made. Selective regions (Rule 9 of NOTE [
# Peak-memory model ]) replay through the same frame and stop the same way.
#
# Rule 2. ``replay_stop_seq`` is the sequence number of the region's last save in the profile, those
# released in the forward included (graph attribute "pack_seqs"): torch counts every pack, also of a node
# the caller's dropped output freed (NOTE [ Outputs the caller drops ]), so the replay runs on to it
# (``OffPathBlocks`` in tests/test_model_classes.py: the held saves alone gave 436,288 against 442,248); a
# custom Function's tensors kept on ctx are not packed (NOTE [ Tensors on ctx ]). -1 when the region
# packs nothing (its backward never unpacks, so it never replays). ``CostModel.replay_in_flight`` counts an
# output of c as re-made only when it was made at or before that save; ``simulate``, the DP's chain
# terms and the ILP's recompute rows all read that one method.
#
# Rule 3. The profile records a tensor's first save in a unit, and no parameter's (planner/profiling/
# recording.py, ``pack``), but torch counts every pack: an op whose packs are all of tensors saved before (or
# of parameters) runs the replay on past an output made before it. So each unit call also records its last
# pack of any tensor (``UnitRecord.last_pack_seq``, the seq when it packed), and "pack_seqs" holds those too.
# Measured (tests/test_model_classes3.py, ``WideGate``: ``wide = cat([a, b]).repeat(...)``, then ``a * b``,
# whose packs are a and b, saved before): the last block checkpointed, its replay the peak, was predicted
# 817,616 against 888,304 measured (-7.96%), the wide output (131,072 bytes) counted as not re-made; now
# 871,912 / 888,304 (-1.85%: Rule 5). Older profiles: the saves' seqs, as before.
#
# Rule 4. Measured (tests/test_model_classes2.py, ``verify(..., tolerance=0)``): four bottleneck blocks
# ``x + fc2(relu(fc1(x)))`` all checkpointed, the peak at the last one's recompute, were predicted 561,096
# against 507,472 measured (+65,536 output counted, the peak moving to the block's backward: 507,472 /
# 507,472 now); ending in ``tanh`` (it saves its output, which the replay re-makes) 561,096 / 561,104 before
# and after. Hugging Face ViTMAE (hidden 64, 3 encoder and 2 decoder layers), both decoder layers
# checkpointed: each layer's output is its residual add; 1,970,448 / 1,940,568 (+1.54%) before, exact now.
# Selective regions: a block's Python after its last pack ran once (forward only) under both full and
# selective checkpointing (torch 2.13), the replay stopping at the pack in both.
#
# Rule 5. Left: the replay's temporaries are its leaves' forward temporaries, calibrated against the unplanned
# forward, whose end holds what the block makes after its last pack (``WideGate``'s product, 16,384 bytes):
# a temporary above the stop (``cat``'s 32,768) is counted less that, 16,384 under. And where the outputs'
# gradients are one tensor (``x = h + g``: add's backward passes one gradient to both), G_c counts it per
# output, which Rule 3's re-made output no longer hides: four such gate blocks (width 128) checkpointed in the
# mid plan are +4,024 bytes over (+0.29%), all four +5,048 (+0.38%), exact before.


def replay_stop_seq(model: CostModel, c: str) -> int:
    """The seq of ``c``'s last pack, -1 if none (Rule 2)."""
    a, gg = model.graph.nodes[c], model.graph.graph
    lo_seq, hi_seq = a["fwd_start_seq"], a["fwd_end_seq"]
    packs = gg.get("pack_seqs")
    if packs is None:  # a graph built otherwise: the saves backward needs
        ctx = gg.get("ctx_held", frozenset())
        packs = sorted(seq for seq, t, _ in model.saves if t not in ctx)
    i = bisect.bisect_right(packs, hi_seq) - 1
    return packs[i] if i >= 0 and packs[i] >= lo_seq else -1


__all__ = ["replay_stop_seq"]
