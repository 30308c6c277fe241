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


__all__ = ["Amp", "OPTIMIZER_NAMES", "OptimizerName", "parse_amp", "parse_optimizer", "parse_sharding"]
