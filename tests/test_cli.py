"""The `remat` CLI end to end: plan/profile/show/devices through typer's CliRunner.

Most cases plan on a synthetic profile (no torch run); one small real model file is profiled
on the CPU with one step. Error cases live in tests/test_errors.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from planner.profiling.devices import get_device, load_devices
from planner.errors import BadInput
from planner.model.schema import Plan, Profile
from tests.conftest import CHAIN_MIN_FEASIBLE_BYTES, invoke
from tests.model_files import TINY_MODEL

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.py"
    path.write_text(TINY_MODEL)
    return path


@pytest.fixture(scope="module")
def tiny_profile(tiny_model: Path) -> Path:
    """``remat profile tiny.py -o profile.json --device cpu --steps 1``, run once for the module."""
    out = tiny_model.parent / "tiny-profile.json"
    r = invoke("profile", tiny_model, "-o", out, "--device", "cpu", "--steps", "1")
    assert r.exit_code == 0, r.output
    return out


# ----------------------------------------------------------------------------- plan


def test_plan_prints_table_budget_peak_recompute_solver(profile_path: Path):
    r = invoke("plan", "--budget", "10MB", "--profile", profile_path)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "budget 10MB = 10485760 bytes (10.00 MiB)" in out
    assert re.search(r"h\.5\s.*\byes\b", out), out  # the unit table marks the checkpointed block
    for word in ("forward ms", "saved MiB", "predicted peak", "params", "grads", "optimizer", "activations",
                 "recompute", "solver dp: optimal", "plan not written"):
        assert word in out, word
    assert not list(profile_path.parent.glob("plan*.json")), "nothing is written without -o"


def test_plan_json_is_a_plan_and_logs_go_to_stderr(profile_path: Path):
    r = invoke("plan", "--budget", "10MB", "--profile", profile_path, "--json")
    assert r.exit_code == 0, r.output
    plan = Plan.model_validate_json(r.stdout)
    assert plan.checkpoints == ["h.5"] and plan.budget_bytes == 10 * 2**20
    assert "budget 10MB = 10485760 bytes" in r.stderr


def test_quiet_leaves_only_the_result(profile_path: Path):
    r = invoke("plan", "--budget", "10MB", "--profile", profile_path, "--json", "--quiet")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    Plan.model_validate_json(r.stdout)


def test_plan_output_writes_a_loadable_plan(profile_path: Path, tmp_path: Path):
    out = tmp_path / "plan.json"
    r = invoke("plan", "--budget", "10MB", "--profile", profile_path, "-o", out)
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.stdout
    plan = Plan.load(out)
    assert plan.checkpoints == ["h.5"]
    assert plan.predicted.peak_bytes <= plan.budget_bytes
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_plan_infeasible_states_minimum_and_writes_nothing(profile_path: Path, tmp_path: Path):
    out = tmp_path / "plan.json"
    r = invoke("plan", "--budget", "1MB", "--profile", profile_path, "-o", out)
    assert r.exit_code == 1
    from planner.act.api import budget_with_headroom, graph_for, min_feasible_bytes
    from planner.model.schema import Profile
    from planner.sizes import format_bytes

    lowest = budget_with_headroom(min_feasible_bytes(graph_for(Profile.load(profile_path))))
    assert lowest > CHAIN_MIN_FEASIBLE_BYTES  # the cost model's minimum peak, plus the default 0.5% headroom
    assert f"minimum feasible budget is {lowest} bytes ({format_bytes(lowest)})" in r.stderr
    assert "Traceback" not in r.output
    assert not out.exists()


def test_same_inputs_give_byte_identical_plans_apart_from_created(profile_path: Path, tmp_path: Path):
    texts = []
    for name in ("a.json", "b.json"):
        r = invoke("plan", "--budget", "8MB", "--profile", profile_path, "--solver", "dp",
                   "-o", tmp_path / name)
        assert r.exit_code == 0, r.output
        texts.append((tmp_path / name).read_text())
    stamp = re.compile(r'"created": \{[^}]*\}')
    assert all(len(stamp.findall(t)) == 1 for t in texts)
    assert stamp.sub("", texts[0]) == stamp.sub("", texts[1])


@pytest.mark.parametrize("solver", ["sqrt", "all", "none"])
def test_other_solvers_run(profile_path: Path, solver: str):
    r = invoke("plan", "--budget", "1GB", "--profile", profile_path, "--solver", solver, "--json", "-q")
    assert r.exit_code == 0, r.output
    assert Plan.model_validate_json(r.stdout).solver.name == solver


# ----------------------------------------------------------------------------- show


def test_show_plan(profile_path: Path, tmp_path: Path):
    out = tmp_path / "plan.json"
    assert invoke("plan", "--budget", "10MB", "--profile", profile_path, "-o", out, "-q").exit_code == 0
    r = invoke("show", out)
    assert r.exit_code == 0, r.output
    assert "budget 10485760 bytes" in r.stdout and "h.5" in r.stdout and "predicted peak" in r.stdout
    r = invoke("show", out, "--json")
    assert Plan.model_validate_json(r.stdout) == Plan.load(out)


def test_show_profile_lists_units(profile_path: Path):
    r = invoke("show", profile_path)
    assert r.exit_code == 0, r.output
    assert "8 candidate units" in r.stdout
    assert all(f"h.{i}" in r.stdout for i in range(8))


# ----------------------------------------------------------------------------- devices


def test_devices_lists_the_spec_files():
    r = invoke("devices")
    assert r.exit_code == 0, r.output
    assert "h100-sxm" in r.stdout and "80.00 GiB" in r.stdout and "989.5" in r.stdout
    r = invoke("devices", "--json")
    names = [d["name"] for d in json.loads(r.stdout)]
    assert names == sorted(names) and "t4" in names


def test_get_device_accepts_aliases_case_insensitively():
    assert get_device("H100").name == "h100-sxm"
    assert get_device(" h100-sxm ").memory_bytes == 80 * 2**30
    assert get_device("t4").peak_flops.bf16 is None
    with pytest.raises(BadInput, match="choose one of: .*h100-sxm"):
        get_device("tpu-v5")
    assert len(load_devices()) >= 11


# ----------------------------------------------------------------------------- a real model


def test_profile_writes_a_profile_of_the_model(tiny_profile: Path):
    prof = Profile.load(tiny_profile)
    assert prof.device == "cpu" and prof.fingerprint.model_class == "Sequential"
    r = invoke("show", tiny_profile)
    assert r.exit_code == 0 and "candidate units" in r.stdout


def test_plan_on_a_real_model_file(tiny_model: Path, tiny_profile: Path, tmp_path: Path):
    out = tmp_path / "plan.json"
    r = invoke("plan", "--budget", "10MB", tiny_model, "--device", "cpu", "--steps", "1", "-o", out)
    assert r.exit_code == 0, r.output
    assert "profiling" in r.stderr and "predicted peak" in r.stdout
    plan = Plan.load(out)
    assert plan.fingerprint == Profile.load(tiny_profile).fingerprint
    # with --profile the model file, if given, is only checked against the profile
    r = invoke("plan", "--budget", "10MB", tiny_model, "--profile", tiny_profile, "--json", "-q")
    assert r.exit_code == 0, r.output
    assert Plan.model_validate_json(r.stdout).fingerprint_digest == plan.fingerprint_digest


def test_verify_a_plan_on_its_model(tiny_model: Path, tiny_profile: Path, tmp_path: Path):
    out = tmp_path / "plan.json"
    r = invoke("plan", "--budget", "1GB", "--profile", tiny_profile, "--solver", "all", "-o", out, "-q")
    assert r.exit_code == 0, r.output
    assert Plan.load(out).checkpoints  # every block checkpointed: verify has recomputes to count
    r = invoke("verify", tiny_model, out, "--device", "cpu", "--steps", "1")
    assert r.exit_code == 0, r.output
    assert "peak memory" in r.stdout and "max |grad diff|" in r.stdout and "verify: OK" in r.stdout
    r = invoke("verify", tiny_model, out, "--device", "cpu", "--steps", "1", "--json", "-q")
    report = json.loads(r.stdout)
    assert report["ok"] is True and report["max_grad_diff"] == 0.0
    assert report["measured_recomputes"] == report["planned_recomputes"] > 0


def test_verify_failure_exits_1(tiny_model: Path, tiny_profile: Path, tmp_path: Path):
    plan = Plan.model_validate_json(invoke("plan", "--budget", "1GB", "--profile", tiny_profile, "--json",
                                           "-q").stdout)
    out = tmp_path / "plan.json"
    one_byte = plan.predicted.model_copy(update={"peak_bytes": 1, "params_bytes": 0, "grads_bytes": 0,
                                                 "optimizer_bytes": 0, "activations_bytes": 1})
    plan.model_copy(update={"budget_bytes": 1, "headroom_bytes": 0, "predicted": one_byte}).save(out)  # no step fits
    r = invoke("verify", tiny_model, out, "--device", "cpu", "--steps", "1")
    assert r.exit_code == 1, r.output
    assert "verify: FAILED" in r.stdout and "error: the plan failed verification" in r.stderr


def test_verify_fails_on_a_wrong_prediction(tiny_model: Path, tiny_profile: Path, tmp_path: Path):
    plan = Plan.model_validate_json(invoke("plan", "--budget", "1GB", "--profile", tiny_profile, "--solver", "all",
                                           "--json", "-q").stdout)
    assert plan.predicted.windows  # what verify compares window by window
    out = tmp_path / "plan.json"
    extra = int(plan.predicted.peak_bytes * 0.3)  # the breakdown must add up (NOTE [ Numbers in files ])
    wrong = plan.predicted.model_copy(update={"peak_bytes": plan.predicted.peak_bytes + extra,
                                              "activations_bytes": plan.predicted.activations_bytes + extra})
    plan.model_copy(update={"predicted": wrong}).save(out)  # a prediction 30% off
    r = invoke("verify", tiny_model, out, "--device", "cpu", "--steps", "1")
    assert r.exit_code == 1, r.output
    assert "prediction error" in r.stdout and "worst window" in r.stdout
    assert "off the measured" in r.stderr and "differ most at" in r.stderr
    r = invoke("verify", tiny_model, out, "--device", "cpu", "--steps", "1", "--tolerance", "40%")
    assert r.exit_code == 0, r.output  # within a looser tolerance
    r = invoke("verify", tiny_model, out, "--tolerance", "lots")
    assert r.exit_code == 2 and "--tolerance" in r.stderr


def test_headroom_is_kept_free_and_recorded(profile_path: Path, tmp_path: Path):
    out = tmp_path / "plan.json"
    r = invoke("plan", "--budget", "10MB", "--profile", profile_path, "--headroom", "2%", "-o", out)
    assert r.exit_code == 0, r.output
    plan = Plan.load(out)
    assert plan.headroom_bytes == int(10 * 2**20 * 0.02)
    assert plan.predicted.peak_bytes <= plan.budget_bytes - plan.headroom_bytes


@pytest.mark.parametrize("bad", ["abc", "60%", "-1%"])
def test_bad_headroom_is_a_usage_error(profile_path: Path, bad: str):
    r = invoke("plan", "--budget", "10MB", "--profile", profile_path, "--headroom", bad)
    assert r.exit_code == 2
    assert "--headroom" in r.output and "Traceback" not in r.output


def test_default_headroom_follows_how_the_profile_was_made(profile_path: Path, tmp_path: Path):
    """NOTE [ Headroom from evidence ]: measured full-precision profiles keep 0.5%, autocast ones 1.5%,
    fake-tensor ones 7%; an explicit --headroom wins."""
    from planner.act.api import AMP_HEADROOM, DEFAULT_HEADROOM, META_HEADROOM, headroom_for
    from planner.model.schema import Recipe

    prof = Profile.load(profile_path)
    assert headroom_for(prof) == DEFAULT_HEADROOM
    assert headroom_for(prof.model_copy(update={"recipe": Recipe(amp="bf16")})) == AMP_HEADROOM
    assert headroom_for(prof.model_copy(update={"device": "meta"})) == META_HEADROOM
    out = tmp_path / "plan.json"
    assert invoke("plan", "--budget", "10MB", "--profile", profile_path, "-o", out).exit_code == 0
    assert Plan.load(out).headroom_bytes == int(10 * 2**20 * DEFAULT_HEADROOM)
    assert invoke("plan", "--budget", "10MB", "--profile", profile_path, "--headroom", "1%", "-o", out).exit_code == 0
    assert Plan.load(out).headroom_bytes == int(10 * 2**20 * 0.01)
