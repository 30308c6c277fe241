"""The memory-safe profile against the full one, on every bundled example that fits this machine.

    python benchmarks/memory_safe.py [--models gpt2,llama] [--steps 1]
    python benchmarks/memory_safe.py --cap-check          # how many tensor bytes fit a CPU cap

For each example: a full profile, and a memory-safe profile (``planner.profiling.memsafe``: the step
measured with every default candidate checkpointed, the unplanned step reconstructed from it).
Prints how many units' saved bytes differ (should be 0), the largest difference of the
calibrated per-window temporaries, the unplanned peak of each (predicted by the cost model on
each profile, and measured by the device on the full run), and, at three budgets (1/4, 1/2 and
3/4 of the way from every-unit-checkpointed to none), whether the two profiles give the same
plan and how the memory-safe plan's predicted peak compares with its measured peak. Times
differ between any two profiles (noise), so for the plan comparison the memory-safe profile gets
the full profile's unit times: the comparison is of the memory side.

``--cap-check`` runs a child process under the CPU cap of ``planner.profiling.capped`` for a few caps
and allocates 1 MiB tensors until the CPU allocator refuses: the bytes reached vs the cap.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.act.api import budget_with_headroom, graph_for, plan_from_profile  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402
from planner.profiling.memsafe import candidate_modules, profile_checkpointed  # noqa: E402
from planner.profiling.model_file import load_model_file  # noqa: E402
from planner.profiling import profile  # noqa: E402
from planner.act.verify import verify  # noqa: E402

MODELS = ("transformer", "gpt2", "llama", "t5", "resnet", "unet")


def compare(name: str, steps: int) -> list[dict]:
    mf = load_model_file(ROOT / "examples" / f"{name}.py")
    t0 = time.perf_counter()
    full = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=steps)
    t1 = time.perf_counter()
    fqns = candidate_modules(full)
    safe = profile_checkpointed(mf.build_model(), mf.example_inputs(), checkpointed=fqns, loss_fn=mf.loss_fn,
                                device="cpu", steps=steps)
    t2 = time.perf_counter()
    times = {u.id: (u.forward_ms, u.backward_ms) for u in full.units}
    same_times = safe.model_copy(update={"units": [
        u.model_copy(update={"forward_ms": times[u.id][0], "backward_ms": times[u.id][1]}) for u in safe.units]})
    gf, gs = graph_for(full), graph_for(same_times)
    saved_diff = sum(gf.nodes[n]["saved_bytes"] != gs.nodes[n]["saved_bytes"] for n in gf.nodes)
    dt = max(abs(gf.nodes[n][k] - gs.nodes[n][k]) for n in gf.graph["leaves"]
             for k in ("fwd_transient_bytes", "bwd_transient_bytes"))
    none_f, none_s = simulate(gf, []).peak_bytes, simulate(gs, []).peak_bytes
    events = lambda p: [(e.kind, e.unit) for e in p.timeline]  # noqa: E731
    if events(full) == events(safe):
        pairs = list(zip(full.timeline, safe.timeline))
        timeline = (f"timeline: {len(pairs)} events, live bytes within "
                    f"{max(abs(a.live_bytes - b.live_bytes) for a, b in pairs)}, peaks within "
                    f"{max(abs(a.peak_bytes - b.peak_bytes) for a, b in pairs)} bytes")
    else:
        timeline = "timeline: the events differ"
    every = simulate(gf, gf.graph["leaves"]).peak_bytes
    print(f"{name}: {len(gf)} units, {len(fqns)} modules checkpointed; profiles {t1 - t0:.0f} s / {t2 - t1:.0f} s; "
          f"units with other saved bytes: {saved_diff}; largest temporaries difference {dt} bytes; "
          f"unplanned peak: measured {full.step.measured_peak_bytes}, predicted full {none_f}, "
          f"memory-safe {none_s} ({(none_s - none_f) / none_f:+.3%}); "
          f"the checkpointed run peaked at {_checkpointed_peak(safe)}; {timeline}", flush=True)
    rows = []
    for q in (1, 2, 3):
        budget = budget_with_headroom(every + (none_f - every) * q // 4)
        pf, ps = plan_from_profile(full, budget, graph=gf), plan_from_profile(same_times, budget, graph=gs)
        rep = verify(mf.build_model(), ps, inputs=mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu",
                     steps=steps)
        err = (ps.predicted.peak_bytes - rep.measured_peak_bytes) / rep.measured_peak_bytes
        rows.append(dict(model=name, q=q, budget=budget, same=pf.checkpoint_units == ps.checkpoint_units,
                         pred_full=pf.predicted.peak_bytes, pred_safe=ps.predicted.peak_bytes,
                         measured=rep.measured_peak_bytes, err=err, fits=rep.measured_peak_bytes <= budget))
        r = rows[-1]
        print(f"  budget {q}/4 {budget}: same plan {r['same']}; predicted full {r['pred_full']}, memory-safe "
              f"{r['pred_safe']}, measured {r['measured']} ({err:+.2%}), fits {r['fits']}", flush=True)
    return rows


def _checkpointed_peak(prof) -> str:
    note = next((n for n in prof.notes if "that step peaked at" in n), "")
    return note.split("that step peaked at ")[-1].split(";")[0] if note else "?"


CAP_CHECK = """
import sys, torch
from planner.profiling.capped import cap_address_space, prepare
prepare()
cap_address_space(int(sys.argv[1]), 0)
held = []
try:
    while True:
        held.append(torch.ones(1 << 18))
except RuntimeError as e:
    assert "can't allocate memory" in str(e), e
print(len(held) << 20)
"""


def cap_check() -> None:
    from planner.profiling.capped import MALLOC_ENV, OVERHEAD_ALLOWANCE_BYTES

    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(ROOT)}
    print(f"allowance for what is not tensors: {OVERHEAD_ALLOWANCE_BYTES >> 20} MiB")
    for cap_mib in (64, 150, 512):
        out = subprocess.run([sys.executable, "-c", CAP_CHECK, str(cap_mib << 20)], env=env, capture_output=True,
                             text=True, check=True)
        reached = int(out.stdout.split()[-1])
        print(f"cap {cap_mib} MiB: 1 MiB tensors allocated until refused: {reached >> 20} MiB "
              f"(cap + {(reached >> 20) - cap_mib} MiB)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--cap-check", action="store_true")
    args = ap.parse_args()
    if args.cap_check:
        cap_check()
        return
    rows = [r for name in args.models.split(",") for r in compare(name.strip(), args.steps)]
    same = sum(r["same"] for r in rows)
    worst = max(abs(r["err"]) for r in rows)
    print(f"\n{same}/{len(rows)} plans equal; memory-safe predictions vs measured peaks: worst {worst:.2%}; "
          f"all fit: {all(r['fits'] for r in rows)}")


if __name__ == "__main__":
    main()
