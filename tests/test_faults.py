"""Faults injected into a model file at each stage remat runs it (issue 28): an exception, sys.exit,
prints, SIGINT, SIGTERM and SIGHUP at import, in build_model, example_inputs, forward and loss_fn. Every
case ends as exit 0 with a right result, or exit 1/2/129/130/143 with one line naming the problem; no
traceback, nothing written, no temporary file or child process left behind.

In-process (CliRunner) for speed; the signals are real signals to this process (remat's handlers are
installed while a command runs, and this module keeps a SIGTERM handler of its own outside them so
that a regression fails the test rather than killing pytest). The capped profiling child is tested
as a subprocess, where a real process boundary is the point.
"""

from __future__ import annotations

import getpass
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import invoke, signal_when_marked
from tests.test_errors import ENV, ROOT

STAGES = ["import", "build_model", "example_inputs", "forward", "loss"]

MODEL = """\
import os, signal, sys
import torch
from torch import nn

def fault(here):
    if here != {stage!r}:
        return
    {action}

fault("import")

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)
    def forward(self, x):
        fault("forward")
        return self.b(torch.relu(self.a(x)))

def build_model():
    fault("build_model")
    return M()

def example_inputs():
    fault("example_inputs")
    return torch.randn(4, 8)

def loss_fn(output):
    fault("loss")
    return output.square().mean()
"""

ACTIONS = {
    "raise": "raise RuntimeError('boom in ' + here)",
    "exit": "sys.exit(3)",
    "print": "print('chatter from ' + here)",
    "sigint": "os.kill(os.getpid(), signal.SIGINT); import time; time.sleep(5)",
    "sigterm": "os.kill(os.getpid(), signal.SIGTERM); import time; time.sleep(5)",
    "sighup": "os.kill(os.getpid(), signal.SIGHUP); import time; time.sleep(5)",  # the terminal closed
}


class _TermOutsideRemat(Exception):
    """Raised by this module's SIGTERM handler: remat's own handler was not in place."""


@pytest.fixture(autouse=True)
def _term_guard():
    def handler(*_):
        raise _TermOutsideRemat("SIGTERM reached the test's handler: remat installed none")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _model(tmp_path: Path, stage: str, action: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(stage=stage, action=ACTIONS[action]))
    return path


EXPECTED = {"raise": (2, "boom in"), "exit": (2, "called sys.exit(3)"), "print": (0, ""),
            "sigint": (130, "interrupted"), "sigterm": (143, "terminated"), "sighup": (129, "hung up")}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("action", list(ACTIONS))
def test_fault_at_each_stage(tmp_path: Path, stage: str, action: str):
    model = _model(tmp_path, stage, action)
    out = tmp_path / "out" / "plan.json"
    out.parent.mkdir()
    json_mode = action == "print"
    r = invoke("plan", "--budget", "1GB", model, "--device", "cpu", "--steps", "1", "-o", out,
               *(["--json"] if json_mode else []))
    code, needle = EXPECTED[action]
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    if json_mode:
        assert json.loads(r.stdout)["kind"] == "remat-plan"  # stdout is the JSON and nothing else
        assert f"chatter from {stage}" in r.stderr and out.exists()
    else:
        errors = [ln for ln in r.stderr.splitlines()
                  if ln.startswith(("error:", "interrupted:", "terminated:", "hung up:"))]
        assert len(errors) == 1 and needle in r.stderr, r.output
        assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == (["plan.json"] if json_mode else [])  # no temp file


def test_sighup_ignored_at_the_start_stays_ignored(tmp_path: Path):
    """NOTE [ Signals and children ], Rule 4: under ``nohup`` (SIGHUP ignored) a hang-up mid-profile changes nothing."""
    model = tmp_path / "model.py"
    model.write_text(MODEL.format(stage="forward", action=(
        "sys._hups = getattr(sys, '_hups', 0) + 1; sys._hups == 1 and os.kill(os.getpid(), signal.SIGHUP)")))
    out = tmp_path / "plan.json"
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        r = invoke("plan", "--budget", "1GB", model, "--device", "cpu", "--steps", "1", "-o", out, "-q")
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert r.exit_code == 0 and out.exists(), r.output


def test_prints_do_not_reach_json_stdout_in_every_command(tmp_path: Path):
    model = _model(tmp_path, "forward", "print")
    prof, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    for args in (["profile", model, "--device", "cpu", "--steps", "1", "-o", prof],
                 ["plan", "--budget", "1GB", model, "--device", "cpu", "--steps", "1", "-o", plan],
                 ["verify", model, plan, "--device", "cpu", "--steps", "1"],
                 ["compare", "--budget", "1GB", "--profile", prof, model]):
        r = invoke(*args, "--json")
        assert r.exit_code == 0, r.output
        json.loads(r.stdout)


def _gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"):
            return True  # a zombie whose parent has not reaped it yet: it runs nothing
        time.sleep(0.1)
    return False


def marking_model(tmp_path: Path) -> tuple[Path, Path]:
    """(marker, model file): the model's forward writes its pid to the marker, then sleeps (a signal's moment)."""
    marker = tmp_path / "child.pid"
    model = tmp_path / "model.py"
    model.write_text(MODEL.format(stage="forward", action=(
        f"open({str(marker)!r} + '.tmp', 'w').write(str(os.getpid())); os.rename({str(marker)!r} + '.tmp', "
        f"{str(marker)!r}); import time; time.sleep(120)")))
    return marker, model


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU memory cap needs Linux")
@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hung up")])
def test_sigterm_to_plan_with_device_memory_ends_the_capped_child(tmp_path: Path, sig: int, code: int, word: str):
    """SIGTERM, and SIGHUP (the terminal closed; before Rule 4 it killed remat at once, leaving /tmp/remat-capped-*)."""
    marker, model = marking_model(tmp_path)
    out = tmp_path / "plan.json"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    returncode, stderr = signal_when_marked(
        [sys.executable, "cli.py", "plan", "--budget", "1GB", str(model), "--device", "cpu", "--device-memory", "2GB",
         "--steps", "1", "-o", str(out)], marker, sig, env={**ENV, "TMPDIR": str(tmpdir)}, cwd=ROOT)
    child = int(marker.read_text())
    assert returncode == code, stderr
    assert f"{word}: nothing was written" in stderr and "Traceback" not in stderr, stderr
    assert _gone(child), f"the capped child {child} outlived its parent"
    left = [p.name for p in tmpdir.iterdir() if p.name != f"torchinductor_{getpass.getuser()}"]
    assert not out.exists() and not left, left  # torch's own compile cache aside, nothing


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU memory cap needs Linux")
@pytest.mark.parametrize("how, needle", [
    ("os.kill(os.getpid(), signal.SIGKILL)", "was killed by SIGKILL (signal 9) before it wrote a profile, as the "
     "kernel's out-of-memory killer does: free memory on this machine, or profile without --device-memory"),
    ("os._exit(7)", "exited with status 7 before it wrote a profile: the model's code or a library it calls ended "
     "it (os._exit, a crash); profile without --device-memory to see where"),
])
def test_a_capped_child_that_dies_is_one_line_that_says_what_to_do(tmp_path: Path, how: str, needle: str):
    """The capped child killed (the kernel's OOM killer sends SIGKILL) or ended by os._exit in the model's code:
    one line saying so in words, not 'exited with status -9', and nothing written."""
    model = tmp_path / "model.py"
    model.write_text(MODEL.format(stage="forward", action=f"if os.environ.get('REMAT_PARENT_PID'): {how}"))
    out = tmp_path / "plan.json"
    r = invoke("plan", "--budget", "1GB", model, "--device", "cpu", "--device-memory", "2GB", "--steps", "1",
               "-q", "-o", out)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert r.stderr.strip() == f"error: profiling within {2 << 30} bytes: the capped profiling process {needle}", r.stderr
    assert not out.exists()


def test_json_stdout_holds_only_the_json_at_the_file_descriptor(tmp_path: Path):
    """A write to fd 1 itself (as a child process or a C library would make) goes to stderr under --json."""
    model = tmp_path / "model.py"
    model.write_text(MODEL.format(stage="forward", action="print('chatter'); os.write(1, b'raw fd write\\n')")
                     .replace('fault("import")', 'os.write(1, b"raw at import\\n")'))
    r = subprocess.run([sys.executable, "cli.py", "plan", "--budget", "1GB", str(model), "--device", "cpu",
                        "--steps", "1", "--json"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kind"] == "remat-plan"
    assert "raw at import" in r.stderr and "raw fd write" in r.stderr and "chatter" in r.stderr
