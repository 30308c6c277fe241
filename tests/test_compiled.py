"""Plans for the step under torch.compile (NOTE [ Compiled profile ] in planner/profiling/compiled.py):
the profile reads the partitioner's saves, the plan records the compile, apply_plan + torch.compile
enforces it within its budget, and a plan run in the other mode warns once."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from planner.act.api import min_feasible_bytes, plan_from_profile
from planner.act.applier import apply_plan
from planner.errors import BadInput
from planner.model.graph import build_graph
from planner.model.schema import COMPILED_PLAN_VERSION, CompileInfo, MemoryEvent, Plan, Profile
from planner.model.synthetic import random_chain, synthetic_profile
from planner.profiling import profile
from planner.profiling.compiled import CompiledStep, measure_compiled, phase_peaks
from planner.profiling.compiled_calibration import (_replayed_before, _without_inputs, with_backward_bounds,
                                                     with_replay_calibration)
from planner.profiling.compiled_graphs import ModuleNames, saved_storages
from planner.profiling.measure import make_optimizer, make_step
from planner.spec import StepSpec
from solvers.cost_model import CostModel, simulate, window_bytes
from tests.conftest import invoke
from tests.model_files import TINY_SEQ_MODEL

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tiny() -> dict:
    ns: dict = {}
    exec(TINY_SEQ_MODEL, ns)  # noqa: S102 (the shared test model file)
    return ns


@pytest.fixture(scope="module")
def compiled_profile() -> Profile:
    m = _tiny()
    return profile(m["build_model"](), m["example_inputs"](), device="cpu", threads=1, steps=1, compile="inductor")


def _measured_peak(plan: Plan) -> int:
    """The compiled step's peak with ``plan`` applied first, as a job runs it."""
    m = _tiny()
    torch._dynamo.reset()
    model = m["build_model"]()
    apply_plan(model, plan)
    opt = make_optimizer("adamw", model)
    step = make_step(torch.compile(model), m["example_inputs"](), optimizer=opt)
    step()
    step()
    model.zero_grad(set_to_none=True)
    static = sum(p.nbytes for p in model.parameters()) * 3 + sum(
        t.nbytes for t in m["example_inputs"]().values())
    _peaks, peak, _source = phase_peaks(step, torch.device("cpu"), static)
    torch._dynamo.reset()
    return peak


def test_compiled_profile_reads_the_partitioners_saves(compiled_profile: Profile):
    p = compiled_profile
    assert p.compile is not None and p.compile.backend == "inductor" and p.compile.torch_version == torch.__version__
    assert p.compile.first_compile_s > 0 and p.ops  # op-level menus under compile (Rule 7)
    units = {u.id: u for u in p.units}
    assert all(units[o.unit].fwd_start_seq <= o.seq <= units[o.unit].fwd_end_seq for o in p.ops)  # compiled positions
    g = build_graph(p)
    blocks = [n for n in g.nodes if n.startswith("blocks.")]
    assert len(blocks) == 4 and all(g.nodes[n]["saved_bytes"] > 0 for n in blocks)
    assert simulate(g, []).peak_bytes == p.step.measured_peak_bytes  # calibrated on the compiled step


def test_compiled_plan_fits_its_budget_under_compile(compiled_profile: Profile, tmp_path):
    g = build_graph(compiled_profile)
    none = simulate(g, []).peak_bytes
    every = simulate(g, [n for n in g.nodes if n.startswith("blocks.")]).peak_bytes
    plan = plan_from_profile(compiled_profile, (none + every) // 2 + 16 * 1024)
    assert (plan.checkpoints or plan.selective) and plan.compile == compiled_profile.compile
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert again.schema_version == COMPILED_PLAN_VERSION and again.compile == plan.compile
    assert _measured_peak(plan) <= plan.budget_bytes


def _warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "remat: this plan was made" in str(w.message)]


def test_a_compiled_plan_run_eagerly_warns_once(compiled_profile: Profile):
    m = _tiny()
    plan = plan_from_profile(compiled_profile, compiled_profile.step.measured_peak_bytes)
    plan = plan.model_copy(update={"checkpoints": ["blocks.0", "blocks.1"], "checkpoint_units": []})
    model = m["build_model"]()
    apply_plan(model, plan)
    batch = m["example_inputs"]()
    said = _warnings(lambda: [model(**batch).backward() for _ in range(2)])
    assert len(said) == 1 and "made for the step under torch.compile (inductor)" in said[0]


def test_an_eager_plan_under_compile_warns_once(compiled_profile: Profile):
    m = _tiny()
    plan = plan_from_profile(compiled_profile, compiled_profile.step.measured_peak_bytes)
    plan = plan.model_copy(update={"checkpoints": ["blocks.0"], "checkpoint_units": [], "compile": None})
    model = m["build_model"]()
    apply_plan(model, plan)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")  # dynamo traces the plan; no inductor needed here
    batch = m["example_inputs"]()
    said = _warnings(lambda: [compiled(**batch).backward() for _ in range(2)])
    torch._dynamo.reset()
    assert len(said) == 1 and "made for the eager step" in said[0]


def _with_timeline(p: Profile, bwd_temporaries_bytes: int) -> Profile:
    """``p`` as a compiled profile whose timeline measured each window at the model's bytes without
    temporaries, the leaves' backward windows ``bwd_temporaries_bytes`` above (eager ones, Rule 5)."""
    g = build_graph(p, selective=False)
    leaves, bare = g.graph["leaves"], window_bytes(g, [], calibrated=False)
    events = [("step_start", None, bare[f"forward of {leaves[0]}"])]
    events += [(kind, n, bare[f"forward of {n}"]) for n in leaves for kind in ("fwd_start", "fwd_end")]
    events += [("forward_end", None, bare["end of forward"]), ("backward_start", None, bare["start of backward"])]
    events += [(kind, n, bare[f"backward of {n}"] + bwd_temporaries_bytes)
               for n in reversed(leaves) for kind in ("bwd_start", "bwd_end")]
    events += [("backward_end", None, bare["optimizer step"]), ("optimizer_end", None, bare["optimizer step"])]
    timeline = [MemoryEvent(seq=i, kind=k, unit=u, live_bytes=b, peak_bytes=b) for i, (k, u, b) in enumerate(events)]
    return p.model_copy(update={"timeline": timeline,
                                "compile": CompileInfo(backend="inductor", torch_version=torch.__version__)})


def test_the_second_compile_bounds_its_own_step():
    """NOTE [ Compiled profile ], Rule 9: the blocks-checkpointed step measured below its prediction
    is predicted at its measurement; the plain step's prediction does not move."""
    p = _with_timeline(synthetic_profile(random_chain(random.Random(0), 4)), bwd_temporaries_bytes=4 << 20)
    blocks = [f"h.{i}" for i in range(4)]
    before = build_graph(p)
    predicted = simulate(before, blocks).peak_bytes
    measured = CompiledStep(forward_peak_bytes=0, backward_peak_bytes=predicted - 100_000, optimizer_peak_bytes=0,
                            peak_bytes=predicted - 100_000, peak_source="test", forward_ms=0.0, backward_ms=0.0,
                            optimizer_ms=0.0, first_compile_s=0.0)
    after = build_graph(with_replay_calibration(with_backward_bounds(p, measured, blocks), measured, blocks))
    assert simulate(after, blocks).peak_bytes == predicted - 100_000
    assert simulate(after, []).peak_bytes == simulate(before, []).peak_bytes


def test_a_checkpointed_block_holds_only_the_inputs_its_compile_saves():
    """NOTE [ Compiled profile ], Rule 4: the block drops an input the partitioner recomputes (rotary
    tables); other units (its submodules among them) keep it."""
    p = synthetic_profile(random_chain(random.Random(0), 2))
    table = max(t.id for t in p.tensors) + 1
    units = [u.model_copy(update={"input_ids": [*u.input_ids, table], "input_bytes": u.input_bytes + 64})
             if u.fqn else u for u in p.units]
    out = {u.fqn: u for u in _without_inputs(units, {"h.1"}, {table}, {table: 64})}
    before = {u.fqn: u for u in units}
    assert table not in out["h.1"].input_ids and out["h.1"].input_bytes == before["h.1"].input_bytes - 64
    assert out["h.0"] == before["h.0"]


def test_a_checkpointed_block_holds_what_its_compile_keeps_to_replay_the_code_before_it():
    """NOTE [ Compiled profile ], Rule 4: an eager tensor that only the compile with the blocks
    checkpointed saves (GPT-2's embeddings, kept to replay the embedding dropout inside the first
    block's replay) is an input of the first checkpointed block after it; one the first compile
    saves already, or one made after every region, is left as it is."""
    from collections import defaultdict

    from planner.model.records import TensorRecord

    p = synthetic_profile(random_chain(random.Random(0), 2))
    units = {u.fqn: u for u in p.units}
    new = max(t.id for t in p.tensors) + 1
    early = TensorRecord(id=new, nbytes=64, created_seq=units["h.0"].fwd_start_seq - 1)
    late = TensorRecord(id=new + 1, nbytes=64, created_seq=units["h.1"].fwd_end_seq + 1)
    p = p.model_copy(update={"tensors": [*p.tensors, early, late]})
    crossing: dict[str, set[int]] = defaultdict(set)
    for t in (early.id, late.id, p.saves[0].tensor_id):
        _replayed_before(p, {f: u.id for f, u in units.items()}, ["h.0", "h.1"], t, {s.tensor_id for s in p.saves},
                         crossing)
    assert dict(crossing) == {units["h.0"].id: {early.id}}


class _CausalBlock(torch.nn.Module):
    """Attention whose causal mask each block makes from the sequence length alone: inductor's CSE
    keeps one, made in the first block, for every block (as GPT-2's under compile)."""

    def __init__(self, width: int):
        super().__init__()
        self.qk, self.out = torch.nn.Linear(width, 2 * width), torch.nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = h.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()
        q, k = self.qk(h).chunk(2, dim=-1)
        scores = (q @ k.transpose(1, 2)).masked_fill(~causal, float("-inf"))
        return h + self.out(scores.softmax(-1) @ h)


class _CausalModel(torch.nn.Module):
    def __init__(self, width: int = 16, vocab: int = 32):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.blocks = torch.nn.Sequential(*[_CausalBlock(width) for _ in range(2)])

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.blocks(self.embed(input_ids)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _causal_model() -> _CausalModel:
    torch.manual_seed(0)
    return _CausalModel()


def _causal_batch() -> dict:
    ids = torch.randint(0, 32, (2, 48), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def _held_beyond_saved(p: Profile, fqns: list[str]) -> int:
    """Bytes the model holds with ``fqns`` checkpointed less the bytes the compile of that set saves."""
    model = _causal_model()
    spec = StepSpec(device="cpu", threads=1, steps=1, compile="inductor")
    _step, graphs = measure_compiled(model, _causal_batch(), p, step=spec, progress=lambda _m: None,
                                     checkpointed=fqns, timed=False)
    saved, _stacks = saved_storages(graphs, ModuleNames(model))
    g = build_graph(p)
    held = CostModel.of(g).holdings(frozenset(n for n in g.nodes if g.nodes[n]["fqn"] in fqns))
    return sum(g.graph["tensor_bytes"][t] for t in held) - sum(s.nbytes for s in saved)


def test_what_a_checkpointed_block_makes_for_later_blocks_is_held_only_while_it_is_checkpointed():
    """NOTE [ Compiled profile ], Rule 4 (issue #24): the compile saves the mask the first block makes
    for every block only when that block is checkpointed, and recomputes it otherwise, and it keeps
    no RNG state per region; the model holds the same, so what it holds beyond the compile's saves
    does not depend on the set."""
    p = profile(_causal_model(), _causal_batch(), device="cpu", threads=1, steps=1, compile="inductor")
    assert _held_beyond_saved(p, ["blocks.1"]) == _held_beyond_saved(p, ["blocks.0", "blocks.1"])


def test_compile_refusals():
    m = _tiny()
    with pytest.raises(BadInput, match="compile backend 'aot_eager' is not supported; choose one of inductor"):
        profile(m["build_model"](), m["example_inputs"](), device="cpu", compile="aot_eager")
    with pytest.raises(BadInput, match="cannot be profiled on device 'meta'"):
        profile(m["build_model"](), m["example_inputs"](), device="meta", target="h100", compile="inductor")
    r = invoke("plan", "--budget", "1GB", "--compile-backend", "inductor", "--profile", "x.json")
    assert r.exit_code == 2 and "--compile-backend chooses the backend of --compile" in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_plan_on_cuda_fits_its_budget():
    m = _tiny()
    prof = profile(m["build_model"](), m["example_inputs"](), device="cuda", steps=1, compile="inductor")
    assert prof.compile is not None and prof.step.peak_source == "cuda-allocator"
    g = build_graph(prof)
    none = simulate(g, []).peak_bytes
    every = simulate(g, [n for n in g.nodes if n.startswith("blocks.")]).peak_bytes
    # on an H200 the midpoint was under the lowest feasible budget (67.07 MiB, of which 64 are cuBLAS's workspaces)
    plan = plan_from_profile(prof, max((none + every) // 2, min_feasible_bytes(g)) + 16 * 1024)
    torch._dynamo.reset()
    model = m["build_model"]().cuda()
    apply_plan(model, plan)
    batch = {k: v.cuda() for k, v in m["example_inputs"]().items()}
    step = make_step(torch.compile(model), batch, optimizer=make_optimizer("adamw", model))
    step()
    step()
    _peaks, peak, source = phase_peaks(step, torch.device("cuda"), 0)
    torch._dynamo.reset()
    assert source == "cuda-allocator" and peak <= plan.budget_bytes
