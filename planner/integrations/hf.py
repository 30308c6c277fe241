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
- the plan was made for another training step than the ``TrainingArguments`` run
  (``training_recipe(args)``: gradient accumulation, clipping, mixed precision, the optimizer
  and its implementation, ranks): its predicted peak is for that step. The Trainer clips
  gradients by default (``max_grad_norm=1.0``) and uses fused AdamW with torch >= 2.8, so plan
  with ``recipe=training_recipe(args)`` (or the ``remat plan`` options the refusal names).

Example::

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RematCallback("plan.json")])
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from planner.act.applier import AppliedPlan, apply_plan, compiled_module
from planner.act.carried import replace_carried
from planner.errors import BadInput
from planner.integrations.recipe import optimizer_difference, refuse_other_recipe
from planner.model.schema import Plan, Recipe
from planner.optimizers import impl_of, spec_for, spec_of

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

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    **kwargs: Any) -> None:
        self._apply(args, model, optimizer)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        # the optimizer the Trainer built, now that it exists (NOTE [ Optimizer specs ]), and the model as a trainer
        # patched it after __init__ (NOTE [ The Trainer's loss ], Rule 4)
        check_training_arguments(self.plan, args, optimizer=optimizer, model=compiled_module(model) or model)
        self._apply(args, model, optimizer)  # a model made by model_init, or a callback added after __init__

    # NOTE [ A compiled model given to the Trainer ]
    #
    # ``Trainer(model=torch.compile(model), callbacks=[RematCallback(plan)])`` hands the callback
    # the compile wrapper. ``apply_plan`` refuses a wrapper ("apply the plan first, then compile"),
    # advice a callback user cannot take: they never call ``apply_plan``.
    # Rule 1. The callback plans the module the wrapper compiles (``_orig_mod``), as ``apply_plan``
    #         looks through a DDP wrapper. ``torch.compile`` traces at the first call, after
    #         ``on_init_end``: the trace sees the planned forwards, as if compiled after the plan.
    # Rule 2. A wrapper that has run already is retraced: dynamo guards on the modules' instance
    #         ``forward`` and recompiles when ``apply_plan`` sets it (its graph then holds the regions).
    def _apply(self, args: Any, model: Any, optimizer: Any) -> None:
        model = compiled_module(model) or model  # NOTE [ A compiled model given to the Trainer ]
        if model is None or model is self._model:
            return
        check_training_arguments(self.plan, args, optimizer=optimizer, model=model)
        if self.handle is not None:  # model_init built a new model: the old one keeps nothing of ours
            self.handle.remove()
        replace_carried(model, by="RematCallback")  # an earlier Trainer's plan: NOTE [ Plans carried without a handle ]
        logger.info("applying %s to %s", self.source, type(model).__name__)
        self.handle = apply_plan(model, self.plan, strict=self.strict, guard=self.guard)
        self._model = model


def check_training_arguments(plan: Plan, args: Any, *, optimizer: Any = None, model: Any = None) -> None:
    """Raise if ``args`` (``TrainingArguments``) contradict ``plan``; see the module docstring.
    ``optimizer``: the one the Trainer was given or built (default: the one ``args.optim`` builds)."""
    which = _trainer_checkpointing(args)
    if which:
        what, fix = which
        raise DoubleCheckpointing(
            f"{what} checkpoints every layer, and the remat plan would checkpoint on top of it (double "
            f"checkpointing; the plan's prediction would not hold): {fix} and let the plan choose, or drop "
            f"RematCallback")
    refuse_other_recipe(plan, training_recipe(args, optimizer), framework="these TrainingArguments", settings=_SETTINGS,
                        python_call="training_recipe(args)", other=_other_differences(plan, args, optimizer, model))


_SETTINGS = {"grad_accum": "gradient_accumulation_steps", "amp": "bf16/fp16",
             "clip_grad_norm": "max_grad_norm; the Trainer clips at 1.0 unless max_grad_norm=0",
             "optimizer_impl": "optim", "zero_grad_set_to_none": "the Trainer calls model.zero_grad()"}
"""The TrainingArguments behind each ``Recipe`` field, named in refusals."""


# NOTE [ Checkpointing the arguments turn on by default ]
#
# TRL's ``SFTConfig`` (and its other trainers' configs) subclass ``TrainingArguments`` with
# ``gradient_checkpointing=True`` as the default: a job that never wrote it was refused with
# "TrainingArguments(activation_checkpointing=True) checkpoints every layer", naming a class and
# an argument (transformers 5's new name) it had not used.
# Rule 1. The refusal names the arguments' own class and, when the value is that class's default,
#         says so; the fix names the argument to pass: ``SFTConfig(gradient_checkpointing=False)``.
# Rule 2. It still refuses: the plan then checkpoints on top of every layer, and its prediction is
#         for a step without that checkpointing.
def _trainer_checkpointing(args: Any) -> tuple[str, str] | None:
    """How the Trainer itself would checkpoint layers, and the argument that turns it off; or None."""
    cls, names = type(args).__name__, ("gradient_checkpointing", "activation_checkpointing")
    on = [n for n in names if getattr(args, n, None)]  # transformers 5 mirrors one name into the other
    by_default = [n for n in on if _field_default(type(args), n) is True]
    if by_default:  # NOTE [ Checkpointing the arguments turn on by default ]
        name = by_default[0]
        return f"{cls}({name}=True), {cls}'s default,", f"pass {cls}({name}=False)"
    if on:
        name = on[-1] if len(on) > 1 else on[0]
        return f"{cls}({name}=True)", f"pass {cls}({name}=False)"
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if isinstance(fsdp_config, dict) and fsdp_config.get("activation_checkpointing"):
        return (f"{cls}(fsdp_config={{'activation_checkpointing': True}})",
                "drop activation_checkpointing from fsdp_config")
    return None


def _field_default(cls: type, name: str) -> Any:
    """The dataclass default of field ``name`` of ``cls``; None when it has none."""
    import dataclasses

    field = next((f for f in dataclasses.fields(cls) if f.name == name), None) if dataclasses.is_dataclass(cls) else None
    return None if field is None or field.default is dataclasses.MISSING else field.default


def training_recipe(args: Any, optimizer: Any = None) -> Recipe:
    """The training step a ``Trainer`` with ``args`` (``TrainingArguments``) runs, as a ``Recipe``.

    Plan with it (``planner.plan(model, budget, inputs=..., recipe=training_recipe(args))``, or
    the ``remat plan`` options ``training_recipe(args).flags()``) so that ``RematCallback``
    accepts the plan. The Trainer accumulates ``gradient_accumulation_steps`` micro-batches,
    clips with ``clip_grad_norm_(max_grad_norm)`` unless ``max_grad_norm`` is 0 (its default is
    1.0), runs forward and loss under autocast with ``bf16``/``fp16`` (fp16 with a GradScaler),
    sets gradients to None after each step (``model.zero_grad()``) and builds AdamW with
    ``fused=True`` for ``optim="adamw_torch_fused"`` (the default since torch 2.8); an
    ``optimizer`` given to the Trainer (``Trainer(optimizers=(optimizer, None))``) is its own implementation.
    """
    clip = getattr(args, "max_grad_norm", None)
    return Recipe(grad_accum=getattr(args, "gradient_accumulation_steps", 1) or 1,
                  amp="bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None,
                  clip_grad_norm=float(clip) if clip and clip > 0 else None,
                  optimizer_impl=impl_of(optimizer) if optimizer is not None else
                  "fused" if _text(getattr(args, "optim", None)) == "adamw_torch_fused" else "default")


def _other_differences(plan: Plan, args: Any, optimizer: Any, model: Any) -> list[str]:
    """Differences outside the step recipe: the optimizer and the ranks."""
    if optimizer is not None:
        out = optimizer_difference(plan, _read(spec_of, optimizer, what=type(optimizer).__name__),
                                   source="the Trainer's optimizer is")
    else:
        out = optimizer_difference(plan, trainer_optimizer(args, model),
                                   source=f"TrainingArguments(optim={_text(args.optim)!r}) build")
    out += _loss_difference(plan, args, model)
    world = getattr(args, "world_size", 1)
    if world != plan.world_size:
        out.append(f"ranks: plan has {plan.world_size}, TrainingArguments have {world} (world_size; "
                   f"remat plan --world-size)")
    return out


# NOTE [ The Trainer's loss ]
#
# With ``label_smoothing_factor`` > 0, or a ``Trainer(compute_loss_func=...)``, the Trainer takes
# ``labels`` out of the batch, calls the model without them, and computes the loss outside it
# (``LabelSmoother``: a log-softmax over the logits and two reductions; or the user's function).
# A plan profiled with the labels in the batch has the model's own loss in its prediction, not the
# Trainer's: on the docs' GPT-2 at a 12 MB budget the step's peak was 10,767,768 bytes against
# 10,273,976 predicted with smoothing (+4.8%), 11,281,600 with a z-loss ``compute_loss_func``
# (+9.8%; the logits' size, which grows with the vocabulary, is what differs).
# Rule 1. ``trainer_step_inputs(args, batch, model, compute_loss_func=...)`` gives the batch and the
#         loss the Trainer runs: plan with them and the prediction is the Trainer's step's.
#         ``compute_loss_func`` gets ``num_items_in_batch`` as the Trainer counts it (the batch's
#         labels other than -100, shifted for a causal LM, times the accumulation steps): a scalar,
#         for the loss's value; the memory does not depend on it.
# Rule 2. The callback refuses a plan whose inputs name ``labels`` when the Trainer smooths: the
#         plan cannot have been made with the Trainer's loss. (A plan without ``labels`` may be
#         a model whose loss needs none; it is not refused.)
# Rule 3. ``compute_loss_func`` is the Trainer's own, which no callback is shown: the runtime guard
#         reports the first training forward that lacks the plan's ``labels`` (NOTE [ Runtime shape
#         guard ], a planned input missing), naming ``trainer_step_inputs``.
# Rule 4. TRL's trainers (``SFTTrainer`` and others, trl 1.16) patch the model's forward with a fused LM
#         head after ``Trainer.__init__`` and call ``model(**batch, fused_lm_head=True)``: per-token
#         log-probabilities in tiles, and the loss from them. On the docs' GPT-2 a plan of the model's
#         own loss predicted 10,832,120 bytes and the SFT step measured 29,775,504 (2.75x), with no word:
#         the flag is no tensor, so neither the fingerprint's inputs nor the shape guard saw it. The
#         fingerprint now keeps the keyword flags a plan was made with (``Fingerprint.flags``); when the
#         model's forward takes ``fused_lm_head`` (read at ``on_train_begin``, once TRL has patched it),
#         the callback refuses a plan made without ``fused_lm_head=True``, and
#         ``trainer_step_inputs(args, batch, trainer.model)`` gives the batch with that flag, planned on
#         the patched model: 27,815,528 predicted, 27,805,328 measured (-0.04%). With smoothing or a
#         ``compute_loss_func`` TRL computes the loss from the logits as the Trainer does (Rules 1-3).

def trainer_step_inputs(args: Any, batch: dict[str, Any], model: Any = None, *,
                        compute_loss_func: Any = None) -> tuple[dict[str, Any], Any]:
    """The batch and ``loss_fn`` a ``Trainer`` with ``args`` (and ``compute_loss_func``, if it is given one) runs
    ``model`` with, for ``planner.plan(model, budget, inputs=inputs, loss_fn=loss_fn, ...)``; ``loss_fn`` None: the
    model's own loss (NOTE [ The Trainer's loss ])."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.trainer_pt_utils import LabelSmoother

    if "labels" not in batch or (compute_loss_func is None and not _smooths(args, model)):
        return ({**batch, "fused_lm_head": True}, None) if "labels" in batch and _fused_head(model) else (batch, None)
    labels = batch["labels"]
    base = getattr(getattr(model, "base_model", None), "model", model)  # a PEFT model's, as the Trainer reads it
    shift = base is None or type(base).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if compute_loss_func is not None:
        counted = labels[..., 1:] if shift and not getattr(getattr(base, "config", None), "is_encoder_decoder",
                                                           False) else labels
        items = counted.ne(-100).sum() * (getattr(args, "gradient_accumulation_steps", 1) or 1)
        return inputs, lambda output: compute_loss_func(output, labels, num_items_in_batch=items)
    smoother = LabelSmoother(epsilon=args.label_smoothing_factor)
    return inputs, lambda output: smoother(output, labels, shift_labels=shift)


def _smooths(args: Any, model: Any) -> bool:
    """The Trainer smooths the loss itself (multi-label classification turns it off)."""
    config = getattr(model, "config", None)
    return bool(getattr(args, "label_smoothing_factor", 0)) and (
        getattr(config, "problem_type", None) != "multi_label_classification")


def _fused_head(model: Any) -> bool:
    """The model's forward takes ``fused_lm_head``: TRL's fused LM head (NOTE [ The Trainer's loss ], Rule 4). Under
    accelerate's autocast wrappers too: read through what they keep (``_original_forward``) and name (``__wrapped__``)."""
    for forward in (getattr(model, "_original_forward", None), getattr(model, "forward", None)):
        func = getattr(forward, "__func__", forward)
        for _ in range(8):  # a few wrappers deep; a __wrapped__ cycle ends
            if "fused_lm_head" in getattr(getattr(func, "__code__", None), "co_varnames", ()):
                return True
            func = getattr(func, "__wrapped__", None)
    return False


def _loss_difference(plan: Plan, args: Any, model: Any) -> list[str]:
    """NOTE [ The Trainer's loss ], Rules 2 and 4."""
    names = {s.name for s in plan.fingerprint.inputs} | {s.name for b in plan.buckets for s in b.inputs}
    if "labels" in names and not _smooths(args, model) and _fused_head(model) and \
            not (plan.fingerprint.flags or {}).get("fused_lm_head"):
        return [f"loss: {type(args).__name__}'s trainer calls the model with fused_lm_head=True (TRL's fused LM head: "
                f"per-token log-probabilities in tiles) and the plan's step calls it without; plan the trainer's "
                f"step: inputs, loss_fn = trainer_step_inputs(args, batch, trainer.model), then planner.plan("
                f"trainer.model, budget, inputs=inputs, loss_fn=loss_fn, ...)"]
    if "labels" not in names or not _smooths(args, model):
        return []
    return [f"loss: the plan's model computes its loss from its 'labels' input; TrainingArguments("
            f"label_smoothing_factor={args.label_smoothing_factor}) take the labels out and smooth the loss outside "
            f"the model (plan with: inputs, loss_fn = trainer_step_inputs(args, batch, model))"]


def trainer_optimizer(args: Any, model: Any = None) -> str | None:
    """The optimizer spec (NOTE [ Optimizer specs ]) of the optimizer a ``Trainer`` builds from
    ``args``: its ``optim``, ``optim_args`` and ``weight_decay`` (given to the largest parameter
    group); None, with a warning, when transformers cannot build it here (a package it needs)."""
    from transformers import Trainer

    def built(args: Any) -> str:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        if "weight_decay" in inspect.signature(cls).parameters:
            kwargs = {**kwargs, "weight_decay": args.weight_decay}
        return spec_for(cls, kwargs)

    return _read(built, args, what=f"TrainingArguments(optim={_text(args.optim)!r})")


def _read(read: Any, source: Any, *, what: str) -> str | None:
    """``read(source)``, or None with a warning when it is no optimizer remat can read (LOMO, a package
    transformers needs and lacks here): that optimizer is not compared."""
    try:
        return read(source)
    except (ImportError, ValueError, TypeError, AttributeError, BadInput) as e:
        logger.warning("remat cannot compare the plan's optimizer with %s: %s", what, e)
        return None


def _text(value: Any) -> str:
    return str(getattr(value, "value", value) or "")


__all__ = ["check_training_arguments", "DoubleCheckpointing", "logger", "RematCallback", "trainer_optimizer",
           "trainer_step_inputs", "training_recipe"]
