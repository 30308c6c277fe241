"""The CLI's options for pipeline stages and tensor parallelism (``--pp``, ``--schedule``,
``--micro-batches``, ``--tp``) and their check before any profiling (docs/distributed.md).

Example::

    check_parallel(ParallelOptions.model_construct(pp=2, micro_batches=4, world_size=1, sharding="none"),
                   frozenset())                                  # a pipeline of 2 stages: fine
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

import typer
from pydantic import BaseModel, model_validator

from planner.errors import BadInput
from planner.options import COUNTS


def _option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


PIPELINE = [
    _option("pp", Annotated[int | None, typer.Option(
        "--pp", max=COUNTS["pp"][1], show_default=False, help="Pipeline stages, one rank each (torch.distributed.pipelining): one plan "
                                         "per stage; example_inputs() is one data-parallel replica's batch.")], None),
    _option("schedule", Annotated[str, typer.Option(
        "--schedule", help="With --pp: the pipeline schedule, 1f1b, gpipe or interleaved-1f1b (with "
                           "--stages-per-rank).")], "1f1b"),
    _option("stages_per_rank", Annotated[int, typer.Option(
        "--stages-per-rank", max=COUNTS["stages_per_rank"][1], help="With --schedule interleaved-1f1b: stages each of the --pp ranks holds (V >= 2; "
                                  "the layers split over pp x V stages, stage s on rank s % pp).")], 1),
    _option("micro_batches", Annotated[int, typer.Option(
        "--micro-batches", max=COUNTS["micro_batches"][1], help="With --pp: micro-batches the replica's batch is split into.")], 1),
    _option("tp", Annotated[int, typer.Option(
        "--tp", max=COUNTS["tp"][1], help="Tensor-parallel ranks sharing each layer (DTensor, column/row-wise attention and MLP): the "
                     "plan is every rank's, made on the rank-local model.")], 1),
    _option("sequence_parallel", Annotated[bool, typer.Option(
        "--sequence-parallel", help="With --tp: shard the sequence between blocks (SequenceParallel norms, "
                                    "all-gathered block inputs, reduce-scattered outputs).")], False),
]
"""``remat plan``'s options for NOTE [ Pipeline stages ] and NOTE [ Tensor-parallel ranks ]."""


class ParallelOptions(BaseModel):
    """The fields of ``PIPELINE`` on ``remat plan``'s options model; its ``_ranks`` check replaces the
    data-parallel one (``RankOptions._ranks``) and runs before any profiling."""

    pp: int | None = None
    schedule: str = "1f1b"
    micro_batches: int = 1
    stages_per_rank: int = 1
    tp: int = 1
    sequence_parallel: bool = False

    @model_validator(mode="after")
    def _ranks(self) -> Any:
        check_parallel(self, self.given)
        typed = {name for name in self.given if getattr(self, name, None) or name in PIPELINE_ONLY}  # 0 is no "off"
        check_honoured(self.pp, self.tp, typed | ({"shapes"} if len(self.shapes) > 1 else set()))
        return self


# NOTE [ Options a layout honours ]
# Pipeline stages and tensor-parallel ranks are planned by their own paths (planner/act/pipeline.py,
# planner/act/tensor_parallel.py), which take fewer of ``remat plan``'s options than one process does.
# An option such a path would drop is refused before any profiling, in one line naming it: a plan
# made without an option the user typed must never look like one made with it. Extend the table
# when a path learns an option; tests/test_cli_layouts.py runs every row.
NOT_HONOURED: dict[str, dict[str, str]] = {
    "pipeline stages": {"offload": "host memory per stage is not modelled",
                        "host_memory": "host memory per stage is not modelled",
                        "compile": "stages are profiled eagerly",
                        "shapes": "a stage is planned for one batch shape"},
    "tensor parallelism": {"offload": "host memory per rank is not modelled",
                           "host_memory": "host memory per rank is not modelled",
                           "compile": "the rank-local model is profiled eagerly"},
}
"""Per layout: the options its path does not honour yet, and why (NOTE [ Options a layout honours ])."""

PIPELINE_ONLY = ("schedule", "micro_batches", "stages_per_rank")
"""Options that only mean something with ``--pp``."""


def check_honoured(pp: int | None, tp: int, typed: set[str]) -> None:
    """``BadInput`` for an option in ``typed`` (those the user gave, with a value that is not off) that the
    layout of ``pp`` and ``tp`` would silently drop (NOTE [ Options a layout honours ])."""
    if pp is None:
        for name in PIPELINE_ONLY:
            if name in typed:
                raise BadInput(f"{{{name}}} is a pipeline option: add {{pp}} N (stages), or drop it",
                               options=(name, "pp"))
    layouts = [what for what, on in (("pipeline stages", pp is not None), ("tensor parallelism", tp > 1)) if on]
    for what in layouts:
        for name, why in NOT_HONOURED[what].items():
            if name in typed:
                if name == "shapes":
                    raise BadInput(f"several {{batch}}/{{seq_len}} sizes with {what} are not planned yet ({why}): "
                                   f"give one of each", options=("batch", "seq_len"))
                raise BadInput(f"{{{name}}} with {what} is not planned yet ({why}): drop it, or plan one process",
                               options=(name,))


def check_parallel(o: Any, given: Any) -> None:
    """Data-parallel ranks (``planner.act.api.check_ranks``), or pipeline stages and tensor-parallel ranks
    (``planner.options.check_layout``) of options ``o`` (``ParallelOptions``' fields, with ``world_size`` and
    ``sharding``); ``given``: the options typed (the world size counts only then)."""
    from planner.act.api import check_ranks
    from planner.options import check_layout

    if o.pp is None and o.tp == 1 and not o.sequence_parallel:
        check_ranks(o.world_size, o.sharding)
    else:
        check_layout(o.pp, o.schedule, o.micro_batches, o.world_size if "world_size" in given else None, o.sharding,
                     tp=o.tp, sequence_parallel=o.sequence_parallel, stages_per_rank=o.stages_per_rank)


__all__ = ["NOT_HONOURED", "PIPELINE", "PIPELINE_ONLY", "ParallelOptions", "check_honoured", "check_parallel"]
