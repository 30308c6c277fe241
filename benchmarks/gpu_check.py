"""The GPU check: plan, apply and verify two examples on CUDA, and calibrate --device meta against them.

    python benchmarks/gpu_check.py                    # on a CUDA machine: about a minute
    OUT=/tmp/out python benchmarks/gpu_check.py       # ... and every number in /tmp/out/gpu_check.json

For examples/gpt2.py and examples/llama.py, each in its own try/except (one failure still
reports the other):

1. profile on CUDA (a warm-up and 3 timing steps), plan at the budget halfway between the
   lowest feasible peak and the peak without checkpointing, then ``planner.act.verify.verify``:
   it applies the plan (``planner.act.applier.apply_plan``), trains with and without it and reads
   the CUDA caching allocator's peak (``torch.cuda.max_memory_allocated`` after
   ``reset_peak_memory_stats``). Printed: predicted vs measured peak, step and recompute time.
2. profile on fake tensors for this GPU's spec (``--device meta --target``, the spec matched
   from ``torch.cuda.get_device_name()``), twice: on fake CUDA tensors (what a CUDA machine
   gets) and on fake CPU tensors with CUDA's rules (what a CPU-only machine and the reference
   profiles get). Printed: modelled / measured time for the step and per candidate unit (the
   roofline's calibration), and the worst per-unit gap in saved bytes against the CUDA profile.
3. fit the roofline's efficiencies to the measured unit times (``planner.profiling.roofline.fit_calibration``,
   on the uncalibrated meta profiles of step 2 and of benchmarks/models/llama_calibration.py, profiled for
   this alone: only units modelled at ``FIT_MIN_UNIT_MS`` or more count, and the examples' are smaller on an
   H100 or H200) and write them to
   ``user_calibration_dir()/<target>.json`` (~/.config/remat/calibration, and $OUT): from then on ``--device meta
   --target <target>`` uses them and says "calibrated" (NOTE [ Roofline ]).

3. the memory-safe profile (``planner.profiling.memsafe``) under a cap of 70% of the measured
   peak, reached both ways: ``device_memory_bytes`` (a fake-tensor pass predicts the overflow,
   ``set_per_process_memory_fraction`` enforces the cap), and a bare per-process fraction (the
   unplanned step runs out of memory, CUDA's ``OutOfMemoryError``, and is retried under
   checkpointing). Printed: units whose saved bytes differ from the full profile, the predicted
   unplanned peak against the measured one, whether the plan at the budget of step 1 is the same,
   and that plan verified (predicted vs measured peak).

4. offload (NOTE [ Peak-memory model ], Rule 10; NOTE [ Offloaded units ]): the pinned copy's
   bandwidth the profile measured against the spec's host_link_bytes_per_s; how much of a side-stream
   copy hides behind a matmul loop on the compute stream (copy alone, compute alone, both); and a
   ``--offload`` plan halfway between offload's lowest peak and every layer's, verified: device peak
   and host peak against the prediction, measured overhead (planned minus unplanned step) against
   the modelled exposed copy time.

Without CUDA it prints "no CUDA device: skipping" and exits 0. Exit 1 when a model failed.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from planner.act.api import graph_for, min_feasible_bytes, plan_from_profile
from solvers.cost_model import simulate
from planner.profiling.meta import build_on_meta
from planner.profiling.model_file import load_model_file
from planner.profiling import profile
from planner.profiling.profiler import resolve_device
from planner.errors import BadInput
from planner.model.schema import Profile
from planner.sizes import format_bytes
from planner.act.verify import verify

MODELS = ("gpt2", "llama")
CALIBRATION_MODEL = ROOT / "benchmarks" / "models" / "llama_calibration.py"
STEPS = 3

CUDA_NAMES = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80gb"), ("L40S", "l40s"), ("L4", "l4"),
              ("4090", "rtx-4090"), ("3090", "rtx-3090"), ("3060", "rtx-3060-12gb"), ("T4", "t4"),
              ("V100", "v100"))
"""Substring of ``torch.cuda.get_device_name()`` -> device spec, first match wins (L40S before L4)."""


def match_target(cuda_name: str) -> str:
    """The device spec for a CUDA device name; h100-sxm when none matches (said in the output)."""
    upper = cuda_name.upper()
    for needle, spec in CUDA_NAMES:
        if needle in upper:
            if spec == "a100-80gb" and "40GB" in upper:
                return "a100-40gb"
            return spec
    return "h100-sxm"


def mid_budget(prof: Profile) -> int:
    g = graph_for(prof)
    return (min_feasible_bytes(g) + simulate(g, []).peak_bytes) // 2


def saved_bytes(prof: Profile) -> dict[str, int]:
    nbytes = {t.id: t.nbytes for t in prof.tensors}
    out = {u.id: 0 for u in prof.units}
    for s in prof.saves:
        out[s.unit] += nbytes[s.tensor_id]
    return out


def calibration(measured: Profile, modelled: Profile) -> dict[str, Any]:
    """Modelled over measured: step phases, every candidate unit's times, per-unit saved bytes."""
    s, m = measured.step, modelled.step

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    units = []
    for node in graph_for(measured).nodes:
        try:
            u, v = measured.unit(node), modelled.unit(node)
        except KeyError:
            continue
        units.append({"unit": node, "measured_fwd_ms": u.forward_ms, "modelled_fwd_ms": v.forward_ms,
                      "measured_bwd_ms": u.backward_ms, "modelled_bwd_ms": v.backward_ms,
                      "fwd_ratio": ratio(v.forward_ms, u.forward_ms), "bwd_ratio": ratio(v.backward_ms, u.backward_ms),
                      "flops": v.flops})
    sm, sf = saved_bytes(measured), saved_bytes(modelled)
    gaps = [(abs(sm[k] - sf.get(k, 0)) / max(sm[k], sf.get(k, 0), 1), k) for k in sm]
    worst = max(gaps, default=(0.0, ""))
    fwd = [u["fwd_ratio"] for u in units if u["fwd_ratio"]]
    return {
        "step_ratio": ratio(m.step_ms, s.step_ms), "forward_ratio": ratio(m.forward_ms, s.forward_ms),
        "backward_ratio": ratio(m.backward_ms, s.backward_ms), "optimizer_ratio": ratio(m.optimizer_ms, s.optimizer_ms),
        "modelled_step_ms": m.step_ms, "measured_step_ms": s.step_ms,
        "unit_fwd_ratio_median": statistics.median(fwd) if fwd else None,
        "unit_fwd_ratio_min": min(fwd, default=None), "unit_fwd_ratio_max": max(fwd, default=None),
        "modelled_peak_bytes": m.measured_peak_bytes, "measured_peak_bytes": s.measured_peak_bytes,
        "worst_unit_saved_bytes_gap": worst[0], "worst_unit": worst[1], "units": units, "notes": modelled.notes,
    }


def check_model(name: str, *, device: str, target: str, pairs: list[tuple[Profile, Profile]]) -> dict[str, Any]:
    """Profile, plan, verify on ``device``; then the meta profiles for ``target`` and their calibration."""
    path = ROOT / "examples" / f"{name}.py"
    mf = load_model_file(path)
    t0 = time.perf_counter()
    measured = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=device, steps=STEPS)
    budget = mid_budget(measured)
    plan = plan_from_profile(measured, budget)
    report = verify(path, plan, steps=STEPS, device=device)
    out: dict[str, Any] = {
        "budget_bytes": budget, "checkpoints": plan.checkpoints, "ok": report.ok, "problems": report.problems,
        "predicted_peak_bytes": report.predicted_peak_bytes, "measured_peak_bytes": report.measured_peak_bytes,
        "predicted_no_plan_peak_bytes": report.predicted_no_plan_peak_bytes,
        "measured_no_plan_peak_bytes": report.measured_no_plan_peak_bytes, "peak_source": report.peak_source,
        "predicted_step_ms": report.predicted_step_ms, "measured_step_ms": report.measured_step_ms,
        "predicted_recompute_ms": report.predicted_recompute_ms, "measured_recompute_ms": report.measured_recompute_ms,
        "recomputes": [report.planned_recomputes, report.measured_recomputes],
        "max_grad_diff": report.max_grad_diff, "profile_peak_bytes": measured.step.measured_peak_bytes,
        "meta": {},
    }
    # each later stage on its own: one that fails keeps the figures above and the stages after it
    out["memory_safe"] = _stage(lambda: memory_safe_check(path, mf, measured, plan, device=device))
    for fake in ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",):
        def meta_stage(fake: str = fake) -> dict[str, Any]:
            modelled = profile_meta_for(mf, target, fake)
            pairs.append((measured, modelled))
            return calibration(measured, modelled)
        out["meta"][f"fake-{fake}"] = _stage(meta_stage)
    out["seconds"] = time.perf_counter() - t0
    return out


def _stage(run: Any) -> dict[str, Any]:
    """``run()``, or ``{"error": ..., "traceback": ...}`` (printed to stderr) when it raised."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 -- report it and go on with the next stage
        print(traceback.format_exc(), file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def calibration_model(*, device: str, target: str, pairs: list[tuple[Profile, Profile]]) -> dict[str, Any]:
    """Step 3's fit needs units the roofline times (``FIT_MIN_UNIT_MS``): CALIBRATION_MODEL profiled on CUDA and
    on fake CUDA tensors, its peaks and unit times side by side (the examples' blocks are too small to fit on)."""
    mf = load_model_file(CALIBRATION_MODEL)
    measured = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=device, steps=STEPS)
    modelled = profile_meta_for(mf, target, "cuda" if torch.cuda.is_available() else "cpu")
    pairs.append((measured, modelled))
    c = calibration(measured, modelled)
    print(f"calibration model {CALIBRATION_MODEL.name}: peak modelled {format_bytes(c['modelled_peak_bytes'])}, "
          f"measured {format_bytes(c['measured_peak_bytes'])} "
          f"({_pct(c['modelled_peak_bytes'], c['measured_peak_bytes'])}); units fwd modelled / measured "
          f"{_x(c['unit_fwd_ratio_median'])} [{_x(c['unit_fwd_ratio_min'])}, {_x(c['unit_fwd_ratio_max'])}]", flush=True)
    return c


def overlap_check(nbytes: int = 256 << 20, matmuls: int = 40) -> dict[str, Any]:
    """Step 4: a device-to-host copy on a side stream beside a matmul loop on the compute stream, as the
    applier runs them (NOTE [ Offloaded units ], Rule 4): each alone and both at once, in ms."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    a = torch.randn(4096, 4096, device="cuda")
    side = torch.cuda.Stream()

    def timed(copy: bool, compute: bool) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if copy:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
        if compute:
            for _ in range(matmuls):
                a @ a
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    timed(True, True)  # warm-up
    copy_ms, compute_ms, both_ms = (min(timed(c, k) for _ in range(3)) for c, k in ((1, 0), (0, 1), (1, 1)))
    hidden = max(0.0, copy_ms + compute_ms - both_ms)
    return {"copy_ms": copy_ms, "compute_ms": compute_ms, "both_ms": both_ms,
            "hidden_share": hidden / copy_ms if copy_ms else None, "copy_bytes_per_s": nbytes / copy_ms * 1e3}


def offload_check(name: str, *, device: str, target: str) -> dict[str, Any]:
    """Step 4: the measured host link against the spec's, and an offload plan verified on CUDA."""
    from solvers.baselines import indexed_blocks
    from planner.profiling.devices import get_device

    path = ROOT / "examples" / f"{name}.py"
    mf = load_model_file(path)
    measured = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=device, steps=STEPS)
    from planner.act.api import budget_with_headroom, headroom_for
    from planner.act.frontier import offload_min_feasible_bytes

    g = graph_for(measured, selective=False)
    every = simulate(g, indexed_blocks(g)).peak_bytes
    lowest = offload_min_feasible_bytes(g, 16 << 30)  # with the copy engine's in-transfer bytes (Rule 10)
    # halfway between offload's lowest peak and every layer's: below every layer where offload reaches it
    budget = budget_with_headroom((lowest + every) // 2 if lowest < every else every, headroom_for(measured))
    plan = plan_from_profile(measured, budget, offload=True, host_memory="16GB")
    report = verify(path, plan, steps=STEPS, device=device)
    spec = get_device(target)
    return {
        "host_link_measured_bytes_per_s": measured.host_link_bytes_per_s,
        "host_link_spec_bytes_per_s": spec.host_link_bytes_per_s,
        "budget_bytes": budget, "every_layer_peak_bytes": every, "offload_lowest_peak_bytes": lowest,
        "offloaded": [u.fqn for u in plan.offload], "checkpoints": plan.checkpoints,
        "predicted_peak_bytes": report.predicted_peak_bytes, "measured_peak_bytes": report.measured_peak_bytes,
        "predicted_host_peak_bytes": report.predicted_host_peak_bytes,
        "measured_host_peak_bytes": report.measured_host_peak_bytes,
        "predicted_overhead_ms": report.predicted_recompute_ms + report.predicted_offload_ms,
        "measured_overhead_ms": report.measured_recompute_ms, "max_grad_diff": report.max_grad_diff,
        "ok": report.ok, "problems": report.problems,
    }


def memory_safe_check(path: Path, mf: Any, measured: Profile, plan: Any, *, device: str) -> dict[str, Any]:
    """Step 3 of the module docstring: the memory-safe profile on CUDA, by prediction and by OOM."""
    from planner.profiling.memsafe import profile_within

    cap = int(0.7 * measured.step.measured_peak_bytes)
    dev = resolve_device(device)  # with its index: set_per_process_memory_fraction refuses a bare 'cuda'

    total = torch.cuda.get_device_properties(dev).total_memory
    out: dict[str, Any] = {"cap_bytes": cap}
    for how in ("predicted", "out-of-memory"):
        torch.cuda.empty_cache()
        if how == "predicted":
            safe = profile_within(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=device,
                                  steps=STEPS, device_memory_bytes=cap)
        else:
            torch.cuda.set_per_process_memory_fraction(cap / total, dev)
            try:
                safe = profile_within(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=device,
                                      steps=STEPS)
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, dev)
        full_saved, safe_saved = saved_bytes(measured), saved_bytes(safe)
        none = simulate(graph_for(safe), []).peak_bytes
        safe_plan = plan_from_profile(safe, plan.budget_bytes)
        torch.cuda.empty_cache()
        report = verify(path, safe_plan, steps=STEPS, device=device)
        out[how] = {
            "checkpointed_while_measuring": len(safe.measured_with_checkpoints),
            "units_with_other_saved_bytes": sum(full_saved.get(u) != b for u, b in safe_saved.items()),
            "predicted_no_plan_peak_bytes": none, "measured_no_plan_peak_bytes": measured.step.measured_peak_bytes,
            "same_plan": safe_plan.checkpoint_units == plan.checkpoint_units,
            "predicted_peak_bytes": report.predicted_peak_bytes, "measured_peak_bytes": report.measured_peak_bytes,
            "ok": report.ok, "notes": safe.notes,
        }
        r = out[how]
        print(f"memory-safe ({how}, cap {format_bytes(cap)}): {r['checkpointed_while_measuring']} checkpointed, "
              f"{r['units_with_other_saved_bytes']} units with other saved bytes, unplanned peak predicted "
              f"{format_bytes(none)} vs measured {format_bytes(measured.step.measured_peak_bytes)} "
              f"({_pct(none, measured.step.measured_peak_bytes)}); same plan {r['same_plan']}; plan peak "
              f"{format_bytes(report.predicted_peak_bytes)} predicted, {format_bytes(report.measured_peak_bytes)} "
              f"measured ({_pct(report.predicted_peak_bytes, report.measured_peak_bytes)})", flush=True)
    return out


def profile_meta_for(mf: Any, target: str, fake_device: str) -> Profile:
    from planner.profiling.meta import profile_meta

    return profile_meta(build_on_meta(mf.build_model), mf.example_inputs(), loss_fn=mf.loss_fn, target=target,
                        fake_device=fake_device, calibrated=False)


def _pct(a: float | None, b: float | None) -> str:
    return f"{(a - b) / b:+.1%}" if a is not None and b else "-"


def _x(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "-"


def print_tables(results: dict[str, Any], target: str) -> None:
    print(f"{'model':<7}{'budget':>11}{'pred peak':>12}{'meas peak':>12}{'err':>8}{'pred step':>11}"
          f"{'meas step':>11}{'pred recomp':>13}{'meas recomp':>13}  ok")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<7} FAILED: {r['error']}")
            continue
        print(f"{name:<7}{format_bytes(r['budget_bytes']):>11}{format_bytes(r['predicted_peak_bytes']):>12}"
              f"{format_bytes(r['measured_peak_bytes']):>12}{_pct(r['predicted_peak_bytes'], r['measured_peak_bytes']):>8}"
              f"{r['predicted_step_ms']:>9.2f}ms{r['measured_step_ms']:>9.2f}ms{r['predicted_recompute_ms']:>11.2f}ms"
              f"{r['measured_recompute_ms']:>11.2f}ms  {'yes' if r['ok'] else 'NO'}")
    print(f"\ncalibration: --device meta --target {target} over CUDA-measured (1.00x = exact)")
    print(f"{'model':<7}{'fake':<6}{'step':>7}{'fwd':>7}{'bwd':>7}{'optim':>7}{'units fwd: median [min, max]':>31}"
          f"{'peak':>9}  worst unit saved bytes")
    for name, r in results.items():
        for fake, c in r.get("meta", {}).items():
            if "error" in c:
                print(f"{name:<7}{fake[5:]:<6} FAILED: {c['error']}")
                continue
            units = f"{_x(c['unit_fwd_ratio_median'])} [{_x(c['unit_fwd_ratio_min'])}, {_x(c['unit_fwd_ratio_max'])}]"
            print(f"{name:<7}{fake[5:]:<6}{_x(c['step_ratio']):>7}{_x(c['forward_ratio']):>7}"
                  f"{_x(c['backward_ratio']):>7}{_x(c['optimizer_ratio']):>7}{units:>31}"
                  f"{_pct(c['modelled_peak_bytes'], c['measured_peak_bytes']):>9}"
                  f"  {c['worst_unit_saved_bytes_gap']:.2%} ({c['worst_unit']})")


def write_calibration(pairs: list[tuple[Profile, Profile]], gpu: str, models: list[str], out: str | None) -> None:
    """Fit the roofline on this GPU's measured units and save it where --device meta on this machine
    finds it (``user_calibration_dir()``; copy it to profiles/devices/calibration/ to ship it)."""
    from planner.profiling.devices import user_calibration_dir
    from planner.profiling.roofline import fit_calibration
    from planner.files import atomic_write_text

    cal = fit_calibration(pairs, measured_on=gpu, models=models)
    text = cal.model_dump_json(indent=2) + "\n"
    path = user_calibration_dir() / f"{cal.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)
    print(f"calibration: modelled / measured was {cal.modelled_over_measured_before:.3f}; efficiencies now "
          f"{cal.matmul_efficiency:.3g} (FLOP/s) and {cal.bandwidth_efficiency:.3g} (bandwidth); wrote {path}")
    if out:
        atomic_write_text(Path(out) / path.name, text)


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: skipping")
        return 0
    gpu = torch.cuda.get_device_name()
    target = match_target(gpu)
    matched = any(n in gpu.upper() for n, _ in CUDA_NAMES)
    print(f"{gpu}: target {target}{'' if matched else ' (no spec matched this name: assumed)'}, "
          f"torch {torch.__version__}")
    results: dict[str, Any] = {}
    pairs: list[tuple[Profile, Profile]] = []
    for name in MODELS:
        try:
            results[name] = check_model(name, device="cuda", target=target, pairs=pairs)
        except Exception as e:  # noqa: BLE001 -- report it and go on with the next model
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(results[name]["traceback"], file=sys.stderr)
        torch.cuda.empty_cache()
    print_tables(results, target)
    results["calibration_model"] = _stage(lambda: calibration_model(device="cuda", target=target, pairs=pairs))
    torch.cuda.empty_cache()
    results["offload"] = {"overlap": overlap_check()}
    for name in MODELS:
        try:
            results["offload"][name] = offload_check(name, device="cuda", target=target)
        except Exception as e:  # noqa: BLE001 -- report it and go on
            results["offload"][name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(results["offload"][name]["traceback"], file=sys.stderr)
        torch.cuda.empty_cache()
    print("offload:", json.dumps(results["offload"], indent=1, default=str))
    out = os.environ.get("OUT")
    if pairs:
        fitted = [n for n in MODELS if "error" not in results.get(n, {"error": 1})]
        fitted += [CALIBRATION_MODEL.stem] if "error" not in results["calibration_model"] else []
        try:
            write_calibration(pairs, gpu, fitted, out)
        except BadInput as e:  # units too small for the roofline (FIT_MIN_UNIT_MS): nothing written, and why
            print(f"calibration: not fitted: {e}")
    if out:
        doc = {"gpu": gpu, "target": target, "torch": torch.__version__, "host": platform.node(), "models": results}
        path = Path(out) / "gpu_check.json"
        path.write_text(json.dumps(doc, indent=1, default=str))
        print(f"wrote {path}")
    failed = [r for k, r in results.items() if k != "offload" and "error" in r]
    failed += [s for k, r in results.items() if k in MODELS and "error" not in r
               for s in (r["memory_safe"], *r["meta"].values()) if "error" in s]
    failed += [r for k, r in results["offload"].items() if k != "overlap" and "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
