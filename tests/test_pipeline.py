"""Pipeline stages (NOTE [ Pipeline stages ] in solvers/pipeline.py): the schedule rules, the stage
peak against the one-process model, plan files, bad input, and one plan verified on two ranks; and
tensor-parallel ranks (NOTE [ Tensor-parallel ranks ]) verified on two ranks."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from planner.act.api import graph_for
from planner.model.schema import PIPELINE_PLAN_VERSION, Plan, Profile
from planner.model.stages import stage_plan
from solvers.cost_model import simulate
from solvers.pipeline import actions, held_bytes, in_flight, plan_stage, solving_graph, split_layers, stage_peak
from tests.conftest import fewest_dispatch_rounds, invoke

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "examples" / "llama_pp.py"
PROFILE = ROOT / "profiles" / "models" / "gpt2-tiny-cpu.json"


def test_blocks_split_evenly_the_first_stages_take_the_rest():
    assert split_layers(4, 2) == [(0, 2), (2, 4)]
    stages = split_layers(126, 16)
    assert [b - a for a, b in stages] == [8] * 14 + [7] * 2 and stages[-1][1] == 126


def test_in_flight_and_order_follow_the_schedules():
    assert [in_flight("1f1b", 4, s, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, s, 2) for s in range(4)] == [2, 2, 2, 1]
    assert in_flight("gpipe", 4, 3, 8) == 8
    assert actions("gpipe", 2, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert actions("1f1b", 2, 0, 4) == [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)]
    assert actions("1f1b", 2, 1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    for sched in ("1f1b", "gpipe"):
        for s in range(3):
            acts = actions(sched, 3, s, 5)
            live = peak = 0
            for kind, _ in acts:
                live += 1 if kind == "F" else -1
                peak = max(peak, live)
            assert sorted(acts) == sorted([("F", j) for j in range(5)] + [("B", j) for j in range(5)])
            assert peak == in_flight(sched, 3, s, 5)


def test_interleaved_order_is_torchs_and_sets_each_stages_in_flight():
    """NOTE [ Interleaved stages ], Rules 1-2: the order torch 2.13's ScheduleInterleaved1F1B gives rank 0 of pp 2 with
    2 stages each and 4 micro-batches; stage s holds 4 - s micro-batches at most."""
    from planner.act.interleaved import interleaved_order
    from solvers.pipeline import order_in_flight

    order = interleaved_order(2, 2, 4, 0)
    assert " ".join(f"{s}{k}{j}" for k, s, j in order) == ("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 "
                                                           "0B2 0B3")
    flights = [order_in_flight(interleaved_order(2, 2, 4, s % 2), s) for s in range(4)]
    assert flights == [4, 3, 2, 1]


def _stage_graph(stage: int, stages: int, schedule: str, micro_batches: int, **sizes: int):
    g = graph_for(Profile.load(PROFILE), selective=False)
    g.graph.update(pp_stages=stages, pp_stage=stage, pp_schedule=schedule, pp_micro_batches=micro_batches,
                   pp_recv_bytes=sizes.get("recv", 0), pp_send_bytes=sizes.get("send", 0),
                   pp_output_bytes=sizes.get("out", 0), pp_batch_bytes=sizes.get("batch", 0))
    return g


def test_one_micro_batch_on_the_last_stage_is_the_one_process_peak():
    g = _stage_graph(1, 2, "1f1b", 1)
    assert stage_peak(g, []).peak_bytes == simulate(g, []).peak_bytes


def test_micro_batches_in_flight_add_what_each_holds():
    one = simulate(_stage_graph(0, 2, "gpipe", 1), []).peak_bytes
    g = _stage_graph(0, 2, "gpipe", 4, out=1000)
    sp = stage_peak(g, [])
    assert sp.in_flight == 4 and sp.held_bytes == held_bytes(g, []) > 1000
    assert sp.peak_bytes >= one + 3 * sp.held_bytes + 1000 + 4 * 0
    assert stage_peak(_stage_graph(0, 2, "1f1b", 4, out=1000), []).peak_bytes < sp.peak_bytes  # 2 in flight, not 4


def test_a_stage_plan_fits_its_stage_peak_in_the_budget():
    from planner.act.api import solve_graph

    g = _stage_graph(0, 2, "gpipe", 3, out=1000)

    def solve(graph, b: int):
        sol = solve_graph(graph, b, solver="auto")
        return None if sol.status == "infeasible" else (list(sol.checkpointed), dict(sol.selective))

    gs = solving_graph(g)
    assert gs is not g and sum(gs.graph["tensor_bytes"].values()) > sum(g.graph["tensor_bytes"].values())
    floor, ceiling = plan_stage(g, 0, solve).lowest_peak_bytes, stage_peak(g, []).peak_bytes
    assert floor < ceiling
    usable = (floor + ceiling) // 2
    chosen = plan_stage(g, usable, solve).chosen
    assert chosen is not None and chosen[0] and stage_peak(g, *chosen).peak_bytes <= usable
    for unit in chosen[0]:  # Rule 9's last pass: no checkpoint the stage peak does not need
        assert stage_peak(g, [u for u in chosen[0] if u != unit]).peak_bytes > usable
    blocks = [u for u in g.graph["fsdp_units"] if u in g]
    assert floor <= stage_peak(g, blocks).peak_bytes  # the search reaches every block checkpointed at least
    assert plan_stage(g, floor - 1, solve).chosen is None
    assert plan_stage(g, ceiling, solve).chosen == ([], {})


def test_stages_of_one_shape_share_one_profile():
    """NOTE [ One profile per stage shape ]: on fake tensors, 4 stages of one layer each profile 3 shapes, and
    stage 2's profile (stage 1's, moved one layer on) equals its own in every field but the creation time."""
    from planner.act.pipeline import _profile_stage, _shapes, pipeline_layout, profile_stages
    from planner.profiling import profile as run_profile
    from planner.profiling.meta import build_on_meta
    from planner.profiling.model_file import load_model_file
    from planner.spec import StepSpec

    mf, layout, step = load_model_file(LLAMA), pipeline_layout(4, "1f1b", 4), StepSpec(device="meta", target="h100")
    said: list[str] = []
    stages = profile_stages(mf, layout, step=step, progress=said.append)
    assert [m.startswith("profiling") for m in said] == [True, True, False, True]
    build = lambda: build_on_meta(mf.build_model)  # noqa: E731
    own = _profile_stage(build(), 2, 4, _shapes(build(), mf.example_inputs(), layout), step, run_profile)
    moved, mine = stages[2].profile.model_dump(), own.model_dump()
    assert "model.layers.2" in own.fingerprint.modules and "model.layers.1" not in own.fingerprint.modules
    assert {k for k in mine if moved[k] != mine[k]} <= {"created_at"}


def test_data_parallel_stages_add_buckets_or_shard_the_state():
    """Rule 10: DDP's buckets (the gradients' size) at every point; FSDP2 holds shards of the parameters and
    optimizer state, at most R + every block unsharded beside them, and steps on shards."""
    plain = _stage_graph(0, 2, "1f1b", 4, out=1000)
    one = stage_peak(plain, [])
    ddp = _stage_graph(0, 2, "1f1b", 4, out=1000)
    ddp.graph.update(pp_dp=4, pp_dp_sharding="ddp")
    grads = plain.graph["grads_bytes"]
    assert stage_peak(ddp, []).peak_bytes == one.peak_bytes + grads
    fsdp = _stage_graph(0, 2, "1f1b", 4, out=1000)
    fsdp.graph.update(pp_dp=4, pp_dp_sharding="fsdp")
    sp = stage_peak(fsdp, [])
    gg = plain.graph
    shards = -(-gg["params_bytes"] // 4) + -(-gg["optimizer_bytes"] // 4)
    assert sp.optimizer_bytes == -(-gg["optimizer_bytes"] // 4)
    assert sp.peak_bytes <= one.peak_bytes - gg["params_bytes"] - gg["optimizer_bytes"] + shards + gg["params_bytes"]
    assert sp.peak_bytes < one.peak_bytes and sp.in_flight == one.in_flight and sp.held_bytes == one.held_bytes


@contextlib.contextmanager
def profiled_once() -> Iterator[None]:
    """Inside, ``planner.profiling.profile`` measures a step once: called again for a model of the same class and
    parameter count on the same step, it returns the first call's profile (a test that plans one rank-local
    model at two budgets, the first only to read its unplanned peak, profiles it once)."""
    import planner.profiling

    measure, seen = planner.profiling.profile, []

    def once(model, inputs=None, *, step=None, **fields):
        key = (type(model), sum(p.numel() for p in model.parameters()), step, fields)
        prof = next((prof for k, prof in seen if k == key), None)
        if prof is None:
            prof = measure(model, inputs, step=step, **fields)
            seen.append((key, prof))
        return prof

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner.profiling, "profile", once)
        yield


def _halfway_stages(layout: Any, *, tp: int = 1, sequence_parallel: bool = False, solve: Any = None):
    """(plan, profiled stages): each stage of ``layout`` profiled on the CPU (one thread; the fewest dispatch-timing
    rounds, the tests check bytes) and planned at the budget halfway between the layout's lowest feasible and
    no-checkpoint peaks (the worst rank's)."""
    from planner.act.pipeline import plan_stages, profile_stages
    from planner.model.fingerprint import fingerprint
    from planner.profiling.meta import build_on_meta
    from planner.profiling.model_file import load_model_file
    from planner.spec import StepSpec

    mf = load_model_file(LLAMA)
    with fewest_dispatch_rounds():
        profiled = profile_stages(mf, layout, step=StepSpec(device="cpu", threads=1, steps=1), tp=tp,
                                  sequence_parallel=sequence_parallel)
    fp = fingerprint(build_on_meta(mf.build_model), mf.example_inputs())
    roomy = plan_stages(profiled, "1GB", fingerprint=fp, solve=solve)
    lowest = max(st.predicted.min_feasible_bytes for st in roomy.stages)
    top = max(st.predicted.no_checkpoint_peak_bytes for st in roomy.stages)
    return plan_stages(profiled, (lowest + top) // 2, fingerprint=fp, solve=solve), profiled


@pytest.fixture(scope="module")
def pipeline_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pp 2, interleaved 1F1B with 2 stages per rank (NOTE [ Interleaved stages ]), 4 micro-batches, each stage's
    layers shared by 2 tensor-parallel ranks with the sequence sharded (Rule 8), at the budget halfway between the
    layout's lowest feasible and no-checkpoint peaks (the worst rank's), planned on the CPU (1F1B is verified on
    ranks below, with FSDP2 and with tp)."""
    from planner.act.pipeline import pipeline_layout

    plan, _ = _halfway_stages(pipeline_layout(2, "interleaved-1f1b", 4, stages_per_rank=2), tp=2,
                              sequence_parallel=True)
    path = tmp_path_factory.mktemp("pp") / "plan.json"
    plan.save(path)
    return path


@pytest.fixture(scope="module")
def fsdp_stages_plan() -> tuple[Plan, int]:
    """pp 2 x dp 2 under FSDP2 (NOTE [ Pipeline stages ], Rule 10), 1F1B with 4 micro-batches, at the halfway budget:
    the plan, and the first stage's optimizer bytes unsharded."""
    from planner.act.pipeline import pipeline_layout
    from planner.spec import SolveSpec

    plan, profiled = _halfway_stages(pipeline_layout(2, "1f1b", 4), solve=SolveSpec(world_size=4, sharding="fsdp"))
    return plan, profiled[0].profile.step.optimizer_bytes


@pytest.fixture(scope="module")
def tp_fsdp_plan() -> Plan:
    """tp 2 x dp 2 under FSDP2, planned on the rank-local model at 80% of its no-checkpoint peak (read from a plan
    at 1GB of the same profile)."""
    from planner.act.tensor_parallel import plan_tensor_parallel
    from planner.profiling.model_file import load_model_file
    from planner.spec import SolveSpec, StepSpec

    mf = load_model_file(LLAMA)
    step, ranks = StepSpec(device="cpu", threads=1, steps=1), SolveSpec(world_size=4, sharding="fsdp")
    with fewest_dispatch_rounds(), profiled_once():
        roomy = plan_tensor_parallel(mf, "1GB", 2, step=step, solve=ranks)
        return plan_tensor_parallel(mf, int(roomy.predicted.no_checkpoint_peak_bytes * 0.8), 2, step=step, solve=ranks)


@pytest.fixture(scope="module")
def tp_pp_plan() -> Plan:
    """tp 2 + sequence parallelism x pp 2, 1F1B with 2 micro-batches, at the halfway budget."""
    from planner.act.pipeline import pipeline_layout

    return _halfway_stages(pipeline_layout(2, "1f1b", 2), tp=2, sequence_parallel=True)[0]


@pytest.fixture(scope="module")
def four_rank_reports(pipeline_plan: Path, fsdp_stages_plan: tuple[Plan, int], tp_fsdp_plan: Plan, tp_pp_plan: Plan,
                      tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plan files of the four layouts of four ranks, verified on one set of gloo ranks (``verify_ranks_together``:
    the ranks start, importing torch and transformers, once for the four), one step between the compared step and
    the measured one."""
    from planner.act.verify_ranks import verify_ranks_together

    folder = tmp_path_factory.mktemp("ranks")
    paths = {"interleaved": pipeline_plan, "fsdp stages": fsdp_stages_plan[0].save(folder / "fsdp_stages.json"),
             "tp x fsdp": tp_fsdp_plan.save(folder / "tp_fsdp.json"), "tp x pp": tp_pp_plan.save(folder / "tp_pp.json")}
    return dict(zip(paths, verify_ranks_together(LLAMA, list(paths.values()), steps=1)))


def test_the_plan_file_holds_one_plan_per_stage(pipeline_plan: Path):
    plan = Plan.load(pipeline_plan)
    data = json.loads(pipeline_plan.read_text())
    assert data["schema_version"] == PIPELINE_PLAN_VERSION and plan.pipeline.stages == 2
    assert plan.pipeline.stages_per_rank == 2 and len(plan.stages) == 4 and plan.world_size == 4
    assert plan.tensor_parallel == 2 and plan.sequence_parallel
    assert [st.in_flight for st in plan.stages] == [4, 3, 2, 1]
    assert [st.modules for st in plan.stages] == [[f"model.layers.{i}"] for i in range(4)]
    assert plan.stages[0].checkpoints and plan.stages[1].checkpoints  # the halfway budget needs them on both ranks
    assert plan.stages[0].predicted.peak_bytes == plan.stages[2].predicted.peak_bytes  # the rank's (Rule 7)
    assert plan.predicted.peak_bytes == max(st.predicted.peak_bytes for st in plan.stages)
    assert plan.checkpoints == [c for st in plan.stages for c in st.checkpoints]
    stage = stage_plan(plan, 1)
    assert stage.checkpoints == plan.stages[1].checkpoints and stage.stages == [] and stage.world_size == 1
    bad = dict(data)
    bad["stages"] = [dict(data["stages"][0], in_flight=9)] + data["stages"][1:]
    broken = pipeline_plan.with_name("bad.json")
    broken.write_text(json.dumps(bad))
    result = invoke("show", broken)
    assert result.exit_code == 2 and "stages.0.in_flight" in result.output


def test_the_applier_applies_the_stage_plan_on_a_stage(pipeline_plan: Path):
    from planner.act.applier import apply_plan
    from planner.act.pipeline import stage_module
    from planner.profiling.model_file import load_model_file

    plan = Plan.load(pipeline_plan)
    mf = load_model_file(LLAMA)
    for s in range(4):
        handle = apply_plan(stage_module(mf.build_model(), s, 4), plan)
        assert handle.checkpointed == plan.stages[s].checkpoints


def test_a_stage_run_as_its_schedule_runs_it_is_not_reported_by_the_step_guard():
    """NOTE [ The step as the loop runs it ], Rule 5: stage 0 of 2 under 1F1B with 4 micro-batches runs two forwards
    before the first backward, and its gradients are alive at the later forwards; the stage's plan counts both, and
    the guard reported both (gradients alive, 2 forwards before their backward). guard="error" now runs it."""
    import torch

    from planner.act.applier import apply_plan
    from planner.act.pipeline import pipeline_layout, split_batch, stage_module
    from planner.profiling.model_file import load_model_file

    plan, _ = _halfway_stages(pipeline_layout(2, "1f1b", 4))
    mf = load_model_file(LLAMA)
    stage = stage_module(mf.build_model(), 0, 2)
    handle = apply_plan(stage, plan, guard="error")
    micro_batches = split_batch(mf.example_inputs())[0].chunk(4)
    outputs = [stage(micro_batches[0]), stage(micro_batches[1])]  # the warm-up forwards
    for k in range(4):
        out = outputs.pop(0)
        out.backward(torch.ones_like(out))
        if k + 2 < 4:
            outputs.append(stage(micro_batches[k + 2]))
    assert handle.checkpointed == plan.stages[0].checkpoints and handle.recompute_count > 0


def test_verify_runs_each_stage_on_its_rank(four_rank_reports: dict):
    """Four gloo ranks on the CPU (2 pipeline positions x 2 tp ranks), two stages each: each rank's measured peak
    within 2% of its prediction and within the budget, the gradients those of one process (tests the whole path:
    stage modules, tp layout, the schedule)."""
    report = four_rank_reports["interleaved"]
    assert report.ok, report.problems
    assert [(r.stage, r.tp_rank) for r in report.rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r.recomputes > 0 for r in report.rows)
    assert report.max_grad_diff < 1e-6


def test_stages_with_fsdp_ranks_verify_on_every_rank(fsdp_stages_plan: tuple[Plan, int], four_rank_reports: dict):
    """pp 2 x dp 2 under FSDP2 (NOTE [ Pipeline stages ], Rule 10), 1F1B with 4 micro-batches, at the budget halfway
    between the layout's lowest feasible and no-checkpoint peaks: each of the 4 gloo ranks within 2% of its stage's
    prediction and within the budget, the gradients those of one process."""
    plan, optimizer_bytes = fsdp_stages_plan
    assert plan.world_size == 4 and plan.sharding == "fsdp" and plan.stages[0].checkpoints
    assert plan.stages[0].predicted.optimizer_bytes == -(-optimizer_bytes // 2)  # shards
    report = four_rank_reports["fsdp stages"]
    assert report.ok, report.problems
    assert [r.stage for r in report.rows] == [0, 0, 1, 1] and report.max_grad_diff < 1e-6


@pytest.mark.parametrize("args, needle", [
    (["--pp", "5"], "give --pp 4 or fewer"),
    (["--pp", "2", "--world-size", "3"], "world size 3 is not tp x pp x dp"),
    (["--pp", "2", "--world-size", "4"], "say how the 2 data-parallel ranks of each stage train, --sharding fsdp"),
    (["--pp", "2", "--schedule", "zero-bubble"], "unknown schedule 'zero-bubble'; choose one of: 1f1b, gpipe"),
    (["--pp", "2", "--micro-batches", "3"], "give --micro-batches one of 1, 2, 4, 8"),
    (["--pp", "2", "--schedule", "interleaved-1f1b"], "interleaved-1f1b runs several stages on each rank: add "
                                                       "--stages-per-rank V"),
    (["--pp", "2", "--stages-per-rank", "2"], "only interleaved-1f1b runs: add --schedule interleaved-1f1b"),
    (["--pp", "2", "--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--micro-batches", "5"],
     "needs micro-batches a multiple of max(1, M // pp) = 2; 5 is not"),
    (["--pp", "2", "--schedule", "interleaved-1f1b", "--stages-per-rank", "3", "--micro-batches", "4"],
     "pp 2 x stages-per-rank 3 = 6 stages is more than the model's 4 layers: give --stages-per-rank 2 or fewer"),
    (["--pp", "2", "--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--world-size", "4", "--sharding",
      "ddp"], "interleaved-1f1b is planned without data-parallel ranks for now (world size pp x tp): drop "
              "--world-size, or use --schedule 1f1b with --sharding ddp"),
    (["--sequence-parallel"], "--sequence-parallel shards the sequence over tensor-parallel ranks: add --tp N"),
    (["--tp", "2", "--world-size", "3"], "world size 3 is not tp x pp x dp with tp 2: give --world-size a multiple "
                                         "of 2"),
    (["--tp", "2", "--pp", "2", "--world-size", "8"], "world size 8 is pp 2 and tp 2 x dp 2: say how the 2 "
                                                      "data-parallel ranks of each stage train, --sharding fsdp or ddp"),
    (["--tp", "2", "--sharding", "fsdp", "--world-size", "2"], "--sharding fsdp needs data-parallel ranks beside the "
                                                               "2 tensor-parallel ones"),
    (["--tp", "2", "--sharding", "ddp", "--world-size", "4"], "use --sharding fsdp (FSDP2 over the data-parallel"),
    (["--tp", "2", "--world-size", "4"], "world size 4 is tp 2 x dp 2: say how the 2 data-parallel ranks train, "
                                         "--sharding fsdp (FSDP2)"),
    (["--tp", "0"], "tp must be an integer >= 1, got 0"),
])
def test_bad_pipeline_and_tensor_parallel_settings_are_one_line_errors(args: list[str], needle: str, tmp_path: Path):
    out = tmp_path / "plan.json"
    result = invoke("plan", LLAMA, "--budget", "1GB", "--device", "cpu", *args, "-o", out)
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output and not out.exists()
    assert len([ln for ln in result.stderr.splitlines() if ln.startswith("error:")]) == 1


def test_tensor_parallel_ranks_run_the_local_model(tp_fsdp_plan: Plan, four_rank_reports: dict, tmp_path: Path):
    """tp 2 x dp 2 under FSDP2 (NOTE [ Tensor-parallel ranks ], Rules 2 and 5): the plan is made on the model
    with half the heads and MLP width, sharded over the two data-parallel ranks, names the full model's
    modules, and each of four gloo ranks on a (dp, tp) mesh measures its prediction within 2%. (tp alone
    runs in the sequence-parallel test below.)"""
    from planner.act.tensor_parallel import local_model
    from planner.profiling.model_file import load_model_file

    mf = load_model_file(LLAMA)
    local = local_model(mf.build_model(), 2)
    assert local.model.layers[0].self_attn.q_proj.weight.shape == (64, 128)
    assert local.model.layers[0].mlp.up_proj.weight.shape == (176, 128)
    plan = tp_fsdp_plan
    assert plan.tensor_parallel == 2 and plan.world_size == 4 and plan.sharding == "fsdp" and plan.checkpoints
    assert plan.fsdp_units == [f"model.layers.{i}" for i in range(4)]
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).tensor_parallel == 2 and json.loads(path.read_text())["schema_version"] == PIPELINE_PLAN_VERSION
    report = four_rank_reports["tp x fsdp"]
    assert report.ok, report.problems
    assert [(r.rank, r.tp_rank) for r in report.rows] == [(0, 0), (1, 1), (2, 0), (3, 1)]


def test_sequence_parallel_ranks_shard_the_sequence_between_blocks(tmp_path: Path, bytes_only):
    """tp 2 with sequence parallelism (NOTE [ Sequence-parallel ranks ]): the rank-local model with its
    collectives emulated holds less than without, and each of two gloo ranks measures its prediction."""
    from planner.act.tensor_parallel import local_builder
    from planner.act.verify_ranks import verify_ranks
    from planner.profiling.model_file import load_model_file
    from planner.spec import StepSpec

    mf = load_model_file(LLAMA)
    seen = []
    local = local_builder(mf.build_model(), 2, sequence_parallel=True)()
    local.model.layers[0].input_layernorm.register_forward_hook(lambda _m, _a, out: seen.append(tuple(out.shape)))
    local.model.layers[0].self_attn.q_proj.register_forward_hook(lambda _m, a, _o: seen.append(tuple(a[0].shape)))
    local(**mf.example_inputs())
    assert seen == [(8, 64, 128), (8, 128, 128)]  # the norm on half the sequence, attention on all of it
    step = StepSpec(device="cpu", threads=1, steps=1)
    with profiled_once():
        roomy = plan_tensor_parallel_sp(mf, "1GB", step)
        plan = plan_tensor_parallel_sp(mf, int(roomy.predicted.no_checkpoint_peak_bytes * 0.8), step)
    assert plan.sequence_parallel and plan.checkpoints
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path).sequence_parallel and json.loads(path.read_text())["sequence_parallel"] is True
    report = verify_ranks(LLAMA, path, steps=1)
    assert report.ok, report.problems
    assert report.max_grad_diff < 1e-6


def test_sequence_parallel_needs_a_sequence_tp_divides():
    import dataclasses

    from planner.errors import BadInput
    from planner.profiling.model_file import load_model_file

    mf = load_model_file(LLAMA)
    odd = dataclasses.replace(mf, example_inputs=lambda **_kw: mf.example_inputs(seq_len=127))
    with pytest.raises(BadInput, match=r"shape \[8, 127\]: give a sequence length divisible by 2"):
        plan_tensor_parallel_sp(odd, "1GB", None)


def plan_tensor_parallel_sp(mf, budget, step):
    from planner.act.tensor_parallel import plan_tensor_parallel

    return plan_tensor_parallel(mf, budget, 2, step=step, sequence_parallel=True)


def test_tp_that_does_not_divide_the_heads_is_a_one_line_error(tmp_path: Path):
    out = tmp_path / "plan.json"
    result = invoke("plan", LLAMA, "--budget", "1GB", "--device", "cpu", "--tp", "3", "-o", out)
    assert result.exit_code == 2 and "tp 3 does not divide the model's 4 attention heads: give --tp one of 1, 2, 4" \
        in result.output, result.output
    assert "Traceback" not in result.output and not out.exists()
    both = invoke("plan", LLAMA, "--budget", "1GB", "--pp", "2", "--tp", "2", "--world-size", "6", "-o", out)
    assert both.exit_code == 2 and "world size 6 is not tp x pp x dp with pp 2 and tp 2: give --world-size a " \
        "multiple of 4" in both.output, both.output


def test_tp_by_pp_ranks_each_plan_their_stage(tp_pp_plan: Plan, four_rank_reports: dict):
    """tp 2 + sequence parallelism x pp 2 (4 gloo ranks, rank = stage x 2 + tp rank): each stage profiled on its
    rank-local model with the sequence sharded between blocks and between stages (NOTE [ Sequence-parallel ranks ],
    Rule 5), its plan named by the full model's modules and fingerprint; every rank within 2% and the budget, the
    gradients one process's (tp x pp without sp: benchmarks/pipeline_stages.py)."""
    plan = tp_pp_plan
    assert plan.world_size == 4 and plan.tensor_parallel == 2 and plan.sequence_parallel and plan.checkpoints
    assert plan.stages[0].send_bytes == plan.stages[1].recv_bytes == 4 * 64 * 128 * 4  # 4 rows, half of 128 positions
    q = next(p for p in plan.stages[1].fingerprint.params if p.name == "model.layers.2.self_attn.q_proj.weight")
    assert q.shape == [128, 128]  # the full-size stage's (a rank lays out the full stage with DTensor)
    report = four_rank_reports["tp x pp"]
    assert report.ok, report.problems
    assert [(r.stage, r.tp_rank) for r in report.rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert report.max_grad_diff < 1e-6
