"""Op times for the selective menus, priced from each op's work (NOTE [ Op work ]). No torch import.

Example::

    ms = priced_by_work([(op.name, op.flops, op.moved_bytes, op.forward_ms) for op in profile.ops])
"""

from __future__ import annotations

from collections.abc import Sequence

# NOTE [ Op work ]
# What a menu keeps is decided op by op (NOTE [ Selective menus ]): which of a unit's ops are
# kept at each byte level is a knapsack over their times, so the order of near-equal ops sets
# the policy. Measured one by one, ops of the same kind and size do not come out equal: on
# examples/gpt2.py three ``aten.mul.Tensor`` calls over the same 3 MiB read 0.10, 0.15 and
# 0.21 ms in one profile and in another order in the next (least of three steps each, one
# CPU thread, beside another process), and which of them a policy kept moved with them
# (docs/benchmarks.md, "Same plan every time"). An op's time is its work at its kind's rate,
# and the rate is what a profile measures well, over every call of that kind:
# Rule 1. Each op's work is what the roofline counts (NOTE [ Roofline ]): its FLOPs where
#   torch's flop counter knows the op (matmuls, convolutions, attention), else the bytes of its
#   tensor inputs and outputs (``planner.profiling.roofline.op_work``; ``OpRecord.flops``,
#   ``OpRecord.moved_bytes``). Views and allocations that write nothing have none.
# Rule 2. Each op overload (``aten.addmm.default``, ``aten.tanh.default``: a transcendental
#   moves bytes at about a tenth of a multiply's rate, so one rate for all bytes would misprice it)
#   gets one rate per kind of work: the sum of its calls' measured times over the sum of their
#   work, over the whole profile (the pooled, least-of-steps times of NOTE [ Op records ]).
#   An op's time is its work times that rate. On examples/gpt2.py the block matmuls' own rates
#   agree within 5% (one profile: 2.17 ms for 226 MFLOP, 0.70 ms for 75 MFLOP, 2.94 ms for 302 MFLOP).
# Rule 3. An op with no work keeps its measured time, and so does every op of a profile whose
#   ops carry no work (older profiles) or whose times are the roofline's already (meta).
# The sum of a kind's times over the profile is unchanged (the rate is a ratio of sums), so the
# kernels' share of a unit's forward (phi of NOTE [ Selective menus ]) moves only by how the
# kind's time is spread over units. The unit times and the whole-step cost model are untouched:
# this prices only the op-level menus.


def priced_by_work(ops: Sequence[tuple[str, float, int, float]]) -> list[float]:
    """Each op's time by NOTE [ Op work ]: ``ops`` are (overload name, FLOPs, bytes moved, measured
    ms) in any order; returns the priced ms in the same order."""
    sums: dict[tuple[str, bool], list[float]] = {}
    for name, flops, moved, ms in ops:
        work = flops if flops > 0 else moved
        if work > 0:
            acc = sums.setdefault((name, flops > 0), [0.0, 0.0])
            acc[0] += ms
            acc[1] += work
    out = []
    for name, flops, moved, ms in ops:
        work = flops if flops > 0 else moved
        acc = sums.get((name, flops > 0))
        out.append(acc[0] / acc[1] * work if work > 0 and acc and acc[1] > 0 else ms)
    return out


__all__ = ["priced_by_work"]
