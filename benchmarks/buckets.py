"""A bucketed plan against the single plan for the longest shape, on examples/llama.py, one CPU thread.

    python benchmarks/buckets.py [--seq-lens 128,256,512] [--budget-point 0.5] [--epochs 2]

1. Profiles examples/llama.py (batch 8) at each length and plans every length under one budget
   (``planner.act.api.plan_buckets``). The budget is held out: fixed by a rule before anything is
   measured against it, ``--budget-point`` of the way from the longest length's lowest feasible
   peak to its peak without checkpointing (with the default headroom on top).
2. Verifies every bucket (``planner.act.verify.verify``: the whole bucketed plan applied, each
   bucket's batch trained with and without it): measured vs predicted peak, the budget, the
   bucket the switch picked, gradients against the unplanned model.
3. Trains a mixed-length epoch (60% short, 30% mid, 10% long batches, shuffled with a fixed seed)
   on three copies of the model: unplanned, the bucketed plan, and the single plan made for the
   longest length (the bucketed plan's largest bucket) under the same budget. Each batch is one
   step (forward, loss, backward) of each copy in turn, so load on the machine hits all three
   alike; CPU time of the thread (one thread) and wall time per step. Recompute = the planned
   copy's time minus the unplanned copy's, summed over the epoch.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.api import budget_with_headroom, graph_for, min_feasible_bytes, plan_buckets  # noqa: E402
from planner.act.applier import apply_plan  # noqa: E402
from planner.act.buckets import bucket_plans  # noqa: E402
from planner.act.verify import verify  # noqa: E402
from planner.profiling import profile  # noqa: E402
from planner.profiling.model_file import call_model, default_loss, load_model_file  # noqa: E402
from planner.sizes import format_bytes  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402

MIX = (0.6, 0.3, 0.1)
"""Share of short, mid and long batches in the epoch."""
EPOCH_BATCHES = 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", default="128,256,512")
    ap.add_argument("--budget-point", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lens = [int(n) for n in args.seq_lens.split(",")]
    mf = load_model_file(ROOT / "examples" / "llama.py")

    t0 = time.perf_counter()
    profiles = [profile(mf.build_model(), mf.example_inputs(seq_len=n), loss_fn=mf.loss_fn, device="cpu",
                        steps=args.steps, threads=1) for n in lens]
    g = graph_for(profiles[-1])
    lo, hi = min_feasible_bytes(g), simulate(g, []).peak_bytes
    budget = budget_with_headroom(lo + int((hi - lo) * args.budget_point))
    plan = plan_buckets(profiles, budget, shapes=[{"seq_len": n} for n in lens])
    print(f"profiled and planned {len(lens)} lengths in {time.perf_counter() - t0:.0f} s; budget {budget} bytes "
          f"({format_bytes(budget)}): {args.budget_point:g} of the way from {lens[-1]} tokens' lowest feasible "
          f"peak {format_bytes(lo)} to its peak without checkpointing {format_bytes(hi)}")

    report = verify(mf, plan, steps=args.steps, device="cpu", threads=1)
    print(f"\n{'seq_len':>8}{'checkpointed':>14}{'op by op':>10}{'predicted':>12}{'measured':>12}{'error':>8}"
          f"{'fits':>6}{'bucket':>8}{'grad diff':>11}{'pred rec ms':>13}{'meas rec ms':>13}")
    for n, b, r in zip(lens, plan.buckets, report.reports):
        print(f"{n:>8}{len(b.checkpoints):>14}{len(b.selective):>10}{format_bytes(r.predicted_peak_bytes):>12}"
              f"{format_bytes(r.measured_peak_bytes):>12}{r.prediction_error:>+8.2%}"
              f"{str(r.measured_peak_bytes <= budget):>6}{'ok' if r.ok else 'FAIL':>8}{r.max_grad_diff:>11.3g}"
              f"{r.predicted_recompute_ms:>13.1f}{r.measured_recompute_ms:>13.1f}")
    print(f"verify: {'OK' if report.ok else 'FAILED: ' + '; '.join(report.problems)}")

    epoch(mf, plan, lens, args.epochs)


def epoch(mf, plan, lens: list[int], epochs: int) -> None:
    counts = [round(EPOCH_BATCHES * share) for share in MIX]
    order = [n for n, c in zip(lens, counts) for _ in range(c)]
    random.Random(0).shuffle(order)
    batches = {n: mf.example_inputs(seq_len=n) for n in lens}
    master = mf.build_model()
    single = bucket_plans(plan)[-1]  # the plan for the longest length alone
    models, handles = {}, {}
    for name, p in (("unplanned", None), ("bucketed", plan), ("single", single)):
        models[name] = copy.deepcopy(master).train()
        handles[name] = apply_plan(models[name], p, guard="error") if p is not None else None
    cpu = {name: [] for name in models}
    wall = {name: [] for name in models}
    for i, n in enumerate(order * (epochs + 1)):  # the first epoch warms up
        names = list(models)
        names = names[i % 3:] + names[:i % 3]  # who goes first rotates
        for name in names:
            model = models[name]
            c0, w0 = time.process_time(), time.perf_counter()
            default_loss(call_model(model, batches[n])).backward()
            c1, w1 = time.process_time(), time.perf_counter()
            model.zero_grad(set_to_none=True)
            if i >= len(order):
                cpu[name].append((n, (c1 - c0) * 1e3))
                wall[name].append((n, (w1 - w0) * 1e3))
    recomputed = {name: (h.recompute_count if h else 0) for name, h in handles.items()}
    print(f"\nmixed epoch: {len(order)} batches of 8 rows ({', '.join(f'{c} x {n}' for n, c in zip(lens, counts))} "
          f"tokens), {epochs} epoch(s) measured after one warm-up, each step of the three copies interleaved, "
          f"one thread")
    print(f"{'copy':<11}{'cpu ms/epoch':>14}{'recompute cpu ms':>18}{'wall ms/epoch':>15}{'recompute wall ms':>19}"
          f"{'recomputed fwds':>17}")
    base_cpu = sum(t for _, t in cpu["unplanned"]) / epochs
    base_wall = sum(t for _, t in wall["unplanned"]) / epochs
    for name in models:
        c, w = sum(t for _, t in cpu[name]) / epochs, sum(t for _, t in wall[name]) / epochs
        print(f"{name:<11}{c:>14.0f}{c - base_cpu:>+18.0f}{w:>15.0f}{w - base_wall:>+19.0f}"
              f"{recomputed[name] // (epochs + 1):>17}")
    print("\nper length, median CPU ms per step: " + "; ".join(
        f"{n}: " + ", ".join(f"{name} {statistics.median(t for m, t in cpu[name] if m == n):.0f}" for name in models)
        for n in lens))


if __name__ == "__main__":
    main()
