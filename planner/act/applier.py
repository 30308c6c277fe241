"""Enforce a ``Plan`` on a live model: checkpoint the planned modules in place, undoably.

Example::

    handle = apply_plan(model, "plan.json")      # or a Plan object
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        ...
    print(handle.recompute_count, "forwards recomputed")
    handle.remove()                               # the model is exactly as before

    with apply_plan(model, plan):                 # or scoped
        ...

Each planned module is checkpointed as one region on every call, with non-reentrant
``torch.utils.checkpoint`` (keyword arguments and non-tensor outputs pass through). The model
keeps its structure: no wrapper modules, so parameter names, ``state_dict`` keys and parameter
objects are unchanged, and optimizers or checkpoints made before ``apply_plan`` still match.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.act import buckets
from planner.act.aliases import distinct_tensors
from planner.act.existing import (TWICE_FIX, TwiceGuard, listing, modules_by_plain_name, overlap,  # noqa: F401
                                   user_checkpointed)
from planner.act.sharding import check_fsdp_options
from planner.act.mode_guard import ModeGuard
from planner.act.norm_stats import attributes_kept, running_stats_kept
from planner.act import step_guard
from planner.act.shape_guard import ShapeGuard
from planner.errors import BadInput, PlanMismatch
from planner.model.fingerprint import lazy_modules, model_differences
from planner.model.schema import Plan, StepChange
from planner.model.stages import plan_for
from planner.profiling.aot_cse import keep_regions_apart
from planner.profiling.rng import HostRngState, held_generators
from planner.profiling.step_changes import Installed, find_step_changes, install
from planner.sizes import format_bytes

logger = logging.getLogger("remat")

GUARDS = ("warn", "error", "off")
"""``apply_plan(guard=...)`` values; see NOTE [ Runtime shape guard ]."""

class PlanAlreadyApplied(BadInput):
    """``apply_plan`` was called on a model that already carries a remat plan."""


# ----------------------------------------------------------------------------- the wrapper


@dataclass
class RegionCounts:
    """How often one checkpointed module ran, since ``apply_plan`` or ``reset_counts()``."""

    calls: int = 0
    """Checkpointed forward calls (with grad enabled; eager mode only)."""
    recomputes: int = 0
    """Forwards ``checkpoint`` replayed during backward (eager mode only)."""


# NOTE [ Checkpointing by instance forward ]
#
# ``nn.Module.__call__`` runs hooks and then ``self.forward``. ``apply_plan`` sets an instance
# attribute ``forward`` on each planned module: a ``CheckpointedForward`` object that calls the
# module's previous forward (the bound class method, or an instance-level forward someone else
# installed) inside ``checkpoint(..., use_reentrant=False, preserve_rng_state=True)``. So:
#   - the module's own hooks stay outside the region and run once (as Hugging Face's
#     ``GradientCheckpointingLayer`` does, and for the same reason: FSDP2's hooks);
#   - ``remove()`` deletes the attribute (or puts back the instance forward it replaced);
#     ``type(module).forward`` is never touched;
#   - it is an object, not a closure: ``copy.deepcopy(model)`` gives a copy whose forward is
#     rebound to the copy's own module (bound methods deep-copy that way; a closure would keep
#     calling the original model's module), and ``torch.save(model)`` can pickle it.
# Tensors passed as keyword arguments are handed to ``checkpoint`` positionally, because
# ``checkpoint`` looks for the device whose RNG state it must preserve in the positional
# arguments only: a dropout inside a region called as ``block(x=h)`` on a GPU would otherwise
# draw a different mask when recomputed (silently wrong gradients).
# A recomputation is recognised without any global flag: every call builds a fresh inner
# function for ``checkpoint``; its first run is the forward, any later run of the same function
# is ``checkpoint`` replaying it during backward. The forward notes numpy's and Python's
# generators, and the replay runs from that state and puts the current one back, as
# ``preserve_rng_state`` does for torch's (NOTE [ Randomness outside torch ] in
# planner/profiling/rng.py). Under ``torch.compile`` the region becomes a
# ``tag_activation_checkpoint`` higher-order op and the compiled backward recomputes it, so no
# Python runs at recompute time and nothing is counted.

class CheckpointedForward:
    """The instance-level ``forward`` of a planned module; see NOTE [ Checkpointing by instance forward ]."""

    _remat_forward = True  # marks a module that already carries a plan
    options: dict[str, Any] = {}
    """Extra keyword arguments for ``checkpoint`` (the memory-safe profile's hooks, planner/profiling/memsafe.py)."""
    on = True
    """False: the bucket in force does not checkpoint this module (NOTE [ Bucketed plans ] in planner/act/buckets.py)."""
    pinned: tuple | None = None
    """The largest bucket's mode, run under torch.compile (the same NOTE); None: a plan without buckets."""
    mode_guard: ModeGuard | None = None
    """Set by ``apply_plan``: warns when the step is compiled and the plan eager, or the reverse."""
    owner: Any = None
    """The ``AppliedPlan`` that installed it; None in a copy (NOTE [ Plans carried without a handle ])."""

    def __init__(self, module: nn.Module, previous: Any, counts: RegionCounts,
                 norms: list[nn.Module] | None = None, saved: frozenset[tuple[str, int]] | None = None,
                 keeps_written: bool = False):
        self.module = module
        self.saved = saved  # None: full checkpoint; else the op calls to keep (NOTE [ Selective regions ])
        self.keeps_written = keeps_written
        self.previous = previous  # the instance forward we replaced, or None
        # Bound here rather than read as ``module.forward``: when deepcopy or pickle rebuilds
        # this object, the module is only half restored and ``module.forward`` may be us.
        self.inner = previous if previous is not None else type(module).forward.__get__(module, type(module))
        self.counts = counts
        self.norms = norms if norms is not None else [
            m for m in module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
        functools.update_wrapper(self, self.inner, assigned=("__doc__", "__name__", "__qualname__"), updated=())
        self.__wrapped__ = self.inner  # inspect.signature(module.forward) shows the real parameters

    def __reduce__(self) -> tuple:
        return (type(self), (self.module, self.previous, self.counts, self.norms, self.saved, self.keeps_written),
                {"on": self.on, "pinned": self.pinned})

    def mode(self) -> tuple:
        """(checkpointed, selective policy or None, keeps_written) of this call."""
        if self.pinned is not None and torch.compiler.is_compiling():
            return self.pinned
        return self.on, self.saved, self.keeps_written

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        on, saved, keeps_written = self.mode()
        if self.mode_guard is not None:
            self.mode_guard.check()
        if not on or not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)  # no backward, nothing to recompute
        extra = {} if saved is None else {
            "context_fn": functools.partial(_selective_contexts, saved, keeps_written)}
        if torch.compiler.is_compiling():
            return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
        self.counts.calls += 1
        distinct, slots = distinct_tensors((*args, *kwargs.values()))  # NOTE [ Aliased arguments ]
        return checkpoint(self._replayable(len(args), tuple(kwargs), slots), *distinct,
                          use_reentrant=False, preserve_rng_state=True, **self.options, **extra)


    @functools.cached_property
    def submodules(self) -> list[nn.Module]:
        """The region's modules, whose tensor attributes a replay leaves as they were (NOTE [ Tensors a replay
        stores on modules ])."""
        return list(self.module.modules())

    @functools.cached_property
    def generators(self) -> tuple[Any, ...]:
        """The generators the region's modules hold (NOTE [ Generators a model holds ]); found on first use."""
        return held_generators(self.module)

    def _replayable(self, n_args: int, keys: tuple[str, ...], slots: list[int]):
        first_run = True
        host = None  # numpy's and Python's generators as the forward found them (NOTE [ Randomness outside torch ])

        def run(*distinct: Any) -> Any:
            nonlocal first_run, host
            flat = [distinct[i] for i in slots]
            args, kwargs = flat[:n_args], dict(zip(keys, flat[n_args:]))
            if first_run:
                first_run = False
                host = HostRngState.capture(self.generators)
                out = self.inner(*args, **kwargs)
                if HostRngState.capture(self.generators).same_as(host):
                    host = None  # it drew nothing: nothing to replay (NOTE [ Regions that draw nothing ])
                return out
            self.counts.recomputes += 1
            now = None
            if host is not None:  # the forward drew: replay its draws, then put back what the step has now
                now = HostRngState.capture(self.generators)
                host.restore()
            try:
                with running_stats_kept(self.norms), attributes_kept(self.submodules):
                    return self.inner(*args, **kwargs)
            finally:
                if now is not None:
                    now.restore()

        return run


# NOTE [ Selective regions ]
#
# A plan's ``selective`` modules are checkpointed the same way, with one more argument:
# ``checkpoint(..., context_fn=...)`` builds torch's selective-checkpointing modes
# (``create_selective_checkpoint_contexts``) around a fresh ``_KeepListed`` policy per call.
# The policy marks MUST_SAVE the op calls the plan lists, by overload name and index among
# that overload's calls in the module's forward (the profiler counts the same way, NOTE [ Op
# records ]), and PREFER_RECOMPUTE everything else. Dropout replays its RNG state as in full
# checkpointing (or is kept, if listed). Under ``torch.compile`` the marks become hints for
# the partitioner on the traced graph, whose op calls may be numbered differently (fused,
# decomposed): the gradients stay exact, the memory is what the compiler makes of the hints.

def _selective_contexts(saved: frozenset[tuple[str, int]], keeps_written: bool) -> tuple[Any, Any]:
    """``context_fn`` of a selective region: torch's modes around a fresh ``_KeepListed``.

    ``keeps_written``: the plan keeps an output written in place together with all its writers
    (NOTE [ Op records ]), so the cache entry's version changes by design; torch's check
    against mutated entries is relaxed for such regions only.
    """
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_KeepListed(saved), allow_cache_entry_mutation=keeps_written)


class _KeepListed:
    """Selective checkpointing policy: keep the listed op calls, recompute the rest.

    See NOTE [ Selective regions ]. One per region call: it counts each op overload's calls
    in this forward (and, for torch versions that also ask during the recompute, there
    separately), so "the k-th aten.mm.default" is the profiler's k-th (NOTE [ Op records ]).
    """

    def __init__(self, saved: frozenset[tuple[str, int]]):
        self.saved = saved
        self.seen: dict[bool, dict[str, int]] = {False: {}, True: {}}

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        name = str(func)
        seen = self.seen[bool(getattr(ctx, "is_recompute", False))]
        k = seen.get(name, 0)
        seen[name] = k + 1
        return CheckpointPolicy.MUST_SAVE if (name, k) in self.saved else CheckpointPolicy.PREFER_RECOMPUTE


# ----------------------------------------------------------------------------- the handle


@dataclass
class AppliedPlan:
    """What ``apply_plan`` did to a model, and how to undo it.

    A context manager: ``with apply_plan(model, plan): ...`` removes the plan on exit.
    """

    checkpointed: list[str]
    """FQNs of the modules now checkpointed, in plan order (a bucketed plan: those some bucket checkpoints whole,
    largest bucket first; the bucket in force says which run checkpointed, NOTE [ Bucketed plans ])."""
    selective: list[str] = field(default_factory=list)
    """FQNs of the modules now checkpointed op by op (the plan's ``selective`` regions)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Plan FQNs left alone, with the reason (already checkpointed by the user, not in the model)."""
    step_changes: list[StepChange] = field(default_factory=list)
    """What the plan changes in the training step (see NOTE [ Step changes ]), as its profile did."""
    offloaded: list[str] = field(default_factory=list)
    """FQNs of the modules whose saved tensors now go to host memory (the plan's ``offload``)."""
    host_store: Any = None
    """``planner.act.offload.HostStore`` of the offloaded tensors: ``.peak_bytes``, ``.live_bytes``,
    ``.reset_peak()``; None without offload."""
    _hooks: list[Any] = field(default_factory=list, repr=False)
    _forwards: dict[str, CheckpointedForward] = field(default_factory=dict, repr=False)
    _changes: Installed | None = field(default=None, repr=False)
    _active: bool = field(default=True, repr=False)
    _guard_hook: Any = field(default=None, repr=False)
    _twice_hook: Any = field(default=None, repr=False)
    _switch: Any = field(default=None, repr=False)

    @property
    def bucket(self) -> int | None:
        """Index into ``plan.buckets`` of the bucket in force (NOTE [ Bucketed plans ]); None without buckets."""
        return None if self._switch is None else self._switch.current

    @property
    def recompute_count(self) -> int:
        """Forwards recomputed during backward, all regions together (eager mode only)."""
        return sum(f.counts.recomputes for f in self._forwards.values())

    @property
    def call_count(self) -> int:
        """Checkpointed forward calls, all regions together (eager mode, grad enabled)."""
        return sum(f.counts.calls for f in self._forwards.values())

    def counts(self) -> dict[str, RegionCounts]:
        """Calls and recomputations per checkpointed FQN."""
        return {name: f.counts for name, f in self._forwards.items()}

    def reset_counts(self) -> None:
        for f in self._forwards.values():
            f.counts.calls = f.counts.recomputes = 0

    def remove(self) -> None:
        """Undo ``apply_plan``: every planned module gets back the forward it had. Idempotent.

        The counts stay readable after ``remove()``.
        """
        if not self._active:
            return
        self._active = False
        for hook in (self._guard_hook, self._twice_hook, *self._hooks):
            if hook is not None:
                hook.remove()
        for name, fwd in self._forwards.items():
            module = fwd.module
            if module.__dict__.get("forward") is not fwd:
                warnings.warn(f"remat: the forward of {name!r} was replaced after apply_plan; "
                              f"leaving it as it is", stacklevel=2)
            elif fwd.previous is not None:
                module.forward = fwd.previous
            else:
                del module.forward
        if self._changes is not None:
            self._changes.remove()

    def __enter__(self) -> AppliedPlan:  # noqa: PYI034 (a dataclass nobody subclasses)
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


# ----------------------------------------------------------------------------- apply_plan


def apply_plan(model: nn.Module, plan_or_path: Plan | str | Path, *, strict: bool = True,
               inputs: Any = None, guard: str = "warn") -> AppliedPlan:
    """Checkpoint the modules a plan names, in place on ``model``.

    Every call of each module in ``plan.checkpoints`` runs inside non-reentrant
    ``torch.utils.checkpoint`` with the RNG state preserved, so dropout masks, the loss and
    the gradients are those of the unplanned model. See NOTE [ Checkpointing by instance
    forward ] and NOTE [ BatchNorm under recomputation ].

    Under torch.distributed the plan may be applied before or after ``fully_shard`` or
    ``DistributedDataParallel``; a DDP wrapper is looked through (its ``.module`` is planned).
    See NOTE [ Plans under FSDP2 and DDP ].

    .. warning::
        Apply the plan before ``torch.compile`` (``model = torch.compile(model)`` afterwards).
        Modules the user already checkpointed (Hugging Face ``gradient_checkpointing_enable()``,
        torch's ``checkpoint_wrapper`` or composable ``checkpoint``) are skipped with a warning,
        never checkpointed twice; so are plan modules inside or around them.

    Args:
        model: the model the plan was made for (structure and parameter shapes must match).
        plan_or_path: a ``Plan`` or the path of a plan file.
        strict: if True, any difference between the plan's fingerprint and the model raises
            ``PlanMismatch``; if False, they are reported in a warning and the plan
            modules present in the model are checkpointed.
        inputs: the inputs the model will be trained on (as ``example_inputs()`` returns them);
            when given, their shapes are checked against the plan's too.
        guard: what happens when a training forward gets inputs larger than the plan's
            ("warn": one warning, "error": ``PlanMismatch``, "off": nothing); smaller ones pass; and
            when the loop runs another step than the plan's (NOTE [ The step as the loop runs it ]).
            See NOTE [ Runtime shape guard ].

    Returns:
        An ``AppliedPlan``: ``.checkpointed``, ``.skipped``, ``.recompute_count``, ``.remove()``.

    Raises:
        PlanMismatch: the plan was made for another model or input shapes (``strict=True``).
        PlanAlreadyApplied: the model already carries a remat plan.
        BadInput: the model is a ``torch.compile`` wrapper, or the plan nests checkpoints.

    Example::

        handle = apply_plan(model, "plan.json", inputs=batch)
        model = torch.compile(model)  # optional, after the plan
    """
    if guard not in GUARDS:
        raise BadInput(f"guard={guard!r} is unknown; choose one of {', '.join(map(repr, GUARDS))}")
    if not isinstance(strict, bool):  # 'no' would be truthy: strict, not what was asked
        raise BadInput(f"strict must be True or False, got {strict!r}")
    plan = plan_for(plan_or_path if isinstance(plan_or_path, Plan) else Plan.load(plan_or_path), model)
    model = _unwrap_ddp(model)
    _check_model(model)
    plans = buckets.bucket_plans(plan)  # see NOTE [ Bucketed plans ]; [plan] without buckets
    bucket_modes = [buckets.modes(p) for p in plans]
    wanted = _wanted(plan, bucket_modes)
    modules = modules_by_plain_name(model)
    _check_fingerprint(buckets.matching(plans, inputs), model, inputs, [n for n in wanted if n not in modules],
                       strict=strict)
    check_fsdp_options(model, plan)

    already = user_checkpointed(model, modules)
    skipped: dict[str, str] = {}
    changes = _step_changes(model, plan)
    handle = AppliedPlan(checkpointed=[], skipped=skipped, step_changes=changes)
    handle._changes = install(model, changes)  # before the checkpoints: they wrap it
    offloads = _offload_store(model, plan, modules, handle)
    seen: set[int] = set()
    guard_mode = ModeGuard(plan.compile.backend if plan.compile else None)
    for name in wanted:
        module = modules.get(name)
        if module is None:
            skipped[name] = "not in the model"
            continue
        reason = overlap(name, already)
        if reason:
            skipped[name] = reason
            continue
        if id(module) in seen:  # one module registered under two names: wrapped once
            continue
        seen.add(id(module))
        _wrap(handle, name, module, bucket_modes, offloads, guard_mode)

    shape_guard = None
    if guard != "off" and plan.fingerprint.inputs:
        shape_guard = ShapeGuard(plan.fingerprint.inputs, guard, plan.predicted.peak_bytes, forward=model.forward)
    if len(plans) > 1:
        for fwd in handle._forwards.values():
            fwd.pinned = fwd.mode()
        handle._switch = buckets.switch_for(plans, handle._forwards, shape_guard, model.forward)
        handle._guard_hook = model.register_forward_pre_hook(handle._switch, with_kwargs=True)
    elif shape_guard is not None:
        handle._guard_hook = model.register_forward_pre_hook(shape_guard, with_kwargs=True)
    for fwd in handle._forwards.values():
        fwd.owner = handle  # NOTE [ Plans carried without a handle ], Rule 1
    _report(plan, handle, already)
    if handle._forwards:
        twice = TwiceGuard(model, modules, handle, reported=bool(already))  # _report warned about it: once
        handle._twice_hook = model.register_forward_pre_hook(twice)
    first = next((fwd.module for fwd in handle._forwards.values()), None)
    handle._hooks += [*step_guard.install(plan, model, first, guard),  # NOTE [ The step as the loop runs it ]
                      *filter(None, [keep_regions_apart(plan, first is not None)])]  # [ CSE across ... regions ]
    return handle


def _wanted(plan: Plan, bucket_modes: list[dict[str, Any]]) -> list[str]:
    """Every module some bucket checkpoints (largest bucket first), then the offloaded ones: one antichain.
    An offload plan is checked against this machine's free memory first (NOTE [ Offloaded units ])."""
    wanted = list(dict.fromkeys(name for m in reversed(bucket_modes) for name in _check_antichain(list(m))))
    if not plan.offload:
        return wanted
    from planner.act.offload import check_host_memory

    check_host_memory(plan)
    return _check_antichain([*wanted, *(u.fqn for u in plan.offload)])  # never with buckets (the schema says)


def _offload_store(model: nn.Module, plan: Plan, modules: dict[str, nn.Module], handle: AppliedPlan) -> dict[str, Any]:
    """``planner.act.offload.offload_store`` for an offload plan; nothing otherwise."""
    if not plan.offload:
        return {}
    from planner.act.offload import offload_store

    return offload_store(model, plan, modules, handle)


def _wrap(handle: AppliedPlan, name: str, module: nn.Module, bucket_modes: list[dict[str, Any]],
          offloads: dict[str, Any], mode_guard: ModeGuard) -> None:
    """Install the planned forward of ``module``: offloaded, or checkpointed as the buckets say."""
    if name in offloads:
        handle._forwards[name] = module.forward = offloads[name](module)
        handle.offloaded.append(name)
        return
    on, saved, keeps_written = bucket_modes[-1].get(name, buckets.OFF)  # the largest bucket's
    fwd = CheckpointedForward(module, module.__dict__.get("forward"), RegionCounts(), saved=saved,
                              keeps_written=keeps_written)
    fwd.on, fwd.mode_guard = on, mode_guard
    module.forward = fwd
    handle._forwards[name] = fwd
    full = any(m.get(name, buckets.OFF)[:2] == (True, None) for m in bucket_modes)
    (handle.checkpointed if full else handle.selective).append(name)


def _step_changes(model: nn.Module, plan: Plan) -> list[StepChange]:
    """The plan's step changes, and those the model needs that the plan lacks (a plan file written before
    remat made them, or one made by hand): checkpointing a layer that appends to a cache breaks its replay
    whatever the plan predicted, so they are made anyway, and the prediction is said to be for another step."""
    if not plan.checkpoints and not plan.selective:
        return list(plan.step_changes)
    have = {(c.kind, c.module) for c in plan.step_changes}
    missing = [c for c in find_step_changes(model) if (c.kind, c.module) not in have]
    if missing:
        logger.warning("remat: the plan was made without the step changes this model needs (%s); remat makes them "
                       "anyway, so the plan's prediction is for another step: re-plan with this version of remat",
                       ", ".join(f"{c.kind} on {c.module or 'the model'}" for c in missing))
    return [*plan.step_changes, *missing]


# NOTE [ Plans under FSDP2 and DDP ]
#
# A plan applies to the model before or after it is wrapped for data parallelism, by the same
# FQNs:
#   - FSDP2's ``fully_shard`` keeps the module tree and names. It swaps each wrapped module's
#     class for a subclass ``FSDP<Class>`` in place and its parameters for DTensors, whose
#     ``.shape`` is the global shape. The fingerprint check uses the original class name and
#     those global shapes, so a plan made on the plain model matches on every rank.
#   - ``DistributedDataParallel`` holds the model as ``.module`` (its FQNs gain a ``module.``
#     prefix); ``apply_plan`` looks through the wrapper and plans ``ddp.module``.
# With FSDP2 the checkpoint sits inside the FSDP unit, as in torchtitan: the unit's hooks are
# module hooks around ``__call__``, so the all-gather (pre-forward) and the reshard
# (post-forward) surround the region, and the recompute re-runs only ``forward``, without the
# hooks. It happens in the unit's backward, when autograd first unpacks a tensor the region
# saved, and FSDP2's pre-backward hook, a hook on the unit's outputs, has by then all-gathered
# the parameters again: the gradient reaches an output (firing the hook) before autograd runs
# anything inside the unit. So the recompute reads unsharded parameters and nothing is
# all-gathered twice, whichever of ``apply_plan`` and ``fully_shard`` runs first. Regions must
# not contain an FSDP unit (its hooks would run inside the recompute); the default candidates,
# the repeated blocks and the modules around them, never do when each block is a unit.

def _unwrap_ddp(model: nn.Module) -> nn.Module:
    """``ddp.module`` for a ``DistributedDataParallel`` wrapper (see NOTE [ Plans under FSDP2 and DDP ])."""
    ddp = getattr(nn.parallel, "DistributedDataParallel", None)
    return model.module if ddp is not None and isinstance(model, ddp) else model


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise BadInput(f"apply_plan needs a torch.nn.Module, got a {type(model).__name__}")
    if compiled_module(model) is not None:
        raise BadInput("apply_plan got a torch.compile'd model; apply the plan to the model first, then "
                       "compile: `apply_plan(model, plan); model = torch.compile(model)`")
    if lazy := lazy_modules(model):  # NOTE [ Lazy modules ]
        raise BadInput(f"lazy module {lazy[0]!r} has no parameters yet: run the model once on a batch (under "
                       f"torch.no_grad()) before apply_plan, as lazy modules need before an optimizer is made")
    carrying = planned_modules(model)
    if carrying:
        raise PlanAlreadyApplied(
            f"the model already carries a remat plan ({len(carrying)} modules checkpointed, e.g. "
            f"{carrying[0] or '<root>'!r}); call .remove() on the handle apply_plan returned before applying another, or "
            f"planner.remove_plan(model) for a model copied or loaded with its plan")


def compiled_module(model: Any) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper compiles (``_orig_mod``); None for any other object."""
    inner = getattr(model, "_orig_mod", None)
    return inner if type(model).__name__ == "OptimizedModule" and isinstance(inner, nn.Module) else None


def planned_modules(model: nn.Module) -> list[str]:
    """FQNs ('' for the root) of the modules that carry a remat plan's checkpointed forward."""
    return [name for name, m in model.named_modules()
            if getattr(m.__dict__.get("forward"), "_remat_forward", False)]


def _check_antichain(names: list[str]) -> list[str]:
    for a in names:
        for b in names:
            if a != b and (a == "" or b.startswith(a + ".")):
                raise BadInput(f"the plan checkpoints both {a or '<root>'!r} and its submodule {b!r}; "
                               f"checkpoint regions must not nest: re-create the plan")
    return names


def _check_fingerprint(plan: Plan, model: nn.Module, inputs: Any, missing: list[str], *, strict: bool) -> None:
    diffs = [f"checkpoint {name!r} is not a module of the model" for name in missing]
    diffs += model_differences(plan.fingerprint, model, inputs)
    if not diffs:
        return
    if strict:
        raise PlanMismatch.listing("the plan was made for another model or input shapes", diffs,
                                   "re-plan for this model, or pass strict=False to apply the modules that exist")
    listing = "\n  ".join(diffs)
    warnings.warn(f"remat: the plan does not match the model (applying what matches):\n  {listing}",
                  stacklevel=3)


def _report(plan: Plan, handle: AppliedPlan, already: dict[str, str]) -> None:
    user_skips = {n: r for n, r in handle.skipped.items() if r != "not in the model"}
    if already:  # NOTE [ Checkpointed twice ]: one warning, every module the user checkpoints
        left = (f"; {len(user_skips)} planned module(s) left to it, not checkpointed twice: "
                + ", ".join(user_skips)) if user_skips else ""
        warnings.warn(f"remat: the model already checkpoints {len(already)} module(s) itself ({listing(already)})"
                      f"{left}; the plan's predicted peak and recompute assume only its own checkpoints. "
                      f"{TWICE_FIX}", stacklevel=3)
    p = plan.predicted
    logger.info(
        "checkpointed %d/%d planned modules (%d op by op)%s; predicted peak %s (budget %s), recompute +%.1f ms/step",
        len(handle.checkpointed) + len(handle.selective), len(plan.checkpoints) + len(plan.selective),
        len(handle.selective),
        (f", skipped {len(handle.skipped)}: {', '.join(handle.skipped)}" if handle.skipped else "")
        + (f", {len(plan.buckets)} buckets (the largest's figures follow)" if plan.buckets else ""),
        format_bytes(p.peak_bytes), format_bytes(plan.budget_bytes), p.recompute_ms,
    )


__all__ = ["AppliedPlan", "apply_plan", "CheckpointedForward", "compiled_module", "GUARDS", "logger", "PlanAlreadyApplied",
           "planned_modules", "RegionCounts", "TWICE_FIX", "TwiceGuard"]
