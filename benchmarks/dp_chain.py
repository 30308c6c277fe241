"""DP solve time on long chains (target: a 200-unit chain in under 1 s).

    python benchmarks/dp_chain.py

Chains are synthetic transformer-like stacks (heterogeneous saved bytes and forward times,
every block saving its input), solved at a budget halfway between "checkpoint everything" and
"checkpoint nothing". Prints n, seconds (best of 3), status and the chosen count.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solvers.cost_model import simulate  # noqa: E402
from planner.model.graph import build_graph  # noqa: E402
from planner.model.synthetic import SynUnit, random_chain, synthetic_profile  # noqa: E402
from solvers import SOLVERS  # noqa: E402


def transformer_chain(rng: random.Random, n: int) -> list[SynUnit]:
    return [SynUnit(name=f"h.{i}", forward_ms=round(rng.uniform(0.9, 1.1), 3), param_bytes=7_000_000,
                    saves=[rng.choice([24, 25, 26]) * 2**20, 8 * 2**20], saves_inputs=True,
                    output_bytes=6 * 2**20) for i in range(n)]


def main() -> None:
    rng = random.Random(0)
    print(f"{'chain':<22}{'n':>5}{'build s':>9}{'solve s':>9}  status    ckpt")
    for kind, make in (("transformer-like", transformer_chain), ("random heterogeneous", random_chain)):
        for n in (50, 100, 200, 400):
            t0 = time.perf_counter()
            g = build_graph(synthetic_profile(make(rng, n)))
            build_s = time.perf_counter() - t0
            lo = simulate(g, g.graph["leaves"]).peak_bytes
            hi = simulate(g, []).peak_bytes
            budget = (lo + hi) // 2
            best, sol = float("inf"), None
            for _ in range(3):
                t0 = time.perf_counter()
                sol = SOLVERS["dp"](g, budget)
                best = min(best, time.perf_counter() - t0)
            print(f"{kind:<22}{n:>5}{build_s:>9.3f}{best:>9.3f}  {sol.status:<9} {len(sol.checkpointed)}")


if __name__ == "__main__":
    main()
