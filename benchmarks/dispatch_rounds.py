"""How steady are selective checkpointing's dispatch figures, r and k, from one measurement to the next?

    python benchmarks/dispatch_rounds.py                            # examples/gpt2.py, 4 measurements of 9 and 27 rounds
    python benchmarks/dispatch_rounds.py --model examples/llama.py --rounds 9,27 --repeats 4

Profiles the model once (one step), then repeats NOTE [ Selective dispatch cost ]'s region rounds
(``planner.profiling.sac_cost``) ``--repeats`` times per round count, the counts interleaved, at one
thread on the thread's CPU time. Per measurement it prints r and k two ways: the median of each
round's paired difference (what the profiler takes, with the interquartile range of the rounds:
the profile's spread) and the difference of least times (what it took before), each per op call
in microseconds, and the load average. The spread between the
measurements of one count is what a profile's r and k move by from one run to the next.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

from planner.profiling import profile, sac_cost  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.profiling.step_changes import profiled_with_step_changes  # noqa: E402
from planner.profiling.timing import ThreadCpuClock, num_threads, spread_ms  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/gpt2.py")
    ap.add_argument("--rounds", default="9,27", help="round counts to compare, interleaved")
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    mf = load_model_file(ROOT / args.model)
    model, inputs = mf.build_model(), mf.example_inputs()
    prof = profile(model, inputs, loss_fn=mf.loss_fn, device="cpu", steps=1)
    seen: list[tuple[dict, int]] = []
    figures = sac_cost._figures

    def keep(ms: dict, n_ops: int) -> sac_cost.SacCost:
        seen.append((ms, n_ops))
        return figures(ms, n_ops)

    sac_cost._figures = keep
    counts = [int(c) for c in args.rounds.split(",")]
    rows: dict[int, list[tuple[float, float, float, float]]] = {c: [] for c in counts}
    try:
        with profiled_with_step_changes(model):  # the step as profiled (a Hugging Face model: use_cache=False)
            _measure(args, model, inputs, prof, mf.loss_fn, seen, counts, rows)
    finally:
        sac_cost._figures = figures
    for count, got in rows.items():
        span = [f"{min(c) * 1e3:.0f} to {max(c) * 1e3:.0f}" for c in zip(*got)]
        print(f"rounds {count}: median r {span[0]} us, k {span[1]} us; least times r {span[2]} us, k {span[3]} us")
    return 0


def _measure(args: argparse.Namespace, model: torch.nn.Module, inputs: object, prof: object, loss_fn: object,
             seen: list, counts: list[int], rows: dict) -> None:
    """``--repeats`` measurements of each round count, the counts interleaved; one row each."""
    for rep in range(args.repeats):
        for count in counts:
            # Rule 4's CPU-seconds cap would stop a large count early: every count runs in full here
            cap, sac_cost.SAC_CPU_SECONDS = sac_cost.SAC_CPU_SECONDS, float("inf")
            try:
                with num_threads(1):
                    sac_cost.measure_sac_cost(model, inputs, prof, loss_fn=loss_fn, amp=None, dev=torch.device("cpu"),
                                              clock=ThreadCpuClock(), rounds=count)
            finally:
                sac_cost.SAC_CPU_SECONDS = cap
            ms, n = seen[-1]
            run = {p: [sum(r) for r in runs] for p, runs in ms.items()}
            t, full = run[None], run["full"]
            rec, kept = run[CheckpointPolicy.PREFER_RECOMPUTE], run[CheckpointPolicy.MUST_SAVE]
            med_r = statistics.median(a - b for a, b in zip(rec, full)) / n
            med_k = statistics.median(a - b for a, b in zip(kept, t)) / n
            least_r, least_k = (min(rec) - min(full)) / n, (min(kept) - min(t)) / n
            iqr_r = spread_ms([(a - b) / n for a, b in zip(rec, full)])
            iqr_k = spread_ms([(a - b) / n for a, b in zip(kept, t)])
            rows[count].append((med_r, med_k, least_r, least_k))
            print(f"{args.model} rounds {count:2d} measurement {rep + 1}: median r {med_r * 1e3:4.0f} us, "
                  f"k {med_k * 1e3:4.0f} us (spread over the rounds {iqr_r * 1e3:.0f}, {iqr_k * 1e3:.0f} us) | least times r {least_r * 1e3:4.0f} us, k {least_k * 1e3:4.0f} us "
                  f"| {n} op calls, load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
