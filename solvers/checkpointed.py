"""The forward windows inside a checkpointed region: their temporaries as the validation step measured them
with the candidates checkpointed (NOTE [ Checkpointed forward windows ]). Torch-free, like every solver module.

Example::

    calibrate_checkpointed_windows(g, CostModel.build(g, calibrated=False, per_rank=False))
    g.nodes["h.3"]["ckpt_fwd_transient_bytes"]   # T of h.3's forward window when h.3 is checkpointed
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import networkx as nx

if TYPE_CHECKING:
    from solvers.cost_model import CostModel

# NOTE [ Checkpointed forward windows ]
#
# Rule 1. A forward window's temporaries T (NOTE [ Peak-memory model ], Rule 6) are calibrated on the step
# without checkpointing: its measured peak less the window's bytes at its end. Inside a checkpointed region
# the window peaks elsewhere: what the region saves is not held, yet alive as its locals until it returns,
# so its end holds less and its peak no less. Four gate blocks (width 128, ``x = h + g``), the last
# checkpointed by hand, its own forward the step's peak: 1,522,568 predicted, 1,582,532 measured (-3.79%).
#
# Rule 2. The validation step (NOTE [ Validation step ]) runs with every top-level candidate checkpointed;
# it records each leaf's forward window there, the live bytes at its start and its peak
# (``Profile.checkpointed_windows``), the rise capped by the window's rise in the step as run (NOTE [ Step as
# run ], Rule 3; ``_add_checkpointed_windows`` in planner/model/graph.py). ``calibrate`` sets each leaf's
# ``ckpt_fwd_transient_bytes``, that peak less the model's bytes for the window with the top-level
# candidates checkpointed, and a window whose leaf is inside a fully checkpointed region takes it for its
# T (``CostModel.forward_base``; the DP's full choice and the ILP's full variables the same). Selective and
# offloaded regions keep the unplanned T; so does every window when nothing was measured (a candidate
# excluded, or another wrapper on one).
#
# Rule 3. The tracker does not see the RNG state each region keeps (made outside the dispatcher; NOTE [
# Validation step ]), which the model counts as retained bytes of every region: the measured peak takes the
# states of the regions begun by the window's end. Without them the gate blocks' last window was 4 x 5,056
# bytes under (1,562,308 / 1,582,532).


def calibrate_checkpointed_windows(g: nx.DiGraph, raw: CostModel) -> None:
    """Each leaf's forward temporaries with the top-level candidates checkpointed, as the validation step ran
    them (NOTE [ Checkpointed forward windows ]); ``raw``: the model without temporaries."""
    leaves = [n for n in g.graph["leaves"] if g.nodes[n].get("ckpt_fwd_window_peak_bytes") is not None]
    if leaves:
        probes = {p[0]: p[1] for p in raw.probes(frozenset(n for n, a in g.nodes(data=True) if a["parent"] is None))}
        for n in leaves:
            g.nodes[n]["ckpt_fwd_transient_bytes"] = max(0, g.nodes[n]["ckpt_fwd_window_peak_bytes"]
                                                         - probes[f"forward of {n}"])


__all__ = ["calibrate_checkpointed_windows"]
