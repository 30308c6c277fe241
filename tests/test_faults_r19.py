"""Bad input and faults, round 19: the four classes round 18 left, and those a new probe found. Each test failed on
the code before its fix; docs/cli.md, "Faults handled (round 19)", lists them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import invoke
from tests.test_errors import GOOD_MODEL, ROOT, check, model_file
from tests.test_faults_r18 import _plan_cli


def _runs(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# ----------------------------------------------------------------------------- children the model leaves


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="remat finds its children in /proc")
def test_a_process_the_model_starts_and_leaves_is_named_and_ended(tmp_path: Path):
    """Rule 7 of NOTE [ Signals and children ]: a subprocess.Popen the model file never waited for (here a shell and
    the sleep it started), and a double fork (a shell that starts a sleep and exits), ran on under PID 1 after remat
    exited 0."""
    below, orphan = tmp_path / "sleep.pid", tmp_path / "orphan.pid"
    model = model_file(tmp_path, f"import subprocess\nCHILD = subprocess.Popen('sleep 300 & echo $! > {below}; "
                                 f"sleep 301', shell=True)\nsubprocess.Popen('sleep 302 & echo $! > {orphan}', "
                                 f"shell=True).wait()\n" + GOOD_MODEL)
    out = tmp_path / "plan.json"
    result = _plan_cli(model, out)
    check(result, 0, f"wrote {out}", "note: 2 process(es) the model file or a library it uses started still run "
                                     "(pid ", ": '/bin/sh -c sleep 300 & echo $! > ", ": 'sleep 302'",
          "), and would outlive remat; remat ends them and what they started")
    pids = [int(pid) for pid in re.findall(r"pid (\d+): ", result.stderr)]
    assert not [pid for pid in [*pids, int(below.read_text()), int(orphan.read_text())] if _runs(pid)], result.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="remat finds its children in /proc")
def test_sigterm_while_the_models_processes_get_their_grace_still_ends_them(tmp_path: Path):
    """Rule 7: SIGTERM in the 2 s the model's left processes get at exit ended remat by Python's default (exit 143, no
    line) and they ran on; the signal now cuts the wait short and they are ended."""
    import signal
    import subprocess
    import time

    from tests.test_faults_r18 import PLAIN_ENV

    model = model_file(tmp_path, "import subprocess, sys\nCHILD = subprocess.Popen([sys.executable, '-c', "
                                 "'import time; time.sleep(300)'])\n" + GOOD_MODEL)
    out = tmp_path / "plan.json"
    proc = subprocess.Popen([sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu", "--steps",
                             "1", "-q", "-o", str(out)], cwd=ROOT, env=PLAIN_ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.8)  # the plan is written last: remat now gives the model's process its 2 s
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    pid = int(re.search(r"\(pid (\d+): ", stderr).group(1))
    assert proc.returncode == 0 and not _runs(pid), stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="remat finds its children in /proc")
def test_multiprocessing_helpers_are_not_the_models(tmp_path: Path):
    """Rule 7 leaves multiprocessing's resource tracker alone (it ends with remat): a spawn context's Lock started
    one, and remat named it as the model's process and killed it before it could free the semaphores it tracks."""
    model = model_file(tmp_path, "import multiprocessing as mp\nLOCK = mp.get_context('spawn').Lock()\n" + GOOD_MODEL)
    out = tmp_path / "plan.json"
    result = _plan_cli(model, out)
    check(result, 0, f"wrote {out}")
    assert "process(es)" not in result.stderr, result.stderr


# ----------------------------------------------------------------------------- models nested deep

NESTED = """
def build_model():
    m = nn.Linear(8, 8)
    for _ in range({depth}):
        m = nn.Sequential(m)
    return m
def example_inputs():
    return torch.randn(2, 8)
"""


def _plain_depth(limit: int = 400) -> int:
    """The deepest chain of nn.Sequential a plain training step runs from here, under this process's limit."""
    import torch
    from torch import nn

    def trains(depth: int) -> bool:
        m = nn.Linear(8, 8)
        for _ in range(depth):
            m = nn.Sequential(m)
        try:
            m(torch.randn(2, 8)).sum().backward()
        except RecursionError:
            return False
        return True

    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if trains(mid) else (lo, mid - 1)
    return lo


def test_a_model_that_trains_under_the_recursion_limit_is_planned(tmp_path: Path):
    """Rule 1 of NOTE [ Models nested deep ]: remat's hooks add a frame a level, and remat's own frames sit below the
    model's: a chain nested as deep as a plain step runs (248 levels from a shell) was 'the model's forward raised
    RecursionError' (remat ran out at 191)."""
    depth = _plain_depth()
    assert depth > 100
    model = model_file(tmp_path, NESTED.format(depth=depth))
    check(invoke("plan", "-b", "1GB", model, "--device", "cpu", "--steps", "1", "-q"), 0, "predicted peak")


def test_a_recursion_error_in_forward_says_how_deep_the_modules_were(tmp_path: Path):
    """Rule 2: 'the model's forward raised RecursionError: maximum recursion depth exceeded', no fix named."""
    result = invoke("plan", "-b", "1GB", model_file(tmp_path, NESTED.format(depth=sys.getrecursionlimit() // 2)),
                    "--device", "cpu", "--steps", "1", "-q")
    check(result, 2, "error: the model's forward raised RecursionError: maximum recursion depth exceeded",
          f" (Python's recursion limit is {sys.getrecursionlimit()}, with modules nested ",
          " deep where it ran out: raise it in the model file (sys.setrecursionlimit) if the model is meant to nest "
          "this deep, or nest less)")


def test_a_model_nested_deeper_than_torch_walks_is_one_line(tmp_path: Path):
    """Rule 3: 1,200 nested nn.Sequential was 'internal error: RecursionError' (torch's named_modules, which remat
    calls on the built model, recursed)."""
    depth = max(1200, sys.getrecursionlimit() + 200)  # inductor's compiles raise this process's limit to 2000
    result = invoke("plan", "-b", "1GB", model_file(tmp_path, NESTED.format(depth=depth)), "--device", "cpu")
    check(result, 2, f"error: Python's recursion limit of {sys.getrecursionlimit()} ran out (RecursionError) in "
                     "named_modules (", "torch/nn/modules/module.py), which called itself ", "raise it in the model "
                     "file (sys.setrecursionlimit) if the model is meant to nest this deep, or nest less")
    assert result.stderr.count("error") == 1, result.stderr


def test_the_unit_tree_is_walked_without_recursion():
    """Rule 4: ``_default_cut`` recursed two frames a unit level; a unit tree 3,000 deep was a RecursionError."""
    from planner.model.graph import candidate_levels
    from planner.model.schema import ROOT_ID, UnitRecord

    def unit(uid: str, parent: str | None, kind: str = "Sequential") -> UnitRecord:
        return UnitRecord.model_construct(id=uid, fqn="" if uid == ROOT_ID else uid, module_type=kind, parent=parent)

    units, children, parent = {ROOT_ID: unit(ROOT_ID, None)}, {}, ROOT_ID
    for level in range(3000):
        uid = f"{parent}.0" if parent != ROOT_ID else "0"
        units[uid], parent = unit(uid, parent), uid
        children[units[uid].parent] = [uid]
    blocks = [f"{parent}.b.{i}" for i in range(2)]  # two blocks of one class, each holding a layer
    children[parent] = blocks
    for b in blocks:
        units[b] = unit(b, parent, "Block")
        units[f"{b}.lin"] = unit(f"{b}.lin", b, "Linear")
        children[b] = [f"{b}.lin"]
    assert candidate_levels(units, children, 0) == [blocks]


# ----------------------------------------------------------------------------- a file's kind in remat show


def test_show_names_a_profile_it_cannot_read_a_profile_file(profile_path: Path, tmp_path: Path):
    """Rule 6 of NOTE [ Files that are not remat's JSON ]: `remat show` called a truncated profile a "plan file",
    to be re-created with `remat plan ...`."""
    cut = tmp_path / "cut.json"
    cut.write_text(profile_path.read_text()[:200])
    result = invoke("show", cut)
    check(result, 2, f"error: profile file {cut} is not valid JSON (line ", "it may be truncated: re-create it with "
                                                                           "`remat profile ...`")
    result = invoke("show", tmp_path)
    check(result, 2, f"error: {tmp_path} is a directory, not a plan or profile file")
    cut.write_bytes(b"\x1f\x8b\x08")
    check(invoke("show", cut), 2, f"error: plan or profile file {cut} is not UTF-8 text (it looks like a gzip file); "
                                  "pass the JSON file `remat plan` or `remat profile` wrote (uncompressed)")


# ----------------------------------------------------------------------------- a default device that is not the model's


def test_the_host_link_probe_copies_from_the_host_whatever_the_default_device():
    """Rule 5 of NOTE [ Offloaded units ]: under ``torch.set_default_device("cuda")`` the probe's source for the
    CPU was made on the GPU, so remat timed a GPU-to-host copy as the CPU's memcpy (read; no GPU in round 19), and the
    offload store's pinned buffer was a GPU tensor torch refuses to pin. ``torch.device("meta")`` as the default
    stands in for the GPU: 'NotImplementedError: Cannot copy out of meta tensor; no data!'."""
    import torch

    from planner.profiling.measure import measure_host_link

    with torch.device("meta"):  # a default device other than the host, as set_default_device sets it
        rate, engine = measure_host_link(torch.device("cpu"), repeats=1)
    assert rate > 0 and not engine


# ----------------------------------------------------------------------------- a model compiled before remat sees it


@pytest.mark.parametrize("build, what", [
    ("torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))", "is a torch.compile'd module"),
    ("nn.Sequential(torch.compile(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 2))", "holds a torch.compile'd module, "
                                                                                 "'0',"),
])
def test_a_model_the_model_file_compiled_is_refused_naming_the_fix(tmp_path: Path, build: str, what: str):
    """NOTE [ A model compiled before remat sees it ]: 'cannot reconcile the profiled timeline with the step as you
    run it: ... +203.98%; the step's memory differs from one run to the next', which blamed the wrong thing."""
    model = model_file(tmp_path, GOOD_MODEL.replace("nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))",
                                                    build))
    check(invoke("plan", "-b", "1GB", model, "--device", "cpu", "--steps", "1"), 2,
          f"error: the model from build_model() in {model} {what} whose modules remat cannot profile one by one; "
          f"return it uncompiled and pass --compile (compile='inductor' in Python), which plans the step as "
          f"torch.compile runs it; in training, apply the plan before compiling")


# ----------------------------------------------------------------------------- file names that are not UTF-8


@pytest.mark.skipif(sys.platform != "linux", reason="a file name of any bytes (macOS and Windows keep Unicode names)")
def test_file_names_that_are_not_utf8_are_planned_and_said(tmp_path: Path):
    """A name is bytes to the system: b'bad\xffname.py' reached the importer with a surrogate, and str.encode() made
    'internal error: UnicodeEncodeError: ... surrogates not allowed' (exit 1); with a strict stdout
    (PYTHONIOENCODING=utf-8) an output name did so at 'wrote ...', after the plan was written (Rule 6 of NOTE [ A
    reader that stops early ])."""
    import os
    import subprocess

    from tests.test_faults_r18 import PLAIN_ENV

    model = model_file(tmp_path, GOOD_MODEL, name=os.fsdecode(b"bad\xffname.py"))
    out = tmp_path / os.fsdecode(b"pl\xffan.json")
    result = subprocess.run([sys.executable, "cli.py", "plan", "-b", "1GB", str(model), "--device", "cpu", "--steps",
                             "1", "-q", "-o", str(out)], cwd=ROOT, env={**PLAIN_ENV, "PYTHONIOENCODING": "utf-8"},
                            capture_output=True, text=True, errors="surrogateescape", timeout=180)
    check(result, 0, f"wrote {tmp_path}/pl\\xffan.json")
    assert out.exists()


# ----------------------------------------------------------------------------- a temporary folder that is full


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU memory cap needs Linux")
def test_a_capped_child_that_cannot_write_its_result_names_the_folder(tmp_path: Path):
    """NOTE [ A temporary folder that is full ]: the child's failed write was a 17-line traceback, then remat blamed
    the model ('exited with status 1 before it wrote a profile: the model's code or a library it calls ended it').
    A file size limit (ulimit -f, which the child inherits) stands in for a full TMPDIR: the same failed write."""
    import resource
    import subprocess

    from tests.test_faults_r18 import PLAIN_ENV

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    result = subprocess.run([sys.executable, "cli.py", "plan", "-b", "1GB", str(model_file(tmp_path, GOOD_MODEL)),
                             "--device", "cpu", "--device-memory", "2GB", "--steps", "1", "-q"], cwd=ROOT,
                            env={**PLAIN_ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=180,
                            preexec_fn=small_files)
    check(result, 2, f"error: profiling within 2147483648 bytes: the capped profiling process could not write its "
                     f"result into remat's temporary folder {tmp_path} (", "bytes free; files are limited to 2048 "
                     "bytes, ulimit -f): free some space there, or point TMPDIR at a folder with room")
    assert result.stderr.count("\n") == 1, result.stderr


def test_a_nan_budget_in_python_is_said_to_be_no_number():
    """planner.plan(prof, budget=float('nan')) (a budget computed in Python) said 'a memory budget must be positive'."""
    from planner.errors import BadInput
    from planner.sizes import parse_bytes

    with pytest.raises(BadInput, match=r"^invalid size nan: not a number \(NaN\); use bytes or a number with a unit"):
        parse_bytes(float("nan"))


# ----------------------------------------------------------------------------- terminal controls in file names


def test_terminal_controls_in_a_file_name_are_written_as_escapes(profile_path: Path, tmp_path: Path):
    """Rule 3 of NOTE [ Text in files ]: a name holding ESC [2J cleared the screen in `remat show`'s error line, and
    ESC ]0;...BEL set the window title in `wrote NAME`."""
    missing = tmp_path / "y\x1b[2J.json"
    result = invoke("show", missing)
    check(result, 2, f"error: plan or profile file {tmp_path}/y\\x1b[2J.json does not exist; check the path")
    out = tmp_path / "x\x1b]0;pwned\x07.json"
    result = invoke("plan", "-b", "10MB", "--profile", profile_path, "-q", "-o", out)
    check(result, 0, f"wrote {tmp_path}/x\\x1b]0;pwned\\x07.json")
    assert out.exists() and "\x1b" not in result.output


# ----------------------------------------------------------------------------- parameters an optimizer step spoilt


def test_parameters_an_optimizer_step_spoilt_are_named_as_the_cause(tmp_path: Path):
    """Rule 6 of NOTE [ A loss that is not finite ]: a pure float16 model under AdamW (eps 1e-08 is 0 in float16)
    was 'the loss is nan in the first training step ... look for a log or square root of a number <= 0', said of
    remat's validation step after the profiled steps' optimizer.step() had spoilt its parameters."""
    model = model_file(tmp_path, GOOD_MODEL.replace("nn.Linear(8, 2))", "nn.Linear(8, 2)).half()")
                       .replace("torch.randn(4, 8)", "torch.randn(4, 8).half()"))
    check(invoke("plan", "-b", "1GB", model, "--device", "cpu", "--steps", "1", "-q"), 2,
          "error: the loss is nan because ", " of the model's 4 trainable parameter tensors hold NaN or inf before this "
          "step: an earlier optimizer.step() made them so, and training would do the same: float16 parameters are "
          "updated in float16, where an eps below 6e-08 (Adam's and AdamW's 1e-08) is 0 and a zero gradient divides 0 "
          "by 0; keep the parameters in float32 and pass --amp fp16 or bf16 for mixed precision")


# ----------------------------------------------------------------------------- async functions in the model file

ASYNC_FORWARD = """
class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)
    async def forward(self, x):
        return self.lin(x)
def build_model():
    return nn.Sequential(M())
def example_inputs():
    return torch.randn(4, 8)
"""


@pytest.mark.parametrize("body, said", [
    (GOOD_MODEL.replace("def build_model", "async def build_model"), "{path}: build_model is an async function (async "
     "def), so calling it gives a coroutine, not a value; define it with def"),
    (ASYNC_FORWARD, "the model from build_model() in {path}: M ('0') has an async forward (async def), which torch "
                    "calls as a plain function, getting a coroutine; define forward with def"),
])
def test_an_async_function_in_the_model_file_is_named(tmp_path: Path, body: str, said: str):
    """Rule 3 of NOTE [ Model-file messages name the fix ]: 'build_model() ... returned a coroutine' and 'the model
    output (coroutine) holds no floating-point tensor to use as a loss', each followed by Python's three-line
    'coroutine ... was never awaited' warning."""
    model = model_file(tmp_path, body)
    result = invoke("plan", "-b", "1GB", model, "--device", "cpu", "--steps", "1", "-q")
    check(result, 2, "error: " + said.format(path=model))
    assert "never awaited" not in result.output


def test_a_step_whose_memory_varies_run_to_run_is_refused_naming_the_fix(tmp_path: Path):
    """A step that slices its activations at a random size allocates differently each run: the refusal said only
    "the step's memory differs from one run to the next" (round 25 probe), neither the likely cause nor the fix."""
    check(invoke("plan", "-b", "1GB", model_file(tmp_path, RANDOM_CUT), "--device", "cpu", "--steps", "1"), 2,
          "the step's memory differs from one run to the next (a shape or a slice drawn at random, routing that "
          "depends on the data); remat plans one step, so make the step allocate the same each run while profiling "
          "(fix what varies at its largest case), then plan")


RANDOM_CUT = """
class RandomCut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(self.a(x)[:int(torch.randint(1, x.shape[0], (1,)))])


def build_model():
    torch.manual_seed(0)  # the same draws in every run of the test
    return RandomCut()


def example_inputs():
    return torch.randn(256, 64)
"""
