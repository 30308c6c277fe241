"""Why this plan: one line per candidate unit, derived from the cost model (``remat plan --why``).

See NOTE [ Why this plan ]. No torch import.

Example::

    for line in explain(graph_for(profile), plan):
        print(line)                            # why each unit is (or is not) checkpointed
"""

from __future__ import annotations

import networkx as nx

from planner.errors import SolverError
from planner.model.schema import Plan
from planner.sizes import format_bytes
from solvers.cost_model import CostModel, check_checkpoint_set, simulate

# NOTE [ Why this plan ]
#
# Every figure here comes from ``simulate`` (NOTE [ Peak-memory model ]), never from a formula of
# its own: for each candidate unit,
#   - checkpointed: the peak without it (``simulate`` of the plan less the unit) and whether that
#     still fits the usable budget; what it frees per millisecond of recompute;
#   - not checkpointed: the peak with it added, and what it would free at the peak per ms;
#   - offloaded (``--offload``): the peak without it, its exposed copy time and the compute that
#     hides the rest (``CostModel.exposed_ms``, ``hidden_ms``);
#   - excluded: the reason the profile gives (unsafe to recompute);
#   - identical units (same module type, forward ms, saved and parameter bytes): the plan with the
#     checkpointed one swapped for its unchosen twin is simulated. The same peak and recompute is a
#     tie: nothing in the cost model prefers either, and the solver returns one of the equal optima
#     (whichever its search meets first; it is not a rule to rely on). Another peak means the
#     position in the step decides (saved tensors of earlier units live longer).
# The line also says where the unit runs relative to the window that sets the peak
# (``Estimate.peak_at``): before it, in it, or after it in forward order.

MAX_UNITS = 128
"""Units explained one by one; beyond that the cost (a simulation per unit and twin) is not worth it."""


def explain(g: nx.DiGraph, plan: Plan) -> list[str]:
    """One line per candidate unit of ``g`` for ``plan`` (NOTE [ Why this plan ])."""
    usable = plan.budget_bytes - plan.headroom_bytes
    chosen = [u for u in plan.checkpoint_units if u in g.nodes]
    selective = _selective_indices(g, plan)
    off = tuple(u.unit for u in plan.offload if u.unit in g.nodes)
    here = simulate(g, chosen, selective, off)
    lines = [f"peak {format_bytes(here.peak_bytes)} at {here.peak_at}; usable budget {format_bytes(usable)} "
             f"(budget less {format_bytes(plan.headroom_bytes)} headroom)"]
    for x in plan.excluded:
        lines.append(f"{x.module or '<root>'}: excluded from plans: {x.reason}")
    nodes = sorted(g.nodes, key=lambda n: g.nodes[n]["order"])
    if len(nodes) > MAX_UNITS:
        return [*lines, f"({len(nodes)} candidates: --why explains up to {MAX_UNITS})"]
    peak_window = _peak_unit(g, here.peak_at)
    for n in nodes:
        lines.append(f"{n}: {_one(g, n, chosen, selective, off, here, usable)}; "
                     f"{_position(g, n, peak_window, here.peak_at)}")
    return lines


def _one(g: nx.DiGraph, n: str, chosen: list[str], selective: dict[str, int], off: tuple[str, ...], here,
         usable: int) -> str:
    ms = g.nodes[n]["forward_ms"]
    if n in off:
        return _offloaded(g, n, chosen, selective, off, here, usable)
    if n in selective:
        return f"checkpointed op by op ({g.nodes[n]['menu'][selective[n]].recompute_ms:.3f} ms of recompute)"
    if n in chosen:
        rest = [c for c in chosen if c != n]
        without = simulate(g, rest, selective, off)
        need = ("needed: without it the peak is " f"{format_bytes(without.peak_bytes)}, over the usable budget"
                if without.peak_bytes > usable else
                f"without it the peak is {format_bytes(without.peak_bytes)}, still within the budget")
        freed = without.peak_bytes - here.peak_bytes
        return (f"checkpointed, {ms:.3f} ms of recompute; {need}; frees {format_bytes(freed)} at the peak "
                f"({_per_ms(freed, ms)}){_twin(g, n, chosen, selective, off, here)}")
    if not _addable(g, [*chosen, n], selective, off):
        return "not checkpointed: it nests with a checkpointed unit"
    added = simulate(g, [*chosen, n], selective, off)
    freed = here.peak_bytes - added.peak_bytes
    if freed <= 0:
        return f"not checkpointed: adding it frees nothing at the peak and costs {ms:.3f} ms"
    return (f"not checkpointed: adding it frees {format_bytes(freed)} at the peak ({_per_ms(freed, ms)}), "
            f"which the budget does not need")


def _offloaded(g: nx.DiGraph, n: str, chosen: list[str], selective: dict[str, int], off: tuple[str, ...], here,
               usable: int) -> str:
    """An offloaded unit's line: what keeping it would cost in memory, and its copies' time."""
    model = CostModel.of(g)
    without = simulate(g, chosen, selective, [o for o in off if o != n])
    need = (f"needed: kept, the peak is {format_bytes(without.peak_bytes)}, over the usable budget"
            if without.peak_bytes > usable else
            f"kept, the peak is {format_bytes(without.peak_bytes)}, still within the budget")
    fwd, bwd = model.hidden_ms(n)
    return (f"offloaded, {format_bytes(model.offload_bytes(n))} to host memory, {model.copy_ms(n):.3f} ms per copy "
            f"each way, {fwd + bwd:.3f} ms of compute to hide them, {model.exposed_ms(n):.3f} ms exposed; {need}")


def _twin(g: nx.DiGraph, n: str, chosen: list[str], selective: dict[str, int], off: tuple[str, ...], here) -> str:
    """The tie rule, when an identical unit was left out (NOTE [ Why this plan ])."""
    sig = _signature(g, n)
    for other in sorted(g.nodes, key=lambda m: g.nodes[m]["order"]):
        if other in chosen or other in off or other == n or _signature(g, other) != sig:
            continue
        swapped = [other if c == n else c for c in chosen]
        if not _addable(g, swapped, selective, off):
            continue
        alt = simulate(g, swapped, selective, off)
        if (alt.peak_bytes, round(alt.recompute_ms, 6)) == (here.peak_bytes, round(here.recompute_ms, 6)):
            return (f"; tie with the identical {other}: the same peak and recompute either way, so no rule of the "
                    f"cost model prefers one and the solver returned one of the equal optima")
        return (f"; identical to {other}, but its position decides: with {other} instead the peak would be "
                f"{format_bytes(alt.peak_bytes)}")
    return ""


def _signature(g: nx.DiGraph, n: str) -> tuple:
    a = g.nodes[n]
    return a["module_type"], round(a["forward_ms"], 6), a["saved_bytes"], a["param_bytes"]


def _addable(g: nx.DiGraph, chosen: list[str], selective: dict[str, int], off: tuple[str, ...] = ()) -> bool:
    try:
        check_checkpoint_set(g, chosen, selective, off)
    except SolverError:  # nested, or one call of a module without the others (NOTE [ Tied calls ])
        return False
    return True


def _per_ms(freed: int, ms: float) -> str:
    return f"{format_bytes(freed / ms)} per ms of recompute" if ms > 0 else "at no measured recompute cost"


def _peak_unit(g: nx.DiGraph, peak_at: str) -> str | None:
    """The graph node whose forward or backward window is ``peak_at`` ('backward of h.2' -> 'h.2'), if any."""
    for prefix in ("forward of ", "backward of ", "recompute of "):
        if peak_at.startswith(prefix):
            return peak_at[len(prefix):]
    return None


def _position(g: nx.DiGraph, n: str, peak_unit: str | None, peak_at: str) -> str:
    if peak_unit is None or peak_unit not in g.nodes:
        return f"runs before the peak ({peak_at})" if peak_at != "optimizer step" else \
            "the peak is at the optimizer step, after every unit"
    mine, theirs = g.nodes[n]["order"], g.nodes[peak_unit]["order"]
    if n == peak_unit:
        return "the peak is in its own window"
    return f"runs {'before' if mine < theirs else 'after'} the window that sets the peak ({peak_unit})"


def _selective_indices(g: nx.DiGraph, plan: Plan) -> dict[str, int]:
    """The plan's selective regions as {node: index into its menu}, matched by the ops each keeps."""
    out = {}
    for region in plan.selective:
        menu = g.nodes[region.unit].get("menu", ()) if region.unit in g.nodes else ()
        saved = [(o.op, o.index) for o in region.save]
        for k, pol in enumerate(menu):
            if list(pol.saved) == saved:
                out[region.unit] = k
                break
    return out


__all__ = ["explain", "MAX_UNITS"]
