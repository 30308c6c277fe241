"""Bad input, round 16: a new user's afternoon of faults, one test per class. Counts beyond any real
use (NOTE [ Counts have ceilings ]), input files that are not remat's JSON (NOTE [ Files that are
not remat's JSON ]), writes that fail part way (NOTE [ Writing output files ], Rule 6), and the
Python API given the wrong kind of object. Each ran before as a hang, an internal error or a
misleading line; all run in-process or on the synthetic chain, except one run under a file size limit."""

from __future__ import annotations

import errno
import gzip
import math
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import planner
import planner.files
from planner.act.api import plan_from_profile
from planner.act.applier import apply_plan
from planner.errors import BadInput, ModelLoadError, PlanFileError
from planner.model.graph import candidate_levels, unit_children
from planner.model.schema import Plan, Profile
from planner.spec import SolveSpec, StepSpec
from tests.conftest import invoke
from tests.test_errors import ENV, GOOD_MODEL, ROOT, check, model_file

# ----------------------------------------------------------------------------- counts have ceilings


@pytest.mark.parametrize("argv, flag, ceiling", [
    (["profile", "{model}", "--threads", "3000000000"], "--threads", "4096"),  # was: internal error ValueError
    (["profile", "{model}", "--grad-accum", "99999999999999999999"], "--grad-accum", "1048576"),  # ValidationError
    (["profile", "{model}", "--steps", "99999999999999999999"], "--steps", "10000"),  # ran for ever
    (["plan", "-b", "1GB", "--profile", "{profile}", "--granularity", "99999999999999999999"], "--granularity", "256"),
    (["plan", "-b", "1GB", "--profile", "{profile}", "--world-size", "99999999999999999999", "--sharding", "ddp"],
     "--world-size", "1048576"),  # was: internal error after planning
    (["plan", "-b", "1GB", "{model}", "--tp", "99999999999999999999"], "--tp", "1048576"),
    (["plan", "-b", "1GB", "{model}", "--pp", "2", "--micro-batches", "99999999999999999999"], "--micro-batches",
     "1048576"),
])
def test_a_count_beyond_its_ceiling_is_one_usage_line(capsys, tmp_path: Path, profile_path: Path, argv, flag,
                                                      ceiling):
    """NOTE [ Counts have ceilings ], Rule 1: the CLI declares each count's max from ``COUNTS``."""
    from planner.cli.main import main

    model = model_file(tmp_path, GOOD_MODEL)
    with pytest.raises(SystemExit) as exit_:
        main([a.format(model=model, profile=profile_path) for a in argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    # typer 0.29 says "Input should be less than or equal to N"; older typers leave it to click, whose
    # IntRange says "V is not in the range 1<=x<=N" (seen with the H200 machine's typer): both name flag and ceiling
    assert re.search(rf"Invalid value for '{flag}': (Input should be less than or equal to {ceiling}|"
                     rf"\d+ is not in the range \d+<=x<={ceiling})", err), err


@pytest.mark.parametrize("make, needle", [
    (lambda: StepSpec(steps=10**20), "steps 100000000000000000000 is above the most remat takes, 10,000"),
    (lambda: StepSpec(threads=3 * 10**9), "threads 3000000000 is above the most remat takes, 4,096"),
    (lambda: SolveSpec(granularity=10**20), "granularity 100000000000000000000 is above the most remat takes, 256"),
    (lambda: SolveSpec(world_size=2**21), "world_size 2097152 is above the most remat takes, 1,048,576"),
    (lambda: planner.profile(torch.nn.Linear(2, 2), torch.ones(1, 2), device="cpu", steps=10**20), "10,000"),
])
def test_a_count_beyond_its_ceiling_is_refused_by_the_library(make, needle):
    """Rule 1 for the Python API: the specs check what the CLI's options check (``profile(steps=10**20)`` ran on)."""
    with pytest.raises(BadInput, match=needle):
        make()


def test_candidate_levels_stop_at_the_leaves(profile_path: Path):
    """A granularity deeper than the module tree gives the leaves once, not one copy per level asked
    (a 20-digit --granularity looped without end)."""
    prof = Profile.load(profile_path)
    units, children = {u.id: u for u in prof.units}, unit_children(prof.units)
    deep = candidate_levels(units, children, 10**6)
    assert len(deep) <= 1 + max(u.depth for u in prof.units), len(deep)
    assert deep == candidate_levels(units, children, len(deep) - 1)


# ----------------------------------------------------------------------------- files that are not remat's JSON


@pytest.mark.parametrize("content, needle", [
    (lambda text: gzip.compress(text.encode()), "is not UTF-8 text (it looks like a gzip file)"),
    (lambda text: text.encode("utf-16"), "is not UTF-8 text (it looks like UTF-16 text)"),
    (lambda text: bytes(range(256)), "is not UTF-8 text (it looks like a binary file)"),
    (lambda text: b"[" * 100_000 + b"]" * 100_000, "is JSON that no remat writes (nested too deep)"),  # RecursionError
    (lambda text: b'{"kind": ' + b"9" * 5000 + b"}", "is JSON that no remat writes (a number with too many digits)"),
    (lambda text: b"import torch\nfrom torch import nn\n", "is not valid JSON: it begins 'import torch', not with '{'"),
])
def test_an_input_that_is_not_remats_json_says_what_it_is(tmp_path: Path, profile_path: Path, content, needle):
    """NOTE [ Files that are not remat's JSON ]: each was "may be truncated" or an internal error before."""
    bad = tmp_path / "bad.json"
    bad.write_bytes(content(profile_path.read_text()))
    result = invoke("plan", "--budget", "1GB", "--profile", bad)
    check(result, 2, "error: profile file", needle)
    assert "truncated" not in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_a_profile_with_a_byte_order_mark_is_read(tmp_path: Path, profile_path: Path):
    """Rule 1: a UTF-8 BOM (Notepad's "UTF-8 with BOM") is dropped, not 'Unexpected UTF-8 BOM ... may be truncated'."""
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + profile_path.read_bytes())
    check(invoke("plan", "--budget", "10MB", "--profile", bom, "-q"), 0)


def test_json_text_or_an_unreadable_path_given_to_load_is_one_line(plan_path: Path):
    """Rule 4: ``Plan.load(text)`` was "OSError: [Errno 36] File name too long"."""
    with pytest.raises(PlanFileError, match=r"got JSON text; to read text, call Plan.model_validate_json\(text\)"):
        Plan.load(plan_path.read_text())
    with pytest.raises(PlanFileError, match="cannot read plan file x{60}...: File name too long"):
        Plan.load("x" * 5000)


# ----------------------------------------------------------------------------- writes that fail part way


def test_a_write_that_fails_keeps_the_old_file_and_is_one_line(tmp_path: Path, profile_path: Path, monkeypatch):
    """NOTE [ Writing output files ], Rule 6: a full disk was "internal error: OSError: [Errno 28]"."""
    out = tmp_path / "plan.json"
    out.write_text("the old plan\n")

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(planner.files.os, "fsync", full)
    text = check(invoke("plan", "--budget", "10MB", "--profile", profile_path, "-o", out), 2,
                 f"error: cannot write {out}: No space left on device (the file there is unchanged); free some space")
    assert "internal error" not in text and out.read_text() == "the old plan\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "profile.json"]  # no temp file left


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as Linux applies it")
def test_a_write_beyond_the_file_size_limit_is_one_line(tmp_path: Path, profile_path: Path):
    """Rule 6 under a real ``ulimit -f``: the write fails with EFBIG (Python ignores SIGXFSZ)."""
    out = tmp_path / "plan.json"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    result = subprocess.run([sys.executable, "cli.py", "plan", "--budget", "10MB", "--profile", str(profile_path),
                             "-o", str(out), "-q"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
                            preexec_fn=limit)
    check(result, 2, f"error: cannot write {out}: File too large (nothing was written); raise the file size limit")
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]


# ----------------------------------------------------------------------------- the Python API, wrong objects


@pytest.mark.parametrize("call, needle", [
    (lambda p: plan_from_profile(None, "10MB"), "plan_from_profile takes a Profile"),  # AttributeError
    (lambda p: plan_from_profile({}, "10MB"), "or the path of a profile file, got dict"),
    (lambda p: plan_from_profile(planner.plan(p, "10MB"), "10MB"),
     "got Plan; a plan is made from the profile it was planned on"),
    (lambda p: planner.verify(torch.nn.Linear(2, 2), planner.plan(p, "10MB"), inputs=torch.ones(1, 2),
                              tolerance=math.nan), "tolerance must be a finite number >= 0"),  # was accepted
    (lambda p: planner.verify(torch.nn.Linear(2, 2), planner.plan(p, "10MB"), inputs=torch.ones(1, 2),
                              prediction_tolerance="lots"), "prediction_tolerance 'lots' is not a fraction"),  # TypeError
    (lambda p: Plan.load(p.with_name("plan.json")).save(None), "expected the path of the file to write"),  # TypeError
    (lambda p: apply_plan(torch.nn.Linear(2, 2), planner.plan(p, "10MB"), strict="no"),
     "strict must be True or False, got 'no'"),  # was truthy: strict
])
def test_python_api_given_the_wrong_object_is_one_line(profile_path: Path, plan_path: Path, call, needle):
    with pytest.raises(BadInput) as err:
        call(profile_path)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_profile_of_a_module_with_nothing_to_train_is_one_line():
    """A frozen module given to ``planner.profile`` was "ValueError: optimizer got an empty parameter list";
    a model file got the same check at load (one ``check_trainable`` for both)."""
    with pytest.raises(ModelLoadError, match="the Linear given to profile\\(\\) has no trainable parameters"):
        planner.profile(torch.nn.Linear(2, 2).requires_grad_(False), torch.ones(1, 2), device="cpu", steps=1)
    with pytest.raises(ModelLoadError, match="the ReLU given to profile\\(\\) has no parameters"):
        planner.profile(torch.nn.ReLU(), torch.ones(1, 2), device="cpu", steps=1)


def test_prediction_tolerance_takes_the_clis_percent_form():
    """``verify(prediction_tolerance="2%")`` as --tolerance 2% (was TypeError: '<=' between int and str); verify reads
    it through ``parse_fraction`` up to, not including, 100%."""
    from planner.options import parse_fraction

    assert parse_fraction("2%", "prediction_tolerance", below=1) == pytest.approx(0.02)
    assert parse_fraction(0.99, "prediction_tolerance", below=1) == 0.99
    with pytest.raises(BadInput, match="below 100%"):
        parse_fraction(1, "prediction_tolerance", below=1)


# ----------------------------------------------------------------------------- devices that are not there


def test_a_cuda_device_that_is_not_there_is_named_with_the_fix(monkeypatch):
    """`--device cuda:7` on a CPU-only machine said "device 'cuda' asked for" (the index lost); on a machine with one
    GPU, "device cuda:7 does not exist: 1 CUDA device(s) visible" with no fix. Both name what was asked and what to
    give (the second branch by stubbing torch.cuda, as a one-GPU machine answers)."""
    from planner.profiling.profiler import resolve_device

    if not torch.cuda.is_available():
        with pytest.raises(BadInput, match="device 'cuda:7' asked for, but CUDA is not available"):
            resolve_device("cuda:7")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(BadInput) as err:
        resolve_device("cuda:7")
    assert err.value.worded({"device": "--device"}).endswith(
        "device cuda:7 does not exist: 2 CUDA device(s) visible (CUDA_VISIBLE_DEVICES renumbers them from 0); use "
        "--device cuda:0 to cuda:1"), str(err.value)


# ----------------------------------------------------------------------------- outputs that name no file


@pytest.mark.parametrize("argv, needle", [
    (["plan", "-b", "10MB", "--profile", "{profile}", "-o", "-"], "cannot write '-': remat writes its files by name"),
    (["plan", "-b", "10MB", "--profile", "{profile}", "-o", "{tmp}/plans/"],
     "cannot write {tmp}/plans/: it ends in '/', so it names a folder; give a file name such as {tmp}/plans/out.json"),
    (["frontier", "--points", "2", "--profile", "{profile}", "--plot", "{tmp}/plots/"],
     "so it names a folder; give a file name such as {tmp}/plots/frontier.png"),
])
def test_an_output_that_names_no_file_is_refused(tmp_path: Path, profile_path: Path, monkeypatch, argv, needle):
    """NOTE [ Writing output files ], Rule 7: `-o -` wrote a file named '-', `-o plans/` a file named 'plans'."""
    monkeypatch.chdir(tmp_path)
    fill = {"profile": profile_path, "tmp": tmp_path}
    check(invoke(*[a.format(**fill) for a in argv]), 2, needle.format(**fill))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]
    with pytest.raises(BadInput, match="it ends in '/'"):
        Profile.load(profile_path).save(f"{tmp_path}/profiles/")


# ----------------------------------------------------------------------------- model-file conventions


@pytest.mark.parametrize("body, needle", [
    ("from .layers import block\n" + GOOD_MODEL, "attempted relative import with no known parent package; a model "
     "file is imported on its own, in no package: import its neighbours by name (e.g. `from layers import block`"),
    (GOOD_MODEL + "build_model = 5\n", "build_model is an int, not a function; define it as `def build_model(): ...`"),
    (GOOD_MODEL + "example_inputs = torch.ones(4, 8)\n", "example_inputs is a Tensor, not a function"),
])
def test_a_model_file_mistake_is_told_its_fix(tmp_path: Path, body: str, needle: str):
    """NOTE [ Model-file messages name the fix ]: the relative import gave only Python's symptom, and a
    build_model that is not a function was called missing ("does not define build_model()")."""
    (tmp_path / "layers.py").write_text("")
    check(invoke("profile", model_file(tmp_path, body), "--device", "cpu", "--steps", "1"), 2, needle)


@pytest.mark.parametrize("build, inputs", [
    ("nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).double()", "torch.randn(4, 8)"),
    ("nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 2))", "torch.randn(4, 8)"),
])
def test_a_model_and_inputs_of_other_dtypes_are_told_the_fix(tmp_path: Path, build: str, inputs: str):
    """torch's "mat1 and mat2 must have the same dtype" (or the embedding's "Expected tensor for argument #1
    'indices' to have one of the following scalar types") named neither the model nor example_inputs()."""
    body = f"def build_model():\n    return {build}\ndef example_inputs():\n    return {inputs}\n"
    check(invoke("profile", model_file(tmp_path, body), "--device", "cpu", "--steps", "1"), 2,
          "the model and its inputs differ in dtype: example_inputs() must give what the model takes")


# ----------------------------------------------------------------------------- layouts on models they do not fit


@pytest.mark.parametrize("flag, layout", [("--tp", "tensor-parallel layouts"), ("--pp", "pipeline stages")])
def test_a_layout_on_a_model_it_is_not_built_for_is_one_line(tmp_path: Path, flag: str, layout: str):
    """`--tp 2` on an nn.Sequential was "internal error: AttributeError: 'Sequential' object has no attribute
    'config'"; `--pp 2` said "plan it without {pp}", the option's placeholder unfilled."""
    model = model_file(tmp_path, GOOD_MODEL)
    result = invoke("plan", "-b", "1GB", model, flag, "2", "--device", "cpu")
    check(result, 2, f"error: {layout} are built for Hugging Face decoder-only language models",
          f"Sequential is not one: plan it without {flag}")
    assert "{" not in result.stderr, result.stderr
