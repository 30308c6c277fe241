"""Checkpointing the model already has: Hugging Face's ``gradient_checkpointing_enable()``, torch's
checkpoint wrappers and composable ``checkpoint`` (NOTE [ Checkpointed twice ]). ``apply_plan`` leaves such modules to it and names them.

Example::

    found = user_checkpointed(model, modules_by_plain_name(model))   # {'h.0': 'torch checkpoint_wrapper', ...}
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from planner.errors import listed
from planner.model.fingerprint import plain_name


def hf_checkpointing(model: nn.Module, flagged: list[nn.Module] | None = None) -> bool:
    """A Hugging Face model with its gradient (activation, in transformers 5) checkpointing on: Hugging Face's own
    test (``is_activation_checkpointing``), read over ``flagged`` (``hf_flagged(model)``, its modules that carry the
    flag) when the caller keeps that list, as ``TwiceGuard`` does, instead of walking every module."""
    if flagged is None:
        flagged = hf_flagged(model)
    return any(getattr(m, "gradient_checkpointing", False) is True for m in flagged)


def hf_flagged(model: nn.Module) -> list[nn.Module]:
    """The modules of a Hugging Face model that carry a ``gradient_checkpointing`` flag (none of another model):
    those ``gradient_checkpointing_enable()`` sets."""
    if not any(hasattr(type(model), n) for n in ("is_activation_checkpointing", "is_gradient_checkpointing")):
        return []
    return [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]


def ancestors(name: str) -> list[str]:
    """'a.b.c' -> ['', 'a', 'a.b']."""
    parts = name.split(".") if name else []
    return ["", *(".".join(parts[:i]) for i in range(1, len(parts)))]


def listing(found: dict[str, str]) -> str:
    """``Hugging Face gradient_checkpointing_enable() on h.0, h.1 and 2 more``."""
    by_how: dict[str, list[str]] = {}
    for name, how in found.items():
        by_how.setdefault(how, []).append(name or "<root>")
    parts = []
    for how, names in by_how.items():
        parts.append(f"{how} on {listed(sorted(names))}")
    return "; ".join(parts)


def modules_by_plain_name(model: nn.Module) -> dict[str, nn.Module]:
    """FQN -> module; a ``CheckpointWrapper`` takes the name of the module it wraps."""
    out: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        out.setdefault(plain_name(name), m)
    return out


def user_checkpointed(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, str]:
    """Modules the user already checkpoints: plain FQN -> how."""
    found: dict[str, str] = {}
    for name, m in modules.items():
        how = checkpointed_by(m)
        if how:
            found[name] = how
    hf_layer = any(is_hf_layer(m) for m in modules.values())
    if not hf_layer and hf_checkpointing(model):
        # Older Hugging Face models: the container calls checkpoint on its layers itself.
        for name, m in modules.items():
            if getattr(m, "gradient_checkpointing", False) is True:
                found.setdefault(name, "Hugging Face gradient checkpointing (inside this module)")
    return found


def checkpointed_by(m: nn.Module) -> str | None:
    if _named_in_mro(type(m), "CheckpointWrapper"):  # FSDPCheckpointWrapper too
        return "torch checkpoint_wrapper"
    if is_hf_layer(m) and getattr(m, "gradient_checkpointing", False) is True:
        return "Hugging Face gradient_checkpointing_enable()"
    registry = getattr(m, "__composable_api_registry", None)
    if isinstance(registry, dict) and "checkpoint" in registry:
        return "torch.distributed._composable checkpoint"
    return None


def is_hf_layer(m: nn.Module) -> bool:
    return _named_in_mro(type(m), "GradientCheckpointingLayer")


@functools.cache
def _named_in_mro(cls: type, name: str) -> bool:
    """A class of that name among ``cls``'s bases; per class once (TwiceGuard asks every step)."""
    return any(c.__name__ == name for c in cls.__mro__)


def overlap(name: str, already: dict[str, str]) -> str | None:
    """Why ``name`` must be left alone: it is, is inside, or contains a user-checkpointed module."""
    for other, how in already.items():
        if other == name:
            return f"already checkpointed ({how})"
        if name == "" or other.startswith(name + "."):
            return f"contains {other!r}, already checkpointed ({how})"
        if other == "" or name.startswith(other + "."):
            return f"inside {other or '<root>'!r}, already checkpointed ({how})"
    return None


# NOTE [ Checkpointed twice ]
#
# A plan is the model's only checkpointing: its prediction assumes no other. Hugging Face's
# ``gradient_checkpointing_enable()`` (and torch's checkpoint wrappers) checkpoint modules too:
#   - enabled before ``apply_plan``: planned modules it covers are left to it (never wrapped twice),
#     and one warning names every module it checkpoints, planned or not, since all of them change
#     the step the plan predicted;
#   - enabled after ``apply_plan``: a forward pre-hook (``TwiceGuard``) notices at the next training
#     forward and warns once, naming the modules now checkpointed twice or beyond the plan. It
#     checks the planned modules and their ancestors, and a Hugging Face model's
#     ``is_gradient_checkpointing``, not every module: a few attribute reads per step.
#   - enabled before profiling: the profile measures the step with that checkpointing (the
#     prediction stays exact), but the modules it checkpoints save nothing a plan could free, and
#     with every layer covered no plan goes below the step's peak. The profiler says so once on
#     stderr and records them (``Profile.user_checkpointed``); when no plan fits, the error names
#     them and the fix, where it said only "no candidate frees memory there" (a peft LoRA Llama
#     whose layers a QLoRA recipe had checkpointed with ``gradient_checkpointing_enable()``).
# Rule 1. The guard finds its modules again when the model's module tree changes (a submodule
#   registered into a planned model's module since it last looked: ``_Registrations``, counted by
#   torch's global registration hook). torch's ``apply_activation_checkpointing`` after ``apply_plan`` (an FSDP
#   recipe) puts a ``CheckpointWrapper`` where a planned layer was: the guard held the layers found
#   when the plan was applied, saw no wrapper, and said nothing; a module added later (a grown
#   layer) was never read either. The walk runs only after such a change, not every step.
# Rule 2. The registration hook does nothing while torch.compile traces. A Hugging Face forward's
#   layer slice runs the hook inside the compiled forward, where dynamo guarded on the set of planned
#   modules (``list(_Registrations.parents.data)[59]``, a weak set); when a planned model was freed
#   the guard read past its end, and the next compile in the process failed with "the model's
#   forward raised IndexError" (the compiled check's second compile on the wide Llama). The
#   compiled step runs no hook, and ``TwiceGuard`` does not look under compile either.
# The fix in every order is the same: ``model.gradient_checkpointing_disable()`` and let the plan
# choose, or ``handle.remove()`` and use the other.

def say_user_checkpointed(found: dict[str, str]) -> None:
    """The profiler's one line on stderr about a model that checkpoints modules itself (NOTE [ Checkpointed twice ])."""
    if found:
        logging.getLogger("remat").warning("remat: %s", user_checkpointed_text(found))


def user_checkpointed_text(found: dict[str, str]) -> str:
    """What checkpointing the model does itself means for a plan, and the fix, in words."""
    return (f"the model checkpoints {len(found)} module(s) itself ({listing(found)}): remat measures that step, "
            f"and a plan cannot free what they save; to let remat choose, turn it off before profiling "
            f"(Hugging Face: model.gradient_checkpointing_disable(); torch: build the model without its "
            f"checkpoint wrappers)")


class _Registrations:
    """How many submodules were registered (``setattr``, ``add_module``, a ``ModuleList.append``) into a module of a
    planned model since the first ``TwiceGuard``: a guard finds its modules again when it moved (NOTE [ Checkpointed
    twice ], Rule 1). Only into a planned model's modules: a Hugging Face forward slices its ``ModuleList`` of layers
    (``self.layers[:n]``), which registers every layer into a new list, at every step."""

    count = 0
    parents: weakref.WeakSet = weakref.WeakSet()

    @staticmethod
    def registered(module: nn.Module, name: str, submodule: Any) -> None:
        if torch.compiler.is_compiling():  # Rule 2: not traced, nor guarded on
            return
        if module in _Registrations.parents:
            _Registrations.count += 1


@functools.cache
def _count_registrations() -> None:
    torch.nn.modules.module.register_module_module_registration_hook(_Registrations.registered)


class TwiceGuard:
    """A forward pre-hook warning once when checkpointing is enabled on a planned model (NOTE [ Checkpointed twice ])."""

    _remat_hook = True  # remat's: planner.remove_plan drops it from a copy (NOTE [ Plans carried without a handle ])

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module], handle: Any, *, reported: bool = False):
        _count_registrations()
        self.model = model
        planned = list(handle._forwards)
        self.planned = set(planned)
        self.names = {a for name in planned for a in ancestors(name)} | self.planned
        self.reported = reported
        self.find(modules)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A model copied or loaded with its plan: its modules are found again at the first call, and counted."""
        self.__dict__.update(state)
        self.registrations = -1
        _count_registrations()

    def find(self, modules: dict[str, nn.Module]) -> None:
        """The planned modules and their ancestors by name, and the modules with Hugging Face's flag (whose
        ``is_activation_checkpointing`` walks every module on each read: 0.15 ms a step of a 4-layer Llama)."""
        self.watch = [modules[n] for n in self.names if n in modules]
        self.hf_flagged = hf_flagged(self.model)
        _Registrations.parents.update(self.model.modules())
        self.registrations = _Registrations.count

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.reported or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        if self.registrations != _Registrations.count:  # the module tree changed: NOTE [ Checkpointed twice ], Rule 1
            self.find(modules_by_plain_name(self.model))
        if not (any(checkpointed_by(m) for m in self.watch) or hf_checkpointing(self.model, self.hf_flagged)):
            return
        found = user_checkpointed(self.model, modules_by_plain_name(self.model))  # once: every module
        if not found:
            return
        self.reported = True
        twice = sorted(n for n in found if overlap(n, dict.fromkeys(self.planned, "")) or n in self.planned)
        warnings.warn(f"remat: checkpointing was enabled on the planned model ({listing(found)}): "
                      f"{'modules checkpointed twice: ' + ', '.join(twice) + '; ' if twice else ''}the plan's "
                      f"predicted peak and recompute no longer hold. {TWICE_FIX}; reported once", stacklevel=2)


TWICE_FIX = ("Call model.gradient_checkpointing_disable() (or drop the wrapper) and let the plan choose what to "
             "checkpoint, or handle.remove() the plan")


__all__ = ["TWICE_FIX", "TwiceGuard", "ancestors", "checkpointed_by", "hf_checkpointing", "hf_flagged", "is_hf_layer",
           "listing", "modules_by_plain_name", "overlap", "user_checkpointed"]
