"""Profile a training step without running it: fake tensors for the bytes, a roofline for the times.

``profile(..., device="meta", target="h100")`` (``remat plan --device meta --target h100``)
lands here. The model is built on the meta device (``build_on_meta``: no memory, so a 7B
model costs nothing to build), its parameters are swapped for fake tensors, and the same
warm-up step and memory step as ``planner.profiling.profiler`` run under
``torch._subclasses.fake_tensor.FakeTensorMode``: every aten op computes output shapes,
dtypes and strides, and nothing is allocated. See docs/meta.md for what comes out.

Example::

    prof = profile_meta(build_on_meta(build_model), inputs, step=StepSpec(device="meta", target="h100"))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from planner.model import schema
from planner.profiling.devices import (DeviceSpec, calibration_path, calibration_source, get_device,
                                       load_calibration)
from planner.errors import BadInput, ProfileError
from planner.profiling.measure import Measured, make_optimizer, make_step
from planner.profiling.model_file import Inputs
from planner.profiling.assemble import assemble_profile
from planner.profiling.recording import memory_step, MemoryRecorder
from planner.profiling.units import StepTimes
from planner.profiling.workspaces import BlasUse
from planner.profiling.tracker import LiveBytesTracker
from planner.profiling.roofline import Roofline
from planner.spec import StepSpec, step_spec

Progress = Callable[[str], None]

@dataclass(frozen=True)
class Rules:
    """How the faked step behaves: the target device type's rules, on fake tensors of ``fake_device``."""

    device_type: str
    """'cuda' for GPU targets; 'cpu' to reproduce a real CPU step exactly (tests)."""
    fake_device: str
    """Device type of the fake tensors: 'cuda' only when this PyTorch can run CUDA autograd."""

    @property
    def round_to(self) -> int:
        return 512 if self.device_type == "cuda" else 1

    @property
    def emulate_cuda(self) -> bool:
        """CUDA rules on fake CPU tensors: the SDPA choice (and autocast's op lists, not emulated)."""
        return self.device_type == "cuda" and self.fake_device == "cpu"


def rules_for(device_type: str = "cuda", fake_device: str | None = None) -> Rules:
    """The rules of ``device_type`` on fake tensors of ``fake_device`` (default: CUDA ones when
    this PyTorch can run CUDA, else CPU ones; see NOTE [ Meta profiling ])."""
    if device_type not in ("cuda", "cpu"):
        raise BadInput(f"meta profiling follows 'cuda' or 'cpu' rules, got {device_type!r}")
    if fake_device is None:
        fake_device = "cuda" if device_type == "cuda" and torch.cuda.is_available() else "cpu"
    if fake_device not in ("cpu", device_type):
        raise BadInput(f"fake {fake_device} tensors cannot follow {device_type} rules; use fake cpu tensors")
    if fake_device == "cuda" and not torch.cuda.is_available():
        raise BadInput("fake CUDA tensors need a PyTorch with CUDA (autograd asks the CUDA runtime for streams)")
    return Rules(device_type=device_type, fake_device=fake_device)


# ----------------------------------------------------------------------------- entry points


def build_on_meta(build_model: Callable[[], nn.Module]) -> nn.Module:
    """``build_model()`` with the meta device as the default: parameters take no memory."""
    with torch.device("meta"):
        return build_model()


# NOTE [ Meta profiling ]
#
# Bytes. The live-bytes tracker (NOTE [ Live-bytes tracker ]) runs on the fake tensors, whose
# storages carry real ``nbytes``: saved-for-backward tensors, unit inputs and outputs, the
# timeline, gradients and the optimizer state (AdamW's ``exp_avg``/``exp_avg_sq`` created by
# the optimizer's own first ``step()`` in the warm-up, under the fake mode) are the bytes a
# real step would allocate, byte for byte, as far as the dispatcher sees them. Not seen: a
# kernel's internal scratch (flash-attention backward), allocator fragmentation and the CUDA
# context (see ``planner.profiling.devices.usable_bytes``). cuBLAS's workspaces are not seen
# either but are counted, by the threads that ran cuBLAS (NOTE [ cuBLAS workspaces ]).
#
# Whose rules. The step follows the *target's* rules: a GPU target gets 512-byte allocation
# blocks, the foreach optimizer (torch's default on CUDA) and CUDA's choice of
# scaled-dot-product-attention kernel (flash for fp16/bf16 without a mask, memory-efficient
# otherwise: they save the output and a log-sum-exp, where the CPU's math path with dropout
# saves the S x S attention matrix). The fake tensors themselves are CUDA tensors when this
# PyTorch has CUDA, else CPU tensors: autograd on fake CUDA tensors needs the CUDA runtime
# (without it, ``InputMetadata`` aborts the process, uncatchably), so on a CPU-only machine
# the rules above are applied by hand and autocast uses the CPU's op lists (the CUDA lists
# also run softmax, layer_norm and losses in fp32; see docs/meta.md).
#
# Times. One roofline per aten op (``Roofline``), summed between the same module hooks the
# profiler times real steps with; see NOTE [ Roofline ].

def profile_meta(
    model: nn.Module,
    inputs: Inputs,
    *,
    step: StepSpec | None = None,
    device_type: str = "cuda",
    fake_device: str | None = None,
    calibrated: bool = True,
    progress: Progress | None = None,
    **step_fields: Any,
) -> schema.Profile:
    """Profile one training step of ``model`` on fake tensors, with times modelled for ``target``.

    See the module docstring and NOTE [ Meta profiling ]. The model may be on the meta
    device (``build_on_meta``) or real; its parameters and buffers are swapped for fake
    tensors during the call and put back afterwards, train/eval flags restored.

    Args:
        model: the model, ideally built with ``build_on_meta``.
        inputs: as for ``planner.profiling.profile``; real tensors (turned into fake ones).
        step: the step (``planner.spec.StepSpec``): its ``target``, a device spec or its name/alias
            (``planner.profiling.devices``), gives the peak FLOP/s and bandwidth of the roofline;
            its loss, optimizer and recipe the step. ``device``, ``steps`` and the cap are not read.
        device_type: whose rules the step follows (NOTE [ Meta profiling ]): 'cuda' for a
            GPU target; 'cpu' makes the faked step the same as a real CPU step (to compare).
        fake_device: the fake tensors' device type; default 'cuda' where this PyTorch has
            CUDA, else 'cpu' (with ``device_type``'s rules applied by hand). 'cpu' on a CUDA
            machine measures what CPU-only machines get (benchmarks/gpu_check.py).
        calibrated: use the target's calibration file when it has one (NOTE [ Roofline ]);
            False: the assumed efficiencies (what benchmarks/gpu_check.py fits against).
        progress: called with a short message as each stage starts.
        **step_fields: ``StepSpec`` fields replacing ``step``'s (``target="h100"``, ``loss_fn=...``).

    Returns:
        A ``schema.Profile`` with ``device='meta'``, ``target`` the spec's name,
        ``step.peak_source='tracker'`` and each unit's forward ``flops``.

    Raises:
        BadInput: an unknown target.
        ProfileError: the model reads tensor values (``.item()``, ``nonzero``), which fake
            tensors do not have, or user code raised.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    step = step_spec(step, **step_fields)
    target = step.target
    if target is None:
        raise BadInput("profile_meta models times for a target device: give target=NAME (remat devices lists them)")
    spec = target if isinstance(target, DeviceSpec) else get_device(target)
    rules = rules_for(device_type, fake_device)
    recipe = step.recipe
    say = progress or (lambda _msg: None)
    dev = torch.device(rules.fake_device)
    calibration = load_calibration(spec) if calibrated else None
    roofline = Roofline(spec, calibration)
    kernels = _RealKernelOutputs(rules)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, kernels, _fake_state(model, dev), \
            _sdpa(rules), _hf_unpacked(inputs), _explaining_fake_errors():
        fake_inputs = _fake_inputs(fake, inputs, dev)
        opt = make_optimizer(step.optimizer, model, impl=recipe.optimizer_impl)
        if rules.device_type == "cuda" and opt is not None and recipe.optimizer_impl == "default":
            for group in opt.param_groups:  # torch picks foreach for CUDA tensors, but not for FakeTensors
                group["foreach"] = True
        run = make_step(model, fake_inputs, loss_fn=step.loss_fn, optimizer=opt, recipe=recipe)
        say("warm-up step (fake tensors)")
        run()
        say("memory and roofline step (fake tensors)")
        stamps: dict[int, tuple[float, float]] = {}
        with roofline:
            mem = memory_step(
                model, run, fake_inputs, opt, dev, recipe=recipe, round_to=rules.round_to,
                recorder=lambda m, tracker: _RooflineRecorder(m, tracker, roofline, stamps))
        times, flops = _times(mem.recorder, stamps)
        workspace_bytes = _with_workspaces(mem.recorder.events, kernels, spec)
        peak = max((e.peak_bytes for e in mem.recorder.events), default=0)
        measured = Measured(peak_bytes=peak, step_ms=times.forward_ms + times.backward_ms + times.optimizer_ms,
                            source="tracker")
        prof = assemble_profile(model, inputs, dev, step.replace(warmup_steps=1, steps=1), times, mem, measured)
    units = [u.model_copy(update={"flops": flops.get(u.id, 0.0)}) for u in prof.units]
    source = calibration_source(calibration_path(spec)) if calibration else None
    return prof.model_copy(update={
        "device": "meta", "device_name": spec.display_name, "target": spec.name, "units": units,
        "step": prof.step.model_copy(update={"workspace_bytes": workspace_bytes}),
        "host_link_bytes_per_s": spec.host_link_bytes_per_s, "copy_engine": spec.name != "cpu",
        "notes": [*prof.notes, *_notes(spec, rules, roofline, source), *_workspace_note(kernels.blas, workspace_bytes)],
        "time_source": "roofline",
        "time_calibration": source,
    })


def _with_workspaces(events: list[Any], kernels: "_RealKernelOutputs", spec: DeviceSpec) -> int:
    """cuBLAS's workspaces the step's threads held, added to every event's bytes: held from the warm-up on, as a
    GPU's allocator reports them (NOTE [ cuBLAS workspaces ]); 0 under the CPU's rules."""
    workspace_bytes = kernels.blas.workspace_bytes(spec.compute_capability) if kernels.cuda else 0
    for e in events:
        e.live_bytes += workspace_bytes
        e.peak_bytes += workspace_bytes
    return workspace_bytes


def _workspace_note(blas: BlasUse, workspace_bytes: int) -> list[str]:
    if not workspace_bytes:
        return []
    threads = " and ".join(t for t, ran in (("the forward's", blas.forward), ("the backward's", blas.backward)) if ran)
    return [f"cuBLAS workspaces of {threads} thread counted in every event: {workspace_bytes} bytes "
            f"(NOTE [ cuBLAS workspaces ]; CUBLAS_WORKSPACE_CONFIG sets their size)"]


def _notes(spec: DeviceSpec, rules: Rules, roofline: "Roofline", calibration: str | None) -> list[str]:
    how = f"calibrated by {calibration}" if calibration else \
        "UNCALIBRATED: assumed; benchmarks/gpu_check.py on this GPU calibrates them"
    notes = [(f"no step was run: bytes from fake tensors, times from a roofline for {spec.display_name} "
              f"(efficiency {roofline.matmul_efficiency:.3g} of peak FLOP/s, {roofline.bandwidth_efficiency:.3g} "
              f"of bandwidth, {how}; see docs/meta.md)")]
    if rules.emulate_cuda:
        notes.append("fake tensors on the CPU with CUDA's rules (512-byte blocks, foreach optimizer, "
                     "CUDA's attention kernels); autocast followed the CPU's op lists")
    return notes


# ----------------------------------------------------------------------------- fake state


@contextlib.contextmanager
def _fake_state(model: nn.Module, dev: torch.device) -> Iterator[None]:
    """Swap every parameter and buffer for an empty fake tensor on ``dev``; put them back after.

    Shared parameters (tied embeddings) stay shared: one fake parameter per original. Must run
    inside the fake mode, so ``torch.empty_strided`` makes fake tensors.
    """
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    fakes: dict[int, torch.Tensor] = {}
    modes = [(m, m.training) for m in model.modules()]

    def fake_of(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in fakes:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
            fakes[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if param else new
        return fakes[id(t)]

    try:
        for m in model.modules():
            for table, param in ((m._parameters, True), (m._buffers, False)):
                for name, t in list(table.items()):
                    if t is not None:
                        swapped.append((table, name, t))
                        table[name] = fake_of(t, param)
        model.train()
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for table, name, original in reversed(swapped):
            table[name] = original
        for m, training in modes:
            m.training = training


def _fake_inputs(fake: Any, inputs: Any, dev: torch.device) -> Any:
    """``inputs`` with every tensor a fake tensor on ``dev`` (non-tensors as they are)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(inputs, torch.Tensor):
        return (inputs if isinstance(inputs, FakeTensor) else fake.from_tensor(inputs)).to(dev)
    if isinstance(inputs, tuple):
        return tuple(_fake_inputs(fake, v, dev) for v in inputs)
    if isinstance(inputs, list):
        return [_fake_inputs(fake, v, dev) for v in inputs]
    if isinstance(inputs, dict):
        return {k: _fake_inputs(fake, v, dev) for k, v in inputs.items()}
    return inputs


@contextlib.contextmanager
def _explaining_fake_errors() -> Iterator[None]:
    """A model that reads tensor values cannot run on fake tensors: say so, and what to do."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except ProfileError as e:
        cause = e.__cause__
        if isinstance(cause, (DataDependentOutputException, DynamicOutputShapeException)):
            raise ProfileError(
                f"{e.template}\n{{device}} meta runs the step on fake tensors, which have shapes but no values; "
                f"this model reads values ({type(cause).__name__}: {cause}). Use {{device}} cpu or cuda, "
                f"or make the forward shape-only (no .item(), nonzero, boolean masks)",
                options=(*e.options, "device")) from cause
        raise


@contextlib.contextmanager
def _hf_unpacked(inputs: Any) -> Iterator[None]:
    """Hugging Face's answer for unpacked sequences, which it cannot compute on fake tensors.

    Given no attention mask, transformers' ``create_causal_mask`` asks
    ``find_packed_sequence_indices(position_ids)`` whether several sequences share a row: a
    data-dependent check it skips on fake tensors (as under ``torch.compile``), answering "maybe",
    which makes it build a 4-D mask and rules out SDPA's flash kernel, costing a B x S x S
    mask and, on CUDA, a saved attention bias per layer that the real step does not have.
    When the model makes its own position ids (no ``position_ids`` among the inputs) they are
    ``arange`` rows, and the real answer is None ("not packed"): give that.
    """
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices") or \
            (isinstance(inputs, dict) and "position_ids" in inputs):
        yield
        return
    original = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


class _RealKernelOutputs(TorchDispatchMode):
    """Outputs where PyTorch's fake kernels and the real ones disagree on memory.

    * ``native_layer_norm``'s fake kernel returns the per-row mean and rstd (saved for
      backward) in the input's dtype on the CPU. The real kernels use fp32 for an fp16/bf16
      input on CUDA, and on the CPU when the weight is fp32 (autocast's mixed case).
    * ``mse_loss`` and ``smooth_l1_loss`` with a reduction return a 0-d tensor that is a view
      of the unreduced element-wise loss (one element per input element), which stays alive
      as long as the loss does, through the whole backward; the fake kernel returns a fresh
      scalar.
    """

    def __init__(self, rules: Rules):
        super().__init__()
        self.cuda = rules.device_type == "cuda"
        self.blas = BlasUse()  # which threads ran cuBLAS (NOTE [ cuBLAS workspaces ])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.cuda:
            self.blas.note(func, args)
        aten = torch.ops.aten
        if func is aten.native_layer_norm.default and self._fp32_stats(*args):
            y, mean, rstd = out
            out = (y, *(torch.empty_strided(t.shape, t.stride(), dtype=torch.float32, device=t.device)
                        for t in (mean, rstd)))
        elif func in (aten.mse_loss.default, aten.smooth_l1_loss.default) and out.dim() == 0:
            x, target = args[0], args[1]
            unreduced = torch.empty(torch.broadcast_shapes(x.shape, target.shape), dtype=out.dtype, device=out.device)
            out = unreduced.as_strided((), (), 0)
        return out

    def _fp32_stats(self, x: torch.Tensor, _shape: Any, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, *_: Any) -> bool:
        if x.dtype not in (torch.float16, torch.bfloat16):
            return False
        return self.cuda or any(t is not None and t.dtype == torch.float32 for t in (weight, bias))


# ----------------------------------------------------------------------------- CUDA attention


class _CudaSdpa(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as CUDA's dispatcher would run it (sm80 and later).

    Flash attention for fp16/bf16 without a mask, memory-efficient attention otherwise, the
    math path (what the CPU runs) for grouped-query attention with a mask or odd head sizes.
    Under autocast, SDPA runs in the autocast dtype, as on CUDA. The aten kernels are CUDA's,
    computed by their meta functions on the fake CPU tensors.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            out = _cuda_sdpa(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def _cuda_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor | None:
    """The CUDA kernel's output, or None to let the call run as it is (math path)."""
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    head_dim = query.shape[-1]
    gqa = enable_gqa and key.shape[-3] != query.shape[-3]
    half = query.dtype in (torch.float16, torch.bfloat16)
    if query.dim() != 4 or head_dim % 8 or head_dim > 256:
        return None
    aten = torch.ops.aten
    if attn_mask is None and half:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                        scale=scale)[0]
    if gqa:
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # CUDA turns it into an additive bias
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        attn_mask = attn_mask.to(query.dtype)
    needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
    return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, needs_grad, dropout_p,
                                                        is_causal, scale=scale)[0]


def _sdpa(rules: Rules) -> contextlib.AbstractContextManager:
    return _CudaSdpa() if rules.emulate_cuda else contextlib.nullcontext()


# ----------------------------------------------------------------------------- times per unit


class _RooflineRecorder(MemoryRecorder):
    """The profiler's memory recorder, also noting the roofline's totals at every event."""

    def __init__(self, model: nn.Module, tracker: LiveBytesTracker, roofline: Roofline,
                 stamps: dict[int, tuple[float, float]]):
        self.roofline = roofline
        self.stamps = stamps
        self._last_roofline = (0.0, 0.0)
        super().__init__(model, tracker)

    def _op_cost(self) -> tuple[float, float]:
        now = (self.roofline.ms, self.roofline.flops)
        last, self._last_roofline = self._last_roofline, now
        return now[0] - last[0], now[1] - last[1]

    def _note(self, kind: str, unit: Any) -> int:
        seq = super()._note(kind, unit)
        self.stamps[seq] = (self.roofline.ms, self.roofline.flops)
        return seq


def _times(rec: Any, stamps: dict[int, tuple[float, float]]) -> tuple[Any, dict[str, float]]:
    """The profiler's ``StepTimes`` from the stamps, and each unit's forward FLOPs."""

    def span(a: int | None, b: int | None, i: int) -> float:
        if a is None or b is None:
            return 0.0
        return max(stamps[b][i] - stamps[a][i], 0.0)

    m = rec.marks
    times = StepTimes(
        forward_ms=span(m["step_start"], m["forward_end"], 0),
        backward_ms=span(m["backward_start"], m["backward_end"], 0),
        optimizer_ms=span(m["backward_end"], m["optimizer_end"], 0),
        unit_ms={u.id: (span(u.fwd_start, u.fwd_end, 0), span(u.bwd_start, u.bwd_end, 0)) for u in rec.units},
        unit_ids=[[u.id for u in rec.units]],
    )
    return times, {u.id: span(u.fwd_start, u.fwd_end, 1) for u in rec.units}


__all__ = ["build_on_meta", "profile_meta", "Progress", "Rules", "rules_for"]
