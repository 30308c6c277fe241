"""Is the objective right? A plan's predicted recompute ms against its measured step-time overhead.

    python benchmarks/time_model.py                          # llama, gpt2, qwen2; mid budget; torch's threads
    python benchmarks/time_model.py --models gpt2,llama --rounds 11 --quarters 1,2,3
    python benchmarks/time_model.py --quarters 2.5         # five eighths of the way: op-level plans on GPT-2
    python benchmarks/time_model.py --threads 1              # the thread's CPU time: robust on a busy machine

For each model (an example's name, or a model file's path): one profile on the CPU at
``--threads`` (default: torch's; see NOTE [ Unit costs ], Rules 1 and 1b), then at each quarter
``q`` of the way from the lowest feasible peak to the peak without checkpointing two plans
(``auto``): whole modules only (``selective=False``) and the default (op-level policies allowed;
a row says "same" when the solver kept whole modules). The plain model and every planned one
(``apply_plan`` on copies of one model) are trained side by side (where the default plan keeps
whole modules, also the op-level plan of the same figures with their spreads set aside, so the
op-level price is measured too; where that is whole modules as well, the one with NOTE [ Robust
choice ]'s 15% line set aside too: the op-level plan the figures price cheapest): ``--rounds`` rounds of one
step of each in turn (``planner.profiling.timing.time_interleaved``), at the profile's thread
count, on ``pick_clock``'s clock (the thread's CPU time at one thread, the wall clock above).
Measured overhead = least planned step - least plain step over the rounds (noise on a shared
machine only raises a step's time); the noise is the interquartile range of the per-round
paired differences (planned - plain of the same round), printed beside it, with their median.

Target per row: |predicted - measured| <= max(15% of measured, 3 ms). Prints a Markdown table;
``--json PATH`` also writes every sample.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from planner.act.api import budget_with_headroom, graph_for, min_feasible_bytes, plan_from_profile  # noqa: E402
from planner.act import robust  # noqa: E402
from planner.act.applier import apply_plan  # noqa: E402
from planner.act.verify import RECOMPUTE_FLOOR_MS, RECOMPUTE_TOLERANCE  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402
from planner.profiling.measure import make_optimizer, make_step  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.profiling import profile  # noqa: E402
from planner.profiling.timing import pick_clock, spread_ms, time_interleaved  # noqa: E402

MODELS = ("llama", "gpt2", "benchmarks/models/qwen2.py")


def model_path(name: str) -> Path:
    """An example's name (examples/<name>.py) or a model file's path."""
    return Path(name) if name.endswith(".py") else ROOT / "examples" / f"{name}.py"


def rows_for(name: str, *, threads: int | None, steps: int, rounds: int,
             quarters: tuple[float, ...]) -> list[dict[str, Any]]:
    mf = load_model_file(model_path(name))
    master = mf.build_model()
    t0 = time.perf_counter()
    prof = profile(copy.deepcopy(master), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=steps,
                   threads=threads)
    profile_s = time.perf_counter() - t0
    g = graph_for(prof)
    lo, hi = min_feasible_bytes(g), simulate(g, []).peak_bytes
    plans = {}
    for q in quarters:
        budget = budget_with_headroom(lo + int((hi - lo) * q) // 4)
        q = f"{q:g}"
        plans[f"{q}/4 modules"] = plan_from_profile(prof, budget, selective=False)
        plans[f"{q}/4 default"] = plan_from_profile(prof, budget, graph=g)
        if not plans[f"{q}/4 default"].selective:  # the op-level plan a quiet machine's figures would give
            quiet = plan_from_profile(_without_spreads(prof), budget)
            if quiet.selective:
                plans[f"{q}/4 op-level, spreads set aside"] = quiet
            else:  # and without Rule 1's 15% line: the op-level plan the figures price cheapest, timed too
                with mock.patch.object(robust, "OP_LEVEL_MIN_GAIN", 0.0):
                    cheapest = plan_from_profile(_without_spreads(prof), budget)
                if cheapest.selective:
                    plans[f"{q}/4 op-level, rules set aside"] = cheapest
    steps_by_name = {"plain": _step(master, mf, None)}
    steps_by_name.update({label: _step(master, mf, plan) for label, plan in plans.items()})
    before = torch.get_num_threads()
    used = prof.threads or before
    torch.set_num_threads(used)
    try:
        for step in steps_by_name.values():  # warm-up: optimizer state, allocator caches
            step()
        clock = pick_clock(torch.device("cpu"), used)
        samples = time_interleaved(steps_by_name, rounds=rounds, clock=clock,
                                   on_round=lambda r: print(f"{name}: round {r + 1}/{rounds}", file=sys.stderr))
    finally:
        torch.set_num_threads(before)
    plain = samples["plain"][0]
    rows = []
    for label, plan in plans.items():
        mine = samples[label][0]
        measured = min(mine) - min(plain)
        paired = [a - b for a, b in zip(mine, plain)]
        predicted = plan.predicted.recompute_ms
        allowed = max(RECOMPUTE_TOLERANCE * abs(measured), RECOMPUTE_FLOOR_MS)
        same = label.endswith("default") and _same(plan, plans[label.replace("default", "modules")])
        rows.append(dict(model=name, budget=label, budget_bytes=plan.budget_bytes, checkpoints=plan.checkpoints,
                         selective=[r.fqn for r in plan.selective], same_as_modules=same,
                         predicted_ms=predicted, measured_ms=measured, paired_median_ms=statistics.median(paired),
                         noise_ms=spread_ms(paired), plain_ms=min(plain), error_ms=predicted - measured,
                         allowed_ms=allowed, ok=abs(predicted - measured) <= allowed, time_source=prof.time_source,
                         clock=clock.source, threads=used, thread_scale=prof.thread_scale, profile_s=profile_s,
                         group_scales=sorted({u.thread_scale for u in prof.units if u.thread_scale}),
                         load=os.getloadavg()[0], samples=samples[label], plain_samples=samples["plain"]))
    return rows


def _without_spreads(prof: Any) -> Any:
    """``prof`` with every spread 0: the noise rules (NOTE [ Selective menus ], NOTE [ Robust choice ])
    set aside, to time the op-level plan the same figures give on a quiet machine."""
    units = [u.model_copy(update={"forward_spread_ms": 0.0, "backward_spread_ms": 0.0}) for u in prof.units]
    return prof.model_copy(update={"units": units, "sac_recomputed_op_spread_ms": 0.0, "sac_kept_op_spread_ms": 0.0})


def _same(a: Any, b: Any) -> bool:
    return a.checkpoints == b.checkpoints and not a.selective and not b.selective


def _step(master: torch.nn.Module, mf: Any, plan: Any) -> Any:
    """A copy of ``master`` (with ``plan`` applied) and its training step (optimizer at lr=0)."""
    model = copy.deepcopy(master).train()
    batch = mf.example_inputs()
    if plan is not None:
        apply_plan(model, plan, inputs=batch)
    return make_step(model, batch, loss_fn=mf.loss_fn, optimizer=make_optimizer(plan.optimizer if plan else "adamw",
                                                                                model))


def print_table(rows: list[dict[str, Any]], command: str) -> None:
    first = rows[0] if rows else {}
    print(f"`{command}`: torch {torch.__version__}, {first.get('threads')} thread(s), profile clock "
          f"{first.get('time_source')}, steps timed on {first.get('clock')}; measured = least planned - least "
          f"plain step over interleaved rounds; noise = interquartile range of the paired per-round differences\n")
    print("| model | budget, plan | checkpoints (op-level) | plain step ms | predicted ms | measured ms | error | "
          "noise ms | paired median ms | ok | load | thread factor (groups) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    for r in rows:
        what = "same as whole modules" if r["same_as_modules"] else \
            f"{len(r['checkpoints'])} ({len(r['selective'])} op-level)"
        err = f"{100 * r['error_ms'] / r['measured_ms']:+.0f}%" if r["measured_ms"] > 0 else f"{r['error_ms']:+.1f} ms"
        print(f"| {r['model']} | {r['budget']} | {what} | {r['plain_ms']:.1f} | {r['predicted_ms']:.1f} | "
              f"{r['measured_ms']:.1f} | {err} | {r['noise_ms']:.1f} | {r['paired_median_ms']:.1f} | "
              f"{'yes' if r['ok'] else 'NO'} | {r['load']:.1f} | {_factors(r)} |")
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} rows within max(15% of measured, 3 ms)")


def _factors(row: dict[str, Any]) -> str:
    """The profile's thread factor and its cost groups' (NOTE [ Thread factor per cost group ])."""
    if not row["thread_scale"]:
        return "-"
    groups = ", ".join(f"{s:.3f}" for s in row["group_scales"])
    return f"{row['thread_scale']:.3f}" + (f" ({groups})" if groups else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="example names or model file paths, comma-separated")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the profile and the timed steps "
                                                              "(default: torch's)")
    ap.add_argument("--steps", type=int, default=3, help="profiler timing steps (the CLI's default)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds of timed steps")
    ap.add_argument("--quarters", default="2", help="budgets, in quarters from the lowest feasible peak to none (2.5: five eighths)")
    ap.add_argument("--json", type=Path, default=None, help="also write every row and sample here")
    args = ap.parse_args()
    quarters = tuple(float(q) for q in args.quarters.split(","))
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        rows += rows_for(name.strip(), threads=args.threads, steps=args.steps, rounds=args.rounds, quarters=quarters)
    print_table(rows, "python benchmarks/time_model.py " + " ".join(sys.argv[1:]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
