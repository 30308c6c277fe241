"""NOTE [ ILP formulation ] as plain data: the ``Program`` of a candidate graph, before any solver sees it.

``build_program`` writes the cost model (NOTE [ Peak-memory model ], ``solvers/cost_model.py``)
linearly, with nothing approximated: a checkpoint set fits the budget in the program iff it fits
under ``simulate`` (``probe_values`` evaluates the program at a set; ``tests/test_ilp.py``
compares every probe). ``solvers.ilp.model`` turns it into a PuLP problem.

Size: one binary per candidate, an OR variable only for a tensor whose "held by then" is not
affine in x, one running-sum variable per probe position where held bytes change; rows: one
per probe, per root-to-leaf path, per OR lower bound and per running sum. Building it is
O(S + n * b) for S save events, n candidates and b leaves.

Example::

    program = build_program(g)
    probe_values(program, frozenset({"h.0"}))["backward of h.0"]   # == the simulate probe, in bytes
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Callable, Iterable

import networkx as nx

from solvers.cost_model import ALIVE_SEQ, CostModel, Estimate, simulate, tie_groups
from solvers.kept import kept_at

_ANTICHAIN_CAP = 512
"""Truth tables are built over at most this many antichains per tensor (else no pruning)."""

_Affine = tuple[int, tuple[tuple[str, int], ...]]  # (constant, ((node, coefficient), ...)), sorted
_Term = tuple[str, object]  # ("save", frozenset of containing nodes) | ("input", node)
_ZERO: _Affine = (0, ())


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
    """Candidate -> its selective policies' variables and its offload variable (their ``parent`` is the
    candidate; Rules 7 and 8)."""
    host: dict[str, int] = field(default_factory=dict)
    """Host memory (Rule 8): offload variable -> the bytes it copies to the host (S_v)."""


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


_OFFLOAD_MARK = "@offload"
"""Variable id of offloading candidate v: f"{v}@offload" (NOTE [ ILP formulation ], Rule 8)."""


def offload_var(v: str) -> str:
    return f"{v}{_OFFLOAD_MARK}"


def split_vars(chosen: Iterable[str]) -> tuple[list[str], dict[str, int], list[str]]:
    """Chosen variables -> (checkpointed candidates, selective {candidate: policy index}, offloaded)."""
    full, sel, off = [], {}, []
    for var in chosen:
        base, mark, j = var.rpartition(_POLICY_MARK)
        if mark and j.isdigit():
            sel[base] = int(j)
        elif var.endswith(_OFFLOAD_MARK):
            off.append(var[:-len(_OFFLOAD_MARK)])
        else:
            full.append(var)
    return full, sel, off


def simulate_vars(g: nx.DiGraph, chosen: Iterable[str]) -> Estimate:
    """``simulate`` of a set of chosen variables (candidates, policies, offloads)."""
    return simulate(g, *split_vars(chosen))


@dataclass(frozen=True)
class _Vars:
    """The program's 0/1 variables (NOTE [ ILP formulation ], Rules 1 and 7): one per candidate and
    one per selective policy of a candidate, each with the candidate it stands for."""

    cands: list[str]  # candidates, forward order
    alts: dict[str, tuple[str, ...]]  # candidate -> its policy variables, then its offload variable
    names: list[str]  # every variable: each candidate followed by its alternatives
    base: dict[str, str]  # variable -> its candidate
    kept: dict[str, frozenset[int]]  # policy variable -> the tensors it keeps
    offloads: frozenset[str] = frozenset()  # the offload variables (Rule 8)

    @staticmethod
    def of(g: nx.DiGraph, *, offload: bool = False) -> _Vars:
        cands = sorted(g.nodes, key=lambda n: g.nodes[n]["order"])
        tied = {n for group in tie_groups(g) for n in group}
        pols = {v: tuple(policy_var(v, j) for j in range(len(g.nodes[v].get("menu", ())))) for v in cands}
        model = CostModel.of(g) if offload else None  # a unit that saves nothing has nothing to offload
        offs = {v: offload_var(v) for v in cands if model and v not in tied and model.offload_bytes(v) > 0}
        alts = {v: pols[v] + ((offs[v],) if v in offs else ()) for v in cands}
        base = {pv: v for v in cands for pv in alts[v]} | {v: v for v in cands}
        kept = {pv: g.nodes[v]["menu"][j].cached_ids for v in cands for j, pv in enumerate(pols[v])}
        return _Vars(cands, alts, [var for v in cands for var in (v, *alts[v])], base, kept,
                     frozenset(offs.values()))

    def policies(self, v: str) -> tuple[str, ...]:
        """Candidate ``v``'s selective policy variables, in menu order."""
        return tuple(pv for pv in self.alts[v] if pv not in self.offloads)

    def ancestors(self, anc: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
        """``anc`` over variables: a policy conflicts with its candidate, the candidate's other
        policies, and everything the candidate conflicts with."""
        out = {v: a | {pv for u in a for pv in self.alts[u]} for v, a in anc.items()}
        for v, pvs in self.alts.items():
            for j, pv in enumerate(pvs):
                out[pv] = out[v] | {v} | set(pvs[:j])
        return out

    def forward_ms(self, g: nx.DiGraph) -> dict[str, float]:
        """Each variable's cost in the objective, per micro-batch: the candidate's forward, the policy's
        ``recompute_ms``, or the offload's exposed copy time (Rule 8)."""
        model = CostModel.of(g)
        mb = g.graph.get("micro_batches", 1)
        return {v: g.nodes[v]["forward_ms"] for v in self.cands} | {
            pv: g.nodes[v]["menu"][j].recompute_ms for v in self.cands for j, pv in enumerate(self.policies(v))} | {
            f: model.exposed_ms(self.base[f]) / mb for f in self.offloads}


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
# Rule 8. Offloaded units (NOTE [ Peak-memory model ], Rule 10; with ``host_budget_bytes``).
# Offloading candidate v is one more variable f = x_{v,off}, an alternative of v like a policy
# (Rule 7): it joins v's antichain rows, and a save inside v is dropped when f is 1; v's inputs
# are not held by it (nothing replays v) and it has no recompute row. The backward row of each
# leaf i inside v adds f * S(v, end(l_i)) (the restore), where a region adds its recomputed bytes.
# With a copy engine the forward rows from v's first leaf through its sync leaf s(v) (or the end
# of forward) and the backward row of s(v) (or the start of backward) add f * S_v: constant
# coefficients, the same terms simulate adds, so the rows stay exact. Host memory: each unit
# copies its own storages, so one row "host_memory": sum of S_v * f <= host budget + 1/2. f's objective coefficient is exposed(v) per
# micro-batch, beside the recompute coefficients (which are per micro-batch too). Tied calls get
# no f (Rule 5 unchanged), nor do candidates that save nothing (S_v = 0: offloading them is keeping
# them). The sequential relaxation ignores the host row (a relaxation still),
# and every plan is re-judged by simulate against both budgets.
#
# Rule 6. Objectives.
# Recompute model: min sum_v forward_ms(v) x_v with P <= budget + 1/2 (probes are whole bytes,
# so "<= budget + 1/2" is "<= budget" with half a byte of slack against solver tolerances).
# Minimum peak model (status infeasible): min P, no budget. Tie-break (``prefer_low_peak``):
# min P subject to recompute <= the optimum, kept only if simulate confirms it is no slower.
# Not an epsilon * P term in the objective: within the solver's gap tolerance that term could
# buy a lower peak with more recompute; a separate, time-boxed solve cannot.


def build_program(g: nx.DiGraph, *, term_bits: int = 24, offload: bool = False) -> Program:
    """The program of NOTE [ ILP formulation ] for ``g``, in four steps: the buckets, each
    tensor's holdings as steps of prefix ORs, the running sums H_b, and the probe rows. Memory is
    counted in multiples of ``scale_bytes`` that keep every term below 2^``term_bits`` of them.
    ``offload``: every candidate not tied may also be offloaded (Rule 8)."""
    model = CostModel.of(g)
    scale = _scale_bytes(model, term_bits)
    var = _Vars.of(g, offload=offload)
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
    parent = {v: g.nodes[v]["parent"] for v in var.cands} | {pv: var.base[pv] for v in var.cands for pv in var.alts[v]}
    host = _host_bytes(model, var)
    stats["offload_variables"] = len(host)
    return Program(var.names, var.forward_ms(g), parent, paths, ors, delta, probes, scale, stats, ties,
                   {v: a for v, a in var.alts.items() if a}, host)


def _host_bytes(model: CostModel, var: _Vars) -> dict[str, int]:
    """Rule 8's host memory: S_v of each offload variable (each unit copies its own storages)."""
    return {f: model.offload_bytes(var.base[f]) for f in sorted(var.offloads)}


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
        if v in var.offloads:
            continue  # nothing replays an offloaded unit: its inputs are not held (Rule 8)
        a = g.nodes[var.base[v]]
        for t in a["input_ids"]:
            holds.setdefault(t, {}).setdefault(bucket(a["fwd_start_seq"]), set()).add(("input", v))
    for v in var.cands:  # an output a policy keeps is held iff that policy is chosen: like an input
        for j, pv in enumerate(var.policies(v)):
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
        ckpt = model.forward_base(i, True) - model.forward_base_bytes[i]  # NOTE [ Checkpointed forward windows ]
        _lin_add(fwd_extra, {c: ckpt / scale for c in contains[i] if c == base[c] and ckpt})
        out_bytes = sum(model.tensor_bytes[t] for t in in_flight_ids)
        probes.append(Probe(f"forward of {leaf}", bucket.leaf[i], fwd_extra,
                            model.forward_base_bytes[i] + out_bytes + cast_bytes))
        rec = {c: (model.restored_bytes(base[c], e) if c in var.offloads
                   else model.recomputed_bytes(base[c], e, kept.get(c, frozenset()))) / scale for c in contains[i]}
        probes.append(Probe(f"backward of {leaf}", bucket.leaf[i], {c: r for c, r in rec.items() if r},
                            model.backward_base_bytes[i]))
    big_m = 0
    for c in var.names:
        if c in var.offloads:
            continue  # no replay, no recompute probe (Rule 8)
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
    cast_form, cast_bytes = casts(ALIVE_SEQ, after=model.leaf_end_seq[-1] if model.leaves else -1)
    probes.append(Probe("end of forward", bucket.last, cast_form, model.tail_forward_base_bytes + cast_bytes))
    probes.append(Probe("start of backward", bucket.last, {}, model.tail_backward_base_bytes))
    probes.append(Probe("optimizer step", None, {}, model.rank.opt_static_bytes))
    _in_transfer_terms(model, var, probes, scale)
    return probes, big_m


def _in_transfer_terms(model: CostModel, var: _Vars, probes: list[Probe], scale: int) -> None:
    """Rule 8 with a copy engine: x_f * S_u on the forward rows from u's first leaf through its sync
    leaf (the end of forward after the last) and on the sync leaf's backward row (the start of backward)."""
    if not var.offloads:
        return
    by_name = {p.name: p for p in probes}
    n = len(model.leaves)
    for f in sorted(var.offloads):
        fwd, bwd = model.in_transfer(frozenset((var.base[f],)))
        for rows, kind, tail in ((fwd, "forward of ", "end of forward"), (bwd, "backward of ", "start of backward")):
            for i, b in rows.items():
                extra = by_name[kind + model.leaves[i] if i < n else tail].extra
                extra[f] = extra.get(f, 0.0) + b / scale


def _cast_terms(g: nx.DiGraph, model: CostModel, var: _Vars,
                scale: int) -> Callable[..., tuple[Lin, int]]:
    """seq -> (form in multiples of ``scale``, constant bytes) of autocast's cached casts made by
    ``seq``, not held then and not in ``in_flight`` (counted as such) (NOTE [ Peak-memory model ],
    Rule 8). A cast saved before ``seq`` is unheld when a candidate containing all its saves is
    checkpointed: x_c for each such c (an antichain picks at most one; a policy that keeps the
    cast holds it instead); a cast saved only later, or never, is alive through the cache
    whatever is checkpointed. So too the outputs the step's code keeps until it drops them (NOTE [ Outputs
    the caller drops ]) while it keeps them (``kept_at``; ``after``: the tail's)."""
    saves: dict[int, list[int]] = {}
    for seq, t, _ in model.saves:
        saves.setdefault(t, []).append(seq)
    span = {v: (g.nodes[var.base[v]]["fwd_start_seq"], g.nodes[var.base[v]]["fwd_end_seq"]) for v in var.names}
    inputs = {t for v in var.cands for t in g.nodes[v]["input_ids"]}  # casts are not, in models we know

    def at(seq: int, in_flight: frozenset[int] = frozenset(), after: int | None = None) -> tuple[Lin, int]:
        form: Lin = {}
        const = 0
        for created, t, dropped in [(c, t, ALIVE_SEQ) for c, t in model.casts] + list(model.dropped):
            seqs = saves.get(t, [])
            if t in in_flight or not kept_at(created, dropped, seq, after):
                continue
            if not seqs or min(seqs) > seq or t in inputs:  # a unit's input: as if never held (over-counts)
                const += model.tensor_bytes[t]
                continue
            for v, (lo, hi) in span.items():
                if lo <= min(seqs) and max(seqs) <= hi and t not in var.kept.get(v, ()):
                    form[v] = form.get(v, 0.0) + model.tensor_bytes[t] / scale
        return form, const

    return at


__all__ = ["Lin", "Probe", "Program", "build_program", "policy_var", "probe_values", "simulate_vars", "split_vars"]
