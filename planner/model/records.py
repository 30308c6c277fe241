"""The records a ``Profile`` holds: what the model is (``Fingerprint``), module calls (``UnitRecord``), tensors, saves, op calls,
parameters, the memory timeline and the step's totals. None of this imports torch.

Example::

    prof.unit("blocks.0").forward_ms, prof.step.measured_peak_bytes
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from planner.model.fields import Bytes, Count, FileModel, Ms, NonNegFloat, Seq, bad_field

ROOT_ID = "<root>"
"""Unit id of the model's root module call."""
LOSS_ID = "<loss>"
"""Unit id of the pseudo-unit that stands for ``loss_fn`` (code run outside the model)."""


class TensorSig(FileModel):
    name: str = Field(description="Parameter FQN, or input path such as 'input_ids' or '0'.")
    shape: list[Count]
    dtype: str


class Fingerprint(FileModel):
    """What a plan is valid for: module names, parameter shapes/dtypes and input shapes."""

    model_class: str
    modules: list[str] = Field(description="FQNs of all submodules, in named_modules() order.")
    params: list[TensorSig]
    inputs: list[TensorSig]
    built_modules: list[str] | None = Field(None, description=(
        "FQNs of the submodules as the model was built, when its first training step changed them (NOTE "
        "[ Modules made by the first step ]); None: the same as ``modules``. Written only when set."))
    flags: dict[str, bool | int | float | str] | None = Field(None, description=(
        "The keyword inputs that are not tensors, e.g. ``fused_lm_head=True`` (NOTE [ The Trainer's loss ], Rule 4); "
        "None: none. Not compared with a model's; written only when set."))

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)  # a fingerprint without built modules or flags is written (and digested) as before
        for name in ("built_modules", "flags"):
            if data.get(name, 0) is None:
                del data[name]
        return data

    def digest(self) -> str:
        """Stable sha256 of the fingerprint (first 16 hex digits)."""
        text = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: "Fingerprint", mine: str = "plan", theirs: str = "model") -> list[str]:
        """Human-readable list of what differs between ``self`` (named ``mine``: the plan, or a profile) and
        ``other`` (``theirs``: the model); none when ``other`` matches the model either as built or after its
        first step (``built_modules``)."""
        if self.built_modules is not None:
            built = self.model_copy(update={"modules": self.built_modules, "built_modules": None})
            if not built.differences(other, mine, theirs):
                return []
        out: list[str] = []
        if self.model_class != other.model_class:
            out.append(f"model class: {mine} has {self.model_class}, {theirs} is {other.model_class}")
        ours, others = set(self.modules), set(other.modules)
        for name in sorted(ours - others)[:10]:
            out.append(f"module {name!r} is in the {mine} but not in the {theirs}")
        for name in sorted(others - ours)[:10]:
            out.append(f"module {name!r} is in the {theirs} but not in the {mine}")
        pa = {p.name: p for p in self.params}
        pb = {p.name: p for p in other.params}
        for name in sorted(set(pa) & set(pb)):
            if (pa[name].shape, pa[name].dtype) != (pb[name].shape, pb[name].dtype):
                out.append(
                    f"parameter {name}: {mine} has {pa[name].shape} {pa[name].dtype}, "
                    f"{theirs} has {pb[name].shape} {pb[name].dtype}"
                )
        for name in sorted(set(pa) ^ set(pb))[:10]:
            where = mine if name in pa else theirs
            out.append(f"parameter {name!r} only in the {where}")
        ia = {i.name: i for i in self.inputs}
        ib = {i.name: i for i in other.inputs}
        for name in sorted(set(ia) | set(ib)):
            a, b = ia.get(name), ib.get(name)
            if a is None or b is None or (a.shape, a.dtype) != (b.shape, b.dtype):
                fa = f"{a.shape} {a.dtype}" if a else "absent"
                fb = f"{b.shape} {b.dtype}" if b else "absent"
                out.append(f"input {name}: {mine} has {fa}, {theirs} has {fb}")
        return out


class UnitRecord(FileModel):
    """One module call (a candidate for checkpointing), in forward execution order."""

    id: str = Field(description="FQN, with '#k' appended for the k-th (k>=1) call of the same module; "
                                "'<root>' for the model itself, '<loss>' for loss_fn.")
    fqn: str = Field(description="Module FQN as in named_modules(); '' for the root.")
    call_index: Count = Field(0, description="0 for the first call of this module in the step, 1 for the next...")
    module_type: str
    parent: str | None = Field(description="Id of the innermost enclosing unit; None for the root and <loss>.")
    depth: Count = Field(description="0 for the root, 1 for its children, ...")
    fwd_start_seq: Seq
    fwd_end_seq: Seq
    bwd_start_seq: Seq | None = Field(None, description="Seq when gradients reached the unit's outputs.")
    bwd_end_seq: Seq | None = Field(None, description="Seq when gradients w.r.t. the unit's inputs were ready.")
    forward_ms: Ms = Field(0.0, description="Forward time, inclusive of submodules: the median over the "
                                               "measured steps, pooled over the unit's cost group.")
    backward_ms: Ms = Field(0.0, description="Backward time, inclusive (median, pooled like forward_ms).")
    cost_group: str = Field("", description="Signature shared by units with the same module type, parameter, "
                                            "input and output shapes and op sequence; they get one price from "
                                            "their pooled samples (NOTE [ Unit costs ] in planner/profiling/timing.py).")
    timing_samples: Count = Field(0, description="Samples behind forward_ms/backward_ms (steps x group members).")
    flops: NonNegFloat = Field(0.0, description="Forward FLOPs, inclusive (when counted).")
    forward_spread_ms: Ms = Field(0.0, description="Interquartile range of the samples behind forward_ms (NOTE "
                                                   "[ Unit costs ], Rule 4); 0: one sample, or not measured.")
    backward_spread_ms: Ms = Field(0.0, description="Interquartile range of the samples behind backward_ms.")
    thread_scale: NonNegFloat | None = Field(None, description="The thread factor of its cost group's forward, "
                                             "which its forward figures were scaled by instead of the profile's "
                                             "(NOTE [ Thread factor per cost group ]); None: the profile's.")
    input_ids: list[int] = Field(default_factory=list,
                                 description="Tensors (ids into Profile.tensors) passed in as inputs and created "
                                             "during the step. Pre-existing tensors (batch, parameters) are static.")
    output_ids: list[int] = Field(default_factory=list, description="Tensors returned, created during the step.")
    grad_output_ids: list[int] | None = Field(None, description=(
        "The outputs backward gives a gradient from code after the call (NOTE [ Outputs without a gradient ] "
        "in planner/profiling/recording.py); None: not recorded (older profiles), read as all of output_ids."))
    input_bytes: Bytes = Field(0, description="Bytes of all tensor inputs (unique storages), pre-existing included.")
    output_bytes: Bytes = Field(0, description="Bytes of all tensor outputs (unique storages).")
    param_bytes: Bytes = Field(0, description="Bytes of the parameters of this module and its submodules.")
    last_pack_seq: Seq | None = Field(None, description=(
        "Seq of the call's last pack in the forward while it was the innermost unit, of any tensor (a parameter, "
        "one saved before): where a replay may stop (NOTE [ The replay stops at the last save ], Rule 3); None: "
        "it packed nothing itself, or not recorded (older profiles)."))
    replay_rise_bytes: Bytes | None = Field(None, description=(
        "The most its forward had alive above what was alive when it started, up to its last pack or a nested "
        "call's: what its replay allocates (NOTE [ What a replay allocates ] in solvers/replay.py); None: it "
        "packed nothing, or not recorded (older profiles, compiled steps)."))
    bwd_before_replay_bytes: Bytes | None = Field(None, description=(
        "What its backward had allocated above what was alive when it started, when it first unpacked a save: "
        "alive beside its replay (NOTE [ What a replay allocates ], Rule 4); None: not recorded."))


class TensorRecord(FileModel):
    """One storage created during the step that matters to the memory model."""

    id: Count
    nbytes: Bytes
    created_seq: Seq
    producer: str | None = Field(None, description="Unit id innermost when it was created.")
    autocast_cached: bool = Field(False, description="A parameter's cast made by autocast in the forward: the "
                                                     "autocast cache keeps it alive until the forward ends.")
    ctx_held: bool = Field(False, description=(
        "Kept on a custom autograd.Function's ctx attribute: held by its node like a save, checkpointed or "
        "not (NOTE [ Tensors on ctx ])."))
    released_seq: Seq | None = Field(None, description=(
        "When the step's code dropped the last tensor a unit returned on this storage (it lives on while "
        "autograd holds it; NOTE [ Outputs the caller drops ]); None: no unit returned it, or it was kept "
        "past the forward."))


class SaveRecord(FileModel):
    """A tensor saved for backward (autograd pack hook), attributed to the innermost unit."""

    tensor_id: Count
    seq: Seq
    unit: str
    released_seq: Seq | None = Field(None, description=(
        "When autograd let go of the save in the forward: a branch no loss reads, freed with the output the "
        "caller dropped (NOTE [ Outputs the caller drops ], Rule 4); None: held for backward."))


class OpRecord(FileModel):
    """One aten op run inside a unit's forward, as a dispatch mode sees it (and as
    ``torch.utils.checkpoint``'s selective checkpointing counts it: its ignored ops, such as
    ``aten.detach``, are left out). In forward order; see NOTE [ Op records ] in the profiler."""

    seq: Seq
    unit: str = Field(description="Innermost unit running the op.")
    name: str = Field(description="Op overload, e.g. 'aten.mm.default'.")
    output_ids: list[int] = Field(default_factory=list,
                                  description="Tensors (ids into Profile.tensors) whose storage the op allocated.")
    output_bytes: Bytes = Field(0, description="Bytes of the storages the op allocated.")
    forward_ms: Ms = Field(0.0, description="Time of the op (measured on real devices, roofline on meta).")
    flops: NonNegFloat = Field(0.0, description="FLOPs of the op, where torch's flop counter knows it.")
    moved_bytes: Bytes = Field(0, description="Bytes of its tensor inputs and outputs, as the roofline counts them "
                                              "(NOTE [ Op work ] in solvers/op_work.py); 0 in older profiles.")
    random: bool = Field(False, description="Draws random numbers (dropout): tagged nondeterministic_seeded.")
    inplace: bool = Field(False, description="Writes one of its inputs (mutable schema: add_, copy_, out=).")
    view: bool = Field(False, description="Returns a view of an input (no new storage).")
    mutated: bool = Field(False, description="A storage it allocated is written in place later in the forward: "
                                             "it can be kept only together with its writers.")
    writes: Seq | None = Field(None, description="In-place ops: seq of the op that allocated what it writes.")
    read_between_writes: bool = Field(False, description="Mutated outputs: another op read it before a write, "
                                                         "so it cannot be kept even with its writers.")
    data_dependent: bool = Field(False, description="Its output shape depends on tensor values (nonzero: MoE "
                                                    "routing); its unit gets no selective policies.")


class ParamRecord(FileModel):
    name: str
    nbytes: Bytes
    grad_seq: Seq = Field(description="Seq of the last forward use: its gradient appears once backward passes it.")


class MemoryEvent(FileModel):
    """One point of the live-memory timeline recorded during the memory-measuring step."""

    seq: Seq
    kind: Literal["step_start", "fwd_start", "fwd_end", "forward_end", "backward_start",
                  "bwd_start", "bwd_end", "backward_end", "optimizer_end"]
    unit: str | None = None
    live_bytes: Bytes = Field(description="Bytes live right at this event (absolute, static memory included).")
    peak_bytes: Bytes = Field(description="Highest live bytes since the previous event, this one included.")


class StepRecord(FileModel):
    params_bytes: Bytes
    buffers_bytes: Bytes = 0
    batch_bytes: Bytes = Field(0, description="Bytes of the input batch (alive throughout the step).")
    grads_bytes: Bytes
    optimizer_bytes: Bytes = Field(description="Optimizer state (e.g. AdamW exp_avg + exp_avg_sq) in steady state.")
    optimizer_step_transient_bytes: Bytes = Field(0, description="Temporaries of optimizer.step(), measured.")
    workspace_bytes: Bytes = Field(0, description="Device memory held through the whole step that no tensor of it "
                                                  "accounts for: cuBLAS's workspaces, counted by a fake-tensor profile "
                                                  "with CUDA's rules; on CUDA the allocator's bytes at the step's start "
                                                  "beyond the tracked ones (NOTE [ cuBLAS workspaces ]); 0 on the CPU.")
    forward_ms: Ms = Field(description="Forward and loss, median over the measured steps.")
    backward_ms: Ms = Field(description="Backward, median over the measured steps.")
    optimizer_ms: Ms = Field(0.0, description="optimizer.step(), median over the measured steps.")
    forward_spread_ms: Ms = Field(0.0, description="Interquartile range of forward_ms's steps (NOTE [ Unit costs ], "
                                                   "Rule 4); 0 when not measured.")
    backward_spread_ms: Ms = Field(0.0, description="Interquartile range of backward_ms's steps.")
    step_ms: Ms = Field(description="forward_ms + backward_ms + optimizer_ms.")
    forward_end_seq: Seq
    backward_start_seq: Seq
    measured_peak_bytes: Bytes | None = Field(None, description="Peak of the step as the device reports it.")
    peak_source: str = Field("none", description="'cuda-allocator', 'cpu-profiler', 'tracker' or 'none'.")
    warmup_steps: Count = 0
    measured_steps: Count = 0
    timeline_source: Literal["as-run", "tracked"] = Field(
        "tracked", description="Where the timeline's live and peak bytes come from: 'as-run', a step run as the "
                               "user runs it (module and gradient hooks only, the device allocator's figures); "
                               "'tracked', the memory step under the live-bytes tracker's dispatch mode, which "
                               "some models run differently (NOTE [ Step as run ] in planner/profiling/as_run.py).")
    tracked_peak_bytes: Bytes | None = Field(None, description="Peak of the memory step under the tracker, when the "
                                                             "timeline is 'as-run'; None otherwise.")


class StepStructure(FileModel):
    """Which units ran in which profiled step (NOTE [ Worst step ] in planner/profiling/assemble.py)."""

    units_seen: list[str] = Field(default_factory=list, description="Every unit id that ran in some profiled step, "
                                                                    "in forward order.")
    skipped: dict[str, list[str]] = Field(default_factory=dict,
                                          description="Profiled step ('timing step 1', 'memory step', 'as-run step') "
                                                      "-> the units seen in other steps that it did not run; steps "
                                                      "that ran every unit are left out.")


class OffloadedUnit(FileModel):
    """A module whose saved tensors go to host memory after its forward and come back for its backward
    (NOTE [ Peak-memory model ], Rule 10, in solvers/cost_model.py)."""

    fqn: str = Field(description="Module FQN; every call of it is offloaded.")
    unit: str = Field(description="Unit id the solver chose (FQN, '#k' for the k-th call).")
    host_bytes: Bytes = Field(description="Bytes of the distinct storages it saves, copied to host memory.")
    d2h_ms: Ms = Field(description="Modelled device-to-host copy time of one call: host_bytes / host link.")
    h2d_ms: Ms = Field(description="Modelled host-to-device copy time of one call.")
    hidden_ms: Ms = Field(0.0, description="Compute the copies overlap: the next leaf's forward and backward "
                                           "(0 without a copy engine, on the CPU).")
    exposed_ms: Ms = Field(description="The part of both copies not hidden behind compute, charged to the "
                                       "step (per step: all micro-batches).")
    sync_fqn: str | None = Field(None, description="The module after this one whose forward end waits for its "
                                                   "device-to-host copy and whose backward starts the prefetch "
                                                   "back; None: the end of forward (CUDA only).")



def check_records(p: Any) -> None:
    """Rule 2 of NOTE [ Numbers in files ] for a profile ``p``: its records agree with each other. Ids are
    unique, records point at tensors and units that exist, units end after they start and nest in a tree
    (every parent chain reaches a root), and every unit is a call of one of the model's modules
    (``fingerprint.modules``), as every plan made from it must name only those."""
    units = {u.id: u for u in p.units}
    if len(units) != len(p.units):
        raise bad_field("units", "two units share an id")
    tensors = {t.id for t in p.tensors}
    if len(tensors) != len(p.tensors):
        raise bad_field("tensors", "two tensors share an id")
    if len({q.name for q in p.params}) != len(p.params):
        raise bad_field("params", "two parameters share a name")
    modules = set(p.fingerprint.modules)
    for i, u in enumerate(p.units):
        if u.fwd_end_seq < u.fwd_start_seq:
            raise bad_field(f"units.{i}.fwd_end_seq", f"{u.fwd_end_seq} is before fwd_start_seq {u.fwd_start_seq}")
        if u.bwd_start_seq is not None and u.bwd_end_seq is not None and u.bwd_end_seq < u.bwd_start_seq:
            raise bad_field(f"units.{i}.bwd_end_seq", f"{u.bwd_end_seq} is before bwd_start_seq {u.bwd_start_seq}")
        if u.parent is not None and u.parent not in units:
            raise bad_field(f"units.{i}.parent", f"no unit has the id {u.parent!r}")
        if u.fqn not in ("", LOSS_ID) and u.fqn not in modules:
            raise bad_field(f"units.{i}.fqn", f"{u.fqn!r} is not a module of the model (fingerprint.modules)")
        missing = next((t for t in (*u.input_ids, *u.output_ids) if t not in tensors), None)
        if missing is not None:
            raise bad_field(f"units.{i}", f"tensor id {missing} is not in tensors")
        stray = next((t for t in u.grad_output_ids or () if t not in u.output_ids), None)
        if stray is not None:
            raise bad_field(f"units.{i}.grad_output_ids", f"tensor id {stray} is not one of output_ids")
    for i, u in enumerate(p.units):
        seen, at = {u.id}, u.parent
        while at is not None:
            if at in seen:
                raise bad_field(f"units.{i}.parent", f"{u.id!r} is its own ancestor (a cycle through {at!r}); "
                                                     f"units nest in a tree")
            seen.add(at)
            at = units[at].parent
    for i, sv in enumerate(p.saves):
        if sv.tensor_id not in tensors:
            raise bad_field(f"saves.{i}.tensor_id", f"{sv.tensor_id} is not in tensors")
        if sv.unit not in units:
            raise bad_field(f"saves.{i}.unit", f"no unit has the id {sv.unit!r}")
    for i, op in enumerate(p.ops):
        if op.unit not in units:
            raise bad_field(f"ops.{i}.unit", f"no unit has the id {op.unit!r}")
    for i, ev in enumerate(p.timeline):
        if ev.peak_bytes < ev.live_bytes:
            raise bad_field(f"timeline.{i}.peak_bytes", f"{ev.peak_bytes} is below live_bytes {ev.live_bytes}")
    st = p.step
    if st.backward_start_seq < st.forward_end_seq:
        raise bad_field("step.backward_start_seq", f"{st.backward_start_seq} is before forward_end_seq "
                                                   f"{st.forward_end_seq}")


__all__ = ["check_records", "LOSS_ID", "ROOT_ID", "OffloadedUnit", "MemoryEvent", "OpRecord", "ParamRecord", "SaveRecord",
           "StepRecord", "StepStructure", "TensorRecord", "UnitRecord"]
