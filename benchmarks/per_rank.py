"""Per-rank plans verified on local ranks (issue #15): predicted vs measured peak on every rank.

    python benchmarks/per_rank.py                                  # the default cases below
    python benchmarks/per_rank.py --cases t5:fsdp:2,resnet:ddp:4   # model:sharding:ranks

For each case: profile the example's ``example_inputs()`` as one rank's batch on the CPU, plan
per rank (``--world-size N --sharding S``) at the budget halfway between every candidate
checkpointed and none (so the solver must choose), then ``verify_ranks``: N gloo processes
each wrap the model (``shard_for_plan``), apply the plan, train and measure their own peak
(NOTE [ CPU peaks across threads ]); rank 0's gradients are compared with one process. Prints
one markdown row per case, with the worst rank's error (predicted - measured) / measured.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import planner  # noqa: E402
from planner.act.api import plan_from_profile  # noqa: E402
from planner.act.verify_ranks import verify_ranks  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402

CASES = ("t5:fsdp:2", "t5:fsdp:4", "t5:ddp:2", "t5:ddp:4", "resnet:ddp:2", "resnet:ddp:4", "transformer:ddp:4",
         "llama:fsdp:2")
"""The combinations docs/distributed.md lacked: the encoder-decoder, DDP at N = 4 and on the CNN, and a
Hugging Face Llama under FSDP2 (issue #29: one block over-predicted before NOTE [ Per-rank memory ]'s tail)."""


def run(name: str, sharding: str, world_size: int, profiles: dict) -> str:
    path = ROOT / "examples" / f"{name}.py"
    if name not in profiles:
        mf = load_model_file(path)
        profiles[name] = planner.profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu",
                                         steps=1)
    prof = profiles[name]
    ends = [plan_from_profile(prof, "1TB", solver=s, world_size=world_size, sharding=sharding).predicted.peak_bytes
            for s in ("all", "none")]
    plan = plan_from_profile(prof, (ends[0] + ends[1]) // 2, world_size=world_size, sharding=sharding)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rep = verify_ranks(path, plan.save(Path(tmp) / "plan.json"), device="cpu")
    worst = max(rep.rows, key=lambda r: abs(r.error))
    no_plan = max((r for r in rep.rows if r.no_plan_error is not None), key=lambda r: abs(r.no_plan_error),
                  default=None)
    return (f"| examples/{name}.py | {world_size} | {sharding} | {plan.budget_bytes:,} | {len(plan.checkpoints)} "
            f"| {worst.predicted_peak_bytes:,} | {worst.measured_peak_bytes:,} | {worst.error:+.2%} "
            f"| {f'{no_plan.no_plan_error:+.2%}' if no_plan else '-'} | {rep.max_grad_diff:.1e} "
            f"| {'pass' if rep.ok else 'FAIL: ' + '; '.join(rep.problems)} | {time.perf_counter() - t0:.0f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated model:sharding:ranks")
    args = ap.parse_args()
    print("| model | N | sharding | budget | ckpt | predicted (worst rank) | measured | error | no plan: error "
          "| grads vs 1 process | result | wall |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    profiles: dict = {}
    for case in args.cases.split(","):
        name, sharding, n = case.split(":")
        try:
            print(run(name, sharding, int(n), profiles), flush=True)
        except Exception as e:  # a crash is a row that fails, with its reason
            print(f"| examples/{name}.py | {n} | {sharding} | - | - | - | - | - | - | - | FAIL: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200]} | - |", flush=True)


if __name__ == "__main__":
    main()
