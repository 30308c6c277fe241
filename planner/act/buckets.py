"""Bucketed plans: one plan per input shape in one file, and the switch that picks one per batch.

Example::

    plans = [planner.plan(model, "2GB", inputs=batch) for batch in (short, mid, long)]
    plan = combine(plans)                    # or planner.plan(model, "2GB", buckets=[short, mid, long])
    handle = apply_plan(model, plan)         # each forward runs the smallest bucket that holds its batch
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from planner.errors import BadInput
from planner.model.fingerprint import input_tensors
from planner.model.schema import BUCKETED_PLAN_VERSION, Fingerprint, Plan, PlanBucket, TensorSig

# NOTE [ Bucketed plans ]
#
# A job sees batches of many shapes (dynamic padding, packing up to a maximum, a curriculum on
# length). A plan made at the longest shape makes every shorter batch recompute what it could
# have kept; a plan made at a typical shape lets the long batch run out of memory. A bucketed
# plan holds one plan per profiled shape, all under the same budget (``Plan.buckets``, smallest
# first); the plan's own fields are its largest bucket's.
# Rule 1. Choosing. At the start of each training forward, a forward pre-hook on the model
#   (``BucketSwitch``) picks the first bucket, smallest first, whose every input is at least
#   as large as the batch's in every dimension. A batch larger than every bucket runs the
#   largest bucket's checkpoints, and the runtime shape guard reports it as it does for a
#   single plan (see NOTE [ Runtime shape guard ]), as it reports any batch lacking an input the
#   plan names. Inputs are named as the fingerprint names them; the call is bound to forward's signature, so positional and keyword calls both match.
# Rule 2. Switching. ``apply_plan`` wraps the union of the modules any bucket checkpoints, each
#   with one ``CheckpointedForward``; a bucket is a mode per wrapper (off, full, or its selective
#   policy), and the switch sets the modes that change. A region reads its mode when it is
#   called, and its recompute replays what that call ran (the policy is bound into the call's
#   ``context_fn``), so a backward that runs after the next batch has switched is still exact.
# Rule 3. torch.compile. A compiled graph cannot switch per batch: the hook is skipped while
#   dynamo traces, and every wrapper reads its largest bucket's mode there (``CheckpointedForward
#   .pinned``), so a compiled model runs the plan of the largest shape for every batch: safe in
#   memory for every batch the buckets hold, with the single plan's recompute.
# Why a pre-hook on the model and not a check in each region: one decision per batch, made
#   before any region runs, so all regions of a forward run the same bucket.

Mode = tuple[bool, "frozenset[tuple[str, int]] | None", bool]
"""A wrapper's mode in one bucket: (checkpointed, the selective policy's kept op calls or None for
the whole module, the policy keeps outputs written in place)."""
OFF: Mode = (False, None, False)


def combine(plans: Sequence[Plan], shapes: Sequence[dict[str, int]] | None = None) -> Plan:
    """One bucketed plan from plans of one model and budget made for different input shapes.

    ``shapes``: the ``example_inputs()`` keyword arguments of each plan's batch (e.g.
    ``{"seq_len": 128}``), kept in the file for ``remat verify``. One plan is returned as it is.
    Raises ``BadInput`` when the plans are for other models, budgets or steps, or two are for one shape.
    """
    if not plans:
        raise BadInput("a bucketed plan needs at least one plan")
    shapes = list(shapes) if shapes is not None else [{} for _ in plans]
    if len(shapes) != len(plans):
        raise BadInput(f"{len(plans)} plans but {len(shapes)} shapes; give one shape per plan")
    if len(plans) == 1:
        return plans[0]
    order = sorted(range(len(plans)), key=lambda i: (_size(plans[i].fingerprint.inputs), plans[i].predicted.peak_bytes))
    plans, shapes = [plans[i] for i in order], [shapes[i] for i in order]
    _check_alike(plans)
    buckets = [PlanBucket(inputs=p.fingerprint.inputs, shape=dict(s), checkpoints=p.checkpoints,
                          checkpoint_units=p.checkpoint_units, selective=p.selective, solver=p.solver,
                          predicted=p.predicted) for p, s in zip(plans, shapes)]
    return plans[-1].model_copy(update={"buckets": buckets, "schema_version": BUCKETED_PLAN_VERSION})


def bucket_plans(plan: Plan) -> list[Plan]:
    """Each bucket of ``plan`` as a plan for its one shape, smallest first; ``[plan]`` without buckets."""
    if not plan.buckets:
        return [plan]
    out = []
    for b in plan.buckets:
        fp = plan.fingerprint.model_copy(update={"inputs": b.inputs})
        out.append(plan.model_copy(update={
            "fingerprint": fp, "fingerprint_digest": fp.digest(), "checkpoints": b.checkpoints,
            "checkpoint_units": b.checkpoint_units, "selective": b.selective, "solver": b.solver,
            "predicted": b.predicted, "buckets": [], "schema_version": 3}))
    return out


def describe(bucket: PlanBucket) -> str:
    """``seq_len 128, batch 8``, or the inputs' shapes: how a bucket is named to people."""
    if bucket.shape:
        return ", ".join(f"{k} {v}" for k, v in bucket.shape.items())
    return ", ".join(f"{s.name} {'x'.join(map(str, s.shape))}" for s in bucket.inputs)


def modes(plan: Plan) -> dict[str, Mode]:
    """FQN -> mode of every module ``plan`` (one bucket, or a plan without buckets) checkpoints."""
    out: dict[str, Mode] = {name: (True, None, False) for name in plan.checkpoints}
    for r in plan.selective:
        out[r.fqn] = (True, frozenset((o.op, o.index) for o in r.save), r.keeps_written)
    return out


def matching(plans: list[Plan], inputs: Any) -> Plan:
    """The bucket plan made for exactly the shapes of ``inputs`` (the largest when none is; None inputs too)."""
    if inputs is not None and len(plans) > 1:
        given = {name: list(t.shape) for name, t in input_tensors(inputs)}
        for p in plans:
            if all(given.get(s.name) == s.shape for s in p.fingerprint.inputs):
                return p
    return plans[-1]


def _size(inputs: list[TensorSig]) -> int:
    return sum(math.prod(s.shape) for s in inputs)


def _check_alike(plans: list[Plan]) -> None:
    """Buckets of one plan share the model, the budget and the step; their shapes differ."""
    first = plans[0]
    same = ("budget_bytes", "headroom_bytes", "recipe", "optimizer", "world_size", "sharding", "device", "dtype")
    for p in plans[1:]:
        fp, fq = _without_inputs(first.fingerprint), _without_inputs(p.fingerprint)
        if fp != fq:
            raise BadInput("the plans are for different models (" + "; ".join(fp.differences(fq)[:3])
                           + "): a bucketed plan holds plans of one model")
        for name in same:
            if getattr(p, name) != getattr(first, name):
                raise BadInput(f"the plans differ in {name} ({getattr(first, name)!r} and {getattr(p, name)!r}): "
                               f"the buckets of one plan share the budget and the training step")
        if sorted(s.name for s in p.fingerprint.inputs) != sorted(s.name for s in first.fingerprint.inputs):
            raise BadInput("the plans' batches have different inputs: every bucket needs the same input names")
    seen = set()
    for p in plans:
        key = tuple(sorted((s.name, tuple(s.shape)) for s in p.fingerprint.inputs))
        if key in seen:
            raise BadInput(f"two plans are for the same input shapes ({describe_inputs(p.fingerprint.inputs)}); "
                           f"give each shape once")
        seen.add(key)


def describe_inputs(inputs: list[TensorSig]) -> str:
    return ", ".join(f"{s.name} {list(s.shape)}" for s in inputs)


def _without_inputs(fp: Fingerprint) -> Fingerprint:
    return fp.model_copy(update={"inputs": []})


# ----------------------------------------------------------------------------- the switch


class BucketSwitch:
    """The forward pre-hook that puts each batch's bucket in force; see NOTE [ Bucketed plans ].

    Marked ``_remat_hook`` for ``planner.remove_plan`` (NOTE [ Plans carried without a handle ]).

    Args:
        buckets: per bucket, smallest first: its input shapes by name, and (module, mode) for every wrapped module.
        guard: the runtime shape guard of the largest bucket, checking a batch no bucket holds, and a planned
            input missing from any batch; or None.
        forward: the model's forward, whose signature names positional arguments.
    """

    _remat_hook = True

    def __init__(self, buckets: list[tuple[dict[str, tuple[int, ...]], list[tuple[nn.Module, Mode]]]],
                 guard: Any, forward: Any):
        self.shapes = [shapes for shapes, _ in buckets]
        self.settings = [settings for _, settings in buckets]
        self.guard = guard
        self.current = len(buckets) - 1  # the wrappers start in the largest bucket's modes
        self.switches = 0
        try:
            self.signature: inspect.Signature | None = inspect.signature(forward)
        except (TypeError, ValueError):
            self.signature = None
        self.positions = _positions(self.signature)
        self.positional = list(self.positions)  # parameter names by position
        names = dict.fromkeys(name for shapes in self.shapes for name in shapes)
        self.paths = [(name, name.split(".")) for name in names]  # nested inputs: '1.0', 'past.key'

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return
        index = self.choose(args, kwargs)
        if self.guard is not None:  # a larger batch when no bucket holds it; a missing input always
            self.guard.check(args, kwargs, shapes=index is None)
        if index is None:
            index = len(self.shapes) - 1
        if index != self.current:
            self.current = index
            self.switches += 1
            for wrapped, (on, saved, keeps_written) in self.settings[index]:
                fwd = wrapped.__dict__["forward"]  # not held here: a deep copy of the model maps modules only
                fwd.on, fwd.saved, fwd.keeps_written = on, saved, keeps_written

    def choose(self, args: tuple, kwargs: dict) -> int | None:
        """Index of the first bucket that holds the batch in every dimension; None: none does."""
        given = self.input_shapes(args, kwargs)
        for i, shapes in enumerate(self.shapes):
            if all(name not in given or _within(given[name], shape) for name, shape in shapes.items()):
                return i
        return None

    def input_shapes(self, args: tuple, kwargs: dict) -> dict[str, tuple[int, ...]]:
        """The shape of every input the buckets name that the call passes (named as in ``fingerprint``).

        Only a call that lacks a name (positional where the plan was made with keywords, or the
        other way round) is matched against forward's signature."""
        top: dict[str, Any] = {str(i): a for i, a in enumerate(args)}
        top.update(kwargs)
        if any(path[0] not in top for _, path in self.paths):
            top = self.named(args, kwargs)
        out = {}
        for name, path in self.paths:
            obj = top.get(path[0])
            for key in path[1:]:
                obj = _child(obj, key)
            if isinstance(obj, torch.Tensor):
                out[name] = tuple(obj.shape)
        return out

    def named(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The call's arguments by index and by key, and each under the other name forward's signature
        gives it (a positional argument by its parameter's name, a keyword argument by its position)."""
        given: dict[str, Any] = {str(i): a for i, a in enumerate(args)}
        given.update(kwargs)
        for name, a in zip(self.positional, args):
            given.setdefault(name, a)
        for key, a in kwargs.items():
            index = self.positions.get(key)
            if index is not None:
                given.setdefault(str(index), a)
        return given


def _positions(signature: inspect.Signature | None) -> dict[str, int]:
    """Name -> position ('0', '1', ... in a fingerprint) of forward's parameters that can be passed by
    position, up to ``*args``."""
    out: dict[str, int] = {}
    for i, p in enumerate(signature.parameters.values() if signature is not None else ()):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        out[p.name] = i
    return out


def _child(obj: Any, key: str) -> Any:
    """``obj[key]`` of a mapping, or ``obj[int(key)]`` of a tuple or list; None when absent."""
    if isinstance(obj, Mapping):
        return obj.get(key)
    if isinstance(obj, (tuple, list)) and key.isdigit() and int(key) < len(obj):
        return obj[int(key)]
    return None


def _within(actual: tuple[int, ...], planned: tuple[int, ...]) -> bool:
    """No more elements along any dimension (or in all, when the ranks differ) than planned."""
    if len(actual) != len(planned):
        return math.prod(actual) <= math.prod(planned)
    return all(a <= p for a, p in zip(actual, planned))


def switch_for(plans: list[Plan], wrappers: dict[str, Any], guard: Any, forward: Any) -> BucketSwitch:
    """The ``BucketSwitch`` for bucket plans ``plans`` (smallest first) over ``wrappers`` (FQN -> wrapper)."""
    buckets = []
    for p in plans:
        m = modes(p)
        shapes = {s.name: tuple(s.shape) for s in p.fingerprint.inputs}
        buckets.append((shapes, [(fwd.module, m.get(name, OFF)) for name, fwd in wrappers.items()]))
    return BucketSwitch(buckets, guard, forward)


__all__ = ["bucket_plans", "BucketSwitch", "combine", "describe", "describe_inputs", "matching", "Mode",
           "modes", "OFF", "switch_for"]
