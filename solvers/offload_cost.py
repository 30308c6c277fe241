"""The offload terms of the cost model (NOTE [ Peak-memory model ], Rule 10): what an offloaded unit
copies, when it is on the device, how long its copies take and how much of that compute hides.

``CostModel`` inherits them (``solvers.cost_model.CostModel``); no torch import.

Example::

    model = CostModel.of(g)
    model.offload_bytes("h.0"), model.copy_ms("h.0"), model.exposed_ms("h.0")
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from solvers.errors import SolverError

# NOTE [ Offload costs ]
#
# NOTE [ Peak-memory model ], Rule 10 (NOTE [ Offloaded units ] in planner/act/offload.py says how
# the applier does it). A candidate u may instead be offloaded: its saved tensors go to host
# memory after they are saved and come back for its backward. The set O of offloaded units is disjoint from C, and
# C u O keeps the antichain and tie rules (tied calls are never offloaded, as they have no menu).
# For u in O, with S(u, p) the bytes of the distinct storages saved inside u at or before p and
# S_u = S(u, end(u)):
#   - its save events are dropped, as a region's are; its inputs are not held (nothing replays u);
#   - device, backward: at the backward of window i inside u, S(u, end(l_i)) is on the device
#     again (the restore, like R_i: every storage of u comes back on u's first unpack and is
#     freed as backward passes its save); a storage u saves that is also held elsewhere is
#     counted twice, as the restore makes a second copy; no recompute probe;
#   - device, in transfer (graph "copy_engine", a CUDA device): u's copies run on a copy engine,
#     so S_u stays on the device at every forward probe from u's first leaf through its sync
#     leaf s(u), the leaf after u's last (whose forward end waits for the copy), or the end of
#     forward when u holds the last leaf; and the prefetch puts S_u on the device at the backward
#     of s(u) (or the start of backward). S_u is counted there even where part of it is held or
#     in flight anyway: an over-count, on the safe side, and linear in the choice. Without a copy
#     engine (the CPU) the copy is a memcpy on the compute thread: nothing stays in transfer;
#   - time: each copy takes S_u / host_link_bytes_per_s one way. With a copy engine the device-to-
#     host copy hides behind s(u)'s forward and the host-to-device copy behind its backward:
#     exposed(u) = max(0, copy - forward_ms(s(u))) + max(0, copy - backward_ms(s(u))) (none after
#     the last leaf). Copies queue on one engine per direction, but each unit's copy starts by the
#     end of u (the previous unit's copy was waited for by then, at its own sync leaf), so summing
#     exposed(u) over O bounds the step's exposed time from above. Without a copy engine both
#     copies are exposed: 2 * copy. The step's offload_ms is the sum, times the micro-batches;
#   - host: each offloaded unit copies its own storages (a storage two units save is copied by
#     each, and each restores its own copy), on the host from the copy until the restore; all of
#     them at the end of forward: host peak = sum of S_u over O (pinned buffers on CUDA, numpy
#     buffers on the CPU: host memory either way), at most the host budget.


class OffloadTerms:
    """Rule 10's terms, on ``CostModel``'s tables (``graph``, ``leaves``, ``node_leaves``, ``saves``,
    ``save_seqs``, ``tensor_bytes``)."""

    graph: Any
    leaves: Any
    node_leaves: Any
    saves: Any
    save_seqs: Any
    tensor_bytes: Any

    def restored_bytes(self, u: str, upto_seq: int) -> int:
        """S(u, p) of Rule 10: bytes of the distinct storages saved inside ``u`` at or before ``upto_seq``
        (what an offloaded ``u`` brings back to the device for its backward, not yet passed)."""
        a = self.graph.nodes[u]
        lo = bisect.bisect_left(self.save_seqs, a["fwd_start_seq"])
        hi = bisect.bisect_right(self.save_seqs, min(a["fwd_end_seq"], upto_seq))
        return sum(self.tensor_bytes[t] for t in {t for _, t, _ in self.saves[lo:hi]})

    def offload_bytes(self, u: str) -> int:
        """S_u of Rule 10: what offloading ``u`` copies to host memory and back."""
        return self.restored_bytes(u, self.graph.nodes[u]["fwd_end_seq"])

    def sync_leaf(self, u: str) -> int:
        """s(u) of Rule 10: the index of the leaf after ``u``'s last (``len(leaves)``: the end of forward)."""
        return max(self.node_leaves[u], default=-1) + 1

    def in_transfer(self, offloaded: frozenset[str]) -> tuple[dict[int, int], dict[int, int]]:
        """Rule 10, in transfer (a copy engine only): bytes on the device at each forward probe (by leaf
        index, ``len(leaves)`` for the end of forward) and at each backward probe (the prefetch)."""
        fwd: dict[int, int] = {}
        bwd: dict[int, int] = {}
        if not offloaded or not self.graph.graph.get("copy_engine", False):
            return fwd, bwd
        for u in offloaded:
            b, s = self.offload_bytes(u), self.sync_leaf(u)
            for i in range(min(self.node_leaves[u], default=s), s + 1):
                fwd[i] = fwd.get(i, 0) + b
            bwd[s] = bwd.get(s, 0) + b
        return fwd, bwd

    def copy_ms(self, u: str) -> float:
        """One way's copy time of offloaded ``u`` over the host link (Rule 10), one micro-batch."""
        link = self.graph.graph.get("host_link_bytes_per_s")
        if not link:
            raise SolverError("this profile has no host link bandwidth, so offloading cannot be timed; "
                              "plan without offload, or re-profile (remat profile records it)")
        return self.offload_bytes(u) / link * 1e3

    def hidden_ms(self, u: str) -> tuple[float, float]:
        """(forward, backward) compute the copies of offloaded ``u`` hide behind: its sync leaf's; none
        without a copy engine or after the last leaf (Rule 10)."""
        s = self.sync_leaf(u)
        if not self.graph.graph.get("copy_engine", False) or s >= len(self.leaves):
            return 0.0, 0.0
        a = self.graph.nodes[self.leaves[s]]
        return a["forward_ms"], a["backward_ms"]

    def exposed_ms(self, u: str) -> float:
        """exposed(u) of Rule 10, per step (all micro-batches): the copies' time not hidden behind compute."""
        copy = self.copy_ms(u)
        fwd, bwd = self.hidden_ms(u)
        return self.graph.graph.get("micro_batches", 1) * (max(0.0, copy - fwd) + max(0.0, copy - bwd))

    def host_bytes(self, offloaded: Iterable[str]) -> int:
        """Host peak of Rule 10: the sum of S_u over the offloaded units."""
        return sum(self.offload_bytes(u) for u in offloaded)


__all__ = ["OffloadTerms"]
