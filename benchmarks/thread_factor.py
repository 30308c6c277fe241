"""How steady is a cost group's thread factor, over every round and over the clean rounds only?

    python benchmarks/thread_factor.py                                   # examples/llama.py, model.layers.0, 25 trials
    python benchmarks/thread_factor.py --model examples/gpt2.py --module transformer.h.0 --trials 15
    python benchmarks/thread_factor.py --burner                          # beside a process busy at random

One module's forward runs alone on the inputs it got in a plain step (as NOTE [ Thread factor per
cost group ] times it), ``--trials`` times, two ways interleaved in one process:
  - every round (the profiler before NOTE [ Clean rounds ]): one unrecorded round, then
    ``GROUP_ROUNDS`` rounds of the forward at one thread (the thread's CPU time) and at
    ``--threads`` (wall time); the least wall time over the least CPU time;
  - clean rounds (``planner.profiling.timing.thread_rounds``): the same, counting only the rounds
    where the process had its cores, up to three times as many rounds.
Prints each trial's factor both ways, their least, median and largest, and the clean rounds of
each trial. ``--burner`` starts a process busy for 0.05 to 0.4 s and idle as long, at random, for
the run's length (a seeded stand-in for another job on the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.profiling.group_scale import GROUP_ROUNDS, _forward_ms  # noqa: E402
from planner.profiling.measure import make_step  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.profiling.sac_cost import _recorded_inputs  # noqa: E402
from planner.profiling.step_changes import profiled_with_step_changes  # noqa: E402
from planner.profiling.timing import (ThreadCpuClock, WallClock, num_threads, thread_factor,  # noqa: E402
                                      thread_rounds)

BURNER = ("import random, time\nrandom.seed(1)\nwhile True:\n    t = time.time(); d = random.uniform(0.05, 0.4)\n"
          "    while time.time() - t < d: pass\n    time.sleep(random.uniform(0.05, 0.4))\n")


def every_round(run, threads: int) -> float:
    one, many = [], []
    for i in range(GROUP_ROUNDS + 1):
        with num_threads(1):
            a = run(ThreadCpuClock())
        with num_threads(threads):
            b = run(WallClock())
        if i:
            one.append(a)
            many.append(b)
    return thread_factor(min(many), min(one), threads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/llama.py")
    ap.add_argument("--module", default="model.layers.0")
    ap.add_argument("--trials", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--burner", action="store_true", help="beside a process busy at random")
    args = ap.parse_args()
    mf = load_model_file(Path(args.model))
    model = mf.build_model().train()
    module = dict(model.named_modules())[args.module]
    burner = subprocess.Popen([sys.executable, "-c", BURNER]) if args.burner else None
    try:
        with profiled_with_step_changes(model):  # the step as profiled (use_cache=False, ...)
            step = make_step(model, mf.example_inputs(), loss_fn=mf.loss_fn, optimizer=None, amp=None)
            with num_threads(1):
                call, = _recorded_inputs(step, [module])

            def run(clock):
                return _forward_ms(module, call, clock, contextlib.nullcontext)

            every, clean, counts = [], [], []
            for _ in range(args.trials):
                every.append(every_round(run, args.threads))
                r = thread_rounds(run, args.threads, GROUP_ROUNDS)
                clean.append(thread_factor(min(b for b, _ in r.clean), min(r.one), args.threads)
                             if r.enough_clean(GROUP_ROUNDS) else None)
                counts.append(f"{len(r.clean)}/{len(r.every)}")
    finally:
        if burner is not None:
            burner.kill()
    print(f"{args.model} {args.module}: {args.trials} trials, {args.threads} threads, burner {args.burner}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("every round: ", " ".join(f"{x:.2f}" for x in every))
    print("clean rounds:", " ".join(f"{x:.2f}" if x is not None else "-" for x in clean))
    print("clean/rounds:", " ".join(counts))
    for name, xs in (("every round", every), ("clean rounds", [x for x in clean if x is not None])):
        if xs:
            print(f"{name:12}: least {min(xs):.3f}, median {statistics.median(xs):.3f}, largest {max(xs):.3f} "
                  f"({len(xs)} trials)")


if __name__ == "__main__":
    main()
