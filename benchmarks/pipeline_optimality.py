"""Is a pipeline stage's plan optimal under NOTE [ Pipeline stages ]? Rule 9's search against every set of
whole layers (#25: the stage search is not proven optimal).

    python benchmarks/pipeline_optimality.py                      # 8 layers, pp 2, 8 micro-batches: 3 cases
    python benchmarks/pipeline_optimality.py --cases gpipe:0,1f1b:0

examples/llama_pp.py's model with 8 layers (``LlamaConfig``, library defaults but the sizes), each stage
profiled on fake tensors (h100). For each case ``schedule:stage`` and 9 budgets evenly between the stage's
lowest feasible and no-checkpoint peaks: the recompute of ``solvers.pipeline.plan_stage``'s plan, and the
least recompute of any set of the stage's layers whose stage peak (Rule 8) fits, found by trying them all
(2^4 sets). The stage's candidates are its layers, its embeddings and the rotary embedding; the layers are
where the memory is. Prints one line per budget and exits 1 if the search ever costs more.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.api import graph_for  # noqa: E402
from planner.act.pipeline import _solver, pipeline_layout, profile_stages  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.spec import StepSpec  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402
from solvers.pipeline import plan_stage, stage_peak  # noqa: E402

CASES = ("gpipe:0", "1f1b:0", "gpipe:1")


def eight_layers():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=352,
                                        num_hidden_layers=8, num_attention_heads=4)).train()


def check(schedule: str, stage: int) -> bool:
    mf = dataclasses.replace(load_model_file(ROOT / "examples" / "llama_pp.py"), build_model=eight_layers)
    st = profile_stages(mf, pipeline_layout(2, schedule, 8), step=StepSpec(device="meta", target="h100"))[stage]
    g = graph_for(st.profile, solver="ilp", selective=False)
    g.graph.update(st.attrs)
    solve = _solver("ilp", None)
    lo, hi = plan_stage(g, 0, solve).lowest_peak_bytes, stage_peak(g, []).peak_bytes
    layers = [n for n in g.nodes if g.nodes[n]["fqn"] in st.modules]
    ok = True
    for budget in (lo + (hi - lo) * k // 10 for k in range(1, 10)):
        chosen = plan_stage(g, budget, solve).chosen
        got = simulate(g, *chosen).recompute_ms if chosen else None
        fits = [simulate(g, list(c)).recompute_ms for r in range(len(layers) + 1)
                for c in itertools.combinations(layers, r) if stage_peak(g, list(c)).peak_bytes <= budget]
        best = min(fits, default=None)
        same = got is not None and best is not None and got <= best + 1e-12
        ok &= same
        print(f"{schedule} stage {stage} budget {budget:,}: search {got:.6f} ms ({len(chosen[0])} checkpointed), "
              f"best of all layer sets {best:.6f} ms: {'same' if same else 'WORSE'}", flush=True)
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help="schedule:stage, comma-separated")
    args = ap.parse_args()
    results = [check(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
