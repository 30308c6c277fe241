"""Train a model file for a few steps with a remat plan applied: the plan in one line of a loop.

    python examples/train.py examples/gpt2.py --plan plan.json --steps 5
    python examples/train.py examples/gpt2.py --plan plan.json --compile aot_eager
    python examples/train.py examples/resnet.py --steps 5        # no plan: the baseline

Make the plan first, e.g. ``remat plan examples/gpt2.py --budget 160MB -o plan.json``.
Every step trains on the model file's ``example_inputs()`` (this is a demo, not a data loader).
"""

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from planner.act.applier import apply_plan
from planner.profiling.model_file import call_model, compute_loss, load_model_file


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="model file: build_model(), example_inputs(), optional loss_fn(output) "
                                 "or loss_fn(output, batch)")
    p.add_argument("--plan", help="plan.json from `remat plan` (omit to train without checkpointing)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)  # AdamW; small models move visibly in 5 steps
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", metavar="BACKEND", help="torch.compile backend, e.g. inductor or aot_eager")
    return p.parse_args(argv)


def to_device(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(v, device) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the plan's summary line
    torch.manual_seed(0)
    mf = load_model_file(args.model)
    model = mf.build_model().to(args.device).train()
    batch = to_device(mf.example_inputs(), args.device)

    handle = apply_plan(model, args.plan, inputs=batch) if args.plan else None  # before compile
    if args.compile:
        model = torch.compile(model, backend=args.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = compute_loss(mf.loss_fn, call_model(model, batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the GPU
        print(f"step {step}: loss {value:.4f}, {(time.perf_counter() - t0) * 1e3:.0f} ms")

    if args.device.startswith("cuda"):
        print(f"peak memory: {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB")
    if handle is not None and not args.compile:  # compiled backward recomputes without Python: not counted
        print(f"recomputed {handle.recompute_count} checkpointed forwards in {args.steps} steps")


if __name__ == "__main__":
    main()
