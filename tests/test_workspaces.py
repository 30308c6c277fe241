"""cuBLAS's workspaces in fake-tensor profiles with CUDA's rules (NOTE [ cuBLAS workspaces ])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.profiling.meta import build_on_meta, profile_meta
from planner.profiling.workspaces import cublas_workspace_bytes, cublaslt_workspace_bytes

MIB = 1 << 20


def _build(bias: bool):
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256, bias=bias), nn.GELU(), nn.Linear(256, 8, bias=bias))
    return build


def _peak(bias: bool, target: str, **kw) -> tuple[int, list[str]]:
    prof = profile_meta(build_on_meta(_build(bias)), torch.randn(32, 64), loss_fn=lambda out: out.square().mean(),
                        target=target, calibrated=False, **kw)
    return prof.step.measured_peak_bytes, prof.notes


def test_the_size_follows_the_compute_capability_and_the_environment(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    assert cublas_workspace_bytes("9.0") == 32 * MIB and cublas_workspace_bytes("8.0") == 8_519_680
    assert cublaslt_workspace_bytes("9.0") == MIB
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the setting torch's determinism docs suggest
    assert cublas_workspace_bytes("9.0") == 128 * 1024
    assert cublaslt_workspace_bytes("9.0") == 128 * 1024  # never above the cuBLAS workspace


def test_a_fake_cuda_step_holds_both_threads_workspaces(monkeypatch):
    """Two handles (the forward's thread, autograd's), each with a Hopper-sized workspace on an H100 and an
    8,519,680-byte one on an A100: the two peaks differ by exactly twice the difference. The same model on the
    CPU's rules holds none."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    hopper, notes = _peak(False, "h100")
    ampere, _ = _peak(False, "a100-80gb")
    assert hopper - ampere == 2 * (32 * MIB - 8_519_680)
    assert any("cuBLAS workspaces of the forward's and the backward's thread" in n for n in notes), notes
    cpu, cpu_notes = _peak(False, "h100", device_type="cpu")
    assert hopper > 2 * 32 * MIB > cpu and not any("cuBLAS" in n for n in cpu_notes)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_a_bias_takes_the_cublaslt_workspace_in_the_forward(monkeypatch, bias):
    """nn.Linear with a bias runs addmm with a 1-D bias, cuBLASLt's path: one more workspace, on the forward's
    thread only (the backward's matmuls are plain mm)."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", "4096")
    _, notes = _peak(bias, "h100")
    (note,) = [n for n in notes if "cuBLAS workspaces" in n]
    assert f": {2 * 32 * MIB + (4 * MIB if bias else 0)} bytes" in note, note
