"""Wrap a model for data parallelism the way a per-rank plan's prediction assumes.

A plan made with ``world_size``/``sharding`` predicts one rank's peak for one layout (see
NOTE [ Per-rank memory ]): FSDP2 with ``fully_shard`` on each module in
``plan.fsdp_units`` (forward order) and then on the root, default options; or DDP with its
defaults. ``shard_for_plan`` builds exactly that layout, so ``remat verify`` and training
scripts (``examples/train_distributed.py``) measure what was predicted. Call it after
``torch.distributed`` is initialised and, like ``fully_shard``, after ``apply_plan`` or before.

Example::

    model = shard_for_plan(model, plan)      # the FSDP2 units (or DDP) the plan's prediction assumed
    apply_plan(model, plan)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from planner.errors import BadInput
from planner.model.schema import Plan


def shard_for_plan(model: nn.Module, plan: Plan, *, device: torch.device | None = None) -> nn.Module:
    """``model`` wrapped as ``plan`` assumes: FSDP2 units and root, DDP, or unchanged.

    Args:
        model: the plain model (already on its device).
        plan: a per-rank plan (``plan.sharding`` 'fsdp' or 'ddp'); 'none' returns ``model``.
        device: the rank's device; DDP on CUDA is given it as its only ``device_ids``.

    Returns:
        The model to train: the same object under FSDP2 (``fully_shard`` works in place), a
        ``DistributedDataParallel`` wrapper under DDP.
    """
    mesh = None
    if plan.tensor_parallel > 1:  # NOTE [ Tensor-parallel ranks ]
        from planner.act.tensor_parallel import tensor_parallel

        tp = plan.tensor_parallel
        if plan.sharding == "none":
            return tensor_parallel(model, tp, sequence_parallel=plan.sequence_parallel)
        mesh = _dp_tp_mesh(model, plan)  # Rule 5: the layers over "tp", then FSDP2 over "dp"
        model = tensor_parallel(model, tp, mesh["tp"], sequence_parallel=plan.sequence_parallel)
        mesh = mesh["dp"]
    if plan.sharding == "none":
        return model
    import torch.distributed as dist

    if not dist.is_initialized():
        raise BadInput(f"a plan for {plan.sharding} needs torch.distributed initialised first "
                       "(torchrun, or remat verify, which starts the ranks itself)")
    if plan.sharding == "ddp":
        ids = [device.index] if device is not None and device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    modules = dict(model.named_modules())
    missing = [f for f in plan.fsdp_units if f not in modules]
    if missing:
        raise BadInput(f"the plan's FSDP units {missing} are not modules of this model; plan it again for this model")
    for fqn in plan.fsdp_units:
        fully_shard(modules[fqn], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _dp_tp_mesh(model: nn.Module, plan: Plan) -> Any:
    """The (dp, tp) device mesh of a tp x dp plan (NOTE [ Tensor-parallel ranks ], Rule 5)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    tp = plan.tensor_parallel
    if not dist.is_initialized() or dist.get_world_size() != plan.world_size:
        raise BadInput(f"a plan for tp {tp} x dp {plan.world_size // tp} needs torch.distributed initialised with "
                       f"{plan.world_size} ranks (torchrun, or remat verify, which starts the ranks itself)")
    return init_device_mesh(next(model.parameters()).device.type, (plan.world_size // tp, tp),
                            mesh_dim_names=("dp", "tp"))


def check_fsdp_options(model: nn.Module, plan: Plan) -> None:
    """Refuse FSDP2 options that the per-rank prediction does not model (a no-op before ``fully_shard``).

    The prediction assumes ``fully_shard``'s defaults on every unit (see NOTE
    [ Per-rank memory ]): parameters resharded after forward, kept in their own dtype, on the
    device. ``reshard_after_forward=False`` keeps every block unsharded from its forward to its
    backward (ZeRO-2), a mixed-precision policy adds low-precision copies, and CPU offload moves
    the shards to host memory: each changes the peak by far more than the tolerance.
    """
    if plan.sharding != "fsdp":
        return
    modules = dict(model.named_modules())
    for fqn in plan.fsdp_units:
        why = _unmodelled_fsdp_option(modules.get(fqn))
        if why:
            raise BadInput(f"{fqn} is wrapped by fully_shard with {why}, which the plan's per-rank prediction "
                           f"does not model; use fully_shard's defaults for it (or train without this plan)")


def _unmodelled_fsdp_option(module: nn.Module | None) -> str:
    """The first non-default FSDP2 option of ``module``'s parameter group, in words ('' if none).

    Reads FSDP2's private state (checked against torch 2.13: ``FSDPModule._get_fsdp_state()``,
    ``FSDPParamGroup.post_forward_mesh_info``, ``.mp_policy``, ``.offload_policy``).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    if not isinstance(module, FSDPModule):
        return ""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:
        return ""
    if group.post_forward_mesh_info is None:
        return "reshard_after_forward=False"
    if group.post_forward_mesh_info != group.mesh_info:
        return "reshard_after_forward=<int> (resharding to a smaller mesh)"
    mp = group.mp_policy
    if mp.param_dtype is not None or mp.reduce_dtype is not None:
        return f"MixedPrecisionPolicy(param_dtype={mp.param_dtype}, reduce_dtype={mp.reduce_dtype})"
    if isinstance(group.offload_policy, CPUOffloadPolicy):
        return "CPUOffloadPolicy"
    return ""


__all__ = ["check_fsdp_options", "shard_for_plan"]
