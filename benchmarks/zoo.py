"""The conformance zoo: every model in ``benchmarks/zoo_models.py``, profiled, planned, applied, measured.

    python benchmarks/zoo.py                       # every model, 3 budgets each; prints the table
    python benchmarks/zoo.py --models llama,t5     # some of them
    python benchmarks/zoo.py --markdown docs/zoo.md  # also write the table as docs/zoo.md
    python benchmarks/zoo.py --recipes all --tiny  # RECIPE_MODELS under every step recipe

For each model: profile one training step on the CPU (AdamW at lr=0, as ``remat plan``
does), plan at budgets 1/4, 1/2 and 3/4 of the way from the minimum feasible peak to the
no-checkpoint peak (plus the planner's headroom), apply each plan with ``apply_plan`` to a
fresh copy and measure with ``planner.verify`` (the allocator's own events; the plan never
sees them). A row passes when nothing crashes, the measured peak is within the budget,
|predicted - measured| <= 2% of measured, and every gradient and buffer equals the unplanned
model's bit for bit (verify replays the RNG, so dropout draws the same masks).

``run_case(spec, budget_fraction, recipe=...)`` is one row; ``recipe`` (a name of ``RECIPES``
or a ``schema.Recipe``: gradient accumulation, amp, clipping) is the training step profiled,
planned and verified, and the row's ``recipe`` column.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.zoo_models import FULL, SPECS, TINY, ModelSpec, Size  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75)
"""Budgets as the fraction of the way from the minimum feasible peak to the no-checkpoint peak."""

MAX_ERROR = 0.02
"""Largest |predicted - measured| / measured peak a row may show (issue #11)."""

RECIPES: dict[str, dict[str, Any]] = {
    "plain": {},
    "accum4": {"grad_accum": 4},
    "bf16": {"amp": "bf16"},
    "fp16": {"amp": "fp16"},  # with a GradScaler
    "clip": {"clip_grad_norm": 1.0},
    "accum4+fp16+clip": {"grad_accum": 4, "amp": "fp16", "clip_grad_norm": 1.0},
}
"""Training-step recipes (``schema.Recipe`` fields) the zoo runs, by name (issue #17); 'plain' is the
plain PyTorch loop."""

RECIPE_MODELS = ("bert", "vit", "bart", "albert", "transformer-encoder")
"""Models the non-plain recipes run on (``--recipes`` without ``--models``): an encoder, a vision
transformer, an encoder-decoder, weights shared across depth, plain PyTorch."""


def recipe_named(recipe: Any) -> tuple[str, Any]:
    """(name, ``schema.Recipe`` or None) for a ``RECIPES`` name, a Recipe or None."""
    from planner.model.schema import Recipe

    if recipe is None or isinstance(recipe, Recipe):
        name = next((n for n, f in RECIPES.items() if Recipe(**f) == recipe), None) if recipe else "plain"
        return name or recipe.describe(), recipe
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {', '.join(RECIPES)}")
    return recipe, Recipe(**RECIPES[recipe]) if RECIPES[recipe] else None


@dataclass
class Case:
    """One zoo row: a model at one budget, what was predicted and what was measured."""

    model: str
    family: str
    fraction: float
    recipe: str = "plain"  # a name of RECIPES
    params: int = 0
    candidates: int = 0
    budget_bytes: int = 0
    none_predicted_bytes: int = 0
    none_measured_bytes: int = 0
    predicted_bytes: int = 0
    measured_bytes: int = 0
    checkpointed: int = 0  # modules the plan checkpoints
    recompute_ms: float = 0.0  # predicted
    recompute_pct: float = 0.0  # predicted recompute / predicted unplanned step
    max_grad_diff: float = 0.0
    solver: str = ""
    seconds: float = 0.0
    error: str = ""  # why the row crashed, or ""
    problems: tuple[str, ...] = ()

    @property
    def rel_error(self) -> float:
        """(predicted - measured) / measured peak of the plan."""
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes if self.measured_bytes else 0.0

    @property
    def passed(self) -> bool:
        return not self.error and not self.problems


@dataclass
class Profiled:
    """A model's profile and candidate graph, shared by its budgets."""

    spec: ModelSpec
    size: Size
    profile: Any
    graph: Any
    params: int
    lo_bytes: int  # minimum feasible predicted peak
    hi_bytes: int  # no-checkpoint predicted peak


def profile_spec(spec: ModelSpec, *, size: Size = FULL, recipe: Any = None, steps: int = 2) -> Profiled:
    """Profile ``spec`` on the CPU and build the graph the planner solves on."""
    from planner.act.api import graph_for, min_feasible_bytes
    from solvers.cost_model import simulate
    from planner.profiling import profile

    model = spec.build(size)
    prof = profile(model, spec.inputs(size), loss_fn=spec.loss_fn, device="cpu", steps=steps,
                   recipe=recipe_named(recipe)[1])
    g = graph_for(prof, solver="auto")
    return Profiled(spec, size, prof, g, sum(p.numel() for p in model.parameters()),
                    min_feasible_bytes(g), simulate(g, []).peak_bytes)


def budget_at(p: Profiled, fraction: float) -> int:
    """The budget ``fraction`` of the way from the minimum feasible peak to none, with headroom."""
    from planner.act.api import budget_with_headroom, headroom_for

    return budget_with_headroom(p.lo_bytes + int((p.hi_bytes - p.lo_bytes) * fraction), headroom_for(p.profile))


def run_case(spec: ModelSpec, budget_fraction: float, *, recipe: Any = None, size: Size = FULL,
             profiled: Profiled | None = None, steps: int = 1) -> Case:
    """One zoo row: plan ``spec`` at ``budget_fraction``, apply, measure, judge. Never raises.

    ``profiled`` reuses a profile of the same spec, size and recipe (``profile_spec``).
    """
    name, recipe = recipe_named(recipe)
    case = Case(spec.name, spec.family, budget_fraction, name)
    t0 = time.perf_counter()
    try:
        p = profiled or profile_spec(spec, size=size, recipe=recipe)
        _measure(case, p, budget_fraction, steps)
    except Exception as e:  # a crash is a row that fails, with its reason
        case.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        case.problems = (_where(e),)
    case.seconds = round(time.perf_counter() - t0, 1)
    return case


def _measure(case: Case, p: Profiled, fraction: float, steps: int) -> None:
    from planner.act.api import plan_from_profile
    from planner.act.verify import verify

    budget = budget_at(p, fraction)
    plan = plan_from_profile(p.profile, budget, solver="auto", graph=p.graph)
    rep = verify(p.spec.build(p.size), plan, inputs=p.spec.inputs(p.size), loss_fn=p.spec.loss_fn,
                 device="cpu", steps=steps, tolerance=0.0)
    pred = plan.predicted
    case.params, case.candidates, case.budget_bytes = p.params, p.graph.number_of_nodes(), budget
    case.none_predicted_bytes, case.none_measured_bytes = pred.no_checkpoint_peak_bytes, rep.measured_no_plan_peak_bytes
    case.predicted_bytes, case.measured_bytes = rep.predicted_peak_bytes, rep.measured_peak_bytes
    case.checkpointed, case.solver = len(plan.checkpoints), f"{plan.solver.name}/{plan.solver.status}"
    case.recompute_ms = pred.recompute_ms
    case.recompute_pct = 100 * pred.recompute_ms / max(1e-9, pred.step_ms - pred.recompute_ms)
    case.max_grad_diff = max(rep.max_grad_diff, rep.max_buffer_diff)
    problems = list(rep.problems)  # over budget, gradients or buffers differ
    if abs(case.rel_error) > MAX_ERROR:
        problems.append(f"prediction off by {case.rel_error:+.2%} (more than {MAX_ERROR:.0%})")
    case.problems = tuple(problems)


def _where(e: BaseException) -> str:
    """The innermost frame of a traceback, for a one-line crash summary."""
    tb = traceback.extract_tb(e.__traceback__)
    return f"at {Path(tb[-1].filename).name}:{tb[-1].lineno} in {tb[-1].name}" if tb else ""


def run_model(spec: ModelSpec, *, fractions=FRACTIONS, recipe: Any = None, size: Size = FULL,
              steps: int = 1) -> list[Case]:
    """Every budget of one model, from one profile. A crash while profiling fails every row."""
    try:
        p = profile_spec(spec, size=size, recipe=recipe)
    except Exception as e:
        return [Case(spec.name, spec.family, f, recipe_named(recipe)[0],
                     error=f"{type(e).__name__}: {e}".splitlines()[0][:300], problems=(_where(e),))
                for f in fractions]
    return [run_case(spec, f, recipe=recipe, size=size, profiled=p, steps=steps) for f in fractions]


# ----------------------------------------------------------------------------- output

HEADER = ("model", "family", "recipe", "params", "cand.", "budget", "none pred", "none meas", "plan pred", "plan meas",
          "error", "ckpt", "recompute", "result")


def row(c: Case) -> tuple[str, ...]:
    mib = lambda b: f"{b / 2**20:.2f}" if b else "-"  # noqa: E731
    if c.error:
        return (c.model, c.family, c.recipe, "-", "-", "-", "-", "-", "-", "-", "-", "-", "-",
                f"FAIL: {c.error} {' '.join(c.problems)}")
    result = "pass" if c.passed else "FAIL: " + "; ".join(c.problems)
    return (c.model, c.family, c.recipe, f"{c.params / 1e6:.2f}M", str(c.candidates),
            f"{int(c.fraction * 4)}/4 {mib(c.budget_bytes)}", mib(c.none_predicted_bytes),
            mib(c.none_measured_bytes), mib(c.predicted_bytes), mib(c.measured_bytes), f"{c.rel_error:+.2%}",
            str(c.checkpointed), f"{c.recompute_ms:.1f} ms ({c.recompute_pct:.0f}%)", result)


def markdown(cases: list[Case], skipped: dict[str, str], command: str) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(c)) + " |" for c in cases]
    ok = [c for c in cases if not c.error]
    worst = max(ok, key=lambda c: abs(c.rel_error), default=None)
    out = [f"Produced by `{command}`; peaks in MiB.", "", *lines, ""]
    if worst is not None:
        under = min(ok, key=lambda c: c.rel_error)
        out.append(f"{sum(c.passed for c in cases)} of {len(cases)} rows pass; worst |error| "
                   f"{abs(worst.rel_error):.2%} ({worst.model} at {int(worst.fraction * 4)}/4); most under-predicted "
                   f"{under.rel_error:+.2%} ({under.model} at {int(under.fraction * 4)}/4), what the planner's "
                   f"headroom must cover (planner.act.api.DEFAULT_HEADROOM).")
    for name, why in skipped.items():
        out.append(f"- {name}: skipped, {why}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="", help="comma-separated names (default: all)")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    ap.add_argument("--json", type=Path, help="write the rows here as JSON")
    ap.add_argument("--tiny", action="store_true", help="the sizes CI runs (tests/test_zoo.py)")
    ap.add_argument("--recipes", default="plain",
                    help=f"comma-separated step recipes, or 'all' ({', '.join(RECIPES)}); other than plain, "
                         f"the models default to RECIPE_MODELS and the table to its own markers")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)),
                    help="budgets, as fractions of the way from the minimum feasible peak to none")
    args = ap.parse_args(argv)
    recipes = list(RECIPES) if args.recipes == "all" else [r for r in args.recipes.split(",") if r]
    for r in recipes:
        try:
            recipe_named(r)  # an unknown name fails here, before any profiling
        except ValueError as e:
            ap.error(str(e))
    fractions = tuple(float(f) for f in args.fractions.split(",") if f)
    only_plain = recipes == ["plain"]
    import torch

    torch.set_num_threads(1)  # a shared 2-core machine: one thread keeps timings comparable
    names = [n for n in args.models.split(",") if n] or ([] if only_plain else list(RECIPE_MODELS))
    specs = [s for s in SPECS if not names or s.name in names]
    cases, skipped = [], {}
    print(" | ".join(HEADER), flush=True)
    for spec in specs:
        why = spec.missing()
        if why:
            skipped[spec.name] = why
            print(f"{spec.name}: skipped, {why}", flush=True)
            continue
        for recipe in recipes:
            for c in run_model(spec, fractions=fractions, recipe=recipe, size=TINY if args.tiny else FULL):
                cases.append(c)
                print(" | ".join(row(c)), f"[{c.seconds:.0f} s]", flush=True)
    command = "python benchmarks/zoo.py" + (f" --models {args.models}" if args.models else "") + \
        ("" if only_plain else f" --recipes {args.recipes}") + \
        (f" --fractions {args.fractions}" if fractions != FRACTIONS else "") + \
        (" --tiny" if args.tiny else "") + \
        (f" --markdown {args.markdown}" if args.markdown else "")
    table = markdown(cases, skipped, command)
    print(table.splitlines()[-1 - len(skipped)] if cases else "no rows")
    if args.markdown:
        _write_between_markers(args.markdown, table, "zoo table" if only_plain else "zoo recipes")
    if args.json:
        import json

        args.json.write_text(json.dumps([asdict(c) | {"rel_error": c.rel_error, "passed": c.passed}
                                         for c in cases], indent=1))
    return 0 if all(c.passed for c in cases) else 1


def _write_between_markers(path: Path, table: str, tag: str) -> None:
    """Replace the table between ``<!-- {tag} begin/end -->`` in ``path`` (appended when absent), atomically."""
    from planner.files import atomic_write_text

    BEGIN, END = f"<!-- {tag} begin -->", f"<!-- {tag} end -->"
    text = path.read_text() if path.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = f"{head}{BEGIN}\n{table}{END}{rest.split(END, 1)[1]}"
    else:
        text = f"{text}{BEGIN}\n{table}{END}\n"
    atomic_write_text(path, text)


if __name__ == "__main__":
    sys.exit(main())
