"""Synthetic profiles: hand-written or random models as ``Profile`` objects, without torch.

Tests (brute-force oracles, property tests) and solver benchmarks use these to exercise the
real ``build_graph`` -> ``simulate`` path on graphs of any shape: chains, skip connections
(U-Net), encoder outputs feeding every decoder block, nested candidates.

Example::

    prof = synthetic_profile(random_chain(random.Random(0), 8))   # no torch needed
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from planner.model.schema import (
    ROOT_ID, Fingerprint, ParamRecord, Profile, SaveRecord, StepRecord, TensorRecord, UnitRecord,
)


@dataclass
class SynUnit:
    """One module call of a synthetic model."""

    name: str  # FQN; repeated blocks are found by names ending in an index, e.g. "h.3"; "s#1" is the
    # second call of module "s" (its own saves and output, the parameters of "s")
    forward_ms: float = 1.0
    backward_ms: float = 2.0
    param_bytes: int = 0
    saves: list[int] = field(default_factory=list)  # bytes of tensors created inside and saved
    saves_inputs: bool = False  # saves the tensors it is given (a Linear saves its input)
    output_bytes: int = 1024
    output_saved: bool = False  # its last op saves its own output (a ReLU does)
    inputs: list[str] | None = None  # units whose outputs it takes; None = the previous unit, [] = the batch
    children: list["SynUnit"] = field(default_factory=list)
    module_type: str = "Block"
    glue_saves_after: list[int] = field(default_factory=list)  # saved by the parent right after it


class _Builder:
    def __init__(self) -> None:
        self.seq = 0
        self.units: list[UnitRecord] = []
        self.tensors: list[TensorRecord] = []
        self.saves: list[SaveRecord] = []
        self.params: list[ParamRecord] = []
        self.out: dict[str, int] = {}

    def tick(self) -> int:
        self.seq += 1
        return self.seq

    def tensor(self, nbytes: int, producer: str) -> int:
        tid = len(self.tensors)
        self.tensors.append(TensorRecord(id=tid, nbytes=nbytes, created_seq=self.seq, producer=producer))
        return tid

    def param(self, name: str, nbytes: int) -> None:
        """A parameter used now; a module called again uses its parameters again (later grad)."""
        seq = self.tick()
        for i, p in enumerate(self.params):
            if p.name == name:
                self.params[i] = ParamRecord(name=name, nbytes=p.nbytes, grad_seq=seq)
                return
        self.params.append(ParamRecord(name=name, nbytes=nbytes, grad_seq=seq))

    def save(self, tid: int, unit: str) -> None:
        self.saves.append(SaveRecord(tensor_id=tid, seq=self.tick(), unit=unit))

    def run(self, u: SynUnit, parent: str, depth: int, inputs: list[int]) -> int:
        fqn, _, call = u.name.partition("#")
        rec = UnitRecord(id=u.name, fqn=fqn, call_index=int(call or 0), module_type=u.module_type, parent=parent,
                         depth=depth, fwd_start_seq=self.tick(), fwd_end_seq=0, forward_ms=u.forward_ms,
                         backward_ms=u.backward_ms, input_ids=list(inputs),
                         input_bytes=sum(self.tensors[t].nbytes for t in inputs))
        self.units.append(rec)
        if u.saves_inputs:
            for t in inputs:
                self.save(t, u.name)
        own_params = u.param_bytes
        x = inputs
        for c in u.children:
            cin = [self.out[n] for n in c.inputs] if c.inputs is not None else x
            y = self.run(c, u.name, depth + 1, cin)
            x = [y]
            for b in c.glue_saves_after:
                self.tick()
                self.save(self.tensor(b, u.name), u.name)
        for b in u.saves:
            self.tick()
            self.save(self.tensor(b, u.name), u.name)
        if own_params:
            self.param(f"{fqn}.weight", own_params)
        self.tick()
        out = self.tensor(u.output_bytes, u.name)
        if u.output_saved:
            self.save(out, u.name)
        rec.output_ids = [out]
        rec.output_bytes = u.output_bytes
        rec.param_bytes = own_params + sum(
            p.nbytes for p in self.params if p.name.startswith(fqn + ".") and p.name != f"{fqn}.weight")
        rec.fwd_end_seq = self.tick()
        self.out[u.name] = out
        return out


def synthetic_profile(units: list[SynUnit], *, batch_bytes: int = 4096, optimizer_factor: int = 2,
                      step_ms: float | None = None) -> Profile:
    """A ``Profile`` of a model whose root calls ``units`` in order (see ``SynUnit``)."""
    b = _Builder()
    root = UnitRecord(id=ROOT_ID, fqn="", module_type="SyntheticModel", parent=None, depth=0,
                      fwd_start_seq=b.tick(), fwd_end_seq=0)
    b.units.append(root)
    x: list[int] = []
    for u in units:
        cin = [b.out[n] for n in u.inputs] if u.inputs is not None else x
        x = [b.run(u, ROOT_ID, 1, cin)]
        for nbytes in u.glue_saves_after:
            b.tick()
            b.save(b.tensor(nbytes, ROOT_ID), ROOT_ID)
    root.fwd_end_seq = b.tick()
    root.output_ids = list(x)
    params_bytes = sum(p.nbytes for p in b.params)
    fwd = sum(u.forward_ms for u in units)
    bwd = sum(u.backward_ms for u in units)
    names = [u.id for u in b.units if u.id != ROOT_ID]
    fp = Fingerprint(model_class="SyntheticModel", modules=names, params=[], inputs=[])
    step = StepRecord(
        params_bytes=params_bytes, batch_bytes=batch_bytes, grads_bytes=params_bytes,
        optimizer_bytes=optimizer_factor * params_bytes, forward_ms=fwd, backward_ms=bwd,
        step_ms=step_ms if step_ms is not None else fwd + bwd,
        forward_end_seq=b.tick(), backward_start_seq=b.tick(),
    )
    return Profile(fingerprint=fp, device="synthetic", units=b.units, tensors=b.tensors, saves=b.saves,
                   params=b.params, step=step)


def random_chain(rng: random.Random, n: int, *, max_bytes: int = 1 << 20) -> list[SynUnit]:
    """A chain of ``n`` heterogeneous blocks ``h.0 .. h.{n-1}``, each feeding the next."""
    units = []
    for i in range(n):
        units.append(SynUnit(
            name=f"h.{i}", forward_ms=round(rng.uniform(0.1, 10.0), 3),
            backward_ms=round(rng.uniform(0.2, 20.0), 3), param_bytes=rng.randrange(0, max_bytes // 4),
            saves=[rng.randrange(1, max_bytes) for _ in range(rng.randrange(0, 4))],
            saves_inputs=rng.random() < 0.7, output_bytes=rng.randrange(1, max_bytes // 2),
            output_saved=rng.random() < 0.3,
        ))
    return units


def random_dag(rng: random.Random, n: int, *, max_bytes: int = 1 << 20, p_skip: float = 0.3,
               p_nested: float = 0.0) -> list[SynUnit]:
    """Blocks with skip connections: each may also take outputs of any earlier block.

    With ``p_nested`` > 0 a block may consist of 2-3 child units (for nested candidates).
    """
    units = random_chain(rng, n, max_bytes=max_bytes)
    for i, u in enumerate(units):
        if i > 0:
            extra = [f"h.{j}" for j in range(i - 1) if rng.random() < p_skip]
            u.inputs = [f"h.{i - 1}"] + extra
        if rng.random() < p_nested:
            u.children = [
                SynUnit(name=f"h.{i}.part{k}", module_type=f"Part{k}",
                        forward_ms=round(rng.uniform(0.1, 5.0), 3), backward_ms=round(rng.uniform(0.1, 9.0), 3),
                        saves=[rng.randrange(1, max_bytes) for _ in range(rng.randrange(0, 3))],
                        saves_inputs=rng.random() < 0.7, output_bytes=rng.randrange(1, max_bytes // 2))
                for k in range(rng.randrange(2, 4))
            ]
            u.forward_ms = round(sum(c.forward_ms for c in u.children) + rng.uniform(0, 1), 3)
    return units


def random_tied(rng: random.Random, n: int, *, shared: int = 1, max_bytes: int = 1 << 20) -> list[SynUnit]:
    """A chain of ``n`` blocks with ``shared`` modules ``s0, s1..`` each called 2-3 times at random
    places in it (weights shared across depth): their calls are one decision for the solvers."""
    units = random_chain(rng, n, max_bytes=max_bytes)
    for k in range(shared):
        params = rng.randrange(0, max_bytes // 4)
        for _ in range(rng.randrange(2, 4)):
            units.insert(rng.randrange(0, len(units) + 1), SynUnit(
                name=f"s{k}", module_type=f"Shared{k}", param_bytes=params,
                forward_ms=round(rng.uniform(0.1, 10.0), 3), backward_ms=round(rng.uniform(0.2, 20.0), 3),
                saves=[rng.randrange(1, max_bytes) for _ in range(rng.randrange(1, 3))],
                saves_inputs=rng.random() < 0.7, output_bytes=rng.randrange(1, max_bytes // 2)))
    calls: dict[str, int] = {}
    for u in units:  # the k-th call in forward order is "s#k", as the profiler names it
        if u.name.startswith("s"):
            k = calls[u.name] = calls.get(u.name, -1) + 1
            u.name += f"#{k}" if k else ""
    return units


__all__ = ["random_chain", "random_dag", "random_tied", "synthetic_profile", "SynUnit"]
