"""Checkpointed blocks under torch.compile, with dynamo's checkpoint side-effect setting off and on (issue #24).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/checkpoint_side_effects.py examples/llama.py --rounds 2

A Hugging Face layer writes transformers' output-capturing context variable inside its forward, so
under ``torch.utils.checkpoint`` dynamo cannot trace the checkpoint as one region ("HOP: Unsafe side
effect") and breaks the graph: the checkpoint runs eagerly between compiled frames and its replay
is not fused into the compiled backward. ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``
lets dynamo trace it (the forward's side effects are then not replayed in the backward); remat's
checkpointed compiles turn it on since round 23, so the "off" arm runs them as if they did not. In one
process, one thread: the eager profile, the plain compiled step (``measure_compiled``, timed), then
the step with the repeated blocks checkpointed (as the compiled profile's second compile does) with
the setting off and on, alternated ``--rounds`` times, each compiled afresh with its kernels built
and timed (median of ``--steps`` steps, the profile's clock). Prints each variant's graph breaks, its
compile and first step, its peak and its phase times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="examples/llama.py")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()

    from torch._dynamo.utils import counters

    import planner
    from planner.profiling.compiled import default_candidates, measure_compiled
    from planner.profiling.model_file import load_model_file
    from planner.spec import StepSpec

    torch.set_num_threads(1)
    mf = load_model_file(args.model)
    model, inputs = mf.build_model(), mf.example_inputs()
    eager = planner.profile(model, inputs, device="cpu", threads=1, steps=args.steps, loss_fn=mf.loss_fn)
    step = StepSpec(device="cpu", compile="inductor", threads=1, steps=args.steps, loss_fn=mf.loss_fn)
    blocks = default_candidates(eager)

    def run(label: str, checkpointed: list[str]) -> None:
        breaks = sum(counters["graph_break"].values())
        start = time.perf_counter()
        m, _ = measure_compiled(model, inputs, eager, step=step, progress=lambda _m: None, checkpointed=checkpointed)
        print(f"{label:<26} {time.perf_counter() - start:6.1f} s (compile and first step {m.first_compile_s:5.1f} s)  "
              f"breaks {sum(counters['graph_break'].values()) - breaks}  peak {m.peak_bytes:,} B  forward "
              f"{m.forward_ms:.1f}  backward {m.backward_ms:.1f}  optimizer {m.optimizer_ms:.1f} ms")

    print(f"{args.model}: checkpointed {', '.join(blocks)}")
    run("plain", [])
    for _ in range(args.rounds):
        for skip in (False, True):
            # remat's checkpointed compiles turn the setting on where this torch has it (NOTE [ Side effects in a
            # checkpointed region ]); the "off" arm is remat as if it had not
            with mock.patch("planner.profiling.aot_cse.side_effects_once_available", lambda skip=skip: skip):
                run(f"checkpointed, setting {'on' if skip else 'off'}", blocks)


if __name__ == "__main__":
    main()
