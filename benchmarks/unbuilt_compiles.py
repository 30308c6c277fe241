"""A memory-only compile against a built one: same peaks, and the seconds saved (issue #24, row 4).

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/unbuilt_compiles.py examples/llama.py --rounds 2

In one process, one thread: the model's eager profile, then the compiled profile's plain compile
(kernels built, as ``remat plan --compile`` runs it first), then the profile's second compile (the
repeated blocks checkpointed, ``measure_compiled(..., timed=False)``) alternately with its CPU kernels
unbuilt (NOTE [ Memory-only compiles ]) and built, ``--rounds`` times each. Prints each compile's
wall seconds (the compile and its measured steps) and its phase peaks, and whether the peaks agree to
the byte. A built round after the first reuses the kernels inductor built before (its cache is by
kernel source), so the first built round is the one ``remat plan --compile`` paid.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

PEAKS = ("forward_peak_bytes", "backward_peak_bytes", "optimizer_peak_bytes", "peak_bytes")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="examples/llama.py")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()

    import planner
    from planner.profiling.compiled import default_candidates, measure_compiled
    from planner.profiling.model_file import load_model_file
    from planner.profiling.unbuilt import unbuilt_kernels
    from planner.spec import StepSpec

    torch.set_num_threads(1)
    mf = load_model_file(args.model)
    model, inputs = mf.build_model(), mf.example_inputs()
    eager = planner.profile(model, inputs, device="cpu", threads=1, loss_fn=mf.loss_fn)
    step = StepSpec(device="cpu", compile="inductor", threads=1, loss_fn=mf.loss_fn)
    candidates = default_candidates(eager)

    def second(unbuilt: bool):
        with unbuilt_kernels() if unbuilt else contextlib.nullcontext():
            return measure_compiled(model, inputs, eager, step=step, progress=lambda _m: None,
                                    checkpointed=candidates, timed=False)[0]

    start = time.perf_counter()
    measure_compiled(model, inputs, eager, step=step, progress=lambda _m: None)
    print(f"{args.model}: the plain compile (built, timed) {time.perf_counter() - start:.1f} s; "
          f"checkpointed: {', '.join(candidates)}")
    seen: dict[bool, set[tuple[int, ...]]] = {True: set(), False: set()}
    for r in range(args.rounds):
        for unbuilt in (True, False):
            start = time.perf_counter()
            run = second(unbuilt)
            peaks = tuple(getattr(run, f) for f in PEAKS)
            seen[unbuilt].add(peaks)
            print(f"round {r + 1} {'unbuilt' if unbuilt else 'built  '} {time.perf_counter() - start:6.1f} s  "
                  + "  ".join(f"{f.removesuffix('_bytes')} {v:,}" for f, v in zip(PEAKS, peaks)))
    print("peaks equal to the byte:", seen[True] == seen[False] and len(seen[True]) == 1)


if __name__ == "__main__":
    main()
