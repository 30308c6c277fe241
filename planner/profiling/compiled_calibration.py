"""The second compile's figures in a compiled profile (NOTE [ Compiled profile ] in
``planner/profiling/compiled.py``): what a compile with the repeated blocks checkpointed saves beyond
the regions' inputs (Rule 4), the backward windows it bounds (Rule 9) and the replay offset (Rule 8).

``profile_compiled`` applies them in that order.

Example::

    result = with_region_saves(result, eager, regions, model, candidates, graphs)
    result = with_replay_calibration(with_backward_bounds(result, replayed, candidates), replayed, candidates)
"""

from __future__ import annotations

from collections import defaultdict

import torch

from planner.model import schema
from planner.model.schema import ROOT_ID
from planner.profiling.compiled import CompiledStep, _tensor_ids, _with_inputs
from planner.profiling.compiled_graphs import (Graphs as _Graphs, ModuleNames, Units as _Units, identities as _identities,
                                               layout as _layout, readers, saved_storages)


def with_region_saves(profile: schema.Profile, eager: schema.Profile, graphs: _Graphs, model: torch.nn.Module,
                      regions: list[str], first: _Graphs) -> schema.Profile:
    """``profile`` with what the compile with ``regions`` checkpointed saves beyond the regions'
    inputs (NOTE [ Compiled profile ], Rule 4): storages a region allocated (a random op's seed; the
    attention mask inductor computes once, in the first layer, for all) as retained bytes of its
    unit; storages code outside every region allocated and regions read as new inputs of those units."""
    names, units = ModuleNames(model), _Units(eager)
    saved, stacks = saved_storages(graphs, names)
    computed = {f"{k}:{n.name}" for k, fw in enumerate(graphs.forward) for n in fw.graph.nodes
                if n.op not in ("placeholder", "output")}
    chains = {name: units.chain(stack) for name, stack in stacks.items() if name in computed}
    identity = _identities(graphs, chains, units, eager)
    first_saved, first_stacks = saved_storages(first, names)
    known = {(s.owner, s.nbytes) for s in first_saved}  # compile 1 has them already
    wanted = set(regions)
    retained = {r.unit: r.nbytes for r in profile.retained}
    tensors, crossing = list(profile.tensors), defaultdict(set)
    next_id = max((t.id for t in tensors), default=-1) + 1
    scale = _scale_of(profile, eager)
    held = {r.tensor_id for r in profile.saves}
    for s in saved:
        if (s.owner, s.nbytes) in known:
            continue
        if s.owner in identity:  # an eager tensor kept for a replay of code before a region
            _replayed_before(profile, units.of_fqn, regions, identity[s.owner], held, crossing)
            continue
        region = next((f for f in stacks.get(s.owner, []) if f in wanted), None)
        if region is not None:  # kept because its region is checkpointed (Rule 4)
            unit = units.of_fqn[region]
            retained[unit] = retained.get(unit, 0) + s.nbytes
            continue
        made = set(chains.get(s.owner, [ROOT_ID]))
        outside = {u for r in _readers_of(graphs, s.owner) for u in chains.get(r, []) if u not in made}
        if outside:
            owner_unit = chains[s.owner][-1] if s.owner in chains else ROOT_ID
            tensors.append(schema.TensorRecord(id=next_id, nbytes=s.nbytes, producer=owner_unit,
                                               created_seq=scale * units.by_id[owner_unit].fwd_start_seq))
            for u in outside:
                crossing[u].add(next_id)
            next_id += 1
    nbytes = {t.id: t.nbytes for t in tensors}
    unsaved = _unsaved_inputs(eager, first, first_saved, first_stacks, units, identity, saved)
    return profile.model_copy(update={
        "tensors": tensors, "units": _with_inputs(_without_inputs(profile.units, wanted, unsaved, nbytes),
                                                  crossing, nbytes),
        "retained": [schema.RetainedBytes(unit=u, nbytes=b) for u, b in retained.items()]})


def _replayed_before(profile: schema.Profile, of_fqn: dict[str, str], regions: list[str], tensor: int,
                     held: set[int], crossing: dict[str, set[int]]) -> None:
    """An eager tensor the compile with ``regions`` checkpointed saves and the first compile does not
    (Rule 4): the input of code between it and the first region after it, which the region's replay
    re-runs (GPT-2's token and position embeddings, kept to replay the embedding dropout inside the
    first block's replay); an input of that region, held while it is checkpointed."""
    if tensor in held:
        return
    created = next(t.created_seq for t in profile.tensors if t.id == tensor)
    starts = sorted((u.fwd_start_seq, u.id) for u in profile.units if u.id in {of_fqn[f] for f in regions})
    first = next((u for start, u in starts if start >= created), None)
    if first is not None:
        crossing[first].add(tensor)


def _unsaved_inputs(eager: schema.Profile, first: _Graphs, first_saved: list, first_stacks: dict, units: _Units,
                    identity: dict[str, int], saved: list) -> set[int]:
    """Tensors the compile with the regions checkpointed (``saved``) does not save although it knows them
    (Rule 4): eager boundary tensors it identified, and the first compile's saved storages (``first_saved``,
    by owner and bytes), whose ids ``compiled_profile`` gave. What neither compile names stays an input (the
    safe side)."""
    lay = _layout(first, first_stacks, units, eager)
    first_ids = _tensor_ids(first_saved, lay, max((t.id for t in eager.tensors), default=-1) + 1)
    pairs = {(s.owner, s.nbytes) for s in saved}
    kept = {identity[s.owner] for s in saved if s.owner in identity}
    kept |= {first_ids[s.owner] for s in first_saved if (s.owner, s.nbytes) in pairs}
    known = set(identity.values()) | {t for o, t in first_ids.items() if o not in lay.identity}
    return known - kept


def _without_inputs(units: list[schema.UnitRecord], regions: set[str], unsaved: set[int],
                    nbytes: dict[int, int]) -> list[schema.UnitRecord]:
    """The units of ``regions`` without the inputs their compile does not save (Rule 4); their
    submodules keep them, so that a tensor stays in flight where the forward still passes it on."""
    out = []
    for u in units:
        drop = [t for t in u.input_ids if t in unsaved] if u.fqn in regions else []
        out.append(u.model_copy(update={"input_ids": [t for t in u.input_ids if t not in drop],
                                        "input_bytes": u.input_bytes - sum(nbytes[t] for t in drop)})
                   if drop else u)
    return out


def _scale_of(profile: schema.Profile, eager: schema.Profile) -> int:
    """K of Rule 2: the factor between a compiled profile's positions and the eager ones."""
    for a, b in zip(profile.units, eager.units):
        if b.fwd_end_seq:
            return a.fwd_end_seq // b.fwd_end_seq
    return 1


def _readers_of(graphs: _Graphs, owner: str) -> list[str]:
    """Names (``k:node``) of the forward nodes that read ``owner``'s storage, through views."""
    k, name = owner.split(":", 1)
    fw = graphs.forward[int(k)]
    node = next(n for n in fw.graph.nodes if n.name == name)
    return [f"{k}:{u.name}" for u in readers(node)]


def with_backward_bounds(profile: schema.Profile, replayed: CompiledStep, regions: list[str]) -> schema.Profile:
    """``profile`` with each leaf's backward window that, with ``regions`` checkpointed, is predicted
    above the measured backward peak of that step lowered to it (NOTE [ Compiled profile ], Rule 9)."""
    from planner.model.graph import build_graph, window_peaks
    from solvers.cost_model import window_bytes

    g = build_graph(profile, selective=False)
    leaves = g.graph["leaves"]
    probes = window_bytes(g, [n for n in g.nodes if g.nodes[n]["fqn"] in regions])
    window_peak = window_peaks(profile.timeline, leaves)
    caps_bytes = {}
    for leaf in leaves:
        excess = probes[f"backward of {leaf}"] - replayed.backward_peak_bytes
        measured = window_peak.get(f"backward of {leaf}")
        if excess > 0 and measured is not None:
            caps_bytes[leaf] = max(0, measured - excess)
    if not caps_bytes:
        return profile
    return profile.model_copy(update={"timeline": _capped_backward_windows(profile.timeline, leaves, caps_bytes)})


def _capped_backward_windows(timeline: list[schema.MemoryEvent], leaves: list[str],
                             caps_bytes: dict[str, int]) -> list[schema.MemoryEvent]:
    """``timeline`` with the events of each leaf's backward window (as ``window_peaks`` bounds it)
    capped at ``caps_bytes[leaf]``; a window without both bounds is left as it is (the safe side)."""
    index = {(e.kind, e.unit): i for i, e in enumerate(timeline)}
    bounds = [index.get(("bwd_start", n)) for n in reversed(leaves)]
    bounds.append(index.get(("backward_end", None)))
    out = list(timeline)
    for leaf, lo, hi in zip(reversed(leaves), bounds, bounds[1:]):
        if leaf not in caps_bytes or lo is None or hi is None:
            continue
        cap = caps_bytes[leaf]
        for i in range(lo + 1, hi + 1):
            e = out[i]
            out[i] = e.model_copy(update={"live_bytes": min(e.live_bytes, cap), "peak_bytes": min(e.peak_bytes, cap)})
    return out


def with_replay_calibration(profile: schema.Profile, replayed: CompiledStep, regions: list[str]) -> schema.Profile:
    """``profile`` with ``replay_transient_bytes`` set so that the highest recompute probe with ``regions``
    checkpointed meets the measured backward peak of that step, from above or below (NOTE [ Compiled
    profile ], Rules 8-9)."""
    from planner.model.graph import build_graph
    from solvers.cost_model import window_bytes

    g = build_graph(profile.model_copy(update={"compile": profile.compile.model_copy(
        update={"replay_transient_bytes": 0})}), selective=False)
    probes = window_bytes(g, [n for n in g.nodes if g.nodes[n]["fqn"] in regions])
    replay = max((v for k, v in probes.items() if k.startswith("recompute of")), default=None)
    offset = 0 if replay is None else replayed.backward_peak_bytes - replay
    info = profile.compile.model_copy(update={"replay_transient_bytes": offset})
    return profile.model_copy(update={"compile": info})


__all__ = ["with_backward_bounds", "with_region_saves", "with_replay_calibration"]
