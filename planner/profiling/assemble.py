"""Assemble the ``schema.Profile`` of a recorded step: the memory step's records, the timing
steps' unit times, the step as run and the device's measured peak.

Example::

    prof = assemble_profile(model, inputs, dev, step, times, mem, measured, as_run=as_run)
"""

from __future__ import annotations

import platform
from collections.abc import Mapping

import torch
import torch.utils.checkpoint

from planner.model import schema
from planner.model.fingerprint import fingerprint
from planner.options import parse_optimizer
from planner.profiling.measure import Measured
from planner.profiling.model_file import Inputs
from planner.profiling.timing import UnitCost, unit_costs
from planner.spec import StepSpec
from planner.profiling.units import StepTimes, UnitCall
from planner.profiling.recording import MemoryRecord
from planner.profiling.as_run import AsRun


def assemble_profile(model: torch.nn.Module, inputs: Inputs, dev: torch.device, step: StepSpec, times: StepTimes,
                     mem: MemoryRecord, measured: Measured, *, as_run: AsRun | None = None) -> schema.Profile:
    """The ``schema.Profile`` of what the steps recorded, for ``step`` run on ``dev``: ``mem`` (the memory
    step's recorder), the timing steps' ``times``, the device's ``measured`` peak and ``as_run``, what
    ``as_run_timeline`` saw, if it ran."""
    from planner.act.existing import modules_by_plain_name, say_user_checkpointed, user_checkpointed

    rec = mem.recorder
    notes = _profile_notes(mem, times, measured, step.optimizer, as_run)
    checkpointed = user_checkpointed(model, modules_by_plain_name(model))  # NOTE [ Checkpointed twice ]
    say_user_checkpointed(checkpointed)
    rec.register_op_outputs()
    # Ids in creation order, so reading the list follows the step.
    order = sorted(rec.tensors.values(), key=lambda t: (t.created_seq, t.id))
    remap = {t.id: i for i, t in enumerate(order)}
    tensors = [schema.TensorRecord(id=remap[t.id], nbytes=t.nbytes, created_seq=t.created_seq, producer=t.producer,
                                   autocast_cached=t.id in rec.autocast_cached,
                                   released_seq=rec.releases.released.get(t.id),
                                   ctx_held=t.id in rec.ctx_held)
               for t in order]
    costs = _pooled_costs(times, rec.signatures)
    units = [_unit_record(u, costs.get(u.id, UnitCost(0.0, 0.0, 0)), rec.signatures.get(u.id, ""), remap) for u in rec.units]
    dead = rec.releases.saves_released  # NOTE [ Outputs the caller drops ], Rule 4
    saves = [schema.SaveRecord(tensor_id=remap[tid], seq=seq, unit=unit, released_seq=dead.get((tid, unit)))
             for tid, seq, unit in rec.saves]
    structure = step_structure({**{f"timing step {i + 1}": ids for i, ids in enumerate(times.unit_ids)},
                                "memory step": [u.id for u in rec.units],
                                **({"as-run step": as_run.unit_ids} if as_run else {})})
    return schema.Profile(
        fingerprint=fingerprint(model, inputs),
        device=dev.type,
        device_name=_device_name(dev),
        dtype=_dtype(model),
        recipe=step.recipe,
        optimizer=parse_optimizer(step.optimizer),
        torch_version=torch.__version__,
        created_at=schema.now_iso(),
        units=units,
        tensors=tensors,
        saves=saves,
        params=mem.param_records,
        ops=rec.op_records(remap),
        timeline=rec.timeline(),
        step=_step_record(mem, times, measured, step, as_run),
        step_structure=structure,
        notes=notes,
        user_checkpointed=checkpointed,
    )


def _profile_notes(mem: MemoryRecord, times: StepTimes, measured: Measured, optimizer: str,
                   as_run: AsRun | None) -> list[str]:
    """What a reader of the profile should know about how its step ran."""
    rec = mem.recorder
    notes: list[str] = []
    if parse_optimizer(optimizer) != "none":
        notes.append(f"{parse_optimizer(optimizer)} ran with lr=0: same state, kernels and temporaries as training, "
                     f"weights unchanged")
    memory_ids = [u.id for u in rec.units]
    if any(ids != memory_ids for ids in times.unit_ids):
        notes.append("the module calls differed between steps (data-dependent control flow?); "
                     "times are matched to units by id")
    if mem.found_bytes:
        notes.append(f"{mem.found_bytes} bytes of tensors held outside parameters and buffers (plain attributes, "
                     f"globals) were live before the step; counted in buffers_bytes")
    if mem.unused_params:
        notes.append(f"{mem.unused_params} trainable parameter(s) got no gradient (not used in the forward)")
    if rec.op_time_note:
        notes.append(rec.op_time_note)
    if rec.unattributed_saves:
        notes.append(f"{rec.unattributed_saves} tensor(s) saved for backward outside any module call were ignored")
    timeline_peak = max((e.peak_bytes for e in rec.events), default=0)
    matched = as_run is not None and as_run.matched
    if matched and abs(as_run.tracked_peak_bytes - timeline_peak) > 0.02 * max(timeline_peak, 1):
        notes.append(f"the step runs differently under remat's tracker (NOTE [ Step as run ]): it peaked at "
                     f"{as_run.tracked_peak_bytes} bytes there and at {timeline_peak} bytes as run; the timeline is "
                     f"the step as run")
    if measured.peak_bytes and abs(measured.peak_bytes - timeline_peak) > 0.02 * measured.peak_bytes:
        notes.append(f"{'as-run' if matched else 'tracked'} peak {timeline_peak} bytes differs from the "
                     f"{measured.source} peak {measured.peak_bytes} bytes by more than 2%")
    return notes


def _step_record(mem: MemoryRecord, times: StepTimes, measured: Measured, step: StepSpec,
                 as_run: AsRun | None) -> schema.StepRecord:
    rec = mem.recorder
    matched = as_run is not None and as_run.matched
    return schema.StepRecord(
        params_bytes=mem.params_bytes,
        buffers_bytes=mem.buffers_bytes + mem.found_bytes,
        batch_bytes=mem.batch_bytes,
        grads_bytes=mem.grads_bytes,
        optimizer_bytes=mem.optimizer_bytes,
        optimizer_step_transient_bytes=mem.optimizer_transient_bytes,
        workspace_bytes=mem.untracked_bytes,
        forward_ms=times.forward_ms,
        backward_ms=times.backward_ms,
        optimizer_ms=times.optimizer_ms,
        forward_spread_ms=times.phase_spread_ms.get("forward", 0.0),
        backward_spread_ms=times.phase_spread_ms.get("backward", 0.0),
        step_ms=step.recipe.grad_accum * (times.forward_ms + times.backward_ms) + times.optimizer_ms,
        forward_end_seq=rec.marks["forward_end"],
        backward_start_seq=rec.marks["backward_start"],
        measured_peak_bytes=measured.peak_bytes,
        peak_source=measured.source,
        warmup_steps=step.warmup_steps,
        measured_steps=step.steps,
        timeline_source="as-run" if matched else "tracked",
        tracked_peak_bytes=as_run.tracked_peak_bytes if matched else None,
    )


# NOTE [ Worst step ]
#
# Some models run a different set of modules from one step to the next: stochastic depth
# (Hugging Face's ``layerdrop`` in Wav2Vec2, HuBERT and others, on by default) skips whole
# layers at random. A profile of a step that skipped layer 0 never offers it to the solver, and
# every step that runs it peaks above the prediction.
#
# Rule 1. remat plans for the worst step the model can take: every layer running. It gets
# there by switching stochastic depth off while it measures (a 'measure' step change, NOTE
# [ Step changes ], Rule 2: Hugging Face's ``layerdrop``, as a module attribute or in the
# config, is 0 while profiling, in the validation step and in ``remat verify``, and restored
# after), not by profiling until every layer happened to run: a forced step is reached in one
# step, every time, and its change is recorded where the user reads it.
# Rule 2. The step's structure is part of the profile (``Profile.step_structure``): every
# unit seen in some profiled step (timing steps, memory step, as-run step), and which step
# skipped which. Skipping that remat cannot switch off shows there; when the memory step (the
# one the plan is made from) skipped a unit another step ran, the profile is refused
# (``planner.profiling.profiler.reconcile``) instead of planning for a lucky step.


def step_structure(steps: Mapping[str, list[str]]) -> schema.StepStructure:
    """Every unit seen in ``steps`` (step name -> unit ids in forward order), in forward order, and what
    each step skipped (NOTE [ Worst step ])."""
    seen: list[str] = []
    for ids in steps.values():
        at = 0
        for uid in ids:
            if uid in seen:
                at = seen.index(uid) + 1
            else:
                seen.insert(at, uid)
                at += 1
    ran = {name: set(ids) for name, ids in steps.items()}
    skipped = {name: [u for u in seen if u not in ran[name]] for name in steps}
    return schema.StepStructure(units_seen=seen, skipped={k: v for k, v in skipped.items() if v})


def _pooled_costs(times: StepTimes, signatures: dict[str, str]) -> dict[str, UnitCost]:
    """Unit id -> its ``UnitCost``: pooled over cost groups when the steps were timed (NOTE [ Unit
    costs ], Rule 3); as given otherwise (the roofline's one modelled step: no spread)."""
    if times.unit_samples:
        return unit_costs(times.unit_samples, signatures)
    return {uid: UnitCost(f, b, 1) for uid, (f, b) in times.unit_ms.items()}


def _unit_record(u: UnitCall, cost: UnitCost, group: str, remap: dict[int, int]) -> schema.UnitRecord:
    return schema.UnitRecord(
        id=u.id, fqn=u.fqn, call_index=u.call_index, module_type=u.module_type, parent=u.parent, depth=u.depth,
        fwd_start_seq=u.fwd_start, fwd_end_seq=u.fwd_end, bwd_start_seq=u.bwd_start, bwd_end_seq=u.bwd_end,
        forward_ms=cost.forward_ms, backward_ms=cost.backward_ms, cost_group=group, timing_samples=cost.samples,
        forward_spread_ms=cost.forward_spread_ms, backward_spread_ms=cost.backward_spread_ms,
        input_ids=[remap[i] for i in u.input_ids], output_ids=[remap[i] for i in u.output_ids],
        grad_output_ids=None if u.grad_output_ids is None else [remap[i] for i in u.grad_output_ids],
        input_bytes=u.input_bytes, output_bytes=u.output_bytes, param_bytes=u.param_bytes,
        last_pack_seq=u.last_pack_seq,
        replay_rise_bytes=None if u.last_pack_high is None else u.last_pack_high - u.fwd_high[0],
        bwd_before_replay_bytes=u.bwd_before_replay,
    )


def _device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine() or "cpu"


def _dtype(model: torch.nn.Module) -> str:
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return str(max(sizes, key=sizes.__getitem__)).removeprefix("torch.") if sizes else "float32"


__all__ = ["assemble_profile", "step_structure"]
