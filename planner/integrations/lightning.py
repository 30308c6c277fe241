"""A PyTorch Lightning callback that applies a remat plan to the model a ``Trainer`` fits.

    from planner.integrations.lightning import RematCallback
    trainer = lightning.Trainer(..., callbacks=[RematCallback("plan.json")])
    trainer.fit(module)

The plan is applied where Lightning expects model changes, before the strategy wraps the model
(DDP, FSDP, ``ModelParallelStrategy``), so the strategy wraps the planned model: in the
callback's ``setup`` hook, or, when the ``LightningModule`` builds its layers in
``configure_model``, right after that hook returns. The plan is applied to the submodule it
was made for: by default the outermost module of the plan's model class (the
``LightningModule`` itself, or e.g. its ``self.model``); ``module="model"`` names it.

A plan made for another training step than the Trainer runs (``training_recipe(trainer,
optimizer)``: ``accumulate_grad_batches``, ``gradient_clip_val``, ``precision``, the optimizer's
implementation, ranks) is refused with ``PlanMismatch`` naming each difference, when fitting
starts (the optimizers exist then), before the first step.

Example::

    trainer = pl.Trainer(callbacks=[RematCallback("plan.json")])
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from planner.act.applier import AppliedPlan, apply_plan, compiled_module
from planner.act.carried import replace_carried
from planner.errors import BadInput
from planner.model.fingerprint import model_differences
from planner.integrations.recipe import optimizer_difference, refuse_other_recipe
from planner.model.schema import Plan, Recipe
from planner.optimizers import impl_of, spec_of

logger = logging.getLogger("remat")


class RematCallback(pl.Callback):
    """Apply a remat plan to the model a Lightning ``Trainer`` fits, before the strategy wraps it.

    Args:
        plan: a ``Plan`` or the path of a plan file (read now: a bad file fails before fitting).
        module: dotted attribute path, from the ``LightningModule``, of the module the plan was
            made for (``"model"`` for ``self.model``); default: the outermost module of the
            plan's model class.
        guard: the runtime shape guard of ``apply_plan`` ("warn", "error" or "off"); see
            NOTE [ Runtime shape guard ].
        strict: as for ``apply_plan``: refuse a plan whose fingerprint differs from the module.
    """

    def __init__(self, plan: Plan | str | Path, *, module: str | None = None, guard: str = "warn",
                 strict: bool = True):
        self.plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        self.module = module
        self.guard = guard
        self.strict = strict
        self.handle: AppliedPlan | None = None
        self._fitted: pl.LightningModule | None = None

    # NOTE [ One callback, several fits ]
    #
    # A callback object outlives a ``fit``: jobs build it once and pass it to each Trainer of a
    # loop (folds, a sweep, phases), or fit a new module with the same Trainer.
    # Rule 1. The plan goes on the module being fitted. Remembering only "applied already" left a
    #         second module unplanned, silently: it trained with every activation kept.
    # Rule 2. The module fitted before gets its forwards back (as the Trainer callback does when
    #         ``model_init`` builds a new model): one handle, on the module in training.
    # Rule 3. The same module fitted again (fit, then fit more) keeps its plan: nothing is re-applied.
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # NOTE [ One callback, several fits ], Rule 3: the module fitted again keeps its plan
        if stage != "fit" or (self.handle is not None and pl_module is self._fitted):
            return
        if self.handle is not None:  # Rule 2
            self.handle.remove()
            self.handle = None
        if not is_overridden("configure_model", pl_module):
            self._apply(pl_module)
            return
        # The layers may only exist once configure_model has run (Lightning calls it right after
        # setup, before the strategy wraps the model): apply the plan when it returns.
        configure_model = pl_module.configure_model

        def configure_then_plan() -> None:
            del pl_module.configure_model  # back to the class's hook
            configure_model()
            self._apply(pl_module)

        pl_module.configure_model = configure_then_plan

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        other = [] if trainer.world_size == self.plan.world_size else [
            f"ranks: plan has {self.plan.world_size}, the Trainer has {trainer.world_size} (remat plan --world-size)"]
        if optimizer is not None:  # NOTE [ Optimizer specs ]
            other += optimizer_difference(self.plan, spec_of(optimizer), source="configure_optimizers gives")
        refuse_other_recipe(self.plan, training_recipe(trainer, optimizer), framework="this Trainer",
                            settings=_SETTINGS, python_call="training_recipe(trainer, optimizer)", other=other)

    # NOTE [ Lightning zeroes gradients after the forward ]
    #
    # Lightning's automatic optimization runs ``training_step``, then ``optimizer.zero_grad()``, then
    # backward: the last step's gradients are alive through the forward. A plan's step (and a plain
    # loop's, and the Hugging Face Trainer's) frees them before it, so on the docs' GPT-2 at a 12 MB
    # budget Lightning's step peaked at 10,691,320 bytes against 10,273,976 predicted (+4.1%), and the
    # step guard reports it (NOTE [ The step as the loop runs it ], Rule 1).
    # Rule 1. When a batch starts, the callback sets the gradients to None, as Lightning is about to:
    #         the gradients backward makes, the loss and the weights are the same (the step already
    #         used the old gradients), and the step is the planned one.
    # Rule 2. Not under manual optimization, nor with an overridden ``optimizer_zero_grad`` (the
    #         module decides), nor when the plan keeps gradients alive anyway (accumulation).
    #         ``on_before_zero_grad`` hooks see gradients set to None.
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if (self.handle is None or self.plan.recipe.grads_alive or not pl_module.automatic_optimization
                or is_overridden("optimizer_zero_grad", pl_module)):
            return
        for optimizer in trainer.optimizers:  # NOTE [ Lightning zeroes gradients after the forward ]
            optimizer.zero_grad(set_to_none=True)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.__dict__.pop("configure_model", None)  # fit failed before configure_model ran

    def _apply(self, pl_module: pl.LightningModule) -> None:
        target = self._target(pl_module)
        replace_carried(target, by="RematCallback")  # an earlier Trainer's plan: NOTE [ Plans carried without a handle ]
        self.handle = apply_plan(target, self.plan, strict=self.strict, guard=self.guard)
        self._fitted = pl_module

    # NOTE [ Several modules of the plan's class ]
    #
    # Without ``module=``, the callback finds the planned model by the plan's model class. A GAN's
    # generator and discriminator are both ``nn.Sequential`` (and so are blocks inside them): the
    # discriminator's plan went to the generator, the first in ``named_modules()``, and was refused
    # with twelve differences of modules and parameter shapes.
    # Rule 1. Of the modules of the plan's class, outermost first, the first whose modules and
    #         parameters are the plan's (``model_differences``, input shapes aside) is planned.
    # Rule 2. None is: the outermost, refused as before, listing what differs.
    def _target(self, pl_module: pl.LightningModule) -> nn.Module:
        if self.module is not None:
            try:
                named = pl_module.get_submodule(self.module)
                # a torch.compile wrapper: plan what it compiles (NOTE [ A compiled model given to the Trainer ]
                # in planner/integrations/hf.py); the default search below finds it by class already
                return compiled_module(named) or named
            except AttributeError:
                raise BadInput(f"RematCallback(module={self.module!r}): the LightningModule has no such "
                               f"submodule; name the attribute holding the planned model, e.g. 'model'") from None
        wanted = self.plan.fingerprint.model_class
        found = [m for _, m in pl_module.named_modules() if type(m).__name__ == wanted]  # pre-order: outermost first
        if found:  # NOTE [ Several modules of the plan's class ]
            return next((m for m in found if not model_differences(self.plan.fingerprint, m, None)), found[0])
        raise BadInput(f"the plan was made for a {wanted}, and the LightningModule ({type(pl_module).__name__}) "
                       f"holds none; pass RematCallback(plan, module='<attribute>') or re-plan for this model")


_AMP = {"32-true": None, "32": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}
"""Lightning's ``precision`` -> ``Recipe.amp`` (``16-mixed`` runs a GradScaler, as fp16 does)."""

_SETTINGS = {"grad_accum": "accumulate_grad_batches", "amp": "precision",
             "clip_grad_norm": "gradient_clip_val with gradient_clip_algorithm='norm'",
             "optimizer_impl": "the optimizer's foreach/fused", "zero_grad_set_to_none": "optimizer.zero_grad()"}
"""The Trainer settings behind each ``Recipe`` field, named in refusals."""


def training_recipe(trainer: pl.Trainer, optimizer: Any = None) -> Recipe:
    """The training step a Lightning ``Trainer`` runs with ``optimizer``, as a ``Recipe``.

    ``accumulate_grad_batches`` micro-batches; ``precision`` "bf16-mixed" or "16-mixed" (with a
    GradScaler) is autocast, "32-true" none (other precisions, which cast the model itself, are
    refused); ``gradient_clip_val`` clips by norm (``gradient_clip_algorithm="value"`` clamps every
    gradient in place, ``clip_grad_value_``: no memory, the step of a recipe without clipping);
    ``optimizer.zero_grad()`` sets gradients to None; the optimizer's ``fused``/``foreach``
    option is its implementation.
    """
    precision = str(trainer.precision)
    if precision not in _AMP:
        raise BadInput(f"Trainer(precision={precision!r}) casts the model itself, which remat does not plan; "
                       f"use one of {', '.join(map(repr, _AMP))}, or drop RematCallback")
    clip = trainer.gradient_clip_val
    by_norm = str(getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm") == "norm"
    return Recipe(grad_accum=trainer.accumulate_grad_batches, amp=_AMP[precision],
                  clip_grad_norm=float(clip) if clip and by_norm else None,
                  optimizer_impl=impl_of(optimizer) if optimizer is not None else "default")


__all__ = ["logger", "RematCallback", "training_recipe"]
