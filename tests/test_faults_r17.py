"""Bad input and faults, round 17: the classes earlier sweeps left (tests/test_cli_faults.py, tests/test_faults.py,
tests/test_bad_input.py). Each test failed on the code before its fix; docs/cli.md, "Faults handled (round 17)",
lists them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import planner
from planner.errors import ProfileError
from tests.conftest import invoke
from tests.test_errors import GOOD_MODEL, check, model_file

# ----------------------------------------------------------------------------- a loss that is not finite


@pytest.mark.parametrize("loss, amp, value", [
    ("torch.log(output - 100).mean()", None, "nan"),  # log of a negative number
    ("(output * 0 / 0.0).mean()", None, "nan"),  # 0 / 0
    ("(output / 0.0).abs().mean()", None, "inf"),  # a division by zero
    ("(output.float() * 1e30).square().sum()", "fp16", "inf"),  # an overflow
])
def test_a_loss_that_is_not_finite_is_refused(tmp_path: Path, loss: str, amp: str | None, value: str):
    """NOTE [ A loss that is not finite ]: each was profiled and planned, exit 0."""
    model = model_file(tmp_path, GOOD_MODEL + f"def loss_fn(output):\n    return {loss}\n")
    out = tmp_path / "plan.json"
    result = invoke("plan", "-b", "1GB", model, "--device", "cpu", "--steps", "1", "-q", "-o", out,
                    *(["--amp", amp] if amp else []))
    check(result, 2, f"error: the loss is {value} in the first training step, so every gradient and the backward "
                     "remat would measure are garbage; make the loss finite")
    assert result.stderr.count("\n") == 1 and not out.exists(), result.stderr
    if amp == "fp16":
        assert "an fp16 overflow (try --amp bf16)" in result.stderr


def test_the_python_api_refuses_a_loss_that_is_not_finite():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ProfileError, match="the loss is nan in the first training step"):
        planner.profile(net, torch.randn(2, 4), device="cpu", steps=1, loss_fn=lambda out: torch.log(-out.abs() - 1).mean())
