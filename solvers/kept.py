"""When a tensor the step's code keeps outside autograd counts in a forward probe of the cost model
(NOTE [ Outputs the caller drops ] in planner/profiling/releases.py; NOTE [ Peak-memory model ], Rule 4,
kept_i). Torch-free, like every solver module.

Example::

    kept_at(made=40, dropped=199, seq=199)     # True: still kept at the end of the window ending at 199
"""

from __future__ import annotations

import bisect


def ever_kept(made: int, dropped: int, leaf_end: tuple[int, ...]) -> bool:
    """Whether some forward probe counts a tensor kept from ``made`` to ``dropped`` (``kept_at``): one made
    and dropped inside a window never does (NOTE [ Outputs the caller drops ], Rule 3)."""
    k = bisect.bisect_left(leaf_end, made)
    return (k < len(leaf_end) and leaf_end[k] <= dropped) or dropped > (leaf_end[-1] if leaf_end else -1)


def kept_at(made: int, dropped: int, seq: int, after: int | None = None) -> bool:
    """Whether a tensor the step's code keeps from ``made`` until it drops it at ``dropped`` counts in the
    forward probe at ``seq`` (NOTE [ Outputs the caller drops ], Rule 3): made by then and dropped at or
    after it; ``after``, for the tail: dropped after the last leaf's end ``after``."""
    return made <= seq and (dropped >= seq if after is None else dropped > after)


__all__ = ["ever_kept", "kept_at"]
