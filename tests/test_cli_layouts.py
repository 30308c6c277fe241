"""NOTE [ Options a layout honours ] (planner/cli/parallel.py): an option that the pipeline or
tensor-parallel path would drop is a one-line error before any profiling, never a plan made
without it; and options checked before profiling are checked before profiling."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.cli.parallel import NOT_HONOURED, PIPELINE_ONLY
from tests.conftest import invoke

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "examples" / "llama_pp.py"

LAYOUT_ARGS = {"pipeline stages": ["--pp", "2"], "tensor parallelism": ["--tp", "2"]}
OPTION_ARGS = {"offload": ["--offload"], "host_memory": ["--offload", "--host-memory", "1GB"],
               "compile": ["--compile"], "shapes": ["--batch", "2,4"]}


def _one_line_error(args: list[str], tmp_path: Path) -> str:
    out = tmp_path / "plan.json"
    result = invoke("plan", LLAMA, "--budget", "1GB", "--device", "cpu", *args, "-o", out)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not out.exists()
    assert "profiling" not in result.output  # refused before any profiling
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("layout, option", [(layout, option) for layout, row in NOT_HONOURED.items()
                                            for option in row])
def test_an_option_the_layout_would_drop_is_refused(layout: str, option: str, tmp_path: Path):
    line = _one_line_error(LAYOUT_ARGS[layout] + OPTION_ARGS[option], tmp_path)
    assert f"with {layout}" in line and "not planned yet" in line


@pytest.mark.parametrize("option, args", [("schedule", ["--schedule", "gpipe"]),
                                          ("micro_batches", ["--micro-batches", "4"]),
                                          ("stages_per_rank", ["--stages-per-rank", "2"]),
                                          ("micro_batches", ["--micro-batches", "0"]),  # was dropped: 0 read as off
                                          ("stages_per_rank", ["--stages-per-rank", "0"]),
                                          ("schedule", ["--schedule", "1f1b"])])  # the default, typed
def test_a_pipeline_option_without_pp_is_refused(option: str, args: list[str], tmp_path: Path):
    assert option in PIPELINE_ONLY
    line = _one_line_error(args, tmp_path)
    assert line == f"error: {args[0]} is a pipeline option: add --pp N (stages), or drop it"


def test_a_bad_host_memory_is_refused_before_profiling(tmp_path: Path):
    line = _one_line_error(["--offload", "--host-memory", "-5GB"], tmp_path)
    assert line.startswith("error: --host-memory: invalid size '-5GB'")


def test_the_pipeline_api_refuses_a_compiled_step():
    from planner.act.pipeline import pipeline_layout, plan_pipeline
    from planner.errors import BadInput
    from planner.spec import StepSpec

    with pytest.raises(BadInput, match="plain eager step"):
        plan_pipeline(LLAMA, "1GB", pipeline_layout(2, "1f1b", 1), step=StepSpec(device="cpu", compile="inductor"))
