"""Gradients and buffers of two runs compared element by element (``remat verify``, one process and
ranks), and the copy of the model each run trains (``run_copy``; ``initialize_lazy``, its lazy modules made).
See NOTE [ Comparing non-finite values ], NOTE [ Derived tensor attributes ] and NOTE [ Lazy modules ].

Example::

    max_abs_diff({"w": torch.tensor([1.0, nan])}, {"w": torch.tensor([1.0, nan])})   # 0.0
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# NOTE [ Comparing non-finite values ]
#
# A step whose loss is NaN gives NaN gradients. ``float(t.abs().max())`` is then NaN, and Python's
# ``max(0.0, nan)`` is 0.0: verify read "max |grad diff| 0, ok" whatever the plan did to the
# gradients. Here an element counts as equal when both sides hold the same value, NaN where NaN
# and inf where inf of the same sign; a NaN or inf on one side only is a difference of inf. So a
# plan that turns finite gradients into NaN fails, and one that keeps a NaN model's NaNs where they
# were passes; ``nonfinite`` lets the report say that the model's own gradients are not finite.


def max_abs_diff(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> float:
    """Largest |a - b| over all entries (NOTE [ Comparing non-finite values ]); inf where one side has a
    tensor and the other not, or another shape."""
    worst = 0.0
    for name in a.keys() | b.keys():
        x, y = a.get(name), b.get(name)
        if x is None and y is None:
            continue
        if x is None or y is None or x.shape != y.shape:
            return float("inf")
        x, y = _dense(x), _dense(y)
        if x.numel() == 0 or (not x.is_floating_point() and torch.equal(x, y)):
            continue
        x, y = x.detach().double(), y.detach().double()
        same = (x == y) | (x.isnan() & y.isnan())
        diff = torch.where(same, torch.zeros_like(x), (x - y).abs())
        diff = torch.where(diff.isnan(), torch.full_like(diff, float("inf")), diff)  # NaN on one side only
        worst = max(worst, float(diff.max()))
    return worst


def nonfinite(tensors: dict[str, torch.Tensor | None]) -> list[str]:
    """The names of the floating-point tensors holding a NaN or an inf."""
    return [n for n, t in tensors.items()
            if t is not None and t.is_floating_point() and t.numel() and not bool(_dense(t).isfinite().all())]


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a strided tensor: the sparse gradient of an ``nn.Embedding(sparse=True)`` has no elementwise
    comparison; densified (duplicate indices summed), two runs' gradients compare value by value."""
    return t if t.layout == torch.strided else t.to_dense()


def nonfinite_notes(grads: dict[str, torch.Tensor | None], loss: float) -> list[str]:
    """verify's note when the unplanned step's own gradients are not finite (NOTE [ Comparing non-finite values ])."""
    bad = nonfinite(grads)
    return [f"the model's own gradients hold NaN or inf without the plan ({len(bad)} tensors, e.g. {bad[0]}; loss "
            f"{loss:g}): they are compared element by element, NaN where NaN; fix the loss"] if bad else []


# NOTE [ Derived tensor attributes ]
#
# ``verify`` trains two copies of the model, each ``copy.deepcopy`` of the one it was given, and torch
# deep-copies a tensor only when it is a leaf of the autograd graph. A model may hold a tensor computed
# from its parameters as a plain attribute: ``torch.nn.utils.prune`` keeps ``weight = weight_orig *
# weight_mask`` on the module (its forward pre-hook computes it again before every forward), as the
# older ``torch.nn.utils.weight_norm`` and ``spectral_norm`` do. deepcopy raised on any pruned model
# ("Only Tensors created explicitly by the user (graph leaves) support the deepcopy protocol"). So such
# an attribute is copied as a detached clone: the same values, no graph to copy; the hook that derived it
# derives it again in the copy's first forward, from the copy's own parameters.

def run_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(model)``, a derived (non-leaf) tensor attribute copied detached (NOTE [ Derived tensor
    attributes ])."""
    memo: dict[int, object] = {}
    for m in model.modules():
        for value in vars(m).values():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


def initialize_lazy(model: torch.nn.Module, batch: Any, dev: torch.device) -> None:
    """Make the parameters of ``model``'s lazy modules with one forward on ``batch``, without gradients,
    every generator seeded alike and put back (NOTE [ Lazy modules ])."""
    from planner.model.fingerprint import lazy_modules
    from planner.profiling import rng
    from planner.profiling.model_file import call_model

    if lazy_modules(model):
        with rng.kept(dev), torch.no_grad():
            rng.seed_all(0)
            call_model(model, batch)


__all__ = ["initialize_lazy", "max_abs_diff", "nonfinite", "nonfinite_notes", "run_copy"]
