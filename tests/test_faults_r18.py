"""Bad input and faults, round 18: the three classes round 17 left, and those a new probe found. Each test failed on
the code before its fix; docs/cli.md, "Faults handled (round 18)", lists them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import invoke
from tests.test_errors import ENV, GOOD_MODEL, ROOT, check, model_file

PLAIN_ENV = {k: v for k, v in ENV.items() if k != "PYTHONFAULTHANDLER"}
"""The environment of a user who did not ask for faulthandler's dump (NOTE [ Exits that skip remat ], Rule 3)."""


def _plan_cli(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu", "--steps",
                           "1", "-q", "-o", str(out), *extra], cwd=ROOT, env=PLAIN_ENV, capture_output=True,
                          text=True, timeout=180)


# ----------------------------------------------------------------------------- exits that skip remat

OS_EXIT_IN_FORWARD = """
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
    def forward(self, x):
        os._exit(5)
def build_model():
    return M()
def example_inputs():
    return torch.randn(4, 8)
"""


@pytest.mark.parametrize("where, body, said", [
    ("import", "import os\nos._exit(4)\n" + GOOD_MODEL, "error: importing {path} called os._exit(4) at {path}:4 in "
                                                        "<module>; put the file's script code under"),
    ("build", "import os\n" + GOOD_MODEL.replace("    return nn.Sequential", "    os._exit(3)\n    return nn.Sequential"),
     "error: build_model() in {path} called os._exit(3) at {path}:6 in build_model; return a value or raise"),
    ("forward", "import os\n" + OS_EXIT_IN_FORWARD, "error: the model's forward called os._exit(5) at {path}:10 in "
                                                    "forward; return a value or raise an exception instead"),
])
def test_os_exit_in_the_model_file_is_one_line(tmp_path: Path, where: str, body: str, said: str):
    """NOTE [ Exits that skip remat ], Rule 1: remat ended with the model's status (4, 3, 5) and no line."""
    model = model_file(tmp_path, body)
    out = tmp_path / "plan.json"
    result = _plan_cli(model, out)  # a process of its own: before the fix, os._exit ended it
    check(result, 2, said.format(path=model))
    assert result.stderr.count("\n") == 1 and not out.exists(), result.stderr


def test_os_exit_in_a_thread_of_the_model_says_so(tmp_path: Path):
    """Rule 1: another thread's os._exit still ends the process with its status, now with a line."""
    model = model_file(tmp_path, "import os, threading\n" + GOOD_MODEL.replace(
        "    return nn.Sequential", "    t = threading.Thread(target=os._exit, args=(6,)); t.start(); t.join()\n"
                                    "    import time; time.sleep(5)\n    return nn.Sequential"))
    out = tmp_path / "plan.json"
    result = _plan_cli(model, out)
    check(result, 6, "error: a thread of the model's code called os._exit(6) at ", "remat ends with status 6")
    assert not out.exists()


@pytest.mark.parametrize("where", ["build", "forward"])
def test_a_segmentation_fault_in_the_model_names_where(tmp_path: Path, where: str):
    """Rule 2: a SIGSEGV (ctypes.string_at(0)) ended remat with status 139 and no line."""
    crash = "ctypes.string_at(0)"
    body = ("import ctypes\n" + GOOD_MODEL.replace("    return nn.Sequential", f"    {crash}\n    return nn.Sequential")
            if where == "build" else "import ctypes, os\n" + OS_EXIT_IN_FORWARD.replace("os._exit(5)", crash))
    model = model_file(tmp_path, body)
    out = tmp_path / "plan.json"
    result = _plan_cli(model, out)
    line = 6 if where == "build" else 10
    func = "build_model" if where == "build" else "forward"
    assert result.returncode == -11, result.stderr
    assert (f"error: remat's process crashed with a fatal signal, segmentation fault, at {model}:{line} in {func} "
            f"(innermost: ") in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr and not out.exists(), result.stderr


def test_a_forked_childs_crash_is_not_remats(tmp_path: Path):
    """Rule 2: the watcher says nothing when the command ended its own way (a forked child crashed)."""
    body = ("import ctypes, multiprocessing as mp\ndef crash():\n    ctypes.string_at(0)\n" + GOOD_MODEL.replace(
        "    return nn.Sequential", "    p = mp.get_context('fork').Process(target=crash); p.start(); p.join()\n"
                                    "    return nn.Sequential"))
    out = tmp_path / "plan.json"
    result = _plan_cli(model_file(tmp_path, body), out)
    check(result, 0)
    assert "crashed" not in result.stderr and out.exists(), result.stderr


@pytest.mark.parametrize("capped", [False, True], ids=["plain", "capped-child"])
def test_ctrl_c_at_the_terminal_is_one_line(tmp_path: Path, capped: bool):
    """Rule 4: Ctrl-C at a terminal signals the whole process group; the crash watcher printed a KeyboardInterrupt
    traceback under remat's 'interrupted' line (test_errors.py signals remat's pid alone). Capped: the signal
    reaches the capped profiling child too (``--device-memory``, NOTE [ Signals and children ], Rule 8), which
    printed a 110-line traceback of its own above that line (round 25 probe)."""
    import signal
    import time

    marker = tmp_path / "imported"
    where = "sys.argv[0].endswith('capped.py')" if capped else "True"  # the import that waits: the child's
    model = model_file(tmp_path, f"import pathlib, sys, time\nif {where}:\n    pathlib.Path({str(marker)!r}).touch()\n"
                                 f"    time.sleep(60)\n" + GOOD_MODEL)
    cap = ["--device-memory", "4GB"] if capped else []
    proc = subprocess.Popen([sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu", "-q", *cap],
                            cwd=ROOT, env=PLAIN_ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # a group of its own, as a shell's foreground job
    try:
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and stderr == "interrupted: nothing was written\n", stderr


# ----------------------------------------------------------------------------- a lowered recursion limit


def test_a_recursion_limit_the_model_file_lowered_is_named(tmp_path: Path):
    """NOTE [ Settings the model file changes ]: 'internal error: RecursionError' (remat's profiler failed
    to import under the model file's limit of 50)."""
    model = model_file(tmp_path, "import sys\nsys.setrecursionlimit(50)\n" + GOOD_MODEL)
    result = _plan_cli(model, tmp_path / "plan.json")
    check(result, 2, "error: Python's recursion limit is 50, lowered from 1000 by the model file or a library it "
                     "imports (sys.setrecursionlimit), and remat ran out of it (RecursionError)",
          "raise the limit to at least 1000, or remove the call")
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_default_device_the_model_code_set_is_named(tmp_path: Path):
    """Rule 2 of NOTE [ Settings the model file changes ]: 'internal error: NotImplementedError: Cannot copy out of
    meta tensor' (remat's own tensors were made on the model file's default device). The tensors that failed, the
    host-link probe's, are made on the CPU by name since round 19 (Rule 5 of NOTE [ Offloaded units ]): the model is
    planned; a failure of remat's code under such a default is still named as the setting's."""
    import torch

    from planner.crashes import _changed_setting

    model = model_file(tmp_path, GOOD_MODEL.replace("    return torch.randn(4, 8)", "    x = torch.randn(4, 8)\n"
                                                    "    torch.set_default_device('meta')\n    return x"))
    check(_plan_cli(model, tmp_path / "plan.json"), 0, f"wrote {tmp_path / 'plan.json'}")
    torch.set_default_device("meta")
    try:
        line = _changed_setting(NotImplementedError("Cannot copy out of meta tensor; no data!"), sys.getrecursionlimit())
    finally:
        torch.set_default_device(None)
    assert line == ("the model's code set torch's default device to 'meta' (torch.set_default_device), and remat's own "
                    "tensors follow it: NotImplementedError: Cannot copy out of meta tensor; no data!; remove the call "
                    "(build the model and the batch with device=... instead; remat moves them to --device)")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the default device must be one torch lacks")
def test_a_default_device_torch_lacks_fails_in_the_model_code(tmp_path: Path):
    """Rule 2: remat's optimizer probe made its tensor on the default device ('internal error: AssertionError: Torch
    not compiled with CUDA enabled'); it is made on the CPU, and the model's build_model fails in its own line."""
    model = model_file(tmp_path, "torch.set_default_device('cuda')\n" + GOOD_MODEL)
    result = _plan_cli(model, tmp_path / "plan.json")
    check(result, 2, f"error: build_model() in {model} raised AssertionError: Torch not compiled with CUDA enabled")


def test_remats_files_take_the_umask_remat_started_with(tmp_path: Path):
    """Rule 3 of NOTE [ Settings the model file changes ]: the model file's os.umask(0o777) made the plan ----------."""
    import stat

    from planner.files import process_umask

    model = model_file(tmp_path, "import os\nos.umask(0o777)\n" + GOOD_MODEL)
    out = tmp_path / "plan.json"
    check(_plan_cli(model, out), 0, f"wrote {out}")
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~process_umask()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_the_model_code_cannot_close_remats_streams(tmp_path: Path, stream: str):
    """Rule 5 of NOTE [ A reader that stops early ]: stdout closed at import was 'internal error: ValueError: I/O
    operation on closed file.' (exit 1); stderr closed, then an error, printed Python's 'lost sys.stderr'."""
    raises = "def loss_fn(output):\n    raise ValueError('boom')\n" if stream == "stderr" else ""
    model = model_file(tmp_path, f"import sys\nsys.{stream}.close()\n" + GOOD_MODEL + raises)
    out = tmp_path / "plan.json"
    result = _plan_cli(model, out)
    if stream == "stdout":
        check(result, 0, f"wrote {out}")
    else:
        check(result, 2, "error: loss_fn raised ValueError: boom")
        assert "lost sys.stderr" not in result.stderr


# ----------------------------------------------------------------------------- plan fields edited by hand


def _edited(plan_path: Path, tmp_path: Path, edit) -> Path:
    document = json.loads(plan_path.read_text())
    edit(document)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(document))
    return out


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["checkpoints"].append(d["checkpoints"][0]), "checkpoints.1: module 'h.5' is listed twice (also "
                                                              "checkpoints.0); list each once"),
    (lambda d: d.update(device="tpu"), "device: 'tpu' is not a device remat profiles on (cpu, cuda, meta, synthetic)"),
    (lambda d: d.update(fingerprint_digest="0" * 16), "fingerprint_digest: '0000000000000000' is not the digest of "
                                                       "the plan's fingerprint ("),
])
def test_a_plan_edited_by_hand_is_refused_where_it_is_wrong(plan_path: Path, tmp_path: Path, edit, needle: str):
    """NOTE [ Plan fields edited by hand ]: each was read (a duplicate applied once) and shown, exit 0."""
    result = invoke("show", _edited(plan_path, tmp_path, edit))
    check(result, 2, f"error: plan file {tmp_path / 'edited.json'}: {needle}")
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_profile_on_a_device_remat_does_not_profile_on_is_refused(profile_path: Path, tmp_path: Path):
    """Rule 3: the plan made from it inherited 'tpu', and planning was an internal error (a ValidationError)."""
    document = json.loads(profile_path.read_text())
    document["device"] = "tpu"
    profile_path.write_text(json.dumps(document))
    check(invoke("plan", "-b", "10MB", "--profile", profile_path), 2,
          f"error: profile file {profile_path}: device: 'tpu' is not a device remat profiles on (cpu, cuda, meta, ")


def test_a_solver_named_by_hand_is_a_record(plan_path: Path, tmp_path: Path):
    """NOTE [ Plan fields edited by hand ], Rule 3: a plan chosen by hand names its own solver; shown as written."""
    result = invoke("show", _edited(plan_path, tmp_path, lambda d: d["solver"].update(name="manual")))
    check(result, 0, "solver manual: ")


@pytest.mark.parametrize("edit, where", [
    (lambda d: d["solver"].update(detail="done\x1b[2J\x1b[31m"), "solver.detail"),  # clears the screen
    (lambda d: d.update(device_name="cpu\x1b]0;pwned\x07"), "device_name"),  # sets the window title
    (lambda d: d["fingerprint"].update(model_class="Net\r"), "fingerprint.model_class"),
])
def test_a_file_whose_text_holds_terminal_controls_is_refused(plan_path: Path, tmp_path: Path, edit, where: str):
    """NOTE [ Text in files ]: `remat show` sent each to the terminal as read, exit 0."""
    result = invoke("show", _edited(plan_path, tmp_path, edit))
    check(result, 2, f"error: plan file {tmp_path / 'edited.json'}: {where}: text with the control character ")
    assert "\x1b[" not in result.stdout and result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("kind", ["plan", "profile"])
def test_a_key_twice_in_one_object_is_refused(plan_path: Path, profile_path: Path, kind: str):
    """Rule 5 of NOTE [ Files that are not remat's JSON ]: the last one counted in silence (a plan's budget of 5
    bytes shown as its second, 10MB, exit 0)."""
    source = plan_path if kind == "plan" else profile_path
    key = "budget_bytes" if kind == "plan" else "device"
    text = source.read_text()
    source.write_text(text.replace(f'"{key}":', f'"{key}": 5, "{key}":', 1))
    result = invoke("show", source) if kind == "plan" else invoke("plan", "-b", "10MB", "--profile", source)
    check(result, 2, f"error: {kind} file {source} has the key '{key}' twice in one object, and JSON readers disagree "
                     f"on which counts (Python's takes the last); keep one")
    assert result.stderr.count("\n") == 1, result.stderr


def test_the_watcher_is_not_started_when_faulthandler_is_on(tmp_path: Path):
    """Rule 3: PYTHONFAULTHANDLER=1 gives faulthandler's whole dump, as the user asked, and no watcher line."""
    model = model_file(tmp_path, "import ctypes\n" + GOOD_MODEL.replace("    return nn.Sequential",
                                                                       "    ctypes.string_at(0)\n    return nn.Sequential"))
    result = subprocess.run([sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu", "-q"],
                            cwd=ROOT, env={**PLAIN_ENV, "PYTHONFAULTHANDLER": "1"}, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == -11 and "Fatal Python error: Segmentation fault" in result.stderr
    assert "remat's process crashed" not in result.stderr and os.path.exists(model)


# ----------------------------------------------------------------------------- exceptions Python can only report


def test_an_atexit_callback_that_raises_is_one_note(tmp_path: Path):
    """NOTE [ Exceptions Python can only report ]: six lines of traceback after remat's last line (exit 0)."""
    model = model_file(tmp_path, "import atexit\ndef boom():\n    raise RuntimeError('cleanup failed')\n"
                                 "atexit.register(boom)\n" + GOOD_MODEL)
    out = tmp_path / "plan.json"
    result = _plan_cli(model, out)
    check(result, 0, f"note: exception ignored in atexit callback boom: RuntimeError: cleanup failed at {model}:5 in "
                     f"boom (remat's result stands; --debug shows the traceback)")
    assert result.stderr.count("\n") == 1 and out.exists(), result.stderr


# ----------------------------------------------------------------------------- a plot's format is its suffix


@pytest.mark.parametrize("name, head", [("f.svg", b"<?xml"), ("f.pdf", b"%PDF"), ("f.png", b"\x89PNG"), ("f", b"\x89PNG")])
def test_a_plot_is_drawn_in_the_format_its_suffix_names(profile_path: Path, tmp_path: Path, name: str, head: bytes):
    """NOTE [ A plot's format is its suffix ]: .svg and .pdf got PNG bytes."""
    pytest.importorskip("matplotlib")
    out = tmp_path / name
    check(invoke("frontier", "--profile", profile_path, "--points", "3", "--plot", out, "-q"), 0)
    assert out.read_bytes().startswith(head)


def test_a_plot_suffix_remat_cannot_draw_is_refused_before_anything_runs(tmp_path: Path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "f.jpeg"
    result = invoke("frontier", model_file(tmp_path, GOOD_MODEL), "--device", "cpu", "--plot", out, "-q")
    check(result, 2, "error: --plot f.jpeg: remat draws png, svg or pdf, named by the suffix, not .jpeg; use e.g. f.png")
    assert result.stderr.count("\n") == 1 and not out.exists() and "budget" not in result.output


# ----------------------------------------------------------------------------- processes the model file leaves running


def test_a_process_the_model_file_leaves_running_does_not_hold_remat(tmp_path: Path):
    """Rule 3 of NOTE [ Threads the model file leaves running ]: a non-daemon multiprocessing Process started at import
    held remat until it ended (60 s in the probe); Rule 6 of NOTE [ Signals and children ]: ended with SIGTERM, the
    forked child raised remat's Terminated and printed its traceback. Held, remat ends with the child's 300 s
    sleep; the run takes 14 s on a quiet machine, so it must end within 240 s (a fixed 60 s, and 90 s to the kill,
    left a loaded 2-core machine four times the quiet run, while profiling's rounds run on under load)."""
    import signal
    import time

    child_s, within_s = 300, 240  # the child's sleep, and the most a run not held by it may take
    pid_file = tmp_path / "child.pid"
    model = model_file(tmp_path, f"import multiprocessing, time\np = multiprocessing.get_context('fork').Process("
                                 f"target=time.sleep, args=({child_s},), name='prefetcher')\np.start()\n"
                                 f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n" + GOOD_MODEL)
    out = tmp_path / "plan.json"
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu",
                                 "--steps", "1", "-q", "-o", str(out)], cwd=ROOT, env=PLAIN_ENV, capture_output=True,
                                text=True, timeout=within_s)
        pid = int(pid_file.read_text())
        check(result, 0, f"note: 1 process(es) the model file or a library it uses started with multiprocessing still "
                         f"run ('prefetcher' (pid {pid})), which Python would wait for at exit; remat ends them")
        assert result.stderr.count("\n") == 1 and out.exists() and time.monotonic() - start < within_s, result.stderr
        time.sleep(0.5)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    finally:
        if pid_file.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


# ----------------------------------------------------------------------------- one way to list names


def test_names_are_listed_as_every_message_lists_them():
    from planner.errors import listed

    assert listed(["a", "b"]) == "a, b"
    assert listed([f"h.{i}" for i in range(7)]) == "h.0, h.1, h.2, h.3 and 3 more"
    assert listed(["'x'", "'y'", "'z'", "'w'"], 3) == "'x', 'y', 'z' and 1 more"
