"""Where a checkpointed region's replay in backward stops, so which of its outputs it re-makes
(NOTE [ The replay stops at the last save ]; NOTE [ Peak-memory model ], Rule 4, G_c), and what else it has
alive (NOTE [ What a replay allocates ]). Torch-free, like every solver module.

Example::

    replay_stop_seq(CostModel.of(g), "h.3")   # the seq of h.3's last pack: outputs made after it stay unmade
    replay_temporaries(CostModel.of(g), "h.3")  # what its replay runs beside, beyond what it re-makes
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

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
# Rule 5. The replay's temporaries were its leaves' forward temporaries, calibrated against the unplanned
# forward, whose end holds what the block makes after its last pack (``WideGate``'s product, 16,384 bytes):
# a temporary above the stop (``cat``'s 32,768) was counted less that, 16,384 under; now measured up to the
# stop (NOTE [ What a replay allocates ]). Left: where the outputs'
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


def replay_in_flight(model: CostModel, c: str) -> int:
    """Bytes alive while ``c`` is recomputed that ``CostModel.recomputed_bytes`` does not count: the gradients
    of c's outputs that code after c differentiates through (backward has reached c; NOTE [ Outputs without a
    gradient ]) and c's outputs the replay re-creates: not those c saves, nor those made after its last save
    (Rule 1); and its replay's copies of what custom Functions keep on ctx (NOTE [ Tensors on ctx ], Rule 3)."""
    a, gg = model.graph.nodes[c], model.graph.graph
    tb, outs, created = gg["tensor_bytes"], a.get("output_ids", ()), gg["tensor_created_seq"]
    lo, hi, stop = a["fwd_start_seq"], a["fwd_end_seq"], replay_stop_seq(model, c)
    ctx = [t for t in gg.get("ctx_held", ()) if lo <= created[t] <= hi]
    return (sum(tb.get(t, 0) for t in a.get("grad_output_ids", outs))
            + sum(tb.get(t, 0) for t in outs if t not in a["saved_ids"] and created.get(t, -1) <= stop)
            + sum(tb[t] for t in ctx))


# NOTE [ What a replay allocates ]
#
# Rule 1. A region's replay re-runs its forward from its start to its last pack (NOTE [ The replay stops at
# the last save ]): the same ops on the same inputs, keeping what they save for backward, freeing what they
# do not, as the step's own forward did. So what the replay has alive above what was alive when it began
# is, at its most, what that forward had alive above its start up to the same pack: the memory step records
# it per call (``UnitRecord.replay_rise_bytes``, under the tracker: the forward allocates the same under a
# dispatch mode, NOTE [ Step as run ], Rule 1). The recompute probe runs that rise beside what backward
# holds there, the gradients of the region's outputs and the replay's copy of the RNG state (NOTE [
# Peak-memory model ], Rules 4 and 7).
#
# Rule 2. ``replay_temporaries`` is the probe's T for a region: the rise less what the probe counts of it
# already (the saves the region made, the outputs and ctx copies it re-makes), plus Rules 4 and 6; without a
# rise (older profiles, compiled steps, synthetic graphs) the calibrated temporaries of its leaves' own
# forwards (NOTE [ A replay's temporaries ] in planner/model/graph.py). One term, so ``simulate``, the DP's
# chain terms and the ILP's recompute rows agree. The calibrated T is measured against the window's end,
# which holds what the region made after its last pack and the replay never makes: a temporary before that
# pack was counted less those bytes, and one after it counted though the replay never reaches it. Measured
# (tests/test_model_classes4.py): ``WideGate`` (``cat``'s 32,768 bytes alive while ``repeat`` makes the
# wide output, the product after the last pack) 871,912 predicted, 888,304 measured, now 888,208.
# Hugging Face ProphetNet (hidden 64, 2 + 2 layers, ngram 2), its first decoder layer checkpointed:
# 4,687,392 / 4,609,592 (+1.69%), its leaf's calibrated T 241,696 where the rise left 147,456; now
# 4,609,576 (with Rule 6).
#
# Rule 3. Selective regions take the same T: their replay makes less by the outputs they keep, which the
# probe's recomputed bytes leave out the same way. Compiled steps record no rise (their replay runs inside
# the fused backward: Rule 11 of NOTE [ Peak-memory model ]).
#
# Rule 4. The replay starts inside the first backward node that unpacks one of the region's saves; what
# backward made since the region's backward started (its ``bwd_start``: the gradient of an output complete)
# up to that unpack is alive beside the whole replay: a copy the nodes before it made (a permuted gradient
# made contiguous), an accumulation. The memory step notes it at each call's first unpack
# (``UnitRecord.bwd_before_replay_bytes``), and T adds it. Hugging Face VitDet's global-attention layer
# (hidden 64, 3 layers, image 32, patch 4, ``window_block_indices=[0, 2]``), checkpointed: the replay peaks
# at the decomposed relative position bias's two broadcast adds (131,072 bytes each) before the saves the
# probe counted in their place, and beside a 32,768-byte gradient its backward made first: 1,876,696
# predicted, 1,929,376 measured (-2.73%); the rise alone 1,896,576; now 1,929,368. Its lowest plan (layers 0
# and 1) 1,418,648 / 1,471,328 (-3.58%, over its budget), now 1,471,320 / 1,471,328.
#
# Rule 5. Rules 1 and 4 are taken under the tracker, where some steps run differently (NOTE [ Step as run ]: a
# scratch buffer only under a dispatch mode, gradients accumulated out of place); each is at most what the
# call's forward, or its backward, had alive above its start in the step as run (``_cap_replay_terms`` in
# planner/model/graph.py).
#
# Rule 6. Backward may hold more when the region's backward starts than the model holds there (static
# bytes, the gradients of parameters used after the region, the tensors held without checkpointing, the
# gradients of its outputs): the gradient of a tensor that later code took as well, waiting for the
# region's part (ProphetNet's encoder output, 16,384 bytes, which the second decoder layer's cross-attention
# differentiated first). ``calibrate_replay_starts`` takes it from the live bytes at the region's
# ``bwd_start`` in the step as run (``bwd_start_extra_bytes``), and T adds it. With Rules 1-4 alone
# ProphetNet's layer above was 16,440 bytes under.
#
# Rule 7. Under autocast the replay allocates more than the forward's rise (not traced: autocast's casts
# inside a replay, README's limitations): ``nn.TransformerEncoder`` (hidden 64, 2 layers, 64 tokens) under
# fp16, its first layer checkpointed, measured 2,445,300 where Rules 1-6 alone predicted 2,339,752 (-4.32%).
# There T is the larger of Rule 2's and the calibrated temporaries, as before Rule 6 (test_zoo.py's recipes).


def replay_temporaries(model: CostModel, c: str) -> int:
    """T of ``c``'s recompute probe, and the replay's RNG copy (Rule 2)."""
    g, gg = model.graph, model.graph.graph
    leaf_t = [g.nodes[model.leaves[i]].get("unit_fwd_transient_bytes", model.forward_base_bytes[i]
                                           - model.rank.fwd_static_bytes) if model.calibrated else 0
              for i in model.node_leaves[c]]
    t = max(0, max(leaf_t, default=0) + gg.get("replay_transient_bytes", 0))
    rise = g.nodes[c].get("replay_rise_bytes")
    if rise is not None and model.calibrated:
        a, tb, created = g.nodes[c], gg["tensor_bytes"], gg["tensor_created_seq"]
        own = model.recomputed_bytes(c, a["fwd_end_seq"]) - sum(
            tb[x] for x in a["saved_ids"] & model.cast_ids if not a["fwd_start_seq"] <= created[x] <= a["fwd_end_seq"])
        measured = (max(0, rise - own - (replay_in_flight(model, c) - _output_grads(model, c)))
                    + a.get("bwd_before_replay_bytes", 0) + a.get("bwd_start_extra_bytes", 0))
        t = max(t, measured) if gg.get("amp") else measured  # Rule 7
    return t + gg.get("replay_rng_copy_bytes", 0)


def _output_grads(model: CostModel, c: str) -> int:
    """Bytes of the gradients of ``c``'s outputs that code after it differentiates through (G_c's first term)."""
    a, tb = model.graph.nodes[c], model.graph.graph["tensor_bytes"]
    return sum(tb.get(x, 0) for x in a.get("grad_output_ids", a.get("output_ids", ())))


def calibrate_replay_starts(g: Any, raw: CostModel) -> None:
    """Each region's ``bwd_start_extra_bytes``: what backward had alive when the region's backward began,
    beyond the static bytes, what the step holds there without checkpointing and its outputs' gradients (Rule 6);
    ``raw``: the model without temporaries, one process."""
    pos = None
    for c, a in g.nodes(data=True):
        if "bwd_start_live_bytes" in a:
            pos = raw.holdings(frozenset()) if pos is None else pos
            end = a["fwd_end_seq"]
            held = sum(raw.tensor_bytes[t] for t, p in pos.items() if p <= end)
            a["bwd_start_extra_bytes"] = max(0, a["bwd_start_live_bytes"] - raw.backward_static(end, end)[0] - held
                                             - _output_grads(raw, c))


__all__ = ["calibrate_replay_starts", "replay_in_flight", "replay_stop_seq", "replay_temporaries"]
