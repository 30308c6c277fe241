"""The step options every entry point takes (sharding, amp, optimizer): their names, and one check each.

The library, the profiler and the CLI all validate through these, so an option means the same
everywhere and is refused with the same message. Torch-free.

Example::

    parse_sharding("FSDP")                    # 'fsdp'; BadInput naming the choices otherwise
"""

from __future__ import annotations

from typing import Literal, get_args

from planner.errors import BadInput
from solvers.contract import SHARDINGS, Sharding

Amp = Literal["bf16", "fp16"]
OptimizerName = Literal["adamw", "adam", "sgd", "none"]

OPTIMIZER_NAMES: tuple[str, ...] = get_args(OptimizerName)
_AMP_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
_NO_AMP = ("", "none", "off")


def parse_sharding(value: str) -> Sharding:
    """``value`` as a ``Sharding`` (any case); ``BadInput`` if it is none of them."""
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in SHARDINGS:
        raise BadInput(f"unknown sharding {value!r}; choose none, ddp or fsdp")
    return v  # type: ignore[return-value]


def parse_amp(value: str | None) -> Amp | None:
    """'bf16'/'bfloat16' -> 'bf16', 'fp16'/'float16' -> 'fp16'; None, '', 'none', 'off' -> None."""
    if value is None or value.strip().lower() in _NO_AMP:
        return None
    amp = _AMP_ALIASES.get(value.strip().lower())
    if amp is None:
        raise BadInput(f"unknown amp {value!r}; use bf16, fp16 or none")
    return amp  # type: ignore[return-value]


def parse_optimizer(value: str) -> OptimizerName:
    """``value`` as an ``OptimizerName`` (any case); ``BadInput`` if it is none of them."""
    v = value.strip().lower()
    if v not in OPTIMIZER_NAMES:
        raise BadInput(f"unknown optimizer {value!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")
    return v  # type: ignore[return-value]



COMPILE_BACKENDS = ("inductor",)
"""torch.compile backends whose partition remat reads (NOTE [ Compiled profile ] in planner/profiling/compiled.py)."""


def parse_compile(value: str | None) -> str | None:
    """A torch.compile backend remat can profile, or None (eager); ``BadInput`` naming the choices otherwise."""
    if value is None:
        return None
    if value not in COMPILE_BACKENDS:
        raise BadInput(f"compile backend {value!r} is not supported; choose one of {', '.join(COMPILE_BACKENDS)}",
                       options=("compile_backend",))
    return value


def compile_backend(compile: bool, backend: str, given: frozenset[str] | set[str] = frozenset()) -> str | None:
    """The backend ``--compile`` and ``--compile-backend`` ask for (None: eager); ``BadInput`` when the backend
    is unknown, or given (in ``given``) without ``--compile``."""
    if "compile_backend" in given and not compile:
        raise BadInput("{compile_backend} chooses the backend of --compile: add --compile, or drop it",
                       options=("compile_backend", "compile"))
    return parse_compile(backend) if compile else None


__all__ = ["Amp", "COMPILE_BACKENDS", "compile_backend", "OPTIMIZER_NAMES", "OptimizerName", "parse_amp", "parse_compile",
           "parse_optimizer", "parse_sharding"]
