"""Offload as a third choice: remat's mixed plans against every-layer recompute and offloading every
layer, measured on one model (NOTE [ Peak-memory model ], Rule 10; NOTE [ Offloaded units ]).

    python benchmarks/offload.py examples/gpt2.py
    python benchmarks/offload.py examples/llama.py --threads 1
    python benchmarks/offload.py zoo:qwen2 zoo:bert         # models of benchmarks/zoo_models.py (FULL size)
    python benchmarks/offload.py examples/llama.py zoo:qwen2 --granularity 1   # blocks and their children
    python benchmarks/offload.py examples/gpt2.py --target h100   # modelled only: --device meta for the spec

With ``--target``: a meta profile for that device spec (its host link, a copy engine), and at the
budget halfway between every layer and no checkpointing the best recompute-only plan against the
mixed plan: modelled step, recompute, exposed copies, and each offloaded unit with the compute its
copies hide behind. Nothing is trained.

Per model: one profile (CPU, ``--threads``), then plans, each verified by ``planner.act.verify.verify``
(trained with and without the plan: device peak from the allocator, the host store's peak, gradients
against the unplanned model, median step CPU time at the profile's threads):

- every layer: remat's ``all`` baseline (every block checkpointed; what Hugging Face's
  ``gradient_checkpointing_enable`` does);
- offload every layer: every block offloaded and nothing recomputed (what ``save_on_cpu`` around every
  layer does; on a CPU-only machine torch's ``save_on_cpu`` copies into the same allocator and frees
  nothing, and Hugging Face's ``offload=True`` refuses to run, as it pins memory: remat's host store
  is used for both rules);
- remat --offload halfway between its lowest feasible budget and every layer's measured peak (below
  every layer: where recompute alone cannot fit), when that lowest budget is below every layer's peak;
- remat --offload and remat without offload at every layer's measured peak (equal peak);
- remat --offload at offloading every layer's measured peak (equal peak).

Prints a Markdown table: predicted and measured device peak, host memory, overhead (recompute +
exposed copies) predicted and measured (planned minus unplanned median step time), gradient diff.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from planner.act.api import graph_for, plan_from_profile, plan_of  # noqa: E402
from planner.act.verify import verify  # noqa: E402
from planner.errors import BudgetInfeasible  # noqa: E402
from planner.model.schema import Plan, SolverInfo  # noqa: E402
from planner.profiling import profile  # noqa: E402
from planner.profiling.model_file import ModelFile, load_model_file  # noqa: E402
from planner.sizes import format_bytes  # noqa: E402
from solvers.baselines import indexed_blocks  # noqa: E402
from solvers.cost_model import simulate  # noqa: E402

HOST_MEMORY = "8GB"
"""The host budget of the remat plans here: far above what these models offload."""


def _model(name: str) -> ModelFile:
    if not name.startswith("zoo:"):
        return load_model_file(name)
    from benchmarks.zoo_models import BY_NAME, FULL

    spec = BY_NAME[name[4:]]
    return ModelFile(build_model=lambda: spec.build(FULL), example_inputs=lambda: spec.inputs(FULL),
                     loss_fn=spec.loss_fn, path=Path(name))


def _rule(prof: Any, g: Any, name: str, checkpointed: list[str], offloaded: list[str]) -> Plan:
    est = simulate(g, checkpointed, None, offloaded)
    return plan_of(prof, g, est, est.peak_bytes, host_budget_bytes=est.host_peak_bytes or None,
                   solver=SolverInfo(name=name, status="feasible", detail="a fixed rule"))


def _row(label: str, plan: Plan | None, mf: ModelFile, threads: int, error: str = "") -> str:
    if plan is None:
        return f"| {label} | {error} | | | | | | |"
    r = verify(mf, plan, steps=3, device="cpu", threads=threads)
    p = plan.predicted
    host = (f"{format_bytes(p.host_peak_bytes)} / {format_bytes(r.measured_host_peak_bytes or 0)}"
            if p.host_peak_bytes else "-")
    over = (p.recompute_ms + (p.offload_ms or 0.0))
    what = f"{len(plan.checkpoints)} ckpt, {len(plan.offload)} offl"
    return (f"| {label} | {what} | {format_bytes(p.peak_bytes)} / {format_bytes(r.measured_peak_bytes)} "
            f"({r.prediction_error:+.2%}) | {host} | {over:.1f} / {r.measured_recompute_ms:.1f} | "
            f"{r.measured_step_ms:.1f} | {r.max_grad_diff:g} | {'ok' if r.ok else 'FAIL: ' + '; '.join(r.problems)} |")


def modelled(names: list[str], target: str) -> None:
    """``--target``: recompute-only against mixed plans on the spec, at the halfway budget (modelled)."""
    from planner.profiling.meta import build_on_meta

    print("| model | plan | checkpointed | offloaded: MiB, copy ms each way, hidden behind ms, exposed ms "
          "| peak | recompute ms | exposed copies ms | modelled step ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        mf = _model(name)
        prof = profile(build_on_meta(mf.build_model), mf.example_inputs(), loss_fn=mf.loss_fn, device="meta",
                       target=target)
        g = graph_for(prof)
        budget = (simulate(g, indexed_blocks(g)).peak_bytes + simulate(g, []).peak_bytes) // 2
        for label, plan in (("recompute only", plan_from_profile(prof, budget, headroom=0.0)),
                            ("--offload", plan_from_profile(prof, budget, headroom=0.0, offload=True,
                                                            host_memory=HOST_MEMORY))):
            p = plan.predicted
            ckpt = ", ".join([*plan.checkpoints, *(f"{r.fqn} (op by op)" for r in plan.selective)]) or "-"
            offl = "; ".join(f"{u.fqn}: {u.host_bytes / 2**20:.1f}, {u.d2h_ms:.3f}, {u.hidden_ms:.3f} "
                             f"({u.sync_fqn or 'end of forward'}), {u.exposed_ms:.3f}" for u in plan.offload) or "-"
            print(f"| {name} ({format_bytes(budget)}) | {label} | {ckpt} | {offl} | {format_bytes(p.peak_bytes)} | "
                  f"{p.recompute_ms:.4f} | {p.offload_ms or 0:.4f} | {p.step_ms:.4f} |")


def _lowest_budget(prof: Any, granularity: int) -> int:
    """The lowest budget (headroom included) at which ``--offload`` finds a plan."""
    try:
        plan_from_profile(prof, 1 << 20, offload=True, host_memory=HOST_MEMORY, selective=False,
                          granularity=granularity)
    except BudgetInfeasible as e:
        return int(e.min_feasible_bytes or 0)
    return 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--granularity", type=int, default=0,
                    help="candidate levels below the blocks for remat's plans (the rules stay per block)")
    ap.add_argument("--target", default=None, help="a device spec: modelled plans on --device meta only")
    args = ap.parse_args()
    if args.target:
        return modelled(args.models, args.target)
    torch.set_num_threads(args.threads)
    print("| variant | plan | device peak predicted / measured (error) | host predicted / measured "
          "| overhead ms predicted / measured | step ms | max grad diff | verify |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        mf = _model(name)
        prof = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu",
                       threads=args.threads)
        g = graph_for(prof, selective=False)
        blocks = list(indexed_blocks(g))  # the repeated blocks, "every layer"
        print(f"| **{name}** | host link {prof.host_link_bytes_per_s / 1e9:.2f} GB/s (memcpy) | | | | | | |")
        every = _rule(prof, g, "all", blocks, [])
        offl = _rule(prof, g, "offload-all", [], blocks)
        peaks = {}
        for label, plan in (("every layer (recompute)", every), ("offload every layer", offl)):
            r = verify(mf, plan, steps=1, device="cpu", threads=args.threads)
            peaks[label] = r.measured_peak_bytes
        print(_row("every layer (recompute)", every, mf, args.threads))
        print(_row("offload every layer (save_on_cpu rule)", offl, mf, args.threads))
        every_peak = peaks["every layer (recompute)"]
        lowest = _lowest_budget(prof, args.granularity)
        print(f"| lowest budget with --offload: {format_bytes(lowest)}; every layer measured "
              f"{format_bytes(every_peak)} | | | | | | | |")
        for label, budget, offload in (
                ("remat --offload below every layer's measured peak", (lowest + every_peak) // 2, True),
                ("remat --offload at every layer's measured peak", peaks["every layer (recompute)"], True),
                ("remat (no offload) at every layer's measured peak", peaks["every layer (recompute)"], False),
                ("remat --offload at offload-every-layer's measured peak", peaks["offload every layer"], True)):
            try:
                plan = plan_from_profile(prof, budget, offload=offload, host_memory=HOST_MEMORY if offload else None,
                                         selective=False, granularity=args.granularity)
            except BudgetInfeasible as e:
                print(_row(f"{label} ({format_bytes(budget)})", None, mf, args.threads, str(e).split(":")[0]))
                continue
            print(_row(f"{label} ({format_bytes(budget)})", plan, mf, args.threads))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
