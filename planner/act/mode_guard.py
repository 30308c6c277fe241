"""Warn once when a plan runs in another mode than it was made for: a compiled plan on an eager step,
an eager plan under ``torch.compile`` (NOTE [ Compiled or eager plans ]). ``apply_plan`` gives every
checkpointed forward of one plan the same ``ModeGuard``.

Example::

    guard = ModeGuard(plan.compile.backend if plan.compile else None)
    guard.check()  # from a checkpointed call: warns once if the step is the other kind
"""

from __future__ import annotations

import warnings
from typing import Any

import torch


# NOTE [ Compiled or eager plans ]
#
# A plan made for the step under torch.compile (``plan.compile``, NOTE [ Compiled profile ] in
# planner/profiling/compiled.py) predicts the partitioner's saves and a compiled replay; one made
# for the eager step predicts autograd's. Applied to the other kind of step, the plan still
# checkpoints what it names, but its predicted peak and recompute are those of another step.
# Rule 1. The first checkpointed call tells: under dynamo's tracing (``torch.compiler.is_compiling``)
#   the step is compiled, otherwise eager. A mismatch warns once per ``apply_plan``, naming both.
# Rule 2. The warning under tracing runs at compile time (``comptime``): no graph break, and
#   nothing is added to the compiled graph. Eager plans check nothing at run time when eager.


class ModeGuard:
    """Warns once when a plan runs in the other mode than it was made for (NOTE [ Compiled or eager plans ])."""

    def __init__(self, compiled_for: str | None):
        self.compiled_for = compiled_for  # the plan's backend, or None: made for the eager step
        self.warned = False

    def warn(self, compiled_now: bool) -> None:
        if self.warned:
            return
        self.warned = True
        if compiled_now:
            msg = ("remat: this plan was made for the eager step, and the model runs under torch.compile: the "
                   "compiled step saves other tensors, so its peak and recompute differ from the plan's prediction; "
                   "re-plan with `remat plan --compile` (compile=... in Python)")
        else:
            msg = (f"remat: this plan was made for the step under torch.compile ({self.compiled_for}), and the model "
                   f"runs eagerly: the eager step saves other tensors, so its peak and recompute differ from the "
                   f"plan's prediction; run torch.compile(model) after apply_plan, or re-plan without --compile")
        warnings.warn(msg, stacklevel=4)

    def check(self) -> None:
        """Called by each checkpointed call; see the NOTE's rules. Under tracing it reads no attribute
        that changes, so that dynamo's guards never recompile for it."""
        if torch.compiler.is_compiling():
            if self.compiled_for is None:
                from torch._dynamo.comptime import comptime

                comptime(_warn_while_tracing)
        elif self.compiled_for is not None:
            self.warn(False)


def _warn_while_tracing(ctx: Any) -> None:
    """Run by dynamo at compile time from ``ModeGuard.check`` (a comptime function may not close over
    locals, so the guard is read from the frame's ``self``; checked against torch 2.13)."""
    try:
        guard = ctx.get_local("self")._i_will_not_complain_if_bc_breaks_VariableTracker().value
    except (AttributeError, KeyError):  # another torch: say it without the guard (at most once per trace)
        guard = ModeGuard(None)
    guard.warn(True)


__all__ = ["ModeGuard"]
