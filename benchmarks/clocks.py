"""Which clock to time units with on a busy CPU: wall, thread CPU time, process CPU time.

    python benchmarks/clocks.py                     # examples/gpt2.py, 1 and 2 threads, 5 steps
    python benchmarks/clocks.py examples/llama.py --steps 7

Times every forward of the repeated blocks (``*.h.N`` / ``*.layers.N``) of the model over
``--steps`` training steps (after one warm-up step) with three clocks at once, at each thread
count, and prints per clock the median and the min-max range over all block forwards. The
blocks are identical, so every spread is noise. See NOTE [ Unit costs ] in planner/profiling/timing.py.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from planner.profiling.measure import make_optimizer, make_step  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "thread CPU": time.thread_time, "process CPU": time.process_time}
BLOCK = re.compile(r".*\.(h|layers|block|blocks)\.\d+$")


def block_times(path: Path, threads: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(threads)
    mf = load_model_file(path)
    model = mf.build_model()
    step = make_step(model, mf.example_inputs(), loss_fn=mf.loss_fn, optimizer=make_optimizer("adamw", model))
    out: dict[str, list[float]] = {name: [] for name in CLOCKS}
    started: dict[int, list[float]] = {}

    def pre(module, _args):
        started[id(module)] = [clock() for clock in CLOCKS.values()]

    def post(module, _args, _out):
        ends = [clock() for clock in CLOCKS.values()]
        for name, a, b in zip(CLOCKS, started.pop(id(module)), ends):
            out[name].append((b - a) * 1e3)

    blocks = [m for name, m in model.named_modules() if BLOCK.match(name)]
    handles = [h for b in blocks for h in (b.register_forward_pre_hook(pre), b.register_forward_hook(post))]
    step()
    for samples in out.values():
        samples.clear()
    for _ in range(steps):
        step()
    for h in handles:
        h.remove()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(Path(__file__).resolve().parents[1] / "examples" / "gpt2.py"))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print(f"`python benchmarks/clocks.py {' '.join(sys.argv[1:])}`: block forwards of {Path(args.model).name}, "
          f"{args.steps} steps, torch {torch.__version__}\n")
    print("| threads | clock | median ms | min ms | max ms | max / min |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for threads in (int(t) for t in args.threads.split(",")):
        for name, samples in block_times(Path(args.model), threads, args.steps).items():
            lo, hi = min(samples), max(samples)
            print(f"| {threads} | {name} | {statistics.median(samples):.1f} | {lo:.1f} | {hi:.1f} | {hi / lo:.2f} |")


if __name__ == "__main__":
    main()
