"""What remat changes in the user's training step, the same way when it profiles and when it applies a plan.

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
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from planner.model.schema import StepChange

logger = logging.getLogger("remat")

HF_CACHE_OFF = "hf_use_cache_off"


def find_step_changes(model: nn.Module) -> list[StepChange]:
    """The changes remat makes to ``model``'s training step (see NOTE [ Step changes ])."""
    return [StepChange(kind=HF_CACHE_OFF, module=name,
                       reason=f"{type(m).__name__} has config.use_cache=True: a checkpointed layer would add its "
                              f"keys and values to the cache again when recomputed, and the cache would keep "
                              f"alive what checkpointing frees (Hugging Face's gradient checkpointing turns "
                              f"the cache off too)")
            for name, m in _topmost_caching_hf_models(model)]


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

    def __init__(self, forwards: list[_CacheOffForward]):
        self._forwards = forwards

    def remove(self) -> None:
        while self._forwards:
            fwd = self._forwards.pop()
            if fwd.module.__dict__.get("forward") is not fwd:
                continue  # replaced after us by someone else: leave their forward in place
            if fwd.previous is not None:
                fwd.module.forward = fwd.previous
            else:
                del fwd.module.forward


def install(model: nn.Module, changes: list[StepChange], *, say: bool = True) -> Installed:
    """Install ``changes`` on ``model``; raises ``BadInput`` for one that names no module of it."""
    from planner.errors import BadInput

    modules = dict(model.named_modules())
    forwards: list[_CacheOffForward] = []
    for change in changes:
        m = modules.get(change.module)
        if m is None:
            raise BadInput(f"the plan changes the training step of module {change.module!r} "
                           f"({change.kind}), which the model does not have; re-create the plan for this model")
        if change.kind == HF_CACHE_OFF and not isinstance(m.__dict__.get("forward"), _CacheOffForward):
            fwd = _CacheOffForward(m, m.__dict__.get("forward"))
            m.forward = fwd
            forwards.append(fwd)
    if say and forwards:  # already installed (profile_within, then profile): said already
        describe(changes)
    return Installed(forwards)


@contextlib.contextmanager
def profiled_with_step_changes(model: nn.Module) -> Iterator[list[StepChange]]:
    """The model's step changes installed for the duration (a profiling path runs the step the plan will
    run); yields them, to record in the profile. Nested, the inner one finds them installed: nothing new
    is installed or said."""
    changes = find_step_changes(model)
    installed = install(model, changes)
    try:
        yield changes
    finally:
        installed.remove()


def describe(changes: list[StepChange]) -> None:
    """Say once on stderr what remat changes in the training step."""
    for c in changes:
        logger.warning("remat: training steps of %s run with use_cache=False: %s",
                       repr(c.module) if c.module else "the model", c.reason)
