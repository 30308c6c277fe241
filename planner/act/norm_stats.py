"""A region's replay leaves its norm layers' running statistics (NOTE [ BatchNorm under recomputation ]) and
the tensors its modules hold as attributes (NOTE [ Tensors a replay stores on modules ]) as its forward left them.

Example::

    with running_stats_kept(norms), attributes_kept(modules):   # around a checkpointed region's recompute
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
# step ]), and a Hugging Face cache is turned off while training (NOTE [ Step changes ]). Tensors
# the replay assigns to module attributes are put back (NOTE [ Tensors a replay stores on modules ]).

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


# NOTE [ Tensors a replay stores on modules ]
#
# Rule 1. A forward may store a tensor it made on its module (Hugging Face RecurrentGemma's RG-LRU keeps its
# last recurrent state, ``self.recurrent_states = recurrent_states``, whether or not the cache is on). The
# replay in backward runs that line again and stores the replayed tensor, whose graph holds the replay's
# recomputed saves (checkpoint keeps them for as long as a node of that graph lives). So the region's
# recomputed tensors outlived its backward, to the next forward: the rest of the backward and the optimizer
# step ran with them, which the cost model counts as freed once the region's backward has passed.
# Rule 2. So after each replay (eager mode, also when it stops early) every tensor attribute of the region's
# modules that the replay replaced is put back to the forward's tensor: the model holds after the step what
# the unplanned model holds (the same tensor object), and the replay's graph goes with the replay.
# Rule 3. Measured (tests/test_model_classes3.py, RecurrentGemma, hidden 64, 3 layers, the first two
# recurrent): the lowest plan (its two recurrent layers) was predicted 1,100,606 and measured 1,365,150
# (-19.4%, over its budget; 264,528 bytes per recurrent layer alive to the step's end); after, exact.
# Rule 4. So too a buffer the forward replaces (``self.x_min = self.x_min * 0.95 + x_min * 0.05``, Hugging Face
# I-BERT's ``QuantAct`` range tracking in training): the replay replaced it once more, a second update per step
# that the validation step, which compares buffer versions, did not see (a new tensor starts a new version).
# Put back, the buffers are the unplanned model's bit for bit; before, the lowest plan's differed by 1.5e-3.
# A buffer written in place (``self.ema.mul_(0.9)``) is not undone: the validation step excludes its module.


class attributes_kept:
    """Put back, on exit, each tensor attribute of ``modules`` that changed (NOTE [ Tensors a replay stores on
    modules ])."""

    def __init__(self, modules: list[nn.Module]):
        self.saved = [(held, k, v) for m in modules for held in (vars(m), m._buffers) for k, v in held.items()
                      if isinstance(v, torch.Tensor)]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for held, k, v in self.saved:
            if held.get(k) is not v:
                held[k] = v


def outside_modes():
    """Run without the dispatch modes in force (a selective region's caching modes)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


__all__ = ["attributes_kept", "outside_modes", "running_stats_kept"]
