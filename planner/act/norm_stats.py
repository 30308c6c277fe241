"""A region's replay leaves its norm layers' running statistics as its forward left them (NOTE
[ BatchNorm under recomputation ]).

Example::

    with running_stats_kept(norms):              # around a checkpointed region's recompute
        out = region(*args)
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


# NOTE [ BatchNorm under recomputation ]
#
# A training-mode BatchNorm updates ``running_mean``, ``running_var`` and
# ``num_batches_tracked`` in place on every forward, so recomputing a region would update them
# twice per step. While a region is recomputed (eager mode), the running statistics of the
# norm layers inside it are copied beforehand and copied back afterwards (also when the
# recomputation stops early, which ``checkpoint`` does by raising inside it). The output of a
# training-mode BatchNorm does not read the running statistics, so the recomputed activations
# are unaffected; after the step the statistics equal the unplanned model's exactly. Other
# in-place updates of module state inside a region (a custom counter, a KV cache) are not
# undone: the profiler's validation step keeps such modules out of plans (NOTE [ Validation
# step ]), and a Hugging Face cache is turned off while training (NOTE [ Step changes ]).

class running_stats_kept:
    """Restore the running statistics of ``norms`` on exit; see NOTE [ BatchNorm under recomputation ]."""

    def __init__(self, norms: list[nn.Module]):
        bufs = [buf for m in norms if m.training and m.track_running_stats
                for buf in (m.running_mean, m.running_var, m.num_batches_tracked) if buf is not None]
        with outside_modes() if bufs else contextlib.nullcontext():  # not ops of the region: selective
            self.saved = [(buf, buf.clone()) for buf in bufs]        # checkpointing must not count them

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        if not self.saved:  # most regions hold no norm: no mode switch per replay
            return
        with torch.no_grad(), outside_modes():
            for buf, value in self.saved:
                buf.copy_(value)


def outside_modes():
    """Run without the dispatch modes in force (a selective region's caching modes)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


__all__ = ["outside_modes", "running_stats_kept"]
