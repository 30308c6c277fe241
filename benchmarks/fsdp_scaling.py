"""One rank's memory under FSDP2 as the world size grows, and the plan at a fixed per-rank budget.

    python benchmarks/fsdp_scaling.py                          # the Llama-2-7B reference profile (H100)
    python benchmarks/fsdp_scaling.py --profile profiles/models/gpt2-small-h100.json --budget 9GB
    python benchmarks/fsdp_scaling.py --synthetic               # a parameter-heavy synthetic chain (no torch run)
    python benchmarks/fsdp_scaling.py --sharding ddp --world-sizes 1,2,4,8

For each world size N: one rank's parameters, gradients and optimizer state as the cost model
counts them (``solvers.rank_memory.rank_memory``, NOTE [ Per-rank memory ]), the
predicted peak without checkpointing, and the plan ``remat plan --world-size N --sharding fsdp``
makes at one per-rank budget: how many units it checkpoints and the recompute it costs. The
profile is of one rank's batch, so activations are the same for every N; only the model state
is divided. Default budget: 95% of the peak without checkpointing at the largest N, so that
every N has to checkpoint something. Without ``--profile`` the Llama-2-7B reference profile
(profiles/models/llama2-7b-h100.json) is used, or, where it is missing, examples/gpt2.py is
profiled on the CPU (~20 s).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.act.api import graph_for, plan_from_profile
from solvers.cost_model import simulate
from solvers.rank_memory import rank_memory
from planner.errors import BudgetInfeasible
from planner.model.schema import Profile
from planner.sizes import format_bytes, parse_bytes

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "profiles" / "models" / "llama2-7b-h100.json"


@dataclass(frozen=True)
class Row:
    world_size: int
    params_bytes: int  # one rank's parameters and buffers outside forward/backward
    grads_bytes: int  # one rank's gradients at the optimizer step
    optimizer_bytes: int
    no_checkpoint_peak_bytes: int
    checkpointed: int | None  # units the plan checkpoints; None: nothing fits the budget
    recompute_ms: float | None
    peak_bytes: int | None  # the plan's predicted peak


def scaling_rows(profile: Profile, budget_bytes: int, world_sizes: list[int], *, sharding: str = "fsdp",
                 solver: str = "dp") -> list[Row]:
    """One row per world size: per-rank static memory, peak without checkpointing, the plan at the budget."""
    rows = []
    for n in world_sizes:
        g = graph_for(profile, solver=solver, world_size=n, sharding=sharding)
        rk = rank_memory(g)
        try:
            plan = plan_from_profile(profile, budget_bytes, solver=solver, graph=g)
            ckpt, rec, peak = len(plan.checkpoint_units), plan.predicted.recompute_ms, plan.predicted.peak_bytes
        except BudgetInfeasible:
            ckpt = rec = peak = None
        rows.append(Row(n, rk.params_bytes, -(-g.graph["grads_bytes"] // rk.grad_divisor), rk.optimizer_bytes,
                        simulate(g, []).peak_bytes, ckpt, rec, peak))
    return rows


def default_budget(profile: Profile, world_sizes: list[int], sharding: str) -> int:
    g = graph_for(profile, solver="dp", world_size=max(world_sizes), sharding=sharding)
    return int(0.95 * simulate(g, []).peak_bytes)


def synthetic_chain(blocks: int = 8) -> Profile:
    """Parameters outweigh activations (a wide model, a small per-rank batch): sharding them matters."""
    from planner.model.synthetic import SynUnit, synthetic_profile

    mib = 2**20
    units = [SynUnit(name="emb", module_type="Embedding", param_bytes=32 * mib, output_bytes=4 * mib)]
    units += [SynUnit(name=f"h.{i}", param_bytes=16 * mib, saves=[48 * mib, 48 * mib], saves_inputs=True,
                      output_bytes=4 * mib, forward_ms=2.0, backward_ms=4.0) for i in range(blocks)]
    units += [SynUnit(name="head", module_type="Linear", param_bytes=32 * mib, saves=[16 * mib],
                      saves_inputs=True, output_bytes=16 * mib, forward_ms=1.0, backward_ms=2.0)]
    return synthetic_profile(units, batch_bytes=mib)


def gpt2_profile() -> Profile:
    from planner.profiling.model_file import load_model_file
    from planner.profiling import profile

    mf = load_model_file(ROOT / "examples" / "gpt2.py")
    return profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=1)


def table(rows: list[Row], units: int) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.2f}"
    lines = [(f"{'N':>3} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} {'no-ckpt peak MiB':>17} "
              f"{'checkpointed':>13} {'recompute ms':>13} {'plan peak MiB':>14}")]
    for r in rows:
        ckpt = "infeasible" if r.checkpointed is None else f"{r.checkpointed}/{units}"
        rec = "-" if r.recompute_ms is None else f"{r.recompute_ms:.2f}"
        lines.append(f"{r.world_size:>3} {mib(r.params_bytes):>11} {mib(r.grads_bytes):>10} "
                     f"{mib(r.optimizer_bytes):>10} {mib(r.no_checkpoint_peak_bytes):>17} {ckpt:>13} "
                     f"{rec:>13} {mib(r.peak_bytes):>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", help="a saved profile (default: see above)")
    p.add_argument("--synthetic", action="store_true", help="plan on synthetic_chain() instead")
    p.add_argument("--budget", help="per-rank budget, e.g. 180MB (default: see above)")
    p.add_argument("--sharding", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--world-sizes", default="1,2,4,8")
    p.add_argument("--solver", default="dp")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.world_sizes.split(",")]
    if args.synthetic:
        prof, source = synthetic_chain(), "synthetic_chain()"
    elif args.profile:
        prof, source = Profile.load(args.profile), args.profile
    elif REFERENCE.exists():
        prof, source = Profile.load(REFERENCE), str(REFERENCE.relative_to(ROOT))
    else:
        prof, source = gpt2_profile(), "examples/gpt2.py on the CPU"
    budget = parse_bytes(args.budget) if args.budget else default_budget(prof, sizes, args.sharding)
    rows = scaling_rows(prof, budget, sizes, sharding=args.sharding, solver=args.solver)
    units = graph_for(prof, solver=args.solver).number_of_nodes()
    print(f"{prof.fingerprint.model_class} ({source}), "
          f"{args.sharding}, per-rank budget {budget} bytes ({format_bytes(budget)}), solver {args.solver}")
    print(table(rows, units))


if __name__ == "__main__":
    main()
