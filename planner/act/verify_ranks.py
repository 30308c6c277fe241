"""Check a per-rank plan by measurement: every rank's peak against the prediction, under DDP or FSDP2.

Example::

    from planner.act.verify_ranks import verify_ranks
    report = verify_ranks("model.py", "plan.json")     # plan made with --world-size 2 --sharding fsdp
    for row in report.rows:
        print(row.rank, row.predicted_peak_bytes, row.measured_peak_bytes, f"{row.error:+.2%}")
    assert report.ok

A per-rank plan is made from the model file's ``example_inputs()`` as *one rank's* batch, so
every rank here trains on ``example_inputs()``: ``plan`` and ``verify`` read the file the same
way. ``verify_ranks`` starts ``plan.world_size`` local processes itself (gloo on the CPU, NCCL
on CUDA, one GPU a rank); launched under ``torchrun`` it runs as the calling rank instead. Each
rank builds the model from the same seed, applies the plan, wraps it as the prediction assumes
(``planner.act.sharding.shard_for_plan``), and trains twice, as single-process ``verify`` does:
without the plan, then with it. Each run does one compared step (losses and, on rank 0, the
full gradients are kept), ``steps`` more, then one measured step: its peak is the device's own
(CUDA's allocator; on the CPU the process-wide allocator total, see NOTE [ CPU peaks across
threads ] in ``planner/profiling/measure.py``). Every rank trains on the same batch, so the gradients
that DDP and FSDP2 average over ranks equal one process's on that batch: the reference is one
process training the plain model on it (rank 0 computes it when launched by torchrun).

The report is ``ok`` when every rank's measured peak fits the budget, every rank's
|predicted - measured| / measured is within ``peak_tolerance``, and the gradients match the
reference within ``grad_tolerance``. ``verify_ranks_together`` checks several plans of one model
file on one set of spawned ranks, one plan after another, each as ``verify_ranks`` checks it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import re
import socket
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from planner.children import PARENT_ENV, die_with_parent, end, quiet_on_ctrl_c, temp_dir
from planner.errors import BadInput, ProfileError
from planner.files import atomic_write_text
from planner.model.schema import Plan
from planner.profiling import rng
from planner.sizes import format_bytes

SEED = 1234
"""Seed set before building the model and before the compared step, on every rank."""


class RankRow(BaseModel):
    rank: int
    stage: int | None = Field(None, description="The rank's pipeline stage (pipeline plans).")
    tp_rank: int | None = Field(None, description="The rank's place among its tensor-parallel ranks (tp > 1).")
    predicted_peak_bytes: int = Field(description="The plan's per-rank prediction.")
    measured_peak_bytes: int
    error: float = Field(description="(predicted - measured) / measured.")
    within_budget: bool
    predicted_no_plan_peak_bytes: int | None = Field(description="The prediction without checkpointing.")
    measured_no_plan_peak_bytes: int
    no_plan_error: float | None
    recomputes: int = Field(description="Forwards recomputed in the compared step on this rank.")


class RanksReport(BaseModel):
    """Per-rank predicted vs measured peaks, the gradient check, and the verdict."""

    model: str
    device: str = Field(description="Device type of the ranks: 'cpu' (gloo) or 'cuda' (NCCL).")
    world_size: int
    sharding: str
    fsdp_units: list[str]
    launched: str = Field(description="'spawned' (remat started the ranks) or 'torchrun'.")
    peak_source: str
    steps: int
    budget_bytes: int
    peak_tolerance: float
    grad_tolerance: float
    rows: list[RankRow]
    loss_diff: float | None = Field(description="|loss with the plan on rank 0 - the reference's|.")
    max_grad_diff: float | None = Field(description="Largest |gradient element| difference, rank 0 vs reference.")
    problems: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    ok: bool


def verify_ranks(model_file: str | Path, plan: Plan | str | Path, *, steps: int = 2, device: str = "cpu",
                 peak_tolerance: float = 0.02, grad_tolerance: float = 1e-5,
                 progress: Any = None) -> RanksReport:
    """Train a per-rank plan on ``plan.world_size`` ranks and compare every rank with the prediction.

    Args:
        model_file: the model file the plan was made for (processes import it by path).
        plan: a ``Plan`` made with ``world_size``/``sharding``, or its path.
        steps: steps between the compared and the measured step (>= 1: DDP rebuilds its
            buckets on the second step, FSDP2 initialises lazily on the first).
        device: 'cpu' (gloo) or 'cuda' (NCCL, one GPU a rank).
        peak_tolerance: largest allowed |predicted - measured| / measured on any rank.
        grad_tolerance: largest allowed |difference| of any gradient element from the reference.
        progress: called with a short message as each stage starts.

    Raises:
        BadInput: not a per-rank plan, too few GPUs, bad arguments.
        ProfileError: a rank failed (its error is in the message).
    """
    plan, args = _checked(model_file, plan, steps, device, peak_tolerance)
    say = progress or (lambda _msg: None)
    if _under_torchrun():
        return _torchrun_report(args, plan, str(model_file), peak_tolerance, grad_tolerance)
    say(f"training the reference: one process, {steps + 2} steps without the plan")
    reference = _reference(args)
    layout = (f"pipeline stages, {plan.pipeline.schedule}" if plan.pipeline is not None else
              _tp_layout(plan) if plan.tensor_parallel > 1 else plan.sharding)
    say(f"training on {plan.world_size} ranks ({layout}), {steps + 2} steps without and with the plan")
    (results,) = _spawn([args], plan.world_size)
    return _report(plan, str(model_file), "spawned", args, results, reference, peak_tolerance, grad_tolerance)


def verify_ranks_together(model_file: str | Path, plans: Sequence[Plan | str | Path], *, steps: int = 2,
                          device: str = "cpu", peak_tolerance: float = 0.02,
                          grad_tolerance: float = 1e-5) -> list[RanksReport]:
    """``verify_ranks`` of each of ``plans`` (one world size, spawned ranks only), on one set of ranks: they
    start once and check the plans one after another, each as ``verify_ranks`` checks it (its trainings'
    memory freed before the next), in one process group. For several layouts of a small model, whose ranks
    take longer to start (torch and the model's libraries imported in each) than to train."""
    checked = [_checked(model_file, plan, steps, device, peak_tolerance) for plan in plans]
    sizes = sorted({plan.world_size for plan, _ in checked})
    if len(sizes) != 1 or _under_torchrun():
        raise BadInput(f"verify_ranks_together spawns one set of ranks for plans of one world size, not under "
                       f"torchrun; got world sizes {sizes}: use verify_ranks for each")
    references = [_reference(args) for _, args in checked]
    results = _spawn([args for _, args in checked], sizes[0])
    return [_report(plan, str(model_file), "spawned", args, rows, reference, peak_tolerance, grad_tolerance)
            for (plan, args), rows, reference in zip(checked, results, references)]


# ----------------------------------------------------------------------------- launching


@dataclass(frozen=True)
class _Args:
    model_file: str
    plan_json: str
    device_type: str
    steps: int


def _checked(model_file: str | Path, plan: Plan | str | Path, steps: int, device: str,
             peak_tolerance: float) -> tuple[Plan, _Args]:
    """The plan, loaded and checked as a per-rank plan, and what its ranks are given."""
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    if plan.sharding == "none" and plan.pipeline is None and plan.tensor_parallel == 1:
        raise BadInput("this plan is for one process (sharding none): verify it with planner.act.verify.verify")
    if steps < 1:
        raise BadInput(f"verify needs steps >= 1, got {steps}")
    if not 0 <= peak_tolerance < 1:
        raise BadInput(f"the prediction tolerance must be a fraction in [0, 1), got {peak_tolerance}")
    return plan, _Args(str(Path(model_file).resolve()), plan.to_json(), _device_type(device, plan.world_size), steps)


def _device_type(device: str, world_size: int) -> str:
    kind = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                        "cpu" if device == "auto" else device).type
    if kind not in ("cpu", "cuda"):
        raise BadInput(f"per-rank verify runs on 'cpu' (gloo) or 'cuda' (NCCL), not {device!r}")
    if kind == "cuda" and torch.cuda.device_count() < world_size:
        raise BadInput(f"the plan is for {world_size} ranks, one GPU each, but {torch.cuda.device_count()} "
                       f"GPU(s) are visible; verify on {{device}} cpu, or on a machine with {world_size} GPUs",
                       options=("device",))
    return kind


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _tp_layout(plan: Plan) -> str:
    """'tensor parallel 2', or with FSDP2 beside it 'tensor parallel 2 x FSDP2 over 2 ranks'."""
    dp = plan.world_size // plan.tensor_parallel
    return f"tensor parallel {plan.tensor_parallel}" + (f" x FSDP2 over {dp} ranks" if dp > 1 else "")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(runs: list[_Args], world_size: int) -> list[list[dict]]:
    """Each run's results, rank by rank (rank 0's with the compared step's gradients), from one set of ranks."""
    import torch.multiprocessing as mp

    with temp_dir("ranks") as tmp:  # NOTE [ Signals and children ], Rule 5
        for i in range(len(runs)):
            Path(tmp, str(i)).mkdir()
        os.environ[PARENT_ENV] = str(os.getpid())  # the spawned ranks inherit it (die_with_parent)
        context = None
        try:
            context = mp.start_processes(_child, args=(world_size, _free_port(), runs, tmp), nprocs=world_size,
                                         join=False, start_method="spawn")
            while not context.join():
                pass
        except mp.ProcessRaisedException as e:
            raise ProfileError(f"a rank failed: {rank_error(str(e))}") from None
        except mp.ProcessExitedException as e:
            raise ProfileError(f"a rank exited without finishing ({e})") from None
        finally:  # interrupted, terminated or failed: no rank outlives this call (NOTE [ Signals and children ])
            for proc in context.processes if context is not None else ():
                end(proc)
            os.environ.pop(PARENT_ENV, None)
        return [_results(Path(tmp, str(i)), world_size) for i in range(len(runs))]


def _results(out_dir: Path, world_size: int) -> list[dict]:
    results = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
    grads: dict = {}
    for path in sorted(out_dir.glob("grads*.pt")):  # grads<rank>.pt: a pipeline stage's each
        grads.update(torch.load(path, weights_only=True))
    results[0]["grads"] = grads
    return results


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|BadInput|Infeasible)\b.*?: \S")


def rank_error(text: str, limit: int = 300) -> str:
    """The first error line of a rank's traceback (a chained one's cause comes first), else its last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    line = next((ln for ln in lines if _ERROR_LINE.match(ln)), lines[-1] if lines else text)
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _child(rank: int, world_size: int, port: int, runs: list[_Args], out_dir: str) -> None:
    """One spawned rank: set up the process group, run both trainings of each run, write each's results."""
    from planner.profiling.measure import count_cpu_allocations

    die_with_parent()
    quiet_on_ctrl_c()  # NOTE [ Signals and children ], Rule 8
    # gathering a 2D (FSDP2 x tp) gradient to full size logs "2 sequential all_gather operations" per rank
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if runs[0].device_type == "cpu":
        count_cpu_allocations()  # before any tensor of the runs exists: see NOTE [ CPU peaks across threads ]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if os.uname().sysname == "Linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # no waiting on a hostname that resolves elsewhere
    torch.set_num_threads(1)
    with _rank_group(runs[0].device_type):  # one group for every run, closed once (NOTE [ Rank exit ])
        for i, args in enumerate(runs):
            result = _rank_main(args, Path(out_dir, str(i), "grads.pt"))
            atomic_write_text(Path(out_dir, str(i), f"rank{rank}.json"), json.dumps(result))


def _rank_main(args: _Args, grads_path: Path) -> dict:
    """Both trainings on this rank (rank 0 saves its compared step's full gradients to ``grads_path``)."""
    import torch.distributed as dist

    with _rank_group(args.device_type) as dev:
        plan = Plan.model_validate_json(args.plan_json)
        if plan.world_size != dist.get_world_size():
            raise BadInput(f"the plan is for {plan.world_size} ranks; this job has {dist.get_world_size()}")
        if plan.pipeline is not None:
            from planner.act.verify_stages import stage_rank_main

            result = stage_rank_main(args, plan, dev, grads_path, SEED)
        else:
            base = _rank_run(args, plan, dev, planned=False, grads_path=None)
            mine = _rank_run(args, plan, dev, planned=True, grads_path=grads_path)
            result = dict(rank=dist.get_rank(), no_plan_peak=base.peak_bytes, peak=mine.peak_bytes,
                          source=mine.source, loss=mine.loss, recomputes=mine.recomputes)
        return result


@contextlib.contextmanager
def _rank_group(device_type: str) -> Iterator[torch.device]:
    """This rank's device, inside a process group: the one there is (torchrun's, or the spawned rank's for all its
    runs), else one made here and closed on the way out (NOTE [ Rank exit ])."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    dev = torch.device(device_type)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    if created:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    finished = False
    try:
        yield dev
        finished = True
    finally:
        if created:
            _close_group(finished)  # NOTE [ Rank exit ]


# NOTE [ Rank exit ]
# A rank that leaves the process group to the interpreter's exit can abort there: gloo's worker
# threads still hold work whose tensors have Python references, and finalization destroys them
# without the GIL ("terminate called without an active exception", SIGABRT; seen once under
# torchrun after a correct report, so torchrun returned 1). DDP's reducer and FSDP2's state hold
# the group in reference cycles, so ``destroy_process_group`` alone does not free it. So every
# rank, spawned or launched by torchrun: collects the cycles once its runs are over, waits at a
# barrier for every rank to be done with the group (only when its own runs finished: a failed
# rank must not wait for ranks that wait on it; it exits, and they fail), then destroys it.


def _close_group(finished: bool) -> None:
    """Collect the cycles that hold the process group, wait for every rank when ``finished``, destroy it
    (NOTE [ Rank exit ])."""
    import torch.distributed as dist

    gc.collect()
    if finished:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()


# ----------------------------------------------------------------------------- one run on one rank


@dataclass
class _RankRun:
    peak_bytes: int
    source: str
    loss: float
    recomputes: int


def _rank_run(args: _Args, plan: Plan, dev: torch.device, *, planned: bool, grads_path: Path | None) -> _RankRun:
    import torch.distributed as dist

    from planner.act.applier import apply_plan
    from planner.profiling.measure import free, measure_rank_step, to_device
    from planner.profiling.model_file import load_model_file
    from planner.act.sharding import shard_for_plan
    from planner.profiling.step_changes import install

    mf = load_model_file(args.model_file)
    rng.seed_all(SEED)  # the same weights on every rank and in the reference
    model = mf.build_model().to(dev).train()
    batch = to_device(mf.example_inputs(), dev)
    handle = apply_plan(model, plan, inputs=batch) if planned else None
    # the step the plan was made for (NOTE [ Step changes ], Rule 2); the plan's own when unplanned
    changes = install(model, plan.step_changes, say=False, scopes=("measure",) if planned else ("train", "measure"))
    model = shard_for_plan(model, plan, device=dev)
    step, opt, loss = _compared_step(model, batch, mf.loss_fn, plan)
    if grads_path is not None:
        full = _full_grads(model)  # a collective under FSDP2: every rank calls it
        if dist.get_rank() == 0:
            torch.save(full, grads_path)  # not kept: the measured step would count them
        del full
    recomputes = handle.recompute_count if handle else 0
    for i in range(args.steps):
        rng.seed_all(SEED + 1 + i)
        step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    rng.seed_all(SEED)
    peak = measure_rank_step(step, dev)  # NOTE [ Late frees on gloo's threads ]
    run = _RankRun(peak.peak_bytes, peak.source, loss, recomputes)
    if handle:
        handle.remove()
    changes.remove()
    del model, opt, step, batch
    free(dev)
    return run


def _compared_step(model: torch.nn.Module, batch: Any, loss_fn: Any, plan: Plan) -> tuple[Any, Any, float]:
    """The plan's step (optimizer and recipe) for ``model``, run once from ``SEED``: (step, optimizer, loss)."""
    from planner.optimizers import from_file
    from planner.profiling.measure import make_optimizer, make_step

    opt = make_optimizer(from_file(plan.optimizer or "adamw", "plan"), model, impl=plan.recipe.optimizer_impl)
    step = make_step(model, batch, loss_fn=loss_fn, optimizer=opt, recipe=plan.recipe)
    losses: list[float] = []
    rng.seed_all(SEED)
    step(lambda name, value: losses.append(float(value.detach())) if name == "forward_end" else None)
    return step, opt, losses[0]


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Gradients by plain FQN, unsharded on the CPU (a collective under FSDP2: every rank calls it)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    out: dict[str, torch.Tensor | None] = {}
    for name, p in inner.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().to("cpu", copy=True)
    return out


def _reference(args: _Args) -> tuple[float, dict[str, torch.Tensor | None]]:
    """One process, the plain model, the same batch and seeds: the loss and gradients of the compared step."""
    from planner.profiling.measure import free, to_device
    from planner.profiling.model_file import load_model_file
    from planner.profiling.step_changes import install

    plan = Plan.model_validate_json(args.plan_json)
    dev = torch.device(args.device_type)
    mf = load_model_file(args.model_file)
    rng.seed_all(SEED)
    model = mf.build_model().to(dev).train()
    batch = to_device(mf.example_inputs(), dev)
    install(model, plan.step_changes, say=False, scopes=("train", "measure"))  # the step the plan was made for
    step, _opt, loss = _compared_step(model, batch, mf.loss_fn, plan)
    grads = {n: None if p.grad is None else p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    del model, step, _opt, batch
    free(dev)
    return loss, grads


def _torchrun_report(args: _Args, plan: Plan, label: str, peak_tolerance: float,
                     grad_tolerance: float) -> RanksReport:
    """Under torchrun: this rank's runs, every rank's rows gathered, rank 0's reference; the same report on all."""
    import torch.distributed as dist

    if args.device_type == "cpu":
        from planner.profiling.measure import count_cpu_allocations

        count_cpu_allocations()  # late: tensors made before now are not counted (see the NOTE)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if args.device_type == "cuda" else "gloo")
    finished = False
    try:
        with tempfile.TemporaryDirectory(prefix="remat_ranks_") as tmp:
            result = _rank_main(args, Path(tmp, "grads.pt"))
            if dist.get_rank() == 0:
                result["grads"] = torch.load(Path(tmp, "grads.pt"), weights_only=True)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {k: v for k, v in result.items() if k != "grads"})
        if dist.get_rank() == 0:
            gathered[0]["grads"] = result["grads"]
            reference = _reference(args)
            report = _report(plan, label, "torchrun", args, gathered, reference, peak_tolerance, grad_tolerance)
        else:
            report = None
        box = [report]
        dist.broadcast_object_list(box, src=0)
        finished = True
        return box[0]
    finally:
        if created:
            _close_group(finished)  # NOTE [ Rank exit ]


# ----------------------------------------------------------------------------- the report


def _report(plan: Plan, label: str, launched: str, args: _Args, results: list[dict],
            reference: tuple[float, dict[str, torch.Tensor | None]], peak_tolerance: float,
            grad_tolerance: float) -> RanksReport:
    from planner.act.compare import max_abs_diff

    rows = []
    for r in sorted(results, key=lambda x: x["rank"]):
        stage = r["rank"] * plan.pipeline.stages // plan.world_size if plan.pipeline else 0  # pp: the mesh's outer dim
        p = plan.stages[stage].predicted if plan.stages else plan.predicted  # a pipeline: the rank's stage
        no_plan = p.no_checkpoint_peak_bytes
        rows.append(RankRow(
            rank=r["rank"], stage=stage if plan.stages else None,
            tp_rank=r["rank"] % plan.tensor_parallel if plan.tensor_parallel > 1 else None,
            predicted_peak_bytes=p.peak_bytes, measured_peak_bytes=r["peak"],
            error=(p.peak_bytes - r["peak"]) / r["peak"], within_budget=r["peak"] <= plan.budget_bytes,
            predicted_no_plan_peak_bytes=no_plan, measured_no_plan_peak_bytes=r["no_plan_peak"],
            no_plan_error=None if no_plan is None else (no_plan - r["no_plan_peak"]) / r["no_plan_peak"],
            recomputes=r["recomputes"]))
    ref_loss, ref_grads = reference
    grad_diff = max_abs_diff(ref_grads, results[0]["grads"])
    loss_diff = abs(max(results, key=lambda x: x["rank"])["loss"] - ref_loss) if plan.stages else \
        abs(results[0]["loss"] - ref_loss)  # a pipeline's loss is its last stage's
    problems = []
    for row in rows:
        if not row.within_budget:
            problems.append(f"rank {row.rank}: measured peak {format_bytes(row.measured_peak_bytes)} is over the "
                            f"budget {format_bytes(plan.budget_bytes)}")
        if abs(row.error) > peak_tolerance:
            problems.append(f"rank {row.rank}: predicted {format_bytes(row.predicted_peak_bytes)}, measured "
                            f"{format_bytes(row.measured_peak_bytes)} ({row.error:+.2%}, tolerance "
                            f"{peak_tolerance:.2%})")
    if grad_diff > grad_tolerance:
        problems.append(f"gradients differ from one process's by up to {grad_diff:.3g} (tolerance {grad_tolerance:g})")
    return RanksReport(
        model=label, device=args.device_type, world_size=plan.world_size,
        sharding=(f"pipeline {plan.pipeline.schedule}, {plan.pipeline.micro_batches} micro-batches"
                  + (f", tensor parallel {plan.tensor_parallel}" if plan.tensor_parallel > 1 else "")
                  + (f", {plan.sharding.upper()} over the stage's data-parallel ranks" if plan.sharding != "none" else "")
                  if plan.pipeline is not None else _tp_layout(plan) if plan.tensor_parallel > 1 else plan.sharding),
        fsdp_units=plan.fsdp_units, launched=launched, peak_source=results[0]["source"], steps=args.steps,
        budget_bytes=plan.budget_bytes, peak_tolerance=peak_tolerance, grad_tolerance=grad_tolerance,
        rows=rows, loss_diff=loss_diff, max_grad_diff=grad_diff, problems=problems, notes=[], ok=not problems)


__all__ = ["RankRow", "RanksReport", "SEED", "verify_ranks", "verify_ranks_together"]
