"""Static memory of one rank under DDP or FSDP2 (NOTE [ Per-rank memory ]): what ``CostModel``
adds to each probe for the graph's ``world_size`` and ``sharding``.

Example::

    rank_memory(g).fwd_static_bytes      # everything static during forward, on one rank
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx


# NOTE [ Per-rank memory ]
#
# Under torch.distributed (graph.graph "world_size" N and "sharding"), static memory is counted
# per rank; activations, recompute and temporaries do not change with N (each rank runs the
# same per-rank batch).
#
# Rule 1. ddp: static memory as in NOTE [ Peak-memory model ], plus DDP's gradient buckets: one
# flat copy of the gradients, allocated when the DDP wrapper is built (default
# gradient_as_bucket_view=False), for any N (docs/distributed.md measures it).
#
# Rule 2. fsdp: FSDP2, fully_shard on every repeated block and on the root. Parameters,
# gradients and optimizer state are divided by N. Unsharded parameters live in buffers of their
# own (FSDPParam.all_gather_outputs), apart from the local shard, so they add their full size,
# for any N. With R the root group's and B the largest block's parameter bytes:
#   forward:  R (the root stays unsharded from forward to backward) + B (the running block)
#             + B when N > 1 (the running block's all-gather output, kept in the all-gather
#             state until the next unit waits for its own unshard);
#   backward, by the block b_k the point is in (blocks in forward order, B_k their parameter
#   bytes; ``CostModel.backward_static``):
#             R + B_k (parameters) + B_(k-1) when N > 1 (the previous block, prefetched)
#             + B_(k+1) (the later block's reduce-scatter input, kept until this block's
#             reduce-scatter; none for the last block) + the running block's and the root
#             group's gradients produced so far at full size (unsharded until their
#             reduce-scatter; the root's when backward ends) instead of their 1/N share;
#             after the last block (final norm, head, loss) the last block only: the root's
#             pre-backward hook prefetches it, and its predecessor is prefetched when the last
#             block's own backward starts (counting the predecessor there over-predicted T5 and
#             Llama under FSDP2 by exactly one block's parameters at N = 2 and 4); before the first
#             block (embeddings) the first block's reduce-scatter input. bwd_extra keeps the
#             largest case, 2R + 4B.
# These terms were read off FSDP2's own state inside a step (benchmarks/fsdp_memory_census.py)
# and checked per rank by ``remat verify`` (docs/distributed.md, which also measures the first
# version: 2R + 4B at every backward point).
#
# Rule 3. Not probed: the instant of a block's reduce-scatter, when its unsharded gradients,
# their reduce-scatter copy and the later block's pending input coexist (one B more than the
# windows around it); it sets the peak only when a block's parameters outweigh its activations
# (docs/distributed.md).
#
# Rule 4. Pipeline stages (graph.graph "pp_stages"): a stage's graph is its own module's, so the
# static memory above is the stage's parameters, gradients and optimizer state whole (world_size 1:
# one replica per stage); its receive buffers and the rest of the replica's batch are in
# NOTE [ Pipeline stages ], Rule 6 (solvers/pipeline.py), added with the micro-batches in flight.


@dataclass(frozen=True)
class RankMemory:
    """Static memory of one rank, per phase (NOTE [ Per-rank memory ])."""

    params_bytes: int  # parameters + buffers held by this rank outside forward/backward
    optimizer_bytes: int
    fwd_static_bytes: int  # everything static during forward
    bwd_static_bytes: int  # everything static during backward, this rank's gradients excepted
    opt_static_bytes: int  # during optimizer.step(): static + all of this rank's gradients + temporaries
    fwd_extra: tuple[int, int]  # (parameter, gradient) bytes on top of the shards in forward
    bwd_extra: tuple[int, int]  # the same in backward, at most (FSDP unsharded buffers, DDP buckets)
    grad_divisor: int  # gradients are split this many ways (FSDP)
    fsdp: bool = False  # backward extras depend on the point: see CostModel.backward_static
    base_bytes: int = 0  # this rank's parameters, optimizer state, batch and cuBLAS workspaces


def rank_memory(g: nx.DiGraph, *, per_rank: bool = True) -> RankMemory:
    """Static memory of one rank for the graph's ``world_size`` and ``sharding``
    (NOTE [ Per-rank memory ])."""
    gg = g.graph
    n = int(gg.get("world_size", 1)) if per_rank else 1
    sharding = gg.get("sharding", "none") if per_rank else "none"
    params, buffers, opt = gg["params_bytes"], gg["buffers_bytes"], gg["optimizer_bytes"]
    grads, batch, opt_tr = gg["grads_bytes"], gg["batch_bytes"], gg["optimizer_step_transient_bytes"]
    alive = gg.get("grads_alive", False)  # NOTE [ Peak-memory model ], "Recipe": in forward too
    batch += gg.get("workspace_bytes", 0)  # held by every rank through the whole step (NOTE [ cuBLAS workspaces ])
    if sharding == "fsdp":
        shard = lambda b: -(-b // n)  # noqa: E731
        root, block = gg.get("fsdp_root_param_bytes", 0), gg.get("fsdp_max_block_param_bytes", 0)
        pending = block if n > 1 else 0  # an all-gather output kept, or a prefetched block
        fwd = (root + block + pending, shard(grads) if alive else 0)
        bwd = (root + block + pending, block + block + root)
        p_rank, o_rank = shard(params) + buffers, shard(opt)
        base = p_rank + o_rank + batch
        return RankMemory(p_rank, o_rank, base + sum(fwd), base + sum(bwd), base + shard(grads) + shard(opt_tr),
                          fwd, bwd, n, True, base)
    buckets = grads if sharding == "ddp" else 0
    base = params + buffers + opt + batch + buckets
    fwd = (0, buckets + (grads if alive else 0))
    return RankMemory(params + buffers, opt, base + fwd[1] - buckets, base, base + grads + opt_tr, fwd,
                      (0, buckets), 1)


__all__ = ["RankMemory", "rank_memory"]
