"""The house (#26): what review found once, checked so that it stays fixed.

Docs and docstrings cite names and paths that exist; one name for one meaning (no second
``Literal`` for a status or a sharding, no bare ``1 << 62`` beside ``ALIVE_SEQ``); the README's
layout names every module; calibrations made here are written outside the installed package;
public parameter lists stay short (``benchmarks/code_shape.py``).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from planner.profiling import devices
from tests.conftest import invoke
from tests.model_files import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted([*(ROOT / "planner").rglob("*.py"), *(ROOT / "solvers").rglob("*.py")])
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXTS = DOCS + LIBRARY + sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")])


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_cited_names_exist():
    """``planner.x.y`` and ``solvers.x.y`` in docs, docstrings and comments name something that exists
    (``planner.profiling.profiler.profile`` and ``planner.sharding.shard_for_plan`` did not)."""
    stale = sorted({f"{name} ({path.relative_to(ROOT)})" for path in TEXTS
                    for name in re.findall(r"\b(?:planner|solvers)(?:\.[A-Za-z_]\w*)+", path.read_text())
                    if not _resolves(name)})
    assert not stale, stale


def test_cited_paths_exist():
    cited = {(m, path) for path in TEXTS
             for m in re.findall(r"\b(?:planner|solvers|benchmarks|examples|tests|profiles|docs)/[\w./-]+\.(?:py|md|json)",
                                 path.read_text())}
    missing = sorted(f"{m} ({path.relative_to(ROOT)})" for m, path in cited
                     if "<" not in m and not (ROOT / m).exists())
    assert not missing, missing


def _literal_args(node: ast.AST) -> tuple[str, ...] | None:
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "Literal"
            and isinstance(node.slice, ast.Tuple)):
        return tuple(e.value for e in node.slice.elts if isinstance(e, ast.Constant))
    return None


def test_status_and_sharding_literals_are_defined_once():
    """``Status`` and ``Sharding`` live in solvers/contract.py; nothing spells them out again."""
    again = {}
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            args = _literal_args(node)
            if args and set(args) in ({"optimal", "feasible", "infeasible"}, {"none", "ddp", "fsdp"}):
                again.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    assert list(again) == ["solvers/contract.py"], again


def test_no_bare_alive_seq_literal():
    """The position after every forward position has one name, ``solvers.cost_model.ALIVE_SEQ``."""
    for path in LIBRARY:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift)
                    and isinstance(node.right, ast.Constant) and node.right.value == 62):
                assert path.name == "cost_model.py", f"{path.relative_to(ROOT)}:{node.lineno}: use ALIVE_SEQ"


def test_the_device_memory_environment_variable_is_read(monkeypatch, tmp_path):
    from planner.cli.options import DEVICE_MEMORY_ENV

    monkeypatch.setenv(DEVICE_MEMORY_ENV, "1GB")
    model = tmp_path / "model.py"
    model.write_text(TINY_MODEL)
    r = invoke("plan", "--budget", "1GB", "--device", "meta", "--target", "h100", model)
    assert r.exit_code == 2
    assert "error: --device-memory caps a device that runs the step; --device meta runs nothing" in r.stderr
    assert f"it comes from the environment, {DEVICE_MEMORY_ENV}=1GB: unset it" in r.stderr  # not typed: say where
    monkeypatch.setenv(DEVICE_MEMORY_ENV, "abc")
    r = invoke("plan", "--budget", "1GB", "--device", "cpu", model)
    assert r.exit_code == 2 and r.stderr.strip() == ("error: --device-memory: invalid size 'abc': use bytes or a number "
                                                     "with a unit, e.g. 12GB, 12GiB, 800MiB, 1.5e9; it comes from the "
                                                     f"environment, {DEVICE_MEMORY_ENV}=abc: unset it"), r.stderr


def test_solve_graph_runs_auto_itself():
    from planner.act.api import graph_for, solve_graph
    from planner.model.schema import Profile
    from solvers.cost_model import simulate

    g = graph_for(Profile.load(ROOT / "profiles" / "models" / "gpt2-tiny-cpu.json"))
    sol = solve_graph(g, simulate(g, []).peak_bytes - 1, solver="auto")
    assert sol.detail.startswith("auto chose ")


def test_calibrations_made_here_go_outside_the_package(monkeypatch, tmp_path):
    spec = devices.get_device("h100")
    monkeypatch.delenv(devices.CALIBRATION_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    package = Path(devices.__file__).resolve().parents[1]
    assert devices.user_calibration_dir() == tmp_path / "config" / "remat" / "calibration"
    assert package not in devices.user_calibration_dir().parents
    monkeypatch.setenv(devices.CALIBRATION_ENV, str(tmp_path / "mine"))
    assert devices.calibration_path(spec) == devices.CALIBRATION_DIR / "h100-sxm.json"  # none of mine yet
    mine = tmp_path / "mine" / "h100-sxm.json"
    mine.parent.mkdir()
    mine.write_text('{"device": "h100-sxm", "matmul_efficiency": 0.5, "bandwidth_efficiency": 0.5, '
                    '"measured_on": "test", "torch_version": "", "created_at": "", "method": "", '
                    '"modelled_over_measured_before": 1.0}')
    assert devices.calibration_path(spec) == mine
    assert devices.load_calibration(spec).matmul_efficiency == 0.5
    assert devices.calibration_source(mine) == str(mine)


def test_every_cited_note_is_defined_once():
    """A NOTE cited anywhere (by its name in brackets) is written once, as a comment beside its code
    (the library's, a benchmark's, or the suite's own, e.g. NOTE [ Inherited SIGINT ])."""
    defined: dict[str, list[str]] = {}
    for path in LIBRARY + sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "tests").glob("*.py")):
        for name in re.findall(r"^\s*# NOTE \[ (.+?) \]\s*$", path.read_text(), flags=re.M):
            defined.setdefault(name, []).append(str(path.relative_to(ROOT)))
    twice = {n: where for n, where in defined.items() if len(where) > 1}
    assert not twice, twice
    cited = {(n, str(path.relative_to(ROOT))) for path in TEXTS + sorted((ROOT / "tests").glob("*.py"))
             for n in re.findall(r"NOTE \[ (.+?) \]", " ".join(re.sub(r"\n\s*#+ ?", " ", path.read_text()).split()))}
    unknown = sorted(f"{n} ({where})" for n, where in cited if n not in defined)
    assert not unknown, unknown


def test_notes_are_comments_not_docstrings():
    """A module docstring says what the module does; its NOTEs sit beside the code they govern."""
    for path in LIBRARY:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert not re.search(r"^\s*(# )?NOTE \[ .+? \]\s*$", doc, flags=re.M), path.relative_to(ROOT)


@pytest.mark.parametrize("path", LIBRARY, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_declares_its_public_names(path: Path):
    tree = ast.parse(path.read_text())
    names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    assert "__all__" in names, f"{path.relative_to(ROOT)} has no __all__"


def test_the_readme_layout_names_every_module():
    text = (ROOT / "README.md").read_text()
    block = text[text.index("The code follows the same path"):]
    block = block[:block.index("```", block.index("```") + 3)]
    missing = sorted(str(p.relative_to(ROOT)) for p in LIBRARY
                     if p.stem != "__init__" and not re.search(rf"\b{p.stem}\b", block))
    assert not missing, f"README's layout block does not name {missing}"


def test_functions_parameter_lists_and_modules_are_short():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from code_shape import MAX_FUNCTION_LINES, MAX_PUBLIC_PARAMETERS, measure
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    shape = measure(ROOT)
    assert shape["public_parameter_lists_over_limit"] == [], f"over {MAX_PUBLIC_PARAMETERS} names"
    assert shape["longest"][0][0] <= MAX_FUNCTION_LINES, shape["longest"][:3]
    assert shape["modules_over_limit"] == [], shape["largest_modules"][:3]


@pytest.mark.parametrize("path", [p for p in LIBRARY if p.name != "__init__.py"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_says_what_it_does_with_an_example(path: Path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert doc.strip() and "Example::" in doc, f"{path.relative_to(ROOT)}: no docstring with an Example::"
