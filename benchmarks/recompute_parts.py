"""Where a checkpointed block's recompute goes: the profiler's figure against its parts, one CPU thread.

    python benchmarks/recompute_parts.py                                  # examples/gpt2.py, transformer.h.1
    python benchmarks/recompute_parts.py examples/llama.py model.layers.1 --rounds 15

For one block of a model file, interleaved rounds of training steps (no optimizer) at one torch
thread, on the thread's CPU time (NOTE [ Unit costs ], Rule 1), least over the rounds:
- the block's forward as the profiler's timing steps read it (``TimingRecorder``: hooks on every
  module), with the recorder's own hook time left out (NOTE [ Unit costs ], Rule 5) and with it in;
- the block's forward with one pair of hooks on the block alone (no profiler);
- the block's forward in the plain step, its first forward under checkpointing and its recompute
  in backward (timed inside ``torch.utils.checkpoint``'s call of it);
- the step's overhead of checkpointing the block: steps with it checkpointed less plain steps,
  with torch's early stop of the recompute (its default) and without.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.utils.checkpoint as tuc  # noqa: E402

from planner.profiling.measure import make_step  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.profiling.profiler import TimingRecorder  # noqa: E402
from planner.profiling.step_changes import profiled_with_step_changes  # noqa: E402
from planner.profiling.timing import ThreadCpuClock  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="examples/gpt2.py")
    ap.add_argument("block", nargs="?", default="transformer.h.1")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mf = load_model_file(ROOT / args.model)
    model = mf.build_model()
    with profiled_with_step_changes(model):
        out = measure(model, mf.example_inputs(), mf.loss_fn, args.block, args.rounds)
    print(f"`python benchmarks/recompute_parts.py {args.model} {args.block} --rounds {args.rounds}`: "
          f"least thread CPU ms over {args.rounds} interleaved rounds, 1 thread, torch {torch.__version__}\n")
    print("| figure | ms |\n| --- | ---: |")
    for name, runs in out.items():
        print(f"| {name} | {min(runs):.2f} |")
    plain = min(out["plain step"])
    for how in ("early stop", "no early stop"):
        print(f"| step overhead of checkpointing it ({how}): least step less least plain step | "
              f"{min(out[f'step, the block checkpointed ({how})']) - plain:.2f} |")
    return 0


def measure(model: torch.nn.Module, inputs, loss_fn, block: str, rounds: int) -> dict[str, list[float]]:
    step = make_step(model, inputs, loss_fn=loss_fn, optimizer=None, amp=None)
    b = dict(model.named_modules())[block]
    inner = type(b).forward.__get__(b, type(b))
    calls: list[float] = []

    def timed(*a, **k):
        t0 = time.thread_time()
        try:
            return inner(*a, **k)
        finally:  # the recompute's early stop ends it by an exception
            calls.append((time.thread_time() - t0) * 1e3)

    def checkpointed(early_stop: bool):
        def run(*a, **k):
            with tuc.set_checkpoint_early_stop(early_stop):
                return tuc.checkpoint(timed, *a, use_reentrant=False, **k)
        return run

    def step_ms(forward=None) -> float:
        calls.clear()
        if forward is not None:
            b.forward = forward
        marks: dict[str, float] = {}
        try:
            step(lambda name, _v=None: marks.__setitem__(name, time.thread_time()))
        finally:
            b.__dict__.pop("forward", None)
        return (marks["backward_end"] - marks["step_start"]) * 1e3

    out: dict[str, list[float]] = {k: [] for k in (
        "forward, profiler's recorder, its hooks left out (Rule 5)", "forward, profiler's recorder, its hooks in",
        "forward, one pair of hooks on the block", "forward in the plain step", "first forward under checkpointing",
        "recompute in backward", "plain step", "step, the block checkpointed (early stop)",
        "step, the block checkpointed (no early stop)")}
    keys = list(out)
    for i in range(rounds + 1):  # the first round warms up
        with TimingRecorder(model, ThreadCpuClock()) as rec:
            rec.reset()
            step(rec.mark)
            u = next(u for u in rec.units if u.fqn == block)
            fig = [rec.clock.ms(u.fwd_start, u.fwd_end), rec.clock.clock.ms(u.fwd_start[0], u.fwd_end[0])]
        marks: dict[str, float] = {}
        hooks = [b.register_forward_pre_hook(lambda *_: marks.__setitem__("s", time.thread_time())),
                 b.register_forward_hook(lambda *_: marks.__setitem__("e", time.thread_time()))]
        step()
        for h in hooks:
            h.remove()
        fig.append((marks["e"] - marks["s"]) * 1e3)
        plain = step_ms(timed)
        fig.append(calls[0])
        stop = step_ms(checkpointed(True))
        fig += [*calls[:2], plain, stop, step_ms(checkpointed(False))]
        if i:
            for k, v in zip(keys, fig):
                out[k].append(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
