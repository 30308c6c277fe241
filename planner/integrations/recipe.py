"""The training step a framework runs, against the one a plan was made for (issue #17).

A plan's predicted peak holds for the step it was profiled with (``Plan.recipe``, see
``planner.model.schema.Recipe``): gradient accumulation keeps gradients alive through the
micro-batches, autocast halves the activations, clipping and fused optimizers add temporaries.
Each framework callback reads its Trainer's recipe and calls ``refuse_other_recipe``.

Example::

    refuse_other_recipe(plan, training_recipe(trainer), framework="Lightning",
                        settings={"grad_accum": "accumulate_grad_batches"}, python_call="training_recipe(trainer)")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from planner.errors import PlanMismatch
from planner.model.schema import Plan, Recipe
from planner.optimizers import from_file, parse_optimizer


def refuse_other_recipe(plan: Plan, job: Recipe, *, framework: str, settings: Mapping[str, str],
                        python_call: str, other: Sequence[str] = ()) -> None:
    """Raise ``PlanMismatch`` when ``plan`` was made for another step than ``job``, the framework's.

    Args:
        plan: the plan the callback was given.
        job: the recipe the framework will run.
        framework: its name in the message, e.g. "these TrainingArguments".
        settings: ``Recipe`` field -> the framework's setting for it, named in the message.
        python_call: how to make the job's recipe in Python, e.g. "training_recipe(args)".
        other: further differences (ranks, optimizer), one phrase each.
    """
    job = job.model_copy(update={"keep_output": plan.recipe.keep_output})  # NOTE [ The output kept through backward ]
    diffs = [f"{d} ({settings[d.split(':')[0]]})" if d.split(":")[0] in settings else d
             for d in plan.recipe.differences(job)] + list(other)
    if not diffs:
        return
    flags = " ".join(job.flags()) or "(no step options: the plain loop)"
    raise PlanMismatch.listing(f"the plan was made for another training step than {framework} run", diffs,
                               f"re-plan with their step: remat plan <model> --budget <budget> {flags} "
                               f"(in Python: planner.plan(..., recipe={python_call})), or change {framework}")


def optimizer_difference(plan: Plan, job_spec: str | None, *, source: str) -> list[str]:
    """The phrase for ``refuse_other_recipe(other=...)`` when the plan's optimizer is not the job's.

    ``job_spec``: the canonical spec of the framework's optimizer (planner.optimizers.spec_of),
    None when it cannot be read; ``source`` says whose it is ("the Trainer's optimizer is").
    A plan without an optimizer (made before plans recorded one) is not compared.
    """
    if job_spec is None or not plan.optimizer or parse_optimizer(from_file(plan.optimizer, "plan")) == job_spec:
        return []
    return [f"optimizer: plan has {parse_optimizer(plan.optimizer)}, {source} {job_spec} "
            f"(remat plan --optimizer '{job_spec}')"]


__all__ = ["optimizer_difference", "refuse_other_recipe"]
