"""The roofline that times a step on fake tensors (NOTE [ Roofline ]), and its calibration on a real GPU.

Example::

    with Roofline(get_device("h100"), load_calibration(get_device("h100"))) as roofline:
        ...   # run ops on fake tensors; roofline.ms is the modelled time so far
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from planner.model import schema
from planner.profiling.devices import Calibration, DeviceSpec, get_device
from planner.errors import BadInput
from planner.profiling.tracker import iter_tensors


# NOTE [ Roofline ]
# An op takes max(compute time, memory time): it is bound by whichever unit it saturates.
#   compute = FLOPs / (peak FLOP/s of the op's dtype * MATMUL_EFFICIENCY)
#   memory  = bytes moved / (memory bandwidth * BANDWIDTH_EFFICIENCY)
# FLOPs are torch.utils.flop_counter's (the FlopCounterMode registry: matmuls, convolutions,
# attention; causal attention counted in full, as it does), forward and backward. Bytes moved
# are the bytes of the op's tensor inputs and outputs (each tensor's elements, capped by its
# storage: an expanded tensor is read once); views and allocations without a write move
# nothing. The dtype column is that of the op's first floating-point input (bf16/fp16;
# fp32 uses tf32 when torch.backends.cuda.matmul.allow_tf32 is set, as in PyTorch); a column
# the device lacks (bf16 on a T4) falls back to fp32. Kernel launch overhead (a few us per
# op) is not modelled: small models come out faster than they run.
# How sure: the two efficiencies come from the device's calibration file
# (``planner.profiling.devices.load_calibration``: this machine's ``user_calibration_dir()``, else the
# shipped profiles/devices/calibration/<name>.json, fitted on a
# real step of that GPU by benchmarks/gpu_check.py). Without one they are the assumptions
# below, and the profile, the plan and the CLI say "uncalibrated" (``Profile.time_calibration``
# is None).

MATMUL_EFFICIENCY = 0.6
"""Assumption: share of the datasheet's dense peak FLOP/s that large bf16 matmuls reach in
training (cuBLAS on H100 reaches 60-75% on big GEMMs, less on the odd shapes of attention
projections and small batches). One factor for every op with FLOPs."""

BANDWIDTH_EFFICIENCY = 0.8
"""Assumption: share of the datasheet's memory bandwidth that elementwise and reduction
kernels reach (STREAM-like copies reach 85-90% on HBM; norms, softmax and optimizer updates
somewhat less)."""

_NO_TRAFFIC_PREFIXES = ("empty", "new_empty", "sym_")
"""Ops that allocate without writing, or read only metadata: no bytes moved."""


def _cpu_flash_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


_EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops,
}
"""Attention kernels the flop counter does not know (the CPU's flash attention), same formula."""


class Roofline(TorchDispatchMode):
    """Model each aten op's time on ``spec`` (NOTE [ Roofline ]) and keep running totals.

    ``ms`` and ``flops`` only grow; differences between two readings are what ran in between.
    """

    def __init__(self, spec: DeviceSpec, calibration: Calibration | None = None):
        super().__init__()
        self.spec = spec
        self.ms = 0.0
        self.flops = 0.0
        self.matmul_efficiency = calibration.matmul_efficiency if calibration else MATMUL_EFFICIENCY
        self.bandwidth_efficiency = calibration.bandwidth_efficiency if calibration else BANDWIDTH_EFFICIENCY
        self._bytes_per_ms = spec.memory_bandwidth_bytes_per_s * self.bandwidth_efficiency / 1e3
        self._tf32 = _tf32_enabled()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.add(func, args, kwargs, out)
        return out

    def add(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Account for one op (called by the mode; public so a test can feed it ops)."""
        if _moves_nothing(func, args, out):
            return
        flops = self._op_flops(func, args, kwargs, out)
        moved = sum(_moved_bytes(t) for t in iter_tensors(args, kwargs, out))
        ms = moved / self._bytes_per_ms
        if flops:
            rate = self._flops_per_s(_op_dtype(args)) * self.matmul_efficiency
            ms = max(ms, flops / rate * 1e3)
            self.flops += flops
        self.ms += ms

    @staticmethod
    def _op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
        packet = func._overloadpacket
        count = flop_registry.get(packet) or _EXTRA_FLOPS.get(packet)
        return float(count(*args, **kwargs, out_val=out)) if count is not None else 0.0

    def _flops_per_s(self, dtype: torch.dtype | None) -> float:
        peak = self.spec.peak_flops
        column = {torch.bfloat16: peak.bf16, torch.float16: peak.fp16}.get(dtype) if dtype else None
        if dtype == torch.float32 and self._tf32:
            column = peak.tf32
        return column or peak.fp32


def op_work(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[float, int]:
    """(FLOPs, bytes moved) of one op, as the roofline counts them (NOTE [ Op work ] in
    solvers/op_work.py prices measured op times by them)."""
    if _moves_nothing(func, args, out):
        return 0.0, 0
    try:
        flops = Roofline._op_flops(func, args, kwargs or {}, out)
    except Exception:  # noqa: BLE001 - a formula that does not take these arguments: no FLOPs known
        flops = 0.0
    return flops, sum(_moved_bytes(t) for t in iter_tensors(args, kwargs or {}, out))


def _moves_nothing(func: Any, args: tuple, out: Any) -> bool:
    """Views (``_unsafe_view`` too: its output shares the input's storage), metadata queries
    (``prim.device``), and allocations that write nothing."""
    if func.is_view or func.namespace == "prim" or func.__name__.startswith(_NO_TRAFFIC_PREFIXES):
        return True
    if func._schema.is_mutable:  # in-place and out= ops return their input, and write it
        return False
    outs = list(iter_tensors(out))
    if not outs:
        return True
    inputs = {_storage_key(t) for t in iter_tensors(args)}
    return all(_storage_key(t) in inputs for t in outs)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _moved_bytes(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return n


def _op_dtype(args: tuple) -> torch.dtype | None:
    for t in iter_tensors(args):
        if t.is_floating_point():
            return t.dtype
    return None


def _tf32_enabled() -> bool:
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except (AttributeError, RuntimeError):
        return False


FIT_MIN_UNIT_MS = 2.0
"""A candidate unit enters the calibration fit when the roofline models its forward and backward at this
many ms or more. On an H200 (round 21) examples/gpt2.py's blocks were modelled at 0.13 ms and measured at
5.4: their time was kernel launches, hooks and Python, which the roofline does not model (NOTE [ Roofline ]),
and a fit on them set the efficiencies to 0.0137 and 0.0183, which would time a large model 44 times too slow."""


def fit_calibration(pairs: list[tuple[schema.Profile, schema.Profile]], *, measured_on: str,
                    models: list[str], min_unit_ms: float = FIT_MIN_UNIT_MS) -> Calibration:
    """Efficiencies that make the roofline's time of the candidate units equal the measured one.

    ``pairs``: (profile measured on the GPU, ``profile_meta(..., calibrated=False)`` of the same
    model for its spec: the assumed efficiencies are what the factor multiplies).
    One factor is fitted: every op's modelled time scales as 1 / efficiency (the roofline is
    homogeneous in both), so both efficiencies are multiplied by modelled / measured, summed
    over the forward and backward ms of every candidate unit of every model; their ratio stays
    as assumed (a single ratio cannot tell compute-bound from memory-bound error apart).
    Only units the roofline models at ``min_unit_ms`` or more count (``FIT_MIN_UNIT_MS``); ``BadInput``
    when none does.
    """
    from planner.model.graph import build_graph

    modelled = measured = longest = 0.0
    target = None
    for real, fake in pairs:
        if fake.time_calibration is not None:
            raise BadInput("fit the calibration on uncalibrated meta profiles: profile_meta(..., calibrated=False)")
        target = fake.target
        for node in build_graph(real).nodes:
            try:
                u, v = real.unit(node), fake.unit(node)
            except KeyError:
                continue
            longest = max(longest, v.forward_ms + v.backward_ms)
            if v.forward_ms + v.backward_ms >= min_unit_ms:
                measured += u.forward_ms + u.backward_ms
                modelled += v.forward_ms + v.backward_ms
    if target is not None and longest < min_unit_ms:
        raise BadInput(f"no candidate unit is modelled at {min_unit_ms} ms or more (the longest: {longest:.3f} ms): "
                       f"units that small are timed by kernel launches and Python, not by the roofline's FLOPs and "
                       f"bytes; calibrate on a model whose layers take milliseconds (a larger batch, width or "
                       f"sequence)")
    if target is None or measured <= 0 or modelled <= 0:
        raise BadInput("calibration needs at least one measured and modelled profile with timed candidate units")
    ratio = modelled / measured
    return Calibration(
        device=get_device(target).name, measured_on=measured_on, torch_version=torch.__version__,
        created_at=schema.now_iso(), matmul_efficiency=min(1.0, MATMUL_EFFICIENCY * ratio),
        bandwidth_efficiency=min(1.0, BANDWIDTH_EFFICIENCY * ratio),
        method=(f"one factor: modelled / measured forward+backward ms over the candidate units of "
                f"{', '.join(models)} ({len(pairs)} profile pairs); efficiencies capped at 1"),
        modelled_over_measured_before=ratio)


__all__ = ["op_work", "BANDWIDTH_EFFICIENCY", "fit_calibration", "FIT_MIN_UNIT_MS", "MATMUL_EFFICIENCY", "Roofline"]
