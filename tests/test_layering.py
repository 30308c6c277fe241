"""The layering: solvers/ (the cost model and every solver) is torch-free, never imports planner,
and reads the graph only through its typed contract (solvers/contract.py).

The static checks read every import statement under solvers/ (function-level ones too), and every
attribute a module there reads by a literal name (``a["saved_bytes"]``, ``g.graph.get("sharding")``):
each is declared in the contract. The dynamic check pickles the candidate graphs of a reference
profile, then, in a fresh interpreter where importing ``torch`` or ``planner`` fails, checks them
against the contract, runs every solver on them and judges each plan with the cost model: the same
answers as in this process. (tests/test_contract.py checks every read at run time.)
"""

from __future__ import annotations

import ast
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from planner.act.api import graph_for, min_feasible_bytes
from planner.model.schema import Profile
from solvers import SOLVERS
from solvers.contract import EDGE_ATTRS, GRAPH_ATTRS, NODE_ATTRS
from solvers.cost_model import simulate

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "profiles" / "models" / "gpt2-tiny-cpu.json"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "solvers").rglob("*.py")), ids=lambda p: p.name)
def test_solvers_import_neither_torch_nor_planner(path: Path):
    bad = sorted(n for n in _imports(path) if n.split(".")[0] in ("torch", "planner"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


NOT_GRAPH_ATTRIBUTES = {"stats", "options"}
"""Dicts under solvers/ read by literal keys that are not the graph's: the ILP's size statistics, and
the keywords its ``solve`` takes through ``**options`` (``host_budget_bytes``)."""


def _literal_reads(path: Path) -> list[tuple[int, str, str]]:
    """(line, key, expression) of every ``x["key"]`` and ``x.get("key", ...)`` in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            target, key = node.value, node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and node.args and isinstance(node.args[0], ast.Constant)):
            target, key = node.func.value, node.args[0].value
        else:
            continue
        if isinstance(key, str) and not (isinstance(target, ast.Name) and target.id in NOT_GRAPH_ATTRIBUTES):
            out.append((node.lineno, key, ast.unparse(node)))
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "solvers").rglob("*.py")), ids=lambda p: p.name)
def test_solvers_read_only_declared_attributes(path: Path):
    declared = NODE_ATTRS | GRAPH_ATTRS | EDGE_ATTRS
    bad = [f"line {line}: {expr}" for line, key, expr in _literal_reads(path) if key not in declared]
    assert not bad, f"{path.relative_to(ROOT)} reads attributes solvers/contract.py does not declare: {bad}"


_BLOCKED = """
import importlib.abc, json, pickle, sys
sys.path.insert(0, {root!r})

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "planner"):
            raise ImportError(f"{{name}} is blocked: solvers must not need it")
        return None

sys.meta_path.insert(0, Blocked())
from solvers import SOLVERS
from solvers.contract import contract_violations
from solvers.cost_model import simulate

cases = pickle.load(open({graphs!r}, "rb"))
out = {{}}
for name, (g, budget) in cases.items():
    assert contract_violations(g) == [], contract_violations(g)
    sol = SOLVERS[name](g, budget, time_limit_s=30)
    out[name] = [sol.status, sorted(sol.checkpointed), simulate(g, sol.checkpointed).peak_bytes]
print(json.dumps(out))
"""


def _run(name: str, g, budget: int) -> list:
    sol = SOLVERS[name](g, budget, time_limit_s=30)
    return [sol.status, sorted(sol.checkpointed), simulate(g, sol.checkpointed).peak_bytes]


def test_every_solver_runs_on_a_saved_graph_without_torch_or_planner(tmp_path: Path):
    prof = Profile.load(PROFILE)
    cases = {}
    for name in SOLVERS:
        g = graph_for(prof, solver=name)
        lowest, peak = min_feasible_bytes(g), simulate(g, []).peak_bytes
        cases[name] = (g, (lowest + peak) // 2)
    graphs = tmp_path / "graphs.pkl"
    graphs.write_bytes(pickle.dumps(cases))
    r = subprocess.run([sys.executable, "-c", _BLOCKED.format(root=str(ROOT), graphs=str(graphs))], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got) == set(SOLVERS)
    assert got == {name: _run(name, g, budget) for name, (g, budget) in cases.items()}
