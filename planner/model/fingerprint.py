"""What a plan is valid for: the model's structure and the shapes it was profiled with.

A plan names module FQNs and was costed for particular parameter and input shapes; the
fingerprint records exactly those, so ``apply``/``verify`` can refuse a plan made for another
model (see ``Fingerprint.differences``). Devices are left out on purpose: a plan made on one
GPU applies on another.

Example::

    fp = fingerprint(model, inputs)
    model_differences(plan.fingerprint, model, inputs)   # [] when the plan fits this model
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from planner.model.schema import Fingerprint, TensorSig


# NOTE [ Lazy modules ]
#
# ``nn.LazyLinear`` and the other lazy modules have no parameter shapes until their first
# forward. A plan is made on the model after its first step (the profiler's warm-up), so its
# fingerprint has the shapes; a freshly built lazy model has none, and reading them raised torch's
# "Can't access the shape of an uninitialized parameter" from deep inside ``apply_plan``, in a
# training job and in ``remat verify``, which builds the model afresh. ``apply_plan`` now refuses
# such a model in one line that says what to do (a dry run, as PyTorch's lazy modules ask before
# an optimizer is made). ``verify`` does the dry run itself on each copy it trains, planned or not,
# on its batch without gradients, every generator seeded alike and put back
# (``planner.act.compare.initialize_lazy``), so both copies start from the same parameters.

def lazy_modules(model: nn.Module) -> list[str]:
    """FQNs of the lazy modules of ``model`` whose parameters are not made yet (NOTE [ Lazy modules ])."""
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params()]


def fingerprint(model: torch.nn.Module, inputs: Any) -> Fingerprint:
    """Fingerprint ``model`` called on ``inputs``.

    Args:
        model: the model; every submodule FQN from ``named_modules()`` (the root, '', left out)
            and every parameter from ``named_parameters()`` is recorded.
        inputs: what ``example_inputs()`` returned. Tensors are named by their path: a lone
            tensor is '0', positional args '0', '1', ..., keyword args by key; nested
            tuples/lists/dicts add dotted parts ('1.0', 'past.key'). Keyword inputs that are
            numbers, strings or booleans are ``flags``; other non-tensors are ignored.
    """
    flags = {str(k): v for k, v in inputs.items() if isinstance(v, (bool, int, float, str))} \
        if isinstance(inputs, Mapping) else {}
    return Fingerprint(
        model_class=type(model).__name__,
        modules=module_fqns(model),
        params=[_sig(name, p) for name, p in model.named_parameters()],
        inputs=[_sig(name, t) for name, t in input_tensors(inputs)],
        flags=flags or None,
    )


def module_fqns(model: torch.nn.Module) -> list[str]:
    """Every submodule's FQN, in ``named_modules()`` order, the root ('') left out: ``Fingerprint.modules``."""
    return [name for name, _ in model.named_modules() if name]


def input_tensors(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every tensor in ``inputs``, named as in ``fingerprint``."""
    if isinstance(inputs, torch.Tensor):
        return [("0", inputs)]
    return list(_walk(inputs, ""))


def _walk(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, Mapping):
        items = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (tuple, list)):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        return
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, torch.Tensor):
            yield name, value
        else:
            yield from _walk(value, name)


def _sig(name: str, t: torch.Tensor) -> TensorSig:
    return TensorSig(name=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))


# ----------------------------------------------------------------------------- comparing


WRAPPED_ATTR = "_checkpoint_wrapped_module"
"""Attribute under which torch's ``CheckpointWrapper`` keeps the module it checkpoints."""


def model_differences(expected: Fingerprint, model: nn.Module, inputs: Any, made_for: str = "plan") -> list[str]:
    """How ``model`` on ``inputs`` differs from the fingerprint a plan or profile (``made_for``) was made for
    (checkpoint wrappers and FSDP's class swap ignored; input shapes only when ``inputs`` is given)."""
    mine = _plain_fingerprint(fingerprint(model, inputs)).model_copy(update={"model_class": _plain_class(model)})
    if inputs is None:  # nothing to compare the plan's input shapes with
        mine = mine.model_copy(update={"inputs": expected.inputs})
    return expected.differences(mine, made_for)


def plain_name(name: str) -> str:
    """FQN without torch ``CheckpointWrapper`` levels, as its ``state_dict`` hook names things."""
    return ".".join(part for part in name.split(".") if part != WRAPPED_ATTR)


def _plain_class(model: nn.Module) -> str:
    """The model's own class name: ``fully_shard`` (and ``replicate``) swap in a subclass ``FSDP<Class>``."""
    cls = type(model)
    if len(cls.__bases__) == 2 and cls.__bases__[0].__name__ in ("FSDPModule", "ReplicateModule"):
        return cls.__bases__[1].__name__
    return cls.__name__


def _plain_fingerprint(fp: Fingerprint) -> Fingerprint:
    modules = list(dict.fromkeys(m for m in map(plain_name, fp.modules) if m))
    params = [p.model_copy(update={"name": plain_name(p.name)}) for p in fp.params]
    return fp.model_copy(update={"modules": modules, "params": params})


__all__ = ["fingerprint", "input_tensors", "model_differences", "plain_name", "WRAPPED_ATTR"]
