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
#   - inputs the plan does not name (an attention mask it was made without) are not checked;
#   - an input the plan names that the call lacks (or passes as None) is reported the same way: the
#     forward is not the planned one. ``labels`` missing means the loss is computed outside the
#     model (a ``Trainer``'s ``compute_loss_func`` or label smoothing, a loop's own loss function),
#     and the plan's prediction holds the model's own loss: a z-loss ``compute_loss_func`` on the
#     docs' GPT-2 peaked 9.8% over it, with no word (NOTE [ The Trainer's loss ]). Checked only where
#     forward's signature binds the call (it tells a keyword from a position).
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
        self.check(args, kwargs)

    def check(self, args: tuple, kwargs: dict, *, shapes: bool = True) -> None:
        """Report a larger input (``shapes``; a bucketed plan checks that itself) or a missing one."""
        if self.reported or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        flat = _flat_shapes(args, kwargs)
        if flat is not None and flat == self.passed:  # the shapes of the last call that passed
            return
        given = self.named_arguments(args, kwargs)
        found = [f"input {n}: planned {p}, got {a}" for n, p, a in self.larger_inputs(given)] if shapes else []
        missing = self.missing_inputs(given)
        found += [f"input {name}: planned {self.planned[name]}, got none" for name in missing]
        if not found:
            self.passed = flat
            return
        self.reported = True
        message = (f"remat: a batch is {'not what' if missing else 'larger than'} the plan was made for "
                   f"({'; '.join(found)}); the predicted peak ({format_bytes(self.peak_bytes)}) no longer holds. "
                   + (_MISSING_FIX if missing else "Plan at the largest shape the job will see (e.g. pad or cap to it)"))
        if self.mode == "error":
            self.reported = False  # raise on every such batch
            raise PlanMismatch(message + ", or pass guard='warn'", found)
        warnings.warn(message + "; reported once", stacklevel=4)

    def missing_inputs(self, given: dict[str, Any]) -> list[str]:
        """The planned inputs the call lacks or passes as None (NOTE [ Runtime shape guard ]); none checked
        when forward's signature is unknown: a keyword could then be a planned position."""
        if self.signature is None:
            return []
        return [name for name in self.planned if given.get(name.split(".")[0]) is None]

    def larger_inputs(self, given: dict[str, Any]) -> list[tuple[str, list[int], list[int]]]:
        """``(name, planned shape, actual shape)`` of every input of ``given`` (``named_arguments``) larger than
        planned."""
        out = []
        for name, t in input_tensors(given):
            planned = self.planned.get(name)
            if planned is not None and _exceeds(list(t.shape), planned):
                out.append((name, planned, list(t.shape)))
        return out


_MISSING_FIX = ("Make the plan with the inputs the training forward gets; with 'labels' missing the loss is "
                "computed outside the model, so plan that loss: planner.plan(model, budget, inputs=<the batch without "
                "labels>, loss_fn=<the loss of the output>) (Trainer: inputs, loss_fn = trainer_step_inputs(args, "
                "batch, model, compute_loss_func=...))")


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
