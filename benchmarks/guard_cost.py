"""Cost of apply_plan's runtime shape guard (NOTE [ Runtime shape guard ]), on 1 CPU thread.

    python benchmarks/guard_cost.py

Two measurements, the variants interleaved so that load on the machine hits both alike:
1. the guard's pre-hook alone, called on examples/gpt2.py's batch (input_ids and labels):
   microseconds per call, best of 5 rounds of 2000 calls;
2. a training step (forward, loss, backward) of examples/gpt2.py on 2 x 64 tokens with the
   same plan (every block checkpointed) under guard="warn" and guard="off": CPU time and wall
   time per step, median of 15 steps each, alternating.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.applier import ShapeGuard, apply_plan  # noqa: E402
from planner.model.fingerprint import fingerprint  # noqa: E402
from planner.profiling.model_file import call_model, default_loss, load_model_file  # noqa: E402
from planner.model.schema import Plan, Predicted, SolverInfo  # noqa: E402

STEPS = 15
CALLS = 2000


def small_batch(mf):
    return {k: v[:2, :64].contiguous() for k, v in mf.example_inputs().items()}


def every_block_plan(model: torch.nn.Module, inputs) -> Plan:
    fp = fingerprint(model, inputs)
    predicted = Predicted(peak_bytes=0, params_bytes=0, grads_bytes=0, optimizer_bytes=0, activations_bytes=0,
                          recompute_ms=0.0, step_ms=0.0)
    return Plan(fingerprint=fp, fingerprint_digest=fp.digest(), budget_bytes=0,
                checkpoints=[f"transformer.h.{i}" for i in range(4)],
                solver=SolverInfo(name="manual", status="feasible"), predicted=predicted)


def hook_us(plan: Plan, batch) -> float:
    guard = ShapeGuard(plan.fingerprint.inputs, "warn", 0)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            guard(None, (), batch)
        best = min(best, (time.perf_counter() - t0) / CALLS * 1e6)
    return best


def step_times(models: dict[str, torch.nn.Module], batch) -> dict[str, tuple[list[float], list[float]]]:
    times = {name: ([], []) for name in models}
    for _ in range(STEPS):
        for name, model in models.items():
            c0, w0 = time.process_time(), time.perf_counter()
            default_loss(call_model(model, batch)).backward()
            times[name][0].append((time.process_time() - c0) * 1e3)
            times[name][1].append((time.perf_counter() - w0) * 1e3)
    return times


def main() -> None:
    torch.set_num_threads(1)
    mf = load_model_file(ROOT / "examples" / "gpt2.py")
    batch = small_batch(mf)
    models = {}
    for guard in ("warn", "off"):
        model = mf.build_model()
        apply_plan(model, every_block_plan(model, batch), guard=guard)
        models[guard] = model
    print(f"guard pre-hook alone: {hook_us(every_block_plan(models['off'], batch), batch):.1f} us per forward "
          f"(best of 5 x {CALLS} calls)")
    step_times(models, batch)  # warm-up
    times = step_times(models, batch)
    print(f"{'guard':<6}{'cpu ms/step':>13}{'wall ms/step':>14}   (median of {STEPS}, 1 thread, interleaved)")
    for name, (cpu, wall) in times.items():
        print(f"{name:<6}{statistics.median(cpu):>13.2f}{statistics.median(wall):>14.2f}")


if __name__ == "__main__":
    main()
