"""Reading inductor's partitioned graphs: what the compiled forward saves for backward, which module
saves it, and where each forward node sits among the eager step's sequence numbers (NOTE [ Compiled
profile ] in planner/profiling/compiled.py, Rules 1-3).

Example::

    with capturing("inductor") as (backend, graphs):
        step = make_step(torch.compile(model, backend=backend), batch, optimizer=opt)
        step()
    saved, stacks = saved_storages(graphs, ModuleNames(model))
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from planner.model import schema
from planner.model.schema import LOSS_ID, ROOT_ID
from planner.options import parse_compile

@dataclass
class Graphs:
    """The forward graphs inductor compiled, in compile order, and the backward graph of each (by
    the ``graph_id`` inductor gives both halves of one AOT graph; a forward that needs no gradient
    has none)."""

    forward: list[torch.fx.GraphModule] = field(default_factory=list)
    forward_ids: list[Any] = field(default_factory=list)
    backward_of: dict[Any, torch.fx.GraphModule] = field(default_factory=dict)

    def backward(self, k: int) -> torch.fx.GraphModule | None:
        return self.backward_of.get(self.forward_ids[k])


@contextlib.contextmanager
def capturing(backend: str) -> Iterator[tuple[Callable[..., Any], Graphs]]:
    """A ``torch.compile`` backend that compiles like ``backend`` and keeps its partitioned graphs."""
    parse_compile(backend)
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    graphs = Graphs()

    def inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        if kwargs.get("is_backward"):
            graphs.backward_of[kwargs.get("graph_id")] = gm
        else:
            graphs.forward.append(gm)
            graphs.forward_ids.append(kwargs.get("graph_id"))
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def compiler(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs, inner_compile=inner)

    with torch._functorch.config.patch(enable_autograd_cache=False):  # the partition must run (Rule 1)
        yield compiler, graphs


# ----------------------------------------------------------------------------- reading the graphs


@dataclass(frozen=True)
class SavedStorage:
    """One storage the compiled forward keeps for backward (NOTE [ Compiled profile ], Rule 1)."""

    owner: str  # forward node that allocated it
    nbytes: int
    holders: tuple[str, ...]  # module FQNs whose backward reads it, innermost


def is_view(node: torch.fx.Node) -> bool:
    schema_ = getattr(node.target, "_schema", None)
    if schema_ is None or not schema_.returns:
        return False
    alias = schema_.returns[0].alias_info
    return alias is not None and not alias.is_write


def storage_owner(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose output owns ``node``'s storage (through view ops)."""
    while node.op == "call_function" and is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return int(val.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return int(val.numel() * val.element_size())


class ModuleNames:
    """FQN of a module named in a node's ``nn_module_stack`` (keyed by ``id`` or by a dynamo path)."""

    def __init__(self, model: torch.nn.Module):
        self.by_id = {str(id(m)): name for name, m in model.named_modules(remove_duplicate=False)}
        self.names = set(self.by_id.values())

    def fqn(self, key: str, value: Any) -> str | None:
        if key.split("@")[0] in self.by_id:
            return self.by_id[key.split("@")[0]]
        path = value[0] if isinstance(value, tuple) else str(value)
        path = re.sub(r"getattr\((.*?), '(\w+)'\)", r"\1.\2", path)
        path = re.sub(r"\[(\d+)\]", r".\1", path)
        parts = path.split(".")
        for i in range(len(parts)):  # strip the root's own name ("L['self']", "L['args'][0]")
            name = ".".join(parts[i:]) if i else ""
            if name in self.names and i:
                return name
        return None

    def stack(self, meta: dict[str, Any], key: str = "nn_module_stack") -> list[str]:
        """FQNs from outermost to innermost; [] when the node carries none."""
        out = []
        for k, v in (meta.get(key) or {}).items():
            name = self.fqn(k, v)
            if name is not None and name not in out:
                out.append(name)
        return out


def saved_storages(graphs: Graphs, names: ModuleNames) -> tuple[list[SavedStorage], dict[str, list[str]]]:
    """What each compiled forward keeps for backward, and each forward node's module stack (by node name).

    Graph breaks give several forward/backward pairs: they are read pair by pair.
    """
    out: list[SavedStorage] = []
    stacks: dict[str, list[str]] = {}
    for k, fw in enumerate(graphs.forward):
        bw = graphs.backward(k)
        if bw is None:
            continue
        nodes = {n.name: n for n in fw.graph.nodes}
        for n in fw.graph.nodes:
            stacks[f"{k}:{n.name}"] = names.stack(n.meta)
        holders: dict[str, list[str]] = defaultdict(list)
        for ph in bw.graph.nodes:
            if ph.op != "placeholder" or ph.name.startswith("tangents") or ph.name not in nodes:
                continue
            owner = storage_owner(nodes[ph.name])
            if owner.op == "placeholder" or _nbytes(owner) == 0:
                continue  # parameters, buffers, the batch: static memory
            for user in readers(ph):
                stack = names.stack(user.meta, "fwd_nn_module_stack") or names.stack(user.meta)
                fqn = stack[-1] if stack else ""
                if fqn not in holders[owner.name]:
                    holders[owner.name].append(fqn)
        for owner_name, who in holders.items():
            out.append(SavedStorage(f"{k}:{owner_name}", _nbytes(nodes[owner_name]), tuple(who)))
    return out, stacks


def readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes of ``node``'s graph that read its storage, through views (the views and the graph's
    output left out)."""
    out, todo = [], list(node.users)
    while todo:
        u = todo.pop()
        if u.op == "call_function" and is_view(u):
            todo.extend(u.users)
        elif u.op != "output":
            out.append(u)
    return out


# ----------------------------------------------------------------------------- positions and identity


@dataclass
class Layout:
    """Forward nodes placed among the eager sequence numbers (NOTE [ Compiled profile ], Rules 2-3)."""

    scale: int  # K: eager seq s becomes K * s
    position: dict[str, int]  # forward node -> position
    unit_of: dict[str, str]  # forward node -> innermost unit id
    identity: dict[str, int]  # forward node that owns a boundary storage -> eager tensor id
    chains: dict[str, list[str]]  # forward node -> unit ids from the root to its innermost unit


class Units:
    """Unit ids of module FQNs (first calls; see NOTE [ Compiled profile ], Rule 2)."""

    def __init__(self, profile: schema.Profile):
        self.by_id = {u.id: u for u in profile.units}
        self.of_fqn = {u.fqn: u.id for u in profile.units if u.call_index == 0 and u.id != LOSS_ID}

    def chain(self, stack: list[str]) -> list[str]:
        """Unit ids from the root to the innermost unit of a module stack."""
        return [ROOT_ID] + [self.of_fqn[f] for f in stack if f and f in self.of_fqn]

    def of(self, fqn: str) -> str:
        while fqn and fqn not in self.of_fqn:
            fqn = fqn.rpartition(".")[0]
        return self.of_fqn.get(fqn, ROOT_ID)


def layout(graphs: Graphs, stacks: dict[str, list[str]], units: Units, profile: schema.Profile) -> Layout:
    gaps: dict[tuple[str, str | None], int] = defaultdict(int)
    last_child: dict[str, str] = {}
    placed: dict[str, tuple[int, int]] = {}
    unit_of: dict[str, str] = {}
    chains: dict[str, list[str]] = {}
    for k, fw in enumerate(graphs.forward):
        for n in fw.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            name = f"{k}:{n.name}"
            chain = units.chain(stacks.get(name, []))
            for parent, child in zip(chain, chain[1:]):
                last_child[parent] = child
            inner = chain[-1]
            anchor = last_child.get(inner)
            gaps[(inner, anchor)] += 1
            base = units.by_id[anchor].fwd_end_seq if anchor else units.by_id[inner].fwd_start_seq
            placed[name] = (base, gaps[(inner, anchor)])
            unit_of[name], chains[name] = inner, chain
    scale = max(gaps.values(), default=0) + 2
    position = {name: scale * base + j for name, (base, j) in placed.items()}
    return Layout(scale, position, unit_of, identities(graphs, chains, units, profile), chains)


def identities(graphs: Graphs, chains: dict[str, list[str]], units: Units,
                profile: schema.Profile) -> dict[str, int]:
    """Boundary storages matched to the eager tensors units record as inputs and outputs (Rule 3)."""
    nbytes = {t.id: t.nbytes for t in profile.tensors}
    free: dict[tuple[str, str], list[int]] = {}
    for u in profile.units:
        free[(u.id, "in")] = list(u.input_ids)
        free[(u.id, "out")] = list(u.output_ids)
    out: dict[str, int] = {}

    def match(owner: str, unit: str, side: str, size: int) -> None:
        ids = free.get((unit, side), [])
        hit = next((t for t in ids if nbytes[t] == size), None)
        if hit is not None:
            ids.remove(hit)
            out.setdefault(owner, hit)

    for k, fw in enumerate(graphs.forward):
        for n in fw.graph.nodes:
            reader = chains.get(f"{k}:{n.name}")
            if reader is None and n.op != "output":
                continue
            for arg in n.all_input_nodes:
                owner = storage_owner(arg)
                made = chains.get(f"{k}:{owner.name}")
                if made is None:
                    continue  # a placeholder: static memory
                size = _nbytes(owner)
                inside = set(reader or [])
                for unit in made:  # outputs: units that made it and that the reader is not in
                    if unit not in inside and unit != ROOT_ID:
                        match(f"{k}:{owner.name}", unit, "out", size)
                for unit in reader or []:  # inputs: units the reader is in and that did not make it
                    if unit not in made:
                        match(f"{k}:{owner.name}", unit, "in", size)
    return out


__all__ = ["Graphs", "is_view", "Layout", "ModuleNames", "SavedStorage", "Units", "capturing", "identities", "layout", "readers",
           "saved_storages", "storage_owner"]
