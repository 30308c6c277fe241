"""Bad input, round 2 (issue 28): output paths, impossible numbers in files, options a saved profile
cannot honour, the runtime guard on positional calls, and loss functions that take the batch.
Each test names the example of the issue it covers; all run in-process on tiny models."""

from __future__ import annotations

import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.errors import BadInput, ModelLoadError, PlanMismatch
from planner.files import atomic_write, check_writable
from planner.model.schema import Plan, Profile
from tests.conftest import invoke
from tests.test_errors import check, model_file

# ----------------------------------------------------------------------------- 1. writing files


def _modes(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_output_through_a_symlink_writes_its_target(tmp_path: Path):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    atomic_write(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "made.json")
    atomic_write(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "made.json").read_text() == "made"


def test_output_refuses_what_is_not_a_regular_file(tmp_path: Path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(BadInput, match="it is a FIFO .named pipe., not a regular file"):
        atomic_write(fifo, "x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    link = tmp_path / "to-null"
    link.symlink_to("/dev/null")
    for path in (Path("/dev/null"), link):  # probed only: never written, even before the fix
        with pytest.raises(BadInput, match="a character device, not a regular file"):
            check_writable(path)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    with pytest.raises(BadInput, match="it is a directory"):
        atomic_write(tmp_path, "x")
    assert not list(tmp_path.glob(".*.tmp"))


def test_output_modes_follow_the_umask_or_the_old_file(tmp_path: Path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "new.json", "x")
        assert _modes(tmp_path / "new.json") == 0o644
        os.umask(0o027)
        atomic_write(tmp_path / "group.json", "x")
        assert _modes(tmp_path / "group.json") == 0o640
        kept = tmp_path / "kept.json"
        kept.write_text("x")
        os.chmod(kept, 0o664)
        atomic_write(kept, "y")
        assert _modes(kept) == 0o664 and kept.read_text() == "y"
    finally:
        os.umask(old)


def test_output_temp_file_removed_when_the_rename_fails(tmp_path: Path, monkeypatch):
    def fail(*_a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        atomic_write(tmp_path / "plan.json", "x")
    assert not list(tmp_path.iterdir())


def test_cli_output_to_a_fifo_is_one_line(profile_path: Path, tmp_path: Path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for cmd in (["plan", "--budget", "10MB", "--profile", profile_path, "-o", fifo],
                ["frontier", "--profile", profile_path, "--points", "2", "-o", fifo]):
        out = check(invoke(*cmd), 2, f"error: cannot write {fifo}: it is a FIFO")
        assert len(out.strip().splitlines()) <= 2  # the budget echo and the error


# ----------------------------------------------------------------------------- 2. numbers in files


def _edit(src: Path, dst: Path, edit) -> Path:
    data = json.loads(src.read_text())
    edit(data)
    dst.write_text(json.dumps(data).replace("Infinity", "1e999"))
    return dst


@pytest.mark.parametrize("what, edit, needle", [
    ("nan forward_ms", lambda d: d["units"][1].__setitem__("forward_ms", float("nan")), "units.1.forward_ms"),
    ("negative forward_ms", lambda d: d["units"][1].__setitem__("forward_ms", -9000.0), "units.1.forward_ms"),
    ("infinite step", lambda d: d["step"].__setitem__("backward_ms", float("inf")), "step.backward_ms"),
    ("negative bytes", lambda d: d["tensors"][0].__setitem__("nbytes", -5), "tensors.0.nbytes"),
    ("fractional bytes", lambda d: d["params"][0].__setitem__("nbytes", 1.5), "params.0.nbytes"),
    ("absurd bytes", lambda d: d["step"].__setitem__("params_bytes", 10**30), "step.params_bytes"),
    ("zero threads", lambda d: d.__setitem__("threads", 0), "threads"),
    ("unit ends before it starts", lambda d: d["units"][1].__setitem__("fwd_end_seq", 0), "units.1.fwd_end_seq"),
    ("save of a missing tensor", lambda d: d["saves"][0].__setitem__("tensor_id", 10**6), "saves.0.tensor_id"),
])
def test_impossible_profile_numbers_are_refused(profile_path: Path, tmp_path: Path, what, edit, needle):
    bad = _edit(profile_path, tmp_path / "bad.json", edit)
    out = check(invoke("plan", "--budget", "10MB", "--profile", bad), 2, f"error: profile file {bad}: {needle}")
    assert "optimal" not in out and len(out.strip().splitlines()) == 2, what  # the budget echo, the error


@pytest.fixture
def plan_file(profile_path: Path, tmp_path: Path) -> Path:
    path = tmp_path / "plan.json"
    assert invoke("plan", "--budget", "10MB", "--profile", profile_path, "-o", path, "-q").exit_code == 0
    return path


@pytest.mark.parametrize("what, edit, needle", [
    ("negative budget", lambda d: d.__setitem__("budget_bytes", -1), "budget_bytes"),
    ("zero budget", lambda d: d.__setitem__("budget_bytes", 0), "budget_bytes"),
    ("absurd world size", lambda d: d.__setitem__("world_size", 10**9), "world_size"),
    ("world size without sharding", lambda d: d.__setitem__("world_size", 4), "world_size: 4 ranks need"),
    ("nan recompute", lambda d: d["predicted"].__setitem__("recompute_ms", float("nan")), "predicted.recompute_ms"),
    ("peak over the budget", lambda d: d.__setitem__("budget_bytes", d["predicted"]["peak_bytes"] // 2),
     "predicted.peak_bytes"),
    ("peak not its breakdown", lambda d: d["predicted"].__setitem__("activations_bytes", 1), "predicted.peak_bytes"),
    ("headroom above the budget", lambda d: d.__setitem__("headroom_bytes", 10**12), "headroom_bytes"),
    ("unknown module", lambda d: d["checkpoints"].append("no.such.module"), "checkpoints."),
    ("negative gap", lambda d: d["solver"].__setitem__("gap", -0.5), "solver.gap"),
])
def test_impossible_plan_numbers_are_refused(plan_file: Path, tmp_path: Path, what, edit, needle):
    bad = _edit(plan_file, tmp_path / "bad.json", edit)
    for cmd in (["show", bad], ["show", bad, "--json"]):
        out = check(invoke(*cmd), 2, f"error: plan file {bad}: {needle}")
        assert len(out.strip().splitlines()) == 1, what
    with pytest.raises(Exception, match=needle.split(":")[0]):
        Plan.load(bad)


def test_every_shipped_profile_passes_the_checks():
    for path in sorted(Path(__file__).resolve().parents[1].glob("profiles/models/*.json")):
        Profile.load(path)


# ----------------------------------------------------------------------------- 3. silent options


@pytest.mark.parametrize("args, needle", [
    (["--optimizer", "sgd"], "--optimizer sgd (the profile has adamw)"),
    (["--device", "meta"], "--device say how to measure a step"),
    (["--device", "cpu"], "--device say how to measure a step"),
    (["--steps", "5"], "--steps say how to measure"),
    (["--threads", "1"], "--threads say how to measure"),
    (["--device-memory", "1GB"], "--device-memory say how to measure"),
    (["--amp", "bf16"], "--amp 'bf16' (the profile has None)"),
    (["--grad-accum", "2"], "--grad-accum 2 (the profile has 1)"),
    (["--clip-grad-norm", "1"], "--clip-grad-norm 1.0 (the profile has None)"),
    (["--fused"], "the optimizer implementation 'fused'"),
    (["--no-zero-grad-set-to-none"], "--zero-grad-set-to-none False"),
])
def test_options_a_saved_profile_cannot_honour_are_refused(profile_path: Path, args, needle):
    for cmd in (["plan", "--budget", "10MB"], ["compare", "--budget", "10MB"], ["frontier", "--points", "2"]):
        check(invoke(*cmd, "--profile", profile_path, *args), 2, needle)


def test_options_a_saved_profile_can_honour_are_honoured(profile_path: Path):
    check(invoke("plan", "--budget", "10MB", "--profile", profile_path, "--optimizer", "adamw", "--grad-accum", "1"),
          0, "optimal")
    os.environ["REMAT_DEVICE_MEMORY"] = "1GB"  # a machine-wide default, not a request: not refused
    try:
        check(invoke("plan", "--budget", "10MB", "--profile", profile_path), 0, "optimal")
    finally:
        del os.environ["REMAT_DEVICE_MEMORY"]


def test_python_plan_on_a_profile_refuses_measuring_arguments(profile_path: Path):
    import planner

    prof = Profile.load(profile_path)
    with pytest.raises(BadInput, match="optimizer .adamw in the profile."):
        planner.plan(prof, "10MB", optimizer="sgd")
    with pytest.raises(BadInput, match="device"):
        planner.plan(prof, "10MB", device="cpu")
    assert planner.plan(prof, "10MB", optimizer="adamw").checkpoints


# ----------------------------------------------------------------------------- 4. the guard, positional calls


class _Images(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

    def forward(self, images, scale=1.0):
        return self.block(images) * scale


def _planned_for(inputs) -> tuple[nn.Module, Plan]:
    import planner

    model = _Images()
    return model, planner.plan(model, "1GB", inputs=inputs, device="cpu", steps=1, solver="all")


@pytest.mark.parametrize("planned_as", ["keyword", "positional"])
def test_guard_binds_positional_and_keyword_calls(planned_as: str):
    from planner.act.applier import apply_plan

    x = torch.randn(4, 8)
    model, plan = _planned_for({"images": x} if planned_as == "keyword" else (x,))
    big = torch.randn(16, 8)
    for call in (lambda m: m(big), lambda m: m(images=big), lambda m: m(big, 2.0)):
        handle = apply_plan(model, plan, guard="error")
        with pytest.raises(PlanMismatch, match=r"planned \[4, 8\], got \[16, 8\]"):
            call(model)
        handle.remove()
    handle = apply_plan(model, plan, guard="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(2, 8)).sum().backward()  # smaller: silent
    handle.remove()


# ----------------------------------------------------------------------------- 10. loss_fn(output, batch)

CLASSIFIER = """
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    def forward(self, x):
        return self.body(x)
def build_model():
    return M()
def example_inputs():
    return {{"x": torch.randn(4, 8)}}
{loss}
"""


def test_loss_fn_taking_the_batch(tmp_path: Path):
    seen = tmp_path / "labels-seen"
    path = model_file(tmp_path, CLASSIFIER.format(loss=(
        "def loss_fn(output, batch):\n"
        f"    open({str(seen)!r}, 'w').write(str(sorted(batch)))\n"
        "    return nn.functional.cross_entropy(output, torch.zeros(len(batch['x']), dtype=torch.long))\n")))
    out = tmp_path / "plan.json"
    check(invoke("plan", "--budget", "1GB", path, "--device", "cpu", "--steps", "1", "-o", out, "-q"), 0)
    assert seen.read_text() == "['x']"
    check(invoke("verify", path, out, "--device", "cpu", "--steps", "1", "-q"), 0)


@pytest.mark.parametrize("loss", [
    "def loss_fn():\n    return 0",
    "def loss_fn(output, batch, extra):\n    return 0",
    "def loss_fn(*, output):\n    return 0",
])
def test_loss_fn_with_another_signature_is_one_line(tmp_path: Path, loss: str):
    path = model_file(tmp_path, CLASSIFIER.format(loss=loss))
    out = check(invoke("plan", "--budget", "1GB", path, "--device", "cpu", "--steps", "1"), 2,
                "cannot be called as loss_fn(output) or loss_fn(output, batch)")
    assert "profiling" not in out  # refused when the file is loaded
    from planner.profiling.model_file import load_model_file

    with pytest.raises(ModelLoadError, match="loss_fn"):
        load_model_file(path)


def test_loss_fn_arity_rules():
    from planner.profiling.model_file import loss_arity

    assert loss_arity(None) == 1 and loss_arity(lambda out: out) == 1 and loss_arity(torch.sum) == 1
    assert loss_arity(lambda out, batch: out) == 2 and loss_arity(lambda out, batch=None: out) == 2
    assert loss_arity(lambda out, *rest: out) == 2 and loss_arity(lambda *a: a) == 2


# ----------------------------------------------------------------------------- 7. one place decides what fits


def test_compare_and_frontier_keep_the_headroom_plan_keeps(profile_path: Path, tmp_path: Path):
    from planner.act.api import budget_with_headroom
    from tests.conftest import CHAIN_MIN_FEASIBLE_BYTES

    between = budget_with_headroom(CHAIN_MIN_FEASIBLE_BYTES) - 1  # holds the lowest peak, not with its headroom
    check(invoke("plan", "--budget", str(between), "--profile", profile_path), 1, "no checkpoint plan fits")
    out = check(invoke("compare", "--budget", str(between), "--profile", profile_path, "--solvers", "dp"), 0,
                "headroom 0.5% of the budget kept free, as remat plan keeps it", "nothing fits")
    assert "optimal" not in out
    report = json.loads(invoke("compare", "--budget", str(between), "--profile", profile_path, "--json").stdout)
    assert report["headroom"] == 0.005 and all(p["status"] == "infeasible" or p["peak_bytes"] < between * 0.995
                                               for p in report["points"])
    sweep = json.loads(invoke("frontier", "--profile", profile_path, "--points", "3", "--json").stdout)
    for p in sweep["points"]:
        if p["status"] != "infeasible":
            assert check(invoke("plan", "--budget", str(p["budget_bytes"]), "--profile", profile_path,
                                "--solver", "dp", "-q"), 0)
    assert "headroom 0.5%" in invoke("frontier", "--profile", profile_path, "--points", "2").stdout
    assert check(invoke("compare", "--budget", str(between), "--profile", profile_path, "--headroom", "0"), 0,
                 "headroom 0.0%", "least recompute within the budget")
