"""Bad input and faults, round 17: the classes earlier sweeps left (tests/test_cli_faults.py, tests/test_faults.py,
tests/test_bad_input.py). Each test failed on the code before its fix; docs/cli.md, "Faults handled (round 17)",
lists them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import planner
from planner.errors import ProfileError
from tests.conftest import invoke, signal_when_marked
from tests.test_errors import ENV, GOOD_MODEL, ROOT, check, model_file

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


def test_a_loss_no_parameter_reaches_is_refused(tmp_path: Path):
    """NOTE [ A loss that is not finite ], Rule 5: a loss made as a new leaf tensor was profiled and planned (exit 0)
    with an empty backward and no optimizer state."""
    model = model_file(tmp_path, GOOD_MODEL + "def loss_fn(output):\n    return torch.tensor(1.0, requires_grad=True)\n")
    check(invoke("plan", "-b", "1GB", model, "--device", "cpu", "--steps", "1", "-q"), 2,
          "error: no parameter got a gradient from the loss: backward reached none of them, so there is nothing to plan")


def test_the_python_api_refuses_a_loss_that_is_not_finite():
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with pytest.raises(ProfileError, match="the loss is nan in the first training step"):
        planner.profile(net, torch.randn(2, 4), device="cpu", steps=1, loss_fn=lambda out: torch.log(-out.abs() - 1).mean())


# ----------------------------------------------------------------------------- budgets that read as something else


@pytest.mark.parametrize("budget, needle", [
    ("8Gb", "'Gb' is Gbit, an eighth of a GB; write 8GB for bytes"),  # was 8 GiB
    ("512Mb", "'Mb' is Mbit, an eighth of a MB; write 512MB for bytes"),
    ("1,5GB", "write the decimal point as '.', e.g. 1.5GB"),
    ("1_000MB", "write the number without separators, e.g. 1000MB"),
    ("1,000MB", "write the number without separators, e.g. 1000MB"),
    ("80%", "a share of the device is not a budget remat can read; give bytes (e.g. 64GB), or --target NAME"),
])
def test_a_budget_that_reads_as_something_else_says_its_fix(profile_path: Path, budget: str, needle: str):
    """NOTE [ Budgets that read as something else ]: '8Gb' planned for 8 GiB; the others got only the generic line."""
    result = invoke("plan", f"--budget={budget}", "--profile", profile_path)
    check(result, 2, f"error: --budget: invalid size {budget!r}: {needle}", "e.g. 12GB, 12GiB")
    assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("budget, nbytes", [("12Gi", 12 << 30), ("800mi", 800 << 20), ("1gb", 1 << 30), ("1Gb ", None)])
def test_kubernetes_units_are_binary_and_bytes_stay_case_insensitive(budget: str, nbytes: int | None):
    from planner.errors import BadInput
    from planner.sizes import parse_bytes

    if nbytes is None:
        with pytest.raises(BadInput, match="Gbit"):
            parse_bytes(budget)
    else:
        assert parse_bytes(budget) == nbytes


@pytest.mark.parametrize("budget", ["0\n_", "1\nGb", "1,5\nGB", "1_0\t00MB"])
def test_a_budgets_fix_never_echoes_a_control_character(budget: str):
    """The hints quoted the budget back: '0\\n_' (drawn by the fuzz test in a fresh clone's run) gave a
    two-line message, 'write the number without separators, e.g. 0\\n'."""
    from planner.errors import BadInput
    from planner.sizes import parse_bytes

    with pytest.raises(BadInput) as e:
        parse_bytes(budget)
    assert "\n" not in str(e.value) and "\t" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------- a reader that stops early


def _read_one_line_then_leave(args: list[str]) -> subprocess.CompletedProcess:
    """``remat ARGS | head -1``: the reader takes one line and closes the pipe."""
    proc = subprocess.Popen([sys.executable, "cli.py", *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()
    stderr = proc.stderr.read()
    return subprocess.CompletedProcess(args, proc.wait(timeout=300), first, stderr)


def test_a_reader_that_stops_early_ends_nothing(tmp_path: Path):
    """NOTE [ A reader that stops early ]: `remat show big.json | head -1` was ~60 lines of traceback ending in
    AttributeError (rich's SystemExit met a name typer lacks); a model that prints, piped to head, lost its plan."""
    import random

    from planner.model.synthetic import random_chain, synthetic_profile

    big = tmp_path / "big.json"
    synthetic_profile(random_chain(random.Random(0), 3000)).save(big)
    shown = _read_one_line_then_leave(["show", str(big)])
    assert shown.returncode == 0 and shown.stdout.startswith("profile of") and shown.stderr == "", shown.stderr

    chatty = model_file(tmp_path, GOOD_MODEL.replace("    return nn.Sequential", "    print('x' * 10**6)\n"
                                                     "    return nn.Sequential"))
    out = tmp_path / "plan.json"
    planned = _read_one_line_then_leave(["plan", "-b", "1GB", str(chatty), "--device", "cpu", "--steps", "1",
                                         "-q", "-o", str(out)])
    assert planned.returncode == 0 and "Traceback" not in planned.stderr, planned.stderr
    assert out.exists()


# ----------------------------------------------------------------------------- a model file that changes directory


def test_relative_paths_are_the_users_when_the_model_changes_directory(tmp_path: Path, monkeypatch):
    """NOTE [ Paths are the user's, not the model file's ]: `-o plan.json` after a model file's os.chdir wrote the
    plan into the directory the model chose (/plan.json in the probe), and `remat verify` looked for PLAN.json there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    model_file(tmp_path, f"import os\nos.chdir({str(elsewhere)!r})\n" + GOOD_MODEL)
    check(invoke("plan", "-b", "1GB", "model.py", "--device", "cpu", "--steps", "1", "-q", "-o", "plan.json"), 0,
          f"wrote {tmp_path / 'plan.json'}")
    assert (tmp_path / "plan.json").exists() and not (elsewhere / "plan.json").exists()
    monkeypatch.chdir(tmp_path)
    check(invoke("verify", "model.py", "plan.json", "--device", "cpu", "--steps", "1", "-q"), 0)


# ----------------------------------------------------------------------------- threads the model file leaves running


def test_a_thread_the_model_file_leaves_running_does_not_hold_remat(tmp_path: Path):
    """NOTE [ Threads the model file leaves running ]: remat wrote its plan, then waited for ever at exit."""
    model = model_file(tmp_path, "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), "
                                 "name='poller').start()\n" + GOOD_MODEL)
    out = tmp_path / "plan.json"
    result = subprocess.run([sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu", "--steps",
                             "1", "-q", "-o", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    check(result, 0, "note: 1 thread(s) the model file or a library it uses started still run ('poller'); remat "
                     "exits without waiting for them")
    assert out.exists() and result.stdout.rstrip().endswith(f"wrote {out}")


def test_a_pools_workers_are_left_to_pythons_shutdown(tmp_path: Path):
    """NOTE [ Threads the model file leaves running ], Rule 2: inductor's compile pool left two idle workers
    after every ``remat plan --compile``, which the note named and ``os._exit`` left to no atexit hook."""
    model = model_file(tmp_path, "import concurrent.futures\nPOOL = concurrent.futures.ThreadPoolExecutor(2)\n"
                                 "POOL.submit(print, end='').result()\n" + GOOD_MODEL)
    out = tmp_path / "plan.json"
    result = subprocess.run([sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu", "--steps",
                             "1", "-q", "-o", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "thread(s)" not in result.stderr, result.stderr
    assert out.exists()


# ----------------------------------------------------------------------------- rules that ignore the budget


@pytest.mark.parametrize("solver", ["none", "every-2"])
def test_a_fixed_rule_over_the_budget_names_the_solver_that_plans_for_it(profile_path: Path, solver: str):
    """NOTE [ Rules that ignore the budget ]: "found no plan within its limits (no detail) ... raise --time-limit",
    a fix that cannot help a rule that ignores the budget."""
    result = invoke("plan", "-b", "10MB", "--profile", profile_path, "--solver", solver, "-q")
    check(result, 2, f"error: solver '{solver}' is a fixed rule that does not look at the budget: its plan peaks at ",
          "above what the budget leaves after the headroom; use --solver auto, which finds plans down to a budget of")
    assert "--time-limit" not in result.stderr and result.stderr.count("\n") == 1, result.stderr


# ----------------------------------------------------------------------------- a parent killed with SIGKILL


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU memory cap needs Linux")
def test_the_folder_of_a_killed_command_is_removed_by_the_next(tmp_path: Path):
    """NOTE [ Signals and children ], Rule 5: `kill -9` of `remat plan --device-memory` (no finally runs) left
    /tmp/remat-capped-* for good; the child died with its parent (Rule 3) and still does."""
    import signal

    from tests.test_faults import MODEL, _gone, marking_model

    marker, model = marking_model(tmp_path)  # under --device-memory the forward runs in the capped child only
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {**ENV, "TMPDIR": str(tmpdir)}
    argv = [sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu", "--device-memory", "2GB",
            "--steps", "1", "-q"]
    returncode, _ = signal_when_marked(argv, marker, signal.SIGKILL, env=env, cwd=ROOT)
    assert returncode == -signal.SIGKILL and _gone(int(marker.read_text()))
    left = [p.name for p in tmpdir.glob("remat-capped-*")]
    assert len(left) == 1, left  # SIGKILL: nothing could remove it
    marker.unlink()
    model.write_text(MODEL.format(stage="forward", action="pass"))
    check(subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300), 0)
    assert list(tmpdir.glob("remat-capped-*")) == []


# ----------------------------------------------------------------------------- optimizer specs from files


def test_a_plan_file_cannot_make_remat_import_a_module(tmp_path: Path, plan_path: Path):
    """NOTE [ Optimizer specs from files ]: a plan naming optimizer 'this.Zen' printed the Zen of Python in
    `remat verify` (the module was imported to build the optimizer); a plan is data."""
    import json

    model = model_file(tmp_path, GOOD_MODEL)
    assert invoke("plan", "-b", "1GB", model, "--device", "cpu", "--steps", "1", "-q", "-o", plan_path).exit_code == 0
    document = json.loads(plan_path.read_text())
    document["optimizer"] = "this.Zen"
    plan_path.write_text(json.dumps(document))
    result = subprocess.run([sys.executable, "cli.py", "verify", str(model), str(plan_path), "--device", "cpu",
                             "--steps", "1", "-q"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    check(result, 2, "error: the plan names optimizer 'this.Zen', and remat imports no module a plan file names "
                     "(files are data): import this in the model file, which is code you trust")
    assert "Zen of Python" not in result.stdout + result.stderr
    document["optimizer"] = "torch.optim.AdamW"  # its module is imported already: named, built and verified
    plan_path.write_text(json.dumps(document))
    check(invoke("verify", model, plan_path, "--device", "cpu", "--steps", "1", "-q"), 0)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("json_mode", [False, True])
def test_stdout_that_cannot_be_written_or_is_closed_keeps_the_file(tmp_path: Path, profile_path: Path,
                                                                   json_mode: bool):
    """NOTE [ A reader that stops early ], Rules 3 and 4: `> /dev/full` was "internal error: OSError: [Errno 28]"
    and `>&-` "internal error: AttributeError: 'NoneType' object has no attribute 'write'", neither wrote -o."""
    out = tmp_path / "plan.json"
    argv = [sys.executable, "cli.py", "plan", "-b", "10MB", "--profile", str(profile_path), "-q", "-o", str(out),
            *(["--json"] if json_mode else [])]
    with open("/dev/full", "w") as full:
        result = subprocess.run(argv, cwd=ROOT, env=ENV, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr == ("error: cannot write to stdout: No space left on device; what "
                                                        "remat printed there is lost (its files are written)\n"), result.stderr
    assert out.exists()
    out.unlink()
    closed = subprocess.run(argv, cwd=ROOT, env=ENV, stdout=None, stderr=subprocess.PIPE, text=True, timeout=120,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 0 and "error" not in closed.stderr and out.exists(), closed.stderr
