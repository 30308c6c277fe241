"""ILP solve time against candidate count, CBC and HiGHS side by side.

    python benchmarks/ilp_scaling.py                                  # both families, 50..500 candidates
    python benchmarks/ilp_scaling.py --family transformer --no-relaxation --time-limit 30
    python benchmarks/ilp_scaling.py --sizes 200 --fractions 0.5

Two graph families, both built with ``nested=True``:

- ``transformer``: GPT-like stacks. Every block ``h.i`` has four sub-modules (ln_1, attn, ln_2,
  mlp), so a candidate is a block or any set of its parts; ln_2 also takes the block input
  (the residual) and every fourth block also reads the output of the block four back (a DAG
  skip connection). Saved sizes are identical across blocks and forward times jittered by
  +-3 %, as in measured profiles. Candidates = 5 x blocks.
- ``random``: ``planner.model.synthetic.random_dag`` with half the blocks split into 2-3 parts and
  sparse skip connections (p_skip=0.05): heterogeneous sizes and tensors held by several
  units, so the program has OR variables and the sequential relaxation is often not exact.

Budgets sit at a fraction between "checkpoint every top-level candidate" (0) and "checkpoint
nothing" (1). Targets: 200 candidates proven optimal in < 5 s, 500 in < 30 s. Prints, per size
and budget, the model size and, per backend, the wall-clock seconds of ``solvers.ilp.solve``
(model build, relaxation and the peak tie-break included), the status, and the route that
proved it: ``relax`` (NOTE [ Sequential relaxation ]) or ``ilp`` (branch-and-bound).
``--no-relaxation`` measures branch-and-bound alone.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from solvers.cost_model import simulate
from planner.model.graph import build_graph
from planner.model.synthetic import SynUnit, random_dag, synthetic_profile
from solvers.base import top_level
from solvers.ilp import build_model, solve

MIB = 2**20


def transformer_dag(rng: random.Random, n_blocks: int, *, skip_every: int = 4) -> list[SynUnit]:
    """``n_blocks`` GPT-like blocks with four sub-modules each, plus skip connections."""
    j = lambda x: round(x * rng.uniform(0.97, 1.03), 3)
    blocks = []
    for i in range(n_blocks):
        prev = f"h.{i - 1}" if i else None
        parts = [
            SynUnit(name=f"h.{i}.ln_1", module_type="LayerNorm", forward_ms=j(0.05), saves_inputs=True,
                    saves=[64 * 1024], output_bytes=8 * MIB, param_bytes=8192),
            SynUnit(name=f"h.{i}.attn", module_type="Attention", forward_ms=j(0.9), saves_inputs=True,
                    saves=[24 * MIB, 32 * MIB, 8 * MIB], output_bytes=8 * MIB, param_bytes=4 * MIB),
            SynUnit(name=f"h.{i}.ln_2", module_type="LayerNorm", forward_ms=j(0.05), saves_inputs=True,
                    saves=[64 * 1024], output_bytes=8 * MIB, param_bytes=8192,
                    inputs=[f"h.{i}.attn"] + ([prev] if prev else [])),
            SynUnit(name=f"h.{i}.mlp", module_type="MLP", forward_ms=j(1.2), saves_inputs=True,
                    saves=[32 * MIB, 32 * MIB], output_bytes=8 * MIB, param_bytes=8 * MIB),
        ]
        inputs = None
        if i >= skip_every and i % skip_every == 0:
            inputs = [prev, f"h.{i - skip_every}"]
        elif i == 0:
            inputs = []
        blocks.append(SynUnit(name=f"h.{i}", module_type="Block", forward_ms=sum(p.forward_ms for p in parts)
                              + j(0.1), children=parts, output_bytes=8 * MIB, inputs=inputs))
    return blocks


def family_graph(family: str, candidates: int, seed: int = 0):
    """A graph of about ``candidates`` candidates of the given family."""
    rng = random.Random(seed)
    if family == "transformer":
        units = transformer_dag(rng, max(1, candidates // 5))
    else:  # ~2.25 candidates per block at p_nested=0.5
        units = random_dag(rng, max(2, round(candidates / 2.25)), p_skip=0.05, p_nested=0.5)
    return build_graph(synthetic_profile(units), granularity=1, nested=True)


def _route(detail: str) -> str:
    if "checkpointing nothing fits" in detail:
        return "trivial"
    return "relax" if "proven by the sequential relaxation" in detail or "admits no plan" in detail else "ilp"


def run(family: str, sizes: list[int], fractions: list[float], time_limit_s: float, backends: list[str],
        use_relaxation: bool = True) -> None:
    head = f"{family:<11} {'cands':>5} {'frac':>5} {'bin':>5} {'cont':>5} {'rows':>6}"
    for b in backends:
        head += f" | {b + ' s':>8} {'status':<22} {'route':<6}"
    print(head + " | recompute ms (per backend)", flush=True)
    for n in sizes:
        g = family_graph(family, n)
        lo = simulate(g, top_level(g)).peak_bytes
        hi = simulate(g, []).peak_bytes
        stats = build_model(g, hi).stats
        for f in fractions:
            budget = lo + int(f * (hi - lo))
            line = (f"{'':<11} {g.number_of_nodes():>5} {f:>5.2f} {stats['binaries']:>5} "
                    f"{stats['variables'] - stats['binaries']:>5} {stats['constraints']:>6}")
            recs = []
            for b in backends:
                t0 = time.perf_counter()
                sol = solve(g, budget, backend=b, time_limit_s=time_limit_s, use_relaxation=use_relaxation)
                dt = time.perf_counter() - t0
                status = sol.status if sol.gap is None else f"{sol.status} gap={sol.gap:.2%}"
                line += f" | {dt:>8.2f} {status:<22} {_route(sol.detail):<6}"
                recs.append(f"{sol.recompute_ms:.3f}")
            print(line + " | " + " / ".join(recs), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=["transformer", "random", "both"], default="both")
    ap.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 200, 500])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--backends", nargs="+", default=["cbc", "highs"])
    ap.add_argument("--no-relaxation", action="store_true",
                    help="branch-and-bound alone, without NOTE [ Sequential relaxation ] (solvers/ilp/bound.py)")
    a = ap.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)  # PuLP 3.3 announcing its 4.0 API
    for family in (["transformer", "random"] if a.family == "both" else [a.family]):
        run(family, a.sizes, a.fractions, a.time_limit, a.backends, use_relaxation=not a.no_relaxation)


if __name__ == "__main__":
    main()
