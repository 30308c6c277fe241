"""What to measure and how to plan, each as one frozen object carried whole: ``StepSpec``, ``SolveSpec``.

``planner.profile`` takes a ``StepSpec`` (the training step and where it runs), ``planner.plan``
a ``StepSpec`` and a ``SolveSpec`` (how the solver plans); the CLI builds both from its typed
options (``planner.cli.options``). Torch-free.

Example::

    from planner.spec import SolveSpec, StepSpec
    from planner.model.schema import Recipe

    step = StepSpec(device="cuda", device_memory_bytes=16 << 30, recipe=Recipe(amp="bf16", grad_accum=4))
    plan = planner.plan(model, "12GB", inputs=batch, step=step, solve=SolveSpec(solver="ilp", time_limit_s=30))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from planner.errors import BadInput
from planner.model.schema import Recipe
from planner.options import check_count, parse_headroom

ProfilingPath = Literal["plain", "meta", "capped", "memory-safe"]
"""How ``planner.profile`` measures a step (``profiling_path``): as it runs; on fake tensors; in a
child process whose address space is capped (a CPU with ``device_memory_bytes``); under
checkpointing when it does not fit (NOTE [ Memory-safe profile ])."""


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """The training step to profile and where it runs. Every field has the default of a plain loop."""

    device: Any = "auto"
    """'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:1', a ``torch.device``, or 'meta':
    nothing runs, fake tensors give the bytes and a roofline of ``target`` the times."""
    target: str | None = None
    """A device spec name (``remat devices``): with device 'meta' the device the times are modelled
    for (required there); elsewhere refused."""
    device_memory_bytes: int | None = None
    """Cap the device at this many bytes while profiling: a step that does not fit is measured under
    checkpointing (NOTE [ Memory-safe profile ]); on the CPU the cap is enforced in a child process,
    which needs a model file (``planner.load_model_file``). None: no cap."""
    optimizer: Any = "adamw"
    """The optimizer spec: 'adamw', 'adam', 'sgd' (momentum 0.9), 'none', any torch.optim class by name
    with its settings ('sgd:momentum=0', 'RMSprop:centered=True'), 'adafactor' (transformers') or the
    dotted path of an Optimizer subclass (NOTE [ Optimizer specs ] in planner/optimizers.py); in Python
    also an Optimizer class or ``functools.partial(cls, **settings)``. Kept as the canonical spec string."""
    recipe: Recipe = field(default_factory=Recipe)
    """The step: gradient accumulation, zero_grad, amp (bf16/fp16 autocast), clipping, the
    optimizer's implementation (``schema.Recipe``); None is read as the plain loop."""
    steps: int = 3
    """Timing steps; unit times are medians over them (NOTE [ Unit costs ])."""
    warmup_steps: int = 1
    """Plain steps before measuring (they create the optimizer state)."""
    threads: int | None = None
    """torch's intra-op threads while profiling (restored after); None: as set. On the CPU, 1 times
    units by the thread's CPU time, which load from other processes does not change."""
    loss_fn: Callable[[Any], Any] | None = None
    """``loss_fn(output)`` or ``loss_fn(output, batch)`` -> scalar (``planner.profiling.model_file.loss_arity``);
    None: ``output.loss``, else the sum of the float outputs."""
    compile: str | None = None
    """A ``torch.compile`` backend ('inductor'): the step as ``torch.compile(model)`` runs it, its
    partitioner's saves and compiled times (NOTE [ Compiled profile ] in planner/profiling/compiled.py);
    None: eager."""

    def __post_init__(self) -> None:
        if self.recipe is None:  # None is the plain loop, as before there was a spec
            object.__setattr__(self, "recipe", Recipe())
        elif not isinstance(self.recipe, Recipe):
            raise BadInput(f"recipe must be a planner.model.schema.Recipe (or None: the plain loop), got "
                           f"{type(self.recipe).__name__}")
        for name in ("steps", "warmup_steps") + (("threads",) if self.threads is not None else ()):
            check_count(name, getattr(self, name))
        from planner.options import parse_optimizer

        object.__setattr__(self, "optimizer", parse_optimizer(self.optimizer))  # canonical: NOTE [ Optimizer specs ]
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise BadInput(f"loss_fn must be callable (loss_fn(output) or loss_fn(output, batch)), got "
                           f"{type(self.loss_fn).__name__}")

    def replace(self, **changes: Any) -> StepSpec:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class SolveSpec:
    """How to plan on a profile: the solver, its candidates, its limits and the ranks."""

    solver: str = "auto"
    """'auto' (the DP on chains, the ILP otherwise), 'dp', 'ilp', 'sqrt', 'sqrt-greedy', 'all',
    'every-2' or 'none' (``solvers.available()``)."""
    granularity: int = 0
    """Levels below the default candidates (repeated blocks and the modules around them)."""
    time_limit_s: float | None = 60.0
    """Wall-clock limit of the solver; None: none."""
    world_size: int = 1
    """Ranks the plan is for (NOTE [ Per-rank memory ])."""
    sharding: str = "none"
    """'none', 'ddp' or 'fsdp' (FSDP2)."""
    headroom: float | None = None
    """Fraction of the budget kept free (0.02, or '2%' as the CLI takes it); None or 'auto': from how the profile
    was made (NOTE [ Headroom from evidence ])."""
    selective: bool = True
    """Let the solver checkpoint units op by op too; False: whole modules only."""
    offload: bool = False
    """Let each unit also move its saved tensors to host memory (NOTE [ Peak-memory model ], Rule 10);
    the ILP chooses keep, recompute or offload together."""
    host_memory: int | str | None = None
    """With ``offload``: the host memory offloaded tensors may take (bytes or '64GB'); None: 80% of this
    machine's available memory (required for a meta profile)."""

    def __post_init__(self) -> None:
        limit = self.time_limit_s
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            raise BadInput(f"time_limit_s must be a positive number of seconds (None: no limit), got {limit!r}")
        if limit == math.inf:  # as HiGHS and CBC read it: no limit
            object.__setattr__(self, "time_limit_s", None)
        check_count("granularity", self.granularity)
        check_count("world_size", self.world_size)
        for name in ("selective", "offload"):
            if not isinstance(getattr(self, name), bool):
                raise BadInput(f"{name} must be True or False, got {getattr(self, name)!r}")
        object.__setattr__(self, "headroom", parse_headroom(self.headroom))

    def replace(self, **changes: Any) -> SolveSpec:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


STEP_FIELDS = frozenset(f.name for f in dataclasses.fields(StepSpec))
SOLVE_FIELDS = frozenset(f.name for f in dataclasses.fields(SolveSpec))


def step_spec(step: StepSpec | None = None, **fields: Any) -> StepSpec:
    """``step`` (default ``StepSpec()``) with ``fields`` replaced; ``BadInput`` naming an unknown one."""
    return _spec(StepSpec, STEP_FIELDS, step, fields)


def solve_spec(solve: SolveSpec | None = None, **fields: Any) -> SolveSpec:
    """``solve`` (default ``SolveSpec()``) with ``fields`` replaced; ``BadInput`` naming an unknown one."""
    return _spec(SolveSpec, SOLVE_FIELDS, solve, fields)


def _spec(cls: type, names: frozenset[str], base: Any, fields: dict[str, Any]) -> Any:
    unknown = sorted(set(fields) - names)
    if unknown:
        hint = " (amp is a field of the recipe: recipe=Recipe(amp=...))" if "amp" in unknown else ""
        raise BadInput(f"unknown {cls.__name__} field(s) {', '.join(unknown)}{hint}; "
                       f"the fields are {', '.join(sorted(names))}")
    if base is not None and not isinstance(base, cls):
        raise BadInput(f"expected a {cls.__name__}, got {type(base).__name__}")
    return dataclasses.replace(base or cls(), **fields)


def profiling_path(step: StepSpec, device_type: str) -> ProfilingPath:
    """How ``planner.profile`` measures ``step`` on a device of ``device_type`` ('cpu', 'cuda', 'meta').

    The memory-safe profile measures the plain step (with amp) only, so another recipe is profiled
    as it runs (and a cap on it is refused, by ``planner.profile``).
    """
    if device_type == "meta":
        return "meta"
    if step.compile is not None:  # the compiled step is measured as it is (refused with a cap)
        return "plain"
    if step.device_memory_bytes is not None and device_type == "cpu":
        return "capped"
    return "memory-safe" if is_plain(step.recipe) else "plain"


def is_plain(recipe: Recipe) -> bool:
    """True for the plain loop, amp aside: what the memory-safe profile measures."""
    return recipe == Recipe(amp=recipe.amp)


__all__ = ["ProfilingPath", "SOLVE_FIELDS", "STEP_FIELDS", "SolveSpec", "StepSpec", "is_plain", "profiling_path",
           "solve_spec", "step_spec"]
