"""AOTAutograd's common-subexpression pass, off where remat's checkpointed regions are compiled (NOTE [ CSE
across checkpointed regions ]).

Example::

    with regions_apart(True):      # the profile's compile with the repeated blocks checkpointed
        step()
    undo = keep_regions_apart(plan, regions=True)  # apply_plan of a compiled plan; undo.remove() restores the setting
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from planner.profiling.step_changes import logger

# NOTE [ CSE across checkpointed regions ]
#
# Before it partitions the joint graph, AOTAutograd merges identical nodes (``fx_graph_cse``,
# ``torch._functorch.config.cse``) without regard to which checkpointed region each belongs to.
# Two layers' identical constants (a Hugging Face attention's zeros of 4x4x256x256 floats in the
# decomposed SDPA, its additive causal mask) become one node in the first layer's region, read by
# every later region; a region's output read elsewhere must be saved, so the compiled step keeps
# them from the forward to the backward, where the plain compiled step (no regions) recomputes
# them. Measured, every block checkpointed whole, one CPU thread: examples/gpt2.py peaked at
# 68,551,792 B with the pass and 57,937,520 B without (-15.5%), examples/llama.py 42,826,024 and
# 38,072,360 B (-11.1%); the step's CPU time moved +1 to +3% (the merged nodes run once per layer).
# Rule 1. remat compiles its regions with the pass off: the profile's compile with the blocks
#   checkpointed, the check's compiles and ``remat verify --compile`` (``apply_plan``), and the
#   user's ``torch.compile`` after ``apply_plan`` of a plan that records it (``CompileInfo.aot_cse``
#   False). The profile's first compile, with no region, keeps the pass: it is the step as the user
#   compiles it.
# Rule 2. The setting is the process's (torch reads it when it compiles); ``apply_plan`` sets it,
#   says so once on stderr, and ``handle.remove()`` puts the previous value back. Plans made before
#   (``aot_cse`` True) leave it alone: they were measured with the pass on.


@contextlib.contextmanager
def regions_apart(apart: bool) -> Iterator[None]:
    """AOTAutograd's CSE off for the duration when ``apart`` (a compile with checkpointed regions, Rule 1)."""
    if not apart:
        yield
        return
    with torch._functorch.config.patch(cse=False):
        yield


class _Restore:
    """Puts AOTAutograd's CSE setting back (Rule 2); a hook-like ``remove()`` for the plan's handle."""

    def __init__(self, before: bool):
        self.before, self.done = before, False

    def remove(self) -> None:
        if not self.done:
            self.done = True
            torch._functorch.config.cse = self.before


def keep_regions_apart(plan: Any, regions: bool) -> _Restore | None:
    """For a compiled ``plan`` that records CSE off and has ``regions``: the setting made (Rule 2), and how to
    undo it; None otherwise."""
    if plan.compile is None or plan.compile.aot_cse or not regions:
        return None
    before = torch._functorch.config.cse
    if before:
        logger.warning("remat: torch.compile runs with torch._functorch.config.cse=False while this plan is applied "
                       "(the plan was measured so): AOTAutograd's CSE merges identical ops of different checkpointed "
                       "regions into the first, which must then save them; handle.remove() restores it")
    torch._functorch.config.cse = False
    return _Restore(before)


__all__ = ["keep_regions_apart", "regions_apart"]
