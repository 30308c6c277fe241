"""Cost of apply_plan's runtime shape guard (NOTE [ Runtime shape guard ]), on 1 CPU thread.

    python benchmarks/guard_cost.py

Two measurements, the variants interleaved so that load on the machine hits both alike:
1. the guard's pre-hook alone, called on examples/gpt2.py's batch (input_ids and labels):
   microseconds per call, best of 5 rounds of 2000 calls;
2. a training step (forward, loss, backward) of examples/gpt2.py on 2 x 64 tokens with the
   same plan (every block checkpointed) under guard="warn" and guard="off": CPU time and wall
   time per step, median of 15 steps each, alternating;
3. the bucket switch of a bucketed plan (NOTE [ Bucketed plans ]) with three buckets of 32, 64 and
   128 tokens over the same model: microseconds per forward when the batch stays in its bucket and
   when every batch changes bucket (the modes of the 4 wrapped blocks set), keyword and positional
   calls, best of 5 rounds of 2000 calls, on the thread's CPU time (load on the machine does not
   add to it) and on the wall clock. The target is under 20 us a forward.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.applier import ShapeGuard, apply_plan  # noqa: E402
from planner.act.buckets import combine  # noqa: E402
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
    return best_us(lambda: guard(None, (), batch))


def best_us(call, calls: int = CALLS, clock=time.perf_counter) -> float:
    """Microseconds per ``call()`` on ``clock``, best of 5 rounds of ``calls``."""
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(calls):
            call()
        best = min(best, (clock() - t0) / calls * 1e6)
    return best


def bucketed_plan(model: torch.nn.Module, batches: list) -> Plan:
    """Three buckets over one model: 2, 3 and 4 blocks checkpointed (the plans are made up: the switch's
    cost does not depend on what a bucket predicts)."""
    plans = []
    for k, b in enumerate(batches, start=2):
        p = every_block_plan(model, b)
        plans.append(p.model_copy(update={"checkpoints": p.checkpoints[:k]}))
    return combine(plans)


def switch_us(mf) -> dict[str, tuple[float, float]]:
    """The bucket switch's pre-hook per forward, (thread CPU time, wall time): staying in one bucket, and
    changing bucket on every call."""
    full = mf.example_inputs()
    batches = [{k: v[:2, :n].contiguous() for k, v in full.items()} for n in (32, 64, 128)]
    model = mf.build_model()
    handle = apply_plan(model, bucketed_plan(model, batches))
    switch = handle._switch
    short, long = batches[0], batches[2]
    positional = (short["input_ids"],)
    alternate = itertools.cycle([short, long])
    calls = {
        "same bucket, keyword call": lambda: switch(model, (), short),
        "same bucket, positional call": lambda: switch(model, positional, {}),
        "another bucket every call": lambda: switch(model, (), next(alternate)),
    }
    out = {what: (best_us(call, clock=time.thread_time), best_us(call)) for what, call in calls.items()}
    assert switch.switches > 0 and handle.bucket in (0, 2)
    return out


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
    for what, (cpu_us, wall_us) in switch_us(mf).items():
        print(f"bucket switch (3 buckets, 4 wrapped blocks), {what}: {cpu_us:.1f} us CPU, {wall_us:.1f} us wall "
              f"per forward (best of 5 x {CALLS} calls)")
    step_times(models, batch)  # warm-up
    times = step_times(models, batch)
    print(f"{'guard':<6}{'cpu ms/step':>13}{'wall ms/step':>14}   (median of {STEPS}, 1 thread, interleaved)")
    for name, (cpu, wall) in times.items():
        print(f"{name:<6}{statistics.median(cpu):>13.2f}{statistics.median(wall):>14.2f}")


if __name__ == "__main__":
    main()
