"""A pipeline plan's parts (NOTE [ Pipeline stages ] in solvers/pipeline.py): the layout (``Pipeline``),
one plan per stage (``StagePlan``), their checks, and the stage plan a stage module applies.

``planner.model.schema.Plan`` holds them (``Plan.pipeline``, ``Plan.stages``); ``StagePlan``'s
fingerprint, solver and prediction are the schema's types, resolved there (``StagePlan.model_rebuild``).

Example::

    plan = Plan.load("plan.json")
    stage_plan(plan, 1).checkpoints            # what stage 1 checkpoints
    apply_plan(stage_module, plan)             # the applier calls plan_for(plan, stage_module)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from planner.model.fields import MAX_COUNT, MAX_WORLD_SIZE, Bytes, FileModel, bad_field


class Pipeline(FileModel):
    """How the ranks run as pipeline stages (NOTE [ Pipeline stages ] in solvers/pipeline.py)."""

    stages: int = Field(ge=2, le=MAX_WORLD_SIZE, description="Pipeline ranks (pp), one stage each but under "
                                                             "interleaved-1f1b, where each holds stages_per_rank.")
    schedule: Literal["1f1b", "gpipe", "interleaved-1f1b"]
    micro_batches: int = Field(ge=1, le=MAX_COUNT, description="Micro-batches the replica's batch is split into.")
    stages_per_rank: int = Field(1, ge=1, le=MAX_COUNT, description="Stages each rank holds (V, interleaved-1f1b; "
                                                                    "NOTE [ Interleaved stages ]).")

    @property
    def num_stages(self) -> int:
        """Every stage of the pipeline: pp x V (stage s runs on rank s % pp)."""
        return self.stages * self.stages_per_rank


class StagePlan(FileModel):
    """One pipeline stage's plan: its modules, what its schedule keeps in flight, its checkpoints."""

    stage: int = Field(ge=0, le=MAX_WORLD_SIZE)
    modules: list[str] = Field(description="The repeated blocks this stage runs (the embeddings run on the first "
                                           "stage, the final norm, head and loss on the last).")
    in_flight: int = Field(ge=1, le=MAX_COUNT, description="Micro-batches held at most between forward and "
                                                          "backward (Rule 2).")
    held_bytes: Bytes = Field(description="What one micro-batch in flight holds under this plan (Rule 4).")
    buffers_bytes: Bytes = Field(description="Receive buffers and the rest of the replica's batch (Rule 6).")
    recv_bytes: Bytes = Field(description="One micro-batch's received activation (0 on the first stage).")
    send_bytes: Bytes = Field(description="One micro-batch's output sent on (0 on the last stage).")
    fingerprint: Fingerprint = Field(description="The stage module's fingerprint, on one micro-batch.")
    fingerprint_digest: str
    headroom_bytes: Bytes = 0
    checkpoints: list[str]
    checkpoint_units: list[str] = Field(default_factory=list)
    solver: SolverInfo
    predicted: Predicted = Field(description="This stage's peak under its schedule, on its rank.")


def check_predicted(where: str, pr: Any, budget_bytes: int, headroom_bytes: int) -> None:
    """One prediction adds up: its peak is the sum of its breakdown and fits the budget less the headroom,
    and its step (which includes the recompute and offload time) is no shorter than those."""
    parts = pr.params_bytes + pr.grads_bytes + pr.optimizer_bytes + pr.activations_bytes
    if parts != pr.peak_bytes:
        raise bad_field(f"{where}.peak_bytes", f"{pr.peak_bytes} is not the sum of its breakdown (params, grads, "
                                               f"optimizer, activations: {parts})")
    if pr.peak_bytes > budget_bytes - headroom_bytes:
        raise bad_field(f"{where}.peak_bytes", f"{pr.peak_bytes} exceeds budget_bytes {budget_bytes} less "
                                               f"headroom_bytes {headroom_bytes}")
    if pr.recompute_ms + (pr.offload_ms or 0.0) > pr.step_ms * (1 + 1e-9) + 1e-6:
        raise bad_field(f"{where}.recompute_ms", f"{pr.recompute_ms} ms of recompute (with offload_ms) exceed "
                                                 f"the {pr.step_ms} ms step_ms that includes them")


def check_stages(plan: Any) -> None:
    """A pipeline plan: one stage plan per stage, in order, each within the budget."""
    pp = plan.pipeline
    if plan.sequence_parallel and plan.tensor_parallel == 1:
        raise bad_field("sequence_parallel", "needs tensor_parallel > 1")
    if pp is None:
        if plan.stages:
            raise bad_field("stages", "stage plans without a pipeline")
        return
    if (pp.stages_per_rank > 1) != (pp.schedule == "interleaved-1f1b"):
        raise bad_field("pipeline.stages_per_rank", "above 1 with interleaved-1f1b only, and needed by it")
    if [st.stage for st in plan.stages] != list(range(pp.num_stages)):
        raise bad_field("stages", f"need one plan per stage 0..{pp.num_stages - 1}, in order")
    ranks = pp.stages * plan.tensor_parallel
    if plan.world_size % ranks or (plan.world_size > ranks and plan.sharding == "none"):
        raise bad_field("world_size", f"{plan.world_size} is not the pipeline's {pp.stages} stages x tp "
                                      f"{plan.tensor_parallel} x dp ranks (with a sharding when dp > 1)")
    for i, st in enumerate(plan.stages):
        check_predicted(f"stages.{i}.predicted", st.predicted, plan.budget_bytes, st.headroom_bytes)
        if st.in_flight > pp.micro_batches:
            raise bad_field(f"stages.{i}.in_flight", f"{st.in_flight} is more than the {pp.micro_batches} micro-batches")


def unset_parallel_fields(plan: Any) -> dict[str, Any]:
    """The plan keys a plan without pipeline stages or tensor parallelism leaves out of its file (``Plan.to_json``)."""
    unset: dict[str, Any] = {} if plan.stages else {"pipeline": True, "stages": True}
    if plan.pipeline is not None and plan.pipeline.stages_per_rank == 1:
        unset["pipeline"] = {"stages_per_rank": True}
    unset = unset if plan.sequence_parallel else {**unset, "sequence_parallel": True}
    return unset if plan.tensor_parallel > 1 else {**unset, "tensor_parallel": True}


def plan_for(plan: Any, model: Any) -> Any:
    """The plan to apply to ``model``: a pipeline plan's stage plan on a stage module (its ``pp_stage``),
    else ``plan``."""
    stage = getattr(model, "pp_stage", None)
    return stage_plan(plan, stage) if plan.stages and isinstance(stage, int) else plan


def stage_plan(plan: Any, stage: int) -> Any:
    """Stage ``stage``'s plan of a pipeline plan, as a plan of its own (for the stage module)."""
    st = plan.stages[stage]
    return plan.model_copy(update=dict(
        fingerprint=st.fingerprint, fingerprint_digest=st.fingerprint_digest, headroom_bytes=st.headroom_bytes,
        checkpoints=st.checkpoints, checkpoint_units=st.checkpoint_units, solver=st.solver,
        predicted=st.predicted, world_size=1, pipeline=None, stages=[]))


__all__ = ["Pipeline", "StagePlan", "check_stages", "plan_for", "stage_plan", "unset_parallel_fields"]
