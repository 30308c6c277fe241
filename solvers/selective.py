"""Selective (op-level) checkpointing: each candidate unit's menu of policies. No torch import.

A *policy* for a unit is the set of op calls inside its forward whose outputs are kept; every
other op is recomputed during backward from the unit's inputs and the kept outputs. These are
the semantics of ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with the kept
ops marked MUST_SAVE and the others PREFER_RECOMPUTE (the applier, ``planner/act/applier.py``,
enforces exactly that). Random ops (dropout) may be kept or recomputed: the recompute replays
the RNG state, as full checkpointing does. "Keep nothing" is full checkpointing; "none" (no
checkpoint) is the other end.

Example::

    menu = build_menu(UnitOps(ops, forward_ms=4.0, end_seq=90, saved_bytes=1 << 20, first_save_inside={}),
                      tensor_bytes=sizes)      # policies, fewest bytes kept first
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

MENU_STEPS = 8
"""Byte levels per unit menu: at most MENU_STEPS - 1 policies (NOTE [ Selective menus ])."""

MIN_ITEM_SHARE = 0.15
"""An op (or group) is kept on its own only when its kernel time is at least this share of the unit's
heaviest one's (NOTE [ Selective menus ], Rule (material))."""

_GRID = 1024
"""Held bytes on the knapsack front are rounded up to saved_bytes / _GRID."""


@dataclass(frozen=True)
class OpCall:
    """What the menu needs of one op call (``planner.model.schema.OpRecord``, flattened)."""

    seq: int
    name: str
    output_ids: tuple[int, ...]
    forward_ms: float
    random: bool = False
    inplace: bool = False
    view: bool = False
    mutated: bool = False
    writes: int | None = None
    read_between_writes: bool = False


@dataclass(frozen=True)
class UnitOps:
    """One unit's forward as its menu sees it."""

    ops: Sequence[OpCall]
    """The op calls of the unit's forward, in order (children's included)."""
    forward_ms: float
    """The unit's forward time (its full recompute)."""
    end_seq: int
    """The unit's ``fwd_end_seq``."""
    saved_bytes: int
    """Bytes the unit holds for backward when not checkpointed."""
    first_save_inside: dict[int, int]
    """Tensor id -> seq of its first save inside the unit."""
    saved_outside: frozenset[int] = frozenset()
    """Tensors that something outside the unit saves."""
    forward_spread_ms: float = 0.0
    """The spread of ``forward_ms``, its median's (``NodeAttrs.forward_spread_ms``)."""
    thread_factor: float = 1.0
    """The ratio of ``forward_ms`` to the forward's one-thread time (the unit's cost group's thread
    factor, NOTE [ Thread factor per cost group ]; 1 when the figures are one thread's)."""
    threads: int = 1
    """The CPU threads ``forward_ms`` is for."""


@dataclass(frozen=True)
class Policy:
    """One selective policy of one unit (see the module docstring)."""

    saved: tuple[tuple[str, int], ...]
    """Kept op calls: (op overload, index among that overload's calls in the unit's forward)."""
    cached: tuple[tuple[int, int], ...]
    """(holding position seq, tensor id) of each kept output storage (NOTE [ Selective menus ])."""
    saved_ms: float
    """Op time the recompute skips, as measured op by op."""
    recompute_ms: float
    """What it adds to the step: the share of the unit's forward it reruns (kernels by time, Python
    by calls), plus selective checkpointing's dispatch of every op call of the unit (NOTE
    [ Selective menus ])."""
    kept_bytes: int
    """Bytes of the kept outputs (counted once per storage)."""
    counts: tuple[tuple[str, int, int], ...]
    """Per op category: (category, kept, recomputed), for ``describe``."""
    keeps_written: bool = False
    """Keeps an output written in place, with its writers (``allow_cache_entry_mutation``)."""
    spread_ms: float = 0.0
    """The measured spread of ``recompute_ms`` (Rule (noise) of NOTE [ Selective menus ])."""
    share: float = 1.0
    """The share of the unit's forward the policy reruns (kernels by time, Python by calls)."""
    calls: tuple[int, int] = (0, 0)
    """Op calls (recomputed, kept): what the dispatch figures are paid on."""
    op_cost_spread_ms: tuple[float, float] = (0.0, 0.0)
    """The spreads of the dispatch figures it was priced with (``build_menu``'s)."""

    @property
    def cached_ids(self) -> frozenset[int]:
        return frozenset(t for _, t in self.cached)


# ----------------------------------------------------------------------------- op categories

_CATEGORIES = (
    ("attention", ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")),
    ("matmul", ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.matmul.", "aten.linear.",
                "aten._scaled_mm.", "aten.convolution.", "aten._convolution.", "aten.cudnn_convolution.",
                "aten.mkldnn_convolution.")),
    ("softmax", ("softmax",)),
    ("norm", ("layer_norm", "batch_norm", "group_norm", "rms_norm")),
    ("dropout", ("dropout", "bernoulli")),
)

_PLURAL = {"matmul": "matmuls", "attention": "attention", "softmax": "softmax", "norm": "norms",
           "dropout": "dropout", "pointwise": "pointwise"}


OP_RATE_SPREAD = 0.05
"""How far apart two ops of equal work may be priced by noise, as a share of their time (Rule (ties) of
NOTE [ Selective menus ]): op times are priced at their overload's rate (NOTE [ Op work ]), one
overload's ops agree within 5% in a profile, and the addmm and mm rates of Qwen2's equal-work
projections differed by 4.7% in one of five profiles and 0.4% in another."""


def spread_of_median(spread_ms: float, rounds: int) -> float:
    """The spread (interquartile range) of the median of ``rounds`` values whose own interquartile range is
    ``spread_ms``: its large-sample range, ``spread_ms * sqrt(pi / 2) / sqrt(rounds)`` (NOTE [ Selective
    dispatch cost ], Rule 4, in planner/profiling/sac_cost.py); ``spread_ms`` itself when the rounds are
    not known (0) or fewer than two."""
    return spread_ms * math.sqrt(math.pi / 2) / math.sqrt(rounds) if rounds >= 2 else spread_ms


def category(name: str, *, random: bool = False) -> str:
    """'matmul', 'attention', 'softmax', 'norm', 'dropout' or 'pointwise' (everything else)."""
    for cat, keys in _CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "dropout" if random else "pointwise"


def describe(policy: Policy) -> str:
    """In words, e.g. 'saves 2 matmuls, 1 attention; recomputes 7 pointwise'."""
    kept = [f"{k} {_PLURAL[c] if k != 1 else c}" for c, k, _ in policy.counts if k]
    redo = [f"{r} {_PLURAL[c] if r != 1 else c}" for c, _, r in policy.counts if r]
    return f"saves {', '.join(kept) or 'nothing'}; recomputes {', '.join(redo) or 'nothing'}"


def choice_spread_ms(a: Policy | bool, b: Policy | bool, forward_spread_ms: float) -> float:
    """The measured spread of the difference of one unit's recompute under two choices, each a
    ``Policy``, True (full checkpointing) or False (none): the unit's forward spread times the
    difference of the shares it reruns, plus each dispatch figure's spread times the difference
    of the calls it is paid on (errors the two prices share cancel; NOTE [ Robust choice ])."""
    def parts(c: Policy | bool) -> tuple[float, int, int]:
        return (c.share, *c.calls) if isinstance(c, Policy) else (1.0 if c else 0.0, 0, 0)

    (sa, ra, ka), (sb, rb, kb) = parts(a), parts(b)
    op = next((c.op_cost_spread_ms for c in (a, b) if isinstance(c, Policy)), (0.0, 0.0))
    return forward_spread_ms * abs(sa - sb) + op[0] * abs(ra - rb) + op[1] * abs(ka - kb)


# ----------------------------------------------------------------------------- menus


def keepable(op: OpCall) -> bool:
    """An op call a policy may keep (NOTE [ Selective menus ])."""
    return bool(op.output_ids) and not (op.inplace or op.view or op.mutated)


def indexed(ops: Sequence[OpCall]) -> list[tuple[OpCall, int]]:
    """Each op with its index among the calls of the same overload, in order."""
    seen: Counter[str] = Counter()
    out = []
    for op in ops:
        out.append((op, seen[op.name]))
        seen[op.name] += 1
    return out


# NOTE [ Selective menus ]
#
# Which ops can be kept: op calls that allocate a new storage (views and in-place ops return
# an input's storage: nothing to keep), whose outputs are not written in place later in the
# forward (selective checkpointing refuses a mutated cache entry), or, if they are, together
# with every op that writes them, all inside the unit, when nothing else reads them between
# the allocation and the last write (NOTE [ Op records ]): none of the group reruns, so the
# kept storage holds the final values every later reader saw. The CPU's dropout (its mask
# made by empty_like, bernoulli_ and div_) is kept that way; its random draw, 10 ms and more
# per attention-sized mask on one CPU thread, is then not replayed.
#
# Random ops are kept all together or not at all. The recompute restores the RNG state of the
# region's start and reruns only what is not kept: a random op that reruns after a kept one
# would draw from the state the kept op consumed in the forward, a different mask, and the
# gradients would be wrong (seen on T5 and BERT, whose blocks hold several dropouts: up to
# 0.009 off). So all random ops of a unit are one item of the knapsack when each of them can be
# kept, and none is kept otherwise.
#
# What keeping op o costs and saves, alone: its output storages are held from the forward
# until backward passes the first save of them inside the unit (or the unit's end, if backward
# does not need them: the recompute consumes them there), so it costs their bytes, except
# storages that something outside the unit saves (held anyway, e.g. a block's output that the
# next block's norm saves), which cost nothing; it saves the op's time from the recompute.
# The recompute of a policy: the unit's forward time F is its kernels K (the op times, on the
# same clock) and the Python around them, P = F - K (the module code, autograd's graph
# building: examples/llama.py's blocks spend 22% of their forward there on one CPU thread).
# A selective replay reruns the unit's whole Python, kept ops or not, and the kernels of the
# recomputed ops; what torch's selective checkpointing adds per op call recomputed (r) and kept
# (k) is measured on the model (NOTE [ Selective dispatch cost ] in
# planner/profiling/sac_cost.py), k as the step that keeps every op less the plain step, which
# holds that replayed Python, P / N per call of N. So a policy recomputing n_r of N calls, with
# kernel time K_r, costs
#     F * (phi * K_r / K + (1 - phi) * n_r / N) + n_r * r + n_k * k,    phi = min(1, K / F),
# exact at both ends (recompute every op: F + N * r, the measured step; keep every op: N * k).
# Pricing the Python by the kernel share instead (phi = 1) under-priced the policies that keep
# the few heavy ops and recompute the many light ones, which is what a menu is made of
# (op-level plans of examples/llama.py were measured 32 to 45% over their prediction;
# docs/benchmarks.md, "Predicted recompute vs measured overhead").
# Rule (threads). Above one CPU thread F and the op times are one thread's CPU times times the
# cost group's thread factor f (NOTE [ Thread factor per cost group ]), measured on the whole
# forward, kernels and Python together. The Python runs on the calling thread at any thread
# count; only the kernels are spread over the pool. So at N threads the Python's share of F is
# not 1 - phi but q = (1 - phi) / f, and the kernels' the rest, 1 - q (capped so that the kernels
# keep at least 1/N of their one-thread time: q <= 1 - phi / (N f)), and a policy costs
#     F * ((1 - q) * K_r / K + q * n_r / N) + n_r * r + n_k * k,
# still exact at both ends. Scaling the Python by f with the kernels under-priced the policies
# that rerun the Python of many light ops and keep the few heavy kernels (which gain most from
# threads): Qwen2's op-level plans at 2 threads were measured 19 to 57% over their prediction,
# and peers.py measured Qwen2's default op-level plan slower than every layer
# (docs/benchmarks.md, "Predicted recompute vs measured overhead"). At one thread q = 1 - phi.
# Op times are least-of-a-few-steps (NOTE [ Op records ]), priced by their work at their
# overload's rate (NOTE [ Op work ], solvers/op_work.py, applied by the graph builder), and F a
# median, so K / F is at most a little low; on a profile whose op times are on another clock than F (older profiles, the
# memory step's wall times), K / F is capped at 1, the share model.
#
# Rule (noise). A policy enters the menu only when it saves more than its measured spread: the
# saving F - recompute must exceed F's spread (its median's, NOTE [ Unit costs ], Rule 4b) times the
# recomputed share plus n_r and n_k times the spreads of r and k (``Profile.sac_*_spread_ms``).
# A policy within the noise of full checkpointing is a choice the next profile may reverse: it
# is left out, and full checkpointing (cheaper in bytes) stands. Likewise for each op (or group)
# the knapsack may keep: it is an item only when what keeping it saves exceeds the spread of that
# saving (F's spread times the share it takes out of the replay, plus the spreads of r and k per
# call). A pointwise op of tens of microseconds saves about its kernel less k - r, within the
# dispatch figures' spread: kept in one profile and not in the next, it made GPT-2's and Qwen2's
# policies differ run to run by 2 to 6 pointwise ops (docs/benchmarks.md, "Same plan every time"). Identical units have identical
# menus (their op times are pooled, NOTE [ Op records ]), and a group's plan is searched over its
# canonical arrangements, not left to the solvers' order (NOTE [ Robust choice ], Rule 3, in
# planner/act/robust.py).
#
# Rule (material). An op (or group) is an item only when its kernel time (priced by its work)
# is also at least MIN_ITEM_SHARE (15%) of the unit's heaviest item's. The light ops of a block (norms, clones,
# pointwise, each 0.03 to 0.3 ms on one CPU thread against 0.6 to 3.9 ms for a matmul) save about
# their dispatch figures' spread: on five GPT-2 profiles under a burner, ten of them per block
# saved 0.9 to 1.3 times their spread, so which of them entered the menu moved with the spreads,
# and with it the policy at a byte level (3 matmuls and 1 pointwise op kept in one profile, 2
# matmuls in the others, at the same bytes; docs/benchmarks.md, "Same plan every time"). A share
# of the heaviest item is a ratio of op times priced by their work (NOTE [ Op work ]), which moves
# little between profiles (Qwen2's lightest matmul is 17.1 to 18.4% of its heaviest over five,
# GPT-2's heaviest pointwise op 8.9 to 9.3%). What it gives up: the light ops' savings, a few
# per cent of a unit's forward, within their noise by the measurement above. The share is of
# kernel times, not of savings: a saving is the kernel less the dispatch figures' k - r per call,
# 40 to 100 us, which moved Qwen2's key and value projections (0.6 to 0.7 ms saved, 0.92 ms of
# kernel against the heaviest matmul's 4.7) from 15.7 to 18.6% of the heaviest saving in four
# profiles to under 15% in the fifth, and the policy that keeps all eight ops left that menu.
# Rule (ties). Two sets of ops that keep the same bytes and save within the spread of their
# difference (F's spread times the difference of the shares they take out of the replay, plus
# the spreads of r and k per call of difference, plus OP_RATE_SPREAD of the share of the ops in
# one set and not the other: ops of equal work priced at two overloads' rates) are one choice to
# the knapsack: the set of fewer items is taken, then the earlier ops. Qwen2's query projection and
# its key and value projections together (GQA: half the width each) keep the same 1 MiB and the
# same work; the dispatch figures of one more kept call decided between them, and the policy
# kept one in four profiles and the other two in the fifth (docs/benchmarks.md, "Same plan every
# time").
# Rule (level ties). Likewise under one byte level of the menu (below): the front's points that save
# within the spread of their difference from the one that saves the most are one choice, and the
# level takes the one of fewest bytes (``_level_pick``). Why: under a burner, one of five Qwen2
# profiles kept 2 matmuls and the attention (4,931,584 B) at the level where the other four kept
# 4 matmuls and the attention (4,734,976 B); both were priced at 17.05 ms in that profile
# (docs/benchmarks.md, "Same plan every time", round 15).
# The whole-step cost model (NOTE [ Peak-memory model ], "Selective regions") then prices
# every policy exactly, positions included; this per-unit pricing only picks the menu.
#
# The menu: the Pareto front of (bytes kept, op time recomputed) over subsets of keepable ops
# is a 0/1 knapsack; it is computed exactly (held bytes rounded up to 1/1024 of the unit's
# saved bytes, so fronts stay small), and the menu takes, for each of MENU_STEPS byte levels
# spread evenly below the bytes the unit holds when not checkpointed, the point of the front
# that saves the most time within that level (or, within the spread, the fewest bytes: Rule
# (level ties)). Policies that keep as much as not checkpointing
# at all, or cost as much time as full checkpointing, are never useful and are left out. The solvers choose per unit among none, full and
# the menu, so their optimality is proven over this menu.

def build_menu(unit: UnitOps, *, tensor_bytes: dict[int, int], writers: dict[int, int] | None = None,
               op_cost_ms: tuple[float, float] = (0.0, 0.0), steps: int = MENU_STEPS,
               op_cost_spread_ms: tuple[float, float] = (0.0, 0.0)) -> tuple[Policy, ...]:
    """The menu of one unit (NOTE [ Selective menus ]), cheapest in bytes first.

    Args:
        unit: the unit's op calls, times and saves (``UnitOps``).
        tensor_bytes: tensor id -> bytes.
        writers: allocating op's seq -> how many in-place ops write its output, in the whole
            step (a group is kept only when all of them are inside the unit).
        op_cost_ms: what selective checkpointing adds per op call it recomputes and per op call
            it keeps (``Profile.sac_recomputed_op_ms``, ``sac_kept_op_ms``; NOTE [ Selective
            dispatch cost ] in planner/profiling/sac_cost.py).
        steps: byte levels (at most ``steps - 1`` policies).
        op_cost_spread_ms: the spreads of the two ``op_cost_ms`` figures (Rule (noise) of the NOTE).
    """
    ops, forward_ms, end_seq, saved_bytes = unit.ops, unit.forward_ms, unit.end_seq, unit.saved_bytes
    first_save_inside, outside, forward_spread_ms = unit.first_save_inside, frozenset(unit.saved_outside), \
        unit.forward_spread_ms
    calls = indexed(ops)
    total_ms = sum(op.forward_ms for op in ops)
    price = _Price(forward_ms, total_ms, len(calls), op_cost_ms, forward_spread_ms, op_cost_spread_ms,
                   unit.thread_factor, unit.threads)
    items = []
    for group in _random_together(calls, _groups(calls, writers or {})):
        ids = {t for op, _ in group if not (op.inplace or op.view) for t in op.output_ids}
        cost = sum(tensor_bytes[t] for t in ids if t not in outside)
        # what keeping the group saves (the NOTE's price of a policy, less the group); a group
        # that saves no more than its spread is never kept (Rule (noise))
        kernel_ms = sum(o.forward_ms for o, _ in group)
        value = price.saved(kernel_ms, len(group))
        if value > 0 and value > price.saved_spread(kernel_ms, len(group)):
            items.append((cost, value, group, kernel_ms))
    heaviest = max((it[3] for it in items), default=0.0)
    items = [it for it in items if it[3] >= MIN_ITEM_SHARE * heaviest]  # Rule (material): kernel time
    if not items or saved_bytes <= 0:
        return ()
    front = _knapsack_front([(c, ms, (kernel, len(group))) for c, ms, group, kernel in items],
                            max(1, math.ceil(saved_bytes / _GRID)), price.difference_spread)
    menu: dict[frozenset[int], Policy] = {}
    for j in range(1, steps):
        level = saved_bytes * j / steps
        chosen = _level_pick([(b, ms, s) for b, ms, s in front if b <= level and s], items, price)
        if chosen is None or chosen in menu:
            continue
        menu[chosen] = _policy([items[i][:3] for i in sorted(chosen)], calls, price, end_seq, tensor_bytes,
                               first_save_inside)
    # a policy no faster than full checkpointing beyond its spread keeps bytes for nothing (Rule (noise))
    return tuple(sorted((p for p in menu.values() if forward_ms - p.recompute_ms > p.spread_ms),
                        key=lambda p: (p.kept_bytes, p.recompute_ms)))


def _level_pick(below: list[tuple[int, float, frozenset[int]]], items: list[tuple[int, float, list, float]],
                price: _Price) -> frozenset[int] | None:
    """Of the front's points under one byte level (bytes, ms saved, items kept), the one that saves the
    most, or the fewest bytes among those within the spread of their difference from it (Rule (level
    ties) of NOTE [ Selective menus ]); None when there are none."""
    if not below:
        return None
    _, best_ms, best = max(below, key=lambda p: (p[1], -p[0]))

    def spread(s: frozenset[int]) -> float:
        kernel, calls = (sum(items[i][3] for i in best) - sum(items[i][3] for i in s),
                         sum(len(items[i][2]) for i in best) - sum(len(items[i][2]) for i in s))
        return price.difference_spread(kernel, calls, sum(items[i][3] for i in best ^ s))

    return min((p for p in below if best_ms - p[1] <= spread(p[2])), key=lambda p: (p[0], -p[1]))[2]


@dataclass(frozen=True)
class _Price:
    """The NOTE's price of a policy for one unit: F, K, N, (r, k) and their spreads."""

    forward_ms: float
    kernel_ms: float
    calls: int
    op_cost_ms: tuple[float, float]
    forward_spread_ms: float
    op_cost_spread_ms: tuple[float, float]
    thread_factor: float = 1.0
    threads: int = 1

    @property
    def phi(self) -> float:
        """The kernels' share of the forward, K / F capped at 1 (1 without op times)."""
        if self.forward_ms <= 0 or self.kernel_ms <= 0:
            return 1.0
        return min(1.0, self.kernel_ms / self.forward_ms)

    @property
    def python(self) -> float:
        """The Python's share of the forward at the profile's threads (Rule (threads) of the NOTE):
        its one-thread share 1 - phi over the thread factor, at most what leaves the kernels 1/N of
        their one-thread time."""
        f = self.thread_factor
        if f >= 1.0 or f <= 0.0:
            return 1.0 - self.phi
        return min((1.0 - self.phi) / f, 1.0 - self.phi / (max(1, self.threads) * f))

    def share(self, recomputed_kernel_ms: float, recomputed_calls: int) -> float:
        """The share of the forward a policy reruns: kernels by time, Python by calls."""
        kernels = recomputed_kernel_ms / self.kernel_ms if self.kernel_ms > 0 else 1.0
        calls = recomputed_calls / self.calls if self.calls else 1.0
        q = self.python
        return (1.0 - q) * kernels + q * calls

    def recompute_ms(self, recomputed_kernel_ms: float, recomputed_calls: int) -> float:
        kept = self.calls - recomputed_calls
        return (self.forward_ms * self.share(recomputed_kernel_ms, recomputed_calls)
                + self.op_cost_ms[0] * recomputed_calls + self.op_cost_ms[1] * kept)

    def spread_ms(self, recomputed_kernel_ms: float, recomputed_calls: int) -> float:
        kept = self.calls - recomputed_calls
        return (self.forward_spread_ms * self.share(recomputed_kernel_ms, recomputed_calls)
                + self.op_cost_spread_ms[0] * recomputed_calls + self.op_cost_spread_ms[1] * kept)

    def saved_spread(self, kept_kernel_ms: float, kept_calls: int) -> float:
        """The spread of ``saved``: the forward's spread times the share the kept calls take out of the
        replay, plus both dispatch figures' spreads per kept call (``choice_spread_ms``)."""
        return self.difference_spread(kept_kernel_ms, kept_calls)

    def difference_spread(self, kernel_ms: float, calls: int, moved_kernel_ms: float = 0.0) -> float:
        """The spread of the difference of two policies' recompute whose kept kernel time and calls differ
        by ``kernel_ms`` and ``calls``, and which keep ``moved_kernel_ms`` of kernels one keeps and the
        other does not: the forward's spread times the difference of their shares, both dispatch
        figures' spreads per call of difference, and OP_RATE_SPREAD of the moved kernels' share of the
        forward (Rule (ties) of the NOTE). With no moved kernels, against keeping nothing: ``saved``'s
        spread."""
        share = self.share(self.kernel_ms, self.calls) - self.share(self.kernel_ms - kernel_ms, self.calls - calls)
        moved = moved_kernel_ms / self.kernel_ms if self.kernel_ms > 0 else 0.0
        return (self.forward_spread_ms * abs(share) + (self.op_cost_spread_ms[0] + self.op_cost_spread_ms[1]) * abs(calls)
                + OP_RATE_SPREAD * self.forward_ms * (1.0 - self.python) * moved)

    def saved(self, kept_kernel_ms: float, kept_calls: int) -> float:
        """What keeping ``kept_calls`` calls of ``kept_kernel_ms`` saves, alone, against recomputing them."""
        return (self.recompute_ms(self.kernel_ms, self.calls)
                - self.recompute_ms(self.kernel_ms - kept_kernel_ms, self.calls - kept_calls))


def _groups(calls: list[tuple[OpCall, int]], writers: dict[int, int]) -> list[list[tuple[OpCall, int]]]:
    """What can be kept: single ops, and mutated outputs with all their writers (first the allocator)."""
    written: dict[int, list[tuple[OpCall, int]]] = {}
    for op, k in calls:
        if op.inplace and op.writes is not None:
            written.setdefault(op.writes, []).append((op, k))
    out = []
    for op, k in calls:
        if keepable(op):
            out.append([(op, k)])
        elif (op.mutated and op.output_ids and not (op.inplace or op.view or op.read_between_writes)
              and op.seq in written and len(written[op.seq]) == writers.get(op.seq, -1)):
            out.append([(op, k), *written[op.seq]])
    return out


def _random_together(calls: list[tuple[OpCall, int]],
                     groups: list[list[tuple[OpCall, int]]]) -> list[list[tuple[OpCall, int]]]:
    """The groups with every group holding a random op merged into one, or dropped when some
    random op of the unit is in no group (NOTE [ Selective menus ]: random ops all or none)."""
    random = [g for g in groups if any(op.random for op, _ in g)]
    if not random:
        return groups
    rest = [g for g in groups if not any(op.random for op, _ in g)]
    in_groups = {op.seq for g in random for op, _ in g}
    if any(op.random and op.seq not in in_groups for op, _ in calls):
        return rest
    return [*rest, [m for g in random for m in g]]


def _knapsack_front(items: list[tuple[int, float, tuple[float, int]]], grid: int,
                    difference_spread: Callable[[float, int, float], float]) -> list[tuple[int, float, frozenset[int]]]:
    """Pareto front of (bytes, ms saved) over subsets of ``items`` (bytes, ms saved, (kernel ms, calls)
    kept); bytes rounded up to ``grid``. Subsets of equal bytes whose savings differ by no more than
    ``difference_spread`` of the differences of their kept kernel time and calls and the kernel time
    of the items in one and not the other are one choice: the fewest items, then the earliest (Rule
    (ties) of NOTE [ Selective menus ])."""
    kernels = [kernel_ms for _, _, (kernel_ms, _) in items]
    front: list[tuple[int, float, frozenset[int], float, int]] = [(0, 0.0, frozenset(), 0.0, 0)]
    for i, (cost, ms, (kernel_ms, calls)) in enumerate(items):
        c = -(-cost // grid) * grid
        merged = front + [(b + c, v + ms, s | {i}, k + kernel_ms, n + calls) for b, v, s, k, n in front]
        merged.sort(key=lambda p: (p[0], -p[1]))
        front = []
        for _, run in itertools.groupby(merged, key=lambda p: p[0]):
            run = list(run)
            best = run[0]  # the most saved at these bytes; then the fewest items within the spread of it
            p = min((q for q in run if best[1] - q[1] <= difference_spread(
                best[3] - q[3], best[4] - q[4], sum(kernels[j] for j in best[2] ^ q[2]))),
                key=lambda q: (len(q[2]), sorted(q[2])))
            if not front or p[1] > front[-1][1]:
                front.append(p)
    return [(b, v, s) for b, v, s, _, _ in front]


def _policy(kept: list[tuple[int, float, list[tuple[OpCall, int]]]], calls: list[tuple[OpCall, int]],
            price: _Price, end_seq: int, tensor_bytes: dict[int, int], first_save_inside: dict[int, int]) -> Policy:
    members = [m for _, _, group in kept for m in group]
    saved_ms = sum(op.forward_ms for op, _ in members)
    recomputed = (max(0.0, price.kernel_ms - saved_ms), len(calls) - len(members))
    ids = {t for op, _ in members for t in op.output_ids}
    kept_keys = {(op.name, k) for op, k in members}
    drawn = {op.writes for op, _ in calls if op.random and op.writes is not None}  # dropout masks
    tally: dict[str, list[int]] = {}
    for op, k in calls:
        if not op.output_ids or op.view or op.inplace:
            continue
        row = tally.setdefault(category(op.name, random=op.random or op.seq in drawn), [0, 0])
        row[0 if (op.name, k) in kept_keys else 1] += 1
    order = ["matmul", "attention", "softmax", "norm", "dropout", "pointwise"]
    return Policy(
        saved=tuple(sorted(kept_keys, key=lambda nk: (nk[0], nk[1]))),
        cached=tuple(sorted((first_save_inside.get(t, end_seq), t) for t in ids)),
        saved_ms=saved_ms,
        recompute_ms=price.recompute_ms(*recomputed),
        kept_bytes=sum(tensor_bytes[t] for t in ids),
        counts=tuple((c, *tally[c]) for c in order if c in tally),
        keeps_written=any(op.inplace for op, _ in members),
        spread_ms=price.spread_ms(*recomputed),
        share=price.share(*recomputed),
        calls=(recomputed[1], len(members)),
        op_cost_spread_ms=price.op_cost_spread_ms,
    )


__all__ = ["build_menu", "category", "choice_spread_ms", "describe", "indexed", "keepable", "MENU_STEPS",
           "MIN_ITEM_SHARE", "OP_RATE_SPREAD", "OpCall", "Policy", "spread_of_median", "UnitOps"]
