"""Offload in planning: the host budget, the plan's offloaded units, and the one-line errors around them.

``remat plan --offload`` lets each unit keep, recompute or move its saved tensors to host memory
(NOTE [ Peak-memory model ], Rule 10, in solvers/cost_model.py; NOTE [ ILP formulation ], Rule 8).
This module holds what ``planner.act.api.plan_from_profile`` and ``remat frontier --offload`` need
beyond the solver: the host budget from ``--host-memory`` or this machine, the plan file's
``offload`` entries, and the bad-input checks. No torch import.

Example::

    host = resolve_host_budget(profile, True, "64GB")        # bytes; None without offload
    plan = plan_from_profile(profile, "12GB", offload=True, host_memory="64GB")
    print([(u.fqn, u.host_bytes, u.exposed_ms) for u in plan.offload])
"""

from __future__ import annotations

import networkx as nx

from planner.errors import BadInput, BudgetInfeasible
from planner.model.schema import OffloadedUnit, Profile
from planner.sizes import format_bytes, parse_bytes
from solvers.cost_model import CostModel

OFFLOAD_SOLVERS = ("auto", "ilp")
"""Solvers that choose offload as a third option (NOTE [ ILP formulation ], Rule 8)."""

OFFLOAD_EAGER = ("{offload} moves saved tensors through autograd's saved-tensor hooks, which a compiled step does "
                 "not run (it would keep them on the device): drop {offload} or {compile}")
"""Offload is applied in eager mode only (planner/act/offload.py skips a traced call)."""

OFFLOAD_ONE_PROCESS = ("{offload} plans one process: under DDP or FSDP2 the ranks' host memory and copies are "
                       "not modelled; drop {offload}, or plan without {sharding}")
"""Offload is planned for one process (NOTE [ Peak-memory model ], Rule 10 models one device and its host)."""


def check_offload(offload: bool, *, solver: str = "auto", world_size: int = 1, sharding: str = "none",
                  n_shapes: int = 1) -> None:
    """The offload checks that need no profile: a solver with the choice, one process, one input shape."""
    if not offload:
        return
    if solver not in OFFLOAD_SOLVERS:
        raise BadInput(f"solver {solver!r} has no offload choice: use {{solver}} auto or ilp with {{offload}}",
                       options=("solver", "offload"))
    if world_size > 1 or sharding != "none":
        raise BadInput(OFFLOAD_ONE_PROCESS, options=("offload", "sharding"))
    check_offload_shapes(offload, n_shapes)


def check_offload_shapes(offload: bool, n_shapes: int) -> None:
    """An offload plan holds one input shape: ``BadInput`` for offload with several (NOTE [ Bucketed plans ])."""
    if offload and n_shapes > 1:
        raise BadInput(f"{{offload}} plans one input shape, and {n_shapes} were given: plan each shape on its own "
                       f"with {{offload}}, or bucket the shapes without it", options=("offload",))


def check_offload_options(offload: bool, host_memory: str | None, *, world_size: int, sharding: str,
                          n_shapes: int, meta: bool, compiled: bool = False) -> None:
    """``remat plan``'s offload options, checked before any profiling (``meta``: a meta step to be profiled,
    which plans for another machine, so it needs ``host_memory``; ``compiled``: ``--compile`` given)."""
    if offload and compiled:
        raise BadInput(OFFLOAD_EAGER, options=("offload", "compile"))
    if host_memory is not None and not offload:
        raise BadInput("{host_memory} is the host budget of offloaded activations: add {offload}, or drop it",
                       options=("host_memory", "offload"))
    if host_memory is not None:
        parse_host_memory(host_memory)
    check_offload(offload, world_size=world_size, sharding=sharding, n_shapes=n_shapes)  # its solver: checked apart
    if offload and meta and host_memory is None:
        raise BadInput("{offload} on --device meta needs {host_memory} SIZE: the host memory of the machine "
                       "that will train, not this one's", options=("host_memory", "offload"))


def parse_host_memory(host_memory: int | str) -> int:
    """``--host-memory`` in bytes, or ``BadInput``: checked before any profiling as well as when planning."""
    try:
        host = parse_bytes(host_memory)
    except BadInput as e:
        raise BadInput(f"{{host_memory}}: {e}", options=("host_memory",)) from None
    if host <= 0:
        raise BadInput(f"{{host_memory}} must be positive, got {host_memory!r}", options=("host_memory",))
    return host


def resolve_host_budget(profile: Profile, offload: bool, host_memory: int | str | None) -> int | None:
    """The host budget of an offload plan (None: no offload), or ``BadInput`` naming the fix.

    Default: ``HOST_MEMORY_FRACTION`` of this machine's available memory for a measured profile; a
    meta profile plans for another machine, so it needs ``host_memory``.
    """
    from planner.profiling.devices import HOST_MEMORY_FRACTION, available_host_bytes

    if not offload:
        if host_memory is not None:
            raise BadInput("{host_memory} is the host budget of offloaded activations: add {offload}, or drop it",
                           options=("host_memory", "offload"))
        return None
    if profile.compile:
        raise BadInput(OFFLOAD_EAGER, options=("offload", "compile"))
    if not profile.host_link_bytes_per_s:
        where = f"device spec {profile.target!r}" if profile.device == "meta" else "this profile"
        raise BadInput(f"{{offload}} needs the bandwidth between device and host memory, and {where} has none: "
                       f"re-profile with this remat (it measures it), or use a device spec with "
                       f"host_link_bytes_per_s (remat devices)", options=("offload",))
    if host_memory is not None:
        return parse_host_memory(host_memory)
    if profile.device == "meta":
        raise BadInput("{offload} on a meta profile needs {host_memory} SIZE: the host memory of the machine that "
                       "will train, not this one's", options=("host_memory", "offload"))
    free = available_host_bytes()
    if free is None:
        raise BadInput("cannot read this machine's available memory: give {host_memory} SIZE with {offload}",
                       options=("host_memory", "offload"))
    return int(free * HOST_MEMORY_FRACTION)


def offloaded_units(g: nx.DiGraph, offloaded: list[str]) -> list[OffloadedUnit]:
    """The plan's ``offload`` entries, with the cost model's bytes and copy times (Rule 10)."""
    model = CostModel.of(g)
    out = []
    for u in offloaded:
        s = model.sync_leaf(u)
        fwd, bwd = model.hidden_ms(u)
        out.append(OffloadedUnit(fqn=g.nodes[u]["fqn"], unit=u, host_bytes=model.offload_bytes(u),
                                 d2h_ms=round(model.copy_ms(u), 6), h2d_ms=round(model.copy_ms(u), 6),
                                 hidden_ms=round(fwd + bwd, 6), exposed_ms=round(model.exposed_ms(u), 6),
                                 sync_fqn=g.nodes[model.leaves[s]]["fqn"] if s < len(model.leaves) else None))
    return out


def host_too_small(g: nx.DiGraph, usable: int, budget_bytes: int, host_budget: int,
                   time_limit_s: float | None) -> None:
    """No plan fits: ``BudgetInfeasible`` naming ``--host-memory`` when more host memory would make one fit."""
    from planner.act.api import solve_graph

    every = CostModel.of(g).host_bytes(list(g.nodes))
    if every <= host_budget:
        return
    roomy = solve_graph(g, usable, time_limit_s=time_limit_s, host_budget_bytes=every)
    if roomy.status == "infeasible":
        return
    raise BudgetInfeasible(
        f"no plan fits the budget of {format_bytes(budget_bytes)} within {format_bytes(host_budget)} of host "
        f"memory; one fits with {format_bytes(roomy.host_peak_bytes)} of host memory: raise {{host_memory}} or "
        f"{{budget}}", budget_bytes=budget_bytes, min_feasible_bytes=None, options=("host_memory", "budget"))


__all__ = ["OFFLOAD_EAGER", "OFFLOAD_ONE_PROCESS", "OFFLOAD_SOLVERS", "check_offload", "check_offload_options", "check_offload_shapes",
           "host_too_small", "parse_host_memory",
           "offloaded_units", "resolve_host_budget"]
