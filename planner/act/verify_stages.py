"""One rank of a pipeline plan's check (``planner.act.verify_ranks`` starts the ranks and reports):
this rank's stage trained by ``torch.distributed.pipelining`` without and with its stage's plan.

Each rank builds the model from the verify seed, keeps its stage (``planner.act.pipeline.stage_module``:
the model's own modules, FQNs kept), applies its stage's plan, and runs the plan's schedule over
the model file's batch (one data-parallel replica's) split into the plan's micro-batches, with
``return_outputs=False`` and the plan's optimizer: one compared step (the last stage's mean loss
and every stage's gradients, which the report compares with one process training the whole
model on the whole batch), ``steps`` more, then one measured step. The peak is the process-wide
count of NOTE [ CPU peaks across threads ] (``planner/profiling/measure.py``), as for FSDP2 ranks.

Example::

    from planner.act.verify_ranks import verify_ranks
    report = verify_ranks("model.py", "plan.json")   # a pipeline plan: each rank runs stage_rank_main
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from planner.model.schema import Plan
from planner.profiling import rng


def stage_rank_main(args: Any, plan: Plan, dev: torch.device, grads_path: Path, seed: int) -> dict:
    """Both trainings of this rank's stage; writes its stage's gradients of the compared step beside
    ``grads_path`` (``grads<rank>.pt``)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mesh = _mesh(plan, dev)
    base = _stage_run(args, plan, dev, seed, mesh, planned=False, grads_path=None)
    mine = _stage_run(args, plan, dev, seed, mesh, planned=True, grads_path=grads_path.with_name(f"grads{rank}.pt"))
    return dict(rank=rank, no_plan_peak=base["peak"], peak=mine["peak"], source=mine["source"], loss=mine["loss"],
                recomputes=mine["recomputes"])


def _mesh(plan: Plan, dev: torch.device) -> Any:
    """The (pp, dp, tp) device mesh of a pipeline whose stages have data-parallel or tensor-parallel ranks (rank =
    (stage x dp + dp rank) x tp + tp rank, pp outermost as torchtitan lays it out), or None."""
    from torch.distributed.device_mesh import init_device_mesh

    assert plan.pipeline is not None
    tp = plan.tensor_parallel
    dp = plan.world_size // (plan.pipeline.stages * tp)
    if dp == 1 and tp == 1:
        return None
    return init_device_mesh(dev.type, (plan.pipeline.stages, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def _lay_out(stage: torch.nn.Module, plan: Plan, mesh: Any) -> torch.nn.Module:
    """``stage`` laid out on its mesh: its layers shared by its tensor-parallel ranks (NOTE [ Tensor-parallel ranks
    ]), then wrapped for its data-parallel ranks as NOTE [ Pipeline stages ], Rule 10 assumes: FSDP2 on every
    repeated block and on the stage, or DDP; ``stage`` itself when the stage has one rank."""
    if mesh is not None and plan.tensor_parallel > 1:
        from planner.act.tensor_parallel import tensor_parallel

        stage.seq_shards = plan.tensor_parallel if plan.sequence_parallel else 1  # Rule 5 of NOTE [ Sequence-parallel ranks ]
        tensor_parallel(stage, plan.tensor_parallel, mesh["tp"], sequence_parallel=plan.sequence_parallel)
    if mesh is None or mesh["dp"].size() == 1:
        return stage
    if plan.sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(stage, process_group=mesh["dp"].get_group())
    from torch.distributed.fsdp import fully_shard

    for layer in stage.model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(stage, mesh=mesh["dp"])


def _stage_run(args: Any, plan: Plan, dev: torch.device, seed: int, mesh: Any, *, planned: bool,
               grads_path: Path | None) -> dict:
    import torch.distributed as dist

    from planner.act.applier import apply_plan
    from planner.act.pipeline import split_batch, stage_module
    from planner.optimizers import from_file
    from planner.profiling.measure import free, make_optimizer, measure_rank_step, to_device
    from planner.profiling.model_file import load_model_file

    pp = plan.pipeline
    assert pp is not None
    rank, in_stage = divmod(dist.get_rank(), plan.world_size // pp.stages)  # this rank's stage, its rank in the stage
    mf = load_model_file(args.model_file)
    stages = []
    for s in range(rank, pp.num_stages, pp.stages):  # V stages under interleaved-1f1b (NOTE [ Interleaved stages ])
        rng.seed_all(seed)  # the same weights as the reference's
        stages.append(stage_module(mf.build_model().to(dev).train(), s, pp.num_stages))
    first, last = stages[0].first, stages[-1].last
    ids, labels = split_batch(to_device(mf.example_inputs(), dev))
    ids = ids if first else None  # a rank keeps what its stage reads (NOTE [ Pipeline stages ], Rule 6)
    labels = labels if last else None
    handles = [apply_plan(st, plan) for st in stages] if planned else []
    wrapped = [_lay_out(st, plan, mesh) for st in stages]
    schedule = _schedule(plan, stages, wrapped, dev, mesh)
    opt = make_optimizer(from_file(plan.optimizer or "adamw", "plan"), torch.nn.ModuleList(stages), impl=plan.recipe.optimizer_impl)

    def step() -> list:
        opt.zero_grad(set_to_none=True)
        losses: list = []
        if first:
            schedule.step(ids, return_outputs=False)
        elif last:
            schedule.step(target=labels, losses=losses, return_outputs=False)
        else:
            schedule.step(return_outputs=False)
        opt.step()
        return losses

    rng.seed_all(seed)
    losses = step()
    loss = float(torch.stack([x.detach() for x in losses]).mean()) if losses else 0.0
    if grads_path is not None:
        _save_grads(stages, grads_path if in_stage == 0 else None)
    recomputes = sum(h.recompute_count for h in handles)
    for i in range(args.steps):
        rng.seed_all(seed + 1 + i)
        step()
    gc.collect()
    rng.seed_all(seed)
    peak = measure_rank_step(step, dev)  # NOTE [ Late frees on gloo's threads ]
    dist.barrier()
    for h in handles:
        h.remove()
    del stages, wrapped, schedule, opt, ids, labels
    free(dev)
    return dict(peak=peak.peak_bytes, source=peak.source, loss=loss, recomputes=recomputes)


def _schedule(plan: Plan, stages: list, wrapped: list, dev: torch.device, mesh: Any) -> Any:
    """The plan's schedule over this rank's stages (one, or V under interleaved-1f1b)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    pp = plan.pipeline
    assert pp is not None
    group = None if mesh is None else mesh["pp"].get_group()
    pstages = [PipelineStage(w, st.pp_stage, pp.num_stages, dev, group=group) for st, w in zip(stages, wrapped)]
    if pp.schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(pstages, n_microbatches=pp.micro_batches, loss_fn=stages[-1].loss)
    kind = Schedule1F1B if pp.schedule == "1f1b" else ScheduleGPipe
    return kind(pstages[0], n_microbatches=pp.micro_batches, loss_fn=stages[0].loss)


def _save_grads(stages: list[torch.nn.Module], path: Path | None) -> None:
    """The rank's stages' gradients, full size (under tp or fsdp a collective: every rank of the stage calls it),
    saved to ``path`` (one rank of the stage's)."""
    grads = {n: None if p.grad is None else p.grad.detach() for st in stages for n, p in st.named_parameters()}
    grads = {n: g.full_tensor() if hasattr(g, "full_tensor") else g for n, g in grads.items()}
    if path is not None:
        torch.save({n: None if g is None else g.to("cpu", copy=True) for n, g in grads.items()}, path)


__all__ = ["stage_rank_main"]
