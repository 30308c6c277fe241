"""Data at the edges: the measured ``Profile`` and the ``Plan`` file.

All are pydantic models that serialise to JSON. Field names carry their units
(``_bytes``, ``_ms``, ``_seq``). The profile's records are in ``records.py``, what each number may
be (NOTE [ Numbers in files ]) and how a file is loaded in ``fields.py``. None of this imports torch.

Sequence numbers (``*_seq``): the profiler keeps one counter for the whole training step and
bumps it at every event it records (module forward start/end, module backward start/end,
every tensor saved for backward). They order everything that happened in the step; the cost
model uses them to place tensors in time (see NOTE [ Peak-memory model ] in
``solvers/cost_model.py``).

Example::

    plan = Plan.load("plan.json")
    plan.predicted.peak_bytes, plan.checkpoints
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from planner.files import atomic_write_text
from planner.model.fields import (MAX_BYTES, MAX_COUNT, MAX_GRAD_ACCUM, MAX_WORLD_SIZE, Bytes, Count, Ms, NonNegFloat,
                                  Seq, Threads, now_iso)
from planner.model.fields import FileModel as _Model  # the base of every model below: unknown fields are an error
from planner.model.fields import bad_field as _bad, load_versioned as _load_versioned
from planner.model.stages import Pipeline, StagePlan, check_predicted, check_stages, unset_parallel_fields
from planner.model.records import (LOSS_ID, ROOT_ID, Fingerprint, OffloadedUnit, MemoryEvent, OpRecord, ParamRecord,
                                   SaveRecord, StepRecord, StepStructure, TensorRecord, TensorSig, UnitRecord,
                                   check_records)
from solvers.contract import Sharding, Status

PROFILE_SCHEMA_VERSION = 5
"""4: compiled profiles (``Profile.compile``); 5: their ``replay_transient_bytes`` signed (NOTE [ Compiled profile ],
Rule 9), so that an older reader refuses one with one line (upgrade). Eager profiles keep version 3."""
PLAN_SCHEMA_VERSION = 7
"""2 added ``recipe`` (``Recipe``); version-1 files load as the default recipe (their ``amp`` kept).
3 added op records (``Profile.ops``) and ``Plan.selective`` (op-level checkpointing); older files
load with none. 4 added ``Plan.buckets`` (one plan per input shape); a plan without buckets is
still written as version 3, byte for byte as before (``SINGLE_SHAPE_PLAN_VERSION``). 5 added
``Plan.offload`` and the host fields (``host_budget_bytes``, ``predicted.host_peak_bytes`` and
``offload_ms``), written only by a plan that offloads; every other plan keeps its version and bytes.
6 added ``compile`` (the step under torch.compile; profile version 4), written only when set. 7: pipeline/tp fields."""
COMPILED_PROFILE_VERSION = 5
COMPILED_PLAN_VERSION, PIPELINE_PLAN_VERSION = 6, 7  # compiled plans; pipeline or tensor-parallel plans
SINGLE_SHAPE_PLAN_VERSION = 3
"""The version a plan without buckets is written as: readers of version 3 read it unchanged."""
BUCKETED_PLAN_VERSION = 4
"""The version a bucketed plan is written as."""
OFFLOAD_PLAN_VERSION = 5
"""The version a plan that offloads is written as: older readers refuse it with one line (upgrade)."""



# ----------------------------------------------------------------------------- recipe


class Recipe(_Model):
    """The training step around forward and backward: what the loop does that moves the peak.

    The defaults are a plain PyTorch loop: ``optimizer.zero_grad()`` (which sets gradients to
    None), one forward and backward per optimizer step, no autocast, no clipping, torch's default
    optimizer implementation. remat profiles, predicts and verifies the step this describes (see
    ``planner.profiling.measure.make_step`` and NOTE [ Peak-memory model ]); a plan is valid for its recipe only.
    """

    grad_accum: int = Field(1, ge=1, le=MAX_GRAD_ACCUM, description="Micro-batches per optimizer step (gradient accumulation): "
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
    keep_output: bool = Field(False, description="The loop holds the model's output (the logits) through backward, "
                                                 "as Hugging Face's loop does (outputs = model(**batch); "
                                                 "outputs.loss.backward()); False: dropped once the loss is made "
                                                 "(NOTE [ The output kept through backward ]).")

    @property
    def grads_alive(self) -> bool:
        """Every parameter's gradient is alive throughout the worst micro-batch (see NOTE [ Peak-memory model ])."""
        return self.grad_accum > 1 or not self.zero_grad_set_to_none

    def describe(self) -> str:
        """One line, e.g. 'grad_accum 4, zero_grad(set_to_none=True), amp bf16, no clipping, default optimizer'."""
        amp = {None: "no amp", "bf16": "amp bf16", "fp16": "amp fp16 + GradScaler"}[self.amp]
        clip = "no clipping" if self.clip_grad_norm is None else f"clip_grad_norm {self.clip_grad_norm:g}"
        kept = ", the output kept through backward" if self.keep_output else ""
        return (f"grad_accum {self.grad_accum}, zero_grad(set_to_none={self.zero_grad_set_to_none}), {amp}, "
                f"{clip}, {self.optimizer_impl} optimizer{kept}")

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
        out += ["--keep-output"] if self.keep_output else []
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


# ----------------------------------------------------------------------------- compile


class CompiledPeak(_Model):
    """One checkpoint set's compiled step, measured (NOTE [ The compiled plan is checked ])."""

    checkpoints: list[str] = Field(description="Module FQNs checkpointed whole; empty: the step as it is.")
    selective: list[SelectiveRegion] = Field(default_factory=list, description="Modules checkpointed op by op.")
    peak_bytes: Bytes = Field(description="The compiled step's measured peak with them checkpointed.")


class CompileInfo(_Model):
    """The step was profiled (a profile) or planned (a plan) as ``torch.compile`` runs it
    (NOTE [ Compiled profile ] in planner/profiling/compiled.py)."""

    backend: str = Field(description="torch.compile backend, e.g. 'inductor'.")
    torch_version: str = Field(description="torch version that compiled it: another may partition differently.")
    first_compile_s: NonNegFloat = Field(0.0, description="Wall seconds of the profile's first compiled step.")
    replay_transient_bytes: int = Field(0, ge=-MAX_BYTES, le=MAX_BYTES,
                                        description="A compiled replay's temporaries beyond its saves, signed: "
                                                    "negative where the fused replay's are below the eager "
                                                    "forward's (NOTE [ Peak-memory model ], Rule 11).")
    measured: list[CompiledPeak] = Field(default_factory=list, description=(
        "Checkpoint sets whose compiled step was measured: the profile's two compiles and, in a plan, each "
        "set remat checked before returning it (NOTE [ The compiled plan is checked ])."))
    aot_cse: bool = Field(True, description=(
        "False: checkpointed steps were compiled with AOTAutograd's CSE off, and apply_plan turns it off "
        "(NOTE [ CSE across checkpointed regions ]); True: left as torch has it (plans made before)."))
    fwd_side_effects_replayed: bool = Field(True, description=(
        "False: checkpointed steps were compiled with dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint "
        "on (a region's forward side effects run once, so dynamo compiles a Hugging Face layer's checkpoint "
        "instead of running it eagerly), and apply_plan turns it on "
        "(NOTE [ Side effects in a checkpointed region ]); True: left as torch has it (plans made before, "
        "or a torch without the setting)."))


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


class Profile(_Model):
    """Everything measured about one training step of one model on one device."""

    kind: Literal["remat-profile"] = "remat-profile"
    schema_version: int = 3
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
                          "to its CPU time at one thread, which every figure but sac_*_op_ms was multiplied by (NOTE "
                          "[ Unit costs ], Rule 1b).")
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
                    "reconstructed, see NOTE [ Memory-safe profile ] in planner/profiling/unplanned.py); empty when the "
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
    checkpointed_windows: dict[str, list[Bytes]] = Field(default_factory=dict, description=(
        "Leaf unit id -> [live bytes when its forward window began, the window's peak] in the validation step, "
        "every top-level candidate checkpointed (NOTE [ Checkpointed forward windows ] in solvers/checkpointed.py); "
        "empty when not measured."))
    sac_recomputed_op_ms: Ms = Field(0.0, description="Milliseconds torch's selective checkpointing adds per "
                                                          "op call a region recomputes, beyond its kernel (NOTE "
                                                          "[ Selective dispatch cost ] in "
                                                          "planner/profiling/sac_cost.py): one thread's CPU time, "
                                                          "not scaled by thread_scale (Rule 5); 0 when not "
                                                          "measured.")
    host_link_bytes_per_s: NonNegFloat | None = Field(
        None, description="Bytes/s one way between the device and host memory, for offloaded activations "
                          "(NOTE [ Peak-memory model ], Rule 10): a memcpy measured on the CPU, a pinned copy "
                          "measured on CUDA, the target's spec under meta; None: not known (older profiles).")
    copy_engine: bool = Field(False, description="Device-host copies run beside compute on a copy engine (CUDA, "
                                                 "meta targets); False on the CPU, where a copy is a memcpy on "
                                                 "the compute thread.")
    sac_kept_op_ms: Ms = Field(0.0, description="Milliseconds torch's selective checkpointing adds per op call "
                                                   "a region keeps (the same NOTE); 0 when not measured.")
    sac_recomputed_op_spread_ms: Ms = Field(0.0, description="Spread of sac_recomputed_op_ms over the rounds it "
                                                             "was measured in (NOTE [ Selective dispatch cost ], "
                                                             "Rule 4); 0 when not measured.")
    sac_kept_op_spread_ms: Ms = Field(0.0, description="Spread of sac_kept_op_ms over its rounds (the same NOTE).")
    sac_rounds: int = Field(0, ge=0, description="Rounds the sac figures are medians of (the same NOTE); 0: not recorded.")
    notes: list[str] = Field(default_factory=list)
    user_checkpointed: dict[str, str] = Field(default_factory=dict, description="Modules the model checkpointed "
                                              "itself in the profiled step, FQN -> how (see "
                                              "planner/act/existing.py); empty in older profiles.")
    compile: CompileInfo | None = Field(None, description="The step under torch.compile (version 4); None: eager.")

    @model_validator(mode="before")
    @classmethod
    def _sync_recipe(cls, data: Any) -> Any:
        return _recipe_with_amp(data)

    @model_validator(mode="after")
    def _consistent(self) -> "Profile":
        check_records(self)
        _check_device(self.device)  # NOTE [ Plan fields edited by hand ], Rule 3: a plan inherits it
        return self

    def unit(self, unit_id: str) -> UnitRecord:
        for u in self.units:
            if u.id == unit_id:
                return u
        raise KeyError(unit_id)

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(path, self.model_dump_json(indent=1, exclude=None if self.compile else {"compile"}))

    @classmethod
    def load(cls, path: str | Path, document: Any = None) -> "Profile":
        """Read and validate the file ``path`` (``document``: its JSON, when read already); ``PlanFileError``."""
        return _load_versioned(cls, path, "remat-profile", PROFILE_SCHEMA_VERSION, "profile", document)


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
    host_peak_bytes: Bytes | None = Field(None, description="Host memory the offloaded tensors take at their "
                                                            "peak (written only when the plan offloads).")
    offload_ms: Ms | None = Field(None, description="Copy time of the offloaded units not hidden behind "
                                                    "compute, per step (written only when the plan offloads).")
    windows: dict[str, Bytes] = Field(default_factory=dict,
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


_NO_OFFLOAD = {"offload": True, "host_budget_bytes": True, "predicted": {"host_peak_bytes": True, "offload_ms": True}}
"""Plan keys written only when a plan offloads, so that plans without offload are byte for byte as before."""


StagePlan.model_rebuild(_types_namespace={"Fingerprint": Fingerprint, "SolverInfo": SolverInfo, "Predicted": Predicted})


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
    offload: list[OffloadedUnit] = Field(default_factory=list,
                                         description="Modules whose saved tensors are moved to host memory "
                                                     "(written only when not empty).")
    host_budget_bytes: Bytes | None = Field(None, description="Host memory the plan may use for offloaded "
                                                              "tensors (written only when the plan offloads).")
    solver: SolverInfo
    predicted: Predicted
    granularity: Count = 0
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
    compile: CompileInfo | None = Field(None, description="For the step under torch.compile (version 6); None: eager.")
    pipeline: Pipeline | None = Field(None, description="Pipeline stages (NOTE [ Pipeline stages ]; version 7).")
    stages: list[StagePlan] = Field(default_factory=list, description="One plan per pipeline stage; apply_plan on a stage module applies its own.")
    tensor_parallel: int = Field(1, ge=1, le=MAX_WORLD_SIZE, description="Ranks sharing each layer (NOTE [ Tensor-parallel ranks ]).")
    sequence_parallel: bool = Field(False, description="The sequence sharded between blocks (NOTE [ Sequence-parallel ranks ]).")

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
        exclude: dict[str, Any] = {} if self.offload else dict(_NO_OFFLOAD)
        if not self.buckets:
            exclude["buckets"] = True
        elif not self.offload:
            exclude["buckets"] = {"__all__": {"predicted": _NO_OFFLOAD["predicted"]}}
        if self.compile is None:
            exclude["compile"] = True
        exclude.update(unset_parallel_fields(self))  # pipeline, stages, tensor_parallel: written only when set
        return self.model_dump_json(indent=2, exclude=exclude or None) + "\n"

    @classmethod
    def load(cls, path: str | Path, document: Any = None) -> "Plan":
        """Read and validate the file ``path`` (``document``: its JSON, when read already); ``PlanFileError``."""
        return _load_versioned(cls, path, "remat-plan", PLAN_SCHEMA_VERSION, "plan", document)


# ----------------------------------------------------------------------------- consistency


def _check_plan(plan: Plan) -> None:
    """Rule 2 of NOTE [ Numbers in files ] for a plan: the prediction adds up and fits the budget,
    the checkpointed modules exist in the model it was made for."""
    if plan.headroom_bytes >= plan.budget_bytes:
        raise _bad("headroom_bytes", f"{plan.headroom_bytes} is not below budget_bytes {plan.budget_bytes}")
    for where, pr in (("predicted", plan.predicted), *((f"buckets.{i}.predicted", b.predicted) for i, b in enumerate(plan.buckets))):
        check_predicted(where, pr, plan.budget_bytes, plan.headroom_bytes)
    check_stages(plan)
    if plan.world_size > 1 and plan.sharding == "none" and plan.pipeline is None and plan.tensor_parallel != plan.world_size:
        raise _bad("world_size", f"{plan.world_size} ranks need sharding 'ddp' or 'fsdp', the plan says 'none'")
    modules = {*plan.fingerprint.modules, ""}  # '' is the root, which named_modules lists first
    host_peak_bytes = plan.predicted.host_peak_bytes
    if host_peak_bytes is not None and plan.host_budget_bytes is not None and host_peak_bytes > plan.host_budget_bytes:
        raise _bad("predicted.host_peak_bytes", f"{host_peak_bytes} exceeds host_budget_bytes "
                                                f"{plan.host_budget_bytes}")
    if plan.offload and plan.buckets:
        raise _bad("offload", "a bucketed plan cannot offload (one input shape per offload plan)")
    for field, names in (("checkpoints", plan.checkpoints), ("selective", [r.fqn for r in plan.selective]),
                         ("offload", [u.fqn for u in plan.offload]), ("fsdp_units", plan.fsdp_units),
                         *((f"buckets.{i}.checkpoints", b.checkpoints) for i, b in enumerate(plan.buckets))):
        for i, name in enumerate(names):
            if name not in modules:
                raise _bad(f"{field}.{i}", f"module {name!r} is not in the model (fingerprint.modules)")
    _check_records(plan)


# NOTE [ Plan fields edited by hand ]
#
# A plan file is data (docs/cli.md, "Trust"), and one edited by hand is read as remat wrote it or refused; remat
# never applies a guess at what an edit meant. Round 17 probe: a module listed twice was applied once, and
# ``solver``, ``device`` and ``fingerprint_digest`` were read without a check.
# Rule 1. A module is listed once in a plan's (or bucket's, or stage's) checkpoints, and a unit (one call of a
#   module) once in its selective and offload lists: a second mention is refused naming both places
#   (``checkpoints.2: module 'h.0' is listed twice (also checkpoints.0)``). remat never writes one; a hand edit
#   that did meant something remat cannot know.
# Rule 2. ``fingerprint_digest`` is the digest of the plan's ``fingerprint`` (the stages' of theirs): it is what
#   ``remat show --why`` matches a profile by, so an edited digest would pair a plan with another model's profile.
# Rule 3. ``device`` is a device kind remat profiles on (``DEVICE_KINDS``; empty in plans made in Python without
#   a profile): ``verify`` compares it with the device it trains on. A profile's too, which its plans inherit
#   (a profile saying 'tpu' made planning an internal error once plans were checked). ``solver`` stays a record, read as written:
#   a plan chosen by hand in Python names its own (``SolverInfo(name="manual")``, as tests and benchmarks do), and
#   its text is checked as all text is (NOTE [ Text in files ] in planner/model/fields.py).

DEVICE_KINDS = ("cpu", "cuda", "meta", "synthetic")
"""The devices a profile (and so a plan) is made on: ``Profile.device``, ``Plan.device``; 'synthetic' for the
made-up profiles of ``planner.model.synthetic`` (tests, benchmarks)."""


def _check_records(plan: Plan) -> None:
    """NOTE [ Plan fields edited by hand ]."""
    lists = [("", plan), *((f"buckets.{i}.", b) for i, b in enumerate(plan.buckets)),
             *((f"stages.{i}.", st) for i, st in enumerate(plan.stages))]
    for prefix, part in lists:
        for field, key in (("checkpoints", None), ("selective", "unit"), ("offload", "unit")):
            seen: dict[str, str] = {}
            for i, item in enumerate(getattr(part, field, [])):
                name, where = getattr(item, key) if key else item, f"{prefix}{field}.{i}"
                if name in seen:
                    raise _bad(where, f"{'module' if key is None else 'unit'} {name!r} is listed twice (also "
                                      f"{seen[name]}); list each once")
                seen[name] = where
    for prefix, part in (("", plan), *((f"stages.{i}.", st) for i, st in enumerate(plan.stages))):
        if part.fingerprint_digest != part.fingerprint.digest():
            raise _bad(f"{prefix}fingerprint_digest", f"{part.fingerprint_digest!r} is not the digest of the "
                                                      f"plan's fingerprint ({part.fingerprint.digest()!r})")
    if plan.device:  # empty in plans made in Python without a profile
        _check_device(plan.device)


def _check_device(device: str) -> None:
    """Rule 3 of NOTE [ Plan fields edited by hand ], for a profile and a plan alike."""
    if device not in DEVICE_KINDS:
        raise _bad("device", f"{device!r} is not a device remat profiles on ({', '.join(DEVICE_KINDS)})")


__all__ = ["BUCKETED_PLAN_VERSION", "Bytes", "DEVICE_KINDS", "COMPILED_PLAN_VERSION", "COMPILED_PROFILE_VERSION", "CompileInfo", "CompiledPeak",
           "Count", "ExcludedUnit", "Fingerprint", "LOSS_ID", "MAX_BYTES", "MAX_COUNT",
           "MAX_WORLD_SIZE", "MemoryEvent", "Ms", "NonNegFloat", "now_iso", "OpRecord", "OpRef",
           "ParamRecord", "Plan", "PIPELINE_PLAN_VERSION", "Pipeline", "PLAN_SCHEMA_VERSION", "PlanBucket", "BUCKETED_PLAN_VERSION", "Predicted", "Profile",
           "PROFILE_SCHEMA_VERSION", "Recipe", "RetainedBytes", "ROOT_ID", "RunStamp", "SaveRecord",
           "SelectiveRegion", "Seq", "SINGLE_SHAPE_PLAN_VERSION", "SolverInfo", "StagePlan", "StepChange", "StepRecord",
           "StepStructure", "TensorRecord", "TensorSig", "Threads", "UnitRecord"]
