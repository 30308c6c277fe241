"""remat's plan against the usual alternatives, on one model at one budget, measured in one run.

    python benchmarks/peers.py                              # examples/gpt2.py on the CPU
    python benchmarks/peers.py examples/llama.py --repeats 7
    python benchmarks/peers.py examples/gpt2.py --device cuda

Variants, each a fresh ``build_model()`` trained with the step of ``planner.profiling.measure.make_step``:

- no checkpointing;
- every layer: Hugging Face's ``model.gradient_checkpointing_enable()`` (use_reentrant=False);
- every second block: a plan checkpointing blocks 0, 2, 4, ... applied by ``apply_plan``;
- remat: ``planner.act.api.plan_from_profile`` at the budget, applied by ``apply_plan``.

The budget is halfway between the predicted peaks of checkpointing every layer (baseline
``all``) and of checkpointing nothing: the range where a fixed rule wastes either memory or time.
Step times: ``--repeats`` rounds of one step per variant in turn (round-robin, so drift on a
shared machine hits every variant alike), median. Peaks: one step per variant, alone on the
device, by ``planner.profiling.measure.measure_step`` (CUDA: the allocator's peak; CPU: the profiler's
memory events). Prints a Markdown table: step time relative to every layer, peak relative to
the budget, and the cost model's predicted peak next to the measured one.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from planner.act.api import graph_for, plan_from_profile
from planner.act.applier import apply_plan
from planner.act.frontier import run_solver
from planner.profiling.measure import free, make_optimizer, make_step, measure_step, sync, to_device
from planner.profiling.model_file import load_model_file
from planner.profiling import profile
from planner.profiling.profiler import resolve_device
from planner.model.schema import Plan
from planner.profiling.tracker import iter_tensors, storage_bytes
from planner.sizes import format_bytes

MIB = 2**20


@dataclass
class Variant:
    name: str
    setup: Callable[[torch.nn.Module, Any], str]
    """Checkpoints the model in place; returns what it checkpointed, for the table."""
    predicted_peak_bytes: int | None
    what: str = ""
    times_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    """Process CPU time of each timed step: with --threads 1, robust to other jobs on the machine."""
    peak_bytes: int | None = None
    error: str = ""


def main() -> None:
    args = _args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    mf = load_model_file(args.model)
    print(f"profiling {args.model} on {dev} ...", file=sys.stderr)
    prof = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=dev,
                   optimizer=args.optimizer, steps=args.profile_steps)
    g = graph_for(prof)
    every_layer, nothing = run_solver(g, "all", 0), run_solver(g, "none", 0)
    budget = (every_layer.peak_bytes + nothing.peak_bytes) // 2
    remat = plan_from_profile(prof, budget)
    every_2 = plan_from_profile(prof, nothing.peak_bytes, solver="every-2")
    variants = [
        Variant("no checkpointing", lambda m, b: "-", nothing.peak_bytes),
        Variant("every layer (HF gradient_checkpointing_enable)", _hf_every_layer,
                run_solver(g, "every-1", budget).peak_bytes),
        Variant("every 2nd block (apply_plan)", _applier(every_2), every_2.predicted.peak_bytes),
        Variant(f"remat plan ({remat.solver.name}, {remat.solver.status})", _applier(remat),
                remat.predicted.peak_bytes),
    ]
    print(f"budget {format_bytes(budget)}: halfway between every layer ({format_bytes(every_layer.peak_bytes)}) "
          f"and no checkpointing ({format_bytes(nothing.peak_bytes)}), predicted", file=sys.stderr)
    for v in variants:
        _measure_peak(v, mf, dev, args.optimizer)
    _time_round_robin(variants, mf, dev, args.optimizer, args.repeats)
    _print_table(args, dev, budget, variants)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="examples/gpt2.py", help="model file (default examples/gpt2.py)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, auto")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (one step per variant each)")
    p.add_argument("--profile-steps", type=int, default=2, help="timing steps of the profile")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default); 1 makes CPU time comparable on a busy machine")
    return p.parse_args()


# ----------------------------------------------------------------------------- variants


def _hf_every_layer(model: torch.nn.Module, _batch: Any) -> str:
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise TypeError("not a Hugging Face model: no gradient_checkpointing_enable()")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)
              and type(m).__name__.endswith(("Block", "Layer", "DecoderLayer"))]
    return f"{len(layers)} layers" if layers else "every layer"


def _applier(plan: Plan) -> Callable[[torch.nn.Module, Any], str]:
    def setup(model: torch.nn.Module, batch: Any) -> str:
        handle = apply_plan(model, plan, inputs=batch)
        return ", ".join(handle.checkpointed) or "-"

    return setup


def _build(v: Variant, mf: Any, dev: torch.device, optimizer: str) -> tuple[Any, Any, Any, Any]:
    """A fresh model with the variant applied, its optimizer, its step, its batch; one warm-up step."""
    model = mf.build_model().to(dev).train()
    batch = to_device(mf.example_inputs(), dev)
    v.what = v.setup(model, batch)
    opt = make_optimizer(optimizer, model)
    step = make_step(model, batch, loss_fn=mf.loss_fn, optimizer=opt)
    step()  # creates the optimizer state: what follows is the steady state
    return model, opt, step, batch


def _measure_peak(v: Variant, mf: Any, dev: torch.device, optimizer: str) -> None:
    """One variant alone on the device (CUDA's peak counts everything allocated there)."""
    try:
        model, opt, step, batch = _build(v, mf, dev, optimizer)
        model.zero_grad(set_to_none=True)  # see measure_step's warning
        gc.collect()
        static = storage_bytes(itertools.chain(model.parameters(), model.buffers(),
                                               iter_tensors(*opt.state.values()) if opt else (),
                                               iter_tensors(batch)))
        v.peak_bytes = measure_step(step, dev, static_bytes=static).peak_bytes
    except torch.OutOfMemoryError:
        v.error = "out of memory"
    except TypeError as e:
        v.error = str(e)
    finally:
        model = opt = step = batch = None  # drop them before the next variant is built
        free(dev)


def _time_round_robin(variants: list[Variant], mf: Any, dev: torch.device, optimizer: str, repeats: int) -> None:
    runs = [(v, _build(v, mf, dev, optimizer)[2]) for v in variants if not v.error]
    for r in range(repeats):
        print(f"round {r + 1}/{repeats}", file=sys.stderr)
        for v, step in runs:
            torch.manual_seed(r)
            sync(dev)
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            sync(dev)
            v.times_ms.append((time.perf_counter() - t0) * 1e3)
            v.cpu_ms.append((time.process_time() - c0) * 1e3)


# ----------------------------------------------------------------------------- output


def _print_table(args: argparse.Namespace, dev: torch.device, budget: int, variants: list[Variant]) -> None:
    base = next((v for v in variants if v.name.startswith("every layer") and v.times_ms), None)
    base_ms = statistics.median(base.times_ms) if base else None
    base_cpu = statistics.median(base.cpu_ms) if base else None
    threads = f", {torch.get_num_threads()} threads" if dev.type == "cpu" else ""
    print(f"`python benchmarks/peers.py {' '.join(sys.argv[1:])}` on {dev}{threads}, torch {torch.__version__}; "
          f"budget {budget} bytes ({budget / MIB:.2f} MiB); step times: median of {args.repeats} "
          f"round-robin rounds\n")
    print("| variant | checkpointed | step ms | vs every layer | CPU ms | vs every layer (CPU) "
          "| peak bytes (measured) | peak / budget | predicted peak bytes |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for v in variants:
        if v.error:
            print(f"| {v.name} | {v.error} | | | | | | | |")
            continue
        ms, cpu = statistics.median(v.times_ms), statistics.median(v.cpu_ms)
        ratio = f"{ms / base_ms:.2f}x" if base_ms else "n/a"
        cpu_ratio = f"{cpu / base_cpu:.2f}x" if base_cpu else "n/a"
        peak = f"{v.peak_bytes} ({v.peak_bytes / MIB:.2f} MiB)" if v.peak_bytes is not None else "n/a"
        share = f"{100 * v.peak_bytes / budget:.3f}%" if v.peak_bytes is not None else "n/a"
        over = f" (over by {v.peak_bytes - budget} B)" if v.peak_bytes is not None and v.peak_bytes > budget else ""
        predicted = str(v.predicted_peak_bytes) if v.predicted_peak_bytes is not None else "n/a"
        print(f"| {v.name} | {v.what} | {ms:.1f} | {ratio} | {cpu:.1f} | {cpu_ratio} | {peak} | {share}{over} "
              f"| {predicted} |")
    spread = {v.name: f"{min(v.times_ms):.0f}-{max(v.times_ms):.0f}" for v in variants if v.times_ms}
    print("\nstep ms range (min-max) per variant: " + "; ".join(f"{k}: {r}" for k, r in spread.items()))








if __name__ == "__main__":
    main()
