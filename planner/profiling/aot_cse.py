"""How remat's checkpointed regions are compiled: AOTAutograd's common-subexpression pass off (NOTE [ CSE
across checkpointed regions ]), a region's forward side effects run once (NOTE [ Side effects in a
checkpointed region ]).

Example::

    with regions_apart(True):      # the profile's compile with the repeated blocks checkpointed
        step()
    undo = keep_regions_apart(plan, regions=True)  # apply_plan of a compiled plan; undo.remove() restores the settings
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch._functorch.config  # noqa: F401 -- read and set below; torch imports it lazily

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


# NOTE [ Side effects in a checkpointed region ]
#
# A Hugging Face layer's forward writes transformers' output-capturing context variable. Under a
# checkpoint, dynamo cannot trace a region with such a side effect (eager checkpointing replays it
# in the recompute, which a compiled backward cannot), so by default it breaks the graph ("HOP:
# Unsafe side effect", once per layer per step) and runs the checkpoint eagerly between compiled
# frames: the region's forward and replay are eager kernels, its saves the eager ones. Dynamo's
# ``skip_fwd_side_effects_in_bwd_under_checkpoint`` traces it instead, the side effect running in
# the forward only, as Hugging Face's capture wants it (its replay would capture the layer twice).
# Measured, every block checkpointed whole, one CPU thread, kernels built (docs/benchmarks.md,
# "Round 22"): examples/llama.py peaked 12.4% lower and stepped 636-645 ms against 705-707 ms;
# examples/gpt2.py 4.7% lower, 1,028-1,050 ms against 1,074-1,164 ms; a cold compile of the
# checkpointed step took 4-5x longer (60.3 s against 14.6 s on llama).
# Rule 1. remat compiles its regions with it on, where CSE is off (NOTE [ CSE across checkpointed
#   regions ], Rule 1), and a plan that records it (``CompileInfo.fwd_side_effects_replayed``
#   False) turns it on in ``apply_plan`` for the user's ``torch.compile``, says so once, and
#   ``handle.remove()`` puts it back. Plans made before (True) leave it alone.
# Rule 2. The setting changes what a step does only where a checkpointed region's forward has a
#   side effect: it then runs once a step, where an eager checkpoint runs it twice.
# Rule 3. A torch without the setting compiles as before, and its plans record True.

SIDE_EFFECT_SETTING = "skip_fwd_side_effects_in_bwd_under_checkpoint"
"""Dynamo's setting that traces a checkpointed region with a forward side effect (NOTE [ Side effects in a
checkpointed region ])."""


def side_effects_once_available() -> bool:
    """Whether this torch can run a checkpointed region's forward side effects once (Rule 3)."""
    return hasattr(torch._dynamo.config, SIDE_EFFECT_SETTING)


@contextlib.contextmanager
def regions_apart(apart: bool) -> Iterator[None]:
    """For the duration when ``apart`` (a compile with checkpointed regions): AOTAutograd's CSE off (NOTE [ CSE
    across checkpointed regions ], Rule 1) and the regions' side effects run once (NOTE [ Side effects in a
    checkpointed region ], Rule 1)."""
    if not apart:
        yield
        return
    once = {SIDE_EFFECT_SETTING: True} if side_effects_once_available() else {}
    with torch._functorch.config.patch(cse=False), torch._dynamo.config.patch(**once):
        yield


class _Restore:
    """Puts the settings back (NOTE [ CSE across checkpointed regions ], Rule 2; NOTE [ Side effects in a
    checkpointed region ], Rule 1); a hook-like ``remove()`` for the plan's handle."""

    def __init__(self, cse: bool | None, once: bool | None):
        self.cse, self.once, self.done = cse, once, False

    def remove(self) -> None:
        if not self.done:
            self.done = True
            if self.cse is not None:
                torch._functorch.config.cse = self.cse
            if self.once is not None:
                setattr(torch._dynamo.config, SIDE_EFFECT_SETTING, self.once)


def settings_now() -> _Restore:
    """How to put both settings back as they are now (a test's fixture; ``keep_regions_apart`` keeps only what
    it changes, so that a change the user makes meanwhile to the other stays)."""
    return _Restore(torch._functorch.config.cse,
                    getattr(torch._dynamo.config, SIDE_EFFECT_SETTING) if side_effects_once_available() else None)


def keep_regions_apart(plan: Any, regions: bool) -> _Restore | None:
    """For a compiled ``plan`` with ``regions`` that records either setting: the settings made, and how to
    undo them; None otherwise."""
    info = plan.compile
    cse_off = info is not None and regions and not info.aot_cse
    once = info is not None and regions and not info.fwd_side_effects_replayed and side_effects_once_available()
    if not (cse_off or once):
        return None
    restore = _Restore(torch._functorch.config.cse if cse_off else None,
                       getattr(torch._dynamo.config, SIDE_EFFECT_SETTING) if once else None)
    if cse_off and restore.cse:
        logger.warning("remat: torch.compile runs with torch._functorch.config.cse=False while this plan is applied "
                       "(the plan was measured so): AOTAutograd's CSE merges identical ops of different checkpointed "
                       "regions into the first, which must then save them; handle.remove() restores it")
    if once and not restore.once:
        logger.warning(f"remat: torch.compile runs with torch._dynamo.config.{SIDE_EFFECT_SETTING}=True while this "
                       f"plan is applied (the plan was measured so): a checkpointed region's forward side effects run "
                       f"once, not again in its recompute, so dynamo compiles it instead of running it eagerly; "
                       f"handle.remove() restores it")
    if cse_off:
        torch._functorch.config.cse = False
    if once:
        setattr(torch._dynamo.config, SIDE_EFFECT_SETTING, True)
    return restore


__all__ = ["SIDE_EFFECT_SETTING", "keep_regions_apart", "regions_apart", "settings_now", "side_effects_once_available"]
