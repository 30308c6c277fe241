"""Profile the training step as ``torch.compile`` runs it (``planner.profile(..., compile="inductor")``).

The result is an ordinary ``schema.Profile`` (same units, tensors, saves and timeline), so the
cost model and every solver plan the compiled step unchanged; ``Profile.compile`` says what was
compiled. See NOTE [ Compiled profile ] for how each figure is obtained; ``compiled_graphs.py``
reads the partitioned graphs.

Example::

    prof = planner.profile(model, batch, device="cpu", compile="inductor")
    plan = planner.plan(prof, "2GB")   # then: apply_plan(model, plan); model = torch.compile(model)
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from planner.model import schema
from planner.model.schema import LOSS_ID, ROOT_ID

if TYPE_CHECKING:
    from planner.spec import StepSpec


# NOTE [ Compiled profile ]
#
# Under ``torch.compile`` (inductor) the forward and backward run as two compiled graphs that
# AOTAutograd's min-cut partitioner split from one joint graph: what the forward keeps for
# backward is what the partitioner chose (fused ops recompute cheap intermediates and save
# fewer, different tensors than eager autograd), and checkpointed regions
# (``torch.utils.checkpoint`` from ``apply_plan``, traced as ``tag_activation_checkpoint``)
# are recomputed inside the compiled backward. The compiled profile is the eager profile with
# the figures that differ replaced, from two compiles (the step as it is, and with the repeated
# blocks checkpointed) and their measured steps:
#
# Rule 1. Saves. One compile with a capturing ``inner_compile`` (inductor's own
#   ``compile_fx_inner`` does the work; the AOT cache is off for it so the partition runs). The
#   backward graph's placeholders other than ``tangents_*`` are exactly the saved values; each
#   is resolved through view ops to the forward node that owns its storage (a parameter or the
#   batch is static memory, not a save). Its bytes are that node's fake value's. Which unit
#   saves it is read from the backward nodes that consume it: AOTAutograd copies the forward
#   op's ``nn_module_stack`` to them (``fwd_nn_module_stack``), so each consumer names the module
#   whose backward needs the tensor; one save record per such module (its innermost unit), at
#   the position of the first forward node of that unit that reads it. Forward nodes without a
#   module stack (code in the root's forward, such as an in-model loss) belong to the root.
# Rule 2. Positions. The eager sequence numbers are multiplied by K and forward nodes take the
#   free positions between them: a node of unit U after U's child C (in graph order) sits just
#   after C's forward end, before it just after U's start. So a save made by U's own code lies
#   in U and in none of its children, as ``build_graph`` attributes saves by position.
# Rule 3. Identity. A storage that crosses a unit boundary in the compiled graph (a block's
#   output, the rotary tables every layer reads) is the eager tensor the unit records as its
#   input or output: matched by unit, direction and bytes in order, so that a checkpointed
#   unit's held input and another unit's save of it count once. Other saved storages are new
#   tensors, created at their owner's position; one that units outside its owner read (inductor
#   computes the attention mask once, in the first layer, for every layer) is an input of each
#   such unit too, so that a checkpointed reader holds it, once.
# Rule 4. Checkpointed. A checkpointed unit's compiled forward keeps those of its inputs that the
#   partitioner saves, and what it will not recompute. That is read from a second compile with
#   the repeated blocks checkpointed (Rule 8). An input it does not save (it recomputes the
#   rotary tables and a 1 KiB tensor the root makes inside each replay, on Qwen2 and GPT-NeoX)
#   is no input of the block: the block's record drops it, its submodules keep it (so
#   that the forward still passes it on, in flight); only inputs that one of the two compiles
#   names (an eager boundary tensor the second identified, a storage the first saved) are
#   judged, the others stay (the safe side). Of the storages it saves that are not unit
#   boundaries of the eager step and that the first compile did not save, those a region
#   allocated are retained bytes of that region (``Profile.retained``, NOTE [ Peak-memory
#   model ], Rule 7), held while it is checkpointed: a random op's seed, and what later regions
#   read (GPT-2: inductor computes the attention mask once, in the first layer, for every layer).
#   Why not inputs of the regions that read it: the partitioner saves such a storage because its
#   own region is checkpointed (a value one checkpointed region makes and a later one reads is
#   saved at the boundary, torch's ``cleanup_recompute_tags``); with that region not
#   checkpointed it recomputes it, as the first compile does, and a reader that held it as an
#   input over-counted it (docs/benchmarks.md, issue #24: GPT-2 with h.1 and h.2). Exact would
#   be "held while its region and a later reader are both checkpointed"; the cost model holds
#   by one unit, so the region checkpointed without a reader over-counts it (the safe side).
#   Those storages code outside every region allocated and regions read are new inputs of the
#   units that read them. The CPU RNG state an eager checkpoint keeps per region
#   (``Profile.region_state_bytes``, NOTE [ Validation step ]) is not kept under compile (no
#   backward graph saves it, and the measured peaks do not hold it): 0 in a compiled profile.
#   An eager tensor it saves that the first compile does not
#   is the input of code before a region that the region's replay re-runs (GPT-2: the token and
#   position embeddings, kept to replay the embedding dropout inside the first block's replay,
#   where the first compile kept the dropout's output): an input of the first region after it,
#   held while that region is checkpointed. Other candidates (finer ones inside a block, the
#   modules around the blocks) are not measured this way: they keep all their inputs only.
# Rule 5. Memory timeline. The compiled step is measured once with marks between its phases:
#   the peaks of the forward (and in-model loss), the backward and the optimizer step. Inside
#   the compiled graphs no module hook runs, so the leaves' windows come from the eager timeline,
#   each event moved by the difference between the compiled and the eager held bytes at its
#   position (saves up to it, no checkpointing) and capped at its phase's compiled peak; the
#   tail windows ("end of forward", "start of backward") are the compiled phase peaks. The eager
#   temporaries of a leaf window thus remain (fusion makes the compiled ones smaller: an
#   over-estimate, on the safe side).
# Rule 6. Times. The compiled step is timed (median of ``steps`` steps, the eager profile's clock):
#   forward, backward, optimizer. Per unit, no hook can time a fused graph, so each unit's eager
#   forward and backward times are scaled by the compiled-to-eager ratio of its phase; a
#   checkpointed unit's recompute is its scaled forward.
# Rule 7. Op-level policies. The eager op records stay (positions scaled by K), so every
#   candidate gets its menu of selective policies (NOTE [ Selective menus ]); the applier's
#   policy (MUST_SAVE the listed op calls, PREFER_RECOMPUTE the rest) is traced into the
#   compiled graph (``tag_activation_checkpoint`` with its ``context_fn``), so the partitioner
#   saves the kept ops' outputs and the region's inputs and recomputes the rest inside the fused
#   backward: what remat gets of compile's cheap recompute of pointwise ops, inside the units it
#   chooses. Figures: a kept output's bytes are the eager op's; a policy's recompute is the
#   unit's compiled forward times the share of its replayed kernels it recomputes: only matmuls,
#   attention and softmax count (``graph.REPLAYED``, by their eager times), since inductor fuses
#   the pointwise ops, norms and dropout into the backward's own kernels, and no Python reruns
#   (no thread factor's Python share), with no dispatch cost (the policy runs once, at trace
#   time: ``sac_*_op_ms`` are 0). Why not the eager share (rounds 18-20): it priced GPT-2's
#   policy that keeps every matmul and the softmax at 21.2 of a block's 31.4 ms, so remat took
#   whole blocks (measured +9.9 ms over the plain compiled step for all four) where that policy
#   on all four blocks measured 19.2 ms faster than the plain step at 125.85 MiB against its
#   165.25 (`benchmarks/compiled_policies.py examples/gpt2.py`, docs/benchmarks.md). Outputs
#   written in place later (the CPU's dropout mask) are not kept: torch asks for no in-place ops
#   in a compiled selective region. Measured at commit 6cd6f05, these peaks were over by 1.8 to
#   10.2% (a kept eager output is not what the partitioner keeps; the replay temporaries are
#   calibrated on whole blocks): the solver chooses by them (the safe side) and the chosen plan
#   is then compiled and measured, which predicts it at its measurement (NOTE [ The compiled
#   plan is checked ]).
# Rule 8. Replay. A checkpointed region's replay runs inside the fused backward graph: inductor
#   recomputes a region where its first reader's backward needs it (a region's output read by
#   the next module's backward is recomputed there, not saved), and its temporaries overlap with
#   that backward's. A second compile with the repeated blocks checkpointed (the candidates plans
#   checkpoint first; a model without repeated blocks: every default candidate) is measured (its
#   memory only: NOTE [ Memory-only compiles ], its CPU kernels not built), and
#   the bytes by which its backward peak exceeds the highest recompute probe of the cost model for
#   that set become ``replay_transient_bytes`` (NOTE [ Peak-memory model ], Rule 11); negative
#   where the probe lies above the measurement (the fused replay's temporaries are smaller than
#   the eager forward's that the probe counts), as Rule 9 has it.
# Rule 9. The second compile bounds its own step. Its measured backward peak is an upper bound on
#   every backward probe of the model for the set it ran (the repeated blocks checkpointed): a
#   leaf's backward window above it is lowered to it (the window's peak of Rule 5 capped, so that
#   its temporaries T lose the excess, never below 0), and the recompute probes meet it through
#   Rule 8's offset. So that set is predicted at its measured peak where these probes set it.
#   Which probes it may move: only those whose temporaries are eager figures (the leaves' backward
#   windows, Rule 5; a replay's, Rule 8). The tail windows stay: they are the first compile's
#   measured phase peaks, exact for the plain step, which lowering them would under-predict. Where
#   a checkpointed set's start of backward is over, the excess is in its held bytes (measured: the
#   output of the last checkpointed block, which the module after it saves in the plain compile
#   and not with the block checkpointed), not in eager temporaries, and the second compile's
#   backward peak, reached elsewhere (a replay), does not bound that window.
#   The forward phase stays too: a checkpointed step's peak lies in its backward. Why no other
#   plan is under-predicted: a set that checkpoints the same regions up to a window has there the
#   same held and recomputed bytes as the measured set, so the same probe, whose step was
#   measured; a set that differs there keeps the lowered temporaries on Rule 6's premise that a
#   window's temporaries do not depend on the set (a premise: each set compiles its own fused
#   backward), and the replay offset is one figure for every region, as Rule 8's was (measured
#   on the blocks, carried to the other candidates).
#   docs/benchmarks.md has the probes it moved on the zoo models.

from planner.profiling.aot_cse import regions_apart, side_effects_once_available
from planner.profiling.compiled_graphs import (Graphs as _Graphs, Layout as _Layout, ModuleNames, is_view,
                                               Units as _Units, capturing, layout as _layout, saved_storages,
                                               storage_owner)


# ----------------------------------------------------------------------------- the compiled profile


@dataclass(frozen=True)
class CompiledStep:
    """The compiled step as measured (NOTE [ Compiled profile ], Rules 5-6)."""

    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    peak_bytes: int
    peak_source: str
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    first_compile_s: float


def compiled_profile(eager: schema.Profile, graphs: _Graphs, model: torch.nn.Module, step: CompiledStep,
                     backend: str) -> schema.Profile:
    """The eager profile with the compiled step's saves, timeline and times (NOTE [ Compiled profile ])."""
    names = ModuleNames(model)
    saved, stacks = saved_storages(graphs, names)
    units = _Units(eager)
    lay = _layout(graphs, stacks, units, eager)
    k = lay.scale
    tensors = [t.model_copy(update={"created_seq": k * t.created_seq}) for t in eager.tensors]
    next_id = max((t.id for t in eager.tensors), default=-1) + 1
    saves = [s.model_copy(update={"seq": k * s.seq}) for s in eager.saves if s.unit == LOSS_ID]
    readers = _forward_readers(graphs, lay)
    crossing: dict[str, set[int]] = defaultdict(set)  # unit -> compiled storages it reads from outside
    ids = _tensor_ids(saved, lay, next_id)
    for s in saved:
        tid = ids[s.owner]
        if s.owner not in lay.identity:
            tensors.append(schema.TensorRecord(id=tid, nbytes=s.nbytes, created_seq=lay.position[s.owner],
                                               producer=lay.unit_of[s.owner]))
            made = set(lay.chains[s.owner])
            for r in readers.get(s.owner, []):
                for unit in lay.chains[r]:
                    if unit not in made:
                        crossing[unit].add(tid)
        for fqn in s.holders:
            unit = units.of(fqn)
            saves.append(schema.SaveRecord(tensor_id=tid, seq=_save_position(s.owner, unit, readers, lay, units),
                                           unit=unit))
    saves.sort(key=lambda s: s.seq)
    scaled = _scaled_records(eager, k)
    timeline = _compiled_timeline(eager, scaled["timeline"], saves, {t.id: t.nbytes for t in tensors}, k, step)
    return eager.model_copy(update=dict(
        tensors=tensors, saves=saves, ops=_compiled_ops(eager, k), timeline=timeline,
        units=_with_inputs(_scaled_units(eager, k, step), crossing, {t.id: t.nbytes for t in tensors}),
        params=scaled["params"], step=_compiled_step_record(eager, k, step), region_state_bytes=0,  # Rule 4
        sac_recomputed_op_ms=0.0, sac_kept_op_ms=0.0, sac_recomputed_op_spread_ms=0.0, sac_kept_op_spread_ms=0.0, sac_rounds=0,
        schema_version=schema.COMPILED_PROFILE_VERSION,
        compile=schema.CompileInfo(backend=backend, torch_version=torch.__version__,
                                   first_compile_s=round(step.first_compile_s, 3)),
        notes=[*eager.notes, f"compiled ({backend}): saves read from the partitioned graphs, times scaled by the "
                             f"compiled step's (NOTE [ Compiled profile ])"],
    ))


def _tensor_ids(saved: list, lay: _Layout, first_new_id: int) -> dict[str, int]:
    """Saved storage (its owner node) -> tensor id: the eager tensor it is (Rule 3), else a new id,
    numbered from ``first_new_id`` in the order of ``saved``."""
    out, next_id = {}, first_new_id
    for s in saved:
        if s.owner in lay.identity:
            out[s.owner] = lay.identity[s.owner]
        elif s.owner not in out:
            out[s.owner], next_id = next_id, next_id + 1
    return out


def _with_inputs(units: list[schema.UnitRecord], crossing: dict[str, set[int]],
                 nbytes: dict[int, int]) -> list[schema.UnitRecord]:
    """Units with the compiled storages they read from outside as inputs too (Rule 3): what a
    checkpointed region keeps of them."""
    out = []
    for u in units:
        extra = sorted(crossing.get(u.id, set()) - set(u.input_ids))
        out.append(u.model_copy(update={"input_ids": [*u.input_ids, *extra],
                                        "input_bytes": u.input_bytes + sum(nbytes[t] for t in extra)})
                   if extra else u)
    return out


def _forward_readers(graphs: _Graphs, lay: _Layout) -> dict[str, list[str]]:
    """Forward nodes that read each owner's storage (through views), in graph order."""
    out: dict[str, list[str]] = defaultdict(list)
    for k, fw in enumerate(graphs.forward):
        for n in fw.graph.nodes:
            if f"{k}:{n.name}" not in lay.position:
                continue
            for arg in n.all_input_nodes:
                owner = f"{k}:{storage_owner(arg).name}"
                if not is_view(n):
                    out[owner].append(f"{k}:{n.name}")
    return out


def _save_position(owner: str, unit: str, readers: dict[str, list[str]], lay: _Layout, units: _Units) -> int:
    """Where ``unit`` saves ``owner``'s storage: its first reader in ``unit``, else its creation
    when ``unit`` made it, else ``unit``'s forward start (NOTE [ Compiled profile ], Rule 1)."""
    mine = [r for r in readers.get(owner, []) if lay.unit_of[r] == unit]
    if mine:
        return lay.position[mine[0]]
    if lay.unit_of.get(owner) == unit:
        return lay.position[owner]
    return lay.scale * units.by_id[unit].fwd_start_seq


def _compiled_ops(eager: schema.Profile, k: int) -> list[schema.OpRecord]:
    """The eager op records at the compiled positions, as Rule 7 keeps them: in-place groups
    (a kept storage written later, the CPU's dropout) are left out of the menus."""
    return [o.model_copy(update={"seq": k * o.seq, "writes": None if o.writes is None else k * o.writes,
                                 "read_between_writes": o.read_between_writes or o.mutated})
            for o in eager.ops]


def _scaled_records(eager: schema.Profile, k: int) -> dict[str, list]:
    return dict(timeline=[e.model_copy(update={"seq": k * e.seq}) for e in eager.timeline],
                params=[p.model_copy(update={"grad_seq": k * p.grad_seq}) for p in eager.params])


def _scaled_units(eager: schema.Profile, k: int, step: CompiledStep) -> list[schema.UnitRecord]:
    """Unit positions scaled by K; times scaled by the compiled-to-eager ratio of their phase (Rule 6)."""
    fwd = step.forward_ms / eager.step.forward_ms if eager.step.forward_ms > 0 else 1.0
    bwd = step.backward_ms / eager.step.backward_ms if eager.step.backward_ms > 0 else 1.0
    out = []
    for u in eager.units:
        out.append(u.model_copy(update=dict(
            fwd_start_seq=k * u.fwd_start_seq, fwd_end_seq=k * u.fwd_end_seq,
            bwd_start_seq=None if u.bwd_start_seq is None else k * u.bwd_start_seq,
            bwd_end_seq=None if u.bwd_end_seq is None else k * u.bwd_end_seq,
            forward_ms=u.forward_ms * fwd, backward_ms=u.backward_ms * bwd,
            forward_spread_ms=u.forward_spread_ms * fwd, backward_spread_ms=u.backward_spread_ms * bwd)))
    return out


def _compiled_step_record(eager: schema.Profile, k: int, step: CompiledStep) -> schema.StepRecord:
    return eager.step.model_copy(update=dict(
        forward_end_seq=k * eager.step.forward_end_seq, backward_start_seq=k * eager.step.backward_start_seq,
        forward_ms=step.forward_ms, backward_ms=step.backward_ms, optimizer_ms=step.optimizer_ms,
        step_ms=step.forward_ms + step.backward_ms + step.optimizer_ms,
        forward_spread_ms=0.0, backward_spread_ms=0.0,
        measured_peak_bytes=step.peak_bytes, peak_source=step.peak_source))


def held_bytes(saves: list[schema.SaveRecord], nbytes: dict[int, int]) -> tuple[list[int], list[int]]:
    """(positions, held bytes up to each): the bytes of the distinct tensors saved at or before a
    position, nothing checkpointed (NOTE [ Compiled profile ], Rule 5)."""
    seen: set[int] = set()
    positions, totals, total = [], [], 0
    for s in sorted(saves, key=lambda s: s.seq):
        if s.tensor_id not in seen:
            seen.add(s.tensor_id)
            total += nbytes[s.tensor_id]
            positions.append(s.seq)
            totals.append(total)
    return positions, totals


def _compiled_timeline(eager: schema.Profile, timeline: list[schema.MemoryEvent], saves: list[schema.SaveRecord],
                       nbytes: dict[int, int], k: int, step: CompiledStep) -> list[schema.MemoryEvent]:
    """The eager timeline moved to the compiled saves and capped at the compiled phase peaks (Rule 5)."""
    import bisect

    eager_held = held_bytes([s.model_copy(update={"seq": k * s.seq}) for s in eager.saves],
                            {t.id: t.nbytes for t in eager.tensors})
    compiled_held = held_bytes(saves, nbytes)
    units = {u.id: u for u in eager.units}

    def at(held: tuple[list[int], list[int]], q: int) -> int:
        i = bisect.bisect_right(held[0], q)
        return held[1][i - 1] if i else 0

    out, phase = [], "forward"
    for e in timeline:
        if e.kind == "backward_start":
            phase = "backward"
        q = _held_position(e, units, k)
        delta = 0 if q is None else at(compiled_held, q) - at(eager_held, q)
        cap = {"forward": step.forward_peak_bytes, "backward": step.backward_peak_bytes}[phase]
        if e.kind in ("backward_end", "optimizer_end"):
            cap = step.optimizer_peak_bytes if e.kind == "optimizer_end" else step.backward_peak_bytes
        live = max(0, min(e.live_bytes + delta, cap))
        peak = max(live, min(e.peak_bytes + delta, cap))
        out.append(e.model_copy(update={"live_bytes": live, "peak_bytes": peak}))
    _set_tail_peaks(out, step)
    return out


def _held_position(e: schema.MemoryEvent, units: dict[str, schema.UnitRecord], k: int) -> int | None:
    """The position whose held bytes an event sees (saves up to it); None: nothing held."""
    if e.kind in ("fwd_start", "fwd_end", "forward_end", "backward_start"):
        return e.seq
    if e.kind == "bwd_start" and e.unit in units:
        return k * units[e.unit].fwd_end_seq
    if e.kind == "bwd_end" and e.unit in units:
        return k * units[e.unit].fwd_start_seq - 1
    return None


def _set_tail_peaks(events: list[schema.MemoryEvent], step: CompiledStep) -> None:
    """The tail windows take the compiled phase peaks (Rule 5): the forward's at its end, the
    backward's at the first event after backward starts."""
    for i, e in enumerate(events):
        if e.kind == "forward_end":
            events[i] = e.model_copy(update={"peak_bytes": max(e.live_bytes, step.forward_peak_bytes)})
        if e.kind == "backward_start" and i + 1 < len(events):
            nxt = events[i + 1]
            events[i + 1] = nxt.model_copy(update={"peak_bytes": max(nxt.live_bytes, step.backward_peak_bytes)})


# ----------------------------------------------------------------------------- measuring the compiled step


PHASES = (("step_start", "forward_end", "forward"), ("backward_start", "backward_end", "backward"),
          ("backward_end", "optimizer_end", "optimizer"))
"""Step marks (``planner.profiling.measure.STEP_MARKS``) that bound each phase of the step."""


def phase_peaks(step: Callable[..., Any], dev: torch.device, static_bytes: int) -> tuple[dict[str, int], int, str]:
    """({phase: peak bytes}, the step's peak, the source) of one step: the CUDA allocator's peak reset
    at each mark, or the CPU allocator's events split at the marks (static memory added)."""
    if dev.type == "cuda":
        return _cuda_phase_peaks(step, dev)
    from planner.profiling.measure import _profiled, cpu_allocations

    marker = "remat::mark::"

    def mark(name: str, _value: Any = None) -> None:
        with torch.profiler.record_function(marker + name):
            pass

    prof, _ms = _profiled(lambda: step(mark))
    at = _marker_times(prof, marker)
    running, peaks, step_peak = static_bytes, dict.fromkeys((p for _, _, p in PHASES), static_bytes), static_bytes
    for t, nbytes in cpu_allocations(prof):
        running += nbytes
        step_peak = max(step_peak, running)
        for lo, hi, name in PHASES:
            if at.get(lo, 0) <= t <= at.get(hi, 1 << 63):
                peaks[name] = max(peaks[name], running)
    return peaks, step_peak, "cpu-profiler"


def _marker_times(prof: Any, prefix: str) -> dict[str, int]:
    out: dict[str, int] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.name.startswith(prefix):
            out[node.name[len(prefix):]] = node.start_time_ns
    return out


def _cuda_phase_peaks(step: Callable[..., Any], dev: torch.device) -> tuple[dict[str, int], int, str]:
    bounds = {hi: name for _, hi, name in PHASES}
    peaks: dict[str, int] = {}

    def mark(name: str, _value: Any = None) -> None:
        torch.cuda.synchronize(dev)
        if name in bounds:
            peaks[bounds[name]] = int(torch.cuda.max_memory_allocated(dev))
        torch.cuda.reset_peak_memory_stats(dev)

    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step(mark)
    return peaks, max(peaks.values()), "cuda-allocator"


def phase_times(step: Callable[..., Any], clock: Any, steps: int) -> dict[str, float]:
    """Median milliseconds of each phase over ``steps`` steps on ``clock``."""
    from planner.profiling.timing import robust_ms

    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        marks: dict[str, Any] = {}
        step(lambda name, _value=None: marks.__setitem__(name, clock.stamp()))
        clock.sync()
        for lo, hi, name in PHASES:
            samples[name].append(clock.ms(marks[lo], marks[hi]))
    return {name: robust_ms(v) for name, v in samples.items()}


@contextlib.contextmanager
def checkpointing(model: torch.nn.Module, fqns: list[str]) -> Iterator[None]:
    """The modules ``fqns`` checkpointed as ``apply_plan`` checkpoints them, for the duration."""
    from planner.act.applier import CheckpointedForward, RegionCounts

    modules = dict(model.named_modules())
    before = {f: modules[f].__dict__.get("forward") for f in fqns}
    for f in fqns:
        modules[f].forward = CheckpointedForward(modules[f], before[f], RegionCounts())
    try:
        yield
    finally:
        for f, previous in before.items():
            if previous is None:
                modules[f].__dict__.pop("forward", None)
            else:
                modules[f].forward = previous


def measure_compiled(model: torch.nn.Module, inputs: Any, eager: schema.Profile, *, step: StepSpec,
                     progress: Callable[[str], None], checkpointed: list[str] = (),
                     timed: bool = True) -> tuple[CompiledStep, _Graphs]:
    """Compile ``step`` once (capturing its graphs), then measure its phase peaks and, when ``timed``,
    its times (Rules 5-6); ``checkpointed`` modules run under checkpoint (Rule 8)."""
    import time

    from planner.profiling.measure import make_optimizer, make_step, to_device
    from planner.profiling.profiler import resolve_device
    from planner.profiling.recording import release_grads
    from planner.profiling.timing import clock_of, num_threads, timing_threads

    dev, recipe = resolve_device(step.device), step.recipe
    model.to(dev)
    model.train()
    inputs = to_device(inputs, dev)
    opt = make_optimizer(step.optimizer, model, impl=recipe.optimizer_impl)
    torch._dynamo.reset()  # compile afresh: the capture must see this step's partition
    with capturing(step.compile) as (compiler, graphs), checkpointing(model, list(checkpointed)), \
            regions_apart(bool(checkpointed)), num_threads(step.threads):  # NOTE [ Side effects in a checkpointed region ]
        run = make_step(torch.compile(model, backend=compiler), inputs, loss_fn=step.loss_fn, optimizer=opt,
                        recipe=recipe)
        what = f"with {len(checkpointed)} modules checkpointed" if checkpointed else "as it is"
        progress(f"compiling the step {what} ({step.compile})")
        start = time.perf_counter()
        run()
        first_s = time.perf_counter() - start
        progress("measuring the compiled step")
        run()  # steady state: the optimizer state exists
        times = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        if timed:
            clock = clock_of(eager, dev)
            with timing_threads(clock):
                times = phase_times(run, clock, step.steps)
        release_grads(model, dev, recipe)
        s = eager.step
        peaks, peak, source = phase_peaks(run, dev,
                                          s.params_bytes + s.buffers_bytes + s.optimizer_bytes + s.batch_bytes)
        release_grads(model, dev, recipe)
    torch._dynamo.reset()
    return CompiledStep(peaks["forward"], peaks["backward"], peaks["optimizer"], peak, source, times["forward"],
                        times["backward"], times["optimizer"], first_s), graphs


def profile_compiled(model: torch.nn.Module, inputs: Any, eager: schema.Profile, *, step: StepSpec,
                     progress: Callable[[str], None] | None = None) -> schema.Profile:
    """The compiled profile of ``step`` (``step.compile``), whose eager profile is ``eager``
    (NOTE [ Compiled profile ]); ``planner.profiling.check_step`` has checked ``step``."""
    say = progress or (lambda _msg: None)
    measured, graphs = measure_compiled(model, inputs, eager, step=step, progress=say)
    result = compiled_profile(eager, graphs, model, measured, step.compile)
    candidates = default_candidates(result)
    if not candidates:
        return _with_measured(result, [([], measured)])
    from planner.profiling.profiler import resolve_device
    from planner.profiling.unbuilt import peak_only

    replayed, regions = peak_only(lambda: measure_compiled(model, inputs, eager, step=step, progress=say,  # memory only
                                                           checkpointed=candidates, timed=False),
                                  resolve_device(step.device), model, say)  # NOTE [ Memory-only compiles ]
    from planner.profiling.compiled_calibration import with_backward_bounds, with_region_saves, with_replay_calibration

    result = with_region_saves(result, eager, regions, model, candidates, graphs)
    result = with_replay_calibration(with_backward_bounds(result, replayed, candidates), replayed, candidates)
    return _with_measured(result, [([], measured), (candidates, replayed)])


def _with_measured(profile: schema.Profile, runs: list[tuple[list[str], CompiledStep]]) -> schema.Profile:
    """``profile`` recording the peaks of the compiles it measured (NOTE [ The compiled plan is checked ]), and
    how its regions compiled: without AOTAutograd's CSE, their side effects once (``regions_apart``)."""
    peaks = [schema.CompiledPeak(checkpoints=list(fqns), peak_bytes=run.peak_bytes) for fqns, run in runs]
    how = {"measured": peaks, "aot_cse": False, "fwd_side_effects_replayed": not side_effects_once_available()}
    return profile.model_copy(update={"compile": profile.compile.model_copy(update=how)})


def default_candidates(profile: schema.Profile) -> list[str]:
    """Module FQNs the second compile checkpoints (Rule 8): the repeated blocks (transformer layers),
    which plans checkpoint first; without any, the default cut's candidates (``build_graph``)."""
    from planner.model.graph import build_graph, repeated_blocks, unit_children

    units = {u.id: u for u in profile.units}
    blocks = repeated_blocks(units, unit_children(profile.units))
    if blocks:
        return sorted({units[b].fqn for b in blocks})
    g = build_graph(profile, selective=False)
    return sorted({g.nodes[n]["fqn"] for n in g.nodes if n not in (ROOT_ID, LOSS_ID)})


__all__ = ["CompiledStep", "PHASES", "checkpointing", "compiled_profile", "default_candidates", "held_bytes",
           "measure_compiled", "phase_peaks", "phase_times", "profile_compiled"]
