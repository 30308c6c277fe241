"""A Hugging Face ``Trainer`` callback that applies a remat plan to the model it trains.

    from planner.integrations.hf import RematCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RematCallback("plan.json")])
    trainer.train()

The plan is applied once, in place, before the first step: when the Trainer is built (before
accelerate wraps the model for DDP or FSDP; see NOTE [ Plans under FSDP2 and DDP ]), or at
the start of training for a model the Trainer makes later (``model_init``). The callback
refuses, with a ``RematError`` naming the fix, when:

- ``TrainingArguments(gradient_checkpointing=True)`` (``activation_checkpointing`` in
  transformers 5, or FSDP's own in ``fsdp_config``): Hugging Face would checkpoint every
  layer and the plan would checkpoint on top of that (double checkpointing, and the plan's
  prediction would not hold);
- the plan was made for another model (``PlanMismatch``, listing what differs);
- the plan was made for another training recipe than the ``TrainingArguments`` (mixed
  precision, optimizer, ranks): its predicted peak is for that recipe.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from planner.act.applier import AppliedPlan, apply_plan
from planner.errors import BadInput, PlanMismatch
from planner.model.schema import Plan

logger = logging.getLogger("remat")


class DoubleCheckpointing(BadInput):
    """The Trainer checkpoints every layer itself (``gradient_checkpointing=True``) and a plan is given."""


class RematCallback(TrainerCallback):
    """Apply a remat plan to the model a ``Trainer`` trains, once, before the first step.

    Args:
        plan: a ``Plan`` or the path of a plan file (read now: a bad file fails before training).
        guard: the runtime shape guard of ``apply_plan`` ("warn", "error" or "off"); see
            NOTE [ Runtime shape guard ]. Plan at the largest batch the data loader gives.
        strict: as for ``apply_plan``: refuse a plan whose fingerprint differs from the model.
    """

    def __init__(self, plan: Plan | str | Path, *, guard: str = "warn", strict: bool = True):
        self.plan = plan if isinstance(plan, Plan) else Plan.load(plan)
        self.source = str(plan) if not isinstance(plan, Plan) else "the plan"
        self.guard = guard
        self.strict = strict
        self.handle: AppliedPlan | None = None
        self._model: Any = None

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._apply(args, model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._apply(args, model)  # a model made by model_init, or a callback added after __init__

    def _apply(self, args: Any, model: Any) -> None:
        if model is None or model is self._model:
            return
        check_training_arguments(self.plan, args)
        if self.handle is not None:  # model_init built a new model: the old one keeps nothing of ours
            self.handle.remove()
        logger.info("applying %s to %s", self.source, type(model).__name__)
        self.handle = apply_plan(model, self.plan, strict=self.strict, guard=self.guard)
        self._model = model


def check_training_arguments(plan: Plan, args: Any) -> None:
    """Raise if ``args`` (``TrainingArguments``) contradict ``plan``; see the module docstring."""
    which = _trainer_checkpointing(args)
    if which:
        raise DoubleCheckpointing(
            f"{which} checkpoints every layer, and the remat plan would checkpoint on top of it (double "
            f"checkpointing; the plan's prediction would not hold): turn it off and let the plan choose, or drop "
            f"RematCallback")
    diffs = recipe_differences(plan, args)
    if diffs:
        listing = "\n  ".join(diffs)
        raise PlanMismatch(f"the plan was made for another training recipe than these TrainingArguments:\n"
                           f"  {listing}\nre-plan with the job's recipe (remat plan --amp/--optimizer/"
                           f"--world-size ...) or change the TrainingArguments", diffs)


def _trainer_checkpointing(args: Any) -> str | None:
    """How the Trainer itself would checkpoint layers, or None."""
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name mirrors it)
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(args, name, None):
            return f"TrainingArguments({name}=True)"
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if isinstance(fsdp_config, dict) and fsdp_config.get("activation_checkpointing"):
        return "TrainingArguments(fsdp_config={'activation_checkpointing': True})"
    return None


def recipe_differences(plan: Plan, args: Any) -> list[str]:
    """What differs between the recipe ``plan`` was made for and ``args``, one line each."""
    out = []
    amp = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    if amp != plan.amp:
        out.append(f"mixed precision: plan has {plan.amp or 'none'}, TrainingArguments have {amp or 'none'} "
                   f"(bf16/fp16)")
    optimizer = _optimizer(getattr(args, "optim", None))
    if optimizer is not None and plan.optimizer and optimizer != plan.optimizer:
        out.append(f"optimizer: plan has {plan.optimizer}, TrainingArguments have {_text(args.optim)}")
    world = getattr(args, "world_size", 1)
    if world != plan.world_size:
        out.append(f"ranks: plan has {plan.world_size}, TrainingArguments have {world} (world_size)")
    return out


def _optimizer(optim: Any) -> str | None:
    """remat's name for a ``TrainingArguments.optim``, or None when remat has no model of it."""
    name = _text(optim)
    if name.startswith("adamw") and "8bit" not in name and "bnb" not in name:
        return "adamw"
    return "sgd" if name == "sgd" else None


def _text(value: Any) -> str:
    return str(getattr(value, "value", value) or "")
