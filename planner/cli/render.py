"""Everything the CLI shows: one helper per thing, rich for people, plain JSON for machines.

Results go to stdout, logs and progress to stderr (see ``consoles``). User-supplied text
(module names, shapes such as ``[4, 256]``, error messages) is printed as plain text, never
parsed as rich markup. No torch import.

Example::

    out, log = consoles(quiet=False)
    show_plan(out, plan)                       # results on stdout, progress on stderr
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import networkx as nx
from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.model.fields import terminal_safe
from planner.model.schema import Plan, Predicted, Profile, Recipe, SolverInfo
from planner.sizes import format_bytes

MIB = 2**20


def consoles(*, quiet: bool = False) -> tuple[Console, Console]:
    """``(out, log)``: results on stdout; logs on stderr, silenced by ``quiet``.

    Made per command (not at import) so the streams are those current when the command runs.
    """
    out = Console(file=sys.stdout, highlight=False, soft_wrap=False)
    log = Console(file=sys.stderr, highlight=False, quiet=quiet)
    return out, log


def plain(console: Console, text: str) -> None:
    """Print ``text`` verbatim: no markup, no highlighting, no wrapping."""
    console.print(Text(terminal_safe(text)), soft_wrap=True)  # Rule 3 of NOTE [ Text in files ]


def error_line(message: str, *, prefix: str = "error") -> None:
    """``error: ...`` on stderr, written directly so that nothing (rich, quiet) can swallow it."""
    sys.stderr.write(f"{prefix}: {terminal_safe(message.rstrip())}\n")  # Rule 3 of NOTE [ Text in files ]
    sys.stderr.flush()


# ----------------------------------------------------------------------------- pieces


def budget_line(text: str, budget_bytes: int) -> str:
    """``budget 12GB = 12884901888 bytes (12.00 GiB)``: the echo of a parsed budget."""
    return f"budget {text.strip()} = {budget_bytes} bytes ({format_bytes(budget_bytes)})"


def units_table(g: nx.DiGraph, checkpointed: Iterable[str] = (), selective: Iterable[str] = (),
                offloaded: Iterable[str] = ()) -> Table:
    """The candidate units in forward order: name, type, forward ms, saved MiB, checkpointed.

    A unit inside a checkpointed one is marked ``inside <id>``: it is recomputed with it; an
    offloaded one ``offload``: its saved tensors go to host memory.
    """
    chosen, ops, off = set(checkpointed), set(selective), set(offloaded)
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("#", justify="right", style="dim")
    table.add_column("unit", overflow="fold")
    table.add_column("type", overflow="ellipsis", max_width=24)
    table.add_column("forward ms", justify="right")
    table.add_column("saved MiB", justify="right")
    table.add_column("checkpoint", justify="left")
    for i, n in enumerate(sorted(g.nodes, key=lambda n: g.nodes[n]["order"])):
        a = g.nodes[n]
        depth = _graph_depth(g, n)
        mark = (Text("yes", style="bold green") if n in chosen else Text("op by op", style="bold cyan")
                if n in ops else Text("offload", style="bold magenta") if n in off
                else Text(_inside(g, n, chosen | ops | off), style="dim"))
        table.add_row(str(i), Text("  " * depth + n), Text(a["module_type"]), f"{a['forward_ms']:.3f}",
                      f"{a['saved_bytes'] / MIB:.2f}", mark)
    return table


def checkpoints_table(plan: Plan) -> Table:
    """The plan's checkpointed modules, when no profile is at hand to show all units."""
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("#", justify="right", style="dim")
    table.add_column("checkpointed module", overflow="fold")
    for i, fqn in enumerate(plan.checkpoints):
        table.add_row(str(i), Text(fqn or "<root>"))
    if not plan.checkpoints:
        table.add_row("-", Text("(no whole module)" if plan.selective or plan.offload else
                                "(none: the model fits without checkpointing)"))
    return table


def buckets_table(plan: Plan) -> Table:
    """A bucketed plan's buckets (NOTE [ Bucketed plans ]): each shape, what it checkpoints, its prediction."""
    from planner.act.buckets import describe

    table = Table(show_edge=False, pad_edge=False)
    table.add_column("#", justify="right", style="dim")
    table.add_column("bucket", no_wrap=True)
    for name in ("checkpointed", "op by op"):
        table.add_column(name, overflow="fold")
    for name in ("peak", "recompute ms", "solver"):
        table.add_column(name, justify="right", no_wrap=True)
    for i, b in enumerate(plan.buckets):
        table.add_row(str(i), Text(describe(b)), Text(", ".join(b.checkpoints) or "-"),
                      Text(", ".join(r.fqn for r in b.selective) or "-"), format_bytes(b.predicted.peak_bytes),
                      f"{b.predicted.recompute_ms:.3f}", b.solver.status)
    return table


def _numbered(first: str, *columns: tuple[str, str]) -> Table:
    """A table of modules: '#', the module column ``first``, then ``columns`` as (header, justify)."""
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("#", justify="right", style="dim")
    table.add_column(first, overflow="fold")
    for header, justify in columns:
        table.add_column(header, justify=justify, overflow="fold")  # type: ignore[arg-type]
    return table


def selective_table(plan: Plan) -> Table:
    """The plan's op-level regions: each module's policy in words."""
    table = _numbered("checkpointed op by op", ("policy", "left"), ("kept MiB", "right"), ("recompute ms", "right"))
    for i, r in enumerate(plan.selective):
        table.add_row(str(i), Text(r.fqn or "<root>"), Text(r.summary), f"{r.kept_bytes / MIB:.2f}",
                      f"{r.recompute_ms:.3f}")
    return table


def offload_table(plan: Plan) -> Table:
    """The plan's offloaded modules: host bytes, copy time each way, the compute that hides it, and what
    is left exposed (NOTE [ Peak-memory model ], Rule 10)."""
    table = _numbered("offloaded to host", ("MiB", "right"), ("copy ms each way", "right"),
                      ("hidden behind ms", "right"), ("exposed ms/step", "right"))
    for i, u in enumerate(plan.offload):
        behind = f"{u.hidden_ms:.3f} ({u.sync_fqn or 'end of forward'})" if u.hidden_ms else "0 (no copy engine)" \
            if u.sync_fqn else "0 (end of forward)"
        table.add_row(str(i), Text(u.fqn or "<root>"), f"{u.host_bytes / MIB:.2f}", f"{u.d2h_ms:.3f}", Text(behind),
                      f"{u.exposed_ms:.3f}")
    return table


def host_line(plan: Plan) -> str:
    """Host memory of the offloaded tensors against the host budget, and the exposed copy time."""
    p = plan.predicted
    return (f"host memory {format_bytes(p.host_peak_bytes or 0)} of {format_bytes(plan.host_budget_bytes or 0)} "
            f"(offloaded tensors); copies add {p.offload_ms or 0:.3f} ms per step not hidden behind compute")


def peak_lines(p: Predicted, budget_bytes: int | None) -> list[str]:
    """Predicted peak, where it happens, and its breakdown."""
    used = f", {100 * p.peak_bytes / budget_bytes:.1f}% of the budget" if budget_bytes else ""
    where = p.peak_at or "?"
    lines = [f"predicted peak {p.peak_bytes} bytes ({format_bytes(p.peak_bytes)}) at {where}{used}"]
    for name, value in (("params", p.params_bytes), ("grads", p.grads_bytes),
                        ("optimizer", p.optimizer_bytes), ("activations", p.activations_bytes)):
        lines.append(f"  {name:<12}{format_bytes(value):>12}")
    extra = []
    if p.no_checkpoint_peak_bytes is not None:
        extra.append(f"without checkpointing {format_bytes(p.no_checkpoint_peak_bytes)}")
    if p.min_feasible_bytes is not None:
        extra.append(f"lowest feasible {format_bytes(p.min_feasible_bytes)}")
    if extra:
        lines.append("  (" + "; ".join(extra) + ")")
    return lines


def recompute_line(p: Predicted) -> str:
    """Recompute overhead in ms and as a share of the step without it."""
    base = p.step_ms - p.recompute_ms - (p.offload_ms or 0.0)
    share = f"{100 * p.recompute_ms / base:.1f}%" if base > 0 else "n/a"
    return f"recompute {p.recompute_ms:.3f} ms per step (+{share} of the {base:.3f} ms step)"


def time_line(source: str, threads: int | None, calibration: str | None) -> str:
    """What the milliseconds are: the clock (or roofline) and how sure (see NOTE [ Unit costs ])."""
    if not source:
        return "times: source not recorded (profile from an older remat)"
    if source == "roofline":
        how = f"calibrated by {calibration}" if calibration else \
            "UNCALIBRATED (assumed efficiencies; run benchmarks/gpu_check.py on the GPU to calibrate)"
        return f"times: modelled by the roofline, {how}"
    on = f" at {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    return f"times: {source}{on}, medians over the timing steps, identical units priced as one"


def solver_line(s: SolverInfo, seconds: float | None = None) -> str:
    """Which solver made the plan and what it proved."""
    gap = f", gap {100 * s.gap:.2f}%" if s.gap is not None and s.status == "feasible" else ""
    took = f" in {seconds:.3f} s" if seconds is not None else ""
    detail = f" ({s.detail})" if s.detail else ""
    return f"solver {s.name}: {s.status}{gap}{detail}{took}"


def written_line(path: Path | str | None, what: str = "plan") -> str:
    """Where the result went, or how to save it."""
    if path is None:
        return f"{what} not written: pass -o {what}.json to save it"
    return f"wrote {path}"


def recipe_line(recipe: Recipe, optimizer: str, compile: Any = None) -> str:
    """The training step a plan or profile is for, e.g. 'step: adamw, grad_accum 4, ...'; a compiled
    one ends 'under torch.compile (inductor, torch 2.13.0)'."""
    under = f", under torch.compile ({compile.backend}, torch {compile.torch_version})" if compile else ""
    return f"step: {optimizer or 'adamw'}, {recipe.describe()}{under}"


# ----------------------------------------------------------------------------- per command


def stages_table(plan: Plan) -> Table:
    """One row per pipeline stage: its blocks, micro-batches in flight, what one holds, its activations at
    the peak, its checkpointed modules and its peak (NOTE [ Pipeline stages ])."""
    t = Table(show_edge=False, pad_edge=False)
    for col in ("stage", "blocks", "in flight", "held MiB", "act MiB", "ckpt", "peak MiB", "no ckpt"):
        t.add_column(col, justify="right", no_wrap=True)
    for st in plan.stages:
        pr = st.predicted
        ids = [m.rsplit(".", 1)[-1] for m in st.modules]
        blocks = f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else (ids[0] if ids else "-")
        t.add_row(str(st.stage), blocks, str(st.in_flight), f"{st.held_bytes / MIB:.1f}",
                  f"{pr.activations_bytes / MIB:.1f}", str(len(st.checkpoints)), f"{pr.peak_bytes / MIB:.1f}",
                  f"{(pr.no_checkpoint_peak_bytes or 0) / MIB:.1f}")
    return t


def show_plan(out: Console, plan: Plan, *, graph: nx.DiGraph | None = None, fresh: bool = False,
              written: Path | str | None = None) -> None:
    """A plan for people: units (or checkpointed modules), peak, recompute, solver.

    ``fresh``: the plan was just made (the budget line is already out): add the solver's time
    and where the plan was written. Otherwise (``remat show``) start with what the plan is for.
    """
    if not fresh:
        plain(out, f"plan for {plan.fingerprint.model_class} ({plan.fingerprint_digest}), "
                   f"budget {plan.budget_bytes} bytes ({format_bytes(plan.budget_bytes)})")
    if plan.pipeline is not None:
        pp = plan.pipeline
        tp, dp = plan.tensor_parallel, plan.world_size // (pp.stages * plan.tensor_parallel)
        parts = ([f"{tp} tensor-parallel"] if tp > 1 else []) + ([f"{dp} data-parallel ({plan.sharding})"] if dp > 1 else [])
        ranks = " x ".join(parts) + " ranks each" if parts else "one rank each"
        if pp.stages_per_rank > 1:  # NOTE [ Interleaved stages ]
            what, ranks = f"{pp.stages} ranks of {pp.stages_per_rank} stages", f"stage s on rank s % {pp.stages} (a " \
                                                                              f"stage's peak is its rank's)"
        else:
            what = f"{pp.stages} stages"
        plain(out, f"pipeline: {what} ({pp.schedule}, {pp.micro_batches} micro-batches), {ranks} "
                   f"(budget and peaks are one rank's); below, the highest stage's peak and the slowest stage's recompute")
        out.print(stages_table(plan))
    elif plan.tensor_parallel > 1:
        sp = ", the sequence sharded between blocks" if plan.sequence_parallel else ""
        dp = plan.world_size // plan.tensor_parallel
        sp += f"; {dp} such groups under FSDP2 ({plan.world_size} ranks)" if dp > 1 else ""
        plain(out, f"tensor parallel: {plan.tensor_parallel} ranks share each layer{sp}; the plan, budget and peak are "
                   f"every rank's (made on the rank-local model)")
    elif plan.world_size > 1 or plan.sharding != "none":
        plain(out, f"per rank: {plan.world_size} rank(s) with {plan.sharding} (budget and peak are one rank's)")
    plain(out, recipe_line(plan.recipe, plan.optimizer, plan.compile))
    if plan.buckets:
        plain(out, f"{len(plan.buckets)} buckets, one plan per input shape; each batch runs the smallest that "
                   f"holds it (larger than all: the last, and the shape guard)")
        out.print(buckets_table(plan))
        plain(out, "the largest bucket:")
    out.print(units_table(graph, plan.checkpoint_units, [r.unit for r in plan.selective],
                          [u.unit for u in plan.offload]) if graph is not None else checkpoints_table(plan))
    if plan.selective:
        out.print(selective_table(plan))
    if plan.offload:
        out.print(offload_table(plan))
    for line in peak_lines(plan.predicted, plan.budget_bytes):
        plain(out, line)
    if plan.compile is not None:
        plain(out, compiled_check_line(plan))
    plain(out, recompute_line(plan.predicted))
    if plan.offload:
        plain(out, host_line(plan))
    plain(out, time_line(plan.time_source, plan.threads, plan.time_calibration))
    plain(out, solver_line(plan.solver, plan.created.solver_seconds if fresh else None))
    step_lines(out, plan.step_changes, plan.excluded)
    if fresh:
        plain(out, written_line(written))


def compiled_check_line(plan: Plan) -> str:
    """Whether the compiled plan's step was measured (NOTE [ The compiled plan is checked ])."""
    from planner.act.compiled_check import measured_of

    mine = measured_of(plan)
    if mine is None:
        return "compiled step: not measured with this plan; remat verify --compile measures it"
    return (f"compiled step: measured at {mine.peak_bytes} bytes ({format_bytes(mine.peak_bytes)}) with this "
            f"plan when it was made ({len(plan.compile.measured)} checkpoint sets measured in all)")


def step_lines(out: Console, changes: Iterable[Any], excluded: Iterable[Any], retained: Iterable[Any] = ()) -> None:
    """What remat changes in the training step, and the modules it will not checkpoint, with why."""
    for c in changes:
        what = "trains with use_cache=False" if c.kind == "hf_use_cache_off" else "runs every layer while measured"
        plain(out, f"step change: {c.module or 'the model'} {what} ({c.reason})")
    for x in excluded:
        plain(out, f"never checkpointed: {x.module or '<root>'}: {x.reason}")
    for r in retained:
        plain(out, f"retained when checkpointed: {r.unit} keeps {format_bytes(r.nbytes)} alive outside its region")


def show_profile(out: Console, profile: Profile, graph: nx.DiGraph, *, fresh: bool = False,
                 written: Path | str | None = None) -> None:
    """A profile for people: its candidate units and the measured step (``fresh``: and where it went)."""
    s = profile.step
    where = profile.device_name or profile.device
    plain(out, f"profile of {profile.fingerprint.model_class} on {where} ({profile.dtype}, "
               f"optimizer {profile.optimizer}), {len(profile.units)} module calls")
    if profile.measured_with_checkpoints:
        plain(out, f"memory-safe profile: measured with {len(profile.measured_with_checkpoints)} modules "
                   f"checkpointed, as the step did not fit the device; the unplanned step's timeline and peak "
                   f"are reconstructed from that run")
    plain(out, recipe_line(profile.recipe, profile.optimizer, profile.compile))
    plain(out, f"{graph.number_of_nodes()} candidate units:")
    out.print(units_table(graph))
    plain(out, f"step {s.step_ms:.3f} ms (forward {s.forward_ms:.3f}, backward {s.backward_ms:.3f}, "
               f"optimizer {s.optimizer_ms:.3f})")
    plain(out, time_line(profile.time_source, profile.threads, profile.time_calibration))
    for name, value in (("params", s.params_bytes + s.buffers_bytes), ("grads", s.grads_bytes),
                        ("optimizer", s.optimizer_bytes), ("batch", s.batch_bytes)):
        plain(out, f"  {name:<12}{format_bytes(value):>12}")
    if s.measured_peak_bytes is not None:
        plain(out, f"measured peak {s.measured_peak_bytes} bytes ({format_bytes(s.measured_peak_bytes)}) "
                   f"[{s.peak_source}]")
    if s.timeline_source == "as-run":
        plain(out, f"timeline: the step as run (under the tracker it peaked at "
                   f"{format_bytes(s.tracked_peak_bytes or 0)})")
    for step, units in profile.step_structure.skipped.items():
        plain(out, f"{step} skipped {', '.join(units)}")
    for note in profile.notes:
        plain(out, f"note: {note}")
    step_lines(out, profile.step_changes, profile.excluded, profile.retained)
    if profile.region_state_bytes:
        plain(out, f"every checkpointed region keeps {format_bytes(profile.region_state_bytes)} until its backward "
                   f"(the RNG state its replay restores); counted by the cost model")
    if fresh:
        plain(out, written_line(written, "profile"))


def verify_table(rows: Iterable[Any]) -> Table:
    """Predicted vs measured, one row per quantity (rows are dicts or sequences)."""
    rows = list(rows)
    table = Table(show_edge=False, pad_edge=False)
    if rows and isinstance(rows[0], dict):
        keys = list(rows[0])
        for k in keys:
            table.add_column(str(k), justify="left" if k == keys[0] else "right")
        for r in rows:
            table.add_row(*(Text(_cell(r.get(k))) for k in keys))
        return table
    for k in ("quantity", "predicted", "measured", "check"):
        table.add_column(k, justify="left" if k == "quantity" else "right")
    for r in rows:
        cells = list(r) + [""] * (4 - len(r))
        table.add_row(*(Text(_cell(c)) for c in cells[:4]))
    return table


def show_verify(out: Console, report: Any) -> None:
    """The verification report: what ran, its rows, notes, problems and the verdict."""
    windows = ", and 1 for the windows with the plan" if report.steps_run > report.steps + 2 else ""
    ran = (f"steps per run: 1 compared, {report.steps} timed, 1 for the peak{windows}" if report.steps_run
           else f"{report.steps} timed steps per run")
    plain(out, f"verify {report.model} on {report.device} ({ran}; peak from {report.peak_source}): "
               f"{len(report.checkpointed)} modules checkpointed"
               + (f", {len(report.offloaded)} offloaded" if report.offloaded else ""))
    under = f", under torch.compile ({report.compile})" if getattr(report, "compile", None) else ""
    plain(out, f"step: {report.recipe.describe()}{under}")
    for name, why in report.skipped.items():
        plain(out, f"skipped {name}: {why}")
    out.print(verify_table(report.rows()))
    for note in report.notes:
        plain(out, f"note: {note}")
    for problem in report.problems:
        plain(out, f"problem: {problem}")
    plain(out, "verify: OK" if report.ok else "verify: FAILED")


def show_buckets_verify(out: Console, report: Any) -> None:
    """A bucketed plan's verification: each bucket's report, then the verdict over all."""
    for i, (name, r) in enumerate(zip(report.buckets, report.reports)):
        plain(out, f"bucket {i} ({name}):")
        show_verify(out, r)
    plain(out, f"verify: OK ({len(report.reports)} buckets)" if report.ok else "verify: FAILED")


def show_rank_verify(out: Console, report: Any) -> None:
    """A per-rank verification: one row per rank, the gradient check, problems and the verdict."""
    plain(out, f"verify {report.model} on {report.world_size} {report.device} ranks ({report.sharding}, "
               f"{report.launched}; peak from {report.peak_source}): budget {format_bytes(report.budget_bytes)}, "
               f"prediction tolerance {report.peak_tolerance:.1%}")
    table = Table(show_edge=False, pad_edge=False)
    where = [k for k in ("stage", "tp_rank") if report.rows and getattr(report.rows[0], k) is not None]
    for name in ("rank", *where, "pred", "meas", "err", "fits", "no plan: pred", "meas", "err"):
        table.add_column(name.replace("_", " "), justify="right", no_wrap=True)
    for r in report.rows:
        no_plan = "-" if r.predicted_no_plan_peak_bytes is None else format_bytes(r.predicted_no_plan_peak_bytes)
        no_err = "-" if r.no_plan_error is None else f"{r.no_plan_error:+.2%}"
        table.add_row(str(r.rank), *(str(getattr(r, k)) for k in where), format_bytes(r.predicted_peak_bytes), format_bytes(r.measured_peak_bytes),
                      f"{r.error:+.2%}", "yes" if r.within_budget else "OVER", no_plan,
                      format_bytes(r.measured_no_plan_peak_bytes), no_err)
    out.print(table)
    plain(out, f"rank 0 vs one process without the plan: max |grad diff| {report.max_grad_diff:.3g} "
               f"(tolerance {report.grad_tolerance:g}), |loss diff| {report.loss_diff:.3g}")
    for note in report.notes:
        plain(out, f"note: {note}")
    for problem in report.problems:
        plain(out, f"problem: {problem}")
    plain(out, "verify: OK" if report.ok else "verify: FAILED")


def devices_table(specs: Sequence[Any]) -> Table:
    """Known devices: name, memory, reserve and usable memory (the default budget, see NOTE
    [ Usable memory ] in planner/profiling/devices.py), bf16 TFLOP/s, bandwidth, full name (aliases: ``--json``)."""
    from planner.profiling.devices import reserve_bytes, usable_bytes

    table = Table(show_edge=False, pad_edge=False)
    table.add_column("name", no_wrap=True)
    table.add_column("memory", justify="right", no_wrap=True)
    table.add_column("reserve", justify="right", no_wrap=True)
    table.add_column("usable", justify="right", no_wrap=True)
    table.add_column("bf16 TFLOP/s", justify="right")
    table.add_column("GB/s", justify="right")
    table.add_column("device", overflow="fold")
    for s in specs:
        bf16 = f"{s.peak_flops.bf16 / 1e12:.1f}" if s.peak_flops.bf16 else "-"
        table.add_row(Text(s.name), format_bytes(s.memory_bytes), format_bytes(reserve_bytes(s)),
                      format_bytes(usable_bytes(s)), bf16, f"{s.memory_bandwidth_bytes_per_s / 1e9:.0f}",
                      Text(s.display_name))
    return table


def show_devices(out: Console, specs: Sequence[Any]) -> None:
    out.print(devices_table(specs))


def frontier_table(report: Any) -> Table:
    """One row per budget; per solver its recompute and predicted peak, or "over" (no plan fits)."""
    names = [n for n in dict.fromkeys(p.solver for p in report.points) if not _baseline(n)]
    cells = {(p.budget_bytes, p.solver): p for p in report.points}
    table = Table(show_edge=False, pad_edge=False, title_justify="left",
                  caption="cells: recompute ms per step / predicted peak" if report.host_budget_bytes is None else
                  "cells: recompute + exposed copy ms per step / predicted peak",
                  caption_justify="left")
    table.add_column("budget", justify="right", no_wrap=True)
    for n in names:
        table.add_column(_solver_header(report, n), justify="right", no_wrap=True)
    for b in sorted({p.budget_bytes for p in report.points}):
        row = [format_bytes(b)]
        for n in names:
            p = cells.get((b, n))
            row.append("-" if p is None else _tradeoff_cell(p))
        table.add_row(*row)
    return table


def baselines_table(report: Any) -> Table:
    """The fixed rules once each: their plans do not depend on the budget."""
    table = Table(show_edge=False, pad_edge=False)
    cost = "recompute ms" if report.host_budget_bytes is None else "recompute + copies ms"
    for k, justify in (("baseline", "left"), ("peak", "right"), (cost, "right"),
                       ("% of step", "right"), ("checkpointed", "right")):
        table.add_column(k, justify=justify, no_wrap=True)
    seen: set[str] = set()
    for p in report.points:
        if _baseline(p.solver) and p.solver not in seen:
            seen.add(p.solver)
            table.add_row(Text(_label(p.solver)), format_bytes(p.peak_bytes), f"{p.overhead_ms:.1f}",
                          _share(p.overhead_ms, report.step_ms),
                          f"{p.checkpointed} + {p.offloaded} offl" if p.checkpointed and p.offloaded else
                          f"{p.offloaded} offl" if p.offloaded else str(p.checkpointed))
    return table


def show_frontier(out: Console, report: Any, *, written: Sequence[Path | str] = ()) -> None:
    """``remat frontier``: the sweep table, the baselines, the range swept, the files written."""
    plain(out, f"frontier of {report.model} on {report.device}: predicted peak from "
               f"{format_bytes(report.min_feasible_bytes)} (lowest feasible) to "
               f"{format_bytes(report.no_checkpoint_peak_bytes)} (no checkpointing); "
               f"step {report.step_ms:.1f} ms without recompute")
    if report.host_budget_bytes is not None:
        plain(out, f"with offload (keep, recompute or move to host, within {format_bytes(report.host_budget_bytes)} "
                   f"of host memory): lowest feasible peak {format_bytes(report.offload_min_feasible_bytes)}")
    plain(out, headroom_line(report.headroom))
    out.print(frontier_table(report))
    out.print(baselines_table(report))
    for path in written:
        plain(out, f"wrote {path}")


def compare_table(report: Any) -> Table:
    """Every solver and baseline at one budget: status ("over": over the budget), peak, share of
    the budget, recompute, number of checkpointed units. Fits 80 columns."""
    table = Table(show_edge=False, pad_edge=False)
    for k, justify in (("solver", "left"), ("status", "left"), ("peak", "right"), ("% budget", "right"),
                       ("recompute ms", "right"), ("% step", "right"), ("#ckpt", "right")):
        table.add_column(k, justify=justify, no_wrap=True)
    for p in report.points:
        status = Text("over", style="red") if p.status == "infeasible" else Text(p.status)
        table.add_row(Text(p.solver), status, format_bytes(p.peak_bytes),
                      f"{100 * p.peak_bytes / report.budget_bytes:.1f}%", f"{p.recompute_ms:.1f}",
                      _share(p.recompute_ms, report.step_ms), str(p.checkpointed))
    return table


def show_compare(out: Console, report: Any) -> None:
    """``remat compare``: the table at one budget, then the fastest plan that fits."""
    from planner.act.api import budget_with_headroom, usable_budget

    usable, _ = usable_budget(report.budget_bytes, report.headroom)
    plain(out, headroom_line(report.headroom, usable))
    out.print(compare_table(report))
    fits = [p for p in report.points if p.status != "infeasible"]
    if fits:
        best = min(fits, key=lambda p: (p.recompute_ms, p.peak_bytes))
        plain(out, f"least recompute within the budget: {best.solver} ({best.recompute_ms:.1f} ms per step, "
                   f"{_share(best.recompute_ms, report.step_ms)} of the step)")
    else:
        lowest = budget_with_headroom(report.min_feasible_bytes, report.headroom)
        plain(out, f"nothing fits; the lowest feasible budget is {lowest} bytes ({format_bytes(lowest)})")


def headroom_line(headroom: float, usable_bytes: int | None = None) -> str:
    """How much of a budget compare and frontier keep free, as ``remat plan`` does."""
    within = f": a plan fits when its peak is within {format_bytes(usable_bytes)}" if usable_bytes is not None else ""
    return f"headroom {100 * headroom:.1f}% of the budget kept free, as remat plan keeps it (--headroom){within}"


# ----------------------------------------------------------------------------- helpers


def _graph_depth(g: nx.DiGraph, n: str) -> int:
    d, p = 0, g.nodes[n]["parent"]
    while p is not None:
        d, p = d + 1, g.nodes[p]["parent"]
    return d


def _inside(g: nx.DiGraph, n: str, chosen: set[str]) -> str:
    p = g.nodes[n]["parent"]
    while p is not None:
        if p in chosen:
            return f"inside {p}"
        p = g.nodes[p]["parent"]
    return "-"


_BASELINE_NAMES = {"none": "none (no checkpointing)", "all": "all (every layer)",
                   "offload-all": "offload-all (every layer to host)"}


def _baseline(name: str) -> bool:
    """A fixed rule (planner.act.frontier.BASELINES): its plan does not depend on the budget."""
    from planner.act.frontier import BASELINES, OFFLOAD_BASELINE

    return name in BASELINES or name == OFFLOAD_BASELINE


def _label(name: str) -> str:
    return _BASELINE_NAMES.get(name, name)


def _solver_header(report: Any, name: str) -> str:
    """``dp (optimal)`` when the optimal solver proved every plan of the sweep, ``dp`` otherwise."""
    proven = all(p.status == "optimal" for p in report.points if p.solver == name and p.status != "infeasible")
    return f"{name} (optimal)" if name == report.optimal_solver and proven else name


def _tradeoff_cell(p: Any) -> str:
    if p.status == "infeasible":
        return "over"
    return f"{p.overhead_ms:.1f} / {format_bytes(p.peak_bytes)}"


def _share(ms: float, step_ms: float) -> str:
    return f"{100 * ms / step_ms:.1f}%" if step_ms > 0 else "n/a"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, bool):
        return "ok" if value else "FAIL"
    return "" if value is None else str(value)


__all__ = ["baselines_table", "buckets_table", "budget_line", "checkpoints_table", "compare_table", "consoles", "devices_table", "error_line", "frontier_table", "headroom_line", "MIB", "peak_lines", "plain", "recipe_line", "recompute_line", "selective_table", "show_buckets_verify", "show_compare", "show_devices", "show_frontier", "show_plan", "show_profile", "show_rank_verify", "show_verify", "solver_line", "step_lines", "time_line", "units_table", "verify_table", "written_line"]
