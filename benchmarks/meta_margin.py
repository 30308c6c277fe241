"""How far a plan made on fake tensors (``--device meta``) is from the real step: the margin meta plans need.

    python benchmarks/meta_margin.py [--models gpt2,llama,t5,unet]

For each example: profile on the meta device with the CPU's rules (``device_type="cpu"``, as
tests/test_meta.py does), plan at a budget halfway between the lowest feasible peak and the
peak without checkpointing (no headroom), apply the plan to a real copy and measure a CPU step
with ``planner.act.verify``. Prints predicted (from fake tensors) and measured peaks and the
error, (measured - predicted) / predicted: what a meta plan's headroom must cover
(``planner.act.api.META_HEADROOM``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.api import graph_for, min_feasible_bytes, plan_from_profile  # noqa: E402
from planner.act.verify import verify  # noqa: E402
from planner.profiling.meta import build_on_meta, profile_meta  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402

MODELS = ("gpt2", "llama", "t5", "unet")


def row(name: str) -> dict:
    path = ROOT / "examples" / f"{name}.py"
    mf = load_model_file(path)
    prof = profile_meta(build_on_meta(mf.build_model), mf.example_inputs(), loss_fn=mf.loss_fn, target="h100",
                        device_type="cpu")
    g = graph_for(prof)
    budget = (min_feasible_bytes(g) + simulate(g, []).peak_bytes) // 2
    plan = plan_from_profile(prof, budget, headroom=0.0)
    report = verify(path, plan, steps=1, device="cpu", prediction_tolerance=0.99)
    p, m = report.predicted_peak_bytes, report.measured_peak_bytes
    return {"model": name, "checkpoints": len(plan.checkpoints), "predicted": p, "measured": m,
            "error": (m - p) / p, "no_plan_predicted": report.predicted_no_plan_peak_bytes,
            "no_plan_measured": report.measured_no_plan_peak_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    print("| model | checkpoints | meta predicted | CPU measured | error | no plan: predicted | measured |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        r = row(name)
        print(f"| {r['model']} | {r['checkpoints']} | {r['predicted']:,} | {r['measured']:,} | {r['error']:+.2%} "
              f"| {r['no_plan_predicted']:,} | {r['no_plan_measured']:,} |", flush=True)


if __name__ == "__main__":
    main()
