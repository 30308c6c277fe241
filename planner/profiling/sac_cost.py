"""What torch's selective checkpointing costs per op call, beyond the recomputed kernels.

Example::

    cost = measure_sac_cost(model, inputs, prof, loss_fn=loss_fn, amp=None, dev=dev, clock=clock)
    prof = with_sac_cost(prof, cost)
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.model.schema import LOSS_ID, ROOT_ID, Profile
from planner.profiling.timing import spread_ms

SAC_ROUNDS = 3
"""Interleaved rounds of the four steps; each keeps its least time (noise only raises times), and
the per-round differences give the spread (Rule 4)."""


class SacCost(NamedTuple):
    """What selective checkpointing adds per op call of a region, beyond recomputed kernels, and the
    spread of each figure over the rounds (NOTE [ Selective dispatch cost ], Rule 4)."""

    recomputed_op_ms: float
    kept_op_ms: float
    recomputed_op_spread_ms: float = 0.0
    kept_op_spread_ms: float = 0.0


# NOTE [ Selective dispatch cost ]
#
# Rule 1. A selective region runs its forward under torch's caching dispatch mode and its
# replay under the cached mode (``create_selective_checkpoint_contexts``): every op call of
# the unit passes through Python twice, whatever the policy keeps. On one CPU thread that is
# tens of microseconds per call, per call kept more than per call recomputed, as much as the
# kernels of a small model's ops (figures in docs/benchmarks.md, "What selective
# checkpointing costs per op call"). A menu that priced only the recomputed kernels would
# under-price every policy by that much.
#
# Rule 2. So the profiler measures it on the model it profiles (``measure_sac_cost``), on the
# same device and threads, in interleaved rounds (least times): the step as it is (t), with the
# top-level candidates (N op calls) fully checkpointed (t_full), and under selective
# checkpointing that recomputes every op (t_r) and that keeps every op (t_k). A policy costs
#     forward_ms * (recomputed kernel time / kernel time) + n_recomputed * r + n_kept * k
# with r = (t_r - t_full) / N and k = (t_k - t) / N: the two ends of every menu are priced as
# measured, the recompute-everything end relative to full checkpointing, which the cost model
# prices at forward_ms. A chain of small ops would be cheaper to time, but it under-states the
# cost of a model's own ops several times over: the cost depends on the ops, so it is measured
# on them. ``Profile.sac_recomputed_op_ms`` and ``Profile.sac_kept_op_ms`` record it (NOTE
# [ Selective menus ] in solvers/selective.py). Each is a difference of two step times over N,
# so on a model whose steps take seconds it is within their noise (it may read 0).
#
# Rule 4. Each figure carries its spread: the interquartile range of its per-round estimates
# ((t_r - t_full) / N of each round; ``Profile.sac_recomputed_op_spread_ms``,
# ``sac_kept_op_spread_ms``). A figure within its spread of 0 is noted in the profile
# (``with_sac_cost``), and a policy enters a menu only when it saves more than the spread of its
# price (NOTE [ Selective menus ], Rule (noise)). Above one CPU thread the rounds run at one
# thread on the profile's scaled clock, like every other figure (NOTE [ Unit costs ], Rule 1b).
#
# Rule 3. On CUDA the Python work overlaps the kernels of earlier ops as long as the GPU is
# busy: the profile's CUDA-event clock sees only what is not hidden. Meta profiles (no device
# to run on) and profiles without op records leave it at 0.

def measure_sac_cost(model: nn.Module, inputs: Any, prof: Profile, *, loss_fn: Callable[[Any], Any] | None,
                     amp: str | None, dev: torch.device, clock: Any, rounds: int = SAC_ROUNDS) -> SacCost:
    """The two per-op figures of NOTE [ Selective dispatch cost ], Rule 2, measured on ``model``."""
    from planner.model.graph import build_graph
    from planner.profiling.measure import make_step
    from planner.profiling.profiler import restoring_model

    g = build_graph(prof, selective=False)  # the candidates validate checkpoints, excluded ones left out
    calls = Counter(u.fqn for u in prof.units)
    modules = dict(model.named_modules())
    top = [a for n, a in g.nodes(data=True) if a["parent"] is None and n not in (ROOT_ID, LOSS_ID)
           and calls[a["fqn"]] == 1 and "forward" not in modules[a["fqn"]].__dict__]  # another wrapper: leave it
    seqs = sorted(o.seq for o in prof.ops)
    n_ops = sum(bisect.bisect_right(seqs, a["fwd_end_seq"]) - bisect.bisect_left(seqs, a["fwd_start_seq"])
                for a in top)
    if not top or n_ops == 0:
        return SacCost(0.0, 0.0)
    # one micro-batch: the figures are per op call, and simulate counts a policy once per micro-batch
    step = make_step(model, inputs, loss_fn=loss_fn, optimizer=None, amp=amp)
    ms: dict[Any, list[float]] = {policy: [] for policy in
                                  (None, "full", CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE)}
    with restoring_model(model, dev):
        for _ in range(rounds):
            for policy, times in ms.items():
                with _selective_regions([modules[a["fqn"]] for a in top], policy):
                    model.zero_grad(set_to_none=True)
                    clock.sync()
                    t0 = clock.stamp()
                    step()
                    t1 = clock.stamp()
                    clock.sync()
                times.append(clock.ms(t0, t1))

    def per_op(policy: Any, base: Any) -> tuple[float, float]:
        rounds_ms = [(a - b) / n_ops for a, b in zip(ms[policy], ms[base])]
        return max(0.0, (min(ms[policy]) - min(ms[base])) / n_ops), spread_ms(rounds_ms)

    (r, r_spread), (k, k_spread) = per_op(CheckpointPolicy.PREFER_RECOMPUTE, "full"), per_op(CheckpointPolicy.MUST_SAVE, None)
    return SacCost(r, k, r_spread, k_spread)


def with_sac_cost(prof: Profile, cost: SacCost) -> Profile:
    """``prof`` with the figures of ``cost``, and a note for each that is within its spread of 0
    (Rule 4)."""
    notes = list(prof.notes)
    for what, ms, spread in (("recomputed", cost.recomputed_op_ms, cost.recomputed_op_spread_ms),
                             ("kept", cost.kept_op_ms, cost.kept_op_spread_ms)):
        if ms <= spread:
            notes.append(f"selective checkpointing's dispatch per {what} op call, {ms * 1e3:.1f} us, is within its "
                         f"spread over the rounds ({spread * 1e3:.1f} us) of 0: op-level policies are priced "
                         f"with it as measured, and a policy enters a menu only when it saves more than its spread")
    return prof.model_copy(update={"sac_recomputed_op_ms": cost.recomputed_op_ms, "sac_kept_op_ms": cost.kept_op_ms,
                                   "sac_recomputed_op_spread_ms": cost.recomputed_op_spread_ms,
                                   "sac_kept_op_spread_ms": cost.kept_op_spread_ms, "notes": notes})


@contextlib.contextmanager
def _selective_regions(modules: list[nn.Module], policy: CheckpointPolicy | str | None) -> Iterator[None]:
    """``modules`` under selective checkpointing with every op call given ``policy`` (None: as they
    are; "full": full checkpointing)."""
    if policy is None:
        yield
        return

    def each_op(_ctx: Any, _func: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        return policy

    # keeping every op output keeps some that the forward writes in place later: allowed here
    contexts = None if policy == "full" else functools.partial(
        create_selective_checkpoint_contexts, each_op, allow_cache_entry_mutation=True)
    for m in modules:
        inner = type(m).forward.__get__(m, type(m))
        m.forward = functools.partial(_region, inner, contexts)
    try:
        yield
    finally:
        for m in modules:
            del m.forward


def _region(inner: Callable[..., Any], contexts: Callable[[], Any] | None, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)
    extra = {} if contexts is None else {"context_fn": contexts}
    return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)


__all__ = ["measure_sac_cost", "SAC_ROUNDS", "SacCost", "with_sac_cost"]
