"""What does remat's applier cost per step beside Hugging Face's own checkpointing of the same layers?

    python benchmarks/wrapper_cost.py                       # examples/llama.py, 10 profiled steps each, one thread
    python benchmarks/wrapper_cost.py --steps 20 --threads 2

Builds the model twice from its file: one copy with ``gradient_checkpointing_enable()`` (non-reentrant,
as transformers passes it), one with ``apply_plan`` of a plan checkpointing the same decoder layers.
Each step runs ``--steps`` times under ``cProfile`` (after two unprofiled steps) and prints, per
step: the whole step, the Python calls, and the cumulative time of every function of remat's own
(``planner/``) that the step runs, beside torch's checkpoint machinery's. cProfile adds its own cost
to every Python call alike, so compare the two rows, not the step times with an unprofiled run's.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from planner.act.api import graph_for, plan_of  # noqa: E402
from planner.act.applier import apply_plan  # noqa: E402
from planner.model.schema import SolverInfo  # noqa: E402
from planner.profiling import profile  # noqa: E402
from planner.profiling.measure import make_optimizer, make_step  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402


def profiled(step, steps: int) -> pstats.Stats:
    step()
    step()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    return pstats.Stats(pr)


def report(name: str, st: pstats.Stats, steps: int) -> None:
    print(f"{name}: step {st.total_tt / steps * 1e3:.1f} ms under cProfile, {st.total_calls / steps:.0f} Python calls")
    rows = [(tt, nc, f"{Path(file).name}:{line}({fn})") for (file, line, fn), (_, nc, tt, _, _) in st.stats.items()
            if f"{ROOT}/planner/" in file and "profiling/measure.py" not in file and "model_file.py" not in file]
    print(f"    remat's own Python (planner/, the calls' own time): {sum(r[0] for r in rows) / steps * 1e3:.3f} ms/step")
    for tt, nc, where in sorted(rows, reverse=True)[:8]:
        print(f"    {tt / steps * 1e3:7.3f} ms/step  {nc / steps:5.1f} calls/step  {where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/llama.py")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mf = load_model_file(Path(args.model))
    master = mf.build_model()
    prof = profile(copy.deepcopy(master), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=1,
                   threads=args.threads)
    g = graph_for(prof, selective=False)
    layers = [n for n in g.nodes if ".layers." in n and g.nodes[n]["parent"] is None]
    est = simulate(g, layers)
    plan = plan_of(prof, g, est, est.peak_bytes, solver=SolverInfo(name="by hand", status="optimal"))
    hf = copy.deepcopy(master).train()
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.config.use_cache = False
    mine = copy.deepcopy(master).train()
    apply_plan(mine, plan)
    print(f"{args.model}: {len(plan.checkpoints)} layers checkpointed both ways, {args.threads} thread(s), "
          f"{args.steps} profiled steps each")
    for name, model in (("Hugging Face every layer", hf), ("apply_plan, the same layers", mine)):
        step = make_step(model, mf.example_inputs(), loss_fn=mf.loss_fn, optimizer=make_optimizer("adamw", model))
        report(name, profiled(step, args.steps), args.steps)


if __name__ == "__main__":
    main()
