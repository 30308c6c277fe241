"""The graph contract (solvers/contract.py): the builder writes every declared attribute and no
other, and the cost model, every solver and the planner read nothing undeclared.

The graphs are copied into ``Strict`` graphs whose attribute dicts record every access to a key
the contract does not declare; each case then runs ``simulate``, the probes, the chain terms, the
ILP's program, every solver and ``plan_from_profile`` on them. The cases cover what the attributes
are for: autocast's casts and gradient accumulation (a small model profiled under bf16 with two
micro-batches), op-level menus, nested candidates, FSDP2 and DDP ranks, modules called twice.
"""

from __future__ import annotations

import random
from pathlib import Path

import networkx as nx
import pytest

from planner.act.api import graph_for, min_feasible_bytes, plan_from_profile
from planner.model.graph import build_graph
from planner.model.schema import Profile
from planner.model.synthetic import random_tied, synthetic_profile
from solvers import SOLVERS
from solvers.contract import (
    EDGE_ATTRS, GRAPH_ATTRS, NODE_ATTRS, EdgeAttrs, GraphAttrs, NodeAttrs, contract_violations, meaning,
)
from solvers.chain import chain_terms
from solvers.cost_model import CostModel, simulate, window_bytes
from solvers.ilp import build_program

REFERENCE_PROFILES = Path(__file__).resolve().parents[1] / "profiles" / "models"

UNDECLARED: list[str] = []
"""Every access to an undeclared key, as 'kind key' (a solver may catch a KeyError; this list it cannot)."""


def _checked(kind: str, declared: frozenset[str]) -> type[dict]:
    class Checked(dict):
        def _check(self, key) -> None:
            if key not in declared:
                UNDECLARED.append(f"{kind} {key!r}")
                raise AssertionError(f"{kind} attribute {key!r} is not declared in solvers/contract.py")

        def __getitem__(self, key):
            self._check(key)
            return super().__getitem__(key)

        def __setitem__(self, key, value):
            self._check(key)
            super().__setitem__(key, value)

        def __contains__(self, key):
            self._check(key)
            return super().__contains__(key)

        def get(self, key, default=None):
            self._check(key)
            return super().get(key, default)

        def setdefault(self, key, default=None):
            self._check(key)
            return super().setdefault(key, default)

        def pop(self, key, *default):
            self._check(key)
            return super().pop(key, *default)

        def update(self, *args, **kw):
            for key in dict(*args, **kw):
                self._check(key)
            super().update(*args, **kw)

    return Checked


class Strict(nx.DiGraph):
    """A DiGraph whose graph, node and edge attribute dicts refuse undeclared keys (copies too)."""

    graph_attr_dict_factory = _checked("graph", GRAPH_ATTRS)
    node_attr_dict_factory = _checked("node", NODE_ATTRS)
    edge_attr_dict_factory = _checked("edge", EDGE_ATTRS)


def strict(g: nx.DiGraph) -> Strict:
    """``g`` as a ``Strict`` graph with its own cost model (built on the strict attributes)."""
    h = Strict()
    h.graph.update({k: v for k, v in g.graph.items() if k != "cost_model"})
    h.add_nodes_from(g.nodes(data=True))
    h.add_edges_from(g.edges(data=True))
    h.graph["cost_model"] = CostModel.build(h)
    return h


def test_every_attribute_has_a_meaning():
    for td, keys in ((NodeAttrs, NODE_ATTRS), (EdgeAttrs, EDGE_ATTRS), (GraphAttrs, GRAPH_ATTRS)):
        for key in keys:
            assert len(meaning(td, key)) > 5, f"{td.__name__}.{key} has no meaning"


def test_a_strict_graph_refuses_an_undeclared_read():
    g = strict(build_graph(Profile.load(REFERENCE_PROFILES / "gpt2-tiny-cpu.json")))
    n = next(iter(g.nodes))
    with pytest.raises(AssertionError, match="'saved_mb' is not declared"):
        g.nodes[n]["saved_mb"]
    with pytest.raises(AssertionError, match="'world' is not declared"):
        g.graph.get("world", 1)
    UNDECLARED.clear()


def test_a_read_the_contract_lacks_fails_the_solvers():
    """Were ``in_flight_ids`` not declared, the cost model's read of it would fail the check."""

    class Lacking(Strict):
        node_attr_dict_factory = _checked("node", NODE_ATTRS - {"in_flight_ids"})

    g = build_graph(Profile.load(REFERENCE_PROFILES / "gpt2-tiny-cpu.json"))
    h = Lacking()
    h.graph.update({k: v for k, v in g.graph.items() if k != "cost_model"})
    h.add_nodes_from((n, {k: v for k, v in a.items() if k != "in_flight_ids"}) for n, a in g.nodes(data=True))
    with pytest.raises(AssertionError, match="'in_flight_ids' is not declared"):
        SOLVERS["dp"](h, simulate(g, []).peak_bytes)
    assert UNDECLARED == ["node 'in_flight_ids'"]
    UNDECLARED.clear()


# ----------------------------------------------------------------------------- the cases


def _cases(menu_profile: Profile) -> dict[str, tuple[Profile, dict]]:
    gpt2 = Profile.load(REFERENCE_PROFILES / "gpt2-tiny-cpu.json")
    tied = synthetic_profile(random_tied(random.Random(0), 6, shared=2))
    return {
        "amp, accumulation, menus": (menu_profile, {}),
        "amp nested": (menu_profile, {"solver": "ilp", "granularity": 1}),
        "gpt2 nested": (gpt2, {"solver": "ilp", "granularity": 1}),
        "gpt2 fsdp": (gpt2, {"world_size": 2, "sharding": "fsdp"}),
        "gpt2 ddp": (gpt2, {"world_size": 4, "sharding": "ddp"}),
        "tied": (tied, {}),
        "gpt2 offload, copy engine": (gpt2.model_copy(update={"host_link_bytes_per_s": 10e9, "copy_engine": True}),
                                      {"offload": True}),
    }


CASES = ["amp, accumulation, menus", "amp nested", "gpt2 nested", "gpt2 fsdp", "gpt2 ddp", "tied",
         "gpt2 offload, copy engine"]


@pytest.mark.parametrize("case", CASES)
def test_the_builder_writes_exactly_the_contract(menu_profile, case):
    prof, kw = _cases(menu_profile)[case]
    g = graph_for(prof, **{k: v for k, v in kw.items() if k != "offload"})
    assert contract_violations(g) == []
    if case.startswith("amp,"):  # the case is what it says
        assert g.graph["autocast_cached"] and g.graph["grads_alive"] and g.graph["micro_batches"] == 2
        assert any(a["menu"] for _, a in g.nodes(data=True))


@pytest.mark.parametrize("case", CASES)
def test_solvers_and_planner_read_only_declared_attributes(menu_profile, case):
    prof, kw = _cases(menu_profile)[case]
    offload = kw.pop("offload", False)
    g = strict(graph_for(prof, **kw))
    UNDECLARED.clear()
    lowest, peak = min_feasible_bytes(g), simulate(g, []).peak_bytes
    budget = (lowest + peak) // 2
    leaves = g.graph["leaves"]
    window_bytes(g, leaves[:1])
    window_bytes(g, leaves[:1], calibrated=False)
    if all(a["leaf"] for _, a in g.nodes(data=True)):
        chain_terms(g)
    build_program(g)
    solvers = ["ilp", "auto"] if kw.get("granularity") else sorted(SOLVERS)
    for name in solvers:
        sol = SOLVERS[name](g, budget, time_limit_s=30)
        simulate(g, sol.checkpointed, sol.selective)
    plan_from_profile(prof, budget, solver=kw.get("solver", "auto"), headroom=0, graph=g,
                      time_limit_s=30)
    if offload:  # the lowest peak with offload (NOTE [ Peak-memory model ], Rule 10), and a plan there
        build_program(g, offload=True)
        none_fits = SOLVERS["ilp"](g, lowest // 2, time_limit_s=30, host_budget_bytes=1 << 40)
        least = none_fits.min_feasible_bytes
        assert none_fits.status == "infeasible" and least is not None and least <= lowest
        plan = plan_from_profile(prof, least, headroom=0, graph=g, time_limit_s=30, offload=True, host_memory="1TB")
        assert plan.predicted.peak_bytes <= least
    assert UNDECLARED == []
