"""The cost model: predicted peak memory and recompute time of a checkpoint set (``simulate``).

Every solver is judged by ``simulate`` and every measurement is compared with it. ``CostModel``
holds what does not depend on the checkpoint set, built once per graph; the DP's chain
recurrence (``solvers/chain.py``) and the ILP's program (``solvers/ilp/program.py``) are
formulated from its terms. Pure Python over the graph of ``planner.model.graph.build_graph``
(its attributes: ``solvers/contract.py``); no torch import. See NOTE [ Peak-memory model ]
above ``CostModel``; static memory per rank: ``solvers/rank_memory.py``.

Example::

    est = simulate(g, ["h.0", "h.2"])          # checkpoint two blocks
    est.peak_bytes, est.peak_at, est.recompute_ms
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import networkx as nx
from pydantic import BaseModel, ConfigDict, Field

from solvers.errors import SolverError
from solvers.offload_cost import OffloadTerms
from solvers.rank_memory import RankMemory, rank_memory
from solvers.kept import ever_kept, kept_at  # NOTE [ Outputs the caller drops ]
from solvers.checkpointed import calibrate_checkpointed_windows
from solvers.replay import calibrate_replay_starts, replay_in_flight, replay_temporaries
from solvers.ties import close_ties, enclosing, is_tied, tie_groups  # NOTE [ Tied calls ]

if TYPE_CHECKING:
    from solvers.chain import ChainTerms


class Estimate(BaseModel):
    """The cost model's prediction for one checkpoint set (see NOTE [ Peak-memory model ])."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    checkpointed: list[str]
    selective: dict[str, int] = Field(default_factory=dict,
                                      description="Selective regions: node id -> index into its menu.")
    peak_bytes: int
    params_bytes: int = Field(description="Parameters and buffers.")
    grads_bytes: int = Field(description="Gradient buffers live at the peak.")
    optimizer_bytes: int
    activations_bytes: int = Field(description="Everything else at the peak: batch, saved and recomputed "
                                               "tensors, gradients of activations, temporaries.")
    peak_at: str = Field(description="Where the peak happens, e.g. 'backward of h.3' or 'optimizer step'.")
    recompute_ms: float
    step_ms: float = Field(description="Profiled step time plus recompute_ms and offload_ms.")
    offloaded: list[str] = Field(default_factory=list, description="Offloaded units (Rule 10), forward order.")
    offload_ms: float = Field(0.0, description="Copy time of the offloaded units not hidden behind compute, "
                                               "per step (Rule 10).")
    host_peak_bytes: int = Field(0, description="Host memory the offloaded tensors take at their peak (Rule 10).")

    @property
    def overhead_ms(self) -> float:
        """What the plan adds to the step: recompute and exposed copies (the solvers' objective)."""
        return self.recompute_ms + self.offload_ms


def simulate(g: nx.DiGraph, checkpointed: Iterable[str], selective: Mapping[str, int] | None = None,
             offloaded: Iterable[str] = ()) -> Estimate:
    """Predict peak memory (with breakdown) and recompute time of one training step.

    ``checkpointed`` is a set of graph node ids (an antichain of the module tree); ``selective``
    maps further nodes to an index into their ``menu`` (op-level policies, Rule 9); ``offloaded``
    units move their saved tensors to host memory (Rule 10).
    See NOTE [ Peak-memory model ] for the semantics.
    Cost: O(S log S + n * s) for S saves, n leaves and s saves per checkpointed unit.
    """
    off = frozenset(offloaded)
    regions = check_checkpoint_set(g, checkpointed, selective, off)
    policies = policies_of(g, selective)
    full = regions - set(policies)
    model = CostModel.of(g)
    name, peak, grads, extra = max(model.probes(regions, policies, off), key=lambda p: p[1])
    params = model.rank.params_bytes + extra  # extra: FSDP's unsharded parameters at that point
    opt = model.rank.optimizer_bytes
    recompute_ms = g.graph.get("micro_batches", 1) * (sum(g.nodes[c]["forward_ms"] for c in full)
                                                       + sum(pol.recompute_ms for pol in policies.values()))
    offload_ms = sum(model.exposed_ms(u) for u in sorted(off, key=lambda n: g.nodes[n]["order"]))
    by_order = lambda ns: sorted(ns, key=lambda n: g.nodes[n]["order"])  # noqa: E731
    return Estimate(
        checkpointed=by_order(full),
        selective={n: int(k) for n, k in sorted((selective or {}).items(), key=lambda kv: g.nodes[kv[0]]["order"])},
        peak_bytes=peak, params_bytes=params, grads_bytes=grads, optimizer_bytes=opt,
        activations_bytes=peak - params - grads - opt, peak_at=name,
        recompute_ms=recompute_ms, step_ms=g.graph["step_ms"] + recompute_ms + offload_ms,
        offloaded=by_order(off), offload_ms=offload_ms, host_peak_bytes=model.host_bytes(off),
    )


def window_bytes(g: nx.DiGraph, checkpointed: Iterable[str], *, calibrated: bool = True,
                 selective: Mapping[str, int] | None = None, offloaded: Iterable[str] = ()) -> dict[str, int]:
    """The model's bytes at every probe of the NOTE, by name ('forward of h.0', 'optimizer step', ...).

    ``calibrated=False`` leaves out the temporaries T: what is live at the end of each window.
    ``verify`` and the validation step compare these with measurements, window by window.
    """
    model = CostModel.of(g) if calibrated else CostModel.build(g, calibrated=False)
    regions = check_checkpoint_set(g, checkpointed, selective, offloaded)
    return {name: total for name, total, _, _ in model.probes(regions, policies_of(g, selective), frozenset(offloaded))}


def policies_of(g: nx.DiGraph, selective: Mapping[str, int] | None) -> dict[str, Any]:
    """node -> its chosen ``solvers.selective.Policy`` (Rule 9)."""
    return {n: g.nodes[n]["menu"][k] for n, k in (selective or {}).items()}


def calibrate(g: nx.DiGraph) -> None:
    """Set the temporaries T (NOTE [ Peak-memory model ], Rule 6) from the measured window peaks, then attach the
    graph's ``CostModel`` (``g.graph["cost_model"]``). Called once by ``build_graph``; unmeasured windows keep T = 0.
    """
    raw = CostModel.build(g, calibrated=False, per_rank=False)
    probes = {p[0]: p[1] for p in raw.probes(frozenset())}
    for leaf in g.graph["leaves"]:
        a = g.nodes[leaf]
        for kind, key, peak_key in (("forward", "fwd_transient_bytes", "fwd_window_peak_bytes"),
                                    ("backward", "bwd_transient_bytes", "bwd_window_peak_bytes")):
            measured = a.get(peak_key)
            if measured is not None:
                a[key] = max(0, measured - probes[f"{kind} of {leaf}"])
        if a.get("fwd_unit_peak_bytes") is not None:  # NOTE [ A replay's temporaries ] in planner/model/graph.py
            a["unit_fwd_transient_bytes"] = max(0, a["fwd_unit_peak_bytes"] - probes[f"forward of {leaf}"])
    calibrate_checkpointed_windows(g, raw)  # NOTE [ Checkpointed forward windows ]
    calibrate_replay_starts(g, raw)  # NOTE [ What a replay allocates ], Rule 6
    for key, peak_key, probe in (("tail_fwd_transient_bytes", "tail_fwd_peak_bytes", "end of forward"),
                                 ("tail_bwd_transient_bytes", "tail_bwd_peak_bytes", "start of backward")):
        measured = g.graph.get(peak_key)
        if measured is not None:
            g.graph[key] = max(0, measured - probes[probe])
    g.graph["cost_model"] = CostModel.build(g)


def check_checkpoint_set(g: nx.DiGraph, checkpointed: Iterable[str],
                         selective: Mapping[str, int] | None = None,
                         offloaded: Iterable[str] = ()) -> frozenset[str]:
    """Validate a checkpoint choice: known node ids, no node together with an ancestor, and
    every call of a module or none of them (see NOTE [ Tied calls ]). ``selective`` maps further
    nodes to an index into their ``menu`` (NOTE [ Peak-memory model ], Rule 9); they are regions
    too. ``offloaded`` units (Rule 10) are no regions, but join the antichain; tied calls are never
    offloaded. Returns all regions."""
    full = frozenset(checkpointed)
    regions = full | frozenset(selective or ())
    off = frozenset(offloaded)
    both = sorted(off & regions)
    if both:
        raise SolverError(f"{both[0]!r} is both offloaded and checkpointed; choose one")
    tied = sorted(off & {n for group in tie_groups(g) for n in group})
    if tied:
        raise SolverError(f"cannot offload {tied[0]!r}: its module is called more than once in the step")
    _check_antichain(g, full, selective, regions | off)
    return regions


def _check_antichain(g: nx.DiGraph, full: frozenset[str], selective: Mapping[str, int] | None,
                     chosen: frozenset[str]) -> None:
    """Known node ids, policies in range, no node with an ancestor in ``chosen``, ties whole."""
    for n, k in (selective or {}).items():
        if n in full:
            raise SolverError(f"{n!r} is both checkpointed and selective; choose one")
        menu = g.nodes[n].get("menu", ()) if n in g.nodes else ()
        if n in g.nodes and not 0 <= k < len(menu):
            raise SolverError(f"{n!r} has no selective policy {k} (its menu has {len(menu)})")
    unknown = sorted(chosen - set(g.nodes))
    if unknown:
        raise SolverError(f"unknown candidate(s) {unknown[:5]}; candidates are graph node ids")
    for n in chosen:
        p = enclosing(g, n, chosen)
        if p is not None:
            raise SolverError(f"cannot checkpoint both {p!r} and its descendant {n!r}")
    for group in tie_groups(g):
        split = [n for n in group if n not in chosen]
        if len(split) < len(group) and split:
            inside = next(n for n in group if n in chosen)
            raise SolverError(f"cannot checkpoint {inside!r} without {split[0]!r}: both are calls of module "
                              f"{g.nodes[inside]['fqn']!r}, and checkpointing a module covers all its calls")


ALIVE_SEQ = 1 << 62
"""A position after every forward position: a gradient kept alive by the recipe counts as last
used there, and a tensor never held is held from there."""


# NOTE [ Peak-memory model ]
#
# Rule 1. What is modelled: one steady-state training step of the recipe (default:
# ``zero_grad(set_to_none=True)``, forward, loss, backward, ``optimizer.step()``; Rule 8), with
# the candidates in the checkpoint set C wrapped in non-reentrant ``torch.utils.checkpoint``. C
# is an antichain of the module tree: a unit and one of its descendants are never both
# checkpointed; and it holds every call of a module or none (NOTE [ Tied calls ]).
#
# Rule 2. Static memory is alive all step: parameters + buffers + optimizer state + the input
# batch. Gradient buffers: none during forward; during backward a parameter's gradient appears
# once backward reaches the last forward use of that parameter (``grad_seq``), and all are
# alive at the optimizer step.
#
# Rule 3. Activations are tracked per storage ("tensor"): a tensor costs its bytes once, however
# many units save it. A tensor is *held* (kept alive for backward) by
#   - every save-for-backward event of it, unless the event happens inside a checkpointed unit
#     (checkpointed units keep nothing of their own), positioned at the event's sequence number;
#   - every checkpointed unit it is an input of (non-reentrant checkpoint keeps the inputs),
#     positioned at the unit's forward start.
# A held tensor lives from its creation until backward passes its *earliest* holding position
# p(t). Backward runs in reverse forward order, so "backward passes position p" means every
# unit that started after p has finished its backward.
#
# Rule 4. Time is cut into windows at the leaves l_1..l_n of the graph (forward order): window
# i is the code after l_{i-1} up to and including l_i (glue code such as a residual add or the
# embedding sum belongs to the next leaf's window); the tail window is everything after l_n
# (final norm, head, loss, when they are not candidates). The peak is the largest probe:
#   forward of window i:   static + |held with p <= end(l_i)  U  out_i  U  kept_i| + T_fwd(i)
#   backward of window i:  static + grads(i) + |held with p <= end(l_i)| + R_i + T_bwd(i)
#   recompute of c in C:   static + grads after c + |held with p <= end(c)| + |recomputed(c)|
#                          + G_c + max T over the leaves' own forwards in c (or what c's forward
#                          allocated up to its last pack: NOTE [ What a replay allocates ])
#   tail forward/backward: static + |all held| + T_tail   (forward: U kept_tail)
#   optimizer step:        static + all grads + the optimizer's measured temporaries
# where out_i are tensors created in window i that later code still uses (in flight, alive
# whether held or not), kept_i are the outputs of units that no unit takes, made by end(l_i) and
# still kept by the step's code when window i starts (NOTE [ Outputs the caller drops ] in
# planner/profiling/releases.py: unheld once their unit is checkpointed, alive until the caller
# drops them; kept_tail those kept past the last leaf), R_i are the tensors a checkpointed unit
# c containing l_i re-creates when its backward starts (everything c saves that c itself
# created: not its inputs, which it kept, nor tensors it reached otherwise, which recompute does
# not copy) and that backward has
# not yet passed (saved at or before end(l_i)), grads(i) are the gradients of parameters last
# used after window i, and G_c (``CostModel.replay_in_flight``) is what the replay of c runs
# beside: the gradient of c's outputs that code after c differentiates through (backward has
# reached c; an output kept but read by no loss has none: NOTE [ Outputs without a gradient ] in
# planner/profiling/recording.py) and c's outputs the replay re-makes (not those c saves, nor those made
# after its last save: NOTE [ The replay stops at the last save ]). ``CostModel`` holds each probe's base
# (static, gradients, T); the held, in-flight and recomputed bytes depend on C.
#
# Rule 5. grads(i) leaves out window i's own parameters: their gradients appear while backward
# frees what window i saved, so the window never holds both in full; counting both at once
# over-counts by up to their bytes wherever the measured window peak falls below it (T is
# never negative): under amp, each fp32 gradient replaces the bf16/fp16 cast it was computed
# from (docs/zoo.md, the recipe table). Window i's gradients are in T_bwd(i), measured; the
# next window's probe counts them in full. So too the tail: its own gradients (a head's, or with
# no leaves at all, every candidate excluded, the whole model's) are in T_tail; counted in full
# beside every held tensor they over-predicted a spectral-normed model's unplanned step by 7.7%.
#
# Rule 6. T are *temporaries* not explained by held tensors: activation gradients in flight,
# kernel workspaces, tensors freed within the window. They are calibrated once per graph from
# the profiler's measured timeline (``calibrate``): T = max(0, measured window peak - the
# model's value for the same window without checkpointing). So the model reproduces the
# measured no-checkpoint step window by window, and checkpointing changes only the held and
# recomputed terms, which are exact bytes. Recompute time is the sum of the checkpointed units'
# forward times (early stopping of the recompute is ignored: a slight overestimate).
#
# Rule 7. Retained bytes r(c): memory that something outside a unit still references after its
# forward (a cache, an attribute set in forward, a hook that keeps outputs), so that
# checkpointing c does not free it. Measured per unit by the profiler's validation step
# (NOTE [ Validation step ] in planner/profiling/validate.py) and added by ``build_graph`` to
# c's inputs as one tensor of r(c) bytes created when c starts. So a checkpointed c holds it
# like its inputs, until backward passes c; not checkpointed, it is an input no one saves and
# costs nothing beyond the measured step (whose windows already contain it). Every solver sees
# it through the same held-tensor terms. What no save holds is alive unplanned too, in T, and
# left out of r(c) (NOTE [ Kept past the forward ] in planner/model/graph.py). What a
# custom Function keeps on ctx is held like a save instead (NOTE [ Tensors on ctx ]). Units
# whose recomputation is unsafe are not candidates. The CPU RNG state each checkpointed region
# keeps (Profile.region_state_bytes, device memory on a CPU run) is counted as retained bytes
# of every unit; and once more in each recompute probe ("replay_rng_copy_bytes"): the replay
# runs inside ``torch.random.fork_rng``, which copies the current state for as long as it runs.
# Missed, a replay whose forward temporaries come at its very end (a branch no loss reads, last
# in its block) was measured 5,056 bytes above its probe.
#
# Rule 8. Recipe (graph.graph "recipe", from ``schema.Recipe``; the profiler ran the same step):
#   grad_accum N > 1:  the step runs N micro-batches and the optimizer step after the last. From
#         micro-batch 2 on, every gradient is alive from the start (accumulated in place; the new
#         gradient is a temporary of its backward window, in T). The worst micro-batch is the last:
#         the profiler measures it, and the model counts all gradients in every window ("grads_alive":
#         forward windows and tail included). Micro-batch 1, whose gradients appear during its
#         backward, is never higher. Recompute time is N times the checkpointed units' forward time.
#   zero_grad(set_to_none=False): the gradients stay allocated (zeroed) between steps: the same term.
#   amp (bf16/fp16): autocast caches the cast of each parameter it casts (leaf, requires grad)
#         until the forward's autocast region exits. A checkpointed unit drops what it saves, but
#         not its casts: they stay alive to the forward's end ("autocast_cached" tensors not held are
#         added to every forward window after their creation and to the end of forward). In
#         backward they are freed; the recompute re-creates them (in R). fp16's GradScaler adds a
#         few scalars; its unscale, like clipping, runs at the optimizer step.
#   clip_grad_norm / GradScaler unscale / fused or foreach optimizers: their temporaries are part
#         of the measured optimizer-step temporaries (between the last backward and the step's end).
# The DP's recurrence (``chain_terms``) keeps autocast's casts as if held (an over-count, so its
# plans fit and ``auto`` sends amp graphs to the ILP, which has the exact term).
#
# Rule 9. Selective regions (op-level checkpointing, NOTE [ Selective menus ] in
# solvers/selective.py): a candidate c may instead run under a policy pi that keeps the outputs
# of some op calls (torch's selective checkpointing with those ops MUST_SAVE). c is then a
# region like a checkpointed unit (in C: its own saves dropped, its inputs held at its forward
# start, the antichain and tie rules unchanged), with three differences:
#   - each kept output storage t is held too, positioned at its first save inside c (backward
#     needs it there), or at end(c) when backward does not need it (the recompute consumes it);
#   - recomputed(c) leaves out the kept storages: they are held, not re-created;
#   - its recompute costs pi's recompute_ms: forward_ms(c) less the kept ops' share, plus the
#     dispatch cost of selective checkpointing (NOTE [ Selective dispatch cost ]).
# Full checkpointing is the policy that keeps nothing. A checkpoint set with policies is a pair
# (C, P): P maps some members of C to an index into their ``menu``.
#
# Rule 10. Offloaded units: a candidate may instead move its saved tensors to host memory and
# back; its terms (device, in transfer, time, host) are NOTE [ Offload costs ] in
# solvers/offload_cost.py, beside the code that computes them.
#
# Rule 11. A compiled step (NOTE [ Compiled profile ] in planner/profiling/compiled.py): Rules 1-9
# on the partitioner's saves, plus graph.graph "replay_transient_bytes" in every recompute probe:
# a replay inside the fused backward overlaps its backward's temporaries (0 for eager steps). It is
# signed: negative where the fused replay's temporaries are below the eager forward's that the probe
# counts; a recompute's temporaries never go below 0.
#
# Not modelled: allocations too brief to leave a window; the planner's headroom
# (planner.act.api.DEFAULT_HEADROOM) covers them. Per-rank memory: NOTE [ Per-rank memory ].


@dataclass(frozen=True, eq=False)
class CostModel(OffloadTerms):
    """NOTE [ Peak-memory model ] for one graph, built once (``CostModel.of``); the graph is not mutated.

    It holds every term that does not depend on the checkpoint set: the windows, the saves, the
    gradients' timing, autocast's cached casts and each probe's base bytes (static + gradients +
    temporaries T). ``simulate``, ``chain_terms`` (the DP) and the ILP's program add the held and
    recomputed bytes of a checkpoint set to these bases.
    """

    graph: nx.DiGraph
    rank: RankMemory
    calibrated: bool  # False: the temporaries T are left out (for ``calibrate``)
    leaves: tuple[str, ...]  # the graph's leaves, forward order: window i ends with leaves[i]
    leaf_end_seq: tuple[int, ...]
    tensor_bytes: Mapping[int, int]
    saves: tuple[tuple[int, int, tuple[str, ...]], ...]  # (seq, tensor, graph nodes containing seq), by seq
    save_seqs: tuple[int, ...]  # the seqs of ``saves``
    node_leaves: Mapping[str, tuple[int, ...]]  # node -> indices of the leaves inside it
    grad_seqs: tuple[int, ...]  # sorted
    grad_suffix: tuple[int, ...]  # grad_suffix[k] = bytes of grads with index >= k in grad_seqs
    casts: tuple[tuple[int, int], ...]  # (created seq, tensor) of autocast's cached casts, sorted
    cast_ids: frozenset[int]
    dropped: tuple[tuple[int, int, int], ...]  # (made, tensor, released): NOTE [ Outputs the caller drops ]
    dropped_ids: frozenset[int]
    # Probe bases (static + gradients + temporaries T), per window and for the tail:
    forward_base_bytes: tuple[int, ...]
    checkpointed_forward_base_bytes: tuple[int | None, ...]  # NOTE [ Checkpointed forward windows ]
    backward_base_bytes: tuple[int, ...]
    tail_forward_base_bytes: int
    tail_backward_base_bytes: int

    tie_groups: tuple[tuple[str, ...], ...]  # NOTE [ Tied calls ]

    @staticmethod
    def attached(g: nx.DiGraph) -> CostModel | None:
        """The model ``build_graph`` attached to ``g`` (``g.graph["cost_model"]``), if any."""
        model = g.graph.get("cost_model")
        return model if isinstance(model, CostModel) and model.graph is g else None

    @staticmethod
    def of(g: nx.DiGraph) -> CostModel:
        """The model ``build_graph`` attached to ``g``, or a new one for a graph built otherwise."""
        return CostModel.attached(g) or CostModel.build(g)

    @staticmethod
    def build(g: nx.DiGraph, *, calibrated: bool = True, per_rank: bool = True) -> CostModel:
        """Derive the model of ``g``. ``calibrated=False`` leaves the temporaries T out and
        ``per_rank=False`` counts one process (both for ``calibrate``)."""
        leaves = tuple(g.graph["leaves"])
        leaf_end = tuple(g.nodes[n]["fwd_end_seq"] for n in leaves)
        ranges = [(n, a["fwd_start_seq"], a["fwd_end_seq"]) for n, a in g.nodes(data=True)]
        ctx = g.graph.get("ctx_held", frozenset())  # NOTE [ Tensors on ctx ]: no region drops them
        saves = tuple(
            (seq, t, () if t in ctx else tuple(n for n, lo, hi in ranges if lo <= seq <= hi))
            for seq, t in g.graph["saves"]
        )
        leaf_pos = {n: i for i, n in enumerate(leaves)}
        node_leaves = {
            n: tuple(leaf_pos[x] for x in leaves
                     if a["fwd_start_seq"] <= g.nodes[x]["fwd_start_seq"] <= a["fwd_end_seq"])
            for n, a in g.nodes(data=True)
        }
        pg = g.graph["param_grads"]
        # NOTE [ Peak-memory model ], "Recipe": gradients kept alive appear before anything else.
        grad_seqs = tuple(ALIVE_SEQ if g.graph.get("grads_alive", False) else s for s, _ in pg)
        suffix = [0] * (len(pg) + 1)
        for k in range(len(pg) - 1, -1, -1):
            suffix[k] = suffix[k + 1] + pg[k][1]
        created = g.graph["tensor_created_seq"]
        casts = tuple(sorted((created[t], t) for t in g.graph.get("autocast_cached", ())))
        dropped = tuple(sorted((created[t], t, r) for t, r in g.graph.get("dropped_released_seq", {}).items()
                               if ever_kept(created[t], r, leaf_end)))
        rk = rank_memory(g, per_rank=per_rank)

        def tr(attrs: dict, key: str) -> int:
            return attrs.get(key, 0) if calibrated else 0

        fields = dict(
            graph=g, rank=rk, calibrated=calibrated, leaves=leaves, leaf_end_seq=leaf_end,
            tensor_bytes=g.graph["tensor_bytes"], saves=saves, save_seqs=tuple(s[0] for s in saves),
            node_leaves=node_leaves, grad_seqs=grad_seqs, grad_suffix=tuple(suffix), casts=casts,
            cast_ids=frozenset(t for _, t in casts), tie_groups=tie_groups(g),
            dropped=dropped, dropped_ids=frozenset(t for _, t, _ in dropped),
        )
        # The bases need backward_static, which reads the fields above: a model without them first.
        partial = CostModel(**fields, forward_base_bytes=(), checkpointed_forward_base_bytes=(), backward_base_bytes=(),
                            tail_forward_base_bytes=0, tail_backward_base_bytes=0)
        fwd_base = tuple(rk.fwd_static_bytes + tr(g.nodes[leaf], "fwd_transient_bytes") for leaf in leaves)
        bwd_base = tuple(partial.backward_static(end, end)[0] + tr(g.nodes[leaf], "bwd_transient_bytes")
                         for leaf, end in zip(leaves, leaf_end))
        fwd_ckpt = tuple(rk.fwd_static_bytes + g.nodes[leaf]["ckpt_fwd_transient_bytes"]
                         if calibrated and "ckpt_fwd_transient_bytes" in g.nodes[leaf] else None for leaf in leaves)
        return CostModel(
            **fields, forward_base_bytes=fwd_base, checkpointed_forward_base_bytes=fwd_ckpt, backward_base_bytes=bwd_base,
            tail_forward_base_bytes=rk.fwd_static_bytes + tr(g.graph, "tail_fwd_transient_bytes"),
            tail_backward_base_bytes=(partial.backward_static(partial.tail_seq, ALIVE_SEQ)[0]
                                      + tr(g.graph, "tail_bwd_transient_bytes")),
        )

    @property
    def tail_seq(self) -> int:
        """Where the tail's gradients are counted from: after every forward use, so the tail's own
        gradients are in its measured temporaries (NOTE [ Peak-memory model ], Rule 5)."""
        return max(self.leaf_end_seq[-1] if self.leaf_end_seq else -1, self.graph.graph["forward_end_seq"])

    def forward_base(self, i: int, checkpointed: bool) -> int:
        """Window i's forward base, its leaf in a fully checkpointed region or not (NOTE [ Checkpointed forward windows ])."""
        ckpt = self.checkpointed_forward_base_bytes[i] if checkpointed else None
        return self.forward_base_bytes[i] if ckpt is None else ckpt

    def grads_after(self, seq: int) -> int:
        """Bytes of parameter gradients (one process) whose last forward use is after ``seq``."""
        return self.grad_suffix[bisect.bisect_right(self.grad_seqs, seq)]

    def backward_static(self, after_seq: int, at_seq: int) -> tuple[int, int, int]:
        """``(bytes, grads_bytes, extra_param_bytes)`` static at a point of backward, activations excepted.

        ``after_seq``: the gradients of parameters last used after it exist; ``at_seq``: the forward
        position the point's backward is at. Without FSDP: ``bwd_static`` and this rank's share of
        those gradients. Under FSDP2 the unsharded buffers depend on the block being run (see
        NOTE [ Per-rank memory ], Rule 2, backward): ``bwd_extra`` is only their largest case.
        """
        g, rk = self.graph, self.rank
        grads = -(-self.grads_after(after_seq) // rk.grad_divisor)
        if not rk.fsdp:
            return rk.bwd_static_bytes + grads, grads + rk.bwd_extra[1], rk.bwd_extra[0]
        n, root = rk.grad_divisor, g.graph.get("fsdp_root_param_bytes", 0)
        blocks = g.graph.get("fsdp_blocks", ())
        here = next((k for k, (lo, hi, _) in enumerate(blocks) if lo <= at_seq <= hi), None)
        if here is None:  # before every block (embeddings) or after them (final norm, head, loss)
            here = -1 if not blocks or at_seq < blocks[0][0] else len(blocks)
        size = lambda k: blocks[k][2] if 0 <= k < len(blocks) else 0  # noqa: E731
        running = size(here) if 0 <= here < len(blocks) else size(len(blocks) - 1) if here == len(blocks) else 0
        # Rule 2: after the last block only the last block is unsharded (the root prefetched it)
        prefetched = (size(here - 1) if 0 <= here < len(blocks) else 0) if n > 1 else 0
        pending_rs = size(here + 1) if here < len(blocks) else 0  # the next block's reduce-scatter input
        own = [self.grads_after(max(after_seq, lo - 1)) - self.grads_after(hi)
               for lo, hi, _ in blocks if hi > after_seq]
        running_grads = own[0] if own and 0 <= here < len(blocks) and blocks[here][1] > after_seq else 0
        # the running block's and the root's
        unsharded = running_grads + max(0, self.grads_after(after_seq) - sum(own))
        grads_extra = unsharded - -(-unsharded // n) + pending_rs
        params_extra = root + running + prefetched
        return rk.base_bytes + grads + grads_extra + params_extra, grads + grads_extra, params_extra

    def recompute_static_bytes(self, c: str) -> int:
        """Static memory and gradients alive while ``c`` is recomputed (its recompute probe's base
        without the temporaries)."""
        end = self.graph.nodes[c]["fwd_end_seq"]
        return self.backward_static(end, end)[0]

    def recompute_transient_bytes(self, c: str) -> int:
        """The temporaries T of ``c``'s recompute (NOTE [ A replay's temporaries ], NOTE [ What a replay
        allocates ]) and the replay's copy of the RNG state (Rule 7): ``solvers.replay.replay_temporaries``."""
        return replay_temporaries(self, c)

    def recomputed_bytes(self, c: str, upto_seq: int, kept: frozenset[int] = frozenset()) -> int:
        """Bytes the recompute of ``c`` re-creates that backward has not passed by ``upto_seq``: the
        tensors ``c`` saves that it also created (not its inputs, nor tensors it reached otherwise),
        and autocast's casts it saves wherever they were made: backward runs outside autocast, so
        each recompute casts afresh (a shared module's later calls reused the forward's cached cast).
        ``kept``: the outputs a selective policy keeps (held, not re-created; Rule 9)."""
        a = self.graph.nodes[c]
        lo_seq, hi_seq = a["fwd_start_seq"], a["fwd_end_seq"]
        created = self.graph.graph["tensor_created_seq"]
        casts = self.cast_ids
        lo = bisect.bisect_left(self.save_seqs, lo_seq)
        hi = bisect.bisect_right(self.save_seqs, min(hi_seq, upto_seq))
        ctx = self.graph.graph.get("ctx_held", frozenset())  # the replay's copies go with its graph
        seen = {t for _, t, _ in self.saves[lo:hi]
                if (lo_seq <= created.get(t, -1) <= hi_seq or t in casts) and t not in kept and t not in ctx}
        return sum(self.tensor_bytes[t] for t in seen)

    def replay_in_flight(self, c: str) -> int:
        """Bytes alive while ``c`` is recomputed that ``recomputed_bytes`` does not count: the gradients of its
        outputs and the outputs its replay re-makes (``solvers.replay.replay_in_flight``)."""
        return replay_in_flight(self, c)

    def cached_casts(self, pos: Mapping[int, int], seq: int, counted: frozenset[int] = frozenset()) -> int:
        """Bytes of autocast's cached casts made by ``seq`` and not held by then (``pos``: holding
        positions): the cache keeps them alive until the forward ends (NOTE [ Peak-memory model ],
        "Recipe"). ``counted``: in flight already."""
        return sum(self.tensor_bytes[t] for c, t in self.casts
                   if c <= seq and pos.get(t, ALIVE_SEQ + 1) > seq and t not in counted)

    def dropped_bytes(self, pos: Mapping[int, int], seq: int, counted: frozenset[int] = frozenset(),
                      after: int | None = None) -> int:
        """Bytes of the unit outputs the step's code keeps until it drops them (NOTE [ Outputs the caller
        drops ]) in the forward probe at ``seq`` (``kept_at``; ``after``: the tail's), not held by then
        (``pos``: holding positions). ``counted``: in flight already."""
        return sum(self.tensor_bytes[t] for c, t, r in self.dropped
                   if kept_at(c, r, seq, after) and pos.get(t, ALIVE_SEQ + 1) > seq and t not in counted)

    def holdings(self, chosen: frozenset[str], policies: Mapping[str, Any] | None = None,
                 offloaded: frozenset[str] = frozenset()) -> dict[int, int]:
        """tensor -> earliest holding position p(t), for the held tensors (see NOTE); ``chosen``
        are all regions, ``policies`` the selective ones' (Rule 9), ``offloaded`` the units whose
        saves go to host memory (Rule 10)."""
        pos: dict[int, int] = {}
        for pol in (policies or {}).values():
            for seq, t in pol.cached:
                if seq < pos.get(t, ALIVE_SEQ):
                    pos[t] = seq
        dropping = chosen | offloaded
        for seq, t, containers in self.saves:
            if dropping and any(c in dropping for c in containers):
                continue
            if seq < pos.get(t, ALIVE_SEQ):
                pos[t] = seq
        for c in chosen:
            start = self.graph.nodes[c]["fwd_start_seq"]
            for t in self.graph.nodes[c]["input_ids"]:
                if start < pos.get(t, ALIVE_SEQ):
                    pos[t] = start
        return pos

    def probes(self, chosen: frozenset[str], policies: Mapping[str, Any] | None = None,
               offloaded: frozenset[str] = frozenset()) -> Iterator[tuple[str, int, int, int]]:
        """(name, total_bytes, grads_bytes, extra_params_bytes) for every probe of the NOTE;
        ``chosen`` are all regions, ``policies`` the selective ones' (``policies_of``, Rule 9),
        ``offloaded`` the offloaded units (Rule 10)."""
        g, rk, tb = self.graph, self.rank, self.tensor_bytes
        policies = policies or {}
        kept = {c: pol.cached_ids for c, pol in policies.items()}
        pos = self.holdings(chosen, policies, offloaded)
        fwd_copy, bwd_copy = self.in_transfer(offloaded)
        held = sorted((p, tb[t]) for t, p in pos.items())
        held_pos = [p for p, _ in held]
        prefix = [0]
        for _, b in held:
            prefix.append(prefix[-1] + b)

        def held_upto(seq: int) -> int:
            return prefix[bisect.bisect_right(held_pos, seq)]

        fwd_p, fwd_g = rk.fwd_extra
        owner = {i: c for c in chosen | offloaded for i in self.node_leaves[c]}
        for i, (leaf, end) in enumerate(zip(self.leaves, self.leaf_end_seq)):
            in_flight_ids = g.nodes[leaf]["in_flight_ids"]
            h = held_upto(end)
            out_extra = sum(tb[t] for t in in_flight_ids if pos.get(t, ALIVE_SEQ) > end)
            out_extra += self.cached_casts(pos, end, in_flight_ids) + fwd_copy.get(i, 0)
            out_extra += self.dropped_bytes(pos, end, in_flight_ids)
            c = owner.get(i)
            full = c is not None and c not in policies and c not in offloaded
            yield f"forward of {leaf}", self.forward_base(i, full) + h + out_extra, fwd_g, fwd_p
            _, grads, extra = self.backward_static(end, end)  # the NOTE's grads(i): used after window i
            rec = (0 if c is None else self.restored_bytes(c, end) if c in offloaded
                   else self.recomputed_bytes(c, end, kept.get(c, frozenset())))
            yield f"backward of {leaf}", self.backward_base_bytes[i] + h + rec + bwd_copy.get(i, 0), grads, extra
        for c in sorted(chosen, key=lambda n: g.nodes[n]["order"]):  # ties resolve the same way every run
            end = g.nodes[c]["fwd_end_seq"]
            static, grads, extra = self.backward_static(end, end)
            total = (static + held_upto(end) + self.recomputed_bytes(c, end, kept.get(c, frozenset()))
                     + self.replay_in_flight(c)
                     + self.recompute_transient_bytes(c))
            yield f"recompute of {c}", total, grads, extra
        h_all, n = prefix[-1], len(self.leaves)
        yield ("end of forward", self.tail_forward_base_bytes + h_all + self.cached_casts(pos, ALIVE_SEQ)
               + self.dropped_bytes(pos, ALIVE_SEQ, after=self.leaf_end_seq[-1] if n else -1)
               + fwd_copy.get(n, 0),
               fwd_g, fwd_p)
        _, grads, extra = self.backward_static(self.tail_seq, ALIVE_SEQ)
        yield "start of backward", self.tail_backward_base_bytes + h_all + bwd_copy.get(n, 0), grads, extra
        all_grads = -(-g.graph["grads_bytes"] // rk.grad_divisor)
        ddp_buckets = fwd_g if g.graph.get("sharding") == "ddp" else 0
        yield "optimizer step", rk.opt_static_bytes, all_grads + ddp_buckets, 0

    @functools.cached_property
    def chain_terms(self) -> ChainTerms:
        """The model as a chain recurrence, for the DP (see ``ChainTerms``); computed on first use."""
        from solvers.chain import build_chain_terms

        return build_chain_terms(self)


__all__ = ["ALIVE_SEQ", "CostModel", "Estimate", "calibrate", "check_checkpoint_set", "close_ties", "is_tied",
           "policies_of", "simulate", "tie_groups", "window_bytes"]
