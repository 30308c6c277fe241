"""What remat changes in the user's training step, the same way when it profiles and when it applies a plan.

Example::

    with profiled_with_step_changes(model) as changes:
        ...                                    # the step as the plan will run it (use_cache=False)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from planner.model.schema import StepChange

logger = logging.getLogger("remat")

HF_CACHE_OFF = "hf_use_cache_off"
LAYERDROP_OFF = "hf_layerdrop_off"


# NOTE [ Step changes ]
#
# A plan is only as good as the step it was measured on: profiling one setting and training
# another is how a prediction goes wrong. So anything remat changes on the user's behalf is
#   - found by ``find_step_changes(model)`` before profiling,
#   - installed by ``install`` around the profiled steps and again by ``apply_plan``,
#   - recorded in ``Profile.step_changes`` and ``Plan.step_changes`` (typed, shown by
#     ``remat show``), and said once on stderr each time it is installed.
#
# Rule 1. Hugging Face models built with their defaults have ``config.use_cache=True``: in a
# training step every decoder layer appends its keys and values to a ``DynamicCache``. The
# cache is an argument of every layer, so a checkpointed layer's recompute appends them a
# second time, and T5's cross-attention reads the keys it cached instead of computing them
# (the replay saves fewer tensors: ``CheckpointError``). The cache also keeps alive the keys
# and values that checkpointing was meant to free. Hugging Face's own checkpointing
# (``GradientCheckpointingLayer``) drops the cache while training; remat does the same, for
# the whole model, while training with gradients enabled: the topmost Hugging Face model
# whose config enables the cache is called with ``use_cache=False``. Generation (no grad, or
# eval mode) is untouched.
#
# Rule 2. Changes have a scope. 'train' changes (Rule 1) are made when profiling and again by
# ``apply_plan``; 'measure' changes only while remat measures the step (profiling, its
# validation step, ``remat verify``), never in the user's training: see NOTE [ Worst step ] in
# planner/profiling/assemble.py for the one there is (layerdrop off, so every layer runs).

def find_step_changes(model: nn.Module, *, measuring: bool = False) -> list[StepChange]:
    """The changes remat makes to ``model``'s training step (see NOTE [ Step changes ]); with ``measuring``,
    also those it makes only while it measures the step (Rule 2)."""
    found = [StepChange(kind=HF_CACHE_OFF, module=name,
                        reason=f"{type(m).__name__} has config.use_cache=True: a checkpointed layer would add its "
                               f"keys and values to the cache again when recomputed, and the cache would keep "
                               f"alive what checkpointing frees (Hugging Face's gradient checkpointing turns "
                               f"the cache off too)")
             for name, m in _topmost_caching_hf_models(model)]
    if measuring:
        found += [StepChange(kind=LAYERDROP_OFF, module=name, scope="measure",
                             reason=f"{type(m).__name__} skips each of its layers at random while training "
                                    f"(layerdrop {p:g}); remat measures the step in which every layer runs, the "
                                    f"worst one, and plans for it")
                  for name, m, p in _layerdrops(model)]
    return found


def _layerdrops(model: nn.Module) -> list[tuple[str, nn.Module, float]]:
    """Modules whose forward skips layers at random (Hugging Face's ``layerdrop``, in a module attribute or
    its config), with the probability as configured (also while remat has it set to 0)."""
    out: list[tuple[str, nn.Module, float]] = []
    configs: set[int] = set()
    for name, m in model.named_modules():
        cfg = getattr(m, "config", None)
        mine = _probability(m, "layerdrop")
        theirs = _probability(cfg, "layerdrop") if cfg is not None and id(cfg) not in configs else 0.0
        if cfg is not None:
            configs.add(id(cfg))
        if mine or theirs:
            out.append((name, m, max(mine, theirs)))
    return out


_ZEROED: dict[int, tuple[weakref.ref, Any]] = {}
"""id of an object (module or config; configs are not hashable) -> (a weak reference to it, its layerdrop)
while remat has the layerdrop at 0, so that a nested profile still finds the change."""


def _saved_layerdrop(obj: Any) -> Any:
    entry = _ZEROED.get(id(obj))
    return entry[1] if entry is not None and entry[0]() is obj else None


def _probability(obj: Any, attr: str) -> float:
    if obj is None:
        return 0.0
    saved = _saved_layerdrop(obj)
    v = saved if saved is not None else getattr(obj, attr, None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else 0.0


def _zero_layerdrop(m: nn.Module) -> Callable[[], None] | None:
    """Set ``layerdrop`` to 0 on ``m`` and its config; the undo, or None when nothing was set."""
    undo: list[Callable[[], None]] = []
    for obj in (m, getattr(m, "config", None)):
        if obj is None or _probability(obj, "layerdrop") == 0.0 or getattr(obj, "layerdrop", 0) == 0:
            continue
        value = obj.layerdrop
        _ZEROED[id(obj)] = (weakref.ref(obj), value)
        obj.layerdrop = 0.0

        def restore(obj: Any = obj, value: Any = value) -> None:
            obj.layerdrop = value
            _ZEROED.pop(id(obj), None)

        undo.append(restore)
    if not undo:
        return None

    def restore_all() -> None:
        for u in reversed(undo):
            u()

    return restore_all


def _topmost_caching_hf_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    if "transformers" not in sys.modules:  # no Hugging Face model can exist without it
        return []
    from transformers import PreTrainedModel

    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if any(name.startswith(f + ".") or f == "" for f, _ in found):
            continue
        if isinstance(m, PreTrainedModel) and _uses_cache(m):
            found.append((name, m))
    return found


def _uses_cache(m: nn.Module) -> bool:
    if not getattr(getattr(m, "config", None), "use_cache", False):
        return False
    try:
        return "use_cache" in inspect.signature(m.forward).parameters
    except (TypeError, ValueError):
        return False


class _CacheOffForward:
    """An instance ``forward`` that passes ``use_cache=False`` while training with gradients.

    An object rather than a closure for the reasons given in NOTE [ Checkpointing by instance
    forward ] (``planner/act/applier.py``): deepcopy and pickle rebind it to the copy's module.
    """

    _remat_step_change = True

    def __init__(self, module: nn.Module, previous: Any):
        self.module, self.previous = module, previous
        self.inner = previous if previous is not None else type(module).forward.__get__(module, type(module))
        self.__wrapped__ = self.inner  # inspect.signature shows the real parameters

    def __reduce__(self) -> tuple:
        return type(self), (self.module, self.previous)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.module.training and torch.is_grad_enabled():
            kwargs["use_cache"] = False
        return self.inner(*args, **kwargs)


class Installed:
    """Step changes installed on a model; ``remove()`` undoes them (idempotent)."""

    def __init__(self, forwards: list[_CacheOffForward], undo: list[Callable[[], None]] | None = None):
        self._forwards = forwards
        self._undo = undo or []

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
        while self._forwards:
            fwd = self._forwards.pop()
            if fwd.module.__dict__.get("forward") is not fwd:
                continue  # replaced after us by someone else: leave their forward in place
            if fwd.previous is not None:
                fwd.module.forward = fwd.previous
            else:
                del fwd.module.forward


def install(model: nn.Module, changes: list[StepChange], *, say: bool = True,
            scopes: tuple[str, ...] = ("train",)) -> Installed:
    """Install those of ``changes`` whose scope is in ``scopes`` (NOTE [ Step changes ], Rule 2) on ``model``;
    raises ``BadInput`` for one that names no module of it."""
    from planner.errors import BadInput

    modules = dict(model.named_modules())
    forwards: list[_CacheOffForward] = []
    undo: list[Callable[[], None]] = []
    changes = [c for c in changes if c.scope in scopes]
    for change in changes:
        m = modules.get(change.module)
        if m is None:
            raise BadInput(f"the plan changes the training step of module {change.module!r} "
                           f"({change.kind}), which the model does not have; re-create the plan for this model")
        if change.kind == HF_CACHE_OFF and not isinstance(m.__dict__.get("forward"), _CacheOffForward):
            fwd = _CacheOffForward(m, m.__dict__.get("forward"))
            m.forward = fwd
            forwards.append(fwd)
        if change.kind == LAYERDROP_OFF and (restore := _zero_layerdrop(m)) is not None:
            undo.append(restore)
    if say and (forwards or undo):  # already installed (profile_within, then profile): said already
        describe(changes)
    return Installed(forwards, undo)


@contextlib.contextmanager
def profiled_with_step_changes(model: nn.Module) -> Iterator[list[StepChange]]:
    """The model's step changes installed for the duration (a profiling path runs the step the plan will
    run); yields them, to record in the profile. Nested, the inner one finds them installed: nothing new
    is installed or said."""
    changes = find_step_changes(model, measuring=True)
    installed = install(model, changes, scopes=("train", "measure"))
    try:
        yield changes
    finally:
        installed.remove()


def describe(changes: list[StepChange]) -> None:
    """Say once on stderr what remat changes in the training step."""
    for c in changes:
        what = "with use_cache=False" if c.kind == HF_CACHE_OFF else "with every layer (layerdrop 0) while measured"
        logger.warning("remat: training steps of %s run %s: %s", repr(c.module) if c.module else "the model",
                       what, c.reason)


__all__ = ["describe", "find_step_changes", "HF_CACHE_OFF", "install", "Installed", "LAYERDROP_OFF", "logger",
           "profiled_with_step_changes"]
