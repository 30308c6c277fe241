"""The runtime shape guard (NOTE [ Runtime shape guard ]): a forward pre-hook that compares a
planned model's inputs with the shapes its plan was made for.

Example::

    handle = apply_plan(model, plan, guard="error")   # a larger batch raises PlanMismatch
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
from torch import nn

from planner.errors import PlanMismatch
from planner.model.fingerprint import input_tensors
from planner.model.schema import TensorSig
from planner.sizes import format_bytes


# NOTE [ Runtime shape guard ]
#
# A plan's prediction holds for the input shapes it was profiled with. Training jobs pad
# dynamically, so a batch can be longer or wider than the planned one, and activations grow
# with it: the planned peak no longer holds and the step may run out of memory.
# ``apply_plan(..., guard=...)`` puts a forward pre-hook on the planned model that compares
# each training forward's tensor inputs with ``plan.fingerprint.inputs``. The call is first bound
# to forward's signature, so an input is found whether the plan named it by position ('0', '1',
# ...) or by key ('images') and whether the job passes it positionally or by keyword:
#   - an input larger than planned in any dimension (more tokens, a bigger batch) is reported
#     once per handle, with the planned and the actual shapes: a warning under "warn" (the
#     default), ``PlanMismatch`` under "error";
#   - equal or smaller inputs pass silently: activations shrink with them;
#   - inputs the plan does not name (an attention mask it was made without) are not checked.
# Forwards without grad (evaluation) and forwards traced by ``torch.compile`` are not checked.
# To plan for variable-length data, plan at the largest shape the job will see, or plan several
# shapes in one bucketed plan (NOTE [ Bucketed plans ] in planner/act/buckets.py).

class ShapeGuard:
    """A forward pre-hook comparing input shapes with the plan's; see NOTE [ Runtime shape guard ]."""

    _remat_hook = True  # remat's: planner.remove_plan drops it from a copy (NOTE [ Plans carried without a handle ])

    def __init__(self, planned: list[TensorSig], mode: str, peak_bytes: int, forward: Any = None):
        self.planned = {sig.name: sig.shape for sig in planned}
        self.mode = mode
        self.peak_bytes = peak_bytes
        self.reported = False
        self.signature = _signature(forward)
        self.passed: tuple | None = None
        """Every argument's shape (or type) at the last call that passed: a training job's batches
        mostly repeat it, and binding the call to forward's signature is most of the hook's cost."""

    def named_arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments under every name the plan may use for them: a positional argument by its
        index and by its parameter's name, a keyword argument by its key and by its parameter's index
        (``inspect.Signature.bind``), so ``model(x)`` is checked as ``model(images=x)`` is."""
        given: dict[str, Any] = {str(i): a for i, a in enumerate(args)}
        given.update(kwargs)
        if self.signature is None:
            return given
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:  # the call does not fit forward's signature; forward itself will say so
            return given
        positional = 0
        for name, param in self.signature.parameters.items():
            if param.kind is param.VAR_POSITIONAL:
                break
            if param.kind is param.KEYWORD_ONLY or param.kind is param.VAR_KEYWORD:
                continue
            if name in bound.arguments:
                given.setdefault(str(positional), bound.arguments[name])
                given.setdefault(name, bound.arguments[name])
            positional += 1
        for name, param in self.signature.parameters.items():
            if param.kind is param.KEYWORD_ONLY and name in bound.arguments:
                given.setdefault(name, bound.arguments[name])
        return given

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.reported or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        shapes = _flat_shapes(args, kwargs)
        if shapes is not None and shapes == self.passed:  # the shapes of the last call that passed
            return
        larger = self.larger_inputs(args, kwargs)
        if not larger:
            self.passed = shapes
            return
        self.reported = True
        listing = "; ".join(f"input {name}: planned {planned}, got {actual}" for name, planned, actual in larger)
        message = (f"remat: a batch is larger than the plan was made for ({listing}); the predicted peak "
                   f"({format_bytes(self.peak_bytes)}) no longer holds. Plan at the largest shape the job will "
                   f"see (e.g. pad or cap to it)")
        if self.mode == "error":
            self.reported = False  # raise on every such batch
            raise PlanMismatch(message + ", or pass guard='warn'", [f"input {n}: planned {p}, got {a}"
                                                                     for n, p, a in larger])
        warnings.warn(message + "; reported once", stacklevel=3)

    def larger_inputs(self, args: tuple, kwargs: dict) -> list[tuple[str, list[int], list[int]]]:
        """``(name, planned shape, actual shape)`` of every input larger than planned."""
        given = self.named_arguments(args, kwargs)
        out = []
        for name, t in input_tensors(given):
            planned = self.planned.get(name)
            if planned is not None and _exceeds(list(t.shape), planned):
                out.append((name, planned, list(t.shape)))
        return out


def _flat_shapes(args: tuple, kwargs: dict) -> tuple | None:
    """The arguments' shapes (a tensor) or types (anything else) by position and key; None when one is
    a container, whose tensors only ``larger_inputs`` finds."""
    out = []
    for key, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, (list, tuple, dict)):
            return None
        out.append((key, value.shape if isinstance(value, torch.Tensor) else type(value)))
    return tuple(out)


def _signature(forward: Any) -> inspect.Signature | None:
    """``forward``'s signature, or None when Python cannot read it (a builtin, a C extension)."""
    if forward is None:
        return None
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        return None


def _exceeds(actual: list[int], planned: list[int]) -> bool:
    """More elements along any dimension (or in all, when the ranks differ) than planned."""
    if len(actual) != len(planned):
        return _numel(actual) > _numel(planned)
    return any(a > p for a, p in zip(actual, planned))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["ShapeGuard"]
