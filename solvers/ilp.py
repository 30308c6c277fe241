"""Optimal checkpoint sets on any graph (DAGs, nested candidates): an exact integer program.

The program is NOTE [ Peak-memory model ] (``solvers/cost_model.py``) written linearly, with
nothing approximated: a checkpoint set fits the budget in the program iff it fits under
``simulate`` (NOTE [ ILP formulation ] above ``build_program``; ``tests/test_ilp.py`` compares
every probe).

How ``solve`` proceeds:

1. Checkpointing nothing fits: done, optimal.
2. The sequential relaxation (``solvers/ilp_bound.py``, NOTE [ Sequential relaxation ]): a
   lower bound on recompute and a plan reaching it. If that plan fits under ``simulate`` it is
   optimal. On stacks of near-identical blocks this is the common case, where branch-and-bound
   alone often cannot close the last fraction of a percent.
3. Otherwise branch-and-bound on the program, with the bound as a cut (HiGHS only, see
   ``solve``). A plan a solver accepts within its tolerances but ``simulate`` puts over budget
   is excluded and the solve repeated (``_Run.fitting``).
4. No plan fits: the same program minimising the peak gives ``min_feasible_bytes``.
5. Among plans of the optimal recompute, a short search for a lower peak (``prefer_low_peak``).
6. The returned plan is judged by ``simulate`` (``solvers.base.judged``); a plan over budget
   there would be a bug, and is reported as such (a RuntimeWarning, status "infeasible").

Backends, through PuLP: HiGHS (``HiGHS``, needs highspy; the default, in-process) and CBC
(``PULP_CBC_CMD``, bundled with PuLP; an MPS file and a process per solve, and guarded against
wrong "optimal" answers, see ``_run_cbc``). Without highspy the HiGHS backend falls back to CBC
and says so in ``Solution.detail``. docs/benchmarks.md compares them (``benchmarks/ilp_scaling.py``).

Size: one binary per candidate, an OR variable only for a tensor whose "held by then" is not
affine in x, one running-sum variable per probe position where held bytes change; rows: one
per probe, per root-to-leaf path, per OR lower bound and per running sum. Building it is
O(S + n * b) for S save events, n candidates and b leaves; solving is exponential in the worst case.
"""

from __future__ import annotations

import bisect
import functools
import math
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal

import networkx as nx
import pulp

from solvers.cost_model import ALIVE_SEQ, CostModel, Estimate, close_ties, is_tied, simulate, tie_groups
from solvers.base import Solution, judged
from solvers.contract import Status, StopReason
from solvers.errors import SolverError
from solvers.ilp_bound import Bound, sequential_bound

Backend = Literal["highs", "cbc"]

DEFAULT_BACKEND: Backend = "highs"
"""See the module docstring: equal or faster than CBC in ``benchmarks/ilp_scaling.py``."""

_ANTICHAIN_CAP = 512
"""Truth tables are built over at most this many antichains per tensor (else no pruning)."""

_Affine = tuple[int, tuple[tuple[str, int], ...]]  # (constant, ((node, coefficient), ...)), sorted
_Term = tuple[str, object]  # ("save", frozenset of containing nodes) | ("input", node)
_ZERO: _Affine = (0, ())


# ----------------------------------------------------------------------------- program

Lin = dict  # linear form: {node id (x) | int (y index) | None (constant): coefficient}


@dataclass(frozen=True)
class Probe:
    """One probe of NOTE [ Peak-memory model ]: bytes = (H(bucket) + extra) * scale + const_bytes."""

    name: str  # as ``simulate`` names it: "backward of h.3", "optimizer step", ...
    bucket: int | None  # held bytes up to this bucket count; None: none (the optimizer step)
    extra: Lin  # in multiples of scale_bytes: recompute terms, in-flight tensors (NOTE [ ILP formulation ])
    const_bytes: int


@dataclass
class Program:
    """NOTE [ ILP formulation ] as plain data, before any solver sees it. Memory in multiples of
    ``scale_bytes``."""

    nodes: list[str]  # candidates, forward order
    forward_ms: dict[str, float]
    parent: dict[str, str | None]
    paths: list[tuple[str, ...]]  # root-to-leaf paths of two or more candidates: sum x <= 1
    ors: list[list[Lin]]  # y_k >= each form of ors[k] (forms may use earlier y)
    delta: dict[int, Lin]  # held bytes added at each bucket
    probes: list[Probe]
    scale_bytes: int  # a power of two (``_scale_bytes``)
    stats: dict = field(default_factory=dict)
    ties: tuple[tuple[str, ...], ...] = ()  # calls of one module: x equal (NOTE [ Tied calls ])
    alternatives: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Candidate -> its selective policies' variables (their ``parent`` is the candidate; Rule 7)."""


def _lin_add(acc: Lin, form: Lin, scale: float = 1.0) -> None:
    for k, c in form.items():
        acc[k] = acc.get(k, 0.0) + scale * c


def _lin_value(form: Lin, x: dict[str, float], y: list[float]) -> float:
    total = 0.0
    for k, c in form.items():
        total += c if k is None else c * (y[k] if isinstance(k, int) else x.get(k, 0.0))
    return total


def probe_values(program: Program, chosen: frozenset[str]) -> dict[str, float]:
    """Each probe's bytes in the program at ``chosen`` (least y and H), by simulate's probe name.

    ``simulate`` reports the same values for the probes it has (it has "recompute of c" only for
    checkpointed c); the tests compare the two.
    """
    x = {v: 1.0 if v in chosen else 0.0 for v in program.nodes}
    y: list[float] = []
    for lows in program.ors:  # a form refers only to earlier y
        y.append(max(_lin_value(lo, x, y) for lo in lows))
    held, running = {}, 0.0
    for b in range(max([*program.delta, *(p.bucket or 0 for p in program.probes), 0]) + 1):
        running += _lin_value(program.delta.get(b, {}), x, y)
        held[b] = running
    return {p.name: ((held[p.bucket] if p.bucket is not None else 0.0) + _lin_value(p.extra, x, y))
            * program.scale_bytes + p.const_bytes for p in program.probes}


def _variable(prob: pulp.LpProblem, name: str, low: float | None, up: float | None = None,
              cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    """A new variable: PuLP 3's ``add_variable`` (PuLP 4 requires it), ``LpVariable`` before."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat)
    return pulp.LpVariable(name, low, up, cat)


def _row(prob: pulp.LpProblem, name: str) -> pulp.LpConstraint | None:
    """A row by name: PuLP 3's ``get_constraint_by_name``, the constraints dict before."""
    if hasattr(prob, "get_constraint_by_name"):
        return prob.get_constraint_by_name(name)
    return prob.constraints.get(name)


def _sanitize(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", s)


def _ancestors(g: nx.DiGraph) -> dict[str, frozenset[str]]:
    out = {}
    for v in g.nodes:
        acc, p = [], g.nodes[v]["parent"]
        while p is not None:
            acc.append(p)
            p = g.nodes[p]["parent"]
        out[v] = frozenset(acc)
    return out


_POLICY_MARK = "@sac"
"""Variable id of policy j of candidate v: f"{v}@sac{j}" (NOTE [ ILP formulation ], Rule 7)."""


def policy_var(v: str, j: int) -> str:
    return f"{v}{_POLICY_MARK}{j}"


def split_vars(chosen: Iterable[str]) -> tuple[list[str], dict[str, int]]:
    """Chosen variables -> (checkpointed candidates, selective {candidate: policy index})."""
    full, sel = [], {}
    for var in chosen:
        base, mark, j = var.rpartition(_POLICY_MARK)
        if mark and j.isdigit():
            sel[base] = int(j)
        else:
            full.append(var)
    return full, sel


def simulate_vars(g: nx.DiGraph, chosen: Iterable[str]) -> Estimate:
    """``simulate`` of a set of chosen variables (candidates and policies)."""
    full, sel = split_vars(chosen)
    return simulate(g, full, sel)


@dataclass(frozen=True)
class _Vars:
    """The program's 0/1 variables (NOTE [ ILP formulation ], Rules 1 and 7): one per candidate and
    one per selective policy of a candidate, each with the candidate it stands for."""

    cands: list[str]  # candidates, forward order
    alts: dict[str, tuple[str, ...]]  # candidate -> its policy variables
    names: list[str]  # every variable: each candidate followed by its policies
    base: dict[str, str]  # variable -> its candidate
    kept: dict[str, frozenset[int]]  # policy variable -> the tensors it keeps

    @staticmethod
    def of(g: nx.DiGraph) -> _Vars:
        cands = sorted(g.nodes, key=lambda n: g.nodes[n]["order"])
        alts = {v: tuple(policy_var(v, j) for j in range(len(g.nodes[v].get("menu", ())))) for v in cands}
        base = {pv: v for v in cands for pv in alts[v]} | {v: v for v in cands}
        kept = {pv: g.nodes[v]["menu"][j].cached_ids for v in cands for j, pv in enumerate(alts[v])}
        return _Vars(cands, alts, [var for v in cands for var in (v, *alts[v])], base, kept)

    def ancestors(self, anc: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
        """``anc`` over variables: a policy conflicts with its candidate, the candidate's other
        policies, and everything the candidate conflicts with."""
        out = {v: a | {pv for u in a for pv in self.alts[u]} for v, a in anc.items()}
        for v, pvs in self.alts.items():
            for j, pv in enumerate(pvs):
                out[pv] = out[v] | {v} | set(pvs[:j])
        return out

    def forward_ms(self, g: nx.DiGraph) -> dict[str, float]:
        """Each variable's recompute: the candidate's forward, or the policy's ``recompute_ms``."""
        return {v: g.nodes[v]["forward_ms"] for v in self.cands} | {
            pv: g.nodes[v]["menu"][j].recompute_ms for v in self.cands for j, pv in enumerate(self.alts[v])}


def _term_affine(term: _Term) -> _Affine:
    kind, p = term
    if kind == "save":
        return (1, tuple(sorted((c, -1) for c in p)))  # type: ignore[union-attr]
    return (0, ((p, 1),))  # type: ignore[list-item]


def _term_active(term: _Term, chosen: frozenset[str]) -> bool:
    kind, p = term
    return not (p & chosen) if kind == "save" else p in chosen  # type: ignore[operator]


def _antichains(nodes: list[str], anc: dict[str, frozenset[str]]) -> list[frozenset[str]] | None:
    """All antichains of ``nodes`` (empty first), or None past ``_ANTICHAIN_CAP``."""
    out: list[frozenset[str]] = []

    def rec(start: int, cur: frozenset[str]) -> bool:
        out.append(cur)
        if len(out) > _ANTICHAIN_CAP:
            return False
        for j in range(start, len(nodes)):
            v = nodes[j]
            if all(v not in anc[u] and u not in anc[v] for u in cur) and not rec(j + 1, cur | {v}):
                return False
        return True

    return out if rec(0, frozenset()) else None


def _fit_affine(table: tuple[bool, ...], chains: list[frozenset[str]],
                index: dict[frozenset[str], int], nodes: list[str]) -> _Affine | None:
    """The affine function of x equal to the Boolean ``table`` on every antichain, if any."""
    c0 = int(table[0])
    coef = {v: int(table[index[frozenset((v,))]]) - c0 for v in nodes}
    for a, val in zip(chains, table):
        if c0 + sum(coef[v] for v in a) != int(val):
            return None
    return (c0, tuple(sorted((v, c) for v, c in coef.items() if c)))


def _tensor_steps(groups: list[tuple[int, set[_Term]]], anc: dict[str, frozenset[str]]) -> tuple:
    """The steps (bucket, representation) of one tensor's prefix ORs; see NOTE [ ILP formulation ].

    A representation is ("aff", affine) or ("or", frozenset of lower bounds), a lower bound
    being ("aff", affine) or ("prev",) for the previous step's variable.
    """
    nodes = sorted({n for _, terms in groups for kind, p in terms
                    for n in (p if kind == "save" else (p,))})  # type: ignore[union-attr]
    chains = _antichains(nodes, anc)
    index = {a: k for k, a in enumerate(chains)} if chains is not None else {}
    steps: list[tuple[int, tuple]] = []
    acc: set[_Term] = set()
    prev_table: tuple[bool, ...] | None = tuple(False for _ in chains) if chains is not None else None
    prev_rep: tuple = ("aff", _ZERO)
    for bucket, terms in groups:
        acc |= terms
        rep: tuple | None = None
        if chains is not None:
            table = tuple(any(_term_active(t, a) for t in acc) for a in chains)
            if table == prev_table:
                continue  # these holdings are never the earliest active one
            prev_table = table
            aff = _fit_affine(table, chains, index, nodes)
            if aff is not None:
                rep = ("aff", aff)
        elif len(acc) == 1:
            rep = ("aff", _term_affine(next(iter(acc))))
        if rep is None:
            lows = {("aff", _term_affine(t)) for t in terms}
            if prev_rep != ("aff", _ZERO):
                lows.add(("prev",) if prev_rep[0] == "or" else prev_rep)
            rep = ("or", frozenset(lows))
        steps.append((bucket, rep))
        prev_rep = rep
    return tuple(steps)


# NOTE [ ILP formulation ]
#
# Rule 1. Variables.
# x_v in {0, 1} per candidate v (checkpoint v). Antichain: per root-to-leaf path of the
# candidate tree, sum x <= 1 ("antichain ..."). Hence a save event with containing nodes S is
# active (held) iff 1 - sum_{c in S} x_c = 1, an affine expression; a checkpoint input of c is
# active iff x_c.
#
# Rule 2. Buckets and prefix ORs.
# Only comparisons "holding position <= probe position" matter, so positions are replaced by
# *buckets*: the rank of the first probe position (a leaf's or a candidate's fwd_end_seq) at or
# after them. Per tensor t, with its holdings grouped by bucket b_1 < b_2 < ..., "t is held
# with p(t) <= b_j" is F_j = OR of the holdings in buckets b_1..b_j. Per prefix j:
#   - F_j == F_{j-1} (decided on the truth table over the antichains of the few candidates the
#     tensor's holdings mention): the new holdings can never be earliest; nothing is added.
#   - F_j affine on those antichains (e.g. "saved inside B, or an input of checkpointed B" is
#     1 - sum of x over B's ancestors): F_j is that affine expression; no variable.
#   - otherwise a continuous y in [0, 1] with y >= F_{j-1} (its expression or variable) and
#     y >= each new holding ("or ..."). y may exceed the OR, which only over-counts memory, so
#     every plan the program accepts fits under simulate, and every plan that fits under
#     simulate is accepted with y = OR.
# Tensors with the same steps (and the same "in flight" leaf, below) are one group with the
# summed bytes, sharing the y variables.
#
# Rule 3. Running sums.
# H_b = held bytes with p <= bucket b: H_b = H_{b-1} + sum_t bytes_t * (F_{j(b)} - F_{j(b)-1})
# ("held ..."), a running sum, so each probe row has a handful of entries instead of every
# tensor.
#
# Rule 4. Probes.
# Each is one row against the peak variable P ("P >= probe"):
#   forward of leaf i:    H(e_i) - sum_{t in out_i} bytes_t * F_t(e_i) + const: a tensor in
#                         flight costs its bytes held or not, so its held term cancels (same
#                         expression, exact) and its bytes go into the constant.
#   backward of leaf i:   H(e_i) + sum_{c containing leaf i} x_c * recomputed(c, e_i) + const;
#                         at most one such x_c is 1 (antichain), as in simulate's ``owner``.
#   recompute of c:       H(end c) + x_c * (recomputed(c) + G_c + max T_fwd) - (1 - x_c) * M_c + const.
#                         simulate has this probe only when c is checkpointed. With x_c = 0 the
#                         row must not cut anything: M_c is how much its constant exceeds that of
#                         the backward of the first leaf ending at or after end(c) (or of the
#                         start of backward), which has at least the same H and R >= 0. M_c > 0
#                         only when parameters used between end(c) and that leaf's end have
#                         gradients that leaf's backward does not count (NOTE [ Peak-memory
#                         model ], Rule 5).
#   end of forward, start of backward: H(all) + const;  optimizer step: P >= const.
# Forward of leaf i and end of forward also count autocast's cached casts not held then
# (NOTE [ Peak-memory model ], Rule 8; ``_cast_terms``): a cast all of whose saves lie inside a
# candidate c adds x_c * its bytes (checkpointing c drops the save, the cache keeps the cast);
# a cast saved later or never goes into the constant.
#
# Rule 5. Tied calls.
# x_v = x_w for the calls v, w of one module ("tied ..."; NOTE [ Tied calls ]).
#
# Rule 7. Selective policies (NOTE [ Peak-memory model ], Rule 9).
# Policy j of candidate v is one more variable p = x_{v,j} that stands for v as a region: it
# joins every antichain row v is in (so v, its policies and its relatives are at most one), a
# save inside v is dropped when any of v's variables is 1, v's inputs are held by each, and
# the outputs p keeps are held by p alone, positioned as ``Policy.cached`` says. Its backward
# and recompute rows count recomputed(v) less what p keeps; its objective coefficient is p's
# recompute_ms. Tied calls have no menu (planner/model/graph.py), so Rule 5 is unchanged.
#
# Rule 6. Objectives.
# Recompute model: min sum_v forward_ms(v) x_v with P <= budget + 1/2 (probes are whole bytes,
# so "<= budget + 1/2" is "<= budget" with half a byte of slack against solver tolerances).
# Minimum peak model (status infeasible): min P, no budget. Tie-break (``prefer_low_peak``):
# min P subject to recompute <= the optimum, kept only if simulate confirms it is no slower.
# Not an epsilon * P term in the objective: within the solver's gap tolerance that term could
# buy a lower peak with more recompute; a separate, time-boxed solve cannot.


def build_program(g: nx.DiGraph, *, term_bits: int = 24) -> Program:
    """The program of NOTE [ ILP formulation ] for ``g``, in four steps: the buckets, each
    tensor's holdings as steps of prefix ORs, the running sums H_b, and the probe rows. Memory is
    counted in multiples of ``scale_bytes`` that keep every term below 2^``term_bits`` of them."""
    model = CostModel.of(g)
    scale = _scale_bytes(model, term_bits)
    var = _Vars.of(g)
    anc = var.ancestors(_ancestors(g))
    buckets = _Buckets.of(g, model)
    groups, n_tensors = _tensor_groups(g, model, var, anc, buckets)
    ors, delta, in_flight = _running_sums(groups, buckets, scale)
    probes, big_m = _probe_rows(g, model, var, buckets, in_flight, scale)
    paths = [p for p in ((leaf, *var.alts[leaf], *sorted(anc[leaf])) for leaf in model.leaves) if len(p) > 1]
    stats = {"scale_bytes": scale, "candidates": len(var.cands), "policies": len(var.names) - len(var.cands),
             "leaves": len(model.leaves),
             "tensors": n_tensors, "tensor_groups": len(groups), "or_variables": len(ors), "or_rows": sum(map(len, ors)),
             "buckets": buckets.last + 1, "probe_rows": len(probes), "antichain_rows": len(paths),
             "big_m_rows": big_m}
    ties = tie_groups(g)
    stats["tie_rows"] = sum(len(group) - 1 for group in ties)
    parent = {v: g.nodes[v]["parent"] for v in var.cands} | {pv: var.base[pv] for pv in var.kept}
    return Program(var.names, var.forward_ms(g), parent, paths, ors, delta, probes, scale, stats, ties,
                   {v: a for v, a in var.alts.items() if a})


def _scale_bytes(model: CostModel, term_bits: int) -> int:
    """Memory is counted in multiples of 2^k bytes, k chosen so that the largest term is below
    2^term_bits of them: CBC's preprocessing loses feasibility with raw byte counts of 1e10 ("possible
    tolerance issue"), and its branch and bound with terms up to 2^24 (see ``CBC_TERM_BITS``).
    Powers of two keep every byte count exactly representable."""
    rk = model.rank
    magnitude = max(rk.opt_static_bytes, rk.bwd_static_bytes + sum(model.tensor_bytes.values()), 1)
    return 2 ** max(0, magnitude.bit_length() - term_bits)


@dataclass(frozen=True)
class _Buckets:
    """Positions replaced by their rank among the probe positions (NOTE [ ILP formulation ])."""

    thresholds: tuple[int, ...]  # every leaf's and candidate's fwd_end_seq, sorted
    leaf: tuple[int, ...]  # the bucket of each leaf's window end
    last: int  # positions after every probe: only the tail probes see them

    @staticmethod
    def of(g: nx.DiGraph, model: CostModel) -> _Buckets:
        ends = {a["fwd_end_seq"] for _, a in g.nodes(data=True)}
        thresholds = tuple(sorted(set(model.leaf_end_seq) | ends))
        return _Buckets(thresholds, tuple(bisect.bisect_left(thresholds, e) for e in model.leaf_end_seq),
                        len(thresholds))

    def __call__(self, pos: int) -> int:
        return bisect.bisect_left(self.thresholds, pos)


def _tensor_groups(g: nx.DiGraph, model: CostModel, var: _Vars, anc: dict[str, frozenset[str]],
                   bucket: _Buckets) -> tuple[dict[tuple, int], int]:
    """Each held tensor's steps of prefix ORs; tensors with the same steps (and the same leaf
    they are in flight in, where that matters) are one group with their summed bytes."""
    holds: dict[int, dict[int, set[_Term]]] = {}
    for seq, t, containers in model.saves:
        regions = frozenset(containers) | {pv for c in containers for pv in var.alts[c]}
        holds.setdefault(t, {}).setdefault(bucket(seq), set()).add(("save", regions))
    for v in var.names:
        a = g.nodes[var.base[v]]
        for t in a["input_ids"]:
            holds.setdefault(t, {}).setdefault(bucket(a["fwd_start_seq"]), set()).add(("input", v))
    for v in var.cands:  # an output a policy keeps is held iff that policy is chosen: like an input
        for j, pv in enumerate(var.alts[v]):
            for seq, t in g.nodes[v]["menu"][j].cached:
                holds.setdefault(t, {}).setdefault(bucket(seq), set()).add(("input", pv))
    out_leaf = {t: i for i, leaf in enumerate(model.leaves) for t in g.nodes[leaf]["in_flight_ids"]}
    step_cache: dict[tuple, tuple] = {}
    groups: dict[tuple, int] = {}
    for t, by_bucket in holds.items():
        key = tuple(sorted((b, frozenset(ts)) for b, ts in by_bucket.items()))
        steps = step_cache.get(key)
        if steps is None:
            steps = step_cache[key] = _tensor_steps([(b, set(ts)) for b, ts in key], anc)
        if steps:
            i = out_leaf.get(t)
            flying = i if i is not None and steps[0][0] <= bucket.leaf[i] else None
            groups[(steps, flying)] = groups.get((steps, flying), 0) + model.tensor_bytes[t]
    return groups, len(holds)


def _running_sums(groups: dict[tuple, int], bucket: _Buckets,
                  scale: int) -> tuple[list[list[Lin]], dict[int, Lin], dict[int, Lin]]:
    """The OR variables' lower bounds, the held bytes each bucket adds to H_b (``delta``), and per
    leaf the held terms of its in-flight tensors, which its forward probe cancels."""
    ors: list[list[Lin]] = []
    delta: dict[int, Lin] = {}
    in_flight: dict[int, Lin] = {}
    for (steps, flying), nbytes in sorted(groups.items(), key=lambda kv: repr(kv[0])):
        w = nbytes / scale
        prev: Lin = {}
        reps: list[tuple[int, Lin]] = []
        for b, rep in steps:
            if rep[0] == "aff":
                cur = _affine_form(rep[1])
            else:
                ors.append([{k: 1.0 for k in prev if isinstance(k, int)} if low[0] == "prev"
                            else _affine_form(low[1]) for low in sorted(rep[1], key=repr)])
                cur = {len(ors) - 1: 1.0}
            d = delta.setdefault(b, {})
            _lin_add(d, cur, w)
            _lin_add(d, prev, -w)
            reps.append((b, cur))
            prev = cur
        if flying is not None:
            last = [r for b, r in reps if b <= bucket.leaf[flying]][-1]
            _lin_add(in_flight.setdefault(flying, {}), last, -w)
    for d in delta.values():
        for k in [k for k, c in d.items() if c == 0]:
            del d[k]
    return ors, delta, in_flight


def _affine_form(a: _Affine) -> Lin:
    return {None: float(a[0]), **{v: float(c) for v, c in a[1]}}


def _probe_rows(g: nx.DiGraph, model: CostModel, var: _Vars, bucket: _Buckets,
                in_flight: dict[int, Lin], scale: int) -> tuple[list[Probe], int]:
    """The probes of NOTE [ Peak-memory model ], named as simulate names them, on the cost model's
    bases; and how many recompute rows need a big-M term."""
    probes: list[Probe] = []
    base, kept = var.base, var.kept
    contains = {i: [c for c in var.names if i in model.node_leaves[base[c]]] for i in range(len(model.leaves))}
    casts = _cast_terms(g, model, var, scale)
    for i, (leaf, e) in enumerate(zip(model.leaves, model.leaf_end_seq)):
        in_flight_ids = g.nodes[leaf]["in_flight_ids"]
        cast_form, cast_bytes = casts(e, in_flight_ids)
        fwd_extra = dict(in_flight.get(i, {}))
        _lin_add(fwd_extra, cast_form)
        out_bytes = sum(model.tensor_bytes[t] for t in in_flight_ids)
        probes.append(Probe(f"forward of {leaf}", bucket.leaf[i], fwd_extra,
                            model.forward_base_bytes[i] + out_bytes + cast_bytes))
        rec = {c: model.recomputed_bytes(base[c], e, kept.get(c, frozenset())) / scale for c in contains[i]}
        probes.append(Probe(f"backward of {leaf}", bucket.leaf[i], {c: r for c, r in rec.items() if r},
                            model.backward_base_bytes[i]))
    big_m = 0
    for c in var.names:
        v = base[c]
        end = g.nodes[v]["fwd_end_seq"]
        const = model.recompute_static_bytes(v)
        later = bisect.bisect_left(model.leaf_end_seq, end)
        m = max(0, const - (model.backward_base_bytes[later] if later < len(model.leaves)
                            else model.tail_backward_base_bytes))
        big_m += m > 0
        coef = (model.recomputed_bytes(v, end, kept.get(c, frozenset())) + model.replay_in_flight(v)
                + model.recompute_transient_bytes(v) + m) / scale
        extra = {**({c: coef} if coef else {}), **({None: -m / scale} if m else {})}
        probes.append(Probe(f"recompute of {c}", bucket(end), extra, const))
    cast_form, cast_bytes = casts(ALIVE_SEQ)
    probes.append(Probe("end of forward", bucket.last, cast_form, model.tail_forward_base_bytes + cast_bytes))
    probes.append(Probe("start of backward", bucket.last, {}, model.tail_backward_base_bytes))
    probes.append(Probe("optimizer step", None, {}, model.rank.opt_static_bytes))
    return probes, big_m


def _cast_terms(g: nx.DiGraph, model: CostModel, var: _Vars,
                scale: int) -> Callable[..., tuple[Lin, int]]:
    """seq -> (form in multiples of ``scale``, constant bytes) of autocast's cached casts made by
    ``seq``, not held then and not in ``in_flight`` (counted as such) (NOTE [ Peak-memory model ],
    Rule 8). A cast saved before ``seq`` is unheld when a candidate containing all its saves is
    checkpointed: x_c for each such c (an antichain picks at most one; a policy that keeps the
    cast holds it instead); a cast saved only later, or never, is alive through the cache
    whatever is checkpointed."""
    saves: dict[int, list[int]] = {}
    for seq, t, _ in model.saves:
        saves.setdefault(t, []).append(seq)
    span = {v: (g.nodes[var.base[v]]["fwd_start_seq"], g.nodes[var.base[v]]["fwd_end_seq"]) for v in var.names}
    inputs = {t for v in var.cands for t in g.nodes[v]["input_ids"]}  # casts are not, in models we know

    def at(seq: int, in_flight: frozenset[int] = frozenset()) -> tuple[Lin, int]:
        form: Lin = {}
        const = 0
        for created, t in model.casts:
            seqs = saves.get(t, [])
            if created > seq or t in in_flight:
                continue
            if not seqs or min(seqs) > seq or t in inputs:  # a unit's input: as if never held (over-counts)
                const += model.tensor_bytes[t]
                continue
            for v, (lo, hi) in span.items():
                if lo <= min(seqs) and max(seqs) <= hi and t not in var.kept.get(v, ()):
                    form[v] = form.get(v, 0.0) + model.tensor_bytes[t] / scale
        return form, const

    return at


@dataclass
class IlpModel:
    """A ``Program`` as a PuLP problem, reusable across objectives and caps."""

    program: Program
    prob: pulp.LpProblem
    x: dict[str, pulp.LpVariable]
    peak: pulp.LpVariable
    recompute: pulp.LpAffineExpression
    stats: dict

    def set_cap(self, cap_bytes: int | None) -> None:
        """P <= cap (None: no cap). Probes are whole bytes: half a byte of slack is exact."""
        self.peak.upBound = None if cap_bytes is None else (cap_bytes + 0.5) / self.program.scale_bytes

    def recompute_row(self, name: str, sense: int, rhs: float | None) -> None:
        """Set the row ``recompute <= rhs`` (sense LE) or ``>= rhs`` (GE); None switches it off.

        Rows are switched off, not deleted (PuLP has no public way to delete a row).
        """
        row = _row(self.prob, name)
        if row is None:
            if rhs is None:
                return
            row = pulp.LpConstraint(self.recompute, sense, name, 0.0)
            self.prob.addConstraint(row, name)
        off = sum(self.program.forward_ms.values()) + 1.0 if sense == pulp.LpConstraintLE else -1.0
        row.constant = -(off if rhs is None else rhs)


def build_model(g: nx.DiGraph, budget_bytes: int | None = None, program: Program | None = None) -> IlpModel:
    """The PuLP problem of NOTE [ ILP formulation ]: min recompute, P <= budget when given."""
    pg = program or build_program(g)
    prob = pulp.LpProblem("remat_checkpoint", pulp.LpMinimize)
    x = {v: _variable(prob, f"x{i}_{_sanitize(v)}", 0, 1, pulp.LpBinary) for i, v in enumerate(pg.nodes)}
    y: list[pulp.LpVariable] = []

    def expr(form: Lin) -> pulp.LpAffineExpression:
        return pulp.LpAffineExpression(
            [((y[k] if isinstance(k, int) else x[k]), c) for k, c in form.items() if k is not None and c],
            constant=form.get(None, 0.0))

    for path in pg.paths:
        prob.addConstraint(pulp.lpSum(x[v] for v in path) <= 1, f"antichain_{_sanitize(path[0])}")
    for group in pg.ties:  # every call of a module, or none (NOTE [ Tied calls ])
        for v in group[1:]:
            prob.addConstraint(x[v] - x[group[0]] == 0, f"tied_{_sanitize(v)}")
    for k, lows in enumerate(pg.ors):
        y.append(_variable(prob, f"y{k}", 0, 1))
        for j, lo in enumerate(lows):
            prob.addConstraint(y[k] - expr(lo) >= 0, f"or_{k}_{j}")
    # H_b: running sum of the deltas, a variable wherever a delta has variables
    held: dict[int, pulp.LpAffineExpression] = {}
    running = pulp.LpAffineExpression()
    n_held = 0
    for b in range(max([*pg.delta, *(p.bucket or 0 for p in pg.probes), 0]) + 1):
        d = pg.delta.get(b)
        if d:
            if any(k is not None for k in d):
                hv = _variable(prob, f"H{b}", 0)
                prob.addConstraint(hv - running - expr(d) == 0, f"held_{b}")
                running = pulp.LpAffineExpression(hv)
                n_held += 1
            else:
                running = running + d[None]
        held[b] = running
    peak = _variable(prob, "P", 0)
    for i, p in enumerate(pg.probes):
        h = held[p.bucket] if p.bucket is not None else pulp.LpAffineExpression()
        e = h + expr(p.extra)
        e = pulp.LpAffineExpression({v: c for v, c in e.items() if c != 0}, constant=e.constant)
        prob.addConstraint(e - peak <= -p.const_bytes / pg.scale_bytes, f"p{i}_{_sanitize(p.name)}")
    recompute = pulp.lpSum(pg.forward_ms[v] * x[v] for v in pg.nodes)
    prob.setObjective(recompute)
    stats = {**pg.stats, "binaries": len(x), "held_variables": n_held,
             "variables": len(x) + len(y) + n_held + 1, "constraints": prob.numConstraints()}
    model = IlpModel(pg, prob, x, peak, recompute, stats)
    model.set_cap(budget_bytes)
    return model


# ----------------------------------------------------------------------------- backends


@dataclass(frozen=True)
class _Outcome:
    state: Literal["optimal", "feasible", "infeasible", "none"]  # "none": no solution in time
    chosen: frozenset[str]
    objective: float | None
    bound: float | None
    seconds: float
    note: str = ""  # something worth saying in Solution.detail


def _highs_available() -> bool:
    return bool(pulp.HiGHS().available())


@functools.cache
def _swallow_highs_banner() -> None:
    """highspy prints a banner to the C-level stdout when the first ``Highs`` is made, which
    would corrupt machine-readable output (``--json``): make that first one into /dev/null."""
    import highspy

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):  # no usable stdout: nothing to protect
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


CBC_TERM_BITS = 16
"""CBC's program counts memory in units that keep every term below 2^16 (HiGHS's: 2^24, as the
plans on file were made). With terms up to 2^24 (whole bytes on a 10 MB step), CBC 2.10.3 called a
worse plan optimal in 5 of 7,225 programs of tests/test_ilp.py's nested DAGs, under each set of
options tried (default, heuristics and cuts off, strong branching off too); in nested_dag(220) its
branch and bound dropped nodes holding the optimum whose LPs, solved afresh, are feasible. With
terms below 2^16: none. Half a byte stays above CBC's primal tolerance (1e-9) for steps up to 2^44
bytes: plans stay byte-exact. ``python benchmarks/cbc_check.py`` (docs/benchmarks.md)."""

CBC_PROOF_OPTIONS = ["heur off", "cuts off"]
"""CBC options of the re-solve that checks an answer ``_cbc_distrust`` rejects: heuristics and cuts
off avoided both bugs it names on every case seen; "heur off" alone once called a feasible model
infeasible."""


def _solve(model: IlpModel, backend: Backend, time_limit_s: float | None, mip_gap: float,
           threads: int | None) -> _Outcome:
    t0 = time.perf_counter()
    limit = None if time_limit_s is None else max(0.05, time_limit_s)
    if backend == "highs":
        state, objective, bound, note = _run_highs(model.prob, limit, mip_gap, threads)
        return _Outcome(state, _chosen(model, state), objective, bound, time.perf_counter() - t0, note)
    state, objective, bound, note = _run_cbc(model.prob, limit, mip_gap, threads, [])
    chosen = _chosen(model, state)
    if not note:
        return _Outcome(state, chosen, objective, bound, time.perf_counter() - t0, note)
    # See _cbc_distrust: the answer is a plan (when there is one) but no proof; CBC_PROOF_OPTIONS re-solves.
    first = (state if state in ("optimal", "feasible") else "none", chosen, objective)
    left = None if limit is None else limit - (time.perf_counter() - t0)
    if left is not None and left <= 0.05:
        state, bound = ("feasible", None) if first[0] != "none" else ("none", None)
        return _Outcome(state, chosen, objective, bound, time.perf_counter() - t0, note)
    state, objective, bound, again = _run_cbc(model.prob, left, mip_gap, threads, CBC_PROOF_OPTIONS)
    chosen = _chosen(model, state)
    note += "; re-solved with CBC's heuristics and cuts off"
    if again and state == "optimal":  # still untrusted: a plan, but no proof
        state, bound = "feasible", None
        note += f", which was untrusted too ({again})"
    if first[0] != "none" and (state not in ("optimal", "feasible") or first[2] < objective - _tolerance(objective)):
        note += f"; kept the first plan ({first[2]:.6g}), the re-solve said {state} ({objective})"
        state, chosen, objective, bound = "feasible", first[1], first[2], None
    return _Outcome(state, chosen, objective, bound, time.perf_counter() - t0, note)


def _chosen(model: IlpModel, state: str) -> frozenset[str]:
    if state not in ("optimal", "feasible"):
        return frozenset()
    return frozenset(v for v, var in model.x.items() if (var.varValue or 0) > 0.5)


def _run_highs(prob: pulp.LpProblem, limit: float | None, mip_gap: float, threads: int | None):
    from highspy import HighsModelStatus as ms

    _swallow_highs_banner()
    prob.solve(pulp.HiGHS(msg=False, timeLimit=limit, gapRel=mip_gap, gapAbs=1e-9, threads=threads))
    h = prob.solverModel
    st, info = h.getModelStatus(), h.getInfo()
    has_sol = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if st == ms.kOptimal:
        state = "optimal"
    elif st in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        state = "infeasible"
    else:
        state = "feasible" if has_sol else "none"
    found = state in ("optimal", "feasible")
    return (state, info.objective_function_value if found else None, info.mip_dual_bound if found else None, "")


def _run_cbc(prob: pulp.LpProblem, limit: float | None, mip_gap: float, threads: int | None, extra: list[str]):
    """CBC through PuLP, with its log read back for the bound and for a known CBC 2.10.3 bug.

    The bug: after "Reduced cost fixing - restarting search", the restarted search may report
    an "Integer solution" below the root bound (494.7 ms with the root at 596.95) and end the
    whole search with a worse plan called optimal (597.263 where 597.119 exists). Any integer
    solution in the log below the returned objective marks such a run; the note says so.
    """
    with tempfile.TemporaryDirectory(prefix="remat_cbc_") as tmp:
        log = os.path.join(tmp, "cbc.log")
        with warnings.catch_warnings():  # PuLP 3.3 deprecates its bundled CBC for PuLP 4
            warnings.simplefilter("ignore", DeprecationWarning)
            # A plan within half a byte of the budget is 5e-8 of a 1e7-byte row. With CBC's
            # default tolerances (1e-7) it returned worse plans as "optimal"; its preprocessing
            # (Cgl) did too even with tight tolerances ("Cbc3007W No integer variables").
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=limit, gapRel=mip_gap, gapAbs=1e-9, threads=threads,
                                       logPath=log, options=["integerT 1e-9", "primalT 1e-9", "preprocess off",
                                                             *extra])
            prob.solve(solver)
        text = Path(log).read_text() if os.path.exists(log) else ""
    has_sol = prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    if prob.status == pulp.LpStatusInfeasible:
        state = "infeasible"
    elif prob.sol_status == pulp.LpSolutionOptimal and prob.status == pulp.LpStatusOptimal:
        state = "optimal"
    else:
        state = "feasible" if has_sol else "none"
    objective = pulp.value(prob.objective) if state in ("optimal", "feasible") else None
    bound = _cbc_bound(text, objective) if state == "feasible" else objective
    return state, objective, bound, _cbc_distrust(text, objective)


def _cbc_distrust(log: str, objective: float | None) -> str:
    """Why CBC's answer is not to be trusted (empty when nothing in its log says so).

    Two CBC 2.10.3 bugs end the search with a plan called optimal that is not proven so:
    - a search restarted after reduced-cost fixing reports an "Integer solution" below the answer;
    - after the feasibility pump, "The LP relaxation is infeasible or too expensive" stops the root
      node although its cuts left the bound below the pump's answer (14.08 against 16.457, 0 nodes).
    """
    if objective is None:
        return ""
    tol = 1e-6 * max(1.0, abs(objective))
    reported = [float(v) for v in re.findall(r"Integer solution of\s*([-+0-9.eE]+)", log)]
    if reported and min(reported) < objective - tol:
        return f"CBC reported a spurious solution ({min(reported):.6g} below its answer {objective:.6g}) after a restart"
    root = re.findall(r"Cuts at root node changed objective from\s*[-+0-9.eE]+\s*to\s*([-+0-9.eE]+)", log)
    if "LP relaxation is infeasible or too expensive" in log and root and float(root[-1]) < objective - tol:
        return (f"CBC stopped its root node at bound {float(root[-1]):.6g} below its answer {objective:.6g} "
                "(LP relaxation reported infeasible)")
    return ""


def _tolerance(ms: float) -> float:
    """Two sums of the same recompute times in another order differ by about this much."""
    return 1e-9 * max(1.0, abs(ms))


def _cbc_bound(log: str, objective: float | None) -> float | None:
    """Best bound from CBC's log ("Lower bound: ..." or "best possible ...")."""
    for pat in (r"Lower bound:\s*([-+0-9.eE]+)", r"best possible\s*([-+0-9.eE]+)"):
        found = re.findall(pat, log)
        if found:
            return float(found[-1])
    return None


def _gap(objective: float | None, bound: float | None) -> float | None:
    if objective is None or bound is None:
        return None
    return max(0.0, objective - bound) / max(abs(objective), 1e-12)


# ----------------------------------------------------------------------------- solve

_MAX_REPAIRS = 20
"""Re-solves allowed when the solver's plan is over budget under simulate (see ``_fitting``)."""


def solve(g: nx.DiGraph, budget_bytes: int, *, time_limit_s: float | None = None,
          backend: Backend | None = None, mip_gap: float = 0.0, prefer_low_peak: bool = True,
          use_relaxation: bool = True, threads: int | None = None, **_: object) -> Solution:
    """Least-recompute checkpoint set that fits ``budget_bytes``, on any candidate graph.

    Args:
        g: a graph from ``planner.model.graph.build_graph`` (nested candidates allowed).
        budget_bytes: peak memory allowed, per NOTE [ Peak-memory model ].
        time_limit_s: wall-clock limit for all solves together (None: none).
        backend: "highs" (default, needs highspy) or "cbc"; None means the default.
        mip_gap: relative gap at which the solver may stop (0: prove optimality).
        prefer_low_peak: among plans of least recompute, look for the lowest peak, with a
            quarter of the time spent so far (the recompute stays optimal either way).
        use_relaxation: first try NOTE [ Sequential relaxation ] (False: the ILP alone).
        threads: solver threads (None: the solver's default).

    Returns:
        A ``Solution``: "optimal" when proven, "feasible" with ``gap`` when the time limit
        stopped the search, "infeasible" with ``min_feasible_bytes`` (the lowest peak any plan
        reaches; proven unless ``detail`` says otherwise).
    """
    run = _Run(g, budget_bytes, time_limit_s, *_pick_backend(backend), mip_gap, threads, prefer_low_peak)
    if simulate(g, []).peak_bytes <= budget_bytes:  # step 1 of the module docstring
        return run.finish([], "optimal", "checkpointing nothing fits")
    run.program = build_program(g, term_bits=CBC_TERM_BITS if run.backend == "cbc" else 24)
    decided = run.by_relaxation() if use_relaxation else None
    return decided if decided is not None else run.branch_and_bound()


def _below(ms: float) -> float:
    """A bound in ms made safe against the summation order of the same floats."""
    return ms - 1e-12 * max(1.0, abs(ms))


def _pick_backend(backend: Backend | None) -> tuple[Backend, list[str]]:
    name = backend or DEFAULT_BACKEND
    if name not in ("highs", "cbc"):
        raise SolverError(f"unknown ILP backend {name!r}; choose 'highs' or 'cbc'")
    if name == "highs" and not _highs_available():
        return "cbc", ["highspy is not installed: using CBC (pip install highspy for HiGHS)"]
    return name, []


def _stats_line(model: IlpModel) -> str:
    stats = model.stats
    return (f"{stats['binaries']} binaries, {stats['variables'] - stats['binaries']} continuous, "
            f"{stats['constraints']} rows")


class _Run:
    """One call of ``solve``, as the steps of the module docstring: the model, the clock, the
    notes for ``detail``. Each step returns the ``Solution`` when it decides the call."""

    def __init__(self, g: nx.DiGraph, budget_bytes: int, time_limit_s: float | None, backend: Backend,
                 notes: list[str], mip_gap: float, threads: int | None, prefer_low_peak: bool = True) -> None:
        self.g, self.budget, self.backend, self.mip_gap, self.threads = g, budget_bytes, backend, mip_gap, threads
        self.time_limit_s, self.prefer_low_peak = time_limit_s, prefer_low_peak
        self.t0 = time.perf_counter()
        self.deadline = None if time_limit_s is None else self.t0 + time_limit_s
        self.notes = [f"backend {backend}", *notes]
        self.program: Program | None = None
        self.model: IlpModel | None = None
        self.bound: Bound | None = None
        self.n_cuts = 0

    # --- the model and the clock

    def left(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.perf_counter())

    def build(self) -> None:
        if self.model is None:
            self.model = build_model(self.g, self.budget, self.program)
            self.notes.append(_stats_line(self.model))

    def tops(self) -> frozenset[str]:
        """Every top-level candidate (with its tied calls): the plan of last resort."""
        return frozenset(close_ties(self.g, (n for n, a in self.g.nodes(data=True) if a["parent"] is None)))

    def objective(self, kind: Literal["recompute", "peak"]) -> None:
        m = self.model
        if kind == "recompute":
            m.prob.setObjective(m.recompute)
        else:  # every x listed (at 0): PuLP's MPS writer needs each known column somewhere
            m.prob.setObjective(pulp.LpAffineExpression([(m.peak, 1), *((v, 0) for v in m.x.values())]))

    # --- step 2: the sequential relaxation decides, or bounds

    def by_relaxation(self) -> Solution | None:
        """The Solution when NOTE [ Sequential relaxation ] decides the budget; else keeps its bound."""
        bound = self.bound = sequential_bound(self.program, self.budget)
        if bound is not None and bound.recompute_ms == math.inf:
            self.notes.append("the sequential relaxation admits no plan (NOTE [ Sequential relaxation ])")
            return self.infeasible()
        if bound is None or not is_tied(self.g, bound.plan):  # it ignores ties (a relaxation still)
            return None
        if simulate_vars(self.g, bound.plan).peak_bytes <= self.budget:
            self.notes.append("proven by the sequential relaxation: its plan fits, and no plan has less recompute "
                              "(NOTE [ Sequential relaxation ])")
            chosen = self.lower_peak(frozenset(bound.plan)) if self.prefer_low_peak else bound.plan
            return self.finish(chosen, "optimal")
        return None

    # --- step 3: branch and bound, plans over budget under simulate cut off

    def branch_and_bound(self) -> Solution:
        self.build()
        bound = self.bound
        if bound is not None and self.backend == "highs":
            self.notes.append(f"sequential relaxation bound {bound.recompute_ms:.6g} ms used as a cut")
            self.model.recompute_row("recompute_lower_bound", pulp.LpConstraintGE, _below(bound.recompute_ms))
        # not for CBC 2.10.3: with that row (parallel to the objective) its restart after reduced-cost
        # fixing "found" a 552.1 ms plan below the root bound and stopped at a wrong "optimal"
        out = self.fitting(self.budget)
        if out.state == "infeasible":
            return self.infeasible()
        if out.state == "none":
            return self.no_plan_in_time()
        chosen = self.lower_peak(out.chosen) if self.prefer_low_peak else out.chosen
        if out.state == "optimal":
            return self.finish(chosen, "optimal")
        return self.finish(chosen, "feasible", "time limit reached: best plan found, optimality not proven",
                           gap=_gap(out.objective, out.bound), stopped="time_limit")

    def fitting(self, cap_bytes: int | None, limit: float | None = None, gap: float | None = None) -> _Outcome:
        """Solve with P <= cap; a plan simulate puts over the cap is cut off and the solve repeated.

        The solver accepts x within its integrality tolerance (1e-6 in HiGHS): x_c = 6e-7 times
        a recompute of 2 MB "saves" a byte. Rounded, such a plan may be a byte or so over the
        cap; it is truly infeasible, so excluding it (a no-good cut) loses nothing.
        """
        m = self.model
        m.set_cap(cap_bytes)
        for _ in range(_MAX_REPAIRS + 1):
            out = _solve(m, self.backend, self.left() if limit is None else limit,
                         self.mip_gap if gap is None else gap, self.threads)
            if out.note:
                self.notes.append(out.note)
            if out.state in ("infeasible", "none") or cap_bytes is None:
                return out
            over = simulate_vars(self.g, out.chosen).peak_bytes - cap_bytes
            if over <= 0:
                return out
            self.n_cuts += 1
            cut = pulp.lpSum(1 - x if v in out.chosen else x for v, x in m.x.items())
            m.prob.addConstraint(cut >= 1, f"exclude_{self.n_cuts}")
            self.notes.append(f"solver tolerance: excluded a plan {over} bytes over, re-solved")
            if limit is not None:
                limit = max(0.05, limit - out.seconds)
        _loud(f"ILP: {_MAX_REPAIRS} plans in a row were over budget under simulate")
        return out

    def no_plan_in_time(self) -> Solution:
        """The solver stopped before its first plan: checkpointing every top-level candidate, if
        that fits ("feasible", gap against the relaxation's bound, or 100 % without one)."""
        tops = sorted(self.tops(), key=lambda n: self.g.nodes[n]["order"])
        est = simulate(self.g, tops)
        if est.peak_bytes > self.budget:
            self.notes.append(f"time limit ({self.time_limit_s} s) reached before any plan was found")
            return self.infeasible(search=False, stopped="no_plan_in_time")
        lower = self.bound.recompute_ms if self.bound is not None else 0.0
        return self.finish(tops, "feasible", f"time limit ({self.time_limit_s} s) reached before the solver found "
                           "a plan: checkpointing every top-level candidate fits (optimality not proven)",
                           gap=_gap(est.recompute_ms, lower), stopped="no_plan_in_time")

    # --- step 4: no plan fits: the lowest peak

    def infeasible(self, *, search: bool = True, stopped: StopReason = "finished") -> Solution:
        """No plan fits: the lowest peak any plan reaches is ``min_feasible_bytes``."""
        g = self.g
        best, proven = self.lowest_peak() if search else (self.tops(), False)
        est = simulate_vars(g, best)
        if not proven:
            self.notes.append("min_feasible_bytes is the best peak found in time, not proven minimal")
            stopped = "time_limit" if stopped == "finished" else stopped
        self.notes.append(f"no plan fits; the minimum feasible budget is {est.peak_bytes} bytes")
        full, sel = split_vars(best)
        sol = judged("ilp", g, full, self.budget, time.perf_counter() - self.t0, selective=sel)
        if search and sol.status != "infeasible":
            _loud(f"ILP found budget {self.budget} infeasible, but simulate fits {sorted(best)} "
                  f"at {est.peak_bytes} bytes (the program and simulate disagree: a bug)")
        return Solution(**{**sol.__dict__, "status": "infeasible", "min_feasible_bytes": est.peak_bytes,
                           "detail": "; ".join(self.notes), "extra": self.extra(), "stopped": stopped})

    def lowest_peak(self) -> tuple[frozenset[str], bool]:
        """The plan of least peak (every top-level candidate if none is found), and whether proven."""
        g, best = self.g, self.tops()
        self.build()
        self.drop_cuts()
        self.model.recompute_row("recompute_lower_bound", pulp.LpConstraintGE, None)
        self.objective("peak")
        out = self.fitting(None)
        proven = out.state == "optimal"
        if out.state in ("optimal", "feasible"):
            best = out.chosen
        # the solver's optimum may sit a byte or so under the rounded plan's peak (see
        # ``fitting``): unless its bound rules it out, ask for a plan one byte lower
        peak = simulate_vars(g, best).peak_bytes
        scale = self.model.program.scale_bytes
        while proven and not (out.bound is not None and out.bound * scale > peak - 1 + 1e-6 * scale):
            out = self.fitting(peak - 1)
            if out.state == "infeasible":
                break
            if out.state != "optimal" and out.state != "feasible":
                proven = False
                break
            best, peak = out.chosen, simulate_vars(g, out.chosen).peak_bytes
        self.objective("recompute")
        return best, proven

    def drop_cuts(self) -> None:
        """Switch the no-good cuts off: a plan over one cap may fit under another."""
        for k in range(1, self.n_cuts + 1):
            # the row is (terms) + constant >= 0 and the terms are >= -len(x): never binding
            _row(self.model.prob, f"exclude_{k}").constant = float(len(self.model.x) + 1)

    # --- step 5: among plans of least recompute, a lower peak

    def lower_peak(self, chosen: frozenset[str]) -> frozenset[str]:
        """Tie-break: the lowest peak among plans no slower than ``chosen`` (kept only if so).

        Gets a quarter of the time spent so far (at least 0.2 s): the recompute is already
        optimal, this only picks among equals.
        """
        first = simulate_vars(self.g, chosen)
        limit = self.tie_break_seconds()
        if limit < 0.1 or first.recompute_ms == 0:
            return chosen
        self.build()
        bound = first.recompute_ms
        self.model.recompute_row("tie_break_recompute", pulp.LpConstraintLE, bound + 1e-12 * max(1.0, bound))
        self.objective("peak")
        try:
            second = self.fitting(self.budget, limit=limit, gap=0.0)
        finally:
            self.model.recompute_row("tie_break_recompute", pulp.LpConstraintLE, None)
            self.objective("recompute")
        if second.state not in ("optimal", "feasible"):
            return chosen
        est = simulate_vars(self.g, second.chosen)
        if est.recompute_ms <= bound and est.peak_bytes < first.peak_bytes:
            self.notes.append(f"peak tie-break: {first.peak_bytes} -> {est.peak_bytes} bytes at equal recompute")
            return second.chosen
        return chosen

    def tie_break_seconds(self) -> float:
        """A quarter of the time spent so far, at least 0.2 s, within the time left."""
        limit = max(0.2, 0.25 * (time.perf_counter() - self.t0))
        spare = self.left()
        return limit if spare is None else min(limit, spare)

    # --- step 6: the Solution, judged by simulate

    def finish(self, chosen, status: Status, note: str | None = None, *, gap: float | None = None,
               stopped: StopReason = "finished") -> Solution:
        if note:
            self.notes.append(note)
        full, sel = split_vars(chosen)
        sol = judged("ilp", self.g, full, self.budget, time.perf_counter() - self.t0, status_if_fits=status,
                     selective=sel)
        if sol.status == "infeasible":
            _loud(f"ILP plan {sorted(chosen)} is over budget under simulate: {sol.peak_bytes} > {self.budget} "
                  "bytes (the program and simulate disagree: a bug)")
            self.notes.append("BUG: the program's plan is over budget under simulate")
        return Solution(**{**sol.__dict__, "gap": gap, "detail": "; ".join(self.notes), "extra": self.extra(),
                           "stopped": stopped})

    def extra(self) -> dict:
        stats = dict(self.model.stats if self.model is not None else
                     self.program.stats if self.program is not None else {})
        if self.bound is not None:
            b = self.bound
            stats.update(bound_ms=b.recompute_ms, bound_seconds=b.seconds, bound_states=b.states,
                         bound_relaxed_ors=b.relaxed_ors, bound_coarsened=b.coarsened)
        return {**stats, "backend": self.backend, "repairs": self.n_cuts}


def _loud(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
