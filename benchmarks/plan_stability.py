"""Does `remat plan` give the same checkpoint set every time, with another CPU-heavy process running?

    python benchmarks/plan_stability.py                       # gpt2, llama, qwen2: 5 runs each, mid budget
    python benchmarks/plan_stability.py --runs 5 --threads 1 --no-burner
    python benchmarks/plan_stability.py --models gpt2 --profiles runs/       # keep each run's profile
    python benchmarks/plan_stability.py --models gpt2 --replan runs/         # plan the kept ones again

Per model: the budget halfway between the lowest feasible peak and the peak without checkpointing
(from one profile made first), then ``--runs`` fresh ``python cli.py plan`` processes at that budget,
while a CPU burner (``python -c 'while True: pass'``, started here and ended by its pid) runs
unless ``--no-burner``. Prints each run's plan (whole modules, and op-level regions with their
policies) and predicted recompute; exit 1 when a model's runs disagree. Models: an example's name
(examples/<name>.py) or a model file's path. ``--profiles DIR``: each run profiles into
DIR/<model>.<run>.json (``remat profile -o``) and plans on it (``remat plan --profile``), the same
measurement in two processes; ``--replan DIR`` plans those profiles again, nothing measured, so a
change to the planning side is compared on the same figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.api import graph_for, min_feasible_bytes  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.profiling import profile  # noqa: E402
from planner.model.schema import Profile  # noqa: E402

MODELS = ("gpt2", "llama", "benchmarks/models/qwen2.py")


def model_path(name: str) -> Path:
    return ROOT / name if name.endswith(".py") else ROOT / "examples" / f"{name}.py"


def mid_budget(name: str, threads: int | None, kept: Path | None = None) -> int:
    """Halfway between the lowest feasible peak and the peak without checkpointing (bytes: any profile
    gives them, so a kept one when replanning)."""
    if kept is not None:
        g = graph_for(Profile.load(kept))
    else:
        mf = load_model_file(model_path(name))
        g = graph_for(profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=1,
                              threads=threads))
    return (min_feasible_bytes(g) + simulate(g, []).peak_bytes) // 2


def plan_once(name: str, budget: int, threads: int | None, steps: int, profile_path: Path | None = None,
              measure: bool = True) -> dict:
    cli = [sys.executable, str(ROOT / "cli.py")]
    measured = ["--device", "cpu", "--steps", str(steps), *(["--threads", str(threads)] if threads else [])]
    if profile_path is None:
        cmd = [*cli, "plan", "--budget", str(budget), str(model_path(name)), *measured, "--json", "-q"]
    else:
        if measure:
            subprocess.run([*cli, "profile", str(model_path(name)), *measured, "-o", str(profile_path), "-q"],
                           capture_output=True, text=True, check=True)
        cmd = [*cli, "plan", "--budget", str(budget), "--profile", str(profile_path), "--json", "-q"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="profiler timing steps (the CLI's default)")
    ap.add_argument("--threads", type=int, default=None, help="--threads for remat plan (default: torch's)")
    ap.add_argument("--no-burner", action="store_true")
    ap.add_argument("--profiles", type=Path, default=None, help="keep each run's profile in this folder")
    ap.add_argument("--replan", type=Path, default=None, help="plan the profiles kept in this folder again")
    args = ap.parse_args()
    folder = args.replan or args.profiles
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    burner = None if args.no_burner or args.replan else subprocess.Popen([sys.executable, "-c", "while True: pass"])
    stable = True
    try:
        for name in args.models.split(","):
            budget = mid_budget(name, args.threads, args.replan / f"{Path(name).stem}.1.json" if args.replan else None)
            sets = []
            for i in range(args.runs):
                kept = folder / f"{Path(name).stem}.{i + 1}.json" if folder is not None else None
                plan = plan_once(name, budget, args.threads, args.steps, kept, measure=args.replan is None)
                regions = tuple(f"{r['fqn']} op-level ({r['summary']})" for r in plan.get("selective", []))
                sets.append((*plan["checkpoints"], *regions))
                print(f"{name} run {i + 1}: budget {budget}, recompute {plan['predicted']['recompute_ms']:.1f} ms "
                      f"({plan['time_source']}, {plan['threads']} thread(s), load {os.getloadavg()[0]:.1f}): "
                      f"{', '.join(sets[-1]) or '-'}", flush=True)
            same = len(set(sets)) == 1
            stable &= same
            print(f"{name}: {sum(s == sets[0] for s in sets)} of {len(sets)} runs give the first run's set"
                  f"{'' if same else ' (DIFFER)'}", flush=True)
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    return 0 if stable else 1


if __name__ == "__main__":
    sys.exit(main())
