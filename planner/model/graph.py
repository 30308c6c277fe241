"""Graph builder: ``Profile`` -> ``networkx.DiGraph`` of checkpoint candidates.

Nodes are candidate units (module calls); edges ``u -> v`` carry the tensors produced inside ``u``
and passed into ``v``; ``g.graph`` holds the step. Every attribute is declared once, with its unit
and meaning, in ``solvers/contract.py`` (``NodeAttrs``, ``EdgeAttrs``, ``GraphAttrs``): what this
module writes and the cost model and the solvers read. ``g.graph["cost_model"]`` is the graph's
``solvers.cost_model.CostModel``, built once, last (``calibrate``).

Granularity: by default the candidates are the repeated blocks (children of a ModuleList or
Sequential that share a class: transformer layers, ResNet blocks) and the modules around them
(the other children of every module that contains blocks). ``granularity=k`` goes k levels
deeper (each candidate is split into its child module calls). ``nested=True`` keeps every
level from the default cut down to ``granularity`` in the graph, for solvers that choose
among nested candidates (a block, or any set of its children, never both).

Example::

    g = build_graph(Profile.load("profile.json"), granularity=1, nested=True)
    sorted(g.nodes)                           # the candidate units
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any, Iterable

import networkx as nx

from planner.errors import BadInput
from planner.options import parse_sharding
from planner.model.schema import LOSS_ID, ROOT_ID, OpRecord, Profile, UnitRecord
from solvers.contract import EdgeAttrs, NodeAttrs, contract_violations
from solvers.cost_model import calibrate
from solvers.selective import OpCall, UnitOps, build_menu, category, spread_of_median


def build_graph(profile: Profile, *, granularity: int = 0, nested: bool = False, world_size: int = 1,
                sharding: str = "none", selective: bool = True) -> nx.DiGraph:
    """Build the candidate graph of ``profile`` (see module docstring for its attributes).

    ``world_size`` and ``sharding`` (``none``, ``ddp``, ``fsdp``) make the cost model count
    memory per rank (see NOTE [ Per-rank memory ]). ``selective`` gives each
    candidate a ``menu`` of op-level policies (``solvers.selective``) when the profile has op
    records; False (or an older profile) leaves every menu empty: whole modules only.
    """
    if granularity < 0:
        raise BadInput(f"granularity must be >= 0, got {granularity}")
    if world_size < 1:
        raise BadInput(f"world size must be >= 1, got {world_size}")
    parse_sharding(sharding)
    units = {u.id: u for u in profile.units}
    children = unit_children(profile.units)
    levels = candidate_levels(units, children, granularity)
    chosen = [uid for level in (levels if nested else levels[-1:]) for uid in level]
    chosen = [uid for uid in chosen if not _excluded(units[uid].fqn, profile)]
    chosen = sorted(set(chosen), key=lambda uid: (units[uid].fwd_start_seq, -units[uid].fwd_end_seq))

    g = nx.DiGraph()
    _set_graph_attrs(g, profile, granularity, nested)
    g.graph.update(world_size=world_size, sharding=sharding, **_fsdp_units(units, children, profile))
    saves_by_seq = sorted(held_saves(profile))
    tensor_bytes = g.graph["tensor_bytes"]
    for order, uid in enumerate(chosen):
        g.add_node(uid, **_node_attrs(units[uid], order, saves_by_seq, tensor_bytes, eager=profile.compile is None))
    _add_retained(g, profile)
    _link_tree(g, chosen, units)
    _add_edges(g, profile, chosen, units)
    leaves = [n for n in chosen if g.nodes[n]["leaf"]]
    g.graph["leaves"] = leaves
    _add_windows(g, profile, leaves, units)
    _cap_replay_terms(g, profile.timeline)
    _add_checkpointed_windows(g, profile, leaves)
    if selective:
        _add_menus(g, profile, chosen, units)
    calibrate(g)
    broken = contract_violations(g)
    if broken:  # a bug here, not bad input: every attribute is declared in solvers/contract.py
        raise RuntimeError(f"build_graph broke the graph contract (solvers/contract.py): {'; '.join(broken[:5])}")
    return g


def _excluded(fqn: str, profile: Profile) -> bool:
    """True for a module the validation step found unsafe to recompute, and for its submodules."""
    return any(fqn == x.module or x.module == "" or fqn.startswith(x.module + ".") for x in profile.excluded)


# NOTE [ Kept past the forward ]
#
# Rule 1. The validation step's retained bytes r(c) (NOTE [ Validation step ]) are what c allocated and
# something still references when backward starts, with c checkpointed. A tensor a block stores on
# itself in forward (``self.last = h``) is among them. If the unplanned step saves it, checkpointing c
# would free it but for the attribute, and r(c) rightly counts it as kept. If nothing saves it, it is
# alive in the unplanned step as well, from its creation on, and the calibrated temporaries T of every
# later window already hold it: counted in r(c) too, three MLP blocks that each keep their MLP's output
# were predicted 8,192 bytes (that output) over in every window after a checkpointed block, the peak
# 369,352 against 361,160 (+2.27%).
#
# Rule 2. ``_kept_unheld``: the unit outputs with no release in the forward (kept past it, NOTE [ Outputs
# the caller drops ], Rule 1) that no save holds; ``_add_retained`` takes those made inside c, other than
# c's own outputs (which r(c) never holds), out of r(c), as it takes out what is kept on ctx.


def _kept_unheld(p: Profile) -> list[tuple[int, int, int]]:
    """(created seq, tensor id, bytes) of the unit outputs something keeps past the forward (an attribute set
    in forward: no release) that no save holds: alive in the unplanned step too, in its calibrated T."""
    returned = {t for u in p.units for t in u.output_ids}
    saved = {t for _, t in held_saves(p)}
    return [(t.created_seq, t.id, t.nbytes) for t in p.tensors
            if t.id in returned and t.released_seq is None and t.id not in saved and not t.ctx_held]


def _add_retained(g: nx.DiGraph, profile: Profile) -> None:
    """Retained bytes r(c), the unit's own plus the state every region keeps, as one more input of c
    (see "Retained bytes" in NOTE [ Peak-memory model ])."""
    own = {r.unit: r.nbytes for r in profile.retained}
    ctx = [(t.created_seq, t.nbytes) for t in profile.tensors if t.ctx_held]  # NOTE [ Tensors on ctx ]
    kept = _kept_unheld(profile)  # NOTE [ Peak-memory model ], Rule 7: alive with or without the plan
    for node, a in g.nodes(data=True):
        if node in own:
            lo, hi = a["fwd_start_seq"], a["fwd_end_seq"]
            own[node] = max(0, own[node] - sum(b for s, b in ctx if lo <= s <= hi)
                            - sum(b for s, t, b in kept if lo <= s <= hi and t not in a["output_ids"]))
    for k, (node, a) in enumerate(sorted(g.nodes(data=True), key=lambda na: na[1]["order"])):
        nbytes = own.get(node, 0) + profile.region_state_bytes
        if nbytes <= 0:
            continue
        tid = -1 - k  # profile tensor ids are >= 0
        g.graph["tensor_bytes"][tid] = nbytes
        g.graph["tensor_created_seq"][tid] = a["fwd_start_seq"]
        a["input_ids"] = a["input_ids"] | {tid}
        a["input_bytes"] += nbytes
        a["retained_bytes"] = nbytes


# ----------------------------------------------------------------------------- candidate choice


def unit_children(units: Iterable[UnitRecord]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for u in units:
        if u.parent is not None:
            out[u.parent].append(u.id)
    return out


# NOTE [ Layers are not blocks ]
#
# Rule 1. Repeated blocks are >= 2 siblings of one class whose names end in an index: transformer layers
# in a ModuleList, ResNet blocks in a Sequential. The siblings of a stack of layers also repeat a class
# (a U-Net's ``conv_block``: ``nn.Sequential(Conv2d, BatchNorm2d, ReLU, Conv2d, BatchNorm2d, ReLU)``), but
# a layer alone is no block to checkpoint: its region keeps its input, which is most of what it saves, so
# it frees next to nothing. A U-Net of such blocks got its Conv2d and BatchNorm2d layers as candidates,
# its in-place ReLUs excluded, and no plan below its unplanned peak ("no candidate frees memory there").
#
# Rule 2. Siblings without submodules beside siblings of another class are layers, not blocks: the
# cut stays at the module that holds them (``d1``, ``u2``), and ``granularity`` goes down to the layers.
# A list of one class only (``nn.ModuleList(nn.Linear(...) for ...)``) stays blocks, as before; so do
# siblings with submodules (a Sequential of ResNet blocks).


def repeated_blocks(units: dict[str, UnitRecord], children: dict[str, list[str]]) -> set[str]:
    """Unit ids of repeated blocks: >= 2 siblings of the same class whose names end in an index."""
    groups: dict[tuple[str | None, str], list[str]] = defaultdict(list)
    for u in units.values():
        last = u.fqn.rsplit(".", 1)[-1]
        if u.id not in (ROOT_ID, LOSS_ID) and last.isdigit():
            groups[(u.parent, u.module_type)].append(u.id)
    blocks = {uid for (parent, _), ids in groups.items() if len(ids) >= 2 and not _layers(ids, parent, units, children)
              for uid in ids}
    # keep the outermost: a block inside another block is a part of it, not a block
    return {b for b in blocks if not any(a in blocks for a in _ancestors(units, b))}


def _layers(ids: list[str], parent: str | None, units: dict[str, UnitRecord], children: dict[str, list[str]]) -> bool:
    """Whether ``ids`` are layers of a stack of layers, not blocks (NOTE [ Layers are not blocks ])."""
    if any(children.get(uid) for uid in ids):
        return False
    return any(units[c].module_type != units[ids[0]].module_type for c in children.get(parent, []))


def _ancestors(units: dict[str, UnitRecord], uid: str) -> list[str]:
    out, p = [], units[uid].parent
    while p is not None:
        out.append(p)
        p = units[p].parent
    return out


def _default_cut(units: dict[str, UnitRecord], children: dict[str, list[str]]) -> list[str]:
    """The top-level units to plan: repeated blocks and the units beside them. Loops, not recursion: a model
    nested 1,200 deep is a unit tree as deep (Rule 4 of NOTE [ Models nested deep ] in ``planner/crashes.py``)."""
    blocks = repeated_blocks(units, children)
    top = [c for c in children.get(ROOT_ID, [])]
    if not top:
        return []
    if blocks:
        holds = _holding(children, blocks)
        out, stack = [], list(reversed(top))
        while stack:  # pre-order: a unit, or its children where a block lies below it
            uid = stack.pop()
            if uid in blocks or uid not in holds:
                out.append(uid)
            else:
                stack.extend(reversed(children.get(uid, [])))
        return out
    # no repeated blocks: descend through single-child wrappers, then take the children
    while len(top) == 1 and children.get(top[0]):
        top = children[top[0]]
    return top


def _holding(children: dict[str, list[str]], blocks: set[str]) -> set[str]:
    """Units that are a block or hold one below them."""
    order = [ROOT_ID]
    for uid in order:  # breadth-first; grows as it goes
        order.extend(children.get(uid, []))
    holds: set[str] = set()
    for uid in reversed(order):  # children before their parents
        if uid in blocks or any(c in holds for c in children.get(uid, [])):
            holds.add(uid)
    return holds


def candidate_levels(units: dict[str, UnitRecord], children: dict[str, list[str]],
                      granularity: int) -> list[list[str]]:
    level = _default_cut(units, children)
    levels = [level]
    for _ in range(granularity):
        finer = [x for uid in level for x in (children.get(uid) or [uid])]
        if finer == level:  # leaves only: every further level is this one (NOTE [ Counts have ceilings ])
            break
        level = finer
        levels.append(level)
    return levels


# ----------------------------------------------------------------------------- attributes


def _set_graph_attrs(g: nx.DiGraph, p: Profile, granularity: int, nested: bool) -> None:
    s = p.step
    g.graph.update(
        model=p.fingerprint.model_class,
        fingerprint=p.fingerprint.model_dump(),
        device=p.device, device_name=p.device_name, target=p.target, dtype=p.dtype, amp=p.amp,
        optimizer=p.optimizer, torch_version=p.torch_version,
        granularity=granularity, nested=nested,
        tensor_bytes={t.id: t.nbytes for t in p.tensors},
        tensor_created_seq={t.id: t.created_seq for t in p.tensors},
        saves=sorted(set(held_saves(p))), ctx_held=frozenset(t.id for t in p.tensors if t.ctx_held),
        pack_seqs=_pack_seqs(p),
        param_grads=sorted((pr.grad_seq, pr.nbytes) for pr in p.params),
        params_bytes=s.params_bytes, buffers_bytes=s.buffers_bytes, batch_bytes=s.batch_bytes,
        optimizer_bytes=s.optimizer_bytes, grads_bytes=s.grads_bytes, workspace_bytes=s.workspace_bytes,
        optimizer_step_transient_bytes=s.optimizer_step_transient_bytes,
        forward_ms=s.forward_ms, backward_ms=s.backward_ms, optimizer_ms=s.optimizer_ms, step_ms=s.step_ms,
        forward_end_seq=s.forward_end_seq, backward_start_seq=s.backward_start_seq,
        measured_peak_bytes=s.measured_peak_bytes, peak_source=s.peak_source,
        recipe=p.recipe.model_dump(), grads_alive=p.recipe.grads_alive, micro_batches=p.recipe.grad_accum,
        autocast_cached=frozenset(t.id for t in p.tensors if t.autocast_cached),
        dropped_released_seq=_dropped(p),
        host_link_bytes_per_s=p.host_link_bytes_per_s, copy_engine=p.copy_engine,
        replay_transient_bytes=p.compile.replay_transient_bytes if p.compile else 0,
        replay_rng_copy_bytes=0 if p.compile else p.region_state_bytes,  # NOTE [ Peak-memory model ], Rule 7
    )


def held_saves(p: Profile) -> list[tuple[int, int]]:
    """(seq, tensor id) of the saves backward needs: not those released in the forward (NOTE [ Outputs the
    caller drops ], Rule 4); and the tensors custom nodes keep on ctx, at their creation (NOTE [ Tensors on
    ctx ], Rule 2)."""
    return ([(s.seq, s.tensor_id) for s in p.saves if s.released_seq is None]
            + [(t.created_seq, t.id) for t in p.tensors if t.ctx_held])


def _pack_seqs(p: Profile) -> tuple[int, ...]:
    """Where the forward packed: every save, those released in the forward too, and each unit call's last pack,
    of a parameter or a tensor saved before included (NOTE [ The replay stops at the last save ], Rules 2-3)."""
    last = (u.last_pack_seq for u in p.units if u.last_pack_seq is not None)
    return tuple(sorted({s.seq for s in p.saves}.union(last)))


def _dropped(p: Profile) -> dict[int, int]:
    """Release seqs of the unit outputs the step's code keeps: those no unit takes, those units take and no save
    holds, and the tensors only saves released in the forward keep (NOTE [ Outputs the caller drops ], Rules
    2, 5 and 4)."""
    taken = {t for u in p.units for t in u.input_ids}
    casts = {t.id for t in p.tensors if t.autocast_cached}
    saved = {t for _, t in held_saves(p)}
    out = {t.id: t.released_seq for t in p.tensors  # a unit's input a save holds: held as before (Rule 5)
           if t.released_seq is not None and t.id not in casts and not (t.id in taken and t.id in saved)}
    held = taken | casts | saved  # also saved for backward: held as before
    for s in p.saves:
        if s.released_seq is not None and s.tensor_id not in held:
            out[s.tensor_id] = max(out.get(s.tensor_id, -1), s.released_seq)
    return out


def _fsdp_units(units: dict[str, UnitRecord], children: dict[str, list[str]], p: Profile) -> dict:
    """FSDP2 wraps every repeated block and the root: the largest block's and the root group's
    parameter bytes (see NOTE [ Per-rank memory ])."""
    blocks = sorted(repeated_blocks(units, children), key=lambda b: units[b].fwd_start_seq)
    first = {}  # forward order, a module's first call
    for b in blocks:
        first.setdefault(units[b].fqn, units[b])
    largest = max((u.param_bytes for u in first.values()), default=0)
    return dict(fsdp_max_block_param_bytes=largest,
                fsdp_root_param_bytes=max(0, p.step.params_bytes - sum(u.param_bytes for u in first.values())),
                fsdp_units=list(first),
                fsdp_blocks=tuple((u.fwd_start_seq, u.fwd_end_seq, u.param_bytes) for u in first.values()))


def _node_attrs(u: UnitRecord, order: int, saves_by_seq: list[tuple[int, int]],
                tensor_bytes: dict[int, int], *, eager: bool = True) -> NodeAttrs:
    import bisect

    lo = bisect.bisect_left(saves_by_seq, (u.fwd_start_seq, -1))
    hi = bisect.bisect_right(saves_by_seq, (u.fwd_end_seq, math.inf))  # after every tensor id at that seq
    saved = frozenset(t for _, t in saves_by_seq[lo:hi])
    inputs = frozenset(u.input_ids)
    attrs = NodeAttrs(
        order=order, fqn=u.fqn, call_index=u.call_index, module_type=u.module_type, depth=u.depth,
        parent=None, leaf=True, fwd_start_seq=u.fwd_start_seq, fwd_end_seq=u.fwd_end_seq,
        forward_ms=u.forward_ms, backward_ms=u.backward_ms, flops=u.flops, param_bytes=u.param_bytes,
        forward_spread_ms=spread_of_median(u.forward_spread_ms, u.timing_samples),  # NOTE [ Unit costs ], Rule 4
        cost_group=u.cost_group,
        saved_bytes=sum(tensor_bytes[t] for t in saved),
        input_bytes=sum(tensor_bytes[t] for t in inputs),
        output_bytes=u.output_bytes,
        saved_ids=saved, input_ids=inputs, output_ids=frozenset(u.output_ids), in_flight_ids=frozenset(),
        grad_output_ids=frozenset(u.output_ids if u.grad_output_ids is None else u.grad_output_ids),
        fwd_window_peak_bytes=None, bwd_window_peak_bytes=None,
        fwd_transient_bytes=0, bwd_transient_bytes=0, menu=(),
    )
    if u.replay_rise_bytes is not None and eager:  # NOTE [ What a replay allocates ] in solvers/replay.py
        attrs["replay_rise_bytes"] = u.replay_rise_bytes
        attrs["bwd_before_replay_bytes"] = u.bwd_before_replay_bytes or 0
    return attrs


def _add_menus(g: nx.DiGraph, p: Profile, chosen: list[str], units: dict[str, UnitRecord]) -> None:
    """Each candidate's menu of selective policies (NOTE [ Selective menus ]). Modules called
    more than once get none: the applier applies one policy to every call of a module."""
    import bisect

    from solvers.op_work import priced_by_work

    if not p.ops:
        return
    calls = Counter(u.fqn for u in p.units)
    ops = sorted(p.ops, key=lambda o: o.seq)
    # NOTE [ Op work ]: measured op times priced by their work (the roofline's own are modelled already)
    op_ms = dict(zip((o.seq for o in ops), (o.forward_ms for o in ops) if p.time_source == "roofline" else
                     priced_by_work([(o.name, o.flops, o.moved_bytes, o.forward_ms) for o in ops])))
    op_seqs = [o.seq for o in ops]
    saves = sorted(held_saves(p))
    tb = g.graph["tensor_bytes"]
    writers = Counter(o.writes for o in ops if o.writes is not None)
    compiled = p.compile is not None  # NOTE [ Compiled profile ], Rule 7: replayed kernels, no Python
    for n in chosen:
        a = g.nodes[n]
        if calls[a["fqn"]] > 1 or n in (ROOT_ID, LOSS_ID):
            continue
        lo, hi = a["fwd_start_seq"], a["fwd_end_seq"]
        inside = ops[bisect.bisect_left(op_seqs, lo):bisect.bisect_right(op_seqs, hi)]
        if any(o.data_dependent for o in inside):
            # selective checkpointing needs the recompute to run the same op calls as the
            # forward; data-dependent shapes (MoE routing) are where they may differ
            continue
        first_inside: dict[int, int] = {}
        outside: set[int] = set()
        for seq, t in saves:
            if lo <= seq <= hi:
                first_inside.setdefault(t, seq)
            else:
                outside.add(t)
        ms = _replayed_ms(inside, op_ms, a["forward_ms"]) if compiled else op_ms
        unit = UnitOps(
            [OpCall(o.seq, o.name, tuple(o.output_ids), ms[o.seq], o.random, o.inplace, o.view, o.mutated,
                    o.writes, o.read_between_writes) for o in inside],
            forward_ms=a["forward_ms"], end_seq=hi, saved_bytes=a["saved_bytes"], first_save_inside=first_inside,
            saved_outside=frozenset(outside), forward_spread_ms=a["forward_spread_ms"],
            **({} if compiled else _thread_factor(p, units.get(n))))
        a["menu"] = build_menu(unit, tensor_bytes=tb, writers=writers,
                               op_cost_ms=(p.sac_recomputed_op_ms, p.sac_kept_op_ms),
                               op_cost_spread_ms=(spread_of_median(p.sac_recomputed_op_spread_ms, p.sac_rounds),
                                                  spread_of_median(p.sac_kept_op_spread_ms, p.sac_rounds)))


REPLAYED = ("matmul", "attention", "softmax")
"""Op categories a compiled replay reruns as kernels of their own; inductor fuses the others into the
backward's kernels (NOTE [ Compiled profile ], Rule 7)."""


def _replayed_ms(inside: list[OpRecord], op_ms: dict[int, float], forward_ms: float) -> dict[int, float]:
    """A unit's op times as a compiled replay costs them (NOTE [ Compiled profile ], Rule 7): the ops of
    ``REPLAYED`` categories share the unit's compiled forward by their eager times, the fused ones 0."""
    heavy = {o.seq for o in inside if category(o.name, random=o.random) in REPLAYED}
    scale = forward_ms / kernels_ms if (kernels_ms := sum(op_ms[s] for s in heavy)) > 0 else 0.0
    return {o.seq: op_ms[o.seq] * scale if o.seq in heavy else 0.0 for o in inside}


def _thread_factor(p: Profile, u: UnitRecord | None) -> dict[str, Any]:
    """The thread factor and count a unit's forward figures are for (NOTE [ Selective menus ], Rule
    (threads)): its cost group's factor, else the profile's; none where the figures are not scaled
    (``Profile.thread_scale`` is set on the 'cpu-thread-time-scaled' clock only)."""
    if not p.thread_scale:
        return {}
    f = u.thread_scale if u is not None and u.thread_scale else p.thread_scale
    return {"thread_factor": f, "threads": p.threads or 1}


def _link_tree(g: nx.DiGraph, chosen: list[str], units: dict[str, UnitRecord]) -> None:
    member = set(chosen)
    for uid in chosen:
        parent = next((a for a in _ancestors(units, uid) if a in member), None)
        g.nodes[uid]["parent"] = parent
        if parent is not None:
            g.nodes[parent]["leaf"] = False


def _graph_node_of_seq(g: nx.DiGraph, chosen: list[str], seq: int) -> str | None:
    """Deepest graph node whose forward range contains ``seq``."""
    best = None
    for n in chosen:
        a = g.nodes[n]
        if a["fwd_start_seq"] <= seq <= a["fwd_end_seq"]:
            if best is None or a["fwd_start_seq"] >= g.nodes[best]["fwd_start_seq"]:
                best = n
    return best


def _add_edges(g: nx.DiGraph, p: Profile, chosen: list[str], units: dict[str, UnitRecord]) -> None:
    producer_node = {t.id: _graph_node_of_seq(g, chosen, t.created_seq) for t in p.tensors}
    tb = g.graph["tensor_bytes"]
    for v in chosen:
        for t in g.nodes[v]["input_ids"]:
            u = producer_node.get(t)
            if u is None or u == v:
                continue
            if is_ancestor(g, u, v) or is_ancestor(g, v, u):
                continue
            if g.has_edge(u, v):
                g.edges[u, v]["bytes"] += tb[t]
            else:
                g.add_edge(u, v, **EdgeAttrs(bytes=tb[t]))


def is_ancestor(g: nx.DiGraph, a: str, b: str) -> bool:
    """True when graph node ``a`` encloses graph node ``b`` (through ``parent`` links)."""
    p = g.nodes[b]["parent"]
    while p is not None:
        if p == a:
            return True
        p = g.nodes[p]["parent"]
    return False


def _add_windows(g: nx.DiGraph, p: Profile, leaves: list[str], units: dict[str, UnitRecord]) -> None:
    """Per leaf: tensors handed on past its window (``in_flight_ids``) and the measured window peaks."""
    ends = [g.nodes[n]["fwd_end_seq"] for n in leaves]
    last_use: dict[int, int] = defaultdict(lambda: -1)
    for u in p.units:
        for t in u.input_ids:
            last_use[t] = max(last_use[t], u.fwd_start_seq)
    created = g.graph["tensor_created_seq"]
    prev_end = -1
    for n, end in zip(leaves, ends):
        g.nodes[n]["in_flight_ids"] = frozenset(
            t for t, c in created.items() if prev_end < c <= end and last_use[t] > end
        )
        prev_end = end

    peaks = window_peaks(p.timeline, leaves)
    g.graph["tail_fwd_peak_bytes"] = peaks.get("end of forward")
    g.graph["tail_bwd_peak_bytes"] = peaks.get("start of backward")
    own = unit_forward_peaks(p.timeline, leaves)
    for n in leaves:
        if f"forward of {n}" in peaks:
            g.nodes[n]["fwd_window_peak_bytes"] = peaks[f"forward of {n}"]
            g.nodes[n]["bwd_window_peak_bytes"] = peaks[f"backward of {n}"]
        if own.get(n) is not None:
            g.nodes[n]["fwd_unit_peak_bytes"] = own[n]


# NOTE [ A replay's temporaries ]
#
# Rule 1. A recompute probe counts what the replay of a region re-creates beside the temporaries of the
# forwards it re-runs (NOTE [ Peak-memory model ], Rule 4). Those were the calibrated T of each leaf's
# forward window, which starts where the previous leaf ended: the code between two leaves is in it, and a
# replay never runs that code. Truncated backprop (``x = x.detach()`` after the second of four MLP blocks)
# frees the first blocks' saves there, so the third block's window peaked before the block began, with
# them alive; as its replay's temporaries they made checkpointing that block look worse than none
# (367,872 predicted, 321,352 measured, unplanned 365,192), and no plan fit below the unplanned peak.
#
# Rule 2. The profile's timeline gives each leaf's own forward, from its fwd_start event to its fwd_end
# (``unit_forward_peaks``); ``calibrate`` sets ``unit_fwd_transient_bytes`` = max(0, that peak - the
# window's modelled bytes), never more than the window's T, and ``CostModel.recompute_transient_bytes``
# takes it; without a timeline (older profiles, synthetic graphs) the window's T, as before. The forward
# and backward windows themselves keep the window's T: their peaks are what is measured.


def _cap_replay_terms(g: nx.DiGraph, tl: list) -> None:
    """Each region's replay terms, measured under the tracker, at most what its forward and its backward had
    alive above their starts as the step ran; and the live bytes when its backward started (NOTE [ What a replay
    allocates ], Rules 5 and 6)."""
    index = {(e.kind, e.unit): i for i, e in enumerate(tl)}
    for n, a in g.nodes(data=True):
        for key, start, end in (("replay_rise_bytes", "fwd_start", "fwd_end"),
                                ("bwd_before_replay_bytes", "bwd_start", "bwd_end")):
            lo, hi = index.get((start, n)), index.get((end, n))
            if key in a and lo is not None and hi is not None and hi > lo:
                a[key] = min(a[key], max(0, max(e.peak_bytes for e in tl[lo + 1: hi + 1]) - tl[lo].live_bytes))
        if "replay_rise_bytes" in a and ("bwd_start", n) in index:  # Rule 6
            a["bwd_start_live_bytes"] = tl[index[("bwd_start", n)]].live_bytes


def _add_checkpointed_windows(g: nx.DiGraph, p: Profile, leaves: list[str]) -> None:
    """Each leaf's forward window peak with the top-level candidates checkpointed, its rise at most the rise of
    the same window in the step as run (NOTE [ Checkpointed forward windows ] in solvers/checkpointed.py)."""
    wins, tl = p.checkpointed_windows, p.timeline
    index = {(e.kind, e.unit): i for i, e in enumerate(tl)}
    starts = [next((i for i, e in enumerate(tl) if e.kind == "step_start"), None)]
    starts += [index.get(("fwd_end", n)) for n in leaves[:-1]]
    for n, lo in zip(leaves, starts):
        hi = index.get(("fwd_end", n))
        if n in wins and lo is not None and hi is not None and hi > lo:
            start, peak = wins[n]
            rise = max(e.peak_bytes for e in tl[lo + 1: hi + 1]) - tl[lo].live_bytes
            end = g.nodes[n]["fwd_end_seq"]  # the regions' RNG states, which the tracker does not see (Rule 3)
            regions = sum(1 for _, a in g.nodes(data=True) if a["parent"] is None and a["fwd_start_seq"] <= end)
            g.nodes[n]["ckpt_fwd_window_peak_bytes"] = (start + max(0, min(peak - start, rise))
                                                        + regions * p.region_state_bytes)


def unit_forward_peaks(tl: list, leaves: list[str]) -> dict[str, int | None]:
    """Measured peak of each leaf's own forward, from its start to its end: its window less the code before
    it (NOTE [ A replay's temporaries ])."""
    index = {(e.kind, e.unit): i for i, e in enumerate(tl)}
    spans = {n: (index.get(("fwd_start", n)), index.get(("fwd_end", n))) for n in leaves}
    return {n: max(e.peak_bytes for e in tl[lo + 1: hi + 1]) for n, (lo, hi) in spans.items()
            if lo is not None and hi is not None and hi > lo}


def window_peaks(tl: list, leaves: list[str]) -> dict[str, int | None]:
    """Measured peak of every window of NOTE [ Peak-memory model ], named as the cost model's probes.

    ``tl`` is a timeline of events with ``kind``, ``unit`` and ``peak_bytes`` (``MemoryEvent``);
    empty when there is no timeline. Without leaves (every candidate excluded) the tail windows are
    the whole forward and the whole backward.
    """
    if not tl:
        return {}
    index = {(e.kind, e.unit): i for i, e in enumerate(tl)}
    pos_of = {e.kind: i for i, e in enumerate(tl) if e.unit is None}

    def peak(lo: int | None, hi: int | None) -> int | None:
        if lo is None or hi is None or hi <= lo:
            return None
        return max(e.peak_bytes for e in tl[lo + 1: hi + 1])

    out: dict[str, int | None] = {}
    # forward windows: (fwd_end of previous leaf, fwd_end of this leaf]
    bounds = [pos_of.get("step_start", 0)] + [index.get(("fwd_end", n)) for n in leaves]
    bounds.append(pos_of.get("forward_end"))
    fwd = _merged_window_peaks(bounds, peak)
    out.update({f"forward of {n}": v for n, v in zip(leaves, fwd[:-1])})
    out["end of forward"] = fwd[-1]
    # backward windows, in backward order: tail, then leaf n, n-1, ..., 1
    bb = [pos_of.get("backward_start")] + [index.get(("bwd_start", n)) for n in reversed(leaves)]
    bb.append(pos_of.get("backward_end"))
    bwd = _merged_window_peaks(bb, peak)
    out["start of backward"] = bwd[0]
    out.update({f"backward of {n}": v for n, v in zip(reversed(leaves), bwd[1:])})
    return out


def _merged_window_peaks(bounds: list[int | None], peak) -> list[int | None]:
    """Peaks of windows (bounds[i], bounds[i+1]] for i in range(len(bounds)-1).

    A missing inner bound merges the two windows around it; both get the merged peak.
    """
    n = len(bounds) - 1
    out: list[int | None] = [None] * n
    i = 0
    while i < n:
        j = i + 1
        while j < n and bounds[j] is None:
            j += 1
        v = peak(bounds[i], bounds[j])
        for k in range(i, j):
            out[k] = v
        i = j
    return out


__all__ = ["build_graph", "candidate_levels", "is_ancestor", "repeated_blocks", "unit_children",
           "window_peaks"]
