"""Data at the edges: the measured ``Profile`` and the ``Plan`` file.

All are pydantic models that serialise to JSON. Field names carry their units
(``_bytes``, ``_ms``, ``_seq``). None of this imports torch.

Sequence numbers (``*_seq``): the profiler keeps one counter for the whole training step and
bumps it at every event it records (module forward start/end, module backward start/end,
every tensor saved for backward). They order everything that happened in the step; the cost
model uses them to place tensors in time (see NOTE [ Peak-memory model ] in
``solvers/cost_model.py``).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from planner.errors import PlanFileError
from planner.files import atomic_write_text
from planner.sizes import MAX_SIZE_BYTES
from solvers.contract import Sharding, Status

PROFILE_SCHEMA_VERSION = 3
PLAN_SCHEMA_VERSION = 4
"""2 added ``recipe`` (``Recipe``); version-1 files load as the default recipe (their ``amp`` kept).
3 added op records (``Profile.ops``) and ``Plan.selective`` (op-level checkpointing); older files
load with none. 4 added ``Plan.buckets`` (one plan per input shape); a plan without buckets is
still written as version 3, byte for byte as before (``SINGLE_SHAPE_PLAN_VERSION``)."""
SINGLE_SHAPE_PLAN_VERSION = 3
"""The version a plan without buckets is written as: readers of version 3 read it unchanged."""

ROOT_ID = "<root>"
"""Unit id of the model's root module call."""
LOSS_ID = "<loss>"
"""Unit id of the pseudo-unit that stands for ``loss_fn`` (code run outside the model)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


# NOTE [ Numbers in files ]
#
# A profile or plan file may be hand-edited, truncated by hand, or written by another tool, and a
# plan drives a training job: every number is checked where it is loaded, so that an impossible
# figure (a NaN time, a negative size, an absurd world size) is one line naming its field rather
# than a plan labelled optimal with "recompute nan ms".
# Rule 1. Sizes are integers in [0, MAX_BYTES]; times, FLOPs and seconds are finite and >= 0;
#   sequence numbers, indices and counts are integers in [0, MAX_COUNT]; thread counts >= 1.
# Rule 2. Figures that must agree with their neighbours are checked together (``_check_profile``,
#   ``_check_plan``): a unit ends after it starts, records point at tensors and units that exist,
#   a plan's predicted peak is its breakdown's sum and fits its budget less the headroom.
# Rule 3. An error names the path into the file (``units.3.forward_ms``) and the value found.

MAX_BYTES = MAX_SIZE_BYTES
"""1 EiB: above any device or host memory; a larger size in a file is an error."""
MAX_WORLD_SIZE = 2**20
"""Ranks: above any data-parallel job run so far; a larger world size in a plan is an error."""

Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Ms = Annotated[float, Field(ge=0, allow_inf_nan=False)]
NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
MAX_COUNT = 2**53
"""Sequence numbers, ids and counts: a step records far fewer events; a larger one in a file is an error."""
Seq = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Threads = Annotated[int, Field(ge=1, le=4096)]


def _bad(path: str, message: str) -> PydanticCustomError:
    """A consistency error for ``_load_versioned`` to word: ``path`` into the file, then what is wrong."""
    return PydanticCustomError("remat_consistency", "{path}: {message}", {"path": path, "message": message})


# ----------------------------------------------------------------------------- fingerprint


class TensorSig(_Model):
    name: str = Field(description="Parameter FQN, or input path such as 'input_ids' or '0'.")
    shape: list[Count]
    dtype: str


class Fingerprint(_Model):
    """What a plan is valid for: module names, parameter shapes/dtypes and input shapes."""

    model_class: str
    modules: list[str] = Field(description="FQNs of all submodules, in named_modules() order.")
    params: list[TensorSig]
    inputs: list[TensorSig]

    def digest(self) -> str:
        """Stable sha256 of the fingerprint (first 16 hex digits)."""
        text = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: "Fingerprint") -> list[str]:
        """Human-readable list of what differs between ``self`` (plan) and ``other`` (model)."""
        out: list[str] = []
        if self.model_class != other.model_class:
            out.append(f"model class: plan has {self.model_class}, model is {other.model_class}")
        mine, theirs = set(self.modules), set(other.modules)
        for name in sorted(mine - theirs)[:10]:
            out.append(f"module {name!r} is in the plan but not in the model")
        for name in sorted(theirs - mine)[:10]:
            out.append(f"module {name!r} is in the model but not in the plan")
        pa = {p.name: p for p in self.params}
        pb = {p.name: p for p in other.params}
        for name in sorted(set(pa) & set(pb)):
            if (pa[name].shape, pa[name].dtype) != (pb[name].shape, pb[name].dtype):
                out.append(
                    f"parameter {name}: plan has {pa[name].shape} {pa[name].dtype}, "
                    f"model has {pb[name].shape} {pb[name].dtype}"
                )
        for name in sorted(set(pa) ^ set(pb))[:10]:
            where = "plan" if name in pa else "model"
            out.append(f"parameter {name!r} only in the {where}")
        ia = {i.name: i for i in self.inputs}
        ib = {i.name: i for i in other.inputs}
        for name in sorted(set(ia) | set(ib)):
            a, b = ia.get(name), ib.get(name)
            if a is None or b is None or (a.shape, a.dtype) != (b.shape, b.dtype):
                fa = f"{a.shape} {a.dtype}" if a else "absent"
                fb = f"{b.shape} {b.dtype}" if b else "absent"
                out.append(f"input {name}: plan has {fa}, model has {fb}")
        return out



# ----------------------------------------------------------------------------- recipe


class Recipe(_Model):
    """The training step around forward and backward: what the loop does that moves the peak.

    The defaults are a plain PyTorch loop: ``optimizer.zero_grad()`` (which sets gradients to
    None), one forward and backward per optimizer step, no autocast, no clipping, torch's default
    optimizer implementation. remat profiles, predicts and verifies the step this describes (see
    ``planner.profiling.measure.make_step`` and NOTE [ Peak-memory model ]); a plan is valid for its recipe only.
    """

    grad_accum: int = Field(1, ge=1, le=2**20, description="Micro-batches per optimizer step (gradient accumulation): "
                                                 "the gradients of micro-batch 1 stay alive through 2..N.")
    zero_grad_set_to_none: bool = Field(True, description="optimizer.zero_grad(set_to_none=...): True (PyTorch's "
                                                          "default) frees the gradients before the step; False "
                                                          "keeps them, zeroed, alive all step.")
    amp: Literal["bf16", "fp16"] | None = Field(None, description="Forward and loss under torch.autocast at this "
                                                                  "dtype; fp16 also scales the loss with a "
                                                                  "GradScaler. None: the model's own dtype.")
    clip_grad_norm: float | None = Field(None, gt=0, allow_inf_nan=False, description="torch.nn.utils.clip_grad_norm_(params, max_norm) "
                                                                 "before the optimizer step (after unscaling).")
    optimizer_impl: Literal["default", "foreach", "fused"] = Field(
        "default", description="The optimizer's implementation: torch's default for the device, or "
                               "foreach=True, or fused=True.")

    @property
    def grads_alive(self) -> bool:
        """Every parameter's gradient is alive throughout the worst micro-batch (see NOTE [ Peak-memory model ])."""
        return self.grad_accum > 1 or not self.zero_grad_set_to_none

    def describe(self) -> str:
        """One line, e.g. 'grad_accum 4, zero_grad(set_to_none=True), amp bf16, no clipping, default optimizer'."""
        amp = {None: "no amp", "bf16": "amp bf16", "fp16": "amp fp16 + GradScaler"}[self.amp]
        clip = "no clipping" if self.clip_grad_norm is None else f"clip_grad_norm {self.clip_grad_norm:g}"
        return (f"grad_accum {self.grad_accum}, zero_grad(set_to_none={self.zero_grad_set_to_none}), {amp}, "
                f"{clip}, {self.optimizer_impl} optimizer")

    def differences(self, other: "Recipe") -> list[str]:
        """What differs between ``self`` (a plan's recipe) and ``other`` (the job's), one phrase each,
        starting with the field's name.

        Clipping counts as on or off: ``clip_grad_norm_`` runs the same kernels whatever the max norm
        (it multiplies every gradient by the clamped coefficient), so the norm does not move the peak.
        """
        return [f"{name}: plan has {getattr(self, name)!r}, training uses {getattr(other, name)!r}"
                for name in self.differing_fields(other)]

    def differing_fields(self, other: "Recipe") -> list[str]:
        """The fields whose values differ between ``self`` and ``other`` (clipping as on or off)."""
        out = []
        for name in type(self).model_fields:
            mine, theirs = getattr(self, name), getattr(other, name)
            same = (mine is None) == (theirs is None) if name == "clip_grad_norm" else mine == theirs
            if not same:
                out.append(name)
        return out

    def flags(self) -> list[str]:
        """The ``remat plan`` options that profile and plan this recipe (none for the defaults)."""
        out = [f"--grad-accum {self.grad_accum}"] if self.grad_accum > 1 else []
        out += [] if self.zero_grad_set_to_none else ["--no-zero-grad-set-to-none"]
        out += [f"--amp {self.amp}"] if self.amp else []
        out += [f"--clip-grad-norm {self.clip_grad_norm:g}"] if self.clip_grad_norm is not None else []
        return out + ([f"--{self.optimizer_impl}"] if self.optimizer_impl != "default" else [])


def _recipe_with_amp(data: Any) -> Any:
    """Files written before ``recipe`` existed mean the default recipe with their ``amp``; ``amp`` mirrors
    ``recipe.amp`` so readers of either see one value."""
    if not isinstance(data, dict):
        return data
    recipe = data.get("recipe")
    if recipe is None:
        return {**data, "recipe": {"amp": data.get("amp")}}
    amp = recipe.amp if isinstance(recipe, Recipe) else (recipe.get("amp") if isinstance(recipe, dict) else None)
    if data.get("amp") not in (None, amp):
        raise ValueError(f"amp {data.get('amp')!r} differs from recipe.amp {amp!r}")
    return {**data, "amp": amp}


# ----------------------------------------------------------------------------- step changes


class StepChange(_Model):
    """Something remat changes in the user's training step, when profiling and when applying a plan.

    See NOTE [ Step changes ] in ``planner/profiling/step_changes.py``.
    """

    kind: Literal["hf_use_cache_off", "hf_layerdrop_off"] = Field(
        description="'hf_use_cache_off': a Hugging Face model is called with use_cache=False while training; "
                    "'hf_layerdrop_off': its layerdrop (stochastic depth) is 0 while remat measures the step, so "
                    "every layer runs (the worst step).")
    module: str = Field(description="FQN of the module whose calls change ('' for the root).")
    reason: str = Field("", description="Why, in words.")
    scope: Literal["train", "measure"] = Field("train", description="'train': when profiling and in training "
                                                                    "(apply_plan installs it); 'measure': only "
                                                                    "while remat profiles or verifies.")


class RetainedBytes(_Model):
    """Bytes a unit keeps alive when checkpointed, measured (see NOTE [ Validation step ] in planner/profiling/validate.py)."""

    unit: str = Field(description="Unit id.")
    nbytes: Bytes = Field(description="Bytes still referenced outside the checkpointed region (a cache, an "
                                    "attribute set in forward, a hook), kept until backward passes the unit.")


class ExcludedUnit(_Model):
    """A module no plan may checkpoint: recomputing it is unsafe (see NOTE [ Validation step ])."""

    module: str = Field(description="Module FQN ('' for the root); every call of it is excluded.")
    reason: str = Field(description="Why, in words.")


# ----------------------------------------------------------------------------- profile


class UnitRecord(_Model):
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
    input_ids: list[int] = Field(default_factory=list,
                                 description="Tensors (ids into Profile.tensors) passed in as inputs and created "
                                             "during the step. Pre-existing tensors (batch, parameters) are static.")
    output_ids: list[int] = Field(default_factory=list, description="Tensors returned, created during the step.")
    input_bytes: Bytes = Field(0, description="Bytes of all tensor inputs (unique storages), pre-existing included.")
    output_bytes: Bytes = Field(0, description="Bytes of all tensor outputs (unique storages).")
    param_bytes: Bytes = Field(0, description="Bytes of the parameters of this module and its submodules.")


class TensorRecord(_Model):
    """One storage created during the step that matters to the memory model."""

    id: Count
    nbytes: Bytes
    created_seq: Seq
    producer: str | None = Field(None, description="Unit id innermost when it was created.")
    autocast_cached: bool = Field(False, description="A parameter's cast made by autocast in the forward: the "
                                                     "autocast cache keeps it alive until the forward ends.")


class SaveRecord(_Model):
    """A tensor saved for backward (autograd pack hook), attributed to the innermost unit."""

    tensor_id: Count
    seq: Seq
    unit: str


class OpRecord(_Model):
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


class ParamRecord(_Model):
    name: str
    nbytes: Bytes
    grad_seq: Seq = Field(description="Seq of the last forward use: its gradient appears once backward passes it.")


class MemoryEvent(_Model):
    """One point of the live-memory timeline recorded during the memory-measuring step."""

    seq: Seq
    kind: Literal["step_start", "fwd_start", "fwd_end", "forward_end", "backward_start",
                  "bwd_start", "bwd_end", "backward_end", "optimizer_end"]
    unit: str | None = None
    live_bytes: Bytes = Field(description="Bytes live right at this event (absolute, static memory included).")
    peak_bytes: Bytes = Field(description="Highest live bytes since the previous event, this one included.")


class StepRecord(_Model):
    params_bytes: Bytes
    buffers_bytes: Bytes = 0
    batch_bytes: Bytes = Field(0, description="Bytes of the input batch (alive throughout the step).")
    grads_bytes: Bytes
    optimizer_bytes: Bytes = Field(description="Optimizer state (e.g. AdamW exp_avg + exp_avg_sq) in steady state.")
    optimizer_step_transient_bytes: Bytes = Field(0, description="Temporaries of optimizer.step(), measured.")
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
                               "some models run differently (NOTE [ Step as run ] in planner/profiling/recording.py).")
    tracked_peak_bytes: Bytes | None = Field(None, description="Peak of the memory step under the tracker, when the "
                                                             "timeline is 'as-run'; None otherwise.")


class StepStructure(_Model):
    """Which units ran in which profiled step (NOTE [ Worst step ] in planner/profiling/recording.py)."""

    units_seen: list[str] = Field(default_factory=list, description="Every unit id that ran in some profiled step, "
                                                                    "in forward order.")
    skipped: dict[str, list[str]] = Field(default_factory=dict,
                                          description="Profiled step ('timing step 1', 'memory step', 'as-run step') "
                                                      "-> the units seen in other steps that it did not run; steps "
                                                      "that ran every unit are left out.")


class Profile(_Model):
    """Everything measured about one training step of one model on one device."""

    kind: Literal["remat-profile"] = "remat-profile"
    schema_version: int = PROFILE_SCHEMA_VERSION
    fingerprint: Fingerprint
    device: str = Field(description="'cpu', 'cuda' or 'meta' (fake tensors, times from a roofline).")
    device_name: str = ""
    target: str | None = Field(None, description="Device spec name the times were modelled for (meta).")
    dtype: str = "float32"
    amp: str | None = Field(None, description="Mirrors recipe.amp (files of schema version 1 had only this).")
    recipe: Recipe = Field(default_factory=Recipe, description="The training step that was profiled.")
    optimizer: str = "adamw"
    torch_version: str = ""
    created_at: str = ""
    time_source: str = Field("", description="What the _ms figures are: 'cpu-thread-time', "
                                             "'cpu-thread-time-scaled', 'wall-clock', 'cuda-events' or 'roofline' "
                                             "(planner.profiling.timing.TIME_SOURCES).")
    threads: Threads | None = Field(None, description="torch intra-op threads the CPU step ran with.")
    thread_scale: NonNegFloat | None = Field(
        None, description="'cpu-thread-time-scaled' only: the measured ratio of the forward's wall time at `threads` "
                          "to its CPU time at one thread, which every figure was multiplied by (NOTE [ Unit costs ], "
                          "Rule 1b).")
    thread_scale_spread: NonNegFloat = Field(0.0, description="Spread of thread_scale over its rounds.")
    time_calibration: str | None = Field(None, description="Roofline only: the calibration file its efficiency "
                                                           "constants came from; None: uncalibrated assumptions.")
    units: list[UnitRecord]
    tensors: list[TensorRecord]
    saves: list[SaveRecord]
    params: list[ParamRecord]
    ops: list[OpRecord] = Field(default_factory=list,
                                description="Ops run inside units during the forward (empty in older profiles).")
    timeline: list[MemoryEvent] = Field(default_factory=list)
    step: StepRecord
    measured_with_checkpoints: list[str] = Field(
        default_factory=list,
        description="Module FQNs checkpointed while the step was measured, because it did not fit the device "
                    "as it is (a memory-safe profile: the timeline and peak of the unplanned step are "
                    "reconstructed, see NOTE [ Memory-safe profile ] in planner/profiling/memsafe.py); empty when the "
                    "step was measured as it is.")
    step_changes: list[StepChange] = Field(default_factory=list,
                                           description="What remat changed in the profiled step (and will change "
                                                       "when a plan is applied).")
    step_structure: StepStructure = Field(default_factory=StepStructure,
                                          description="The units seen and which profiled step skipped which (empty "
                                                      "in older profiles and on fake tensors).")
    retained: list[RetainedBytes] = Field(default_factory=list,
                                          description="Measured bytes checkpointing does not free, per unit.")
    excluded: list[ExcludedUnit] = Field(default_factory=list,
                                         description="Modules whose recomputation is unsafe: never planned.")
    region_state_bytes: Bytes = Field(0, description="Device bytes every checkpointed region keeps until its "
                                                   "backward for its replay (the CPU RNG state on a CPU run), "
                                                   "measured by the validation step; 0 when not measured.")
    sac_recomputed_op_ms: Ms = Field(0.0, description="Milliseconds torch's selective checkpointing adds per "
                                                          "op call a region recomputes, beyond its kernel (NOTE "
                                                          "[ Selective dispatch cost ] in "
                                                          "planner/profiling/sac_cost.py); 0 when not measured.")
    sac_kept_op_ms: Ms = Field(0.0, description="Milliseconds torch's selective checkpointing adds per op call "
                                                   "a region keeps (the same NOTE); 0 when not measured.")
    sac_recomputed_op_spread_ms: Ms = Field(0.0, description="Spread of sac_recomputed_op_ms over the rounds it "
                                                             "was measured in (NOTE [ Selective dispatch cost ], "
                                                             "Rule 4); 0 when not measured.")
    sac_kept_op_spread_ms: Ms = Field(0.0, description="Spread of sac_kept_op_ms over its rounds (the same NOTE).")
    notes: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _sync_recipe(cls, data: Any) -> Any:
        return _recipe_with_amp(data)

    @model_validator(mode="after")
    def _consistent(self) -> "Profile":
        _check_profile(self)
        return self

    def unit(self, unit_id: str) -> UnitRecord:
        for u in self.units:
            if u.id == unit_id:
                return u
        raise KeyError(unit_id)

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(path, self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        return _load_versioned(cls, path, "remat-profile", PROFILE_SCHEMA_VERSION, "profile")


# ----------------------------------------------------------------------------- plan


class SolverInfo(_Model):
    name: str = Field(description="Solver that produced the plan ('dp', 'ilp', ...); 'auto' resolves to one.")
    status: Status
    gap: NonNegFloat | None = Field(None, description="Relative optimality gap when status is 'feasible'.")
    detail: str = ""


class RunStamp(_Model):
    at: str = Field("", description="Creation time, ISO 8601 UTC.")
    solver_seconds: NonNegFloat = Field(0.0, description="Wall-clock seconds the solver took.")


class Predicted(_Model):
    peak_bytes: Bytes
    params_bytes: Bytes
    grads_bytes: Bytes
    optimizer_bytes: Bytes
    activations_bytes: Bytes
    recompute_ms: Ms
    step_ms: Ms
    peak_at: str = ""
    no_checkpoint_peak_bytes: Bytes | None = None
    min_feasible_bytes: Bytes | None = None
    windows: dict[str, int] = Field(default_factory=dict,
                                    description="Predicted bytes of every forward and backward window, in forward "
                                                "order ('forward of h.0', ...; see NOTE [ Peak-memory model ]): "
                                                "verify compares them with the measured windows.")


class OpRef(_Model):
    """One op call in a unit's forward: the ``index``-th call of overload ``op`` (0 = first)."""

    op: str = Field(description="Op overload as torch names it, e.g. 'aten.mm.default'.")
    index: Count


class SelectiveRegion(_Model):
    """A module checkpointed op by op: the listed op calls' outputs are kept, the rest recomputed."""

    fqn: str = Field(description="Module FQN; every call of it runs under the policy.")
    unit: str = Field(description="Unit id the solver chose (FQN, '#k' for the k-th call).")
    save: list[OpRef] = Field(description="Op calls whose outputs are kept (MUST_SAVE); all others recomputed.")
    summary: str = Field("", description="The policy in words, e.g. 'saves 2 matmuls; recomputes 7 pointwise'.")
    recompute_ms: Ms = Field(0.0, description="Predicted recompute time of one call.")
    kept_bytes: Bytes = Field(0, description="Bytes of the kept outputs.")
    keeps_written: bool = Field(False, description="Keeps outputs written in place together with their writers "
                                                   "(allow_cache_entry_mutation).")


class PlanBucket(_Model):
    """One input shape of a bucketed plan and what is checkpointed for it (planner/act/buckets.py)."""

    inputs: list[TensorSig] = Field(description="The input shapes the bucket was profiled with, named as "
                                                "Fingerprint.inputs names them; batches no larger in any "
                                                "dimension run under this bucket's checkpoints.")
    shape: dict[str, int] = Field(default_factory=dict,
                                  description="The keyword arguments example_inputs() made the batch with "
                                              "({'batch': 8, 'seq_len': 128}); empty for batches given as tensors.")
    checkpoints: list[str] = Field(description="As Plan.checkpoints, for this bucket.")
    checkpoint_units: list[str] = Field(default_factory=list, description="As Plan.checkpoint_units.")
    selective: list[SelectiveRegion] = Field(default_factory=list, description="As Plan.selective.")
    solver: SolverInfo
    predicted: Predicted


class Plan(_Model):
    """A checkpoint plan: which module calls to checkpoint, for which model, and what it costs.

    A bucketed plan (``buckets`` not empty) holds one plan per input shape; its own fields are
    those of its largest bucket, so a reader that ignores ``buckets`` gets the plan for the
    largest shape.
    """

    kind: Literal["remat-plan"] = "remat-plan"
    schema_version: int = SINGLE_SHAPE_PLAN_VERSION
    fingerprint: Fingerprint
    fingerprint_digest: str
    budget_bytes: Bytes = Field(gt=0, description="The memory budget the plan was made for (one rank's).")
    headroom_bytes: Bytes = Field(0, description="Kept free below the budget: the solver planned for "
                                               "budget_bytes - headroom_bytes (see planner.act.api.DEFAULT_HEADROOM).")
    checkpoints: list[str] = Field(description="Module FQNs, each checkpointed as one region (every call).")
    checkpoint_units: list[str] = Field(default_factory=list,
                                        description="Unit ids (FQN, '#k' for k-th call) the solver chose.")
    selective: list[SelectiveRegion] = Field(default_factory=list,
                                             description="Modules checkpointed op by op (schema version 2).")
    solver: SolverInfo
    predicted: Predicted
    granularity: int = 0
    device: str = ""
    device_name: str = ""
    target: str | None = None
    dtype: str = ""
    amp: str | None = Field(None, description="Mirrors recipe.amp (files of schema version 1 had only this).")
    recipe: Recipe = Field(default_factory=Recipe, description="The training step the plan was made for; "
                                                               "apply it to that step only.")
    optimizer: str = ""
    world_size: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Data-parallel ranks the plan is for.")
    sharding: Sharding = "none"
    fsdp_units: list[str] = Field(default_factory=list, description=(
        "With sharding 'fsdp': the modules the per-rank prediction assumes each wrapped in fully_shard, "
        "in forward order, before the root (planner.act.sharding.shard_for_plan wraps exactly these)."))
    step_changes: list[StepChange] = Field(default_factory=list,
                                           description="What apply_plan changes in the training step, as the "
                                                       "profile did (see planner/profiling/step_changes.py).")
    excluded: list[ExcludedUnit] = Field(default_factory=list,
                                         description="Modules the profile found unsafe to recompute: not planned.")
    torch_version: str = ""
    remat_version: str = ""
    time_source: str = Field("", description="What recompute_ms is measured or modelled with (Profile.time_source).")
    threads: Threads | None = Field(None, description="torch intra-op threads of the profiled CPU step.")
    time_calibration: str | None = Field(None, description="Roofline only: its calibration file; None: "
                                                           "uncalibrated (Profile.time_calibration).")
    created: RunStamp = Field(default_factory=lambda: RunStamp(),
                              description="The one field that differs between identical runs: when the plan "
                                          "was made and how long the solver took.")
    buckets: list[PlanBucket] = Field(default_factory=list,
                                      description="One plan per input shape, smallest first, the last one the "
                                                  "plan's own fields (schema version 4; written only when not "
                                                  "empty). apply_plan switches between them per batch.")

    @model_validator(mode="before")
    @classmethod
    def _sync_recipe(cls, data: Any) -> Any:
        return _recipe_with_amp(data)

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        _check_plan(self)
        return self

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(path, self.to_json())

    def to_json(self) -> str:
        return self.model_dump_json(indent=2, exclude=None if self.buckets else {"buckets"}) + "\n"

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return _load_versioned(cls, path, "remat-plan", PLAN_SCHEMA_VERSION, "plan")


# ----------------------------------------------------------------------------- consistency


def _check_profile(p: Profile) -> None:
    """Rule 2 of NOTE [ Numbers in files ] for a profile: records agree with each other."""
    units = {u.id for u in p.units}
    if len(units) != len(p.units):
        raise _bad("units", "two units share an id")
    tensors = {t.id for t in p.tensors}
    for i, u in enumerate(p.units):
        if u.fwd_end_seq < u.fwd_start_seq:
            raise _bad(f"units.{i}.fwd_end_seq", f"{u.fwd_end_seq} is before fwd_start_seq {u.fwd_start_seq}")
        if u.bwd_start_seq is not None and u.bwd_end_seq is not None and u.bwd_end_seq < u.bwd_start_seq:
            raise _bad(f"units.{i}.bwd_end_seq", f"{u.bwd_end_seq} is before bwd_start_seq {u.bwd_start_seq}")
        if u.parent is not None and u.parent not in units:
            raise _bad(f"units.{i}.parent", f"no unit has the id {u.parent!r}")
        missing = next((t for t in (*u.input_ids, *u.output_ids) if t not in tensors), None)
        if missing is not None:
            raise _bad(f"units.{i}", f"tensor id {missing} is not in tensors")
    for i, sv in enumerate(p.saves):
        if sv.tensor_id not in tensors:
            raise _bad(f"saves.{i}.tensor_id", f"{sv.tensor_id} is not in tensors")
        if sv.unit not in units:
            raise _bad(f"saves.{i}.unit", f"no unit has the id {sv.unit!r}")
    for i, op in enumerate(p.ops):
        if op.unit not in units:
            raise _bad(f"ops.{i}.unit", f"no unit has the id {op.unit!r}")
    for i, ev in enumerate(p.timeline):
        if ev.peak_bytes < ev.live_bytes:
            raise _bad(f"timeline.{i}.peak_bytes", f"{ev.peak_bytes} is below live_bytes {ev.live_bytes}")
    st = p.step
    if st.backward_start_seq < st.forward_end_seq:
        raise _bad("step.backward_start_seq", f"{st.backward_start_seq} is before forward_end_seq "
                                              f"{st.forward_end_seq}")


def _check_plan(plan: Plan) -> None:
    """Rule 2 of NOTE [ Numbers in files ] for a plan: the prediction adds up and fits the budget,
    the checkpointed modules exist in the model it was made for."""
    pr = plan.predicted
    if plan.headroom_bytes >= plan.budget_bytes:
        raise _bad("headroom_bytes", f"{plan.headroom_bytes} is not below budget_bytes {plan.budget_bytes}")
    parts = pr.params_bytes + pr.grads_bytes + pr.optimizer_bytes + pr.activations_bytes
    if parts != pr.peak_bytes:
        raise _bad("predicted.peak_bytes", f"{pr.peak_bytes} is not the sum of its breakdown (params, grads, "
                                           f"optimizer, activations: {parts})")
    if pr.peak_bytes > plan.budget_bytes - plan.headroom_bytes:
        raise _bad("predicted.peak_bytes", f"{pr.peak_bytes} exceeds budget_bytes {plan.budget_bytes} less "
                                           f"headroom_bytes {plan.headroom_bytes}")
    if plan.world_size > 1 and plan.sharding == "none":
        raise _bad("world_size", f"{plan.world_size} ranks need sharding 'ddp' or 'fsdp', the plan says 'none'")
    modules = {*plan.fingerprint.modules, ""}  # '' is the root, which named_modules lists first
    for field, names in (("checkpoints", plan.checkpoints), ("selective", [r.fqn for r in plan.selective])):
        for i, name in enumerate(names):
            if name not in modules:
                raise _bad(f"{field}.{i}", f"module {name!r} is not in the model (fingerprint.modules)")


# ----------------------------------------------------------------------------- files


def now_iso() -> str:
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()


def _load_versioned(cls: Any, path: str | Path, kind: str, version: int, what: str) -> Any:
    path = Path(path)
    if not path.exists():
        raise PlanFileError(f"{what} file {path} does not exist; check the path")
    if path.is_dir():
        raise PlanFileError(f"{path} is a directory, not a {what} file")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise PlanFileError(f"{what} file {path} is empty; re-create it with `remat {what} ...`")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanFileError(
            f"{what} file {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
            f"it may be truncated: re-create it with `remat {what} ...`"
        ) from None
    if not isinstance(data, dict) or data.get("kind") != kind:
        found = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise PlanFileError(
            f"{path} is JSON but not a remat {what} (kind={found!r}, expected {kind!r}); "
            f"pass a file written by `remat {what}`"
        )
    sv = data.get("schema_version")
    if not isinstance(sv, int) or sv > version or sv < 1:
        raise PlanFileError(
            f"{what} file {path} has schema_version {sv!r}, this remat reads version {version}; "
            f"upgrade remat (pip install -U remat) or re-create the file"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise PlanFileError(f"{what} file {path}: {_field_error(e)}; re-create it with `remat {what} ...`") from None


def _field_error(e: ValidationError) -> str:
    """The first error as ``path.into.file: what is wrong (got VALUE)`` (Rule 3 of NOTE [ Numbers in files ])."""
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first["loc"])
    if first["type"] == "remat_consistency":
        return first["msg"] if not loc else f"{loc}.{first['msg']}"
    got = first.get("input")
    shown = "" if isinstance(got, (dict, list)) or first["type"] == "missing" else f" (got {got!r})"
    return f"{loc or '<top>'}: {first['msg'][:1].lower()}{first['msg'][1:]}{shown}"


__all__ = ["Bytes", "Count", "ExcludedUnit", "Fingerprint", "LOSS_ID", "MAX_BYTES", "MAX_COUNT",
           "MAX_WORLD_SIZE", "MemoryEvent", "Ms", "NonNegFloat", "now_iso", "OpRecord", "OpRef",
           "ParamRecord", "Plan", "PLAN_SCHEMA_VERSION", "PlanBucket", "Predicted", "Profile",
           "PROFILE_SCHEMA_VERSION", "Recipe", "RetainedBytes", "ROOT_ID", "RunStamp", "SaveRecord",
           "SelectiveRegion", "Seq", "SINGLE_SHAPE_PLAN_VERSION", "SolverInfo", "StepChange", "StepRecord",
           "StepStructure", "TensorRecord", "TensorSig", "Threads", "UnitRecord"]
