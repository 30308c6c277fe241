"""A CPU with less memory: profile a model file in a child process whose address space is capped.

``remat plan --device cpu --device-memory 150MiB model.py`` lands here (CUDA caps itself with
``torch.cuda.set_per_process_memory_fraction``, in ``planner.profiling.memsafe``). The child builds the
model, caps its address space so that at most the given bytes remain for the model's tensors,
and runs ``planner.profiling.memsafe.profile_within``: a step that needs more fails as it would on a
smaller machine (``RuntimeError: DefaultCPUAllocator: can't allocate memory``).

Example::

    prof = profile_capped("model.py", step=StepSpec(device="cpu", device_memory_bytes=150 << 20))
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

from planner.children import die_with_parent, how_it_ended, quiet_on_ctrl_c, run_child, temp_dir
from planner.errors import ProfileError, RematError
from planner.files import atomic_write_text
from planner.spec import StepSpec

# NOTE [ CPU memory cap ]
#
# PyTorch's CPU allocator has no limit of its own, so the kernel enforces one: RLIMIT_AS caps
# the process's virtual address space. Three things make address space track tensor bytes:
#   - the limit is set after the model, its inputs and every library are loaded, at the
#     address space in use then, plus the cap, less the bytes of the tensors that already
#     exist (parameters, buffers, the batch: they count as device memory);
#   - glibc is told to serve every allocation above 64 KiB with its own mmap, returned on free
#     (MALLOC_MMAP_THRESHOLD_; by default the threshold grows and freed blocks stay in the heap),
#     and to keep one arena (MALLOC_ARENA_MAX: each new thread's arena would reserve 64 MiB);
#   - the intra-op threads are started, and the CPU profiler and the fake-tensor pass run once
#     on a toy tensor, before the limit: their code and thread stacks are not the step's;
#   - a fixed allowance (OVERHEAD_ALLOWANCE_BYTES) is left on top of the cap for what profiling
#     a step allocates besides tensors: the CPU profiler's event buffers (it records every
#     allocation), autograd nodes, Python objects. Measured: 70 MiB on llama8 (8 layers).
# These are environment variables read when the process starts, hence a child process.
# So the cap is approximate, to the allowance: docs/benchmarks.md measures how many tensor bytes
# fit under a cap (benchmarks/memory_safe.py --cap-check).

MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc settings for the child (NOTE [ CPU memory cap ])."""

OVERHEAD_ALLOWANCE_BYTES = 80 * 2**20
"""Address space the cap leaves for what a profiled step allocates besides tensors: the CPU
profiler's event buffers, autograd nodes, Python objects (about 70 MiB for
benchmarks/models/llama8.py; see NOTE [ CPU memory cap ])."""


def profile_capped(model_path: str | Path, *, step: StepSpec, quiet: bool = False) -> Any:
    """Profile ``model_path`` on the CPU in a child process capped at ``step.device_memory_bytes``; the
    model file gives the loss (``step`` has none), ``step`` the optimizer, amp, steps and threads.

    Returns the ``schema.Profile`` (memory-safe when the step did not fit). The child's
    progress goes to this process's stderr unless ``quiet``.

    Raises:
        ProfileError: with the child's message, when it failed.
    """
    from planner.model.schema import Profile

    device_memory_bytes = step.device_memory_bytes
    with temp_dir("capped") as tmp:  # NOTE [ Signals and children ], Rule 5
        out = Path(tmp) / "profile.json"
        cmd = [sys.executable, "-m", "planner.profiling.capped", str(Path(model_path).resolve()), str(out),
               "--device-memory", str(device_memory_bytes), "--optimizer", step.optimizer, "--steps", str(step.steps),
               "--warmup-steps", str(step.warmup_steps)]
        if step.recipe.amp:
            cmd += ["--amp", step.recipe.amp]
        if step.threads:
            cmd += ["--threads", str(step.threads)]
        if quiet:
            cmd.append("--quiet")
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, **MALLOC_ENV,
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        rc = run_child(cmd, env=env)  # ended with remat, NOTE [ Signals and children ]
        if rc == NOT_WRITTEN:
            raise ProfileError(f"profiling within {device_memory_bytes} bytes: the capped profiling process could not "
                               f"write its result into remat's temporary folder {Path(tmp).parent} ({_free(tmp)}): "
                               f"free some space there, or point TMPDIR at a folder with room")
        data = json.loads(out.read_text()) if out.exists() else None
        if rc != 0 or data is None or "error" in data:
            why = (", as the kernel's out-of-memory killer does: free memory on this machine, or profile without "
                   "{device_memory_bytes}") if rc == -signal.SIGKILL else \
                (": the model's code or a library it calls ended it (os._exit, a crash); profile without "
                 "{device_memory_bytes} to see where")
            message = (data or {}).get("error") or f"the capped profiling process {how_it_ended(rc)} before it " \
                                                   f"wrote a profile{why}"
            raise ProfileError(f"profiling within {device_memory_bytes} bytes: {message}",
                               options=tuple(data.get("options", ())) if data else ("device_memory_bytes",))
        return Profile.model_validate(data)


# NOTE [ A temporary folder that is full ]
#
# The capped child hands its profile (or its error) to remat through a file in remat's temporary folder (TMPDIR, else
# /tmp). When that folder is full (or a file size limit, ``ulimit -f``, stops the write), the child's write failed with a 17-line traceback and remat blamed the model:
# "the capped profiling process exited with status 1 before it wrote a profile: the model's code or a library it
# calls ended it (os._exit, a crash)" (round 19 probe, TMPDIR on an 8 KiB tmpfs). The child exits ``NOT_WRITTEN``
# instead, saying nothing, and remat says one line naming the folder, its free bytes, the file size limit when there
# is one, and the fix (exit 2).

NOT_WRITTEN = 75
"""The capped child's status when it cannot write its result (EX_TEMPFAIL of sysexits.h)."""


def _free(folder: str) -> str:
    """The free bytes of ``folder``'s file system and this process's file size limit, which the child inherits."""
    import shutil

    try:
        free = f"{shutil.disk_usage(folder).free} bytes free"
    except OSError as e:
        free = e.strerror or str(e)
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return free if soft == resource.RLIM_INFINITY else f"{free}; files are limited to {soft} bytes, ulimit -f"


def cap_address_space(device_memory_bytes: int, existing_bytes: int, *,
                      allowance_bytes: int = OVERHEAD_ALLOWANCE_BYTES) -> int:
    """Cap this process's address space: what is mapped now, plus ``device_memory_bytes`` less
    ``existing_bytes`` (tensors already allocated that count as device memory), plus
    ``allowance_bytes`` for what is not tensors. Returns the limit."""
    limit = vm_size_bytes() + device_memory_bytes - existing_bytes + allowance_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and limit > hard:
        limit = hard
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def vm_size_bytes() -> int:
    """This process's virtual memory size (VmSize of /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise ProfileError("cannot read VmSize from /proc/self/status: the CPU memory cap needs Linux")


def prepare() -> None:
    """Load and start, before the cap, what the step uses but is not the step's memory."""
    import torch

    from planner.profiling.meta import profile_meta  # noqa: F401  (the fake-tensor pass's imports)
    from planner.profiling.measure import measure_step

    x = torch.ones(1 << 16)
    measure_step(lambda: (x * 2).sum(), "cpu")  # intra-op threads, the CPU profiler
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        (torch.ones(4, requires_grad=True) * 2).sum().backward()


def _child(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m planner.profiling.capped")
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--device-memory", type=int, required=True)
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=1)
    p.add_argument("--amp", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        prof = _profile_child(args)
    except RematError as e:
        return _written(out, json.dumps({"error": e.template, "options": e.options}), e.exit_code)  # worded by the caller
    except MemoryError:
        return _written(out, json.dumps({"error": "out of memory outside the step (Python's own allocations); raise "
                                               "{device_memory_bytes}", "options": ["device_memory_bytes"]}),
                        ProfileError.exit_code)
    return _written(out, prof.model_dump_json(), 0)  # the parent never reads half a profile


def _written(out: Path, text: str, status: int) -> int:
    """``status`` once ``text`` is in ``out``; ``NOT_WRITTEN`` when it cannot be written (NOTE [ A temporary folder
    that is full ])."""
    try:
        atomic_write_text(out, text)
    except OSError:  # WriteFailed: the folder is full, or gone
        return NOT_WRITTEN
    return status


def _profile_child(args: argparse.Namespace) -> Any:
    from planner.model.schema import Recipe
    from planner.profiling.memsafe import profile_within
    from planner.profiling.model_file import load_model_file
    from planner.profiling.tracker import iter_tensors, storage_bytes

    say = (lambda _m: None) if args.quiet else (lambda m: print(f"  [capped] {m}", file=sys.stderr, flush=True))
    prepare()
    mf = load_model_file(args.model)
    model = mf.build_model()
    inputs = mf.example_inputs()
    existing = storage_bytes([*model.parameters(), *model.buffers(), *iter_tensors(inputs)])
    if existing >= args.device_memory:
        raise ProfileError(f"the model's parameters, buffers and batch take {existing} bytes, more than the "
                           f"device memory of {args.device_memory} bytes")
    limit = cap_address_space(args.device_memory, existing)
    say(f"address space capped at {limit} bytes ({args.device_memory - existing} bytes left for the step)")
    step = StepSpec(device="cpu", device_memory_bytes=args.device_memory, loss_fn=mf.loss_fn, optimizer=args.optimizer,
                    steps=args.steps, warmup_steps=args.warmup_steps, recipe=Recipe(amp=args.amp), threads=args.threads)
    return profile_within(model, inputs, step=step, progress=say)


if __name__ == "__main__":
    die_with_parent()
    quiet_on_ctrl_c()  # NOTE [ Signals and children ], Rule 8
    sys.exit(_child(sys.argv[1:]))


__all__ = ["cap_address_space", "MALLOC_ENV", "NOT_WRITTEN", "OVERHEAD_ALLOWANCE_BYTES", "prepare", "profile_capped",
           "vm_size_bytes"]
