"""Interleaved 1F1B plans (NOTE [ Interleaved stages ] in solvers/interleaved.py): each of pp ranks holds
V stages; torch's own order of a rank's forwards and backwards, and the joint plan of a rank's stages.

Example::

    interleaved_order(2, 2, 4, rank=0)[:3]     # [('F', 0, 0), ('F', 0, 1), ('F', 2, 0)]
    plan_pipeline("model.py", "40GB", pipeline_layout(2, "interleaved-1f1b", 4, stages_per_rank=2))
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from planner.model.schema import SolverInfo, StagePlan
from planner.spec import SolveSpec


class _StandInStage:
    """What ``ScheduleInterleaved1F1B`` reads of a stage to make its order: no module, no process group."""

    def __init__(self, index: int, num_stages: int, pp: int, rank: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == num_stages - 1


@lru_cache(maxsize=64)
def _orders(pp: int, per_rank: int, micro_batches: int) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    out = []
    for rank in range(pp):
        stages = [_StandInStage(rank + v * pp, pp * per_rank, pp, rank) for v in range(per_rank)]
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=micro_batches)  # type: ignore[arg-type]
        out.append(tuple(("F" if a.computation_type == _ComputationType.FORWARD else "B", a.stage_index,
                          a.microbatch_index) for a in sched.pipeline_order[rank] if a is not None))
    return tuple(out)


def interleaved_order(pp: int, per_rank: int, micro_batches: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s forwards ('F') and backwards ('B') as (kind, stage, micro-batch), in the order torch 2.13's
    ``ScheduleInterleaved1F1B`` runs them (NOTE [ Interleaved stages ], Rule 1)."""
    return list(_orders(pp, per_rank, micro_batches)[rank])


def plan_interleaved(profiled: list[Any], budget_bytes: int, spec: SolveSpec) -> list[StagePlan | int]:
    """One plan per stage, a rank's stages planned together (Rule 6); where a rank fits nothing, each of its
    stages gives the budget the rank needs at least (with the headroom)."""
    from planner.act.api import budget_with_headroom
    from planner.act.pipeline import _solver, make_stage_plan, stage_graph
    from solvers.interleaved import plan_rank, rank_peak
    from solvers.pipeline import StagePeak, buffers_bytes, held_bytes, order_in_flight

    pp = profiled[0].attrs["pp_stages"] // len({s for _, s, _ in profiled[0].attrs["pp_rank_order"]})
    out: list[StagePlan | int] = [0] * len(profiled)
    for rank in range(pp):
        mine = [st for st in profiled if st.attrs["pp_stage"] % pp == rank]
        built = [stage_graph(st, budget_bytes, spec) for st in mine]
        graphs = [b[0] for b in built]
        room, usable, headroom_bytes = built[0][1], min(b[2] for b in built), max(b[3] for b in built)
        solve = _solver(spec.solver, spec.time_limit_s)
        chosen, lowest = plan_rank(graphs, usable, solve)
        if chosen is None:
            for st in mine:
                out[st.attrs["pp_stage"]] = budget_with_headroom(lowest, room)
            continue
        peak = rank_peak(graphs, chosen)
        no_plan = rank_peak(graphs, [([], {}) for _ in graphs]).peak_bytes
        info = SolverInfo(name=solve.used, status="feasible", detail="the rank's stages searched together "
                                                                       "(NOTE [ Interleaved stages ], Rule 6)")
        for st, g, c in zip(mine, graphs, chosen):  # Rule 7: each stage carries its rank's peak
            sp = StagePeak(**{**peak.__dict__, "held_bytes": held_bytes(g, *c), "buffers_bytes": buffers_bytes(g),
                              "in_flight": order_in_flight(g.graph["pp_rank_order"], st.attrs["pp_stage"])})
            out[st.attrs["pp_stage"]] = make_stage_plan(st, g, c, sp, no_plan, lowest, headroom_bytes, info)
    return out


__all__ = ["interleaved_order", "plan_interleaved"]
