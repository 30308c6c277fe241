"""What does remat's applier cost per step beside Hugging Face's own checkpointing of the same layers?

    python benchmarks/wrapper_cost.py                       # examples/llama.py, 10 profiled steps each, one thread
    python benchmarks/wrapper_cost.py --steps 20 --threads 2
    python benchmarks/wrapper_cost.py --tiny --rounds 300   # per-step CPU time, no cProfile, paired rounds

Builds the model twice from its file: one copy with ``gradient_checkpointing_enable()`` (non-reentrant,
as transformers passes it), one with ``apply_plan`` of a plan checkpointing the same decoder layers.
Each step runs ``--steps`` times under ``cProfile`` (after two unprofiled steps) and prints, per
step: the whole step, the Python calls, and the cumulative time of every function of remat's own
(``planner/``) that the step runs, beside torch's checkpoint machinery's. cProfile adds its own cost
to every Python call alike, so compare the two rows, not the step times with an unprofiled run's.

``--rounds N`` times instead, without cProfile: N rounds of one step of each (the plain model, Hugging
Face's, remat's), each round in an order shuffled afresh (``shuffled_rounds`` of ``benchmarks/peers.py``),
process CPU time per step; it prints each one's median and the median over rounds of remat's step less
Hugging Face's. ``--tiny`` builds the model file's Llama at
hidden 16, 8 tokens of a 64-word vocabulary, so that the steps' arithmetic is small and what is left
is the checkpointing's Python.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.peers import shuffled_rounds  # noqa: E402
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
    ap.add_argument("--rounds", type=int, default=0, help="time N paired rounds without cProfile (0: cProfile)")
    ap.add_argument("--tiny", action="store_true", help="the Llama at hidden 16, 2 x 8 tokens")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mf = load_model_file(Path(args.model))
    build, inputs = (_tiny_llama, _tiny_batch) if args.tiny else (mf.build_model, mf.example_inputs)
    master = build()
    prof = profile(copy.deepcopy(master), inputs(), loss_fn=mf.loss_fn, device="cpu", steps=1,
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
    what = "tiny Llama" if args.tiny else args.model
    if args.rounds:
        plain = copy.deepcopy(master).train()
        plain.config.use_cache = False
        steps = {name: make_step(m, inputs(), loss_fn=mf.loss_fn, optimizer=make_optimizer("adamw", m))
                 for name, m in (("plain", plain), ("Hugging Face every layer", hf), ("apply_plan", mine))}
        timed(steps, args.rounds, f"{what}: {len(plan.checkpoints)} layers checkpointed both ways, "
                                  f"{args.threads} thread(s), {args.rounds} rounds")
        return
    print(f"{what}: {len(plan.checkpoints)} layers checkpointed both ways, {args.threads} thread(s), "
          f"{args.steps} profiled steps each")
    for name, model in (("Hugging Face every layer", hf), ("apply_plan, the same layers", mine)):
        step = make_step(model, inputs(), loss_fn=mf.loss_fn, optimizer=make_optimizer("adamw", model))
        report(name, profiled(step, args.steps), args.steps)


def timed(steps: dict, rounds: int, title: str) -> None:
    for step in steps.values():
        for _ in range(3):
            step()
    names, cpu_us = list(steps), {name: [] for name in steps}
    for _, name in shuffled_rounds(names, rounds, progress=False):  # peers.py's order: shuffled afresh each round
        c0 = time.process_time_ns()
        steps[name]()
        cpu_us[name].append((time.process_time_ns() - c0) / 1e3)
    print(title)
    for name in names:
        print(f"    {name}: median {statistics.median(cpu_us[name]):.0f} us CPU per step, least {min(cpu_us[name]):.0f}")
    diff = [a - b for a, b in zip(cpu_us["apply_plan"], cpu_us["Hugging Face every layer"])]
    print(f"    apply_plan less Hugging Face, per round: median {statistics.median(diff):.0f} us CPU per step")


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         attention_dropout=0.1, tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).train()


def _tiny_batch() -> dict:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


if __name__ == "__main__":
    main()
