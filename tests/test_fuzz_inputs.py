"""Property-based fuzzing of what a user hands remat (issue 28): plan files, profile files, budget
strings and option values. Every case must end as exit 0 with a sane result, or exit 1/2 with one
line naming the problem: no traceback, no internal error, nothing written when it fails.

A case is a valid file with one part of its JSON replaced (a number by NaN, a negative or a huge
one, a string, a list, null), removed, or the text truncated; ``judge`` states the contract once.
"""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.model.synthetic import random_chain, synthetic_profile
from tests.conftest import invoke

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


def judge(result, *, written: Path | None = None) -> str | None:
    """What is wrong with how a command ended, or None (the contract in the module docstring)."""
    text = result.output
    if "Traceback" in text or "internal error" in text:
        return f"traceback or internal error:\n{text}"
    if result.exit_code not in (0, 1, 2):
        return f"exit {result.exit_code}:\n{text}"
    if result.exit_code == 0:
        if re.search(r"\bnan\b|\binf\b|-\d+(\.\d+)? ms", result.stdout):
            return f"a result with an impossible figure:\n{result.stdout}"
        return None
    if result.exit_code == 2 and "Usage: remat" in text and re.search(r"Invalid value|No such option|Missing", text):
        return None  # typer's usage error: the usage line and the option (NOTE [ CLI errors and exit codes ])
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    if len(errors) != 1:
        return f"exit {result.exit_code} without one error line:\n{text}"
    if written is not None and written.exists():
        return f"exit {result.exit_code} but {written} was written"
    return None


# ----------------------------------------------------------------------------- JSON mutations

ODD_VALUES = st.sampled_from([float("nan"), float("inf"), float("-inf"), -1, -9000.5, 0, 1, 1.5, 10**30, -(10**30),
                              2**63, "", "12", "x", None, True, [], {}, [1, 2], {"a": 1}])


def _paths(obj, prefix=()):
    """Every path (tuple of keys/indices) into ``obj``, containers included."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:4]):  # the first few records of a list: enough kinds, fewer paths
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated(draw, text: str) -> str:
    """``text`` (a JSON document) with one mutation: a value replaced or removed, or the text cut."""
    kind = draw(st.sampled_from(["replace", "replace", "replace", "remove", "truncate"]))
    if kind == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))]
    data = json.loads(text)
    paths = [p for p in _paths(data) if p]
    path = draw(st.sampled_from(paths))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if kind == "remove":
        parent.pop(path[-1]) if isinstance(parent, dict) else parent.pop(path[-1])
    else:
        parent[path[-1]] = draw(ODD_VALUES)
    return json.dumps(data)  # NaN and Infinity as Python writes them, as a careless tool would


@pytest.fixture(scope="module")
def good_files(tmp_path_factory) -> tuple[str, str]:
    """(profile text, plan text) of a small synthetic chain."""
    tmp = tmp_path_factory.mktemp("fuzz")
    prof = tmp / "profile.json"
    synthetic_profile(random_chain(random.Random(1), 4)).save(prof)
    plan = tmp / "plan.json"
    assert invoke("plan", "--budget", "1GB", "--profile", prof, "-o", plan, "-q").exit_code == 0
    return prof.read_text(), plan.read_text()


@FUZZ
@given(data=st.data())
def test_fuzzed_plan_files(good_files, tmp_path_factory, data):
    text = data.draw(mutated(good_files[1]))
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(text)
    for args in (["show", path], ["show", path, "--json"]):
        r = invoke(*args)
        assert judge(r) is None, (judge(r), text[:2000])
    if r.exit_code == 0:  # it loaded: what --json printed loads again, and its numbers are sane
        plan = json.loads(r.stdout)
        assert plan["budget_bytes"] > 0 and math.isfinite(plan["predicted"]["recompute_ms"])


@FUZZ
@given(data=st.data())
def test_fuzzed_profile_files(good_files, tmp_path_factory, data):
    text = data.draw(mutated(good_files[0]))
    folder = tmp_path_factory.mktemp("profile")
    path, out = folder / "profile.json", folder / "plan.json"
    path.write_text(text)
    r = invoke("plan", "--budget", "1GB", "--profile", path, "-o", out)
    assert judge(r, written=out) is None, (judge(r), text[:2000])
    r = invoke("show", path)
    assert judge(r) is None, (judge(r), text[:2000])


# ----------------------------------------------------------------------------- budgets and options

BUDGET_TEXT = st.one_of(
    st.text(max_size=12),
    st.builds(lambda n, u, sp: f"{n}{sp}{u}", st.one_of(st.integers(-5, 10**25), st.floats(allow_nan=True),
                                                        st.sampled_from(["1e400", ".5", "0.0001", "1e-9", "-0"])),
              st.sampled_from(["", "B", "KB", "kib", "MB", "GiB", "gb", "TB", "PB", "XB", "G", "m", "bytes"]),
              st.sampled_from(["", " ", "\t"])),
)


@settings(max_examples=300, deadline=None)
@given(text=BUDGET_TEXT)
def test_fuzzed_budget_strings_parse_or_say_why(text):
    from planner.errors import BadInput
    from planner.sizes import parse_bytes

    try:
        n = parse_bytes(text)
    except BadInput as e:
        assert "\n" not in str(e) and "e.g. 12GB" in str(e)
    else:
        assert isinstance(n, int) and 0 < n <= 2**60


@FUZZ
@given(text=BUDGET_TEXT.filter(lambda t: not t.startswith("-") and "\x00" not in t))
def test_fuzzed_budget_strings_through_the_cli(good_files, tmp_path_factory, text):
    path = tmp_path_factory.mktemp("budget") / "profile.json"
    path.write_text(good_files[0])
    r = invoke("plan", f"--budget={text}", "--profile", path)
    assert judge(r) is None, (judge(r), text)


OPTION_VALUES = st.one_of(st.sampled_from(["0", "-1", "1", "2", "nan", "inf", "-inf", "1e9", "99%", "0.5%", "",
                                           "auto", "ddp", "fsdp", "none", "dp", "ilp", "x"]),
                          st.text(max_size=6).filter(lambda t: not t.startswith("-") and "\x00" not in t))
PLAN_OPTIONS = ["--headroom", "--granularity", "--time-limit", "--world-size", "--sharding", "--solver", "--target",
                "--optimizer", "--amp", "--clip-grad-norm", "--grad-accum"]
SWEEP_OPTIONS = ["--points", "--solvers", "--headroom", "--time-limit", "--granularity"]


@FUZZ
@given(option=st.sampled_from(PLAN_OPTIONS), value=OPTION_VALUES, second=st.sampled_from(PLAN_OPTIONS),
       value2=OPTION_VALUES)
def test_fuzzed_plan_options(good_files, tmp_path_factory, option, value, second, value2):
    folder = tmp_path_factory.mktemp("opts")
    path, out = folder / "profile.json", folder / "plan.json"
    path.write_text(good_files[0])
    r = invoke("plan", "--budget", "1GB", "--profile", path, f"{option}={value}", f"{second}={value2}", "-o", out)
    assert judge(r, written=out) is None, (judge(r), option, value, second, value2)


@FUZZ
@given(command=st.sampled_from(["frontier", "compare"]), option=st.sampled_from(SWEEP_OPTIONS), value=OPTION_VALUES)
def test_fuzzed_sweep_options(good_files, tmp_path_factory, command, option, value):
    path = tmp_path_factory.mktemp("sweep") / "profile.json"
    path.write_text(good_files[0])
    extra = ["--budget", "1GB"] if command == "compare" else ["--points", "2"]
    r = invoke(command, "--profile", path, *extra, f"{option}={value}")
    assert judge(r) is None, (judge(r), command, option, value)
