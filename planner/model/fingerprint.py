"""What a plan is valid for: the model's structure and the shapes it was profiled with.

A plan names module FQNs and was costed for particular parameter and input shapes; the
fingerprint records exactly those, so ``apply``/``verify`` can refuse a plan made for another
model (see ``Fingerprint.differences``). Devices are left out on purpose: a plan made on one
GPU applies on another.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from planner.model.schema import Fingerprint, TensorSig


def fingerprint(model: torch.nn.Module, inputs: Any) -> Fingerprint:
    """Fingerprint ``model`` called on ``inputs``.

    Args:
        model: the model; every submodule FQN from ``named_modules()`` (the root, '', left out)
            and every parameter from ``named_parameters()`` is recorded.
        inputs: what ``example_inputs()`` returned. Tensors are named by their path: a lone
            tensor is '0', positional args '0', '1', ..., keyword args by key; nested
            tuples/lists/dicts add dotted parts ('1.0', 'past.key'). Non-tensors are ignored.
    """
    return Fingerprint(
        model_class=type(model).__name__,
        modules=[name for name, _ in model.named_modules() if name],
        params=[_sig(name, p) for name, p in model.named_parameters()],
        inputs=[_sig(name, t) for name, t in input_tensors(inputs)],
    )


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
