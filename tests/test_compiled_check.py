"""A compiled plan is compiled and measured before it is returned (NOTE [ The compiled plan is checked ],
planner/act/compiled_check.py): the loop on a synthetic profile with a stated measure, then the real
compile of a small model through the API and the CLI."""

from __future__ import annotations

import random

import pytest
import torch

import planner
from planner.act.api import plan_from_profile
from planner.act.compiled_check import CHECKED_AT, CHECKS
from planner.errors import BudgetInfeasible
from planner.model.graph import build_graph
from planner.model.schema import CompiledPeak, CompileInfo, Plan, Profile
from planner.model.synthetic import random_chain, synthetic_profile
from solvers.cost_model import simulate
from tests.conftest import invoke
from tests.model_files import TINY_SEQ_MODEL

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _compiled(measured: list[CompiledPeak] = ()) -> Profile:
    p = synthetic_profile(random_chain(random.Random(3), 6))
    return p.model_copy(update={"compile": CompileInfo(backend="inductor", torch_version=torch.__version__,
                                                       measured=list(measured))})


class _Measure:
    """A compiled step whose peak is the cost model's plus ``over(plan)`` bytes; counts its compiles."""

    def __init__(self, over) -> None:
        self.over, self.sets = over, []

    def __call__(self, plan: Plan) -> int:
        self.sets.append(list(plan.checkpoints))
        return plan.predicted.peak_bytes + self.over(plan)


def _mid_budget(p: Profile) -> int:
    g = build_graph(p)
    none, every = simulate(g, []).peak_bytes, simulate(g, [n for n in g.nodes if n.startswith("h.")]).peak_bytes
    return (none + every) // 2


def test_a_plan_measured_under_its_prediction_is_predicted_at_its_measurement():
    p = _compiled()
    budget = _mid_budget(p)
    measure = _Measure(lambda plan: -1000)
    plan = plan_from_profile(p, budget, check=measure)
    alone = plan_from_profile(p, budget)
    assert measure.sets == [alone.checkpoints] and plan.checkpoints == alone.checkpoints
    assert plan.predicted.peak_bytes == alone.predicted.peak_bytes - 1000 and plan.predicted.peak_at == CHECKED_AT
    assert plan.predicted.recompute_ms == alone.predicted.recompute_ms
    assert plan.compile.measured == [CompiledPeak(checkpoints=alone.checkpoints,
                                                  peak_bytes=alone.predicted.peak_bytes - 1000)]


def test_a_plan_measured_above_its_prediction_within_the_budget_is_predicted_at_the_measurement(tmp_path):
    p = _compiled()
    budget = _mid_budget(p)
    alone = plan_from_profile(p, budget)
    room = alone.budget_bytes - alone.headroom_bytes - alone.predicted.peak_bytes
    assert room > 10
    plan = plan_from_profile(p, budget, check=_Measure(lambda plan: room))
    assert plan.checkpoints == alone.checkpoints
    assert plan.predicted.peak_bytes == alone.predicted.peak_bytes + room
    assert plan.predicted.activations_bytes == alone.predicted.activations_bytes + room
    assert plan.predicted.peak_at == CHECKED_AT
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan  # the raised prediction still adds up and fits


def test_a_plan_measured_over_the_budget_is_planned_again_lower_by_the_excess():
    p = _compiled()
    budget = _mid_budget(p)
    first = plan_from_profile(p, budget)
    usable = first.budget_bytes - first.headroom_bytes
    excess = usable - first.predicted.peak_bytes + 50_000  # the first set measures 50,000 B over the budget
    measure = _Measure(lambda plan: excess if plan.checkpoints == first.checkpoints else 0)
    plan = plan_from_profile(p, budget, check=measure)
    assert measure.sets[0] == first.checkpoints and plan.checkpoints != first.checkpoints
    assert plan.predicted.peak_bytes <= usable - excess  # what the solver was asked for on the second try
    measured = {tuple(m.checkpoints): m.peak_bytes for m in plan.compile.measured}
    assert measured[tuple(first.checkpoints)] == usable + 50_000 and measured[tuple(plan.checkpoints)] <= usable


def test_no_plan_measured_within_the_budget_names_the_measured_peaks():
    p = _compiled()
    budget = _mid_budget(p)
    measure = _Measure(lambda plan: 10 << 20)  # every set 10 MiB above its prediction
    with pytest.raises(BudgetInfeasible) as e:
        plan_from_profile(p, budget, check=measure)
    assert 1 <= len(measure.sets) <= CHECKS
    text = str(e.value)
    assert "under torch.compile" in text and "measured" in text and "\n" not in text
    assert e.value.min_feasible_bytes > budget  # the budget the lowest measured peak fits


def test_a_set_the_profile_measured_is_not_compiled_again():
    p = _compiled()
    budget = _mid_budget(p)
    alone = plan_from_profile(p, budget)
    known = CompiledPeak(checkpoints=list(reversed(alone.checkpoints)), peak_bytes=alone.predicted.peak_bytes - 7)
    measure = _Measure(lambda plan: 0)
    plan = plan_from_profile(_compiled([known]), budget, check=measure)
    assert measure.sets == [] and plan.checkpoints == alone.checkpoints
    assert plan.compile.measured == [known] and plan.predicted.peak_bytes == known.peak_bytes


def test_a_measured_set_within_the_budget_is_the_plan_when_the_cost_model_puts_it_over():
    p = _compiled()
    g = build_graph(p)
    blocks = sorted(n for n in g.nodes if n.startswith("h."))
    every = simulate(g, blocks)
    budget = planner.act.api.budget_with_headroom(every.peak_bytes - 1)  # the cost model: nothing fits
    with pytest.raises(BudgetInfeasible):
        plan_from_profile(p, budget)
    known = CompiledPeak(checkpoints=blocks, peak_bytes=every.peak_bytes - 2)  # measured: it fits
    measure = _Measure(lambda plan: 0)
    plan = plan_from_profile(_compiled([known]), budget, check=measure)
    floor = plan_from_profile(p, budget + 1000)  # the cost model's plan at its own lowest budget
    assert measure.sets == [floor.checkpoints] != [blocks]  # measured at its prediction: over (Rule 5)
    assert sorted(plan.checkpoints) == blocks and plan.solver.name == "measured"
    assert plan.predicted.peak_bytes == every.peak_bytes - 2
    assert plan.predicted.recompute_ms == pytest.approx(every.recompute_ms)


def test_the_cost_models_lowest_plan_is_measured_when_nothing_is_predicted_within_the_budget(tmp_path):
    p = _compiled()
    g = build_graph(p)
    every = simulate(g, [n for n in g.nodes if n.startswith("h.")]).peak_bytes  # the cost model's lowest
    budget = planner.act.api.budget_with_headroom(every) - 5000  # the cost model: nothing fits
    with pytest.raises(BudgetInfeasible) as refused:
        plan_from_profile(p, budget)
    floor = plan_from_profile(p, refused.value.min_feasible_bytes)
    measure = _Measure(lambda plan: -10_000)  # every set measures 10,000 B below the cost model
    plan = plan_from_profile(p, budget, check=measure)
    assert measure.sets == [floor.checkpoints] and plan.checkpoints == floor.checkpoints
    assert plan.budget_bytes == budget and plan.predicted.peak_bytes == floor.predicted.peak_bytes - 10_000
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan  # fits the budget asked for, as measured
    with pytest.raises(BudgetInfeasible) as e:  # measured at the cost model's figure: nothing fits, one compile
        plan_from_profile(p, budget, check=_Measure(lambda plan: 0))
    assert f"was compiled and measured at {floor.predicted.peak_bytes} bytes" in str(e.value)
    assert e.value.min_feasible_bytes == refused.value.min_feasible_bytes


def _plans_across(p: Profile) -> list[Plan]:
    """The cost model's plans at 40 budgets from its lowest (every block checkpointed) to nothing checkpointed."""
    g = build_graph(p)
    lo = planner.act.api.budget_with_headroom(simulate(g, [n for n in g.nodes if n.startswith("h.")]).peak_bytes)
    hi = simulate(g, []).peak_bytes
    return [plan_from_profile(p, lo + (hi - lo) * k // 40) for k in range(40)]


def _spend_case():
    """A budget with a margin: the profile, the budget, the cost model's plan there, the cheaper plan the
    solver finds when the usable budget is raised by ``raise_bytes``, ``raise_bytes`` and the usable budget."""
    p = _compiled()
    plans = _plans_across(p)
    for first, next_ in zip(plans, plans[1:]):
        usable = first.budget_bytes - first.headroom_bytes
        raise_bytes = next_.predicted.peak_bytes - usable
        margin = usable - first.predicted.peak_bytes + raise_bytes  # measured that far below: the margin
        if next_.checkpoints != first.checkpoints and raise_bytes > 0 and margin >= 0.03 * first.budget_bytes:
            raised = plan_from_profile(p, planner.act.api.budget_with_headroom(usable + raise_bytes))
            return p, first.budget_bytes, first, raised, raise_bytes, usable
    raise AssertionError("no budget whose plan changes when raised")


def test_a_plan_measured_well_under_the_budget_spends_the_margin_on_a_cheaper_plan():
    p, budget, first, raised, tenth, usable = _spend_case()
    assert raised.predicted.recompute_ms < first.predicted.recompute_ms and raised.checkpoints != first.checkpoints
    measure = _Measure(lambda plan: -tenth)  # every set that far below the cost model (Rule 7)
    said: list[str] = []
    plan = plan_from_profile(p, budget, check=measure, progress=said.append)
    assert measure.sets == [first.checkpoints, raised.checkpoints] and plan.checkpoints == raised.checkpoints
    assert any(m.startswith("the plan measured ") and " under the budget: a plan recomputing " in m for m in said)
    assert plan.predicted.peak_bytes == raised.predicted.peak_bytes - tenth <= usable
    assert plan.predicted.recompute_ms == raised.predicted.recompute_ms and plan.predicted.peak_at == CHECKED_AT
    assert [m.checkpoints for m in plan.compile.measured] == [first.checkpoints, raised.checkpoints]


def test_a_cheaper_plan_measured_over_the_budget_leaves_the_first():
    p, budget, first, raised, tenth, usable = _spend_case()
    over = usable - raised.predicted.peak_bytes + 1  # the cheaper set measures one byte over the budget
    measure = _Measure(lambda plan: over if plan.checkpoints == raised.checkpoints else -tenth)
    plan = plan_from_profile(p, budget, check=measure)
    assert measure.sets == [first.checkpoints, raised.checkpoints] and plan.checkpoints == first.checkpoints
    assert plan.predicted.peak_bytes == first.predicted.peak_bytes - tenth
    assert {tuple(m.checkpoints): m.peak_bytes for m in plan.compile.measured}[tuple(raised.checkpoints)] == usable + 1


def test_a_cheaper_plan_measured_over_the_budget_is_followed_by_the_secant(monkeypatch):
    """Rule 7's second try: the cost model's error differs from set to set, so after a cheaper set measured over,
    the check plans for the secant between the two measured sets and keeps the set between them that fits."""
    from planner.act import compiled_check

    monkeypatch.setattr(compiled_check, "SPEND_AT", 0.0)
    monkeypatch.setattr(compiled_check, "SPEND_GAIN", 0.0)
    p = _compiled()
    plans = _plans_across(p)
    case = None
    for first, far in ((a, b) for i, a in enumerate(plans) for b in plans[i + 1:]):
        if far.predicted.peak_bytes <= first.predicted.peak_bytes:
            continue
        between = plan_from_profile(p, planner.act.api.budget_with_headroom(far.predicted.peak_bytes - 1))
        if len({tuple(first.checkpoints), tuple(far.checkpoints), tuple(between.checkpoints)}) == 3:
            case = first, far, between
            break
    assert case is not None, "no three plans apart"
    first, far, between = case
    usable = first.budget_bytes - first.headroom_bytes
    by = far.predicted.peak_bytes - usable  # the first set's error: the first try plans for ``far``
    errors = {tuple(first.checkpoints): -by, tuple(far.checkpoints): usable + 1 - far.predicted.peak_bytes,
              tuple(between.checkpoints): -by}
    measure = _Measure(lambda plan: errors[tuple(plan.checkpoints)])
    plan = plan_from_profile(p, first.budget_bytes, check=measure)
    assert measure.sets == [first.checkpoints, far.checkpoints, between.checkpoints]
    assert plan.checkpoints == between.checkpoints and plan.predicted.peak_bytes == between.predicted.peak_bytes - by
    assert between.predicted.recompute_ms < first.predicted.recompute_ms


def test_a_margin_under_spend_at_is_not_spent(monkeypatch):
    from planner.act import compiled_check

    p, budget, first, _raised, by, usable = _spend_case()
    margin = usable - (first.predicted.peak_bytes - by)  # as the first test measures it: spent there
    monkeypatch.setattr(compiled_check, "SPEND_AT", margin / first.budget_bytes + 1e-6)
    measure = _Measure(lambda plan: -by)
    plan = plan_from_profile(p, budget, check=measure)
    assert measure.sets == [first.checkpoints] and plan.checkpoints == first.checkpoints


def test_a_cheaper_plan_saving_under_spend_gain_is_not_compiled(monkeypatch):
    """Rule 7 spends a compile only on a plan predicted to save ``SPEND_GAIN`` of the found plan's recompute."""
    from planner.act import compiled_check

    p, budget, first, raised, by, _usable = _spend_case()
    gain = (first.predicted.recompute_ms - raised.predicted.recompute_ms) / first.predicted.recompute_ms
    monkeypatch.setattr(compiled_check, "SPEND_GAIN", gain + 1e-6)
    measure = _Measure(lambda plan: -by)
    plan = plan_from_profile(p, budget, check=measure)
    assert measure.sets == [first.checkpoints] and plan.checkpoints == first.checkpoints
    monkeypatch.setattr(compiled_check, "SPEND_GAIN", gain - 1e-6)  # just within it: spent
    measure = _Measure(lambda plan: -by)
    assert plan_from_profile(p, budget, check=measure).checkpoints == raised.checkpoints
    assert measure.sets == [first.checkpoints, raised.checkpoints]


@pytest.fixture(scope="module")
def op_level_profile():
    """A compiled stamp on test_selective's model, profiled eagerly, its dispatch cost set aside as that
    file's ``prof`` fixture sets it: plans op by op that the synthetic chains cannot give."""
    from planner.profiling import profile
    from tests.test_selective import _inputs, _loss, _net

    measured = profile(_net(), _inputs(), loss_fn=_loss, device="cpu", steps=1)
    units = [u.model_copy(update={"forward_spread_ms": 0.0}) for u in measured.units]
    return measured.model_copy(update={
        "sac_recomputed_op_ms": 0.0, "sac_kept_op_ms": 0.0, "units": units, "sac_recomputed_op_spread_ms": 0.0,
        "sac_kept_op_spread_ms": 0.0,
        "compile": CompileInfo(backend="inductor", torch_version=torch.__version__, measured=[])})


def test_the_lowest_whole_module_plan_is_measured_when_the_lowest_plan_measures_over(op_level_profile, monkeypatch):
    from planner.act import compiled_check

    p = op_level_profile
    with pytest.raises(BudgetInfeasible) as e:
        plan_from_profile(p, 1, selective=False)
    floor = plan_from_profile(p, e.value.min_feasible_bytes, selective=False)
    op = next(plan_from_profile(p, b) for b in range(floor.budget_bytes, 1 << 40, floor.budget_bytes // 20)
              if plan_from_profile(p, b).selective)
    real = compiled_check._floor_plan
    monkeypatch.setattr(compiled_check, "_floor_plan",  # the cost model's lowest plan: op by op, as on the wide Llama
                        lambda prof, spec, graph, budget: op if spec.selective else real(prof, spec, graph, budget))
    measure = _Measure(lambda plan: (10 << 20) if plan.selective else -10_000)  # op by op: far over; whole: under
    budget = floor.budget_bytes - 5000  # below the cost model's floor
    plan = plan_from_profile(p, budget, check=measure)
    assert measure.sets == [op.checkpoints, floor.checkpoints] and not plan.selective
    assert plan.checkpoints == floor.checkpoints and plan.budget_bytes == budget
    assert plan.predicted.peak_bytes == floor.predicted.peak_bytes - 10_000


def test_an_eager_profile_is_not_checked():
    p = synthetic_profile(random_chain(random.Random(3), 6))
    measure = _Measure(lambda plan: 0)
    plan = plan_from_profile(p, _mid_budget(p), check=measure)
    assert measure.sets == [] and plan.compile is None


# ----------------------------------------------------------------------------- the real compile


def test_plan_compile_measures_the_chosen_plan_within_its_budget(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY_SEQ_MODEL)
    made = invoke("profile", "--compile", str(tmp_path / "tiny.py"), "--threads", "1", "--steps", "1",
                  "-o", str(tmp_path / "profile.json"))
    assert made.exit_code == 0, made.output
    prof = Profile.load(tmp_path / "profile.json")
    assert [m.checkpoints for m in prof.compile.measured][0] == []  # the profile's two compiles
    assert len(prof.compile.measured) == 2
    assert prof.compile.aot_cse is False  # its regions compiled apart (NOTE [ CSE across checkpointed regions ])
    assert prof.compile.fwd_side_effects_replayed is False  # NOTE [ Side effects in a checkpointed region ]
    g = build_graph(prof)
    blocks = sorted(n for n in g.nodes if n.startswith("blocks."))
    budget = planner.act.api.budget_with_headroom(simulate(g, blocks[:2]).peak_bytes)  # a set neither compile ran
    result = invoke("plan", "--profile", str(tmp_path / "profile.json"), str(tmp_path / "tiny.py"),
                    "--budget", str(budget), "-o", str(tmp_path / "plan.json"))
    assert result.exit_code == 0, result.output
    plan = Plan.load(tmp_path / "plan.json")
    mine = [m for m in plan.compile.measured if set(m.checkpoints) == set(plan.checkpoints)]
    assert plan.checkpoints and mine and mine[0].peak_bytes <= budget - plan.headroom_bytes
    assert len(plan.compile.measured) == 3 and plan.predicted.peak_bytes >= mine[0].peak_bytes
    assert "compiled step: measured at" in result.output
    again = invoke("plan", "--profile", str(tmp_path / "profile.json"), "--budget", str(budget))
    assert again.exit_code == 0 and "not measured with this plan" in again.output  # nothing to compile


def test_the_python_api_checks_a_compiled_plan_too():
    ns: dict = {}
    exec(TINY_SEQ_MODEL, ns)  # noqa: S102 (the shared test model file)
    model, batch = ns["build_model"](), ns["example_inputs"]()
    plan = planner.plan(model, 10 << 20, inputs=batch, device="cpu", threads=1, steps=1, compile="inductor")
    assert not plan.checkpoints  # the plain compiled step fits: the profile measured it, no compile more
    assert [m.checkpoints for m in plan.compile.measured][0] == [] and len(plan.compile.measured) == 2
    assert plan.predicted.peak_bytes == plan.compile.measured[0].peak_bytes


def test_an_op_level_plan_is_known_by_what_each_region_keeps():
    from types import SimpleNamespace

    from planner.act.compiled_check import measured_of
    from planner.model.schema import OpRef, SelectiveRegion

    def region(*ops: int) -> SelectiveRegion:
        return SelectiveRegion(fqn="h.0", unit="h.0", save=[OpRef(op="aten.mm.default", index=i) for i in ops])

    measured = [CompiledPeak(checkpoints=["h.1"], selective=[region(0, 1)], peak_bytes=100),
                CompiledPeak(checkpoints=["h.1"], peak_bytes=200)]

    def plan(selective):
        return SimpleNamespace(checkpoints=["h.1"], selective=selective,
                               compile=SimpleNamespace(measured=measured))

    assert measured_of(plan([region(0, 1)])).peak_bytes == 100
    assert measured_of(plan([])).peak_bytes == 200
    assert measured_of(plan([region(0)])) is None  # keeps another set of outputs: another compiled step


def test_the_registration_count_is_not_traced_by_torch_compile():
    """NOTE [ Checkpointed twice ], Rule 2: a Hugging Face forward's layer slice registers modules inside the
    compiled forward; dynamo guarded on the weak set of planned modules, and a model freed during a later
    compile made the guard read past its end (the wide Llama's second check compile: "the model's forward
    raised IndexError")."""
    from torch import nn

    from planner.act.existing import _Registrations, _count_registrations

    _count_registrations()
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    others = [nn.Linear(2, 2) for _ in range(5)]
    _Registrations.parents.update([*others, layers])
    count = _Registrations.count

    def forward(x):
        for layer in layers[:2]:  # registers each layer into a new ModuleList, as LlamaModel's slice does
            x = layer(x)
        return x

    explained = torch._dynamo.explain(forward)(torch.randn(2, 4))
    assert not [g.name for g in explained.out_guards if "_Registrations" in g.name]
    assert _Registrations.count == count
    layers.append(nn.Linear(4, 4))  # eager, into a planned model's module: counted
    assert _Registrations.count == count + 1
