"""Predicted vs measured peak memory and recompute, for every bundled example, on this machine.

    python benchmarks/predict_vs_measure.py [--models gpt2,llama] [--device cpu] [--steps 3]

For each example model: profile once, then for the plans "none" (no checkpointing), "all"
(every top-level unit checkpointed) and the optimal plan at three budgets (1/4, 1/2 and 3/4 of
the way from the minimum feasible peak to the no-checkpoint peak), apply the plan to a fresh
copy of the model and measure a training step with ``planner.act.verify`` (CPU: the allocator's
own events from torch.profiler; CUDA: the caching allocator's peak). Prints, per row, the
predicted and measured peak, their relative error, whether the measured peak is within the
budget, and predicted vs measured recompute overhead (planned minus unplanned step time;
noisy on a shared CPU). Each budget includes the planner's default headroom
(``planner.act.api.DEFAULT_HEADROOM``): "none" and "all" get the budget whose usable part is
their predicted peak.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.api import budget_with_headroom, graph_for, min_feasible_bytes, plan_from_profile  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.profiling import profile  # noqa: E402
from planner.sizes import format_bytes  # noqa: E402
from planner.act.verify import verify  # noqa: E402
from solvers.base import top_level  # noqa: E402

MODELS = ("transformer", "gpt2", "llama", "t5", "resnet", "unet")


def rows_for(name: str, device: str, steps: int) -> list[dict]:
    mf = load_model_file(ROOT / "examples" / f"{name}.py")
    t0 = time.perf_counter()
    prof = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=device, steps=steps)
    profile_s = time.perf_counter() - t0
    g = graph_for(prof, solver="auto")
    lo, hi = min_feasible_bytes(g), simulate(g, []).peak_bytes
    every = simulate(g, top_level(g)).peak_bytes
    plans = [("none", "none", budget_with_headroom(hi)), ("all", "all", budget_with_headroom(every))]
    plans += [(f"auto@{q}/4", "auto", budget_with_headroom(lo + (hi - lo) * q // 4)) for q in (1, 2, 3)]
    out = []
    for label, solver, budget in plans:
        plan = plan_from_profile(prof, budget, solver=solver, graph=g)
        rep = verify(mf.build_model(), plan, inputs=mf.example_inputs(), loss_fn=mf.loss_fn,
                     device=device, steps=steps)
        err = (rep.predicted_peak_bytes - rep.measured_peak_bytes) / rep.measured_peak_bytes
        out.append(dict(model=name, plan=label, budget=budget, predicted=rep.predicted_peak_bytes,
                        measured=rep.measured_peak_bytes, err=err, fits=rep.measured_peak_bytes <= budget,
                        rec_pred=rep.predicted_recompute_ms, rec_meas=rep.measured_recompute_ms,
                        step_ms=rep.measured_no_plan_step_ms, grad=rep.max_grad_diff, n=len(plan.checkpoints),
                        profile_s=profile_s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(f"{'model':<12}{'plan':<11}{'#ckpt':>6}{'budget':>12}{'predicted':>12}{'measured':>12}{'error':>8}"
          f"{'fits':>6}{'recompute pred':>16}{'meas':>9}{'grad diff':>11}")
    errors = []
    for name in args.models.split(","):
        for r in rows_for(name, args.device, args.steps):
            errors.append(abs(r["err"]))
            print(f"{r['model']:<12}{r['plan']:<11}{r['n']:>6}{format_bytes(r['budget']):>12}"
                  f"{format_bytes(r['predicted']):>12}{format_bytes(r['measured']):>12}{r['err']:>+8.2%}"
                  f"{'yes' if r['fits'] else 'NO':>6}{r['rec_pred']:>13.1f} ms{r['rec_meas']:>+9.1f}"
                  f"{r['grad']:>11.2g}", flush=True)
    print(f"\n|predicted - measured| / measured: median {statistics.median(errors):.2%}, "
          f"worst {max(errors):.2%} over {len(errors)} plans")


if __name__ == "__main__":
    main()
