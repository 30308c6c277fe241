"""Every set of a model's repeated blocks compiled and measured, beside its compiled prediction (issue #24).

    python benchmarks/compiled_sets.py examples/gpt2.py
    python benchmarks/compiled_sets.py examples/gpt2.py --profile old.json --profile new.json

Profiles the model under ``torch.compile`` (``remat profile --compile``, one thread, one step) unless
``--profile`` gives saved compiled profiles, then for each non-empty set of the repeated blocks
compiles the step with that set checkpointed (as ``apply_plan`` does, the step changes installed)
and measures its peak as the profile measures its compiles (``phase_peaks``, NOTE [ Compiled
profile ], Rule 5). Prints one row per set: the measured peak, each profile's prediction and its
error, and where the last profile's peak lies.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--profile", action="append", default=[], help="a saved compiled profile (repeatable)")
    args = p.parse_args()
    from planner.model.graph import build_graph
    from planner.model.schema import Profile
    from planner.profiling import profile
    from planner.profiling.compiled import default_candidates, measure_compiled
    from planner.profiling.model_file import load_model_file
    from planner.profiling.step_changes import find_step_changes, install
    from planner.spec import StepSpec
    from solvers.cost_model import simulate

    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    mf = load_model_file(args.model)
    profiles = [Profile.load(f) for f in args.profile] or [
        profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=1, threads=1,
                compile="inductor")]
    graphs = [build_graph(x) for x in profiles]
    model = mf.build_model()
    install(model, find_step_changes(model), say=False)
    spec = StepSpec(device="cpu", threads=1, steps=1, compile="inductor", loss_fn=mf.loss_fn)
    blocks = default_candidates(profiles[-1])
    for k in range(1, len(blocks) + 1):
        for chosen in itertools.combinations(blocks, k):
            step, _graphs = measure_compiled(model, mf.example_inputs(), profiles[-1], step=spec,
                                             progress=lambda _m: None, checkpointed=list(chosen), timed=False)
            row = [f"{','.join(chosen):40}", f"measured {step.peak_bytes:>11}"]
            for g in graphs:
                est = simulate(g, [n for n in g.nodes if g.nodes[n]["fqn"] in chosen])
                error = (est.peak_bytes - step.peak_bytes) / step.peak_bytes
                row.append(f"predicted {est.peak_bytes:>11} {error:+.2%}")
            print("  ".join(row) + f"  at {est.peak_at}", flush=True)


if __name__ == "__main__":
    main()
