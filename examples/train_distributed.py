"""Train a model file data-parallel under torchrun (FSDP2 or DDP, gloo on CPU) with a remat plan.

    torchrun --nproc-per-node 2 examples/train_distributed.py examples/transformer.py --plan plan.json --sharding fsdp --steps 3
    torchrun --nproc-per-node 2 examples/train_distributed.py examples/transformer.py --plan plan.json --sharding ddp --steps 3
    python examples/train_distributed.py examples/transformer.py --steps 3     # one process: the reference

``example_inputs()`` is the global batch: rank r trains on rows [r*B/N, (r+1)*B/N). The plan is
per rank, so make it for that slice: ``planner.plan(model, budget, inputs=<one rank's slice>,
world_size=N, sharding="fsdp")``, or ``remat plan --world-size N --sharding fsdp`` on a model file
whose ``example_inputs()`` returns one rank's batch. See docs/distributed.md.
"""

import argparse
import gc
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from planner.act.applier import apply_plan
from planner.act.sharding import shard_for_plan
from planner.profiling.model_file import call_model, compute_loss, load_model_file
from planner.model.schema import Plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="model file: build_model(), example_inputs(), optional loss_fn(output) "
                                 "or loss_fn(output, batch)")
    p.add_argument("--plan", help="plan.json made per rank (omit to train without checkpointing)")
    p.add_argument("--sharding", choices=("fsdp", "ddp", "none"), default="fsdp",
                   help="fsdp: fully_shard each block, then the root; ddp: DistributedDataParallel")
    p.add_argument("--apply-plan", choices=("before", "after"), default="before",
                   help="apply the plan before wrapping (the torchtitan order) or to the wrapped model")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dump", help="rank 0 saves {'losses', 'grads' (last step, full)} here (torch.save)")
    return p.parse_args(argv)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: children of the outermost ModuleLists (transformer layers)."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and id(m) not in inside:
            found.extend(m)
            inside.update(id(x) for b in m for x in b.modules())
    return found


def wrap(model: nn.Module, sharding: str, world_size: int) -> nn.Module:
    if world_size == 1 or sharding == "none":
        return model
    if sharding == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in blocks(model):  # each block is one FSDP unit: its all-gather surrounds its checkpoint
        fully_shard(block)
    return fully_shard(model)  # the root group: embeddings, final norm, head


def rank_slice(obj, rank: int, world_size: int):
    """This rank's rows of every batch tensor (dim 0); anything else as it is."""
    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        if obj.shape[0] % world_size:
            raise SystemExit(f"the global batch ({obj.shape[0]} rows) does not split over {world_size} ranks")
        n = obj.shape[0] // world_size
        return obj[rank * n:(rank + 1) * n].contiguous()
    if isinstance(obj, (tuple, list)):
        return type(obj)(rank_slice(v, rank, world_size) for v in obj)
    if isinstance(obj, dict):
        return {k: rank_slice(v, rank, world_size) for k, v in obj.items()}
    return obj


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Gradients by plain FQN, unsharded (a collective under FSDP: every rank calls it)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    out = {}
    for name, p in inner.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().clone()
    return out


def note_plan_mismatch(plan: Plan, batch, world_size: int, sharding: str) -> None:
    from planner.model.fingerprint import fingerprint

    planned = {(i.name, tuple(i.shape)) for i in plan.fingerprint.inputs}
    local = {(i.name, tuple(i.shape)) for i in fingerprint(nn.Module(), batch).inputs}
    if planned != local:
        print(f"note: the plan was costed for inputs {sorted(planned)}; each rank trains on {sorted(local)}")
    if (plan.world_size, plan.sharding) != (world_size, sharding):
        print(f"note: the plan was made for world size {plan.world_size} with {plan.sharding}; "
              f"this run is {world_size} with {sharding}")


def main(argv=None):
    args = parse_args(argv)
    distributed = "RANK" in os.environ  # set by torchrun
    if distributed:
        dist.init_process_group("gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(name)s: %(message)s")

    torch.manual_seed(0)  # the same initial weights on every rank
    mf = load_model_file(args.model)
    model = mf.build_model().train()
    batch = rank_slice(mf.example_inputs(), rank, world_size)

    plan = Plan.load(args.plan) if args.plan else None
    if plan is not None and rank == 0:
        note_plan_mismatch(plan, batch, world_size, args.sharding)
    handle = apply_plan(model, plan) if plan and args.apply_plan == "before" else None
    if plan is not None and plan.sharding == args.sharding and distributed:
        model = shard_for_plan(model, plan)  # the FSDP units the plan's prediction assumed
    else:
        model = wrap(model, args.sharding, world_size)
    if plan and args.apply_plan == "after":
        handle = apply_plan(model, plan)  # FSDP2 keeps the FQNs; a DDP wrapper is looked through
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses, grads = [], {}
    for step in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(mf.loss_fn, call_model(model, batch), batch)  # the mean over this rank's rows
        loss.backward()  # DDP and FSDP average gradients over ranks: the gradient of the global mean
        if step == args.steps - 1 and args.dump:
            grads = full_grads(model)
        optimizer.step()
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)  # gloo has no AVG: sum, then divide
        losses.append(total.item() / world_size)
        if rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f}")

    if rank == 0 and handle is not None:
        print(f"recomputed {handle.recompute_count} checkpointed forwards in {args.steps} steps on rank 0")
    if rank == 0 and args.dump:
        torch.save({"losses": losses, "grads": grads}, args.dump)
    if distributed:
        # FSDP2's state and DDP's reducer hold the process group in reference cycles; collected at
        # interpreter exit, gloo's threads sometimes abort the process (SIGABRT after the last step)
        del model, optimizer, handle
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
