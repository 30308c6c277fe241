"""The step options every entry point takes (sharding, amp, optimizer, pipeline stages): their names, and one
check each.

The library, the profiler and the CLI all validate through these, so an option means the same
everywhere and is refused with the same message. Torch-free to import (an optimizer spec is read
with torch, in planner/optimizers.py).

Example::

    parse_sharding("FSDP")                    # 'fsdp'; BadInput naming the choices otherwise
"""

from __future__ import annotations

from typing import Any, Literal

from planner.errors import BadInput
from planner.model.fields import MAX_GRAD_ACCUM, MAX_THREADS, MAX_WORLD_SIZE
from solvers.contract import SHARDINGS, Sharding
from solvers.pipeline import SCHEDULES

Amp = Literal["bf16", "fp16"]
OptimizerName = str
"""An optimizer spec: 'adamw', 'sgd:momentum=0', 'adafactor', a dotted path (NOTE [ Optimizer specs ])."""
_AMP_ALIASES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
_NO_AMP = ("", "none", "off")


# NOTE [ Counts have ceilings ]
#
# Rule 1. Every count a caller gives (timing steps, threads, candidate levels, ranks, stages,
#   micro-batches) lies between the lowest and the highest value ``COUNTS`` gives it. The specs
#   check it (``check_count``), the CLI declares each option's min and max from the same table,
#   so an absurd count is one line before anything runs.
# Rule 2. A ceiling is far above any real use (10,000 timing steps, 4,096 threads) and never above
#   what the files accept (NOTE [ Numbers in files ]): a plan made must be a plan that loads.
# Why: ``remat profile --steps 99999999999999999999`` timed 54,613 steps in 120 s and ran on for
# ever, --granularity of 20 digits hung the planner without a line, --threads 3000000000 ended as
# "internal error: ValueError: Overflow when unpacking long", and --grad-accum 1e20 or
# --world-size 1e20 --sharding ddp as a five-line pydantic ValidationError (the latter after planning).

MAX_STEPS = 10_000
"""Timing (and warm-up) steps: unit times are medians, which 10,000 steps pin down many times over."""
MAX_GRANULARITY = 256
"""Candidate levels below the repeated blocks: deeper than any module tree (each level is one deeper)."""

COUNTS: dict[str, tuple[int, int]] = {
    "steps": (1, MAX_STEPS), "warmup_steps": (0, MAX_STEPS), "threads": (1, MAX_THREADS),
    "granularity": (0, MAX_GRANULARITY), "world_size": (1, MAX_WORLD_SIZE), "grad_accum": (1, MAX_GRAD_ACCUM),
    "tp": (1, MAX_WORLD_SIZE), "pp": (2, MAX_WORLD_SIZE), "micro_batches": (1, MAX_GRAD_ACCUM),
    "stages_per_rank": (1, MAX_WORLD_SIZE),
}
"""Per count, its lowest and highest value (NOTE [ Counts have ceilings ])."""


def check_count(name: str, value: Any) -> None:
    """``BadInput`` unless ``value`` is an integer (not a bool) within ``COUNTS[name]`` (NOTE [ Counts have
    ceilings ]); the message names the count as ``{name}``, which the CLI words as its flag."""
    low, high = COUNTS[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise BadInput(f"{name} must be an integer >= {low}, got {value!r}", options=(name,))
    check_ceiling(name, value)


def check_ceiling(name: str, value: int) -> None:
    """``BadInput`` when the integer ``value`` is above ``COUNTS[name]``'s highest (NOTE [ Counts have ceilings ])."""
    low, high = COUNTS[name]
    if value > high:
        raise BadInput(f"{{{name}}} {value} is above the most remat takes, {high:,}; give {low} to {high}",
                       options=(name,))


def parse_sharding(value: str) -> Sharding:
    """``value`` as a ``Sharding`` (any case); ``BadInput`` if it is none of them."""
    v = value.strip().lower() if isinstance(value, str) else value
    if v not in SHARDINGS:
        raise BadInput(f"unknown sharding {value!r}; choose none, ddp or fsdp")
    return v  # type: ignore[return-value]


def parse_amp(value: str | None) -> Amp | None:
    """'bf16'/'bfloat16' -> 'bf16', 'fp16'/'float16' -> 'fp16'; None, '', 'none', 'off' -> None."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _NO_AMP):
        return None
    amp = _AMP_ALIASES.get(value.strip().lower()) if isinstance(value, str) else None
    if amp is None:
        raise BadInput(f"unknown amp {value!r}; use bf16, fp16 or none")
    return amp  # type: ignore[return-value]


def parse_optimizer(value: str) -> OptimizerName:
    """``value`` as a canonical optimizer spec (planner/optimizers.py, which imports torch when
    called); ``BadInput`` naming the accepted names otherwise."""
    from planner.optimizers import parse_optimizer as parse

    return parse(value)


def parse_fraction(value: Any, field: str, *, below: float = 0.5) -> float:
    """'0.5%' or '0.005' (or the number) -> 0.005, at least 0 and under ``below`` (one half); ``BadInput`` naming
    ``field`` otherwise (NaN too)."""
    t = str(value).strip()
    try:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(value)
        fraction = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise BadInput(f"{{{field}}} {value!r} is not a fraction; use e.g. 0.5% or 0.005", options=(field,)) from None
    if not 0 <= fraction < below:
        raise BadInput(f"{{{field}}} {value!r} must be at least 0% and below {below:.0%}", options=(field,))
    return fraction


def parse_headroom(value: Any) -> float | None:
    """The part of a budget kept free: None or 'auto' (None: ``planner.act.api.headroom_for`` decides), else
    ``parse_fraction`` ('2%', 0.02)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    return parse_fraction(value, "headroom")


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


def check_layout(stages: Any, schedule: str, micro_batches: Any, world_size: int | None = None,
                 sharding: str = "none", *, tp: Any = 1, sequence_parallel: bool = False, stages_per_rank: Any = 1) -> None:
    """Pipeline stages (``stages`` None: none) and tensor parallelism (``tp``) settings that are bad
    whatever the model, each one line naming the fix (``BadInput``)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise BadInput(f"tp must be an integer >= 1, got {tp!r}", options=("tp",))
    check_ceiling("tp", tp)
    if sequence_parallel and tp == 1:
        raise BadInput("{sequence_parallel} shards the sequence over tensor-parallel ranks: add {tp} N (N >= 2), or "
                       "drop it", options=("sequence_parallel", "tp"))
    if stages is not None:
        _check_stages(stages, schedule, micro_batches)
    _check_interleaved(stages, schedule, micro_batches, stages_per_rank, (world_size or tp * (stages or 1)) // tp,
                       sharding)
    ranks = tp * (stages or 1)
    what = f"pp {stages} and tp {tp}" if stages else f"tp {tp}"
    dp, rest = divmod(world_size or ranks, ranks)
    if rest:
        raise BadInput(f"world size {world_size} is not tp x pp x dp with {what}: give {{world_size}} a multiple "
                       f"of {ranks} (dp = world size / {ranks}), e.g. {ranks}", options=("world_size",))
    if stages is None and sharding == "ddp":
        raise BadInput("tensor parallelism with DDP beside it is not planned: DDP does not take the DTensor parameters "
                       "of a tensor-parallel layer; use {sharding} fsdp (FSDP2 over the data-parallel ranks)",
                       options=("sharding",))
    if stages is None and dp == 1 and sharding != "none":
        raise BadInput(f"{{sharding}} {sharding} needs data-parallel ranks beside the {tp} tensor-parallel ones: give "
                       f"{{world_size}} a multiple of {tp} above it (dp = world size / {tp}), or drop {{sharding}}",
                       options=("world_size", "sharding"))
    if dp > 1 and sharding == "none":
        how = "{sharding} fsdp or ddp" if stages else "{sharding} fsdp (FSDP2)"
        raise BadInput(f"world size {world_size} is {what} x dp {dp}: say how the {dp} data-parallel ranks "
                       f"{'of each stage ' if stages else ''}train, {how}", options=("sharding",))


def _check_stages(stages: Any, schedule: str, micro_batches: Any) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise BadInput(f"pp must be an integer >= 2 (stages), got {stages!r}; drop {{pp}} for one stage",
                       options=("pp",))
    if schedule not in SCHEDULES:
        raise BadInput(f"unknown schedule {schedule!r}; choose one of: {', '.join(SCHEDULES)}", options=("schedule",))
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise BadInput(f"micro-batches must be an integer >= 1, got {micro_batches!r}", options=("micro_batches",))
    check_ceiling("pp", stages)
    check_ceiling("micro_batches", micro_batches)


def _check_interleaved(stages: Any, schedule: str, micro_batches: int, per_rank: Any, tp_groups: int,
                       sharding: str) -> None:
    """``--stages-per-rank`` V and interleaved-1f1b (NOTE [ Interleaved stages ], Rules 1 and 8), one line each;
    ``tp_groups``: the world size over tp (pp x dp)."""
    if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 1:
        raise BadInput(f"stages-per-rank must be an integer >= 1, got {per_rank!r}", options=("stages_per_rank",))
    check_ceiling("stages_per_rank", per_rank)
    if per_rank > 1 and schedule != "interleaved-1f1b":
        raise BadInput(f"{{stages_per_rank}} {per_rank} puts several stages on a rank, which only interleaved-1f1b "
                       f"runs: add {{schedule}} interleaved-1f1b, or drop it", options=("stages_per_rank", "schedule"))
    if schedule != "interleaved-1f1b" or stages is None:
        return
    if per_rank < 2:
        raise BadInput("interleaved-1f1b runs several stages on each rank: add {stages_per_rank} V (V >= 2)",
                       options=("stages_per_rank",))
    rounds = max(1, micro_batches // stages)
    if micro_batches % rounds:
        fits = [m for m in range(stages, 4 * stages + 1) if m % max(1, m // stages) == 0]
        raise BadInput(f"interleaved-1f1b with pp {stages} needs micro-batches a multiple of max(1, M // pp) = {rounds}; "
                       f"{micro_batches} is not: give {{micro_batches}} e.g. {', '.join(map(str, fits[:6]))}",
                       options=("micro_batches",))
    if tp_groups > stages:
        raise BadInput(f"interleaved-1f1b is planned without data-parallel ranks for now (world size pp x tp): drop "
                       f"{{world_size}}, or use {{schedule}} 1f1b with {{sharding}} "
                       f"{sharding if sharding != 'none' else 'fsdp'}", options=("world_size", "schedule", "sharding"))


def check_model_fit(num_layers: int, stages: int, micro_batches: int, rows: int, per_rank: int = 1) -> None:
    """Pipeline settings the model or its batch cannot take (``BadInput``); ``stages`` ranks of ``per_rank``."""
    if stages * per_rank > num_layers:
        if per_rank > 1:
            raise BadInput(f"pp {stages} x stages-per-rank {per_rank} = {stages * per_rank} stages is more than the "
                           f"model's {num_layers} layers: give {{stages_per_rank}} {num_layers // stages} or fewer "
                           f"(or a smaller {{pp}})", options=("stages_per_rank", "pp"))
        raise BadInput(f"pp {stages} is more stages than the model's {num_layers} layers: give {{pp}} {num_layers} "
                       f"or fewer", options=("pp",))
    if rows % micro_batches:
        fits = [m for m in range(1, rows + 1) if rows % m == 0]
        raise BadInput(f"{micro_batches} micro-batches do not divide the batch of {rows} rows: give "
                       f"{{micro_batches}} one of {', '.join(map(str, fits))}", options=("micro_batches",))


__all__ = ["Amp", "COMPILE_BACKENDS", "COUNTS", "MAX_GRANULARITY", "MAX_STEPS", "check_ceiling", "check_count",
           "check_layout", "check_model_fit", "compile_backend",
           "OptimizerName", "parse_amp", "parse_compile", "parse_fraction", "parse_headroom", "parse_optimizer",
           "parse_sharding"]
