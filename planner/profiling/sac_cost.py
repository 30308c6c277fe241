"""What torch's selective checkpointing costs per op call, beyond the recomputed kernels.

Example::

    cost = measure_sac_cost(model, inputs, prof, loss_fn=loss_fn, amp=None, dev=dev, clock=clock)
    prof = with_sac_cost(prof, cost)
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from planner.model.schema import LOSS_ID, ROOT_ID, Profile
from planner.profiling.timing import ScaledCpuClock, ThreadCpuClock, spread_ms

SAC_ROUNDS = 27
"""Interleaved rounds of the four region runs (NOTE [ Selective dispatch cost ], Rules 2 and 4): each
figure is the median of its per-round differences, their interquartile range its spread."""

SAC_MIN_ROUNDS = 9
"""Rounds run whatever they cost; more run, up to ``SAC_ROUNDS``, while they fit ``SAC_CPU_SECONDS`` (Rule 4)."""

SAC_CPU_SECONDS = 10.0
"""CPU seconds of the calling thread the rounds may take, judged by the first (unrecorded) round: CPU
time, so that how many rounds run does not depend on the machine's other load (Rule 4)."""


class SacCost(NamedTuple):
    """What selective checkpointing adds per op call of a region, beyond recomputed kernels, and the
    spread of each figure over the rounds (NOTE [ Selective dispatch cost ], Rule 4)."""

    recomputed_op_ms: float
    kept_op_ms: float
    recomputed_op_spread_ms: float = 0.0
    kept_op_spread_ms: float = 0.0
    rounds: int = 0


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
# same device and threads: the regions themselves, not the step. One top-level candidate per
# cost group (identical units cost the same, NOTE [ Unit costs ], Rule 3) runs its forward and
# backward alone, on the inputs it got in a plain step, in interleaved rounds: as it is (t),
# fully checkpointed (t_full), under selective checkpointing that recomputes every op (t_r)
# and that keeps every op (t_k); N is their op calls. A policy costs
#     forward_ms * (recomputed kernel time / kernel time) + n_recomputed * r + n_kept * k
# with r = (t_r - t_full) / N and k = (t_k - t) / N, each the median over the rounds of that
# round's difference (Rule 4): the two ends of every menu are priced as
# measured, the recompute-everything end relative to full checkpointing, which the cost model
# prices at forward_ms. A chain of small ops would be cheaper to time, but it under-states the
# cost of a model's own ops several times over: the cost depends on the ops, so it is measured
# on them. ``Profile.sac_recomputed_op_ms`` and ``Profile.sac_kept_op_ms`` record it (NOTE
# [ Selective menus ] in solvers/selective.py).
# Why the regions alone: the figures were differences of whole step times over N, and a step
# holds the embedding, the head, the loss and every other unit, whose noise is not the
# regions'; on examples/llama.py at load 13 they read r = 90 us with a spread of 45 us and
# k = 206 us with a spread of 137 us over 3 rounds, so menus and the op-level-or-whole choice
# moved between runs (docs/benchmarks.md, "Same plan every time"). One region per cost group
# costs a fraction of a step, so three times the rounds cost less than the steps did; regions
# of under a tenth of the largest one's op calls (an embedding, a head: few ops, heavy kernels)
# are left out, their noise would outweigh their calls. A model
# whose regions cannot run alone on their recorded inputs (a forward that fails on them) is
# timed by whole steps, as before (``_step_runs``). The inputs are recorded as the caller passes
# them, before the region's own pre-hooks (``_recorded_inputs``), since running it alone calls it
# and runs them again: recorded after them, a sequence-parallel layer's cut (a pre-hook) cut its
# input twice, the region failed alone, and each such profile fell back to whole steps
# (examples/llama.py's sequence-parallel rank at one thread: 41.6 s, 12.0 s since).
#
# Rule 4. Each figure is the median of its per-round estimates ((t_r - t_full) / N of each
# round: the two runs of a pair are a moment apart, so a change of the machine's load between
# rounds cancels) and carries their interquartile range as its spread
# (``Profile.sac_recomputed_op_spread_ms``, ``sac_kept_op_spread_ms``). The figure is a few
# per cent of the region's time, so it needs rounds: on examples/gpt2.py (one thread, load
# 1.2 to 1.8, four measurements each) 9 rounds gave r from 25 to 193 us and k from 55 to 207 us
# by the median, from 31 to 133 us and 80 to 132 us by the difference of least times (what was
# used before), and 27 rounds gave r from 61 to 83 us and k from 113 to 133 us by the median
# (docs/benchmarks.md, "Same plan every time"). So up to ``SAC_ROUNDS`` rounds, at least
# ``SAC_MIN_ROUNDS``, as many as fit ``SAC_CPU_SECONDS`` of CPU time at the first round's cost
# (CPU time: the machine's other load does not change how many run). A figure within its
# spread of 0 is noted in the profile (``with_sac_cost``), and a policy enters a menu only when
# it saves more than the spread of its price (NOTE [ Selective menus ], Rule (noise)).
# The spread over the rounds is how far one round's figure strays; the prices use the median,
# which strays less: their spread is the median's (``solvers.selective.spread_of_median``: the
# interquartile range over the rounds times 1.2533 / sqrt(rounds), the large-sample range of a
# median), and the profile records the rounds (``Profile.sac_rounds``). Taken as they were, the
# spreads over the rounds (9 to 236 us on thirty profiles under a burner, 13x between two of
# one model) times the dozens of op calls a block pays them on made the choice between
# op-level and whole layers a matter of which profile it was: GPT-2's op-level plan was predicted
# 33 to 41 ms cheaper than whole blocks in all fifteen profiles, and sent to whole blocks in
# one, where that spread read 50 ms (docs/benchmarks.md, "Same plan every time").
#
# Rule 5 (threads). Above one CPU thread the rounds run at one thread, like every other figure
# (NOTE [ Unit costs ], Rule 1b), but the figures are the thread's CPU time unscaled: r and k are
# Python (the dispatch modes' per-call work, the replayed module code), which runs on the calling
# thread however many intra-op threads the kernels get, so the forward's thread factor (0.57 on
# Qwen2 at 2 threads) does not apply to them. Scaled by it, Qwen2's op-level plans at 2 threads
# were predicted at 38, 22 and 11 ms and measured at 64, 49 and 27 ms (docs/benchmarks.md,
# "Predicted recompute vs measured overhead").
#
# Rule 3. On CUDA the Python work overlaps the kernels of earlier ops as long as the GPU is
# busy: the profile's CUDA-event clock sees only what is not hidden. Meta profiles (no device
# to run on) and profiles without op records leave it at 0.

_POLICIES = (None, "full", CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE)
"""As it is, full checkpointing, recompute every op, keep every op (Rule 2)."""


def measure_sac_cost(model: nn.Module, inputs: Any, prof: Profile, *, loss_fn: Callable[[Any], Any] | None,
                     amp: str | None, dev: torch.device, clock: Any, rounds: int = SAC_ROUNDS) -> SacCost:
    """The two per-op figures of NOTE [ Selective dispatch cost ], Rule 2, measured on ``model``."""
    from planner.profiling.measure import make_step
    from planner.profiling.profiler import restoring_model

    regions = _regions(prof, model)
    n_ops = sum(n for _, n in regions)
    if not regions or n_ops == 0:
        return SacCost(0.0, 0.0)
    modules = dict(model.named_modules())
    mods = [modules[fqn] for fqn, _ in regions]
    clock = _python_clock(clock)
    # one micro-batch: the figures are per op call, and simulate counts a policy once per micro-batch
    step = make_step(model, inputs, loss_fn=loss_fn, optimizer=None, amp=amp)
    with restoring_model(model, dev):
        try:
            ms = _region_runs(step, mods, amp, dev, clock, rounds)
        except Exception:  # noqa: BLE001 - a region that cannot run alone: whole steps (Rule 2)
            model.zero_grad(set_to_none=True)
            ms = _step_runs(step, model, mods, clock, rounds)
    return _figures(ms, n_ops)


def _python_clock(clock: Any) -> Any:
    """``clock``, or the unscaled thread CPU clock for a ``ScaledCpuClock`` (Rule 5)."""
    return ThreadCpuClock() if isinstance(getattr(clock, "clock", clock), ScaledCpuClock) else clock


def _figures(ms: dict[Any, list[list[float]]], n_ops: int) -> SacCost:
    """r and k (Rule 2) from each policy's run times (per round, per region), with their spreads."""
    def per_op(policy: Any, base: Any) -> tuple[float, float]:
        rounds_ms = [(sum(a) - sum(b)) / n_ops for a, b in zip(ms[policy], ms[base])]
        return max(0.0, statistics.median(rounds_ms)), spread_ms(rounds_ms)

    (r, r_spread), (k, k_spread) = per_op(CheckpointPolicy.PREFER_RECOMPUTE, "full"), per_op(CheckpointPolicy.MUST_SAVE, None)
    return SacCost(r, k, r_spread, k_spread, rounds=len(ms[None]))


def _regions(prof: Profile, model: nn.Module) -> list[tuple[str, int]]:
    """(fqn, op calls) of one top-level candidate per cost group (Rule 2): candidates called once, not
    wrapped by something else, with at least ``_REGION_SHARE`` of the largest one's op calls."""
    from planner.model.graph import build_graph

    g = build_graph(prof, selective=False)  # the candidates validate checkpoints, excluded ones left out
    calls = Counter(u.fqn for u in prof.units)
    group = {u.fqn: u.cost_group for u in prof.units}
    modules = dict(model.named_modules())
    seqs = sorted(o.seq for o in prof.ops)
    out: dict[str, tuple[str, int]] = {}
    for n, a in g.nodes(data=True):
        if (a["parent"] is None and n not in (ROOT_ID, LOSS_ID) and calls[a["fqn"]] == 1
                and "forward" not in modules[a["fqn"]].__dict__):  # another wrapper: leave it
            ops = bisect.bisect_right(seqs, a["fwd_end_seq"]) - bisect.bisect_left(seqs, a["fwd_start_seq"])
            out.setdefault(group.get(a["fqn"]) or a["fqn"], (a["fqn"], ops))
    most = max((ops for _, ops in out.values()), default=0)
    return [(fqn, ops) for fqn, ops in out.values() if ops > 0 and ops >= _REGION_SHARE * most]


_REGION_SHARE = 0.1
"""Regions with fewer op calls than this share of the largest one's are not timed (Rule 2): an
embedding or a head of a few ops adds its kernels' noise to the sums and almost no op calls."""


def _region_runs(step: Callable[[], None], mods: list[nn.Module], amp: str | None, dev: torch.device, clock: Any,
                 rounds: int) -> dict[Any, list[list[float]]]:
    """Each policy's forward-and-backward ms of each region alone, per round (after one round unrecorded)."""
    from planner.profiling.measure import AMP_DTYPES

    calls = _recorded_inputs(step, mods)
    amp_dtype = AMP_DTYPES[amp] if amp else None
    ms: dict[Any, list[list[float]]] = {policy: [] for policy in _POLICIES}
    start = time.thread_time()
    for i in range(rounds + 1):
        if i == 1:  # Rule 4: as many rounds as fit the CPU seconds, at least SAC_MIN_ROUNDS
            each_s = max(time.thread_time() - start, 1e-9)
            rounds = min(rounds, max(SAC_MIN_ROUNDS, int(SAC_CPU_SECONDS / each_s)))
        if i > rounds:
            break
        for policy, runs in ms.items():
            with _selective_regions(mods, policy):
                row = [_region_ms(m, call, clock, dev, amp_dtype) for m, call in zip(mods, calls)]
            if i:
                runs.append(row)
    return ms


def _recorded_inputs(step: Callable[[], None], mods: list[nn.Module]) -> list[tuple[tuple, dict]]:
    """The (args, kwargs) each of ``mods`` is called with in one plain step, detached: before its pre-hooks (Rule 2)."""
    seen: dict[int, tuple[tuple, dict]] = {}

    def grab(m: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault(id(m), pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), (args, kwargs)))

    handles = [m.register_forward_pre_hook(grab, with_kwargs=True, prepend=True) for m in mods]
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return [seen[id(m)] for m in mods]


def _region_ms(m: nn.Module, call: tuple[tuple, dict], clock: Any, dev: torch.device,
               amp_dtype: torch.dtype | None) -> float:
    """One forward and backward of ``m`` alone on fresh copies of its recorded inputs."""
    from planner.profiling.units import io_tensors

    m.zero_grad(set_to_none=True)
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.clone() if t.is_floating_point() else t, call)
    autocast = torch.autocast(dev.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    clock.sync()
    t0 = clock.stamp()
    with autocast:
        out = m(*args, **kwargs)
    outs = [t for t in io_tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    t1 = clock.stamp()
    clock.sync()
    return clock.ms(t0, t1)


def _step_runs(step: Callable[[], None], model: nn.Module, mods: list[nn.Module], clock: Any,
               rounds: int) -> dict[Any, list[list[float]]]:
    """Each policy's whole-step ms per round, every candidate region under it (Rule 2's fallback)."""
    ms: dict[Any, list[list[float]]] = {policy: [] for policy in _POLICIES}
    for _ in range(rounds):
        for policy, runs in ms.items():
            with _selective_regions(mods, policy):
                model.zero_grad(set_to_none=True)
                clock.sync()
                t0 = clock.stamp()
                step()
                t1 = clock.stamp()
                clock.sync()
            runs.append([clock.ms(t0, t1)])
    return ms


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
                                   "sac_kept_op_spread_ms": cost.kept_op_spread_ms, "sac_rounds": cost.rounds,
                                   "notes": notes})


# NOTE [ Inference-mode ops under selective checkpointing ]
#
# A block may run part of its forward under ``torch.inference_mode()`` (a frozen teacher, a
# gate computed without autograd, then cloned back in). Torch's selective checkpointing wraps
# every op output it is told to keep in a record of its version counter, and inference tensors
# have none: "Inference tensors do not track version counter" raised while the profile timed
# "keep every op" (Rule 2), and no profile was made. An op run in inference mode is given
# PREFER_RECOMPUTE whatever the policy: its output is never saved for backward (autograd
# refuses inference tensors), so no op-level policy keeps it (the menus list saved storages
# only), and its replay is what full checkpointing runs.

@contextlib.contextmanager
def _selective_regions(modules: list[nn.Module], policy: CheckpointPolicy | str | None) -> Iterator[None]:
    """``modules`` under selective checkpointing with every op call given ``policy`` (None: as they
    are; "full": full checkpointing)."""
    if policy is None:
        yield
        return

    def each_op(_ctx: Any, _func: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
        # see NOTE [ Inference-mode ops under selective checkpointing ]
        return CheckpointPolicy.PREFER_RECOMPUTE if torch.is_inference_mode_enabled() else policy

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
