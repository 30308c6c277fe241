"""Module calls while a training step runs (NOTE [ Units ]): the ``Recorder`` whose module and
gradient hooks stamp each call's forward and backward, the ``UnitCall`` it fills, and the timing
steps' ``StepTimes``. Shared by every profiling path.

Example::

    with Recorder(model) as rec:
        step(rec.mark)
    [u.id for u in rec.units]
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch.utils import _pytree as pytree
from typing_extensions import Self

from planner.model.schema import LOSS_ID, ROOT_ID


# NOTE [ Units ]
#
# A unit is one call of a module: the candidate for checkpointing. Its id is the module's
# FQN ('<root>' for the model itself), with '#k' appended for the k-th call (k >= 1) of the
# same module in the step (a shared block, a tied embedding). ``loss_fn`` runs as the
# pseudo-unit '<loss>'. Units are listed in the order their forward started; ``parent`` is
# the innermost unit running when the call started.
#
# Backward boundaries come from gradient hooks registered during the forward:
# ``bwd_start`` is when the gradient of the first of the unit's outputs is complete;
# ``bwd_end`` is when the gradients of all its inputs that require grad are complete (the
# last such hook to fire). A unit whose inputs need no gradient (an embedding of token ids,
# the first conv on images) ends its backward when the gradients of its parameters are
# complete, if its call is their first use in the step; otherwise ``bwd_end`` stays None.
# An input also consumed by a later sibling (q/k/v projections of one tensor) completes its
# gradient only after that sibling's backward, so the earlier sibling's ``bwd_end`` is late.

class UnitCall:
    """One module call while a step runs. ``fwd_*``/``bwd_*`` hold clock stamps or seqs."""

    __slots__ = (
        "bwd_before_replay",
        "bwd_end",
        "bwd_end_event",
        "bwd_start",
        "bwd_start_live",
        "call_index",
        "depth",
        "fqn",
        "fwd_end",
        "fwd_high",
        "fwd_start",
        "grad_output_ids",
        "has_input_grads",
        "id",
        "index",
        "input_bytes",
        "input_ids",
        "key",
        "last_pack_high",
        "last_pack_seq",
        "module_type",
        "output_bytes",
        "output_ids",
        "param_bytes",
        "parent",
    )

    def __init__(self, uid: str, fqn: str, call_index: int, module_type: str, parent: str | None,
                 depth: int, key: int | None, index: int):
        self.id, self.fqn, self.call_index, self.module_type = uid, fqn, call_index, module_type
        self.parent, self.depth, self.key, self.index = parent, depth, key, index
        self.fwd_start = self.fwd_end = self.bwd_start = self.bwd_end = None
        self.bwd_end_event: int | None = None
        self.has_input_grads = False
        self.input_ids: list[int] = []
        self.output_ids: list[int] = []
        self.grad_output_ids: list[int] | None = None
        """The outputs backward gives a gradient from outside the call (NOTE [ Outputs without a gradient ]
        in recording.py); None: not known."""
        self.input_bytes = self.output_bytes = self.param_bytes = 0
        self.last_pack_seq: int | None = None
        """Seq of the call's last pack as the innermost unit (NOTE [ The replay stops at the last save ], Rule 3)."""
        self.fwd_high: tuple[int, int] | None = None
        self.last_pack_high: int | None = None
        self.bwd_start_live: int | None = None
        self.bwd_before_replay: int | None = None
        """(live at its forward's start, most live since) and that most at its last pack, its own or a nested
        call's; live when its backward started, and above that when it first unpacked (NOTE [ What a replay
        allocates ] in solvers/replay.py)."""


@dataclass
class _Point:
    """One gradient that units listen to (see NOTE [ Gradient points ])."""

    ref: weakref.ref
    node: int | None
    """Sequence number of the tensor's grad_fn when hooked; it changes if modified in place."""
    units: list[UnitCall]


class _Handles:
    """Hooks removed together (NOTE [ Outputs written in place ])."""

    def __init__(self, *handles: Any):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Recorder:
    """Module-call bookkeeping shared by the timing and the memory step (see NOTE [ Units ]).

    Subclasses say what a point in time is (``_note``: a clock stamp, or a seq plus a
    timeline event) and may look at each unit's inputs and outputs.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.named = list(model.named_modules())
        self.names = {id(m): name for name, m in self.named}
        self.modules = {id(m): m for _, m in self.named}
        self.handles: list[Any] = []
        self.grad_handles: list[Any] = []
        self.reset()

    def reset(self) -> None:
        self._remove(self.grad_handles)
        self.units: list[UnitCall] = []
        self.stack: list[UnitCall] = []
        self.calls: dict[int, int] = {}
        self.first_use: dict[torch.nn.Parameter, int] = {}
        self.end_points: dict[int, _Point] = {}
        self.start_points: dict[int, _Point] = {}
        self.marks: dict[str, Any] = {}
        self.in_forward = False

    def __enter__(self) -> Self:
        try:
            for _, m in self.named:
                self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
                self.handles.append(m.register_forward_pre_hook(self._inputs, with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        except BaseException:
            self._remove(self.handles)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove(self.handles)
        self._remove(self.grad_handles)

    @staticmethod
    def _remove(handles: list[Any]) -> None:
        while handles:
            handles.pop().remove()

    # ------------------------------------------------------------- step marks

    def mark(self, name: str, value: Any = None) -> None:
        """The step's ``mark`` callback (``planner.profiling.measure.STEP_MARKS``)."""
        if name == "step_start":
            self.in_forward = True
            self.marks[name] = self._note(name, None)
        elif name == "loss_start":
            self._enter(None, LOSS_ID, LOSS_ID, "loss_fn", (value,), {})
        elif name == "forward_end":
            if self.stack and self.stack[-1].key is None:
                self._exit(self.stack[-1], (), {}, value)
            self.in_forward = False
            self.marks[name] = self._note(name, None)
        else:
            self.marks[name] = self._note(name, None)

    # ------------------------------------------------------------- module hooks

    # NOTE [ Inputs after pre-hooks ]
    # A unit starts (``_pre``, prepended) before the model's own forward pre-hooks run, so what they
    # allocate is the unit's; its inputs are taken by a second pre-hook, appended after them
    # (``_inputs``): what ``forward`` gets, which is what a checkpointed region keeps. A pre-hook
    # that replaces the arguments (``lambda m, args: (args[0] * 0.5,)``, a cast to the parameters'
    # dtype) made a tensor the unit was not recorded to take: checkpointing the unit kept it, and
    # the step was measured 2.4% above its prediction (one input's bytes, 32,768, unexplained).
    # Gradients of the inputs are still listened for on the arguments as the caller passed them.

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.in_forward:  # e.g. recomputation by the model's own checkpointing
            return
        fqn = self.names[id(module)]
        unit = self._enter(id(module), fqn or ROOT_ID, fqn, type(module).__name__, args, kwargs)
        for p in module.parameters(recurse=False):
            self.first_use.setdefault(p, unit.index)

    def _inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The arguments as ``forward`` gets them, after the model's own pre-hooks (NOTE [ Inputs after pre-hooks ])."""
        if self.stack and self.stack[-1].key == id(module):
            self._on_inputs(self.stack[-1], args, kwargs)

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.stack and self.stack[-1].key == id(module):
            self._exit(self.stack[-1], args, kwargs, output, module)

    def _enter(self, key: int | None, base: str, fqn: str, module_type: str, args: tuple, kwargs: dict) -> UnitCall:
        k = self.calls.get(key, 0) if key is not None else 0
        if key is not None:
            self.calls[key] = k + 1
        parent = self.stack[-1] if self.stack and key is not None else None
        unit = UnitCall(base if k == 0 else f"{base}#{k}", fqn, k, module_type,
                     parent.id if parent else None, len(self.stack) if key is not None else 0, key, len(self.units))
        self.units.append(unit)
        self.stack.append(unit)
        unit.fwd_start = self._note("fwd_start", unit)
        if key is None:  # a module's: once its own pre-hooks have run (NOTE [ Inputs after pre-hooks ])
            self._on_inputs(unit, args, kwargs)
        # Hooked now, before forward runs: an in-place module (ReLU(inplace=True)) would
        # otherwise hand us its input already turned into its output.
        for t in io_tensors(args, kwargs):
            if t.requires_grad:
                unit.has_input_grads = True
                self._listen_end(t, unit)
        return unit

    def _exit(self, unit: UnitCall, args: tuple, kwargs: dict, output: Any,
              module: torch.nn.Module | None = None) -> None:
        self.stack.pop()
        self._on_outputs(unit, output)
        unit.fwd_end = self._note("fwd_end", unit)
        for t in io_tensors(output):
            if t.requires_grad:
                self._listen_start(t, unit)
        if not unit.has_input_grads and module is not None:
            # NOTE [ Units ]: parameters first used in this call complete their gradient
            # when this call's backward is done.
            for p in module.parameters():
                if p.requires_grad and self.first_use.get(p, -1) >= unit.index:
                    self._listen_end(p, unit)

    # NOTE [ Gradient points ]
    # Units nest and share tensors: a block's input is its first child's input, its output
    # its last child's output, one unit's output the next one's input. Autograd runs the
    # hooks on one gradient in the order they were registered, which is not the order of
    # the units' backward. So each gradient gets one hook (a "point") that notes every unit
    # listening to it in backward order: ends innermost and latest-called first, then starts
    # outermost first. Ends hook the tensor and starts the node that made it; autograd runs
    # a node's tensor hooks before its node hooks, so when one unit's output is the next
    # one's input, the next unit's backward ends before this one's starts.

    def _listen_end(self, t: torch.Tensor, unit: UnitCall) -> None:
        self._listen(self.end_points, t, unit, self._fire_ends, lambda t, fn: t.register_hook(fn))

    # NOTE [ Outputs written in place ]
    # Rule 1. A unit's backward starts when a gradient reaches the node that made one of its outputs (a
    # prehook on the output's grad_fn as the unit returns it). The caller may then write the output in
    # place (``h = block(x); h.mul_(0.5)``). When the output is a view (``nn.Linear`` on a 3-D input returns
    # a view of its 2-D ``addmm``), autograd rebases the view's base on a ``CopySlices`` node and drops the
    # view's node from the graph: neither its prehook nor a tensor hook taken before the write ever runs.
    # The unit's start then fell back to its end (``_fire_ends``), its backward window folded into the one
    # before, and checkpointing it looked as if it freed what its replay re-makes there.
    # Rule 2. So a view's start is heard on its base's node too (the ``CopySlices`` keeps it as its next):
    # autograd runs a base's node after its views' nodes, so while the view's node is in the graph it is
    # heard first and the base adds nothing.
    # Rule 3. Measured (tests/test_model_classes3.py, three LayerNorm-MLP blocks, ``h = block(x); h.mul_(0.5);
    # x = x + h``): the middle block checkpointed (the mid plan) was predicted 345,056 and measured 370,392
    # (-6.84%, over its budget), the last one 370,520 / 419,168 (-11.6%); now 370,520 / 370,392 and 419,296 /
    # 419,168 (+128, the replay's rounding as elsewhere), and the mid plan takes the first block, exact.

    def _listen_start(self, t: torch.Tensor, unit: UnitCall) -> None:
        def register(t: torch.Tensor, fn: Callable[[Any], None]) -> Any:
            if t.grad_fn is None:
                return t.register_hook(fn)
            base = t._base if t._is_view() else None
            if base is None or base.grad_fn is None:
                return t.grad_fn.register_prehook(fn)
            return _Handles(t.grad_fn.register_prehook(fn), base.grad_fn.register_prehook(fn))

        self._listen(self.start_points, t, unit, self._fire_starts, register)

    def _listen(self, points: dict[int, _Point], t: torch.Tensor, unit: UnitCall,
                fire: Callable[[list[UnitCall], Any], None], register: Callable[..., Any]) -> None:
        node = t.grad_fn._sequence_nr() if t.grad_fn is not None else None
        point = points.get(id(t))
        if point is None or point.ref() is not t or point.node != node:  # new, or modified in place
            point = points[id(t)] = _Point(weakref.ref(t), node, [])
            self.grad_handles.append(register(t, functools.partial(fire, point.units)))
        if unit not in point.units:
            point.units.append(unit)

    def _fire_ends(self, units: list[UnitCall], _grad: Any) -> None:
        for unit in sorted(units, key=lambda u: -u.index):
            if unit.bwd_start is None:  # an identity (shortcut, loss_fn returning its input)
                unit.bwd_start = self._note("bwd_start", unit)
            unit.bwd_end = self._note("bwd_end", unit)  # the last gradient to complete wins

    def _fire_starts(self, units: list[UnitCall], _grads: Any) -> None:
        for unit in sorted(units, key=lambda u: u.index):
            if unit.bwd_start is None:
                unit.bwd_start = self._note("bwd_start", unit)

    # ------------------------------------------------------------- subclass points

    def _note(self, kind: str, unit: UnitCall | None) -> Any:
        raise NotImplementedError

    def _on_inputs(self, unit: UnitCall, args: tuple, kwargs: dict) -> None:
        pass

    def _on_outputs(self, unit: UnitCall, output: Any) -> None:
        pass


# NOTE [ Outputs in dataclasses ]
#
# A module may return its tensors in a plain ``@dataclass`` (``Output(hidden, aux)``), which
# pytree does not know (Hugging Face registers its ``ModelOutput``; namedtuples are tuples). Taken
# as one leaf, such an output had no tensors: a block's outputs were recorded as none, so the cost
# model left them out of what its replay runs beside (Rule 4's G_c), and a plan checkpointing the
# middle one of three such blocks was measured 4.7% above its prediction (and its budget). A dataclass's fields are searched like
# a tuple's items. Other objects that carry tensors in attributes are not searched: a module
# passed as an argument would count its parameters as inputs.

def io_tensors(*trees: Any) -> Iterator[torch.Tensor]:
    """Tensors among a module's inputs or outputs: pytree knows ``ModelOutput`` and friends;
    containers it does not know are searched as plain tuples, lists, dicts and dataclasses
    (NOTE [ Outputs in dataclasses ])."""
    for leaf in pytree.tree_leaves(trees):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif isinstance(leaf, (tuple, list)):
            yield from io_tensors(*leaf)
        elif isinstance(leaf, Mapping):
            yield from io_tensors(*leaf.values())
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            yield from io_tensors(*(getattr(leaf, f.name) for f in dataclasses.fields(leaf)))


@dataclass
class StepTimes:
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    optimizer_ms: float = 0.0
    unit_ms: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Unit id -> (forward ms, backward ms), medians over the steps it appeared in."""
    unit_ids: list[list[str]] = field(default_factory=list)
    """The unit ids of each timing step, to check the steps called the same modules."""
    unit_samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Unit id -> its (forward ms, backward ms) in each step, for pooling (NOTE [ Unit costs ])."""
    phase_spread_ms: dict[str, float] = field(default_factory=dict)
    """'forward', 'backward', 'optimizer' -> the spread of the phase's times (NOTE [ Unit costs ], Rule 4)."""


__all__ = ["io_tensors", "Recorder", "StepTimes", "UnitCall"]
