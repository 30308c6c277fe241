"""Memory-only compiles: inductor's CPU kernels bound to stand-ins, never built (NOTE [ Memory-only compiles ]).

Example::

    peak = peak_only(lambda: measure(plan), device)   # one compile, its fused C++ kernels not built
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

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
#   Hugging Face's layers under ``apply_plan``'s checkpoint mutate a context variable, 5 breaks a
#   step on examples/llama.py), where dynamo runs the checkpoint eagerly. KNOWN HOLE: the eager
#   body reads values the stand-ins made, and a value-dependent op inside it records no break of
#   its own (a checkpointed block that appends to a list and indexes ``y[y > 0]``: one break, the
#   HOP's), so a mixture of experts routed inside such a region would be measured on zeros'
#   routing; to be closed before CPU plans of such models are trusted. A run that raised (an
#   extern op that refuses zeros: a Cholesky factor, a multinomial draw) is measured again too.
# Rule 2. Zeros, not garbage. The stand-ins write zeros, so every value is finite and the same
#   each run: an index a kernel computes is in range, a ``GradScaler`` finds no inf and steps (the
#   optimizer's state is allocated as in the real step).
# Rule 3. Nothing outlives it. The FX graph and AOTAutograd caches are off inside (nothing is
#   written or read), the wrapper modules loaded inside are dropped from inductor's module cache
#   afterwards and dynamo is reset, so no later compile in the process (the user's, ``remat
#   verify --compile``) can run a stand-in. The model's buffers are put back as they were (a
#   stand-in zeroes a BatchNorm's running statistics where its kernel would update them).
# Rule 4. CPU only. On CUDA the kernels are Triton's, built as before, and the device's peak is
#   measured as it runs. Under ``cpp_wrapper`` the wrapper is C++ and binds no stand-in: the
#   kernels are built (the same figure, at the old cost).

T = TypeVar("T")


def peak_only(measure: Callable[[], T], device: torch.device, model: torch.nn.Module | None = None,
              say: Callable[[str], None] | None = None) -> T:
    """``measure()`` (one compile and its measured steps) with inductor's CPU kernels unbuilt, or run again
    with them built where the stand-ins could have changed an allocation (Rule 1), saying why to ``say``;
    ``model``'s buffers are put back after the unbuilt run (Rule 3)."""
    if device.type != "cpu" or _values_make_shapes():  # Rules 1 and 4
        return measure()
    before = _graph_breaks()
    try:
        with _buffers_kept(model), unbuilt_kernels():
            result = measure()
    except Exception as e:  # noqa: BLE001 -- Rule 1: the step with its kernels built says what is wrong, if anything
        why = f"it raised {type(e).__name__.lstrip('_')} on the stand-ins' zeros"
    else:
        after = _graph_breaks()
        new = [why for why, n in after.items() if n > before.get(why, 0)]
        if all(HOP_SIDE_EFFECT in why for why in new) and all(after.get(w, 0) >= n for w, n in before.items()):
            return result
        why = "a graph break lets the values it computes decide what runs"  # or its count was cleared: unknown
    (say or (lambda _m: None))(f"measuring again with inductor's kernels built: {why}")
    return measure()


@contextlib.contextmanager
def unbuilt_kernels() -> Iterator[None]:
    """Inside: every C++ kernel inductor binds is a stand-in that zeroes what it would write (Rules 2-3)."""
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codecache import PyCodeCache

    before_paths = set(PyCodeCache.modules_no_attr)
    before_modules = len(PyCodeCache.modules)
    bind = AsyncCompile.cpp_pybinding
    AsyncCompile.cpp_pybinding = _stand_in_binding  # type: ignore[method-assign]
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), \
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
"""The one graph-break reason let through (Rule 1, and its known hole)."""


def _graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks so far in this process: {reason: count}."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


@contextlib.contextmanager
def _buffers_kept(model: torch.nn.Module | None) -> Iterator[None]:
    """``model``'s buffers as they were, afterwards (Rule 3)."""
    kept = [(b, b.detach().clone()) for b in model.buffers()] if model is not None else []
    try:
        yield
    finally:
        with torch.no_grad():
            for b, copy in kept:
                b.copy_(copy)


__all__ = ["HOP_SIDE_EFFECT", "peak_only", "unbuilt_kernels"]
