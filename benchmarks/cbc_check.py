"""CBC 2.10.3's answers on the ILP against brute force, per CBC configuration, and remat's verdict.

    python benchmarks/cbc_check.py                       # nested DAGs of seeds 0..1499, every configuration
    python benchmarks/cbc_check.py --seeds 220,670,1046  # given seeds

For each random nested DAG of at most 12 candidates (tests/test_ilp.py's ``nested_graph``) and each
budget of that test, every antichain is simulated (the brute-force optimum) and the program of
``solvers.ilp`` is solved by CBC with each configuration below, with remat's own options
(``run_cbc``: tolerances 1e-9, preprocessing off). A wrong answer is "optimal" above the optimum,
or "infeasible" where a plan fits. ``remat`` is ``ilp.solve(backend="cbc", use_relaxation=False)``:
wrong as above, or "feasible" (a right plan not proven) where the optimum exists.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pulp  # noqa: E402

from solvers import ilp  # noqa: E402
from solvers.ilp.backends import run_cbc  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402
from tests.solver_checks import best_recompute, brute_force  # noqa: E402
from tests.test_ilp import MAX_CANDIDATES, budgets, nested_graph  # noqa: E402

CONFIGS = {"default": [], "re-solve (CBC_PROOF_OPTIONS)": ilp.CBC_PROOF_OPTIONS,
           "re-solve, strong branching off too": [*ilp.CBC_PROOF_OPTIONS, "strong 0"]}




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:1500", help="first:last (exclusive) or a comma-separated list")
    ap.add_argument("--term-bits", type=int, default=ilp.CBC_TERM_BITS,
                    help="the program's largest term below 2^N units (remat's CBC program: CBC_TERM_BITS)")
    args = ap.parse_args()
    first, sep, last = args.seeds.partition(":")
    seeds = range(int(first), int(last)) if sep else [int(s) for s in args.seeds.split(",")]
    bits = args.term_bits
    warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 on its bundled CBC
    solves, wrong = 0, {name: [] for name in [*CONFIGS, "remat"]}
    not_proven = []
    for seed in seeds:
        g = nested_graph(seed)
        if g.number_of_nodes() > MAX_CANDIDATES:
            continue
        points = brute_force(g)
        program = ilp.build_program(g, term_bits=bits)
        for budget in budgets(points):
            if simulate(g, []).peak_bytes <= budget:  # no program is solved
                continue
            best = best_recompute(points, budget)
            solves += 1
            for name, options in CONFIGS.items():
                state, objective, _, _ = run_cbc(ilp.build_model(g, budget, program).prob, None, 0.0, None,
                                                      list(options))
                if (best is None) != (state == "infeasible") or (state == "optimal" and objective > best + 1e-9):
                    wrong[name].append(f"{seed}@{budget}: {state} {objective} (optimum {best})")
            sol = ilp.solve(g, budget, backend="cbc", use_relaxation=False)
            if (best is None) != (sol.status == "infeasible") or (best is not None and sol.recompute_ms > best + 1e-9):
                wrong["remat"].append(f"{seed}@{budget}: {sol.status} {sol.recompute_ms} (optimum {best})")
            elif best is not None and sol.status != "optimal":
                not_proven.append(f"{seed}@{budget}")
    print(f"seeds {args.seeds}, terms below 2^{bits}: {solves} (graph, budget) programs (CBC bundled with PuLP {pulp.__version__})\n")
    print("| configuration | wrong answers | cases |")
    print("| --- | ---: | --- |")
    for name, cases in wrong.items():
        print(f"| {name} | {len(cases)} of {solves} | {'; '.join(cases)} |")
    print(f"\nremat: optimum found but not proven ('feasible') in {len(not_proven)}: {', '.join(not_proven)}")


if __name__ == "__main__":
    main()
