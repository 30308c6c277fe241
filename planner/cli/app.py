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
failed / internal error, 2 bad input or usage, 130 interrupted, 143 terminated, 129 hung up (SIGHUP).
See docs/cli.md.

Example::

    remat plan --budget 12GB examples/gpt2.py -o plan.json    # ./cli.py, or the installed remat
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from planner.cli import output, render
from planner.options import compile_backend
from planner.errors import OOM_HINT, BadInput, PlanMismatch, ProfileError, RematError, Terminated, VerificationFailed
from planner.cli.options import (COMPARE, DEVICES_CMD, FLAGS, FRONTIER, PLAN, PROFILE_CMD, SHOW, VERIFY,
                                 CompareOptions, FrontierOptions, HfSource, Options, PlanOptions, ProfileOptions,
                                 ShowOptions, StepOptions, VerifyOptions)
from planner.cli.saved_profile import check_profile_options

app = typer.Typer(
    name="remat",
    help="Plan activation checkpointing for a PyTorch training step within a memory budget.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# ----------------------------------------------------------------------------- errors

# NOTE [ CLI errors and exit codes ]
#
# Every command runs inside ``_guarded``, the one place that turns failures into output:
#   - RematError (and subclasses): "error: <message>" on stderr, exit ``err.exit_code``
#     (2 bad input, 1 no plan fits / verification failed). PlanMismatch adds its differences.
#   - KeyboardInterrupt: "interrupted", exit 130; SIGTERM: "terminated", exit 143; SIGHUP: "hung up",
#     exit 129 (NOTE [ Signals and children ] in planner/children.py). Files are written last and atomically (planner.files.atomic_write,
#     NOTE [ Writing output files ]): nothing half-written is left, and no child process.
#   - anything else is a bug in remat: "internal error: ...", exit 1.
# Tracebacks only with --debug. Usage errors (unknown option, a value out of range) are click's,
# worded in one line by the console script (NOTE [ Usage errors in one line ], planner/cli/main.py): exit 2.


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command so that errors end as one line and an exit code (see NOTE above)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from planner.children import HANGUP, signals_raise
        from planner.crashes import exits_said

        debug = bool(kwargs.get("debug", False))
        try:
            with signals_raise(), exits_said():  # NOTE [ Exits that skip remat ]
                return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.BadParameter):
            raise
        except Terminated as e:
            _traceback(debug)
            render.error_line("nothing was written", prefix="hung up" if e.signum in HANGUP else "terminated")
            raise typer.Exit(128 + e.signum) from None
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


def command(name: str, options: type[Options], params: list[inspect.Parameter]) -> Callable[..., Any]:
    """``@app.command`` taking ``params`` (``planner.cli.options``) and calling the function with them as
    one ``options`` model, with the error handling of NOTE [ CLI errors and exit codes ]."""

    def deco(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        @functools.wraps(fn)
        def run(ctx: typer.Context, **kwargs: Any) -> None:
            opts = options(**kwargs, given=_given_on_command_line(ctx, kwargs))
            with output.json_stdout(opts.as_json):  # NOTE [ JSON on stdout ]
                fn(opts)

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        run.__signature__ = inspect.Signature([context, *params])  # type: ignore[attr-defined]
        run.__annotations__ = {}
        app.command(name)(_guarded(run))
        return fn

    return deco


def _given_on_command_line(ctx: typer.Context, kwargs: dict[str, Any]) -> frozenset[str]:
    """The options the user typed (not defaults, not environment variables): what NOTE [ Options a saved
    profile cannot honour ] checks."""
    return frozenset(k for k in kwargs if getattr(ctx.get_parameter_source(k), "name", None) == "COMMANDLINE")


# ----------------------------------------------------------------------------- plan


@command("plan", PlanOptions, PLAN)
def plan_cmd(o: PlanOptions) -> None:
    """Find the checkpoint set that fits --budget with the least recompute."""
    from planner.act.api import graph_for, plan_from_profile, resolve_budget
    from planner.act.compiled_check import compiled_peak

    out, log = render.consoles(quiet=o.quiet)
    budget_bytes, budget = resolve_budget(o.budget, o.target)
    _need_source(o, "remat plan --budget 12GB model.py", "remat plan --budget 12GB --profile profile.json")
    _check_output(o, o.output)
    render.plain(log if o.as_json else out, render.budget_line(budget, budget_bytes))
    if o.hf is not None and o.clip_grad_norm is None and not (o.fused or o.foreach):
        render.plain(log, TRAINER_NOTE)
    if o.pp is not None:
        plan, graph = _plan_pipeline(o, budget_bytes, log), None
    elif o.tp > 1:
        plan, graph = _plan_tensor_parallel(o, budget_bytes), None
    elif len(o.shapes) > 1:
        plan, graph = _plan_buckets(o, budget_bytes, log), None
    else:
        source = _model_source(o.model, o)
        prof = _profile_source(o, log, source)
        graph = graph_for(prof, solve=o.solve_spec)
        render.plain(log, f"solving with {o.solver} over {graph.number_of_nodes()} candidates ...")
        check = compiled_peak(source, step=o.step_spec(), progress=_progress(log)) if prof.compile and source else None
        plan = plan_from_profile(prof, budget_bytes, solve=o.solve_spec, graph=graph, check=check, progress=_progress(log))
    if o.output is not None:
        plan.save(o.output)
    if o.as_json:
        output.print_json(plan)
        if o.output is not None:
            render.plain(log, render.written_line(o.output))
    else:
        render.show_plan(out, plan, graph=graph, fresh=True, written=o.output)
    if o.why:
        _why(log if o.as_json else out, graph, plan)


def _plan_pipeline(o: PlanOptions, budget_bytes: int, log: Any) -> Any:
    """One plan per pipeline stage (NOTE [ Pipeline stages ]): each stage profiled on one micro-batch."""
    from planner.act.pipeline import pipeline_layout, plan_pipeline

    if o.profile is not None:
        raise BadInput("a saved profile is of the whole model; pipeline stages are profiled one by one: drop "
                       "--profile and give the model file")
    if o.granularity or o.device_memory is not None:
        raise BadInput("pipeline stages are planned over their repeated blocks, without a device-memory cap, for "
                       "now: drop --granularity and --device-memory")
    if o.device == "meta" and o.target is None:
        raise BadInput("--device meta models times for a target device: add --target NAME (remat devices lists them)")
    layout = pipeline_layout(o.pp, o.schedule, o.micro_batches, o.stages_per_rank)
    return plan_pipeline(_model_source(o.model, o), budget_bytes, layout, tp=o.tp, step=o.step_spec(), solve=o.solve_spec,
                         progress=_progress(log), sequence_parallel=o.sequence_parallel)


def _plan_tensor_parallel(o: PlanOptions, budget_bytes: int) -> Any:
    """Every tensor-parallel rank's plan, made on the rank-local model (NOTE [ Tensor-parallel ranks ])."""
    from planner.act.tensor_parallel import plan_tensor_parallel

    if o.profile is not None or len(o.shapes) > 1:
        raise BadInput("a tensor-parallel plan profiles the rank-local model itself, for one batch shape: drop "
                       "--profile and give one --batch and --seq-len")
    if o.device == "meta" and o.target is None:
        raise BadInput("--device meta models times for a target device: add --target NAME (remat devices lists them)")
    return plan_tensor_parallel(_model_source(o.model, o), budget_bytes, o.tp, step=o.step_spec(), solve=o.solve_spec,
                                sequence_parallel=o.sequence_parallel)


def _plan_buckets(o: PlanOptions, budget_bytes: int, log: Any) -> Any:
    """A bucketed plan: every shape of --batch x --seq-len profiled and planned under the budget."""
    from planner.act.api import plan_buckets

    if o.profile is not None:
        raise BadInput("a saved profile holds one batch shape: give one --batch and one --seq-len with --profile, "
                       "or drop --profile to profile every shape")
    sources = _model_sources(o.model, o)
    profiles = []
    for i, (shape, mf) in enumerate(sources):
        render.plain(log, f"shape {i + 1}/{len(sources)}: " + ", ".join(f"{k} {v}" for k, v in shape.items()))
        profiles.append(_run_profiler(mf, o, log))
    render.plain(log, f"solving with {o.solver} for {len(profiles)} shapes ...")
    return plan_buckets(profiles, budget_bytes, shapes=[shape for shape, _ in sources], solve=o.solve_spec)


# ----------------------------------------------------------------------------- profile


@command("profile", ProfileOptions, PROFILE_CMD)
def profile_cmd(o: ProfileOptions) -> None:
    """Measure one training step of model.py: module times, saved tensors, memory timeline."""
    from planner.act.api import graph_for

    out, log = render.consoles(quiet=o.quiet)
    _check_output(o, o.output)
    source = _model_source(o.model, o)
    if source is None:
        raise BadInput("give a model file (remat profile model.py) or a Hugging Face config "
                       "(remat profile --hf config.json --batch 8 --seq-len 2048)")
    prof = _run_profiler(source, o, log)
    if o.output is not None:
        prof.save(o.output)
    if o.as_json:
        output.print_json(prof)
        if o.output is not None:
            render.plain(log, render.written_line(o.output, "profile"))
    else:
        render.show_profile(out, prof, graph_for(prof), fresh=True, written=o.output)


# ----------------------------------------------------------------------------- frontier


@command("frontier", FrontierOptions, FRONTIER)
def frontier_cmd(o: FrontierOptions) -> None:
    """Sweep budgets: recompute and peak of every solver and baseline, as a table, JSON or a plot."""
    import time

    from planner.act.api import headroom_for
    from planner.act.offload_plan import resolve_host_budget
    from planner.act.frontier import frontier, sweep_graph, tradeoff, with_offload
    from planner.files import atomic_write_text

    out, log = render.consoles(quiet=o.quiet)
    _need_source(o, "remat frontier model.py", "remat frontier --profile profile.json")
    _check_output(o, o.output)
    _check_output(o, o.plot, **{"the file -o writes": o.output})
    if o.plot is not None:
        from planner.cli.plot import require_matplotlib

        require_matplotlib(o.plot)  # before minutes of profiling, not after; its format too
    prof = _profile_source(o, log)
    graph = sweep_graph(prof, o.solvers, granularity=o.granularity, world_size=o.world_size, sharding=o.sharding)
    headroom = o.headroom if o.headroom is not None else headroom_for(prof)
    host = resolve_host_budget(prof, o.offload, o.host_memory)  # None without --offload
    t0 = time.perf_counter()
    with output.counter(log, f"sweeping {o.points} budgets") as tick:
        pts = frontier(graph, points=o.points, solvers=o.solvers, time_limit_s=o.time_limit_s, headroom=headroom,
                       progress=tick, host_budget_bytes=host)
    report = tradeoff(graph, pts, kind="remat-frontier", model=prof.fingerprint.model_class,
                      device=_device_text(prof), seconds=time.perf_counter() - t0, headroom=headroom)
    report = with_offload(report, graph, host, time_limit_s=o.time_limit_s)
    budgets = len({p.budget_bytes for p in pts})
    render.plain(log, f"swept {budgets} budgets x {len(pts) // max(budgets, 1)} solvers and baselines "
                      f"({len(pts)} plans) in {report.seconds:.2f} s")
    written = []
    if o.output is not None:
        written.append(atomic_write_text(o.output, output.json_text(report)))
    if o.plot is not None:
        from planner.cli.plot import plot_frontier

        written.append(plot_frontier(report, o.plot))
    if o.as_json:
        output.print_json(report)
        for path in written:
            render.plain(log, render.written_line(path))
    else:
        render.show_frontier(out, report, written=written)


# ----------------------------------------------------------------------------- compare


@command("compare", CompareOptions, COMPARE)
def compare_cmd(o: CompareOptions) -> None:
    """Every solver and baseline side by side at one budget: peak, recompute, what fits."""
    import time

    from planner.act.api import headroom_for, resolve_budget
    from planner.act.frontier import compare, sweep_graph, tradeoff

    out, log = render.consoles(quiet=o.quiet)
    budget_bytes, budget = resolve_budget(o.budget, o.target)
    _need_source(o, "remat compare --budget 2GB model.py", "remat compare --budget 2GB --profile profile.json")
    render.plain(log if o.as_json else out, render.budget_line(budget, budget_bytes))
    prof = _profile_source(o, log)
    graph = sweep_graph(prof, o.solvers, granularity=o.granularity, world_size=o.world_size, sharding=o.sharding)
    headroom = o.headroom if o.headroom is not None else headroom_for(prof)
    t0 = time.perf_counter()
    pts = compare(graph, budget_bytes, solvers=o.solvers, time_limit_s=o.time_limit_s, headroom=headroom)
    report = tradeoff(graph, pts, kind="remat-compare", model=prof.fingerprint.model_class,
                      device=_device_text(prof), budget_bytes=budget_bytes, seconds=time.perf_counter() - t0,
                      headroom=headroom)
    output.print_json(report) if o.as_json else render.show_compare(out, report)


# ----------------------------------------------------------------------------- show


@command("show", ShowOptions, SHOW)
def show_cmd(o: ShowOptions) -> None:
    """Show a plan file (or a profile file) as tables."""
    from planner.act.api import graph_for
    from planner.model.fields import EITHER, read_document
    from planner.model.schema import Plan, Profile

    out, log = render.consoles(quiet=o.quiet)
    document = read_document(o.path, EITHER)  # read once: a pipe (<(cat plan.json)) cannot be read again
    if isinstance(document, dict) and document.get("kind") == "remat-profile":
        if o.why:
            raise BadInput("--why explains a plan: remat show plan.json --why --profile profile.json")
        prof = Profile.load(o.path, document)
        output.print_json(prof) if o.as_json else render.show_profile(out, prof, graph_for(prof))
        return
    plan = Plan.load(o.path, document)
    if o.why and plan.pipeline is not None:
        raise BadInput("--why explains a plan made on one profile; a pipeline plan has one per stage: drop --why")
    if o.why and o.profile is None:
        raise BadInput("--why needs the profile the plan was made on: remat show plan.json --why --profile "
                       "profile.json (or remat plan ... --why)")
    if o.profile is not None and not o.why:
        raise BadInput("--profile with remat show only serves --why: add --why, or drop --profile")
    output.print_json(plan) if o.as_json else render.show_plan(out, plan)
    if o.why:
        prof = Profile.load(o.profile)
        if prof.fingerprint.digest() != plan.fingerprint_digest:
            raise PlanMismatch(f"{o.profile} was made for another model than {o.path}: pass the profile the plan "
                               f"was made on", prof.fingerprint.differences(plan.fingerprint, "profile", "plan"))
        graph = graph_for(prof, granularity=plan.granularity, world_size=plan.world_size, sharding=plan.sharding,
                          solver="ilp" if plan.solver.name == "ilp" else "auto")
        _why(log if o.as_json else out, graph, plan)


# ----------------------------------------------------------------------------- verify


@command("verify", VerifyOptions, VERIFY)
def verify_cmd(o: VerifyOptions) -> None:
    """Train with and without the plan; compare measured peak, time and gradients with the prediction."""
    from planner.act.verify import BucketsReport, verify

    out, log = render.consoles(quiet=o.quiet)
    model, plan = (None, o.model) if o.hf is not None and o.plan is None else (o.model, o.plan)  # --hf c.json p.json
    if plan is None:
        raise BadInput("give the model and the plan: remat verify model.py plan.json "
                       "(or remat verify --hf config.json --batch 8 --seq-len 2048 plan.json)")
    source = _model_source(model, o)
    if source is None:
        raise BadInput("give the model file the plan was made for: remat verify model.py plan.json")
    report = verify(source, plan, steps=o.steps, device=o.device, threads=o.threads, progress=_progress(log),
                    prediction_tolerance=o.tolerance,
                    compile=compile_backend(o.compile, o.compile_backend, o.given))
    per_rank = getattr(report, "launched", None) is not None
    if per_rank and report.launched == "torchrun" and os.environ.get("RANK", "0") != "0":
        pass  # every rank has the report; rank 0 prints it
    elif o.as_json:
        output.print_json(report)
    elif per_rank:
        render.show_rank_verify(out, report)
    elif isinstance(report, BucketsReport):
        render.show_buckets_verify(out, report)
    else:
        render.show_verify(out, report)
    if not report.ok:
        raise VerificationFailed("the plan failed verification: " + "; ".join(report.problems))


# ----------------------------------------------------------------------------- devices


@command("devices", Options, DEVICES_CMD)
def devices_cmd(o: Options) -> None:
    """List the accelerators remat knows (profiles/devices/*.json), with the memory a plan may use."""
    from planner.profiling.devices import load_devices, reserve_bytes, usable_bytes

    out, _ = render.consoles(quiet=o.quiet)
    specs = load_devices()
    if o.as_json:
        output.print_json([{**s.model_dump(mode="json"), "reserve_bytes": reserve_bytes(s),
                            "usable_bytes": usable_bytes(s)} for s in specs])
    else:
        render.show_devices(out, specs)


# ----------------------------------------------------------------------------- helpers


def _why(console: Any, graph: Any, plan: Any) -> None:
    """``--why``: one line per candidate (NOTE [ Why this plan ] in planner/act/why.py)."""
    from planner.act.why import explain

    render.plain(console, "why:")
    for line in explain(graph, plan):
        render.plain(console, f"  {line}")


def _device_text(prof: Any) -> str:
    """``cpu (x86_64)``, ``cuda (NVIDIA H100 80GB HBM3)``: the device kind and what it was."""
    name = prof.device_name
    return f"{prof.device} ({name})" if name and name != prof.device else prof.device


def _need_source(o: StepOptions, with_model: str, with_profile: str) -> None:
    if getattr(o, "profile", None) is None and o.model is None and o.hf is None:
        raise BadInput(f"give a model file ({with_model}), a Hugging Face config (--hf config.json --batch 8 "
                       f"--seq-len 2048) or a saved profile ({with_profile})")


TRAINER_NOTE = ("note: a Hugging Face Trainer clips gradients at norm 1.0 (max_grad_norm) and, with torch 2.8 or "
                "later, uses fused AdamW by default: for its RematCallback, plan that step with --clip-grad-norm 1 "
                "--fused (planner.integrations.hf.training_recipe(args) gives the step of any TrainingArguments)")
"""Printed by ``remat plan --hf`` without step options: the Trainer would refuse the plain loop's plan."""


def _model_source(model: Path | None, o: HfSource) -> Any:
    """The ``ModelFile`` of MODEL.py or of ``--hf config.json``, making batches of the one shape asked for;
    None when neither is given."""
    sources = _model_sources(model, o)
    if len(sources) > 1:
        raise BadInput(f"{len(sources)} batch shapes make a bucketed plan, which remat plan makes; give one "
                       f"--batch and one --seq-len here")
    return sources[0][1] if sources else None


def _model_sources(model: Path | None, o: HfSource) -> list[tuple[dict[str, int], Any]]:
    """(shape, ``ModelFile`` making batches of that shape) for every shape --batch and --seq-len ask for
    (``example_inputs(**shape)``; NOTE [ Bucketed plans ]); [] when no model is given."""
    import dataclasses
    from planner.profiling.model_file import load_model_file

    if o.hf is None:
        if o.task:
            raise BadInput("--task only applies with --hf config.json (a model file builds its own model)")
        if model is None:
            if o.batch or o.seq_len:
                raise BadInput("--batch and --seq-len make batches of a model: give MODEL.py or --hf config.json")
            return []
        mf = load_model_file(model)
    else:
        if model is not None:
            raise BadInput(f"give either a model file ({model}) or --hf {o.hf}, not both")
        if o.batch is None:
            raise BadInput("--hf needs --batch N: the rows of the batch to plan for (plan at the largest "
                           "batch the job will see)")
        from planner.integrations.hf_config import load_hf_config

        mf = load_hf_config(o.hf, batch_size=max(o.batch), seq_len=max(o.seq_len) if o.seq_len else None,
                            task=o.task.strip().lower() if o.task else None)
    return [(shape, dataclasses.replace(mf, example_inputs=functools.partial(mf.example_inputs, **shape)))
            for shape in o.shapes]


def _check_output(o: Any, path: Path | None, **outputs: Path | None) -> None:
    """Fail before minutes of profiling, not after, when ``path`` cannot be written, is one of the
    command's inputs or another of its ``outputs`` (NOTE [ Writing output files ], Rule 5); the write
    itself is ``atomic_write_text``."""
    from planner.files import check_output

    check_output(path, {"the model file": o.model, "the profile read by --profile": getattr(o, "profile", None),
                        "the config read by --hf": o.hf}, outputs)


def _profile_source(o: StepOptions, log: Any, source: Any = None) -> Any:
    """The profile to plan on: loaded from --profile, else measured by running the model (``source``,
    its ``ModelFile`` when the caller has loaded it).

    A saved profile measured one recipe: recipe options other than the defaults must match it.
    """
    from planner.act.api import check_profile_matches
    from planner.model.schema import Profile

    source = source if source is not None else _model_source(o.model, o)
    profile = getattr(o, "profile", None)
    if profile is None:
        return _run_profiler(source, o, log)
    prof = Profile.load(profile)
    check_profile_options(prof, o, profile)
    if source is not None:
        try:
            check_profile_matches(prof, source)
        except PlanMismatch as e:
            raise PlanMismatch(f"{e}: remat profile {_profile_args(source.path)} -o profile.json",
                               e.differences) from None
    return prof


def _profile_args(path: Path) -> str:
    """How ``remat profile`` names this model: the model file, or --hf with its config."""
    return str(path) if path.suffix == ".py" else f"--hf {path} --batch N --seq-len N"


def _run_profiler(mf: Any, o: StepOptions, log: Any) -> Any:
    """``planner.profile`` on the model file with the step the options describe; the library picks
    how to measure it (``planner.spec.profiling_path``), this refuses flags that cannot apply and
    announces it."""
    from planner.profiling import check_step, profile
    from planner.spec import is_plain, profiling_path

    meta = o.device == "meta"
    if meta and o.target is None:
        from planner.profiling.devices import load_devices

        raise BadInput(f"--device meta models times for a target device: add --target NAME, one of: "
                       f"{', '.join(s.name for s in load_devices())}")
    if meta and {"steps", "threads"} & o.given:
        typed = [n for n in ("steps", "threads") if n in o.given]
        raise BadInput(f"{' and '.join('{' + n + '}' for n in typed)} time a real step; --device meta runs two "
                       f"steps on fake tensors and models the times for --target: drop "
                       f"{'them' if len(typed) > 1 else 'it'}", options=tuple(typed))
    step = o.step_spec(device_memory_bytes=_device_memory(o.device_memory, meta, "device_memory" in o.given))
    if step.device_memory_bytes is not None and not is_plain(step.recipe):
        raise BadInput("--device-memory measures the plain training step (with --amp) for now; drop it, or drop "
                       "--grad-accum/--no-zero-grad-set-to-none/--clip-grad-norm/--fused/--foreach/--keep-output")
    how = profiling_path(step, check_step(step).type)
    if how == "capped":
        if mf.path.suffix != ".py":  # the child process imports a model file
            raise BadInput("--device-memory on the CPU profiles a model file in a child process; with --hf, "
                           "write a model.py that builds the model (or drop --device-memory)")
        render.plain(log, f"profiling {mf.path} on cpu within {step.device_memory_bytes} bytes "
                          f"(a capped child process) ...")
        return profile(mf, step=step, progress=None if log.quiet else (lambda _msg: None))
    # stages the profiler announces: a warm-up step, the timing steps, the memory step, the peak,
    # the validation step (meta: a warm-up step and one memory-and-roofline step on fake tensors)
    title = (f"profiling {mf.path} on fake tensors for {o.target}" if meta
             else f"profiling {mf.path} on {o.device} ({o.steps} steps)")
    with output.stages(log, f"{title} ...", total=2 if meta else o.steps + 4) as say:
        return profile(mf, step=step, progress=say)


def _device_memory(text: str | None, meta: bool, typed: bool) -> int | None:
    """--device-memory (or, not ``typed``, REMAT_DEVICE_MEMORY: its errors name it) in bytes; None when not given."""
    from planner.cli.options import DEVICE_MEMORY_ENV
    from planner.sizes import parse_bytes

    if text is None or not text.strip():
        return None
    env = "" if typed else f"; it comes from the environment, {DEVICE_MEMORY_ENV}={text}: unset it"
    if meta:
        raise BadInput(f"--device-memory caps a device that runs the step; --device meta runs nothing (drop one){env}")
    try:
        value = parse_bytes(text)
    except BadInput as e:
        raise BadInput(f"--device-memory: {e}{env}") from None
    if value <= 0:
        raise BadInput(f"--device-memory must be positive, got {text!r}{env}")
    return value


def _progress(log: Any) -> Callable[[str], None]:
    return lambda message: render.plain(log, message)


if __name__ == "__main__":
    app(prog_name="remat")


__all__ = ["app", "command", "compare_cmd", "devices_cmd", "frontier_cmd",
           "plan_cmd", "profile_cmd", "show_cmd", "TRAINER_NOTE", "verify_cmd"]
