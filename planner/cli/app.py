"""remat: plan activation checkpointing for a PyTorch training step within a memory budget.

Commands to paste (from a checkout, ``python cli.py`` works wherever ``remat`` does)::

    remat plan --budget 2GB examples/gpt2.py                      # profile on this machine, plan, show
    remat plan --budget 2GB examples/gpt2.py -o plan.json         # ... and save the plan
    remat profile examples/gpt2.py -o profile.json --steps 2      # measure once ...
    remat plan --budget 300MB --profile profile.json --json       # ... plan many times, no torch run
    remat show plan.json                                          # a plan (or a profile) as tables
    remat verify examples/gpt2.py plan.json                       # predicted vs measured, exit 1 if off
    remat frontier examples/gpt2.py --plot frontier.png           # recompute vs peak over all budgets
    remat compare --budget 150MB --profile profile.json           # all solvers and baselines at one budget
    remat plan --device meta --target h100 examples/llama7b.py    # a 7B model planned without a GPU (seconds)
    remat plan --budget 40GB --hf config.json --batch 8 --seq-len 2048   # a Hugging Face config, no model.py
    remat devices                                                 # known accelerators

Results go to stdout, logs and progress to stderr; ``--quiet`` silences the latter and
``--json`` makes stdout machine-readable. Exit codes: 0 ok, 1 no plan fits / verification
failed / internal error, 2 bad input or usage, 130 interrupted. See docs/cli.md.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from planner.cli import render
from planner.errors import OOM_HINT, BadInput, PlanMismatch, ProfileError, RematError, VerificationFailed
from planner.options import parse_amp, parse_optimizer, parse_sharding

app = typer.Typer(
    name="remat",
    help="Plan activation checkpointing for a PyTorch training step within a memory budget.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

DEVICES = ("auto", "cpu", "cuda", "meta")
FLAGS = {"budget": "--budget", "granularity": "--granularity", "sharding": "--sharding", "solver": "--solver",
         "time_limit_s": "--time-limit"}
"""Library parameters a ``RematError`` may name (its ``options``), as this command line spells them."""

# ----------------------------------------------------------------------------- shared options

Debug = Annotated[bool, typer.Option("--debug", help="Show the full traceback of any error.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Only the result: no logs or progress on stderr.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout, not tables.")]
Steps = Annotated[int, typer.Option("--steps", min=1, help="Training steps measured (after a warm-up step).")]
Threads = Annotated[int | None, typer.Option(
    "--threads", min=1, show_default=False,
    help="torch intra-op threads for the measured steps (default: torch's). On the CPU, 1 times each "
         "unit by the thread's CPU time, which other processes on the machine do not change.")]


def _device_option(value: str) -> str:
    v = value.strip().lower()
    if v in DEVICES or (v.startswith("cuda:") and v[5:].isdigit()):
        return v
    raise typer.BadParameter(f"unknown device {value!r}; choose one of {', '.join(DEVICES)} or cuda:N "
                             f"(meta: no memory used, times modelled)")


Device = Annotated[str, typer.Option(
    "--device", callback=_device_option,
    help="Where to run the step: auto (cuda if available, else cpu), cpu, cuda[:N], meta.")]


def _checked(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A typer callback from a ``planner.options`` check: its ``BadInput`` becomes a usage error."""

    def callback(value: Any) -> Any:
        try:
            return parse(value)
        except BadInput as e:
            raise typer.BadParameter(str(e)) from None

    return callback


Optimizer = Annotated[str, typer.Option(
    "--optimizer", callback=_checked(parse_optimizer),
    help="Optimizer whose state is counted in the peak: adamw, adam, sgd, none.")]


Amp = Annotated[str | None, typer.Option(
    "--amp", callback=_checked(parse_amp), show_default=False,
    help="Mixed precision: bf16 or fp16 (torch.autocast around forward and loss; with --device meta, "
         "for the target). Default: the model's own dtype.")]
Target = Annotated[str | None, typer.Option(
    "--target", show_default=False,
    help="Device spec (remat devices; aliases, any case): --device meta models times for it; without "
         "--budget, the budget is its usable memory.")]
GradAccum = Annotated[int, typer.Option(
    "--grad-accum", min=1, help="Micro-batches per optimizer step (gradient accumulation); the plan is for "
                                "the worst one, with the earlier ones' gradients alive.")]
SetToNone = Annotated[bool, typer.Option(
    "--zero-grad-set-to-none/--no-zero-grad-set-to-none",
    help="optimizer.zero_grad(set_to_none=...): PyTorch's default frees the gradients; --no-... keeps them "
         "(zeroed) alive all step.")]
ClipGradNorm = Annotated[float | None, typer.Option(
    "--clip-grad-norm", show_default=False,
    help="clip_grad_norm_(max_norm) before the optimizer step; its temporaries count at the step.")]
Fused = Annotated[bool, typer.Option("--fused", help="The optimizer with fused=True.")]
Foreach = Annotated[bool, typer.Option("--foreach", help="The optimizer with foreach=True.")]
WorldSize = Annotated[int, typer.Option(
    "--world-size", min=1, help="Data-parallel ranks; the budget and the peak are per rank (> 1 needs "
                                "--sharding ddp or fsdp). See docs/distributed.md.")]
DeviceMemory = Annotated[str | None, typer.Option(
    "--device-memory", envvar="REMAT_DEVICE_MEMORY", show_default=False,
    help="Memory the device may use (12GB, 150MiB; env REMAT_DEVICE_MEMORY): a step that does not fit is "
         "profiled with its candidates checkpointed (a memory-safe profile). CUDA: a per-process cap; "
         "CPU: profiled in a child process whose address space is capped.")]
Sharding = Annotated[str, typer.Option(
    "--sharding", callback=_checked(parse_sharding),
    help="How the ranks hold the model: none (one process), ddp (a full replica plus gradient buckets), "
         "fsdp (FSDP2 on every block and the root: sharded, all-gathered per block).")]


HfConfig = Annotated[Path | None, typer.Option(
    "--hf", help="A Hugging Face config.json (or its folder) instead of MODEL.py: the model of its "
                 "architectures (or --task) with the library's defaults, on a random batch of --batch rows "
                 "of --seq-len tokens (or images of the config's size).", show_default=False)]
Batch = Annotated[int | None, typer.Option("--batch", min=1, help="With --hf: rows per batch.",
                                           show_default=False)]
SeqLen = Annotated[int | None, typer.Option("--seq-len", min=1, help="With --hf: tokens per row (text models).",
                                            show_default=False)]
Task = Annotated[str | None, typer.Option(
    "--task", help="With --hf: causal-lm, seq2seq, masked-lm or classification; default: the config's "
                   "architectures.", show_default=False)]


# ----------------------------------------------------------------------------- errors

# NOTE [ CLI errors and exit codes ]
#
# Every command runs inside ``_guarded``, the one place that turns failures into output:
#   - RematError (and subclasses): "error: <message>" on stderr, exit ``err.exit_code``
#     (2 bad input, 1 no plan fits / verification failed). PlanMismatch adds its differences.
#   - KeyboardInterrupt: "interrupted", exit 130. Files are written last and atomically
#     (planner.model.schema.atomic_write_text), so an interrupted run leaves nothing behind.
#   - anything else is a bug in remat: "internal error: ...", exit 1.
# Tracebacks only with --debug. Usage errors (unknown option, bad --device) are typer's:
# exit 2 with the usage line.


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command so that errors end as one line and an exit code (see NOTE above)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        debug = bool(kwargs.get("debug", False))
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.BadParameter):
            raise
        except KeyboardInterrupt:
            _traceback(debug)
            render.error_line("nothing was written", prefix="interrupted")
            raise typer.Exit(130) from None
        except RematError as e:
            _traceback(debug)
            message = e.worded(FLAGS)
            if isinstance(e, PlanMismatch) and e.differences and e.differences[0] not in message:
                message += "\n  " + "\n  ".join(e.differences)
            render.error_line(message)
            raise typer.Exit(e.exit_code) from None
        except Exception as e:  # noqa: BLE001 -- a bug in remat: one line unless --debug
            _traceback(debug)
            if _is_oom(e):
                render.error_line(f"out of memory ({type(e).__name__}): {OOM_HINT}")
                raise typer.Exit(ProfileError.exit_code) from None
            hint = "" if debug else "; rerun with --debug for the traceback"
            render.error_line(f"{type(e).__name__}: {e}{hint}", prefix="internal error")
            raise typer.Exit(1) from None

    return wrapper


def _traceback(debug: bool) -> None:
    if debug:
        traceback.print_exc(file=sys.stderr)


def _is_oom(e: BaseException) -> bool:
    """planner.profiling.measure.is_oom without importing torch: CUDA's OutOfMemoryError (torch's and
    torch.cuda's share the name), the CPU allocator's RuntimeError, Python's MemoryError."""
    return (type(e).__name__ == "OutOfMemoryError" or isinstance(e, MemoryError)
            or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)))


def command(name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``@app.command`` with the error handling of NOTE [ CLI errors and exit codes ]."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        app.command(name)(_guarded(fn))
        return fn

    return deco


# ----------------------------------------------------------------------------- plan


@command("plan")
def plan_cmd(
    model: Annotated[Path | None, typer.Argument(
        help="model.py defining build_model() and example_inputs(); optional with --profile.",
        metavar="MODEL.py", show_default=False)] = None,
    budget: Annotated[str | None, typer.Option(
        "--budget", "-b", help="Memory budget: 12GB, 12GiB, 800MiB, 1.5e9 (GB = GiB). Default with "
                               "--target: the target's usable memory.",
        show_default=False)] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the plan here (atomic). Without it nothing is written.")] = None,
    solver: Annotated[str, typer.Option(
        "--solver", help="auto, dp, ilp, sqrt, sqrt-greedy, all, every-2 or none.")] = "auto",
    device: Device = "auto",
    device_memory: DeviceMemory = None,
    target: Target = None,
    amp: Amp = None,
    optimizer: Optimizer = "adamw",
    profile: Annotated[Path | None, typer.Option(
        "--profile", help="Plan on a saved profile: nothing is run.")] = None,
    granularity: Annotated[int, typer.Option(
        "--granularity", min=0, help="Candidate levels below the repeated blocks (0 = blocks).")] = 0,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", min=0.001, help="Seconds the ILP may search; then its best plan is kept.")] = 60.0,
    no_selective: Annotated[bool, typer.Option(
        "--no-selective", help="Whole modules only: no op-level (selective) checkpointing policies.")] = False,
    steps: Steps = 3,
    threads: Threads = None,
    headroom: Annotated[str, typer.Option(
        "--headroom", help="Part of the budget kept free, for what the cost model cannot see: "
                           "0.5%, 2% or a fraction such as 0.01; auto: from the zoo's evidence, by how the "
                           "profile was made (0.5% measured, 1.5% under autocast, 7% on --device meta).")] = "auto",
    world_size: WorldSize = 1,
    sharding: Sharding = "none",
    hf: HfConfig = None,
    batch: Batch = None,
    seq_len: SeqLen = None,
    task: Task = None,
    grad_accum: GradAccum = 1,
    zero_grad_set_to_none: SetToNone = True,
    clip_grad_norm: ClipGradNorm = None,
    fused: Fused = False,
    foreach: Foreach = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Find the checkpoint set that fits --budget with the least recompute."""
    from planner.act.api import graph_for, plan_from_profile
    from planner.sizes import parse_bytes

    out, log = render.consoles(quiet=quiet)
    budget, budget_bytes = _budget_or_target(budget, target, parse_bytes)
    _need_source(model, profile, hf, "remat plan --budget 12GB model.py", "remat plan --budget 12GB --profile profile.json")
    _check_solver(solver)
    _check_output(output)
    _check_ranks(world_size, sharding)
    recipe = _recipe(amp, grad_accum, zero_grad_set_to_none, clip_grad_norm, fused, foreach, optimizer)
    render.plain(log if as_json else out, render.budget_line(budget, budget_bytes))
    if hf is not None and recipe.clip_grad_norm is None and recipe.optimizer_impl == "default":
        render.plain(log, TRAINER_NOTE)
    source = _model_source(model, hf=hf, batch=batch, seq_len=seq_len, task=task)
    prof = _profile_source(source, profile, device=device, optimizer=optimizer, steps=steps, log=log,
                           target=target, recipe=recipe, threads=threads, device_memory=device_memory)
    graph = graph_for(prof, solver=solver, granularity=granularity, world_size=world_size, sharding=sharding,
                      selective=not no_selective)
    render.plain(log, f"solving with {solver} over {graph.number_of_nodes()} candidates ...")
    plan = plan_from_profile(prof, budget_bytes, solver=solver, granularity=granularity,
                             time_limit_s=time_limit, headroom=_headroom(headroom), graph=graph)
    if output is not None:
        plan.save(output)
    if as_json:
        render.print_json(plan)
        if output is not None:
            render.plain(log, render.written_line(output))
    else:
        render.show_plan(out, plan, graph=graph, fresh=True, written=output)


# ----------------------------------------------------------------------------- profile


@command("profile")
def profile_cmd(
    model: Annotated[Path | None, typer.Argument(
        help="model.py defining build_model() and example_inputs(); or use --hf.", metavar="MODEL.py",
        show_default=False)] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the profile here (atomic). Without it nothing is written.")] = None,
    device: Device = "auto",
    device_memory: DeviceMemory = None,
    target: Target = None,
    amp: Amp = None,
    optimizer: Optimizer = "adamw",
    steps: Steps = 3,
    threads: Threads = None,
    hf: HfConfig = None,
    batch: Batch = None,
    seq_len: SeqLen = None,
    task: Task = None,
    grad_accum: GradAccum = 1,
    zero_grad_set_to_none: SetToNone = True,
    clip_grad_norm: ClipGradNorm = None,
    fused: Fused = False,
    foreach: Foreach = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Measure one training step of model.py: module times, saved tensors, memory timeline."""
    from planner.act.api import graph_for

    out, log = render.consoles(quiet=quiet)
    _check_output(output)
    source = _model_source(model, hf=hf, batch=batch, seq_len=seq_len, task=task)
    if source is None:
        raise BadInput("give a model file (remat profile model.py) or a Hugging Face config "
                       "(remat profile --hf config.json --batch 8 --seq-len 2048)")
    recipe = _recipe(amp, grad_accum, zero_grad_set_to_none, clip_grad_norm, fused, foreach, optimizer)
    prof = _run_profiler(source, device=device, optimizer=optimizer, steps=steps, log=log, target=target,
                         recipe=recipe, threads=threads, device_memory=device_memory)
    if output is not None:
        prof.save(output)
    if as_json:
        render.print_json(prof)
        if output is not None:
            render.plain(log, render.written_line(output, "profile"))
    else:
        render.show_profile(out, prof, graph_for(prof), fresh=True, written=output)


# ----------------------------------------------------------------------------- frontier


Solvers = Annotated[str | None, typer.Option(
    "--solvers", help="Comma-separated solvers to run (default: the optimal one, sqrt-greedy, sqrt); "
                      "the baselines none, all, every-2/3/4 always run.", show_default=False)]
Granularity = Annotated[int, typer.Option(
    "--granularity", min=0, help="Candidate levels below the repeated blocks (0 = blocks).")]
TimeLimit = Annotated[float, typer.Option(
    "--time-limit", min=0.001, help="Seconds the ILP may search at each budget.")]
ProfileFile = Annotated[Path | None, typer.Option("--profile", help="Use a saved profile: nothing is run.")]
ModelArg = Annotated[Path | None, typer.Argument(
    help="model.py defining build_model() and example_inputs(); optional with --profile.",
    metavar="MODEL.py", show_default=False)]


@command("frontier")
def frontier_cmd(
    model: ModelArg = None,
    points: Annotated[int, typer.Option(
        "--points", min=1, help="Budgets swept, evenly spaced from the lowest feasible peak to the "
                                "peak without checkpointing.")] = 12,
    plot: Annotated[Path | None, typer.Option(
        "--plot", help="Draw the trade-off to this PNG (needs: pip install 'remat\\[plot]').")] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the points as JSON here (atomic).")] = None,
    profile: ProfileFile = None,
    device: Device = "auto",
    device_memory: DeviceMemory = None,
    optimizer: Optimizer = "adamw",
    steps: Steps = 3,
    threads: Threads = None,
    target: Target = None,
    amp: Amp = None,
    granularity: Granularity = 0,
    solvers: Solvers = None,
    time_limit: TimeLimit = 30.0,
    world_size: WorldSize = 1,
    sharding: Sharding = "none",
    hf: HfConfig = None,
    batch: Batch = None,
    seq_len: SeqLen = None,
    task: Task = None,
    grad_accum: GradAccum = 1,
    zero_grad_set_to_none: SetToNone = True,
    clip_grad_norm: ClipGradNorm = None,
    fused: Fused = False,
    foreach: Foreach = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Sweep budgets: recompute and peak of every solver and baseline, as a table, JSON or a plot."""
    import time

    from planner.act.frontier import frontier, tradeoff
    from planner.model.schema import atomic_write_text

    out, log = render.consoles(quiet=quiet)
    names = _solver_list(solvers)
    _need_source(model, profile, hf, "remat frontier model.py", "remat frontier --profile profile.json")
    _check_ranks(world_size, sharding)
    _check_output(output)
    _check_output(plot)
    if plot is not None:
        from planner.cli.plot import require_matplotlib

        require_matplotlib()  # before minutes of profiling, not after
    recipe = _recipe(amp, grad_accum, zero_grad_set_to_none, clip_grad_norm, fused, foreach, optimizer)
    source = _model_source(model, hf=hf, batch=batch, seq_len=seq_len, task=task)
    prof = _profile_source(source, profile, device=device, optimizer=optimizer, steps=steps, log=log,
                           target=target, recipe=recipe, threads=threads, device_memory=device_memory)
    graph = _graph(prof, names, granularity, world_size=world_size, sharding=sharding)
    t0 = time.perf_counter()
    with render.counter(log, f"sweeping {points} budgets") as tick:
        pts = frontier(graph, points=points, solvers=names, time_limit_s=time_limit, progress=tick)
    report = tradeoff(graph, pts, kind="remat-frontier", model=prof.fingerprint.model_class,
                      device=_device_text(prof), seconds=time.perf_counter() - t0)
    budgets = len({p.budget_bytes for p in pts})
    render.plain(log, f"swept {budgets} budgets x {len(pts) // max(budgets, 1)} solvers and baselines "
                      f"({len(pts)} plans) in {report.seconds:.2f} s")
    written = []
    if output is not None:
        written.append(atomic_write_text(output, render.json_text(report)))
    if plot is not None:
        from planner.cli.plot import plot_frontier

        written.append(plot_frontier(report, plot))
    if as_json:
        render.print_json(report)
        for path in written:
            render.plain(log, render.written_line(path))
    else:
        render.show_frontier(out, report, written=written)


# ----------------------------------------------------------------------------- compare


@command("compare")
def compare_cmd(
    model: ModelArg = None,
    budget: Annotated[str | None, typer.Option(
        "--budget", "-b", help="Memory budget: 12GB, 12GiB, 800MiB, 1.5e9 (GB = GiB). Default with "
                               "--target: the target's usable memory.", show_default=False)] = None,
    profile: ProfileFile = None,
    device: Device = "auto",
    device_memory: DeviceMemory = None,
    optimizer: Optimizer = "adamw",
    steps: Steps = 3,
    threads: Threads = None,
    target: Target = None,
    amp: Amp = None,
    granularity: Granularity = 0,
    solvers: Solvers = None,
    time_limit: TimeLimit = 60.0,
    world_size: WorldSize = 1,
    sharding: Sharding = "none",
    hf: HfConfig = None,
    batch: Batch = None,
    seq_len: SeqLen = None,
    task: Task = None,
    grad_accum: GradAccum = 1,
    zero_grad_set_to_none: SetToNone = True,
    clip_grad_norm: ClipGradNorm = None,
    fused: Fused = False,
    foreach: Foreach = False,
    as_json: AsJson = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Every solver and baseline side by side at one budget: peak, recompute, what fits."""
    import time

    from planner.act.frontier import compare, tradeoff
    from planner.sizes import parse_bytes

    out, log = render.consoles(quiet=quiet)
    budget, budget_bytes = _budget_or_target(budget, target, parse_bytes)
    names = _solver_list(solvers)
    _need_source(model, profile, hf, "remat compare --budget 2GB model.py",
                 "remat compare --budget 2GB --profile profile.json")
    _check_ranks(world_size, sharding)
    render.plain(log if as_json else out, render.budget_line(budget, budget_bytes))
    recipe = _recipe(amp, grad_accum, zero_grad_set_to_none, clip_grad_norm, fused, foreach, optimizer)
    source = _model_source(model, hf=hf, batch=batch, seq_len=seq_len, task=task)
    prof = _profile_source(source, profile, device=device, optimizer=optimizer, steps=steps, log=log,
                           target=target, recipe=recipe, threads=threads, device_memory=device_memory)
    graph = _graph(prof, names, granularity, world_size=world_size, sharding=sharding)
    t0 = time.perf_counter()
    pts = compare(graph, budget_bytes, solvers=names, time_limit_s=time_limit)
    report = tradeoff(graph, pts, kind="remat-compare", model=prof.fingerprint.model_class,
                      device=_device_text(prof), budget_bytes=budget_bytes,
                      seconds=time.perf_counter() - t0)
    render.print_json(report) if as_json else render.show_compare(out, report)


# ----------------------------------------------------------------------------- show


@command("show")
def show_cmd(
    path: Annotated[Path, typer.Argument(help="A plan or profile JSON file.", metavar="FILE")],
    as_json: AsJson = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Show a plan file (or a profile file) as tables."""
    from planner.act.api import graph_for
    from planner.model.schema import Plan, Profile

    out, _ = render.consoles(quiet=quiet)
    if _file_kind(path) == "remat-profile":
        prof = Profile.load(path)
        render.print_json(prof) if as_json else render.show_profile(out, prof, graph_for(prof))
    else:
        plan = Plan.load(path)
        render.print_json(plan) if as_json else render.show_plan(out, plan)


# ----------------------------------------------------------------------------- verify


@command("verify")
def verify_cmd(
    model: Annotated[Path | None, typer.Argument(
        help="model.py the plan was made for (with --hf: the plan).", metavar="MODEL.py",
        show_default=False)] = None,
    plan: Annotated[Path | None, typer.Argument(help="The plan file to check.", metavar="PLAN.json",
                                                show_default=False)] = None,
    steps: Steps = 3,
    threads: Threads = None,
    device: Device = "auto",
    hf: HfConfig = None,
    batch: Batch = None,
    seq_len: SeqLen = None,
    task: Task = None,
    tolerance: Annotated[str, typer.Option(
        "--tolerance", help="Largest |predicted - measured| / measured peak before verify fails: 2%, 0.5% or "
                            "a fraction such as 0.02.")] = "2%",
    as_json: AsJson = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Train with and without the plan; compare measured peak, time and gradients with the prediction."""
    from planner.act.verify import verify

    out, log = render.consoles(quiet=quiet)
    if hf is not None and plan is None:  # remat verify --hf config.json plan.json
        model, plan = None, model
    if plan is None:
        raise BadInput("give the model and the plan: remat verify model.py plan.json "
                       "(or remat verify --hf config.json --batch 8 --seq-len 2048 plan.json)")
    source = _model_source(model, hf=hf, batch=batch, seq_len=seq_len, task=task)
    if source is None:
        raise BadInput("give the model file the plan was made for: remat verify model.py plan.json")
    report = verify(source, plan, steps=steps, device=device, threads=threads, progress=_progress(log),
                    prediction_tolerance=_fraction(tolerance, "--tolerance"))
    per_rank = getattr(report, "launched", None) is not None
    if per_rank and report.launched == "torchrun" and os.environ.get("RANK", "0") != "0":
        pass  # every rank has the report; rank 0 prints it
    elif as_json:
        render.print_json(report)
    elif per_rank:
        render.show_rank_verify(out, report)
    else:
        render.show_verify(out, report)
    if not report.ok:
        raise VerificationFailed("the plan failed verification: " + "; ".join(report.problems))


# ----------------------------------------------------------------------------- devices


@command("devices")
def devices_cmd(as_json: AsJson = False, quiet: Quiet = False, debug: Debug = False) -> None:
    """List the accelerators remat knows (profiles/devices/*.json), with the memory a plan may use."""
    from planner.profiling.devices import load_devices, reserve_bytes, usable_bytes

    out, _ = render.consoles(quiet=quiet)
    specs = load_devices()
    if as_json:
        render.print_json([{**s.model_dump(mode="json"), "reserve_bytes": reserve_bytes(s),
                            "usable_bytes": usable_bytes(s)} for s in specs])
    else:
        render.show_devices(out, specs)


# ----------------------------------------------------------------------------- helpers


def _budget(text: str, parse: Callable[[str], int]) -> int:
    try:
        return parse(text)
    except BadInput as e:
        raise BadInput(f"--budget: {e}") from None


def _headroom(text: str) -> float | None:
    """--headroom: 'auto' (None: ``planner.act.api.headroom_for``) or a fraction."""
    return None if text.strip().lower() == "auto" else _fraction(text, "--headroom")


def _fraction(text: str, option: str) -> float:
    """'0.5%' or '0.005' -> 0.005; BadInput naming the option otherwise."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise BadInput(f"{option} {text!r} is not a fraction; use e.g. 0.5% or 0.005") from None
    if not 0 <= value < 0.5:
        raise BadInput(f"{option} {text!r} must be between 0% and 50%")
    return value


def _check_solver(name: str) -> None:
    from solvers import available

    names = available()
    if name not in names:
        raise BadInput(f"unknown solver {name!r}; choose one of: {', '.join(names)}")


def _solver_list(text: str | None) -> list[str] | None:
    """``--solvers a,b``: validated names, baselines dropped (they always run); None: the default set."""
    from planner.act.frontier import BASELINES
    from solvers import available

    if text is None:
        return None
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names:
        raise BadInput("--solvers: give at least one solver name, e.g. --solvers dp,sqrt")
    known = available()
    for n in names:
        if n not in known and n not in BASELINES:
            raise BadInput(f"--solvers: unknown solver {n!r}; choose from: {', '.join(known)}")
    return [n for n in dict.fromkeys(names) if n not in BASELINES]


def _device_text(prof: Any) -> str:
    """``cpu (x86_64)``, ``cuda (NVIDIA H100 80GB HBM3)``: the device kind and what it was."""
    name = prof.device_name
    return f"{prof.device} ({name})" if name and name != prof.device else prof.device


def _need_source(model: Path | None, profile: Path | None, hf: Path | None, with_model: str,
                 with_profile: str) -> None:
    if profile is None and model is None and hf is None:
        raise BadInput(f"give a model file ({with_model}), a Hugging Face config (--hf config.json --batch 8 "
                       f"--seq-len 2048) or a saved profile ({with_profile})")


TRAINER_NOTE = ("note: a Hugging Face Trainer clips gradients at norm 1.0 (max_grad_norm) and, with torch 2.8 or "
                "later, uses fused AdamW by default: for its RematCallback, plan that step with --clip-grad-norm 1 "
                "--fused (planner.integrations.hf.training_recipe(args) gives the step of any TrainingArguments)")
"""Printed by ``remat plan --hf`` without step options: the Trainer would refuse the plain loop's plan."""


def _model_source(model: Path | None, *, hf: Path | None, batch: int | None, seq_len: int | None,
                  task: str | None) -> Any:
    """The ``ModelFile`` of MODEL.py or of ``--hf config.json``; None when neither is given."""
    from planner.profiling.model_file import load_model_file

    if hf is None:
        given = [name for name, value in (("--batch", batch), ("--seq-len", seq_len), ("--task", task)) if value]
        if given:
            raise BadInput(f"{', '.join(given)} only apply with --hf config.json (a model file makes its own "
                           f"inputs in example_inputs())")
        return None if model is None else load_model_file(model)
    if model is not None:
        raise BadInput(f"give either a model file ({model}) or --hf {hf}, not both")
    if batch is None:
        raise BadInput("--hf needs --batch N: the rows of the batch to plan for (plan at the largest "
                       "batch the job will see)")
    from planner.integrations.hf_config import load_hf_config

    return load_hf_config(hf, batch_size=batch, seq_len=seq_len, task=task.strip().lower() if task else None)


def _graph(prof: Any, names: list[str] | None, granularity: int, *, world_size: int = 1,
           sharding: str = "none") -> Any:
    """One candidate graph for all solvers of a sweep: nested only when every solver handles it."""
    from planner.act.api import graph_for
    from planner.act.frontier import OPTIMAL_SOLVERS, default_solvers

    names = names if names is not None else default_solvers()
    optimal = next((n for n in names if n in OPTIMAL_SOLVERS), "dp")
    graph = graph_for(prof, solver=optimal, granularity=granularity, world_size=world_size, sharding=sharding)
    if "dp" in names and any(not a["leaf"] for _, a in graph.nodes(data=True)):  # the DP runs on chains
        raise BadInput(f"--granularity {granularity} with {optimal} gives nested candidates, which dp "
                       f"cannot plan; drop dp from --solvers or use --granularity 0")
    return graph


def _check_ranks(world_size: int, sharding: str) -> None:
    """--world-size with --sharding, checked before any profiling (see docs/distributed.md)."""
    from planner.act.api import check_ranks

    try:
        check_ranks(world_size, sharding)
    except BadInput as e:
        raise BadInput(f"--world-size/--sharding: {e.worded(FLAGS)}") from None


def _check_output(path: Path | None) -> None:
    """Fail before minutes of profiling, not after, when ``path`` cannot be written.

    The write itself goes through ``atomic_write_text``; this only probes the folder.
    """
    if path is not None:
        from planner.model.schema import check_writable

        check_writable(path)


def _file_kind(path: Path) -> str | None:
    """The ``kind`` a JSON file declares, or None; loading reports what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data.get("kind") if isinstance(data, dict) else None


def _profile_source(model: Any, profile: Path | None, *, device: str, optimizer: str, steps: int,
                    log: Any, target: str | None = None, recipe: Any = None, threads: int | None = None,
                    device_memory: str | None = None) -> Any:
    """The profile to plan on: loaded from --profile, else measured by running ``model`` (a ModelFile).

    A saved profile measured one recipe: recipe options other than the defaults must match it.
    """
    from planner.model.schema import Profile, Recipe

    if profile is None:
        return _run_profiler(model, device=device, optimizer=optimizer, steps=steps, log=log, target=target,
                             recipe=recipe, threads=threads, device_memory=device_memory)
    prof = Profile.load(profile)
    if recipe is not None and recipe != Recipe() and recipe != prof.recipe:
        raise BadInput(f"{profile} was measured for another training step ("
                       + "; ".join(prof.recipe.differences(recipe)).replace("training uses", "options give")
                       + f"): re-profile with these options, or drop them to plan its recipe")
    if model is not None:
        _check_profile_matches(prof, model)
    return prof


def _check_profile_matches(prof: Any, mf: Any) -> None:
    """With both --profile and a model: build the model (no step is run) and compare fingerprints."""
    from planner.model.fingerprint import fingerprint
    from planner.profiling.meta import build_on_meta

    model_path = mf.path
    # shapes and names are all a fingerprint needs: build on the meta device (a 7B model costs nothing)
    diffs = prof.fingerprint.differences(fingerprint(build_on_meta(mf.build_model), mf.example_inputs()))
    if diffs:
        listing = "\n  ".join(diffs)
        raise PlanMismatch(f"the profile was made for another model or input shapes:\n  {listing}\n"
                           f"re-profile: remat profile {_profile_args(model_path)} -o profile.json", diffs)


def _profile_args(path: Path) -> str:
    """How ``remat profile`` names this model: the model file, or --hf with its config."""
    return str(path) if path.suffix == ".py" else f"--hf {path} --batch N --seq-len N"


def _run_profiler(mf: Any, *, device: str, optimizer: str, steps: int, log: Any, target: str | None = None,
                  recipe: Any = None, threads: int | None = None, device_memory: str | None = None) -> Any:
    from planner.model.schema import Recipe
    from planner.profiling import profile
    from planner.profiling.memsafe import profile_within
    from planner.profiling.meta import build_on_meta
    from planner.profiling.profiler import resolve_device

    meta = device == "meta"
    if meta and target is None:
        from planner.profiling.devices import load_devices

        raise BadInput(f"--device meta models times for a target device: add --target NAME, one of: "
                       f"{', '.join(s.name for s in load_devices())}")
    cap = _device_memory(device_memory, meta)
    amp = recipe.amp if recipe is not None else None
    plain = recipe is None or recipe == Recipe(amp=amp)
    if cap is not None and not plain:
        raise BadInput("--device-memory measures the plain training step (with --amp) for now; drop it, or drop "
                       "--grad-accum/--no-zero-grad-set-to-none/--clip-grad-norm/--fused/--foreach")
    if cap is not None and resolve_device(device).type == "cpu":
        from planner.profiling.capped import profile_capped

        if mf.path.suffix != ".py":  # the child process imports a model file
            raise BadInput("--device-memory on the CPU profiles a model file in a child process; with --hf, "
                           "write a model.py that builds the model (or drop --device-memory)")
        render.plain(log, f"profiling {mf.path} on cpu within {cap} bytes (a capped child process) ...")
        return profile_capped(mf.path, device_memory_bytes=cap, optimizer=optimizer, steps=steps, amp=amp,
                              threads=threads, quiet=log.quiet)
    # stages the profiler announces: a warm-up step, the timing steps, the memory step, the peak,
    # the validation step (meta: a warm-up step and one memory-and-roofline step on fake tensors)
    title = f"profiling {mf.path} on fake tensors for {target}" if meta else f"profiling {mf.path} on {device} ({steps} steps)"
    with render.stages(log, f"{title} ...", total=2 if meta else steps + 4) as say:
        net = build_on_meta(mf.build_model) if meta else mf.build_model()
        if meta or not plain:  # the memory-safe profile measures the plain step (with amp) only
            return profile(net, mf.example_inputs(), loss_fn=mf.loss_fn, device=device, optimizer=optimizer,
                           steps=steps, recipe=recipe, target=target if meta else None, threads=threads,
                           progress=say)
        # a step that does not fit (cap, or out of memory) is measured under checkpointing (planner/profiling/memsafe.py)
        return profile_within(net, mf.example_inputs(), device_memory_bytes=cap, loss_fn=mf.loss_fn,
                              device=device, optimizer=optimizer, steps=steps, amp=amp, threads=threads,
                              progress=say)


def _device_memory(text: str | None, meta: bool) -> int | None:
    """--device-memory (or REMAT_DEVICE_MEMORY) in bytes; None when not given."""
    from planner.sizes import parse_bytes

    if text is None or not text.strip():
        return None
    if meta:
        raise BadInput("--device-memory caps a device that runs the step; --device meta runs nothing (drop one)")
    try:
        value = parse_bytes(text)
    except BadInput as e:
        raise BadInput(f"--device-memory: {e}") from None
    if value <= 0:
        raise BadInput(f"--device-memory must be positive, got {text!r}")
    return value


def _recipe(amp: str | None, grad_accum: int, set_to_none: bool, clip_grad_norm: float | None, fused: bool,
            foreach: bool, optimizer: str) -> Any:
    """The training step the options describe (``schema.Recipe``), checked before any profiling."""
    from planner.model.schema import Recipe

    if fused and foreach:
        raise BadInput("--fused and --foreach are two implementations of one optimizer: give one of them")
    if (fused or foreach) and optimizer == "none":
        raise BadInput(f"--{'fused' if fused else 'foreach'} chooses the optimizer's implementation, but "
                       f"--optimizer is none: drop it or pick an optimizer")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise BadInput(f"--clip-grad-norm must be a positive max norm, got {clip_grad_norm:g}")
    impl = "fused" if fused else "foreach" if foreach else "default"
    return Recipe(grad_accum=grad_accum, zero_grad_set_to_none=set_to_none, amp=amp,
                  clip_grad_norm=clip_grad_norm, optimizer_impl=impl)


def _budget_or_target(budget: str | None, target: str | None, parse: Callable[[str], int]) -> tuple[str, int]:
    """``--budget`` as text and bytes; without it, the usable memory of ``--target`` (see ``usable_bytes``)."""
    from planner.profiling.devices import get_device, usable_bytes

    spec = get_device(target) if target is not None else None  # an unknown name fails here, before profiling
    if budget is not None:
        return budget, _budget(budget, parse)
    if spec is None:
        raise BadInput("give --budget SIZE (remat plan --budget 12GB model.py), or --target NAME to plan for "
                       "a device's usable memory (remat devices lists them)")
    return f"{spec.name} usable memory", usable_bytes(spec)


def _progress(log: Any) -> Callable[[str], None]:
    return lambda message: render.plain(log, message)


if __name__ == "__main__":
    app(prog_name="remat")
