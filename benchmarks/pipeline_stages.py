"""Pipeline stages and tensor-parallel ranks verified on local ranks (issue #25): every rank's predicted
vs measured peak.

    python benchmarks/pipeline_stages.py       # pp 2 (1f1b, gpipe; 4 micro-batches), tp 2 with and without sp, tp 2 x pp 2
    python benchmarks/pipeline_stages.py --cases 1f1b:2:4,gpipe:2:2,tp2,tp2-sp,1f1b:2:4:tp2
    python benchmarks/pipeline_stages.py --cases 1f1b:2:4:dp2-fsdp,gpipe:2:4:dp2-fsdp,1f1b:2:4:dp2-ddp
    python benchmarks/pipeline_stages.py --cases interleaved-1f1b:2:4:v2     # 2 ranks of 2 stages each
    python benchmarks/pipeline_stages.py --cases 1f1b:2:4:tp2:sp             # tp 2 + sequence parallel x pp 2

A case is ``schedule:stages:micro-batches`` (pipeline stages), with ``:vN`` for N stages per rank
(interleaved-1f1b), ``:tpN`` (and ``:sp`` for sequence parallelism) for N tensor-parallel ranks
per stage and ``:dpN-fsdp`` or ``:dpN-ddp`` for N data-parallel ranks per stage, or ``tpN`` (tensor parallelism alone), ``tpN-sp`` with sequence parallelism. For each: profile
examples/llama_pp.py (a tiny LlamaForCausalLM from ``LlamaConfig``, library defaults but the sizes) on
the CPU (each stage on one micro-batch; under tp the rank-local model), plan at the budget halfway
between the layout's lowest feasible and no-checkpoint peaks (each the highest over its stages), then
``verify_ranks``: one gloo process per rank trains with the plan and measures its own peak (NOTE [ CPU
peaks across threads ]); the gradients are compared with one process training the whole model on the
whole batch. Prints one markdown row per rank (NOTE [ Pipeline stages ] in solvers/pipeline.py, NOTE
[ Tensor-parallel ranks ] and NOTE [ Sequence-parallel ranks ] in planner/act/tensor_parallel.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.pipeline import pipeline_layout, plan_stages, profile_stages  # noqa: E402
from planner.act.tensor_parallel import plan_tensor_parallel  # noqa: E402
from planner.act.verify_ranks import verify_ranks  # noqa: E402
from planner.errors import BudgetInfeasible  # noqa: E402
from planner.model.fingerprint import fingerprint  # noqa: E402
from planner.profiling.meta import build_on_meta  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.spec import SolveSpec, StepSpec  # noqa: E402

MODEL = ROOT / "examples" / "llama_pp.py"
CASES = ("1f1b:2:4", "gpipe:2:4", "tp2", "tp2-sp", "1f1b:2:4:tp2", "interleaved-1f1b:2:4:v2", "1f1b:2:4:tp2:sp")
STEP = StepSpec(device="cpu", threads=1)


def _halfway(plans: list) -> int:
    lowest = max(p.predicted.min_feasible_bytes for p in plans)
    return (lowest + max(p.predicted.no_checkpoint_peak_bytes for p in plans)) // 2


def plan_case(case: str) -> tuple:
    """(plan, budget, label) of one case, at the halfway budget."""
    mf = load_model_file(MODEL)
    parts = case.split(":")
    if len(parts) == 1:  # tpN or tpN-sp
        tp, sp = int(case[2:].split("-")[0]), case.endswith("-sp")
        roomy = plan_tensor_parallel(mf, "1TB", tp, step=STEP, sequence_parallel=sp)
        try:  # the lowest feasible budget: what an infeasible one names
            plan_tensor_parallel(mf, 1 << 20, tp, step=STEP, sequence_parallel=sp)
        except BudgetInfeasible as e:
            roomy.predicted.min_feasible_bytes = e.min_feasible_bytes
        budget = _halfway([roomy])
        label = f"tp {tp}" + (" + sp" if sp else "")
        return plan_tensor_parallel(mf, budget, tp, step=STEP, sequence_parallel=sp), budget, label
    schedule, stages, micro = parts[0], int(parts[1]), int(parts[2])
    tp = next((int(p[2:]) for p in parts[3:] if p.startswith("tp")), 1)
    per_rank = next((int(p[1:]) for p in parts[3:] if p.startswith("v")), 1)
    sp = "sp" in parts[3:]
    dp, sharding = next(((int(p[2:].split("-")[0]), p.split("-")[1]) for p in parts[3:] if p.startswith("dp")),
                        (1, "none"))
    profiled = profile_stages(mf, pipeline_layout(stages, schedule, micro, per_rank), step=STEP, tp=tp,
                              sequence_parallel=sp)
    fp = fingerprint(build_on_meta(mf.build_model), mf.example_inputs())
    solve = SolveSpec(world_size=stages * tp * dp, sharding=sharding)
    budget = _halfway(plan_stages(profiled, "1TB", fingerprint=fp, solve=solve).stages)
    label = f"pp {stages} {schedule} x{micro}" + (f", V {per_rank}" if per_rank > 1 else "") + \
        (f", tp {tp}" if tp > 1 else "") + (" + sp" if sp else "") + \
        (f", dp {dp} {sharding}" if dp > 1 else "")
    return plan_stages(profiled, budget, fingerprint=fp, solve=solve), budget, label


def run(case: str, out_dir: Path) -> list[str]:
    plan, budget, label = plan_case(case)
    path = out_dir / f"plan-{case.replace(':', '-')}.json"
    plan.save(path)
    report = verify_ranks(MODEL, path)
    rows = []
    for row in report.rows:
        st = plan.stages[row.stage] if row.stage is not None else None
        mine = [x for x in plan.stages if row.stage is not None and x.stage % plan.pipeline.stages == row.stage]
        ckpt = f"{sum(len(x.checkpoints) for x in mine)}/{sum(len(x.modules) for x in mine)}" if st else \
            str(len(plan.checkpoints))
        where = "-" if row.stage is None else ", ".join(str(x.stage) for x in mine)  # interleaved: the rank's stages
        flight = "-" if st is None else ", ".join(str(x.in_flight) for x in mine)
        rows.append(f"| {label} | {row.rank} | {where} | {'-' if row.tp_rank is None else row.tp_rank} | "
                    f"{flight} | {budget:,} | {ckpt} | {row.predicted_peak_bytes:,} | "
                    f"{row.measured_peak_bytes:,} | {row.error:+.2%} | {row.no_plan_error:+.2%} | "
                    f"{report.max_grad_diff:.1e} | {'pass' if report.ok else 'FAIL'} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="schedule:stages:micro-batches[:vN][:tpN][:sp][:dpN-fsdp|ddp], tpN or tpN-sp, "
                                                            "comma-separated")
    ap.add_argument("--out", type=Path, default=Path("/tmp"), help="where the plan files go")
    args = ap.parse_args()
    print("| layout | rank | stage | tp rank | in flight | budget | ckpt | predicted | measured | error | "
          "no plan: error | grads vs 1 process | result |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for case in args.cases.split(","):
        t0 = time.perf_counter()
        for line in run(case, args.out):
            print(line, flush=True)
        print(f"<!-- {case}: {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
