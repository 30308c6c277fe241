"""What a checkpointed block's replay costs under torch.compile: whole blocks against op-level policies.

    python benchmarks/compiled_policies.py examples/gpt2.py --threads 1 --repeats 11
    python benchmarks/compiled_policies.py examples/llama.py --threads 1 --blocks 2

remat prices a compiled replay from eager figures (NOTE [ Compiled profile ], Rules 6-7): a whole
block at its compiled forward, a selective policy at that forward times the eager kernel share of
the ops it recomputes. This script measures both kinds side by side, on the model's repeated blocks
(the first ``--blocks`` of them), with no planner in between: plain torch.compile; the blocks
checkpointed whole; the blocks under a policy that keeps every matmul and the softmax (recomputing
the pointwise ops, which inductor fuses); the blocks under a policy that keeps the matmuls only.
Each variant is compiled afresh (AOTAutograd's CSE off where blocks are checkpointed, as remat
compiles them: NOTE [ CSE across checkpointed regions ]), its peak measured, then all step in
shuffled rounds (``benchmarks/peers.py``). Prints each variant's peak and its recompute as measured:
the median over rounds of its CPU ms less plain compile's in the same round.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from benchmarks.compiled import _paired_ms, _paired_wins
from benchmarks.peers import MIB, Variant, _measure_peak, _time_round_robin
from planner.model.graph import repeated_blocks, unit_children
from planner.profiling import profile
from planner.profiling.model_file import load_model_file
from planner.profiling.profiler import resolve_device

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.matmul.default}
SOFTMAX = {aten._softmax.default, aten._safe_softmax.default}


def main() -> None:
    args = _args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device("auto")
    mf = load_model_file(args.model)
    blocks = _blocks(mf, dev)[:args.blocks or None]
    variants = [Variant("torch.compile", functools.partial(_wrap, fqns=[], keep=None), None, compile_budget=None),
                Variant("blocks whole", functools.partial(_wrap, fqns=blocks, keep=None), None, compile_budget=None),
                Variant("blocks, keep matmuls and softmax", functools.partial(_wrap, fqns=blocks,
                                                                              keep=MATMULS | SOFTMAX), None,
                        compile_budget=None),
                Variant("blocks, keep matmuls", functools.partial(_wrap, fqns=blocks, keep=MATMULS), None,
                        compile_budget=None)]
    kept = []
    for v in variants:
        print(f"compiling {v.name} ...", file=sys.stderr)
        kept.append(_measure_peak(v, mf, dev, "adamw"))
    _time_round_robin(variants, kept, mf, dev, "adamw", args.repeats)
    plain = variants[0]
    print(f"`python benchmarks/compiled_policies.py {' '.join(sys.argv[1:])}` on {dev}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}; {len(blocks)} blocks "
          f"({', '.join(blocks)}); median of {args.repeats} shuffled rounds\n")
    print("| variant | peak bytes (measured) | CPU ms | recompute CPU ms (paired median) | against plain |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for v in variants:
        if v.error:
            print(f"| {v.name} | {v.error} | | | |")
            continue
        extra = f"{_paired_ms(v, plain):+.1f}" if v is not plain else ""
        wins = _paired_wins(v, plain) if v is not plain else ""
        print(f"| {v.name} | {v.peak_bytes} ({v.peak_bytes / MIB:.2f} MiB) | {statistics.median(v.cpu_ms):.1f} "
              f"| {extra} | {wins} |")


def _blocks(mf: Any, dev: torch.device) -> list[str]:
    """The model's repeated blocks, as remat finds them (one eager profile step)."""
    prof = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device=dev, steps=1)
    units = {u.id: u for u in prof.units}
    return sorted(units[b].fqn for b in repeated_blocks(units, unit_children(prof.units)))


def _wrap(model: torch.nn.Module, batch: Any, *, fqns: list[str], keep: set | None) -> str:
    """``fqns`` checkpointed: whole (``keep`` None), or keeping the outputs of the ops in ``keep``."""
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # the step remat's plans run (NOTE [ Step changes ], Rule 1)
    modules = dict(model.named_modules())
    for f in fqns:
        inner = modules[f].forward
        modules[f].forward = functools.partial(_checkpointed, inner, keep)
    if fqns:
        torch._functorch.config.cse = False  # as remat compiles checkpointed regions (read by peers._build)
    return ", ".join(fqns) or "-"


def _checkpointed(inner: Any, keep: set | None, *args: Any, **kwargs: Any) -> Any:
    if keep is None:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a model file (examples/gpt2.py)")
    p.add_argument("--blocks", type=int, default=0, help="checkpoint the first N repeated blocks (0: all)")
    p.add_argument("--repeats", type=int, default=11, help="timed rounds (one step per variant each)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    return p.parse_args()


if __name__ == "__main__":
    main()
