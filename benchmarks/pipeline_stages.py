"""Pipeline stages verified on local ranks (issue #25): every stage's predicted vs measured peak.

    python benchmarks/pipeline_stages.py                              # pp 2: 1f1b and gpipe, 4 micro-batches
    python benchmarks/pipeline_stages.py --cases 1f1b:2:4,gpipe:2:2   # schedule:stages:micro-batches

For each case: profile each stage of examples/llama_pp.py (a tiny LlamaForCausalLM, library
defaults) on one micro-batch on the CPU, plan at the budget halfway between the layout's lowest
feasible and no-checkpoint peaks (each the highest over its stages), then ``verify_ranks``: one
gloo process per stage runs ``torch.distributed.pipelining``'s schedule with its stage's plan and
measures its own peak (NOTE [ CPU peaks across threads ]); the gradients of every stage are
compared with one process training the whole model on the whole batch. Prints one markdown row
per stage (NOTE [ Pipeline stages ] in solvers/pipeline.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.pipeline import pipeline_layout, plan_stages, profile_stages  # noqa: E402
from planner.act.verify_ranks import verify_ranks  # noqa: E402
from planner.model.fingerprint import fingerprint  # noqa: E402
from planner.profiling.meta import build_on_meta  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.spec import StepSpec  # noqa: E402

MODEL = ROOT / "examples" / "llama_pp.py"
CASES = ("1f1b:2:4", "gpipe:2:4")


def run(schedule: str, stages: int, micro_batches: int, out_dir: Path) -> list[str]:
    mf = load_model_file(MODEL)
    layout = pipeline_layout(stages, schedule, micro_batches)
    profiled = profile_stages(mf, layout, step=StepSpec(device="cpu", threads=1))
    fp = fingerprint(build_on_meta(mf.build_model), mf.example_inputs())
    roomy = plan_stages(profiled, "1TB", fingerprint=fp)
    lowest = max(st.predicted.min_feasible_bytes for st in roomy.stages)
    top = max(st.predicted.no_checkpoint_peak_bytes for st in roomy.stages)
    budget = (lowest + top) // 2
    plan = plan_stages(profiled, budget, fingerprint=fp)
    path = out_dir / f"plan-{schedule}-{stages}-{micro_batches}.json"
    plan.save(path)
    report = verify_ranks(MODEL, path)
    rows = []
    for row, st in zip(report.rows, plan.stages):
        rows.append(f"| {schedule} | {stages} | {micro_batches} | {row.rank} | {st.in_flight} | {budget:,} | "
                    f"{len(st.checkpoints)}/{len(st.modules)} | {row.predicted_peak_bytes:,} | "
                    f"{row.measured_peak_bytes:,} | {row.error:+.2%} | {row.no_plan_error:+.2%} | "
                    f"{report.max_grad_diff:.1e} | {'pass' if report.ok else 'FAIL'} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="schedule:stages:micro-batches, comma-separated")
    ap.add_argument("--out", type=Path, default=Path("/tmp"), help="where the plan files go")
    args = ap.parse_args()
    print("| schedule | pp | micro-batches | stage | in flight | budget | ckpt | predicted | measured | error | "
          "no plan: error | grads vs 1 process | result |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for case in args.cases.split(","):
        schedule, stages, micro = case.split(":")
        t0 = time.perf_counter()
        for line in run(schedule, int(stages), int(micro), args.out):
            print(line, flush=True)
        print(f"<!-- {case}: {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
