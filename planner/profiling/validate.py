"""Measure what checkpointing frees instead of assuming it: the profiler's validation step.

Example::

    prof.retained, prof.excluded, prof.region_state_bytes = validate(model, inputs, prof, loss_fn=loss_fn,
                                                                     amp=None, dev=dev)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from planner.errors import ProfileError
from planner.model.schema import ExcludedUnit, Profile, RetainedBytes
from planner.profiling.units import io_tensors
from planner.profiling.rng import seed_all

RETAINED_MIN_BYTES = 4096
"""Smaller differences are not reported as retained: the CPU tracker counts exact bytes, and
CUDA rounds each storage to 512 bytes, so a few KiB is below anything a cache or an
attribute holds."""


VALIDATION_SEED = 1234
"""Every generator is seeded with this before the validation step, so it draws the same numbers each time."""


class Validation(NamedTuple):
    """What the validation step measured (NOTE [ Validation step ])."""

    retained: list[RetainedBytes]
    excluded: list[ExcludedUnit]
    region_state_bytes: int
    """Device bytes every checkpointed region keeps for its replay (the RNG state), whatever the unit."""
    checkpointed_windows: dict[str, list[int]]
    """Leaf unit id -> [live bytes at its forward window's start, its peak], every candidate checkpointed."""


# NOTE [ Validation step ]
#
# The cost model assumes a checkpointed unit keeps nothing of its own (NOTE [ Peak-memory
# model ]). That is false when something outside the region still references the tensors
# the unit creates: a cache, an attribute set in forward (``self.attn = probs``), a hook
# that stores outputs, an extra output kept by the caller. And recomputing a unit is unsafe
# when it changes state (a counter, a buffer updated in place) or saves other tensors when
# replayed (``CheckpointError``). So after profiling, ``validate`` runs one more step on the
# same device, forward and backward, with every top-level candidate checkpointed (as
# ``apply_plan`` does it), under the live-bytes tracker. Each storage allocated while a
# checkpointed unit c runs its forward is attributed to c. When backward starts (the model's
# output already dropped, see ``planner.profiling.measure.make_step``), the storages still alive that
# were allocated inside c and are not c's outputs are what checkpointing c did not free:
# c's *retained bytes* r(c) (kept when over ``RETAINED_MIN_BYTES``). On the CPU every region also
# keeps the RNG state for its replay (``_rng_state_bytes``): ``Profile.region_state_bytes``, the
# same for every unit, so it is one figure and not a line per unit. Outputs flow on as the
# inputs of later units, which the cost model already counts. The cost model counts r(c) as
# a tensor c keeps when checkpointed, like its inputs (see "Retained bytes" in the NOTE [
# Peak-memory model ]); ``remat verify`` then compares its prediction with the measured step.
# A unit whose replay raises, or changes a buffer, a parameter or a plain-number attribute of
# its modules, or whose forward writes one of its inputs in place (``nn.Dropout(inplace=True)``
# as a candidate of its own: the region keeps that input to replay from, and autograd's version
# check fails in backward), is excluded from every plan with the reason (``Profile.excluded``,
# shown by ``remat plan`` and ``remat show``); the step is re-run without it. BatchNorm running
# statistics are restored by the applier (NOTE [ BatchNorm under recomputation ]) and are not a
# reason.

def validate(model: nn.Module, inputs: Any, prof: Profile, *, loss_fn: Callable[[Any], Any] | None,
             amp: str | None, dev: torch.device) -> Validation:
    """Retained bytes per candidate and the candidates whose recompute is unsafe (NOTE [ Validation step ])."""
    from planner.model.graph import build_graph

    g = build_graph(prof)
    cands = sorted((n for n, a in g.nodes(data=True) if a["parent"] is None), key=lambda n: g.nodes[n]["order"])
    fqns = list(dict.fromkeys(g.nodes[n]["fqn"] for n in cands))
    excluded: dict[str, str] = {}
    for _ in range(len(fqns) + 1):
        chosen = [f for f in fqns if f not in excluded]
        run = _checkpointed_step(model, inputs, set(cands), chosen, loss_fn=loss_fn, amp=amp, dev=dev,
                                 leaves=_window_leaves(g, model))
        excluded.update(run.writes_inputs)
        if run.failed is None:
            excluded.update(run.mutated)
            break
        if run.failed[0]:
            excluded[run.failed[0]] = run.failed[1]
    else:
        raise ProfileError("the validation step kept failing with every candidate excluded; please report this")
    retained = [RetainedBytes(unit=n, nbytes=run.retained[n]) for n in cands
                if g.nodes[n]["fqn"] in chosen and g.nodes[n]["fqn"] not in excluded
                and run.retained.get(n, 0) > RETAINED_MIN_BYTES]
    return Validation(retained, [ExcludedUnit(module=f, reason=r) for f, r in excluded.items()],
                      _rng_state_bytes(dev), run.windows if not excluded else {})


def _window_leaves(g: Any, model: nn.Module) -> set[str]:
    """The leaves whose forward windows the checkpointed step records: none when a module already has a
    forward of its own (another wrapper), which the step does not checkpoint (NOTE [ Checkpointed forward
    windows ] in solvers/checkpointed.py)."""
    if any("forward" in m.__dict__ for m in model.modules()):
        return set()
    return {g.nodes[n]["fqn"] for n in g.graph["leaves"]}


def _rng_state_bytes(dev: torch.device) -> int:
    """Device bytes of the RNG state a checkpointed region keeps until its backward (preserve_rng_state=True).

    It is made outside the dispatcher, so the tracker does not see it: on the CPU it is the
    CPU generator's state (5056 bytes in torch 2.x, docs/benchmarks.md); on CUDA both states
    live in host memory and cost the device nothing.
    """
    return torch.get_rng_state().nbytes if dev.type == "cpu" else 0


# ----------------------------------------------------------------------------- one step


@dataclass
class _Run:
    retained: dict[str, int] = field(default_factory=dict)
    """Unit id -> bytes allocated in its forward, not its outputs, still alive when backward starts."""
    failed: tuple[str, str] | None = None
    """(module FQN, reason) when a replay raised."""
    mutated: dict[str, str] = field(default_factory=dict)
    """Module FQN -> what its replay changed."""
    writes_inputs: dict[str, str] = field(default_factory=dict)
    """Module FQN -> why: its forward wrote one of its inputs in place."""
    phase: str = "forward"
    replaying: str | None = None
    windows: dict[str, list[int]] = field(default_factory=dict)
    """Leaf unit id -> [live bytes at its forward window's start, its peak] (NOTE [ Checkpointed forward
    windows ] in solvers/checkpointed.py)."""


class _Watch:
    """The forward a validation checkpoint region runs: notes which region replays, and what it changes."""

    def __init__(self, module: nn.Module, name: str, run: _Run):
        self.module, self.name, self.run = module, name, run
        self.inner = type(module).forward.__get__(module, type(module))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.run.phase != "backward":
            inputs = list(io_tensors((args, kwargs)))
            versions = [t._version for t in inputs]
            out = self.inner(*args, **kwargs)
            if any(t._version != v for t, v in zip(inputs, versions)):
                self.run.writes_inputs.setdefault(
                    self.name, "it writes one of its inputs in place (an in-place dropout or activation, say): "
                               "a checkpointed region keeps its inputs to replay from them, so the replay would "
                               "read the written values")
            return out
        self.run.replaying = self.name
        before = _state(self.module)
        try:
            return self.inner(*args, **kwargs)
        finally:  # also when checkpoint stops the replay early, which it does by raising
            changed = _changes(before, _state(self.module))
            if changed:
                self.run.mutated.setdefault(self.name, f"recomputing it changes {changed} a second time per step")


def _checkpointed_step(model: nn.Module, inputs: Any, units: set[str], checkpointed: list[str], *,
                       loss_fn: Any, amp: str | None, dev: torch.device, leaves: set[str] = frozenset()) -> _Run:
    from planner.profiling.measure import make_step
    from planner.profiling.profiler import restoring_model
    from planner.profiling.tracker import LiveBytesTracker, iter_tensors

    run = _Run()
    modules = dict(model.named_modules())
    wanted = {id(modules[f]) for f in checkpointed}
    owner: dict[int, str] = {}  # storage serial -> unit id whose checkpointed forward allocated it
    outputs: set[int] = set()  # serials of the checkpointed units' outputs
    running: list[str] = []
    calls: dict[int, int] = {}

    def allocated(_func: Any, _inputs: Any, new: list) -> None:
        if running:
            for e in new:
                owner[e.serial] = running[-1]

    tracker = LiveBytesTracker(device_type=dev.type, round_to=512 if dev.type == "cuda" else 1, observer=allocated)

    def started(module: nn.Module, _args: Any, name: str) -> None:
        if run.phase == "forward" and id(module) in wanted and not running:
            uid = _call_id(calls, module, name)
            running.append(uid if uid in units else "")

    def ended(module: nn.Module, _args: Any, out: Any) -> None:
        if run.phase == "forward" and id(module) in wanted and running:
            running.pop()
            outputs.update(e.serial for e in map(tracker.entry, io_tensors(out)) if e is not None)

    def mark(name: str, _value: Any = None) -> None:
        window.mark(name)
        if name == "backward_start":
            run.phase = "backward"
            for e in tracker.live_entries():
                uid = owner.get(e.serial)
                if uid and e.serial not in outputs:
                    run.retained[uid] = run.retained.get(uid, 0) + e.nbytes
        elif name == "backward_end":
            run.phase = "done"

    with restoring_model(model, dev), _checkpointed(modules, checkpointed, run), contextlib.ExitStack() as hooks:
        window = _Windows(run, tracker, leaves, modules, hooks)
        for name, m in modules.items():
            if id(m) in wanted:
                hooks.callback(m.register_forward_pre_hook(lambda mod, a, name=name: started(mod, a, name)).remove)
                hooks.callback(m.register_forward_hook(ended).remove)
        step = make_step(model, inputs, loss_fn=loss_fn, optimizer=None, amp=amp)
        model.zero_grad(set_to_none=True)
        for static in (model.parameters(), model.buffers(), iter_tensors(inputs)):
            tracker.register_static(static)
        seed_all(VALIDATION_SEED)  # restoring_model puts every generator back (NOTE [ Randomness outside torch ])
        try:
            with tracker:
                step(mark)
        except ProfileError as e:
            _failed(run, e)
    return run


class _Windows:
    """Each leaf's forward window in the checkpointed step: live bytes at its start and its peak (NOTE [
    Checkpointed forward windows ] in solvers/checkpointed.py). ``leaves``: their module FQNs."""

    def __init__(self, run: _Run, tracker: Any, leaves: Any, modules: dict[str, nn.Module],
                 hooks: contextlib.ExitStack):
        self.run, self.tracker = run, tracker
        self.calls: dict[int, int] = {}
        self.start = 0
        for name, m in modules.items():
            if name in leaves:
                hooks.callback(m.register_forward_hook(lambda mod, a, o, name=name: self.end(mod, name)).remove)

    def mark(self, name: str) -> None:
        if name == "step_start":  # the first window starts with the step
            self.tracker.mark()
            self.start = self.tracker.live_bytes

    def end(self, module: nn.Module, name: str) -> None:
        if self.run.phase != "forward":
            return
        live = self.tracker.live_bytes
        self.run.windows[_call_id(self.calls, module, name)] = [self.start, max(self.tracker.mark(), live)]
        self.start = live


def _call_id(calls: dict[int, int], module: nn.Module, name: str) -> str:
    """The unit id of this call of ``module`` (NOTE [ Units ]), counting its calls in ``calls``."""
    k = calls.get(id(module), 0)
    calls[id(module)] = k + 1
    return (name or "<root>") + (f"#{k}" if k else "")


def _failed(run: _Run, e: ProfileError) -> None:
    """Note in ``run`` why the checkpointed step failed; re-raise ``e`` when the failure is not a recompute's."""
    if run.writes_inputs and run.phase == "backward":  # autograd's version check; excluded by the caller
        run.failed = ("", str(e))
        return
    if run.phase != "backward" or run.replaying is None:
        raise e
    cause = e.__cause__ or e
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    run.failed = (run.replaying, f"its recomputation raised {type(cause).__name__}: {first}")


@contextlib.contextmanager
def _checkpointed(modules: dict[str, nn.Module], names: list[str], run: _Run) -> Iterator[None]:
    from planner.act.applier import RegionCounts, CheckpointedForward

    done: list[nn.Module] = []
    try:
        for name in names:
            m = modules[name]
            if "forward" in m.__dict__:  # another wrapper (e.g. a step change): validate through it
                continue
            m.forward = CheckpointedForward(m, _Watch(m, name, run), RegionCounts())
            done.append(m)
        yield
    finally:
        for m in done:
            del m.forward


def _state(module: nn.Module) -> dict[str, Any]:
    """What a replay must not change: parameter and buffer versions (BatchNorm statistics aside),
    and plain-number attributes."""
    out: dict[str, Any] = {}
    for prefix, m in module.named_modules():
        norm = isinstance(m, nn.modules.batchnorm._NormBase)
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if not (norm and n in ("running_mean", "running_var", "num_batches_tracked")):
                out[f"{prefix}.{n}".lstrip(".")] = t._version
        for n, v in vars(m).items():
            if isinstance(v, (bool, int, float)) and n not in ("training",):
                out[f"{prefix}.{n}".lstrip(".")] = v
    return out


def _changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    names = [k for k in after if before.get(k) != after[k]]
    return ", ".join(repr(n) for n in names[:3]) + (" ..." if len(names) > 3 else "")


__all__ = ["RETAINED_MIN_BYTES", "validate", "Validation", "VALIDATION_SEED"]
