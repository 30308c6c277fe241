"""Memory-only compiles: inductor's CPU kernels bound to stand-ins, never built (NOTE [ Memory-only compiles ]).

Example::

    peak = peak_only(lambda: measure(plan), device)   # one compile, its fused C++ kernels not built
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# NOTE [ Memory-only compiles ]
#
# Two of the compiles ``remat plan --compile`` runs are measured for their memory only: the
# compiled profile's second compile (NOTE [ Compiled profile ], Rule 8, not timed) and each check
# of a compiled plan (NOTE [ The compiled plan is checked ], Rule 1). On the CPU most of such a
# compile's time is g++ building inductor's new fused kernels (docs/benchmarks.md, "Row 4"). The
# step's memory does not need them: inductor's generated wrapper allocates every buffer
# (``empty_strided_cpu``), frees it (``del``) and calls the extern kernels (matmuls, attention,
# fallbacks), which allocate through torch's CPU allocator, the one whose profiler events remat
# measures; a fused C++ kernel only reads and writes the buffers it is handed (its own scratch is
# ``malloc``'d, which those events never see). So in these compiles each C++ kernel
# (``AsyncCompile.cpp_pybinding``) is bound to a stand-in that zeroes the buffers the kernel
# would write (its pointer arguments without ``const``), and is never built:
# Rule 1. Same allocations. Every buffer, with its size and lifetime, is the real step's as long
#   as no shape or branch depends on a value the kernels compute. Under dynamo's defaults such a
#   dependence (``nonzero``, ``.item()``, a mixture of experts' routing) breaks the graph, and
#   eager code between the graphs sees the values; so a run whose compile broke a graph (a new
#   reason in dynamo's ``graph_break`` counter), or that ran with ``capture_scalar_outputs`` or
#   ``capture_dynamic_output_shape_ops`` on, is measured again with its kernels built. One kind
#   of break is let through: a side effect inside a higher-order op (``HOP: Unsafe side effect``:
#   Hugging Face's layers under a checkpoint mutate a context variable, 5 breaks a step on
#   examples/llama.py where remat's compiles cannot run it once, NOTE [ Side effects in a
#   checkpointed region ], Rule 3), where dynamo runs the checkpoint eagerly, its body reading the
#   values the stand-ins made without a break of its own (a checkpointed block that appends to a
#   list and indexes ``y[y > 0]`` records one break, the HOP's). So every checkpoint body run
#   eagerly inside is watched (``_bodies_watched``: a dispatch mode over its forward and its
#   recompute, not over its backward, where a mode would change how gradients accumulate, NOTE
#   [ Step as run ]): an op whose output shape or Python value depends on values (``nonzero``,
#   a boolean index, ``.item()``, ``one_hot`` without its class count; torch's
#   ``dynamic_output_shape`` and ``data_dependent_output`` tags) there means the run is measured
#   again built, and so does a HOP break where no checkpoint body ran eagerly (another
#   higher-order op) or where this torch's checkpoint cannot be watched. The two reads that
#   bypass the dispatcher, ``.tolist()`` and ``.numpy()`` (and ``np.asarray``, through it), are
#   watched by wrapping those methods of ``torch.Tensor`` while a body runs (``_host_reads``).
#   What the watch cannot see: a read through the storage's memory (``data_ptr``, DLPack) inside
#   such a body, and another higher-order op's side-effect break in a step whose checkpoints
#   broke too.
#   A run that raised (an extern op that refuses zeros: a Cholesky factor, a multinomial draw)
#   is measured again too.
# Rule 2. Zeros, not garbage. The stand-ins write zeros, so every value is finite and the same
#   each run: an index a kernel computes is in range, a ``GradScaler`` finds no inf and steps (the
#   optimizer's state is allocated as in the real step).
# Rule 3. Nothing outlives it. The FX graph and AOTAutograd caches are off inside (nothing is
#   written or read), the wrapper modules loaded inside are dropped from inductor's module cache
#   afterwards and dynamo is reset, so no later compile in the process (the user's, ``remat
#   verify --compile``) can run a stand-in. The model's buffers are put back as they were (a
#   stand-in zeroes a BatchNorm's running statistics where its kernel would update them).
# Rule 4. Scalar kernels. Inside, inductor writes each C++ kernel without its vectorized variant
#   (``cpp.simdlen`` 0): code the stand-ins never run. Inductor reads the vector ISA only when it
#   writes a kernel's C++; it fuses, plans and removes buffers before (the buffers a kernel keeps
#   local come from its scalar variant), so the wrapper allocates the same. Measured (a scratch
#   script, one process, one thread, the blocks checkpointed with their side effects once, NOTE
#   [ Side effects in a checkpointed region ]), the profile's second compile: examples/llama.py
#   40.2 s (the process's first) and 30.4 s scalar, 51.4 s vectorized; examples/gpt2.py 29.6 and
#   26.1 s scalar, 48.1 (the first) and 33.6 s vectorized; every phase peak equal to the byte.
#   Most of what is left is inductor's Python (sympy) over one graph of every layer's forward and
#   replay.
# Rule 5. CPU only. On CUDA the kernels are Triton's, built as before, and the device's peak is
#   measured as it runs. Under ``cpp_wrapper`` the wrapper is C++ and binds no stand-in: the
#   kernels are built (the same figure, at the old cost).

T = TypeVar("T")


def peak_only(measure: Callable[[], T], device: torch.device, model: torch.nn.Module | None = None,
              say: Callable[[str], None] | None = None) -> T:
    """``measure()`` (one compile and its measured steps) with inductor's CPU kernels unbuilt, or run again
    with them built where the stand-ins could have changed an allocation (Rule 1), saying why to ``say``;
    ``model``'s buffers are put back after the unbuilt run (Rule 3)."""
    if device.type != "cpu" or _values_make_shapes():  # Rules 1 and 5
        return measure()
    from planner.profiling.profiler import buffers_kept

    before, reads = _graph_breaks(), _Reads()
    try:
        with buffers_kept(model), unbuilt_kernels(), _bodies_watched(reads):
            result = measure()
    except Exception as e:  # noqa: BLE001 -- Rule 1: the step with its kernels built says what is wrong, if anything
        why = f"it raised {type(e).__name__.lstrip('_')} on the stand-ins' zeros"
    else:
        why = _why_built(before, _graph_breaks(), reads)
        if why is None:
            return result
    (say or (lambda _m: None))(f"measuring again with inductor's kernels built: {why}")
    return measure()


def _why_built(before: dict[str, int], after: dict[str, int], reads: _Reads) -> str | None:
    """Why a run on the stand-ins may not have allocated as the built step (Rule 1), or None."""
    if reads.ops:
        return f"a checkpoint run eagerly read values the stand-ins made ({', '.join(sorted(reads.ops))})"
    new = [why for why, n in after.items() if n > before.get(why, 0)]
    if any(HOP_SIDE_EFFECT not in why for why in new) or any(after.get(w, 0) < n for w, n in before.items()):
        return "a graph break lets the values it computes decide what runs"  # or its count was cleared: unknown
    if new and not reads.watched:
        return "a higher-order op broke the graph where this torch's checkpoints cannot be watched"
    if new and not reads.bodies:
        return "a higher-order op other than a checkpoint broke the graph"
    return None


@contextlib.contextmanager
def unbuilt_kernels() -> Iterator[None]:
    """Inside: every C++ kernel inductor binds is a stand-in that zeroes what it would write, written scalar
    (Rules 2-4)."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache

    before_paths = set(PyCodeCache.modules_no_attr)
    before_modules = len(PyCodeCache.modules)
    bind = AsyncCompile.cpp_pybinding
    AsyncCompile.cpp_pybinding = _stand_in_binding  # type: ignore[method-assign]
    try:
        with torch._inductor.config.patch({"fx_graph_cache": False, "cpp.simdlen": 0}), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            yield
    finally:
        AsyncCompile.cpp_pybinding = bind  # type: ignore[method-assign]
        for path in set(PyCodeCache.modules_no_attr) - before_paths:
            del PyCodeCache.modules_no_attr[path]
        del PyCodeCache.modules[before_modules:]
        torch._dynamo.reset()


def _stand_in_binding(_self: Any, argtypes: list[str], _source_code: str) -> Callable[..., None]:
    """The stand-in for one kernel: zeroes its written buffers (pointer arguments without ``const``)."""
    written = [i for i, t in enumerate(argtypes) if t.strip().endswith("*") and not t.strip().startswith("const")]

    def kernel(*args: Any) -> None:
        for i in written:
            args[i].zero_()

    return kernel


def _values_make_shapes() -> bool:
    """Whether dynamo may put a value into a shape inside one graph (Rule 1)."""
    cfg = torch._dynamo.config
    return bool(cfg.capture_scalar_outputs or cfg.capture_dynamic_output_shape_ops)


HOP_SIDE_EFFECT = "HOP: Unsafe side effect"
"""The one graph-break reason let through, its eagerly run checkpoints watched (Rule 1)."""


def _graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process: {reason: count}."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


class _Reads:
    """What the watched checkpoint bodies did (Rule 1): ``ops`` read values, ``bodies`` ran, ``watched`` could be."""

    def __init__(self) -> None:
        self.ops: set[str] = set()
        self.bodies, self.watched = 0, False


class _ValueReads(TorchDispatchMode):
    """Records, into ``reads``, each op whose output shape or Python value depends on its inputs' values."""

    def __init__(self, reads: _Reads) -> None:
        super().__init__()
        self.reads = reads

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # a compiled call inside runs compiled (never under a stand-in)
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if _reads_values(func, args):
            self.reads.ops.add(str(func.overloadpacket).removeprefix("aten."))
        return func(*args, **(kwargs or {}))


def _reads_values(func: Any, args: tuple) -> bool:
    """Whether ``func`` on ``args`` gives a shape or a Python value from values (torch's op tags, Rule 1)."""
    tags = func.tags
    if torch.Tag.data_dependent_output in tags:
        return True
    if torch.Tag.dynamic_output_shape not in tags:
        return False
    name = func.overloadpacket.__name__
    if name == "index":  # an integer index's shape is its own; a boolean mask's is its count of trues
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if name == "one_hot":
        return (args[1] if len(args) > 1 else -1) < 0  # no class count: the largest value decides
    return True


@contextlib.contextmanager
def _bodies_watched(reads: _Reads) -> Iterator[None]:
    """Inside: each ``torch.utils.checkpoint`` body run eagerly (both variants) runs, forward and recompute,
    under ``_watching`` (Rule 1); ``reads.watched`` says whether this torch's checkpoint could be."""
    from torch.utils import checkpoint as cp

    generator = getattr(cp, "_checkpoint_without_reentrant_generator", None)
    function = getattr(cp, "CheckpointFunction", None)
    names = list(inspect.signature(generator).parameters)[:5] if generator is not None else []
    if function is None or names != ["fn", "preserve_rng_state", "context_fn", "determinism_check", "debug"]:
        yield
        return

    def watched_generator(fn: Any, preserve: bool = True, context_fn: Any = cp.noop_context_fn, *rest: Any,
                          **kwargs: Any) -> Any:
        if _tracing():  # a compile tracing the checkpoint (AOTAutograd), not a body run eagerly
            return generator(fn, preserve, context_fn, *rest, **kwargs)
        if len(rest) > 1 and rest[1]:  # debug=True (checkpoint passes it positionally) takes no context
            reads.watched = False
            return generator(fn, preserve, context_fn, *rest, **kwargs)
        reads.bodies += 1
        return generator(fn, preserve, _with_watch(context_fn, reads), *rest, **kwargs)

    class WatchedFunction:
        @staticmethod
        def apply(run: Callable[..., Any], preserve: bool, *args: Any) -> Any:
            if _tracing():
                return function.apply(run, preserve, *args)
            reads.bodies += 1
            return function.apply(_watched_call(run, reads), preserve, *args)

    reads.watched = True
    cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = watched_generator, WatchedFunction
    try:
        yield
    finally:
        cp._checkpoint_without_reentrant_generator, cp.CheckpointFunction = generator, function


def _tracing() -> bool:
    """Whether a compile is tracing what runs now (dynamo, or AOTAutograd's proxy or fake tensors)."""
    key = torch._C._TorchDispatchModeKey
    return torch.compiler.is_compiling() or any(torch._C._get_dispatch_mode(k) is not None
                                                for k in (key.PROXY, key.FAKE))


def _with_watch(context_fn: Callable[[], tuple[Any, Any]], reads: _Reads) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` whose forward and recompute contexts also watch (``_bodies_watched``)."""

    @contextlib.contextmanager
    def and_watched(context: Any) -> Iterator[None]:
        with context, _watching(reads):
            yield

    def contexts() -> tuple[Any, Any]:
        forward, recompute = context_fn()
        return and_watched(forward), and_watched(recompute)

    return contexts


def _watched_call(run: Callable[..., T], reads: _Reads) -> Callable[..., T]:
    """``run`` under ``_watching`` (a reentrant checkpoint's forward and recompute, not its backward)."""

    @functools.wraps(run)
    def watched(*args: Any, **kwargs: Any) -> T:
        with _watching(reads):
            return run(*args, **kwargs)

    return watched


@contextlib.contextmanager
def _watching(reads: _Reads) -> Iterator[None]:
    """Inside: every read of values a body can make is recorded into ``reads``, through the dispatcher
    (``_ValueReads``) or around it (``_host_reads``) (Rule 1)."""
    with _ValueReads(reads), _host_reads(reads):
        yield


HOST_READS = ("tolist", "numpy")
"""The methods of ``torch.Tensor`` that hand its values to Python without a dispatched op (Rule 1)."""


@contextlib.contextmanager
def _host_reads(reads: _Reads) -> Iterator[None]:
    """Inside: each of ``HOST_READS`` called on a tensor is recorded into ``reads`` (Rule 1)."""
    before = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}

    def recorded(name: str) -> Callable[..., Any]:
        method = getattr(torch.Tensor, name)

        @functools.wraps(method)
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads.ops.add(name)
            return method(self, *args, **kwargs)

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, recorded(name))
    try:
        yield
    finally:
        for name, was in before.items():
            if was is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, was)


__all__ = ["HOP_SIDE_EFFECT", "peak_only", "unbuilt_kernels"]
