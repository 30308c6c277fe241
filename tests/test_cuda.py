"""Paths only a CUDA device takes. Each test skips without one (CI has none); benchmarks/gpu_session.sh runs
them on a lent GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.profiling import profile
from planner.profiling.memsafe import profile_within
from planner.profiling.model_file import load_model_file
from planner.profiling.workspaces import cublaslt_workspace_bytes
from tests.model_files import TINY_SEQ_MODEL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tiny() -> dict:
    ns: dict = {}
    exec(TINY_SEQ_MODEL, ns)  # noqa: S102 (the shared test model file)
    return ns


def test_a_model_profiled_on_cuda_can_be_profiled_again():
    """A profile leaves the model on its device; a second profile of it with CPU inputs said "example_inputs()
    returns a tensor on cpu but the model is on cuda:0" (first seen on an H200: benchmarks/gpu_check.py)."""
    m = _tiny()
    model = m["build_model"]()
    first = profile(model, m["example_inputs"](), device="cuda", steps=1)
    assert next(model.parameters()).device.type == "cuda"
    second = profile(model, m["example_inputs"](), device="cuda", steps=1)
    # On an H200 the second peak was 1 MiB (1,048,576 bytes) higher: the first profile's checkpointed validation
    # step recomputed an addmm with a bias on autograd's thread, whose cuBLASLt workspace stays (NOTE [ cuBLAS
    # workspaces ], Rule 3)
    assert 0 <= second.step.measured_peak_bytes - first.step.measured_peak_bytes <= cublaslt_workspace_bytes("9.0")


@pytest.mark.parametrize("how", ["predicted", "out-of-memory"])
def test_the_memory_safe_profile_retries_under_checkpointing_on_cuda(how):
    """NOTE [ Memory-safe profile ] on CUDA: the unplanned step does not fit a cap of 70% of its peak, so the
    profile is measured with modules checkpointed. The retry found the model moved to CUDA by the failed step and
    refused it (the same error as above)."""
    mf = load_model_file(Path(__file__).resolve().parents[1] / "examples" / "gpt2.py")  # MBs, not a 2 MB segment's KBs
    full = profile(mf.build_model(), mf.example_inputs(), device="cuda", steps=1)
    cap = int(0.7 * full.step.measured_peak_bytes)
    dev = torch.device("cuda")
    if how == "predicted":
        safe = profile_within(mf.build_model(), mf.example_inputs(), device="cuda", steps=1, device_memory_bytes=cap)
    else:
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.set_per_process_memory_fraction((base + cap) / torch.cuda.get_device_properties(dev).total_memory)
        try:
            safe = profile_within(mf.build_model(), mf.example_inputs(), device="cuda", steps=1)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
    assert safe.measured_with_checkpoints, safe.notes


def test_a_cuda_profile_holds_what_no_tensor_accounts_for():
    """NOTE [ cuBLAS workspaces ]: the allocator's bytes at the step's start beyond the tracked ones (two cuBLAS
    workspaces, the forward's thread's and autograd's, from the warm-up on) are static memory of the step, so the
    cost model's unplanned peak is the measured one wherever the step peaks, the optimizer step too."""
    from planner.act.api import graph_for
    from planner.profiling.workspaces import cublas_workspace_bytes
    from solvers.cost_model import simulate

    m = _tiny()
    prof = profile(m["build_model"](), m["example_inputs"](), device="cuda", steps=1)
    capability = "{}.{}".format(*torch.cuda.get_device_capability())
    assert prof.step.workspace_bytes >= 2 * cublas_workspace_bytes(capability)
    assert simulate(graph_for(prof), []).peak_bytes == pytest.approx(prof.step.measured_peak_bytes, rel=0.02)
