"""Plans a model carries without a handle to undo them: ``remove_plan(model)``.

Example::

    model = torch.load("model.pt", weights_only=False)   # saved whole, with its plan applied
    planner.remove_plan(model)                           # the forwards and hooks it was saved with
    handle = planner.apply_plan(model, plan)             # now counted, removable
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

logger = logging.getLogger("remat")


# NOTE [ Plans carried without a handle ]
#
# ``apply_plan`` installs instance forwards and forward hooks on the model, and only the
# ``AppliedPlan`` it returns undoes them. A model can carry them with no handle at hand:
# ``copy.deepcopy`` and ``torch.save(model)``/``torch.load`` copy the forwards and hooks (they
# are objects made to survive that, NOTE [ Checkpointing by instance forward ]) but no handle;
# and a framework callback holds the handle of the Trainer that applied it, so a second Trainer
# built on the same model (a second phase, a new run continuing the first) gets a model that
# already carries a plan.
# Rule 1. Each planned forward knows the handle that installed it (``owner``); copies do not
#         (``__reduce__`` leaves it out), so a copy's forwards are told apart from the original's.
# Rule 2. ``remove_plan`` undoes a live owner through its handle (its counts stay readable), and
#         strips what copies carry: remat's instance forwards (outermost first, down to the first
#         that is not remat's) and the hooks remat registers (marked ``_remat_hook``).
# Rule 3. A callback given a model that carries a plan replaces it with its own, with one
#         warning: refusing (``PlanAlreadyApplied``) told the user to call ``.remove()`` on a
#         handle they never had.

def carries_plan(model: nn.Module) -> bool:
    """True when some module of ``model`` has a remat forward (a plan's, or a step change's)."""
    return any(_is_remat(m.__dict__.get("forward")) for m in model.modules())


def remove_plan(model: nn.Module) -> int:
    """Undo whatever remat plan ``model`` carries, with or without the handle (NOTE [ Plans carried without a
    handle ]); returns how many modules it checkpointed or offloaded. A model without a plan is left as it is."""
    planned = [fwd for m in model.modules() if getattr(fwd := m.__dict__.get("forward"), "_remat_forward", False)]
    for owner in {id(o): o for fwd in planned if (o := fwd.owner) is not None}.values():
        owner.remove()  # Rule 2: the live plan, through its handle
    for module in model.modules():
        forward = module.__dict__.get("forward")
        while _is_remat(forward):  # a copy's: a checkpoint over a step change, outermost first
            if forward.previous is not None:
                module.forward = forward.previous
            else:
                del module.forward
            forward = module.__dict__.get("forward")
        _drop_hooks(module)
    return len(planned)


def replace_carried(model: nn.Module, *, by: str) -> None:
    """Rule 3: remove the plan ``model`` carries, if any, saying so once; ``by`` names who applies the next."""
    if carries_plan(model):
        n = remove_plan(model)
        logger.warning("remat: %s already carried a remat plan (%d modules; applied before, by apply_plan or an "
                       "earlier Trainer's callback, or copied or loaded with the model): %s replaces it", type(model).__name__, n, by)


def _is_remat(forward: Any) -> bool:
    return getattr(forward, "_remat_forward", False) or getattr(forward, "_remat_step_change", False)


def _drop_hooks(module: nn.Module) -> None:
    for hooks, with_kwargs in ((module._forward_pre_hooks, module._forward_pre_hooks_with_kwargs),
                               (module._forward_hooks, module._forward_hooks_with_kwargs)):
        for key in [k for k, hook in hooks.items() if getattr(hook, "_remat_hook", False)]:
            del hooks[key]
            with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)


__all__ = ["carries_plan", "remove_plan", "replace_carried"]
