"""Plan every reference profile (profiles/models/*.json) at three budgets with every solver, through the CLI.

    python benchmarks/reference_plans.py > before.json   # then, after a refactor:
    python benchmarks/reference_plans.py > after.json && diff before.json after.json

Each entry is the CLI's exit code and its ``--json`` plan with the run stamp (``created``) removed,
so two runs of the same code print the same bytes: a refactor that changes no behaviour changes nothing here.
Budgets are the lowest feasible peak plus 10%, 40% and 80% of the way to the peak without checkpointing,
and half the lowest feasible peak (the error path), with no headroom. The ILP gets 30 s per plan.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from typer.testing import CliRunner  # noqa: E402

from cli import app  # noqa: E402
from planner.act.api import graph_for, min_feasible_bytes  # noqa: E402
from planner.model.schema import Profile  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402

SOLVERS = ["auto", "dp", "ilp", "sqrt", "sqrt-greedy", "all", "every-2", "none"]
FRACTIONS = [0.1, 0.4, 0.8]


def main() -> None:
    runner = CliRunner()
    results = {}
    for path in sorted((ROOT / "profiles" / "models").glob("*.json")):
        g = graph_for(Profile.load(path))
        lowest, peak = min_feasible_bytes(g), simulate(g, []).peak_bytes
        budgets = {f"{f}": lowest + int(f * (peak - lowest)) for f in FRACTIONS} | {"half-lowest": lowest // 2}
        for fraction, budget in budgets.items():
            for solver in SOLVERS:
                args = ["plan", "--profile", str(path), "--budget", str(budget), "--solver", solver,
                        "--time-limit", "30", "--headroom", "0", "--json", "--quiet"]
                r = runner.invoke(app, args)
                try:
                    body = json.loads(r.stdout)
                    body.pop("created", None)
                except ValueError:
                    body = r.stdout
                results[f"{path.stem} {fraction} {solver}"] = {"exit": r.exit_code, "plan": body, "stderr": r.stderr}
                print(path.stem, fraction, solver, r.exit_code, file=sys.stderr)
    json.dump(results, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
