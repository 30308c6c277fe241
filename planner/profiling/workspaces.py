"""cuBLAS workspaces: device memory a real CUDA step holds that no tensor accounts for.

Fake tensors (``planner.profiling.meta``) see every tensor a step allocates but not the workspaces
cuBLAS takes from the caching allocator; this module counts them (NOTE [ cuBLAS workspaces ]).

Example::

    blas = BlasUse()                             # planner/profiling/meta.py notes every aten call
    blas.note(torch.ops.aten.mm.default, (a, b))
    blas.workspace_bytes("9.0")                  # 33554432: one Hopper-sized workspace, the forward's thread
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch

# NOTE [ cuBLAS workspaces ]
# Seen first on an H200 (benchmarks/gpu_check.py, round 21): fake-tensor peaks of examples/gpt2.py
# and examples/llama.py were 26.5% and 33.3% under the measured ones, 64 to 67 MiB each, and a
# tiny model of 0.15 MB of parameters peaked at 69,117,440 bytes. PyTorch gives every cuBLAS
# handle, per stream, a workspace from the caching allocator on its first use
# (``setWorkspaceForHandle`` in ATen's CublasHandlePool.cpp) and keeps it for the process:
#   Rule 1. Size: ``CUBLAS_WORKSPACE_CONFIG`` (":SIZE_KiB:COUNT" pairs, summed SIZE x COUNT KiB)
#           when set; else 32 MiB on compute capability 9.0 (Hopper), 4096 KiB x 2 + 16 KiB x 8
#           (8,519,680 bytes) on the others.
#   Rule 2. Handles are per thread. A training step's matmuls run on two: the caller's (forward,
#           loss, optimizer) and the autograd engine's thread for the device (every backward on
#           CUDA, recomputation under checkpointing included). So two workspaces: one where the
#           forward runs a cuBLAS op, one where the backward does.
#   Rule 3. The cuBLASLt path (``addmm`` with a 1-D bias, as ``nn.Linear`` with a bias and Hugging
#           Face's ``Conv1D`` call it; ``_addmm_activation``, ``_scaled_mm``) takes its own workspace
#           per thread: ``CUBLASLT_WORKSPACE_SIZE`` KiB, default 1024, at most the cuBLAS size.
# The tiny model (nn.Linear with biases) is Rules 1-3 exactly: 2 x 32 MiB + 1 MiB and its own
# 0.96 MB. They stay from the warm-up on, so in a measured step they are in every event's live
# bytes, as the CUDA allocator reports them (planner/profiling/as_run.py): ``profile_meta`` adds
# them the same way, so the temporaries calibrated against the events (NOTE [ Peak-memory model ],
# Rule 6) stay as they were, and records them as ``StepRecord.workspace_bytes``, which the cost
# model holds with the batch through the whole step (``solvers.rank_memory``): the optimizer
# step's peak, which no event calibrates (its temporaries are relative to the end of backward),
# has them too. A real CUDA profile measures them: the allocator's bytes at the memory step's
# start beyond the tracked static bytes (``planner.profiling.as_run``, ``untracked_bytes``), which
# also takes in whatever else the process holds on the device then. Not yet run on a GPU (the
# H200 run predates it: there the optimizer-step peak lacked them). The CPU has none.

HOPPER_WORKSPACE_BYTES = 32 * 1024 * 1024
OTHER_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
LT_WORKSPACE_KIB = 1024

_aten = torch.ops.aten
CUBLAS_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                        _aten.addbmm.default, _aten.mv.default, _aten.addmv.default, _aten.dot.default,
                        _aten._addmm_activation.default, _aten._scaled_mm.default})
"""aten ops that run on a cuBLAS handle (matmul, linear and einsum reach these)."""


def cublas_workspace_bytes(compute_capability: str | None) -> int:
    """Rule 1 of NOTE [ cuBLAS workspaces ]: one handle's workspace on a device of ``compute_capability``."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return HOPPER_WORKSPACE_BYTES if compute_capability == "9.0" else OTHER_WORKSPACE_BYTES


def cublaslt_workspace_bytes(compute_capability: str | None) -> int:
    """Rule 3: one thread's cuBLASLt workspace."""
    try:
        kib = int(os.environ.get("CUBLASLT_WORKSPACE_SIZE", LT_WORKSPACE_KIB))
    except ValueError:
        kib = LT_WORKSPACE_KIB
    return min(kib * 1024, cublas_workspace_bytes(compute_capability))


@dataclass
class BlasUse:
    """Which threads of a step ran cuBLAS and cuBLASLt (Rule 2): noted per aten call under fake tensors."""

    forward: bool = False
    backward: bool = False
    lt_forward: bool = False
    lt_backward: bool = False

    def note(self, func: Any, args: tuple) -> None:
        if func not in CUBLAS_OPS:
            return
        in_backward = torch._C._current_graph_task_id() != -1
        bias = len(args) > 0 and isinstance(args[0], torch.Tensor) and args[0].dim() == 1
        lt = (func is _aten.addmm.default and bias) or func in (_aten._addmm_activation.default,
                                                                _aten._scaled_mm.default)
        if in_backward:
            self.backward, self.lt_backward = True, self.lt_backward or lt
        else:
            self.forward, self.lt_forward = True, self.lt_forward or lt

    def workspace_bytes(self, compute_capability: str | None) -> int:
        """The workspaces the step's threads hold (Rules 1-3)."""
        blas, lt = cublas_workspace_bytes(compute_capability), cublaslt_workspace_bytes(compute_capability)
        return blas * (self.forward + self.backward) + lt * (self.lt_forward + self.lt_backward)


__all__ = ["BlasUse", "CUBLAS_OPS", "cublas_workspace_bytes", "cublaslt_workspace_bytes"]
