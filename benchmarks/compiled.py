"""remat's compiled plans against torch.compile's own activation_memory_budget, at equal peaks.

    python benchmarks/compiled.py examples/llama.py --threads 1
    python benchmarks/compiled.py examples/gpt2.py --threads 1 --budgets 0.2,0.3,0.5,0.7 --repeats 5
    python benchmarks/compiled.py --zoo gpt-neox --threads 1     # a zoo model (benchmarks/zoo_models.py, FULL size)

1. ``remat profile --compile`` of the model (``planner.profiling.profile(..., compile="inductor")``,
   NOTE [ Compiled profile ]), timed: what ``remat plan --compile`` costs before its solver runs.
2. torch.compile (inductor) of the plain model, without a budget and with each
   ``torch._functorch.config.activation_memory_budget`` of ``--budgets``: each compiled afresh
   (no AOT or FX graph cache; one backend object per variant, see ``benchmarks/peers.py``), its
   first step (compiling it) timed, its peak measured by ``measure_step``.
3. remat's compiled plan made at each budget variant's measured peak (``plan_from_profile`` with
   that peak as the budget and the check of ``remat plan --compile``: the chosen plan compiled and
   measured before it is returned, NOTE [ The compiled plan is checked ]), applied by ``apply_plan``
   and then compiled, measured the same way; its prediction next to the measurement, and the cost
   model's own figure for the set it chose before the check ("cost model").
4. ``--repeats`` round-robin rounds of one step per variant (drift hits all alike); the table
   gives the median wall and CPU ms per step (with --threads 1, CPU time is robust to other jobs),
   and each variant's recompute as measured: the median over rounds of its CPU ms less plain
   torch.compile's in the same round, beside remat's predicted recompute.

Prints a Markdown table and one line per budget: remat's plan at compile's peak, no slower at a
peak no higher (the medians, and the paired median of remat less compile with the rounds remat
was not slower in)? Then whether peaks fall as the budget falls (monotone), for both.
``--profile PATH`` reads a saved ``remat profile --compile`` of the model instead of profiling it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.peers import Variant, _applier, _measure_peak, _time_round_robin
from planner.act.api import plan_from_profile
from planner.act.compiled_check import compiled_peak
from planner.errors import BudgetInfeasible
from planner.model.schema import Plan, Profile
from planner.profiling import profile
from planner.profiling.model_file import load_model_file
from planner.profiling.profiler import resolve_device
from planner.profiling.step_changes import find_step_changes, install
from planner.spec import StepSpec

MIB = 2**20


def main() -> None:
    args = _args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # one model class compiled for every variant
    dev = resolve_device(args.device)
    mf = _zoo_model(args.zoo) if args.zoo else load_model_file(args.model)
    if args.zoo:
        args.model = f"the zoo's {args.zoo}"
    print(f"profiling {args.model} under torch.compile on {dev} ...", file=sys.stderr)
    t0 = time.perf_counter()
    if args.profile:  # a saved `remat profile --compile` of this model: its own time is not this run's
        prof, profile_s = Profile.load(args.profile), None
    else:
        prof = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=dev,
                       steps=args.profile_steps, threads=args.threads or None, compile="inductor")
        profile_s = time.perf_counter() - t0
    variants = [Variant("torch.compile", _same_step, None, compile_budget=None)]
    if find_step_changes(mf.build_model()):  # what the step changes are worth to compile alone
        variants.append(Variant("torch.compile, as built (no step changes)", lambda m, b: "-", None,
                                compile_budget=None))
    variants += [Variant(f"torch.compile, activation_memory_budget {b:g}", _same_step, None, compile_budget=b)
                 for b in args.budgets]
    kept = [_timed_peak(v, mf, dev) for v in variants]
    plans: dict[str, Plan | None] = {}
    costs: dict[str, str] = {}  # the cost model's own figure at each budget, before the check
    targets = [(f"remat --compile at the peak of budget {v.compile_budget:g}", v.peak_bytes)
               for v in variants if isinstance(v.compile_budget, float) and v.peak_bytes]
    targets += [(f"remat --compile at {b / MIB:.2f} MiB (its own range)", b)
                for b in _spread(prof, variants[0].peak_bytes, args.spread)]
    check = compiled_peak(mf.build_model(), inputs=mf.example_inputs(),
                          step=StepSpec(device=dev, threads=args.threads or None, loss_fn=mf.loss_fn))
    for name, budget in targets:
        t1 = time.perf_counter()
        try:
            plan = plan_from_profile(prof, budget, check=check)
        except BudgetInfeasible as e:  # compile went below what remat's candidates reach
            variants.append(Variant(name, lambda m, b: "-", None, error=str(e).split(": raise")[0][:160]))
            kept.append(None)
            continue
        plans[name] = plan
        solve_s = time.perf_counter() - t1
        costs[name] = _unchecked(prof, budget)
        variants.append(Variant(name, _applier(plan), plan.predicted.peak_bytes,
                                predicted_recompute_ms=plan.predicted.recompute_ms, compile_budget=None))
        variants[-1].solve_s = solve_s  # type: ignore[attr-defined]
        kept.append(_timed_peak(variants[-1], mf, dev))
    _time_round_robin(variants, kept, mf, dev, "adamw", args.repeats)
    _print(args, dev, prof, profile_s, variants, plans, costs)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="examples/llama.py")
    p.add_argument("--zoo", default="", metavar="NAME",
                   help="a model of benchmarks/zoo_models.py at its FULL size instead of a model file")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    p.add_argument("--budgets", type=lambda t: [float(x) for x in t.split(",") if x.strip()],
                   default=[0.7, 0.5, 0.3, 0.2], metavar="B1,B2,...", help="activation_memory_budget values")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (one step per variant each)")
    p.add_argument("--profile", default="", metavar="PATH",
                   help="a saved `remat profile --compile` of the same model and step, instead of profiling it")
    p.add_argument("--profile-steps", type=int, default=2, help="timing steps of the profile")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--spread", type=int, default=0, metavar="N",
                   help="also N remat plans at budgets spread evenly from the lowest its plans fit up to the "
                        "plain compiled step's peak (for models where compile's budgets go below remat's reach)")
    return p.parse_args()


def _unchecked(prof: Any, budget: int) -> str:
    """The cost model's own plan at ``budget`` (no check): its predicted peak, or 'none fits'."""
    try:
        plan = plan_from_profile(prof, budget)
    except BudgetInfeasible:
        return "none fits"
    return str(plan.predicted.peak_bytes)


def _zoo_model(name: str) -> Any:
    """A zoo model (``benchmarks/zoo_models.py``, FULL size) in a model file's shape."""
    from types import SimpleNamespace

    from benchmarks.zoo_models import FULL, SPECS

    spec = next((s for s in SPECS if s.name == name), None)
    if spec is None:
        raise SystemExit(f"--zoo {name}: not a zoo model; pick one of {', '.join(s.name for s in SPECS)}")
    return SimpleNamespace(build_model=lambda: spec.build(FULL).train(), example_inputs=lambda: spec.inputs(FULL),
                           loss_fn=spec.loss_fn, path=Path("benchmarks/zoo_models.py"))


def _spread(prof: Any, top: int | None, n: int) -> list[int]:
    """``n`` budgets from the lowest a remat plan fits (the minimum feasible peak, with headroom) up to,
    not including, the measured peak of the plain compiled step."""
    from planner.act.api import budget_with_headroom, graph_for, headroom_for
    from solvers.dp import min_feasible_bytes

    if n <= 0 or not top:
        return []
    low = budget_with_headroom(min_feasible_bytes(graph_for(prof, selective=False)), headroom_for(prof))
    return [low + (top - low) * k // n for k in range(n)] if low < top else []


def _same_step(model: torch.nn.Module, _batch: Any) -> str:
    """torch.compile's variants run the step remat's plans run: the step changes ``apply_plan`` installs
    (NOTE [ Step changes ]: a Hugging Face model trains with ``use_cache=False``), else compile's peaks
    would count the keys and values its cache keeps (or not) and the comparison would be of two steps."""
    changes = find_step_changes(model)
    install(model, changes, say=False)
    return "- (use_cache=False, as remat's plans run)" if changes else "-"


def _timed_peak(v: Variant, mf: Any, dev: torch.device) -> Any:
    """``peers._measure_peak``, with the wall seconds of the build (its first step compiles) kept."""
    t0 = time.perf_counter()
    kept = _measure_peak(v, mf, dev, "adamw")
    v.first_s = time.perf_counter() - t0  # type: ignore[attr-defined]
    return kept


def _paired_ms(v: Variant, base: Variant) -> float:
    """The median over rounds of ``v``'s CPU ms less ``base``'s in the same round (both run once per round)."""
    return statistics.median(a - b for a, b in zip(v.cpu_ms, base.cpu_ms))


def _paired_wins(v: Variant, base: Variant) -> str:
    """In how many rounds ``v`` took no more CPU time than ``base``."""
    wins = sum(a <= b for a, b in zip(v.cpu_ms, base.cpu_ms))
    return f"not slower in {wins} of {min(len(v.cpu_ms), len(base.cpu_ms))} rounds"


def _print(args: argparse.Namespace, dev: torch.device, prof: Any, profile_s: float | None,
           variants: list[Variant], plans: dict[str, Plan | None], costs: dict[str, str]) -> None:
    threads = f", {torch.get_num_threads()} thread(s)" if dev.type == "cpu" else ""
    print(f"`python benchmarks/compiled.py {' '.join(sys.argv[1:])}` on {dev}{threads}, torch {torch.__version__}; "
          f"step times: median of {args.repeats} round-robin rounds\n")
    first_s = prof.compile.first_compile_s
    took = (f"{profile_s:.1f} s; the model's first compiled step in it (the first compile of this process): "
            f"{first_s:.1f} s; ratio {profile_s / max(first_s, 1e-9):.2f}" if profile_s is not None else
            f"read from {args.profile} (its first compiled step took {first_s:.1f} s when it was made)")
    print(f"remat profile --compile: {took}; replay temporaries {prof.compile.replay_transient_bytes} B. First steps "
          f"below are later compiles of this process (inductor reuses compiled kernels it has seen)\n")
    print("| variant | checkpointed | peak bytes (measured) | predicted | error | cost model | plan s | step ms | CPU ms "
          "| recompute CPU ms, measured (predicted) | first step s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    plain = variants[0]  # torch.compile, the step remat's plans run, nothing recomputed
    for v in variants:
        if v.error:
            print(f"| {v.name} | {v.error} | | | | | | | | | |")
            continue
        pred = v.predicted_peak_bytes
        err = f"{(pred - v.peak_bytes) / v.peak_bytes:+.2%}" if pred and v.peak_bytes else ""
        model, plan_s = (costs[v.name], f"{v.solve_s:.1f}") if v.name in plans else ("", "")  # type: ignore
        extra = f"{_paired_ms(v, plain):+.1f}" if v is not plain else ""
        if v.predicted_recompute_ms is not None and v is not plain:
            extra += f" ({v.predicted_recompute_ms:.1f})"
        print(f"| {v.name} | {v.what} | {v.peak_bytes} ({v.peak_bytes / MIB:.2f} MiB) | {pred or ''} | {err} "
              f"| {model} | {plan_s} | {statistics.median(v.times_ms):.1f} | {statistics.median(v.cpu_ms):.1f} "
              f"| {extra} | {getattr(v, 'first_s', 0.0):.1f} |")
    print()
    budgets = [v for v in variants if isinstance(v.compile_budget, float)]
    for b in budgets:
        mine = next((v for v in variants if v.name.endswith(f"budget {b.compile_budget:g}") and v.name.startswith("remat")), None)
        if mine is None or mine.error or not b.cpu_ms:
            continue
        faster = statistics.median(mine.cpu_ms) <= statistics.median(b.cpu_ms)
        lower = mine.peak_bytes <= b.peak_bytes
        print(f"budget {b.compile_budget:g}: remat {statistics.median(mine.cpu_ms):.1f} CPU ms at "
              f"{mine.peak_bytes / MIB:.2f} MiB, compile {statistics.median(b.cpu_ms):.1f} CPU ms at "
              f"{b.peak_bytes / MIB:.2f} MiB (paired rounds: remat {_paired_ms(mine, b):+.1f} ms, "
              f"{_paired_wins(mine, b)}): {'not slower' if faster else 'SLOWER'}, "
              f"{'peak no higher' if lower else 'HIGHER peak'}; within its budget: {mine.peak_bytes <= b.peak_bytes}")
    peaks = [v.peak_bytes for v in budgets]
    print(f"compile: peaks in falling activation_memory_budget order {[round(p / MIB, 2) for p in peaks]} MiB: "
          f"{'monotone' if all(a >= b for a, b in zip(peaks, peaks[1:])) else 'NOT monotone'}")
    ours = sorted(((plans[v.name].budget_bytes, v.peak_bytes) for v in variants if v.name in plans and v.peak_bytes),
                  reverse=True)
    print(f"remat: peaks in falling budget order {[(round(b / MIB, 2), round(p / MIB, 2)) for b, p in ours]} "
          f"(budget, peak MiB): {'monotone' if all(a[1] >= b[1] for a, b in zip(ours, ours[1:])) else 'NOT monotone'}")


if __name__ == "__main__":
    main()
