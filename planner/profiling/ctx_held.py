"""Tensors a custom ``torch.autograd.Function`` keeps on ``ctx`` attributes (NOTE [ Tensors on ctx ]), found by
the memory step (``recording.py``) when the forward ends.

Example::

    held = ctx_tensors(loss)          # [tensor, ...] that backward's custom nodes keep as attributes
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# NOTE [ Tensors on ctx ]
#
# A custom ``autograd.Function`` may keep a tensor for its backward as an attribute (``ctx.x = x``)
# instead of ``ctx.save_for_backward(x)``. ``ctx`` is the node backward runs, so the tensor lives until
# backward passes that node, as a save does; but no saved-tensor hook sees it, so a checkpointed region
# does not drop it either. The profile recorded no save, the unplanned step's calibration took the
# tensor into every later window's temporaries, and the validation step found it alive after a
# checkpointed forward: retained bytes (NOTE [ Peak-memory model ], Rule 7), counted again beside
# the calibration once its unit was checkpointed. Three blocks with such a GELU (hidden 32), one
# checkpointed: +7.66% (the middle block) and +8.12% (the first), 32,768 bytes over in every window.
#
# Rule 1. When the forward ends, the memory step walks the nodes backward will run (from the loss's
# ``grad_fn``) and takes the tensors among the attributes of the custom ones (``ctx_tensors``):
# ``TensorRecord.ctx_held``.
# Rule 2. ``build_graph`` counts each as a save at its creation that no region drops (no containing
# graph node: held as glue code's saves are, whatever is checkpointed), and takes the ones a unit made
# out of that unit's retained bytes, which measured them.
# Rule 3. A replay runs the Function again, and its new node keeps a second copy until the replay's
# graph is dropped, when the replay ends: the recompute probe counts it beside the replay (``CostModel.
# replay_in_flight``); the backward windows after it do not.


def ctx_tensors(loss: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that custom autograd nodes reachable from ``loss`` keep as attributes (Rule 1)."""
    root = loss.grad_fn
    if root is None:
        return
    seen, stack = {id(root)}, [root]
    kept = [root]  # keeps each wrapper alive, so that ``id`` stays unique during the walk
    while stack:
        node = stack.pop()
        for value in getattr(node, "__dict__", {}).values():
            yield from _tensors(value)
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                kept.append(nxt)
                stack.append(nxt)


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


__all__ = ["ctx_tensors"]
