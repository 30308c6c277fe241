"""One tensor passed to a checkpointed region several times stays one tensor when it is recomputed.

Example::

    distinct, slots = distinct_tensors((h, h, h, mask))   # [h, mask], [0, 0, 0, 1]
    args = [distinct[i] for i in slots]                    # (h, h, h, mask) again
"""

from __future__ import annotations

from typing import Any

import torch

# NOTE [ Aliased arguments ]
#
# Non-reentrant ``checkpoint`` keeps a region's tensor arguments for the recomputation by saving
# them for backward (its ``_NoopSaveInputs``), and hands the recomputation what autograd unpacks.
# With no ``saved_tensors_hooks`` in force, an argument comes back as the very object passed; with
# any hooks in force (remat's own recorder in ``verify``, an offload plan, the memory-safe profile,
# a user's ``save_on_cpu``), every saved argument is unpacked as a new tensor object. A forward
# that branches on identity then takes another path when recomputed: ``nn.MultiheadAttention``
# called as ``attn(h, h, h)`` checks ``query is key is value`` and projects with one packed matmul,
# but the replay gets three distinct objects and projects three times, saving other tensors, and
# backward fails with torch's "Recomputed values ... have different metadata". So the applier passes
# each distinct tensor once and rebuilds the argument list from it inside the region: every
# position that held one object holds one (unpacked) object again, in the forward and the replay.

def distinct_tensors(values: tuple[Any, ...] | list[Any]) -> tuple[list[Any], list[int]]:
    """``values`` with every tensor object once, and for each value its index in that list."""
    distinct: list[Any] = []
    slots: list[int] = []
    seen: dict[int, int] = {}
    for v in values:
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen[id(v)] = len(distinct)
                distinct.append(v)
            slots.append(seen[id(v)])
        else:
            slots.append(len(distinct))
            distinct.append(v)
    return distinct, slots


__all__ = ["distinct_tensors"]
