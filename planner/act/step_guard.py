"""The runtime step guard (NOTE [ The step as the loop runs it ]): hooks that compare the training
step a planned model runs in with the step its plan was made for (``Plan.recipe``), where the loop,
not the model, decides: gradients alive at the forward, autocast, the model's output kept through
backward.

Example::

    handle = apply_plan(model, plan)   # guard="warn": a loop with zero_grad(set_to_none=False) warns once
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from planner.errors import PlanMismatch
from planner.model.fingerprint import input_tensors
from planner.model.schema import Plan
from planner.sizes import format_bytes

# NOTE [ The step as the loop runs it ]
#
# A plan predicts the step of its recipe (``Plan.recipe``, NOTE [ Peak-memory model ]): the Trainer
# and Lightning callbacks compare it with their arguments, but a plain loop, accelerate, or a loop
# copied from a tutorial is not shown to remat, and three of its habits moved the peak of the docs'
# GPT-2 at a 12 MB budget with no word (predicted 10,273,976 bytes):
# Rule 1. Gradients alive at a training forward, when the plan's recipe frees them before it
#   (``optimizer.zero_grad(set_to_none=False)``, or accumulating micro-batches with a plan made
#   for one): 11,211,480 measured (+9.1%). A forward pre-hook reads the ``.grad`` of two trainable
#   parameters (the first and the last). Plan with ``Recipe(zero_grad_set_to_none=False)`` or
#   ``grad_accum`` (``remat plan --no-zero-grad-set-to-none``/``--grad-accum``).
# Rule 2. Autocast other than the plan's: a bf16 plan run without autocast peaked at 13,479,128
#   bytes against 10,830,072 (+24.5%). Read where the model runs under it: a pre-hook on the first
#   planned module, inside the model (accelerate enters autocast inside the root's forward). On or
#   off, and the dtype's size (Lightning runs "16-mixed" as bf16 on the CPU: the same bytes).
# Rule 3. The model's output kept through backward: remat's step drops it once the loss is made
#   (``make_step``), and Hugging Face's own loop (``outputs = model(**batch); loss = outputs.loss;
#   loss.backward()``) keeps it: 10,788,056 (+5.0%, the logits). For a model that computes its own
#   loss (an output mapping with a ``loss``), a forward hook keeps weak references to the other
#   tensors of the output, and a hook on the loss's gradient, the first thing its backward computes,
#   reads them: alive then, they are alive through the backward. Reported when they hold over 1% of
#   the predicted peak; read at the first ``OUTPUT_CHECKS`` backward passes only (a loop keeps its
#   habit), since the hooks cost 65 us a step of a tiny Llama. (A loss computed outside the model
#   may save the output itself, so that the caller holding it costs nothing: not read.) A plan made
#   for that loop (``Recipe(keep_output=True)``, ``remat plan --keep-output``; NOTE [ The output kept
#   through backward ]) predicts it, 10,798,264 bytes against 10,788,056 measured (-0.09%): the report
#   names it, and under such a plan nothing is read.
# Rule 4. Several training forwards alive at one backward: two views of a batch (``loss =
#   model(**a).loss + model(**b).loss``), a gradient penalty's second forward, a chunked loop. The
#   plan's step runs one forward per backward, and the GPT-2 with two views peaked at 16,637,660
#   bytes against 10,273,976 (+61.9%), with no word. The model's pre-hook counts training forwards,
#   and a hook on the gradient of the first output that takes one (read at the first
#   ``OUTPUT_CHECKS`` backward passes that reach one) reports more than one since the last. A plan of
#   that step is a plan of a module whose forward makes every call (a wrapper calling the model on
#   each input, the plan applied to it): 11,286,044 predicted, 11,255,516 measured (-0.27%). Only
#   forwards in training mode count: an evaluation written without ``no_grad`` (``model.eval();
#   model(**val).loss.item()``) was counted with the next step's forward, and reported. (One in
#   training mode whose output no backward reaches still is: rare.)
# Rule 5. A pipeline stage's plan, on its stage module (``pp_stage``), is run by its schedule:
#   several micro-batches' forwards before their backward, and the stage's gradients alive at the
#   later ones' forwards (1F1B), both counted in the stage's prediction (NOTE [ Pipeline stages ]).
#   Rules 1 and 4 are not read there: stage 0 of 2 under 1F1B with 4 micro-batches was reported by
#   both (Rule 1 since round 18).
# Each is reported once per ``apply_plan`` as a warning, or raises ``PlanMismatch`` on every such
# step under ``guard="error"``; ``guard="off"`` installs none. Forwards without grad (evaluation)
# and forwards traced by ``torch.compile`` are not checked.

KEPT_FRACTION = 0.01
"""An output kept through backward is reported when it holds more than this part of the predicted peak."""
OUTPUT_CHECKS = 3
"""Backward passes whose model output is read (Rule 3); after them the hooks cost nothing (65 us a step of the
tiny Llama of ``benchmarks/wrapper_cost.py --tiny`` while they read)."""


class StepGuard:
    """The checks of NOTE [ The step as the loop runs it ]: ``pre`` on the model, ``amp`` on the first planned
    module, ``post`` on the model (each an object of its own: ``planner.remove_plan`` finds them by
    ``_remat_hook``)."""

    def __init__(self, plan: Plan, model: nn.Module, mode: str):
        self.mode = mode
        self.plan = plan
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        self.staged = isinstance(getattr(model, "pp_stage", None), int)  # Rule 5: a stage module (``plan_for``)
        self.params = [] if plan.recipe.grads_alive or self.staged or not trainable else [
            _owner(model, name) for name in dict.fromkeys((trainable[0], trainable[-1]))]
        """(module, name) of the two parameters read: not the parameters, which FSDP2's ``fully_shard`` replaces
        by their shards after the plan is applied (held, the full ones stayed alive: +0.41 MiB on a pipeline
        stage's rank)."""
        self.reported: set[str] = set()
        self.outputs_read = 0
        self.forwards = 0
        """Training forwards since a backward last reached one's output (Rule 4)."""
        self.forwards_read = 0

    def hooks(self) -> tuple[Any, Any, Any]:
        return _Hook(self.before), _Hook(self.amp), _Hook(self.after)

    def before(self, module: nn.Module, args: tuple) -> None:
        if not _checked():
            return
        self.forwards += module.training and not self.staged  # Rule 4
        if any(getattr(owner._parameters.get(name), "grad", None) is not None for owner, name in self.params):
            self.report("grads", f"gradients are alive at a training forward, and the plan's step frees them "
                                 f"before it ({self.plan.recipe.describe()}): the loop calls "
                                 f"optimizer.zero_grad(set_to_none=False) or accumulates gradients. Plan its step "
                                 f"(remat plan --no-zero-grad-set-to-none or --grad-accum N; recipe=Recipe(...) in Python)")

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Rule 3: at the start of the backward of the model's own loss, its other outputs should be gone (an input
        handed back in the output lives with the batch: not counted)."""
        if self.forwards_read < OUTPUT_CHECKS and module.training and not self.staged and _checked():  # Rules 4, 5
            first = next((t for _, t in input_tensors(output) if t.requires_grad), None)
            if first is not None:
                first.register_hook(self.at_output_grad)
        if self.outputs_read >= OUTPUT_CHECKS or self.plan.recipe.keep_output:
            return
        loss = output.get("loss") if isinstance(output, Mapping) and _checked() else None
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return
        given = {t.untyped_storage().data_ptr() for _, t in input_tensors((args, kwargs))}
        kept = [(weakref.ref(t), t.untyped_storage().nbytes()) for name, t in input_tensors(output)
                if name != "loss" and t.dim() and t.untyped_storage().data_ptr() not in given]
        loss.register_hook(lambda grad: self.at_backward(kept))

    def at_backward(self, kept: list[tuple[weakref.ref, int]]) -> None:
        self.outputs_read += 1
        alive = sum(n for ref, n in kept if ref() is not None)
        if alive > KEPT_FRACTION * self.plan.predicted.peak_bytes:
            self.report("output", f"the model's output ({format_bytes(alive)}, "
                                  f"{alive / self.plan.predicted.peak_bytes:.1%} of the predicted peak) is alive "
                                  f"through its backward (e.g. outputs = model(**batch); outputs.loss.backward()), "
                                  f"and the plan's step drops it once the loss is made. Plan the loop's step: "
                                  f"remat plan --keep-output (recipe=Recipe(keep_output=True) in Python)")

    def at_output_grad(self, grad: torch.Tensor) -> None:
        """Rule 4: backward reached a training forward's output; how many forwards ran since the last."""
        if self.forwards > 1:
            self.report("forwards", f"the model ran {self.forwards} training forwards before their backward, and the "
                                    f"plan's step runs one: their activations are alive together (two views of a "
                                    f"batch, a penalty's second forward). Plan a module whose forward makes every "
                                    f"call (a wrapper calling the model on each input) and apply the plan to it")
        self.forwards_read += self.forwards > 0
        self.forwards = 0

    def amp(self, module: nn.Module, args: tuple) -> None:
        if not _checked() or "amp" in self.reported:
            return
        tensor = next((a for a in args if isinstance(a, torch.Tensor)), None)  # walking parameters: 15 us a call
        device = tensor.device.type if tensor is not None else next((p.device.type for p in module.parameters()), None)
        running = torch.get_autocast_dtype(device) if device and torch.is_autocast_enabled(device) else None
        planned = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.plan.recipe.amp or "")
        if (running is None) != (planned is None) or (running and running.itemsize != planned.itemsize):
            self.report("amp", f"the plan was made for {f'autocast {planned}' if planned else 'no autocast'}, and "
                               f"the model runs under {f'autocast {running}' if running else 'no autocast'}. Plan "
                               f"its step (remat plan --amp bf16/fp16, or without --amp)")

    def report(self, kind: str, what: str) -> None:
        if kind in self.reported:
            return
        message = (f"remat: the training step is not the one the plan was made for: {what}; the predicted peak "
                   f"({format_bytes(self.plan.predicted.peak_bytes)}) does not hold for it")
        if self.mode == "error":
            raise PlanMismatch(message + ", or pass guard='warn'", [what])
        self.reported.add(kind)
        warnings.warn(message + "; reported once", stacklevel=4)


class _Hook:
    """One of a ``StepGuard``'s hooks, marked as remat's (NOTE [ Plans carried without a handle ])."""

    _remat_hook = True

    def __init__(self, check: Any):
        self.check = check

    def __call__(self, *args: Any) -> None:
        self.check(*args)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding parameter ``name`` of ``model``, and its name there."""
    prefix, _, leaf = name.rpartition(".")
    return model.get_submodule(prefix), leaf


def _checked() -> bool:
    """A training forward, eager: the only kind the guard reads."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def install(plan: Plan, model: nn.Module, first: nn.Module | None, mode: str) -> list[Any]:
    """The guard's hook handles on ``model`` and on ``first``, a planned module (none when ``mode`` is "off")."""
    if mode == "off":
        return []
    before, amp, after = StepGuard(plan, model, mode).hooks()
    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after, with_kwargs=True)]
    if first is not None:
        handles.append(first.register_forward_pre_hook(amp))
    return handles


__all__ = ["install", "KEPT_FRACTION", "OUTPUT_CHECKS", "StepGuard"]
