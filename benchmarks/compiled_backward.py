"""Where a compiled step's backward reaches its peak, with a given checkpoint set (issue #24).

    python benchmarks/compiled_backward.py examples/llama.py model.layers.0,model.layers.1,model.layers.2
    python benchmarks/compiled_backward.py --zoo qwen2 model.layers.0,model.layers.2 model.layers.0
    python benchmarks/compiled_backward.py examples/llama.py model.layers.0,model.layers.2 --no-peak-memory-reorder

For each checkpoint set (comma-separated module FQNs, checkpointed as ``apply_plan`` does): compile
the step (inductor, one thread, the step changes ``apply_plan`` installs), run one step under the CPU
profiler with memory events and the step's marks, and print

1. the CPU allocator's running bytes over the backward, static memory added, as ``phase_peaks``
   (NOTE [ Compiled profile ], Rule 5) counts them: the peak, where it falls (the fraction of the
   backward's time), and the running bytes at each change of kernel (inductor's kernels are
   profiled by name, ``cpp.enable_kernel_profile``);
2. the partitioned backward graph's own liveness, before inductor: each storage alive from the node
   that makes it (a saved tensor: from the start) to its last reader, gradients to the end; the
   highest bytes of each run of nodes of one module (``F:`` a replayed forward node, ``B:`` a
   backward node), static memory not added.

The first is what the compiled profile's probes must cover; the second is what the cost model's
held and recomputed terms mirror. Sets are compiled afresh each (no AOT or FX graph cache).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="examples/llama.py")
    p.add_argument("sets", nargs="+", help="checkpoint sets: module FQNs joined by commas ('' for none)")
    p.add_argument("--zoo", default="", metavar="NAME", help="a zoo model (benchmarks/zoo_models.py, FULL size)")
    p.add_argument("--no-peak-memory-reorder", action="store_true",
                   help="turn off inductor's reorder_for_peak_memory pass (on by default in torch 2.13)")
    args = p.parse_args()
    if args.zoo:  # the positional model is then the first set
        args.sets = [args.model, *args.sets]
    from benchmarks.compiled import _zoo_model
    from planner.profiling import profile
    from planner.profiling.model_file import load_model_file

    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64
    torch._inductor.config.cpp.enable_kernel_profile = True
    torch._inductor.config.reorder_for_peak_memory = not args.no_peak_memory_reorder
    mf = _zoo_model(args.zoo) if args.zoo else load_model_file(args.model)
    eager = profile(mf.build_model(), mf.example_inputs(), loss_fn=mf.loss_fn, device="cpu", steps=1, threads=1)
    s = eager.step
    static = s.params_bytes + s.buffers_bytes + s.optimizer_bytes + s.batch_bytes
    for arg in args.sets:
        fqns = [f for f in arg.split(",") if f]
        prof, graphs = _compiled_step(mf, fqns)
        print(f"checkpointed: {', '.join(fqns) or 'nothing'}")
        _print_running_bytes(prof, static)
        _print_graph_liveness(graphs.backward(0))


def _compiled_step(mf: Any, fqns: list[str]) -> tuple[Any, Any]:
    """(the profiler of one steady-state step, the captured graphs) of ``mf``'s model compiled with ``fqns``
    checkpointed, as ``measure_compiled`` compiles and runs it."""
    from planner.profiling.compiled import checkpointing
    from planner.profiling.compiled_graphs import capturing
    from planner.profiling.measure import _profiled, make_optimizer, make_step
    from planner.profiling.step_changes import find_step_changes, install

    model = mf.build_model()
    changes = find_step_changes(model)
    if changes:
        install(model, changes, say=False)
    model.train()
    opt = make_optimizer("adamw", model)
    torch._dynamo.reset()
    with capturing("inductor") as (compiler, graphs), checkpointing(model, fqns):
        run = make_step(torch.compile(model, backend=compiler), mf.example_inputs(), loss_fn=mf.loss_fn, optimizer=opt)
        run()
        run()  # steady state: the optimizer state exists

        def mark(name: str, _value: Any = None) -> None:
            with torch.profiler.record_function("remat::mark::" + name):
                pass

        prof, _ms = _profiled(lambda: run(mark))
    torch._dynamo.reset()
    return prof, graphs


def _events(prof: Any) -> tuple[dict[str, int], list[tuple[int, str]], list[tuple[int, int, int]]]:
    """(marks by name, (start ns, name) of the kernels and aten ops, (ns, ptr, bytes) of CPU allocations)."""
    from torch._C._profiler import _EventType

    marks, ops, allocs = {}, [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            if node.extra_fields.device.type == "cpu":
                allocs.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name.startswith("remat::mark::"):
            marks[node.name[len("remat::mark::"):]] = node.start_time_ns
        elif "cpp_fused" in node.name or (node.name.startswith("aten::") and not _in_aten_op(node)):
            ops.append((node.start_time_ns, node.name))
    return marks, sorted(ops), sorted(allocs)


def _in_aten_op(node: Any) -> bool:
    """Whether an aten op runs inside another (``aten::resolve_conj`` inside ``aten::mm``): only the outer one
    names the kernel."""
    parent = node.parent
    return parent is not None and parent.name.startswith("aten::")


def _print_running_bytes(prof: Any, static_bytes: int) -> None:
    """Running allocator bytes over the backward; blocks freed that the step did not allocate are skipped,
    as ``cpu_allocations`` skips them (NOTE [ Blocks from before the run ])."""
    import bisect

    marks, ops, allocs = _events(prof)
    lo, hi = marks["backward_start"], marks["backward_end"]
    starts = [t for t, _ in ops]
    alive, running, rows, peak = set(), static_bytes, [], (0, 0.0, "")
    for t, ptr, nbytes in allocs:
        if nbytes < 0 and ptr not in alive:
            continue
        (alive.add if nbytes > 0 else alive.discard)(ptr)
        running += nbytes
        if lo <= t <= hi:
            i = bisect.bisect_left(starts, t)
            op = ops[i][1] if i < len(ops) else "?"
            frac = (t - lo) / (hi - lo)
            if not rows or rows[-1][2] != op:
                rows.append((frac, running, op))
            if running > peak[0]:
                peak = (running, frac, op)
    print(f"  backward peak {peak[0]} B at {peak[1]:.3f} of the backward's time, before {peak[2]}")
    for frac, nbytes, op in rows:
        print(f"    {frac:6.3f} {nbytes:>11} {op[:100]}")


def _print_graph_liveness(bw: torch.fx.GraphModule) -> None:
    from planner.profiling.compiled_graphs import _nbytes, is_view, storage_owner

    nodes = list(bw.graph.nodes)
    last: dict[torch.fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[storage_owner(a)] = len(nodes) if n.op == "output" else max(last.get(storage_owner(a), -1), i)
    live: dict[torch.fx.Node, int] = {}
    running, runs = 0, []
    for i, n in enumerate(nodes):
        if n.op in ("placeholder", "call_function") and not is_view(n) and storage_owner(n) is n and _nbytes(n):
            live[n] = _nbytes(n)
            running += live[n]
        where = _module_of(n)
        if runs and runs[-1][0] == where:
            runs[-1][2], runs[-1][3] = max(runs[-1][2], running), i
        else:
            runs.append([where, i, running, i])
        for o in [o for o in live if last.get(o, -1) <= i]:
            running -= live.pop(o)
    print("  partitioned backward graph, live bytes per module run (nodes first-last: highest bytes, module):")
    for where, first, top, final in runs:
        if where != "?":
            print(f"    {first:5d}-{final:5d} {top:>11} {where}")


def _module_of(n: torch.fx.Node) -> str:
    for key, tag in (("nn_module_stack", "F"), ("fwd_nn_module_stack", "B")):
        stack = n.meta.get(key)
        if stack:
            v = list(stack.values())[-1]
            path = v[0] if isinstance(v, tuple) else str(v)
            for junk in ("L['self'].", "inner.__self__.", "module.", ".forward", "']"):
                path = path.replace(junk, "")
            return f"{tag}:{path.replace('._modules[' + chr(39), '.')}"
    return "?"


if __name__ == "__main__":
    main()
