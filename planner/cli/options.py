"""The remat command's options: one typed model per command, and the typer parameters that fill it.

Each command declares its parameters once, as groups shared between commands (the step to
measure, the Hugging Face source, the training recipe, the ranks, the output switches), and
receives them as one frozen options model, validated there once: sharding, amp and optimizer
are ``Literal`` fields checked by ``planner.options``. A field's error names the field as
``{name}`` (``RematError.options``); ``FLAGS`` words it as the flag the user typed.

Example::

    o = PlanOptions(model=Path("model.py"), budget="12GB", given=frozenset()); o.step_spec(), o.solve_spec
"""

from __future__ import annotations

import inspect
import itertools
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator

from planner.errors import BadInput
from planner.files import as_output
from planner.model.schema import Recipe
from planner.cli.parallel import PIPELINE, ParallelOptions
from planner.optimizers import check_impl
from planner.options import (COUNTS, Amp, OptimizerName, Sharding, compile_backend, parse_amp, parse_fraction, parse_headroom,
                             parse_optimizer, parse_sharding)
from planner.spec import SolveSpec, StepSpec

DEVICES = ("auto", "cpu", "cuda", "meta")

DEVICE_MEMORY_ENV = "REMAT_DEVICE_MEMORY"
"""Environment variable read when --device-memory is not given."""


def _param(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default, annotation=annotation)


def bounds(name: str) -> dict[str, int]:
    """typer's ``min`` and ``max`` of the count option ``name``, from ``COUNTS`` (NOTE [ Counts have ceilings ])."""
    low, high = COUNTS[name]
    return {"min": low, "max": high}


def _model_arg(help_text: str) -> inspect.Parameter:
    return _param("model", Annotated[Path | None, typer.Argument(help=help_text, metavar="MODEL.py",
                                                                 show_default=False)], None)


MODEL_HELP = "model.py defining build_model() and example_inputs(); optional with --profile."

OUTPUT_SWITCHES = [
    _param("as_json", Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout, not tables.")],
           False),
    _param("quiet", Annotated[bool, typer.Option("--quiet", "-q", help="Only the result: no logs or progress on "
                                                                      "stderr.")], False),
    _param("debug", Annotated[bool, typer.Option("--debug", help="Show the full traceback of any error.")], False),
]

BUDGET = _param("budget", Annotated[str | None, typer.Option(
    "--budget", "-b", help="Memory budget: 12GB, 12GiB, 800MiB, 1.5e9 (GB = GiB). Default with --target: the "
                           "target's usable memory.", show_default=False)], None)
PROFILE = _param("profile", Annotated[Path | None, typer.Option(
    "--profile", help="Use a saved profile: nothing is run.")], None)
GRANULARITY = _param("granularity", Annotated[int, typer.Option(
    "--granularity", **bounds("granularity"), help="Candidate levels below the repeated blocks (0 = blocks).")], 0)
SOLVERS = _param("solvers", Annotated[str | None, typer.Option(
    "--solvers", help="Comma-separated solvers to run (default: the optimal one, sqrt-greedy, sqrt); the "
                      "baselines none, all, every-2/3/4 always run.", show_default=False)], None)
STEPS = _param("steps", Annotated[int, typer.Option(
    "--steps", **bounds("steps"), help="Training steps measured (after a warm-up step).")], 3)
THREADS = _param("threads", Annotated[int | None, typer.Option(
    "--threads", **bounds("threads"), show_default=False,
    help="torch intra-op threads for the measured steps (default: torch's). On the CPU every figure is "
         "the thread's CPU time at one thread, which other processes on the machine do not change; above "
         "one thread it is scaled by the step's measured wall-to-CPU ratio at N threads.")], None)
DEVICE = _param("device", Annotated[str, typer.Option(
    "--device", help="Where to run the step: auto (cuda if available, else cpu), cpu, cuda[:N], meta.")], "auto")
COMPILE = [_param("compile", Annotated[bool, typer.Option("--compile", help="The step as torch.compile(model) runs it "
                                                                          "(apply the plan, then compile).")], False),
           _param("compile_backend", Annotated[str, typer.Option("--compile-backend", help="inductor.")], "inductor")]


HEADROOM = _param("headroom", Annotated[str, typer.Option(
    "--headroom", help="Part of the budget kept free, for what the cost model cannot see: 0.5%, 2% or a "
                       "fraction such as 0.01; auto: from the zoo's evidence, by how the profile was made (0.5% "
                       "measured, 1.5% under autocast, 7% on --device meta). plan, compare and frontier keep the "
                       "same.")], "auto")


WHY = _param("why", Annotated[bool, typer.Option(
    "--why", help="One line per candidate unit: why it is checkpointed or not (from the cost model: the peak "
                  "without or with it, bytes freed per ms of recompute, ties, exclusions).")], False)


OFFLOAD = _param("offload", Annotated[bool, typer.Option(
    "--offload", help="Each unit may also move its saved tensors to host memory (keep, recompute or offload, chosen "
                      "together by the ILP); with frontier: the three-way frontier.")], False)
HOST_MEMORY = _param("host_memory", Annotated[str | None, typer.Option(
    "--host-memory", help="Host memory offloaded tensors may take (with --offload): 64GB, 0.5TiB. Default: 80% of "
                          "this machine's available memory; required with --device meta.")], None)


def _time_limit(default: float, help_text: str) -> inspect.Parameter:
    return _param("time_limit_s", Annotated[float, typer.Option("--time-limit", min=0.001, help=help_text)], default)


def _output(help_text: str) -> inspect.Parameter:
    return _param("output", Annotated[str | None, typer.Option("--output", "-o", metavar="PATH", help=help_text)],
                  None)  # a str: Options._output_path sees a trailing '/' before pathlib drops it


HF_SOURCE = [
    _param("hf", Annotated[Path | None, typer.Option(
        "--hf", help="A Hugging Face config.json (or its folder) instead of MODEL.py: the model of its "
                     "architectures (or --task) with the library's defaults, on a random batch of --batch rows "
                     "of --seq-len tokens (or images of the config's size).", show_default=False)], None),
    _param("batch", Annotated[str | None, typer.Option(
        "--batch", show_default=False,
        help="Rows per batch (with --hf; with MODEL.py, passed to example_inputs(batch=N)). Several, as 4,8: "
             "remat plan makes one plan per shape in one file (a bucketed plan).")], None),
    _param("seq_len", Annotated[str | None, typer.Option(
        "--seq-len", show_default=False,
        help="Tokens per row (with --hf, text models; with MODEL.py, passed to example_inputs(seq_len=N)). "
             "Several, as 128,256,512: a bucketed plan, one plan per length.")], None),
    _param("task", Annotated[str | None, typer.Option(
        "--task", help="With --hf: causal-lm, seq2seq, masked-lm or classification; default: the config's "
                       "architectures.", show_default=False)], None),
]

MEASURED_STEP = [
    DEVICE,
    _param("device_memory", Annotated[str | None, typer.Option(
        "--device-memory", envvar=DEVICE_MEMORY_ENV, show_default=False,
        help=f"Memory the device may use (12GB, 150MiB; env {DEVICE_MEMORY_ENV}): a step that does not fit is "
             "profiled with its candidates checkpointed (a memory-safe profile). CUDA: a per-process cap; "
             "CPU: profiled in a child process whose address space is capped.")], None),
    _param("target", Annotated[str | None, typer.Option(
        "--target", show_default=False,
        help="Device spec (remat devices; aliases, any case): --device meta models times for it; without "
             "--budget, the budget is its usable memory.")], None),
    _param("amp", Annotated[str | None, typer.Option(
        "--amp", show_default=False,
        help="Mixed precision: bf16 or fp16 (torch.autocast around forward and loss; with --device meta, "
             "for the target). Default: the model's own dtype.")], None),
    _param("optimizer", Annotated[str, typer.Option(
        "--optimizer", help="Optimizer whose state and step are counted in the peak: adamw, adam, sgd (momentum 0.9), none, "
        "any torch.optim class by name with settings that move memory (sgd:momentum=0, RMSprop:centered=True), "
        "adafactor (transformers') or module.Class of your own Optimizer.")], "adamw"),
    STEPS,
    THREADS,
    *COMPILE,
]

RECIPE = [
    _param("grad_accum", Annotated[int, typer.Option(
        "--grad-accum", **bounds("grad_accum"), help="Micro-batches per optimizer step (gradient accumulation); the plan is for "
                                    "the worst one, with the earlier ones' gradients alive.")], 1),
    _param("zero_grad_set_to_none", Annotated[bool, typer.Option(
        "--zero-grad-set-to-none/--no-zero-grad-set-to-none",
        help="optimizer.zero_grad(set_to_none=...): PyTorch's default frees the gradients; --no-... keeps them "
             "(zeroed) alive all step.")], True),
    _param("clip_grad_norm", Annotated[float | None, typer.Option(
        "--clip-grad-norm", show_default=False,
        help="clip_grad_norm_(max_norm) before the optimizer step; its temporaries count at the step.")], None),
    _param("keep_output", Annotated[bool, typer.Option(
        "--keep-output", help="The loop holds the model's output (the logits) through backward: outputs = "
                              "model(**batch); outputs.loss.backward(), Hugging Face's loop.")], False),
    _param("fused", Annotated[bool, typer.Option("--fused", help="The optimizer with fused=True.")], False),
    _param("foreach", Annotated[bool, typer.Option("--foreach", help="The optimizer with foreach=True.")], False),
]

RANKS = [
    _param("world_size", Annotated[int, typer.Option(
        "--world-size", **bounds("world_size"), help="Data-parallel ranks; the budget and the peak are per rank (> 1 needs "
                                    "--sharding ddp or fsdp). See docs/distributed.md.")], 1),
    _param("sharding", Annotated[str, typer.Option(
        "--sharding", help="How the ranks hold the model: none (one process), ddp (a full replica plus gradient "
                           "buckets), fsdp (FSDP2 on every block and the root: sharded, all-gathered per block).")],
           "none"),
]




def _flag(p: inspect.Parameter) -> str | None:
    for meta in getattr(p.annotation, "__metadata__", ()):
        decls = [d for d in (getattr(meta, "param_decls", None) or ()) if d.startswith("--")]
        if getattr(meta, "default", ...) not in (..., None) and str(meta.default).startswith("--"):
            decls.insert(0, str(meta.default))  # typer.Option("--json", ...): the first name is its "default"
        if decls:
            return decls[0].split("/")[0]
    return None


def _cli_flags(*groups: list[inspect.Parameter]) -> dict[str, str]:
    return {p.name: flag for group in groups for p in group if (flag := _flag(p)) is not None}


# ----------------------------------------------------------------------------- the models


def _parse_device(value: Any) -> str:
    v = str(value).strip().lower()
    if v in DEVICES or (v.startswith("cuda:") and v[5:].isdigit()):
        return v
    raise BadInput(f"{{device}}: unknown device {value!r}; choose one of {', '.join(DEVICES)} or cuda:N "
                   f"(meta: no memory used, times modelled)", options=("device",))


def _naming(field: str, parse: Any) -> Any:
    """``parse`` with its ``BadInput`` prefixed by the field (worded as the CLI's flag)."""

    def check(value: Any) -> Any:
        try:
            return parse(value)
        except BadInput as e:
            raise BadInput(f"{{{field}}}: {e.worded({})}", options=(field,)) from None

    return check


class Options(BaseModel):
    """What every command takes: the output switches."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    as_json: bool = False
    quiet: bool = False
    debug: bool = False
    given: frozenset[str] = frozenset()
    """Fields the user typed on the command line (not defaults, not environment variables)."""

    @field_validator("output", "plot", "model", "plan", "profile", "path", "hf", mode="before", check_fields=False)
    @classmethod
    def _path(cls, value: Any, info: ValidationInfo) -> Path | None:  # NOTE [ Paths are the user's, not the model file's ]
        if value is None or info.field_name not in ("output", "plot"):
            return None if value is None else Path(value).absolute()
        example = "frontier.png" if info.field_name == "plot" else "out.json"
        return as_output(value, example).absolute()  # NOTE [ Writing output files ], Rule 7


class HfSource(BaseModel):
    """A Hugging Face config instead of a model file, and the batch shapes to make (with either)."""

    hf: Path | None = None
    batch: list[int] | None = None
    seq_len: list[int] | None = None
    task: str | None = None

    @field_validator("batch", "seq_len", mode="before")
    @classmethod
    def _sizes(cls, value: Any, info: Any) -> list[int] | None:
        """'128,256,512' -> [128, 256, 512]: each a positive integer, each once."""
        if value is None or isinstance(value, list):
            return value
        sizes = [part.strip() for part in str(value).split(",")]
        if not all(p.isdigit() and int(p) >= 1 for p in sizes):
            raise BadInput(f"{{{info.field_name}}} {value!r}: give positive integers separated by commas, e.g. "
                           f"128 or 128,256,512", options=(info.field_name,))
        return sorted(set(map(int, sizes)))

    @property
    def shapes(self) -> list[dict[str, int]]:
        """The ``example_inputs`` keyword arguments of every batch shape asked for (every ``batch`` with
        every ``seq_len``), smallest first; ``[{}]`` when neither is given."""
        keys = [(k, v) for k, v in (("batch", self.batch), ("seq_len", self.seq_len)) if v]
        return [dict(zip([k for k, _ in keys], combo)) for combo in itertools.product(*(v for _, v in keys))]


class StepOptions(Options, HfSource):
    """The training step to measure (or to plan on a saved profile's)."""

    model: Path | None = None
    device: str = "auto"
    device_memory: str | None = None
    target: str | None = None
    amp: Amp | None = None
    optimizer: OptimizerName = "adamw"
    steps: int = 3
    threads: int | None = None
    compile: bool = False
    compile_backend: str = "inductor"
    grad_accum: int = 1
    zero_grad_set_to_none: bool = True
    clip_grad_norm: float | None = None
    fused: bool = False
    foreach: bool = False
    keep_output: bool = False

    @field_validator("amp", mode="before")
    @classmethod
    def _amp(cls, value: Any) -> Amp | None:
        return _naming("amp", parse_amp)(value)

    @field_validator("optimizer", mode="before")
    @classmethod
    def _optimizer(cls, value: Any) -> OptimizerName:
        return _naming("optimizer", parse_optimizer)(value)

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> str:
        return _parse_device(value)

    @model_validator(mode="after")
    def _step(self) -> StepOptions:
        compile_backend(self.compile, self.compile_backend, self.given)
        if self.fused and self.foreach:
            raise BadInput("{fused} and {foreach} are two implementations of one optimizer: give one of them",
                           options=("fused", "foreach"))
        if self.fused or self.foreach:
            check_impl(self.optimizer, "fused" if self.fused else "foreach")
        if self.clip_grad_norm is not None and not 0 < self.clip_grad_norm < math.inf:
            raise BadInput(f"{{clip_grad_norm}} must be a positive, finite max norm, got {self.clip_grad_norm:g}; "
                           f"drop it for a step without clipping",
                           options=("clip_grad_norm",))
        return self

    @property
    def recipe(self) -> Recipe:
        """The training step the options describe."""
        impl = "fused" if self.fused else "foreach" if self.foreach else "default"
        return Recipe(grad_accum=self.grad_accum, zero_grad_set_to_none=self.zero_grad_set_to_none, amp=self.amp,
                      clip_grad_norm=self.clip_grad_norm, optimizer_impl=impl, keep_output=self.keep_output)

    def step_spec(self, *, device_memory_bytes: int | None = None) -> StepSpec:
        """The ``planner.spec.StepSpec`` the options describe (the model file gives the loss): its
        ``target`` only for ``--device meta`` (elsewhere ``--target`` is the default budget's device)."""
        return StepSpec(device=self.device, target=self.target if self.device == "meta" else None,
                        device_memory_bytes=device_memory_bytes, optimizer=self.optimizer, recipe=self.recipe,
                        steps=self.steps, threads=self.threads,
                        compile=compile_backend(self.compile, self.compile_backend))


class ProfileOptions(StepOptions):
    output: Path | None = None


class RankOptions(BaseModel):
    world_size: int = 1
    sharding: Sharding = "none"

    @field_validator("sharding", mode="before")
    @classmethod
    def _sharding(cls, value: Any) -> Sharding:
        return _naming("sharding", parse_sharding)(value)

    @model_validator(mode="after")
    def _ranks(self) -> RankOptions:
        from planner.act.api import check_ranks

        check_ranks(self.world_size, self.sharding)  # before any profiling
        return self


class OffloadOptions(StepOptions, RankOptions):
    """``--offload`` and ``--host-memory`` (``remat plan`` and ``remat frontier``)."""

    profile: Path | None = None
    offload: bool = False
    host_memory: str | None = None

    @model_validator(mode="after")
    def _offload(self) -> OffloadOptions:
        """The offload options that need no profile, checked before any profiling."""
        from planner.act.offload_plan import check_offload_options

        check_offload_options(self.offload, self.host_memory, world_size=self.world_size, sharding=self.sharding,
                              n_shapes=len(self.shapes), meta=self.device == "meta" and self.profile is None,
                              compiled=self.compile)
        return self


class PlanOptions(ParallelOptions, OffloadOptions):
    budget: str | None = None
    output: Path | None = None
    solver: str = "auto"
    granularity: int = 0
    time_limit_s: float = 60.0
    no_selective: bool = False
    headroom: float | None = None
    why: bool = False

    @model_validator(mode="after")
    def _offload_solver(self) -> PlanOptions:
        from planner.act.offload_plan import OFFLOAD_SOLVERS

        if self.offload and self.solver not in OFFLOAD_SOLVERS:
            raise BadInput(f"solver {self.solver!r} has no offload choice: use {{solver}} auto or ilp with {{offload}}",
                           options=("solver", "offload"))
        return self

    @field_validator("solver")
    @classmethod
    def _solver(cls, name: str) -> str:
        from solvers import available

        if name not in available():
            raise BadInput(f"unknown solver {name!r}; choose one of: {', '.join(available())}")
        return name

    @field_validator("headroom", mode="before")
    @classmethod
    def _headroom(cls, text: Any) -> float | None:
        return parse_headroom(text)

    @property
    def solve_spec(self) -> SolveSpec:
        """The ``planner.spec.SolveSpec`` the options describe."""
        return SolveSpec(solver=self.solver, granularity=self.granularity, time_limit_s=self.time_limit_s,
                         world_size=self.world_size, sharding=self.sharding, headroom=self.headroom,
                         selective=not self.no_selective, offload=self.offload, host_memory=self.host_memory)


class SweepOptions(OffloadOptions):
    granularity: int = 0
    solvers: list[str] | None = None
    time_limit_s: float = 30.0
    headroom: float | None = None

    @field_validator("headroom", mode="before")
    @classmethod
    def _headroom(cls, text: Any) -> float | None:
        return parse_headroom(text)

    @field_validator("solvers", mode="before")
    @classmethod
    def _solvers(cls, text: Any) -> list[str] | None:
        """``--solvers a,b``: validated names, baselines dropped (they always run); None: the default set."""
        from planner.act.frontier import BASELINES
        from solvers import available

        if text is None or isinstance(text, list):
            return text
        names = [n.strip().lower() for n in text.split(",") if n.strip()]
        if not names:
            raise BadInput("{solvers}: give at least one solver name, e.g. {solvers} dp,sqrt", options=("solvers",))
        for n in names:
            if n not in available() and n not in BASELINES:
                raise BadInput(f"{{solvers}}: unknown solver {n!r}; choose from: {', '.join(available())}",
                               options=("solvers",))
        return [n for n in dict.fromkeys(names) if n not in BASELINES]


class FrontierOptions(SweepOptions):
    points: int = 12
    plot: Path | None = None
    output: Path | None = None


class CompareOptions(SweepOptions):
    budget: str | None = None
    time_limit_s: float = 60.0


class VerifyOptions(Options, HfSource):
    model: Path | None = None
    plan: Path | None = None
    steps: int = 3
    threads: int | None = None
    device: str = "auto"
    tolerance: float = 0.02
    compile: bool = False
    compile_backend: str = "inductor"

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> str:
        return _parse_device(value)

    @field_validator("tolerance", mode="before")
    @classmethod
    def _tolerance(cls, value: Any) -> float:
        return parse_fraction(value, "tolerance")


class ShowOptions(Options):
    path: Path
    why: bool = False
    profile: Path | None = None


# ----------------------------------------------------------------------------- each command's parameters

PLAN = [
    _model_arg(MODEL_HELP), BUDGET,
    _output("Write the plan here (atomic). Without it nothing is written."),
    _param("solver", Annotated[str, typer.Option("--solver", help="auto, dp, ilp, sqrt, sqrt-greedy, all, every-2 "
                                                                  "or none.")], "auto"),
    *MEASURED_STEP, PROFILE, GRANULARITY,
    _time_limit(60.0, "Seconds the ILP may search; then its best plan is kept."),
    _param("no_selective", Annotated[bool, typer.Option(
        "--no-selective", help="Whole modules only: no op-level (selective) checkpointing policies.")], False),
    OFFLOAD, HOST_MEMORY,
    HEADROOM, WHY, *RANKS, *PIPELINE, *HF_SOURCE, *RECIPE, *OUTPUT_SWITCHES,
]
PROFILE_CMD = [
    _model_arg("model.py defining build_model() and example_inputs(); or use --hf."),
    _output("Write the profile here (atomic). Without it nothing is written."),
    *MEASURED_STEP, *HF_SOURCE, *RECIPE, *OUTPUT_SWITCHES,
]
MAX_POINTS = 1000
"""The most budgets a frontier sweeps: more than a plot shows, and every solver plans at each (the ILP up to
--time-limit): --points 100000 ran on for hours."""

FRONTIER = [
    _model_arg(MODEL_HELP),
    _param("points", Annotated[int, typer.Option(
        "--points", min=1, max=MAX_POINTS, help="Budgets swept, evenly spaced from the lowest feasible peak to the "
                                                "peak without checkpointing.")], 12),
    _param("plot", Annotated[str | None, typer.Option(
        "--plot", metavar="PATH", help="Draw the trade-off to this PNG, SVG or PDF, by its suffix (needs: pip install 'remat\\[plot]').")], None),
    _output("Write the points as JSON here (atomic)."),
    PROFILE, *MEASURED_STEP, GRANULARITY, SOLVERS,
    _time_limit(30.0, "Seconds the ILP may search at each budget."), HEADROOM, OFFLOAD, HOST_MEMORY,
    *RANKS, *HF_SOURCE, *RECIPE, *OUTPUT_SWITCHES,
]
COMPARE = [
    _model_arg(MODEL_HELP), BUDGET, PROFILE, *MEASURED_STEP, GRANULARITY, SOLVERS,
    _time_limit(60.0, "Seconds the ILP may search at each budget."), HEADROOM,
    *RANKS, *HF_SOURCE, *RECIPE, *OUTPUT_SWITCHES,
]
SHOW = [_param("path", Annotated[Path, typer.Argument(help="A plan or profile JSON file.", metavar="FILE")]), WHY,
        _param("profile", Annotated[Path | None, typer.Option(
            "--profile", help="With --why: the profile the plan was made on.")], None),
        *OUTPUT_SWITCHES]
VERIFY = [
    _model_arg("model.py the plan was made for (with --hf: the plan)."),
    _param("plan", Annotated[Path | None, typer.Argument(help="The plan file to check.", metavar="PLAN.json",
                                                         show_default=False)], None),
    STEPS, THREADS, DEVICE, *COMPILE, *HF_SOURCE,
    _param("tolerance", Annotated[str, typer.Option(
        "--tolerance", help="Largest |predicted - measured| / measured peak before verify fails: 2%, 0.5% or a "
                            "fraction such as 0.02.")], "2%"),
    *OUTPUT_SWITCHES,
]
DEVICES_CMD = [*OUTPUT_SWITCHES]

FLAGS = {**_cli_flags(PLAN, PROFILE_CMD, FRONTIER, COMPARE, VERIFY), "device_memory_bytes": "--device-memory"}
"""Field (and library parameter) name -> the flag this command line spells it as: how a ``RematError``'s
``options`` are worded for the user."""


__all__ = ["bounds", "BUDGET", "COMPARE", "COMPILE", "CompareOptions", "DEVICE", "DEVICE_MEMORY_ENV",
           "DEVICES", "DEVICES_CMD", "FLAGS", "FRONTIER", "FrontierOptions", "GRANULARITY", "HEADROOM",
           "HF_SOURCE", "HfSource", "MEASURED_STEP", "MODEL_HELP", "Options",
           "OUTPUT_SWITCHES", "PLAN", "PlanOptions", "PROFILE", "PROFILE_CMD", "ProfileOptions",
           "RankOptions", "RANKS", "RECIPE", "SHOW", "ShowOptions", "SOLVERS", "StepOptions", "STEPS",
           "SweepOptions", "THREADS", "VERIFY", "VerifyOptions", "WHY"]
