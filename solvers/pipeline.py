"""Pipeline stages (``torch.distributed.pipelining``): one stage's peak under its schedule
(NOTE [ Pipeline stages ]), and the search that plans a stage for it.

A stage's graph is the graph of one micro-batch through the stage's modules (its profile), with
the ``pp_*`` attributes of ``solvers/contract.py``; ``stage_peak`` adds what the schedule keeps
alive beside it. Torch-free.

Example::

    split_layers(126, 16)[0]                 # (0, 8): the first stage's repeated blocks
    in_flight("1f1b", 4, 0, 8)               # 4 micro-batches held by the first stage
    stage_peak(g, ["model.layers.3"]).peak_bytes
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import networkx as nx

from solvers.cost_model import CostModel, check_checkpoint_set, policies_of

Schedule = Literal["1f1b", "gpipe", "interleaved-1f1b"]
"""Pipeline schedules planned for: ``Schedule1F1B``, ``ScheduleGPipe`` and ``ScheduleInterleaved1F1B`` (V stages
per rank, NOTE [ Interleaved stages ] in solvers/interleaved.py)."""

SCHEDULES: tuple[str, ...] = get_args(Schedule)


# NOTE [ Pipeline stages ]
#
# N stages (ranks), M micro-batches of one data-parallel replica's batch, one stage per rank
# (``PipelineStage`` + ``ScheduleGPipe``/``Schedule1F1B`` of torch.distributed.pipelining, as
# torch 2.13 runs them, ``step(..., return_outputs=False)``).
#
# Rule 1. Modules. The repeated blocks are split evenly in forward order: with L blocks, stage s
# gets L // N, and the first L % N stages one more. The embeddings run on the first stage, the
# final norm, the head and the loss on the last (``split_layers``).
# Rule 2. Order. GPipe runs every forward, then every backward (F0..F(M-1), B0..B(M-1)). 1F1B
# runs w = min(M, N - s) forwards, then alternates one backward and one forward while forwards
# are left, then the remaining backwards (``actions``). A stage therefore holds at most
# ``in_flight`` micro-batches between their forward and backward: M under GPipe, min(N - s, M)
# under 1F1B.
# Rule 3. One micro-batch. The stage's graph is one micro-batch through the stage's modules
# (profiled as its own module: input = the received activation, or the micro-batch's tokens on
# the first stage; "loss" = the received gradient fed to the stage's output, or the real loss on
# the last stage). Its probes (NOTE [ Peak-memory model ]) are the running micro-batch's peak
# with this stage's parameters, optimizer state and gradients (NOTE [ Per-rank memory ] is not
# applied on top: one replica per stage).
# Rule 4. Held per micro-batch in flight, H(C): every tensor the stage holds for its backward
# under the checkpoint set C (the held tensors of Rule 3 of the peak model, autocast's casts
# included), plus the stage's output (the schedule keeps it in ``fwd_cache`` for the backward;
# on the last stage the logits the loss is computed from). A probe of micro-batch j adds H(C)
# for every other micro-batch in flight at that action. The running micro-batch's own output is
# alive through its backward too (the graph's step drops it after the loss): backward probes add
# it. Under 1F1B the schedule's ``output`` variable keeps the previous micro-batch's output until
# the next forward returns: a forward that follows a backward adds it.
# Rule 5. Gradients. Before the stage's first backward the probes are those of the graph (no
# gradients in forward, gradients appearing through the first backward). After it every
# parameter gradient is alive (accumulated over micro-batches): forward and backward probes
# count all of them.
# Rule 6. Buffers, allocated at the first step and kept: M receive buffers of one micro-batch's
# input activation on every stage but the first (the graph's batch is one of them), and M
# receive buffers of the output's gradient on every stage but the last. The first stage holds
# the whole replica batch of tokens (its micro-batches are views of it; the graph counts one),
# the last the whole batch of labels.
# Rule 7. Input gradients: every stage but the first makes the gradient of each received
# activation in its backward (in the graph: the stage is profiled with an input that requires
# grad), sends it and drops it (torch sets the buffer's ``.grad`` to None); a send not yet waited
# for keeps it. GPipe waits for its backward sends after the last backward: a backward counts
# the input gradients of every earlier one. 1F1B waits for each before the next forward, and in
# the cooldown (backwards with no forward left) after the next backward; and its send list
# (``bwd_sends``) keeps the last input gradient until the next backward replaces it: every
# backward but the first, and a forward that follows a backward, count one (measured: without
# it the last stage of examples/llama_pp.py at pp 2 was 129,072 bytes, one activation, low).
# Rule 8. The stage's peak is the largest over its actions (Rule 2) of the action's probes plus
# Rules 4-7, and the optimizer step's probe plus the buffers (Rule 6).
# Rule 9. Planning a stage: the checkpoint set must keep Rule 8's peak within the budget. The
# solvers minimise recompute under a graph's peak, which for one micro-batch can be blind to what
# the schedule multiplies (Llama-405B's first stage peaks at its optimizer step with one
# micro-batch, where no checkpoint helps, and at 16 micro-batches in flight with 16). So a stage is
# solved on a copy of its graph in which every tensor a micro-batch can hold (saved for backward,
# or kept as a checkpointed unit's input) counts ``in_flight`` times (``solving_graph``): its end
# of forward is what the schedule's busiest point holds. ``plan_stage`` searches that copy's budget
# for the largest whose plan keeps Rule 8's peak (on the true graph) within the budget: the
# fewest recompute among the budgets tried, optimal for the copy, not proven optimal for the
# stage; the most checkpointing it reaches is the lower-peaked of the copy's plan at the copy's lowest
# budget and every repeated block of the stage (on Llama-3-405B, tp 8, the copy's plan left stage 0 at
# 97 GiB where every layer checkpointed is far lower). Then it drops, costliest first, every checkpoint Rule 8's peak does not need (``_prune``):
# the copy counts every held tensor ``in_flight`` times at every point, more than Rule 8 does, and
# its plan can checkpoint more than the stage needs. A checkpoint set is its stage's alone (a module
# lives on one stage).
# Rule 10. Data-parallel stages: each stage runs on D ranks (``pp_dp``; the world is pp x tp x D), every
# one with its own replica batch (the model file's), so Rules 1-9 hold per rank; only the static memory
# changes, as torch.distributed.pipelining drives the wrapper (``backward_maybe_with_nosync`` and
# ``perform_reduce_grad`` of torch 2.13's stage.py). The graph's static memory is one process's.
#   ddp: DDP's buckets (one flat copy of the gradients, from construction; NOTE [ Per-rank memory ],
#   Rule 1) at every point; the micro-batches' backwards run under ``no_sync`` but the last.
#   fsdp: FSDP2 on every repeated block and on the stage's root, defaults. Parameters and optimizer state
#   are held as 1/D shards. Every backward runs with ``set_requires_gradient_sync(False)`` and
#   ``set_reshard_after_backward(False)``: gradients accumulate unsharded, at full size (the graph's
#   gradients, Rule 5 unchanged), and a block's parameters stay unsharded after its backward until its
#   next forward reshards them; the reduce-scatter runs once, after the last backward, and the
#   optimizer step sees shards of everything. Unsharded parameters U at a point (R the root group's,
#   B_i block i's, block k running; ``_unsharded_bytes``): forward, R + B + B (the largest block and
#   its all-gather output, NOTE [ Per-rank memory ], Rule 2), but after a backward (1F1B's steady state)
#   the blocks from k on, still unsharded, and no all-gather; backward, R + the blocks from k - 1 on
#   (k - 1 prefetched; before the blocks every block; after them the last, which the root prefetches when
#   the gradient reaches the stage's output, so not yet in the last stage's loss, which the schedule's
#   ``loss_fn`` computes outside the stage: +4.1% on the last stage of pp 2 x dp 2 before this was seen),
#   but every block after a backward that no forward followed (GPipe's later backwards, 1F1B's
#   cooldown). Not probed: the reduce-scatter after the last backward (activations are gone by then).


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the repeated blocks of each stage (Rule 1)."""
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append((start, start + n))
        start += n
    return out


def in_flight(schedule: str, num_stages: int, stage: int, micro_batches: int) -> int:
    """Micro-batches stage ``stage`` holds at most between their forward and backward (Rule 2)."""
    return micro_batches if schedule == "gpipe" else min(num_stages - stage, micro_batches)


def order_in_flight(order: Iterable[tuple[str, int, int]], stage: int) -> int:
    """The most micro-batches stage ``stage`` holds between forward and backward along a rank's ``order``
    of ('F' or 'B', stage, micro-batch) (interleaved-1f1b: NOTE [ Interleaved stages ], Rule 2)."""
    held = most = 0
    for kind, s, _ in order:
        if s == stage:
            held += 1 if kind == "F" else -1
            most = max(most, held)
    return max(most, 1)


def actions(schedule: str, num_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """The stage's forwards ('F', j) and backwards ('B', j) in the order it runs them (Rule 2)."""
    m = micro_batches
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    warm = min(m, num_stages - stage)
    out = [("F", j) for j in range(warm)]
    f, b = warm, 0
    while True:
        out.append(("B", b))
        b += 1
        if f == m:
            break
        out.append(("F", f))
        f += 1
    out += [("B", j) for j in range(b, m)]
    return out


@dataclass(frozen=True)
class StagePeak:
    """Rule 8's peak of one stage for one checkpoint set, with its breakdown."""

    peak_bytes: int
    peak_at: str  # e.g. 'backward of model.layers.1, micro-batch 0, 1 more in flight'
    held_bytes: int  # H(C): one micro-batch in flight (Rule 4)
    in_flight: int
    buffers_bytes: int  # Rule 6, beyond the graph's own batch
    params_bytes: int
    grads_bytes: int  # gradients alive at the peak
    optimizer_bytes: int


def held_bytes(g: nx.DiGraph, checkpointed: Iterable[str], selective: Mapping[str, int] | None = None) -> int:
    """H(C) of Rule 4: what one micro-batch in flight holds on the stage."""
    model = CostModel.of(g)
    regions = check_checkpoint_set(g, checkpointed, selective)
    pos = model.holdings(regions, policies_of(g, selective))
    held = sum(model.tensor_bytes[t] for t in pos)
    held += sum(model.tensor_bytes[t] for _, t in model.casts if t not in pos)
    return held + g.graph["pp_output_bytes"]


def buffers_bytes(g: nx.DiGraph) -> int:
    """Rule 6: the receive buffers and the rest of the replica's batch, beyond the graph's batch."""
    gg = g.graph
    m = gg["pp_micro_batches"]
    return (m - 1) * gg["pp_recv_bytes"] + m * gg["pp_send_bytes"] + gg["pp_batch_bytes"]


def stage_peak(g: nx.DiGraph, checkpointed: Iterable[str], selective: Mapping[str, int] | None = None) -> StagePeak:
    """Rule 8: the stage's peak under its schedule for checkpoint set ``checkpointed``."""
    gg = g.graph
    n, s, m, sched = gg["pp_stages"], gg["pp_stage"], gg["pp_micro_batches"], gg["pp_schedule"]
    model = CostModel.of(g)
    regions = check_checkpoint_set(g, checkpointed, selective)
    probes = list(model.probes(regions, policies_of(g, selective)))
    fwd = [p for p in probes if p[0].startswith("forward of ") or p[0] == "end of forward"]
    bwd = [p for p in probes if p[0].startswith(("backward of ", "recompute of ")) or p[0] == "start of backward"]
    opt = next(p for p in probes if p[0] == "optimizer step")
    all_grads = gg["grads_bytes"]
    held = held_bytes(g, checkpointed, selective)
    buffers = buffers_bytes(g)
    recv, out = gg["pp_recv_bytes"], gg["pp_output_bytes"]
    dp = _DataParallel.of(g)
    best = (opt[1] + buffers + dp.optimizer_step_bytes, "optimizer step", opt[2] + dp.step_grads_bytes, 0)
    f_done = b_done = 0
    last = None
    for kind, j in actions(sched, n, s, m):
        if kind == "F":
            others = f_done - b_done
            extra = out + recv if sched == "1f1b" and last == "B" else 0  # Rules 4 and 7: the previous B's
        else:
            others = f_done - b_done - 1
            pending = b_done if sched == "gpipe" else min(b_done, 1)  # Rule 7
            extra = out + pending * recv  # Rule 4: its own output
        for name, total, grads, _extra in (fwd if kind == "F" else bwd):
            if b_done:  # Rule 5: every gradient alive after the first backward
                total, grads = total + all_grads - grads, all_grads
            unsharded = dp.unsharded_bytes(name, kind, after_backward=last == "B")  # Rule 10
            total += others * held + buffers + extra + dp.static_bytes + unsharded
            if total > best[0]:
                best = (total, f"{name}, micro-batch {j}, {others} more in flight", grads + dp.buckets_bytes,
                        unsharded)
        f_done += kind == "F"
        b_done += kind == "B"
        last = kind
    return StagePeak(peak_bytes=best[0], peak_at=best[1], held_bytes=held, in_flight=in_flight(sched, n, s, m),
                     buffers_bytes=buffers, params_bytes=model.rank.params_bytes + dp.params_delta + best[3],
                     grads_bytes=best[2], optimizer_bytes=model.rank.optimizer_bytes + dp.optimizer_delta)


@dataclass(frozen=True)
class _DataParallel:
    """Rule 10's terms for a stage's D data-parallel ranks (``pp_dp``, ``pp_dp_sharding``)."""

    graph: nx.DiGraph
    sharding: str
    ranks: int
    params_delta: int = 0  # the rank's parameters less the graph's (fsdp: shards)
    optimizer_delta: int = 0
    buckets_bytes: int = 0  # ddp

    @staticmethod
    def of(g: nx.DiGraph) -> _DataParallel:
        gg = g.graph
        d, sharding = gg.get("pp_dp", 1), gg.get("pp_dp_sharding", "none")
        if sharding == "ddp":
            return _DataParallel(g, sharding, d, buckets_bytes=gg["grads_bytes"])
        if sharding != "fsdp":
            return _DataParallel(g, sharding, d)
        p, o = gg["params_bytes"], gg["optimizer_bytes"]
        return _DataParallel(g, sharding, d, -(-p // d) - p, -(-o // d) - o)

    @property
    def static_bytes(self) -> int:
        """Added at every point of forward and backward."""
        return self.params_delta + self.optimizer_delta + self.buckets_bytes

    @property
    def optimizer_step_bytes(self) -> int:
        """Added at the optimizer step: fsdp steps on shards of the gradients and of its temporaries."""
        if self.sharding != "fsdp":
            return self.buckets_bytes
        gg, d = self.graph.graph, self.ranks
        g_, tr = gg["grads_bytes"], gg["optimizer_step_transient_bytes"]
        return self.params_delta + self.optimizer_delta + (-(-g_ // d) - g_) + (-(-tr // d) - tr)

    @property
    def step_grads_bytes(self) -> int:
        """The gradients' change at the optimizer step (fsdp: shards; ddp: its buckets)."""
        g_ = self.graph.graph["grads_bytes"]
        return -(-g_ // self.ranks) - g_ if self.sharding == "fsdp" else self.buckets_bytes

    def unsharded_bytes(self, probe: str, kind: str, *, after_backward: bool) -> int:
        """fsdp: the unsharded parameters U at probe ``probe`` of a forward ('F') or backward ('B') that
        follows a backward or not (Rule 10)."""
        if self.sharding != "fsdp":
            return 0
        gg = self.graph.graph
        root, sizes = gg["fsdp_root_param_bytes"], [b for _, _, b in gg["fsdp_blocks"]]
        k = self._block_of(probe)
        if kind == "F":
            if after_backward:
                return root + sum(sizes[max(k, 0):])
            big = max(sizes, default=0)
            return root + big + (big if self.ranks > 1 else 0)
        if after_backward or k < 0:
            return root + sum(sizes)
        if probe == "start of backward" and gg["pp_stage"] == gg["pp_stages"] - 1:
            return root  # the loss runs outside the stage: the root's pre-backward prefetch comes after it
        if k >= len(sizes):
            return root + (sizes[-1] if sizes else 0)
        return root + sum(sizes[max(k - (1 if self.ranks > 1 else 0), 0):])

    def _block_of(self, probe: str) -> int:
        """The index of the block probe ``probe`` runs in; -1 before every block, len(blocks) after them."""
        blocks = self.graph.graph["fsdp_blocks"]
        unit = probe.split(" of ", 1)[1] if probe.startswith(("forward of ", "backward of ", "recompute of ")) else None
        if unit is None or unit not in self.graph:
            return len(blocks)  # end of forward, start of backward
        seq = self.graph.nodes[unit]["fwd_end_seq"]
        for k, (lo, hi, _) in enumerate(blocks):
            if lo <= seq <= hi:
                return k
        return -1 if blocks and seq < blocks[0][0] else len(blocks)


Solve = Callable[[nx.DiGraph, int], "tuple[list[str], dict[str, int]] | None"]
"""A solver on a graph at a budget: ``(checkpointed, selective)`` minimising recompute with the
graph's peak within it, or None when nothing fits it."""


def solving_graph(g: nx.DiGraph) -> nx.DiGraph:
    """The copy of stage graph ``g`` the solvers plan on (Rule 9): held-able tensors count
    ``in_flight`` times."""
    gg = g.graph
    k = order_in_flight(gg["pp_rank_order"], gg["pp_stage"]) if "pp_rank_order" in gg else \
        in_flight(gg["pp_schedule"], gg["pp_stages"], gg["pp_stage"], gg["pp_micro_batches"])
    if k == 1:
        return g
    held = {t for _, t in gg["saves"]}
    for _, a in g.nodes(data=True):
        held |= set(a["input_ids"])
    out = g.copy()
    out.graph["tensor_bytes"] = {t: b * k if t in held else b for t, b in gg["tensor_bytes"].items()}
    out.graph["cost_model"] = CostModel.build(out)
    return out


@dataclass(frozen=True)
class StagePlanResult:
    """Rule 9's answer for one stage."""

    chosen: tuple[list[str], dict[str, int]] | None  # None: nothing found fits
    lowest_peak_bytes: int  # the stage peak of the most checkpointing the search reaches


def plan_stage(g: nx.DiGraph, usable_bytes: int, solve: Solve) -> StagePlanResult:
    """Rule 9: the plan, on ``solving_graph(g)``, of the largest budget whose stage peak (Rule 8, on
    ``g``) fits ``usable_bytes``."""
    from solvers.cost_model import simulate
    from solvers.dp import min_feasible_bytes

    gs = solving_graph(g)
    lowest, highest = min_feasible_bytes(gs), simulate(gs, []).peak_bytes
    blocks = ([u for u in g.graph.get("fsdp_units", ()) if u in g], {})  # every repeated block of the stage
    most = min((solve(gs, lowest) or ([], {}), blocks), key=lambda c: stage_peak(g, *c).peak_bytes)
    lowest_peak = stage_peak(g, *most).peak_bytes
    if stage_peak(g, []).peak_bytes <= usable_bytes:
        return StagePlanResult(([], {}), lowest_peak)
    if lowest_peak > usable_bytes:
        return StagePlanResult(None, lowest_peak)
    best, lo, hi = most, lowest, highest  # the plan at lo fits
    while hi - lo > max(1, highest // 100_000):
        mid = (lo + hi) // 2
        sol = solve(gs, mid)
        if sol is not None and stage_peak(g, *sol).peak_bytes <= usable_bytes:
            lo, best = mid, sol
        else:
            hi = mid
    return StagePlanResult(_prune(g, best, usable_bytes), lowest_peak)


def _prune(g: nx.DiGraph, chosen: tuple[list[str], dict[str, int]], usable_bytes: int) -> tuple[list[str], dict[str, int]]:
    """Rule 9's last pass: drop every checkpoint the stage peak does not need, the costliest first (the copy's
    plan can checkpoint more than the stage needs)."""
    kept, selective = list(chosen[0]), chosen[1]
    for unit in sorted(kept, key=lambda n: (-g.nodes[n]["forward_ms"], g.nodes[n]["order"])):
        fewer = [n for n in kept if n != unit]
        if stage_peak(g, fewer, {k: v for k, v in selective.items() if k in fewer}).peak_bytes <= usable_bytes:
            kept = fewer
    return kept, {k: v for k, v in selective.items() if k in kept}


__all__ = ["SCHEDULES", "Schedule", "StagePeak", "actions", "buffers_bytes", "held_bytes", "in_flight", "order_in_flight",
           "StagePlanResult", "plan_stage", "solving_graph", "split_layers", "stage_peak"]
