"""Is the objective right? A plan's predicted recompute ms against its measured step-time overhead.

    python benchmarks/time_model.py                          # every example, 1 thread (CPU time)
    python benchmarks/time_model.py --models gpt2,llama --rounds 11
    python benchmarks/time_model.py --threads 2              # wall clock: noisy on a busy machine

For each example: one profile on the CPU at ``--threads`` (``planner.profiling.profiler.profile``; its clock
is the thread's CPU time at one thread, see NOTE [ Unit costs ]), then the optimal plan (``auto``)
at 1/4, 1/2 and 3/4 of the way from the lowest feasible peak to the peak without checkpointing.
The plain model and the three planned ones (``apply_plan`` on copies of one model) are then
trained side by side: ``--rounds`` rounds of one step of each in turn
(``planner.profiling.timing.time_interleaved``), at the profile's thread count. Measured overhead = the
median over rounds of (planned step - plain step of the same round), on the profile's clock and on
the wall clock: pairing within a round cancels the machine's drift between rounds.

Target per row: |predicted - measured| <= max(15% of measured, 3 ms) on the profile's clock.
Prints a Markdown table; ``--json PATH`` also writes every sample.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from planner.act.api import budget_with_headroom, graph_for, min_feasible_bytes, plan_from_profile  # noqa: E402
from planner.act.applier import apply_plan  # noqa: E402
from planner.act.verify import RECOMPUTE_FLOOR_MS, RECOMPUTE_TOLERANCE  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402
from planner.profiling.measure import make_optimizer, make_step  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.profiling import profile  # noqa: E402
from planner.profiling.timing import pick_clock, time_interleaved  # noqa: E402

MODELS = ("transformer", "gpt2", "llama", "t5", "resnet", "unet")
QUARTERS = (1, 2, 3)


def rows_for(name: str, *, threads: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    mf = load_model_file(ROOT / "examples" / f"{name}.py")
    master = mf.build_model()
    t0 = time.perf_counter()
    prof = profile(copy.deepcopy(master), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=steps,
                   threads=threads)
    profile_s = time.perf_counter() - t0
    g = graph_for(prof)
    lo, hi = min_feasible_bytes(g), simulate(g, []).peak_bytes
    plans = {f"{q}/4": plan_from_profile(prof, budget_with_headroom(lo + (hi - lo) * q // 4), graph=g)
             for q in QUARTERS}
    steps_by_name = {"plain": _step(master, mf, None)}
    steps_by_name.update({label: _step(master, mf, plan) for label, plan in plans.items()})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in steps_by_name.values():  # warm-up: optimizer state, allocator caches
            step()
        clock = pick_clock(torch.device("cpu"), threads)
        samples = time_interleaved(steps_by_name, rounds=rounds, clock=clock,
                                   on_round=lambda r: print(f"{name}: round {r + 1}/{rounds}", file=sys.stderr))
    finally:
        torch.set_num_threads(before)
    base_clock, base_wall = (statistics.median(x) for x in samples["plain"])
    rows = []
    for label, plan in plans.items():
        measured, wall_ms = (_paired_median(samples[label][i], samples["plain"][i]) for i in (0, 1))
        predicted = plan.predicted.recompute_ms
        allowed = max(RECOMPUTE_TOLERANCE * abs(measured), RECOMPUTE_FLOOR_MS)
        rows.append(dict(model=name, budget=label, budget_bytes=plan.budget_bytes, checkpoints=plan.checkpoints,
                         predicted_ms=predicted, measured_ms=measured, measured_wall_ms=wall_ms,
                         plain_ms=base_clock, plain_wall_ms=base_wall, error_ms=predicted - measured,
                         allowed_ms=allowed, ok=abs(predicted - measured) <= allowed, time_source=prof.time_source,
                         threads=prof.threads, profile_s=profile_s, samples=samples[label],
                         plain_samples=samples["plain"]))
    return rows


def _paired_median(planned: list[float], plain: list[float]) -> float:
    return statistics.median(a - b for a, b in zip(planned, plain))


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
          f"{first.get('time_source')}; measured = median over interleaved rounds of (planned - plain) step time\n")
    print("| model | budget | checkpoints | plain step ms | predicted ms | measured ms | error ms | allowed ms | "
          "ok | measured wall ms |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['budget']} | {len(r['checkpoints'])} | {r['plain_ms']:.1f} | "
              f"{r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {r['error_ms']:+.1f} | {r['allowed_ms']:.1f} | "
              f"{'yes' if r['ok'] else 'NO'} | {r['measured_wall_ms']:.1f} |")
    ok = sum(r["ok"] for r in rows)
    print(f"\n{ok} of {len(rows)} rows within max(15% of measured, 3 ms)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the profile and the timed steps")
    ap.add_argument("--steps", type=int, default=5, help="profiler timing steps")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds of timed steps")
    ap.add_argument("--json", type=Path, default=None, help="also write every row and sample here")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        rows += rows_for(name.strip(), threads=args.threads, steps=args.steps, rounds=args.rounds)
    print_table(rows, "python benchmarks/time_model.py " + " ".join(sys.argv[1:]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
