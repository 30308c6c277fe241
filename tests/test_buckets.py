"""Bucketed plans (NOTE [ Bucketed plans ]): one plan file for several input shapes, the bucket of
each batch put in force at the start of its forward; gradients equal the unplanned model's."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

from planner.act.applier import apply_plan
from planner.act.buckets import bucket_plans, combine
from planner.errors import BadInput, PlanMismatch
from planner.model.fingerprint import fingerprint
from planner.model.schema import Plan, Predicted, SolverInfo
from planner.profiling.model_file import load_model_file
from tests.conftest import invoke
from tests.model_files import TINY_MODEL, TINY_SEQ_MODEL
from tests.test_guard import VOCAB, WIDTH
from tests.test_guard import TinyLM as GuardLM

SHORT, MID, LONG = (4, 8), (4, 16), (4, 32)
"""Batch rows x tokens of the three buckets."""
CHECKPOINTS = {SHORT: [], MID: ["blocks.1"], LONG: ["blocks.0", "blocks.1"]}
"""What each bucket checkpoints: more for longer batches, as a plan under one budget does."""


class TinyLM(GuardLM):
    """test_guard's model with dropout in its blocks: a recomputation must replay the masks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.1), nn.GELU())
                                    for _ in range(2))


def batch(rows: int, tokens: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, tokens), generator=torch.Generator().manual_seed(rows * 1000 + tokens))
    return {"input_ids": ids, "labels": ids.clone()}


def one_plan(model: nn.Module, shape: tuple[int, int], checkpoints: list[str]) -> Plan:
    fp = fingerprint(model, batch(*shape))
    predicted = Predicted(peak_bytes=shape[1] << 16, params_bytes=0, grads_bytes=0, optimizer_bytes=0,
                          activations_bytes=shape[1] << 16, recompute_ms=float(len(checkpoints)), step_ms=10.0)
    return Plan(fingerprint=fp, fingerprint_digest=fp.digest(), budget_bytes=1 << 30, checkpoints=checkpoints,
                checkpoint_units=checkpoints, solver=SolverInfo(name="manual", status="optimal"), predicted=predicted)


def bucketed(model: nn.Module) -> Plan:
    shapes = [LONG, SHORT, MID]  # any order: combine sorts them
    return combine([one_plan(model, s, CHECKPOINTS[s]) for s in shapes],
                   [{"batch": s[0], "seq_len": s[1]} for s in shapes])


def step(model: nn.Module, rows: int, tokens: int, *, positional: bool = False) -> tuple[torch.Tensor, list[str]]:
    """One training step's forward and backward (gradients set to None first) under a fixed seed: the loss and
    the remat warnings."""
    b = batch(rows, tokens)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.zero_grad()
        loss = model(b["input_ids"], b["labels"]) if positional else model(**b)
        loss.backward()
    return loss.detach(), [str(w.message) for w in caught if "remat" in str(w.message)]


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


# ----------------------------------------------------------------------------- the file


def test_buckets_are_sorted_the_top_level_is_the_largest_and_a_bucket_reads_as_its_own_plan(tmp_path):
    model = TinyLM()
    plan = bucketed(model)
    assert [b.shape for b in plan.buckets] == [{"batch": 4, "seq_len": 8}, {"batch": 4, "seq_len": 16},
                                               {"batch": 4, "seq_len": 32}]
    assert plan.checkpoints == CHECKPOINTS[LONG] and plan.fingerprint.inputs[0].shape == list(LONG)
    assert plan.schema_version == 4
    again = Plan.load(plan.save(tmp_path / "plan.json"))
    assert again == plan
    singles = bucket_plans(again)
    assert [p.checkpoints for p in singles] == [CHECKPOINTS[SHORT], CHECKPOINTS[MID], CHECKPOINTS[LONG]]
    assert singles[0].fingerprint_digest == fingerprint(model, batch(*SHORT)).digest()
    assert singles[0].to_json() == one_plan(model, SHORT, []).model_copy(
        update={"created": singles[0].created}).to_json()


@pytest.mark.parametrize("edit, needle", [
    (lambda b: b["predicted"].__setitem__("activations_bytes", 1), "buckets.0.predicted.peak_bytes"),
    (lambda b: b["predicted"].__setitem__("peak_bytes", 1 << 40), "buckets.0.predicted.peak_bytes"),
    (lambda b: b["predicted"].__setitem__("recompute_ms", 1e30), "buckets.0.predicted.recompute_ms"),
    (lambda b: b["checkpoints"].append("no.such.module"), "buckets.0.checkpoints.0"),
])
def test_a_bucket_is_checked_as_its_own_plan_is(tmp_path, edit, needle):
    data = json.loads(bucketed(TinyLM()).to_json())
    edit(data["buckets"][0])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(Exception, match=needle):
        Plan.load(bad)


def test_a_single_shape_plan_file_is_unchanged_and_older_plans_load(tmp_path):
    model = TinyLM()
    plan = one_plan(model, LONG, ["blocks.0"])
    text = plan.to_json()
    data = json.loads(text)
    assert "buckets" not in data and data["schema_version"] == 3
    assert combine([plan]) is plan
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert Plan.load(path).buckets == []


def test_combine_refuses_plans_of_other_models_budgets_or_one_shape_twice():
    model = TinyLM()
    a, b = one_plan(model, SHORT, []), one_plan(model, LONG, [])
    with pytest.raises(BadInput, match="differ in budget_bytes"):
        combine([a, b.model_copy(update={"budget_bytes": 1})])
    other = one_plan(nn.Sequential(TinyLM()), LONG, [])
    with pytest.raises(BadInput, match="different models"):
        combine([a, other])
    with pytest.raises(BadInput, match="same input shapes"):
        combine([a, a])
    with pytest.raises(BadInput, match="2 plans but 1 shapes"):
        combine([a, b], [{}])


# ----------------------------------------------------------------------------- switching


@pytest.mark.parametrize("positional", [False, True], ids=["keywords", "positional"])
def test_each_batch_runs_the_smallest_bucket_that_holds_it_with_the_plain_models_gradients(positional):
    torch.manual_seed(0)
    plain = TinyLM()
    model = copy.deepcopy(plain)
    handle = apply_plan(model, bucketed(model))
    assert handle.checkpointed == ["blocks.0", "blocks.1"]
    # (rows, tokens) -> (bucket, forwards recomputed): smaller batches fall in the smallest bucket holding them
    for shape, (bucket, recomputes) in {(4, 8): (0, 0), (2, 5): (0, 0), (4, 16): (1, 1), (3, 9): (1, 1),
                                        (4, 32): (2, 2), (1, 17): (2, 2), (4, 8 + 1): (1, 1)}.items():
        handle.reset_counts()
        loss, warned = step(model, *shape, positional=positional)
        assert (handle.bucket, handle.recompute_count, warned) == (bucket, recomputes, []), shape
        ref, _ = step(plain, *shape)
        assert torch.equal(loss, ref)
        mine, theirs = grads(model), grads(plain)
        assert all(torch.equal(mine[n], theirs[n]) for n in theirs), shape


def test_another_batch_size_picks_the_bucket_that_holds_it():
    model = TinyLM()
    shapes = [(2, 32), (8, 8)]  # a short batch of many rows and a long batch of few
    plan = combine([one_plan(model, s, c) for s, c in zip(shapes, [["blocks.0"], ["blocks.1"]])])
    handle = apply_plan(model, plan)
    step(model, 8, 4)
    assert plan.buckets[handle.bucket].inputs[0].shape == [8, 8]
    assert handle.recompute_count == 1 and handle.counts()["blocks.1"].recomputes == 1
    step(model, 2, 20)
    assert plan.buckets[handle.bucket].inputs[0].shape == [2, 32]
    assert handle.counts()["blocks.0"].recomputes == 1


def test_a_plan_made_on_positional_inputs_switches_on_keyword_calls():
    model = TinyLM()
    plans = []
    for shape in (SHORT, LONG):
        b = batch(*shape)
        fp = fingerprint(model, (b["input_ids"], b["labels"]))  # inputs named '0' and '1'
        plans.append(one_plan(model, shape, CHECKPOINTS[shape]).model_copy(
            update={"fingerprint": fp, "fingerprint_digest": fp.digest()}))
    handle = apply_plan(model, combine(plans))
    assert list(handle._switch.shapes[0]) == ["0", "1"]
    step(model, *SHORT)
    assert handle.bucket == 0 and handle.recompute_count == 0
    step(model, 2, 20)
    assert handle.bucket == 1 and handle.recompute_count == 2


def test_a_batch_larger_than_every_bucket_runs_the_largest_and_triggers_the_guard():
    model = TinyLM()
    handle = apply_plan(model, bucketed(model))
    step(model, *SHORT)
    handle.reset_counts()
    _, warned = step(model, 4, 33)
    assert handle.bucket == 2 and handle.recompute_count == 2
    (message,) = warned
    assert "planned [4, 32], got [4, 33]" in message
    model, handle = TinyLM(), None
    handle = apply_plan(model, bucketed(model), guard="error")
    with pytest.raises(PlanMismatch, match=r"planned \[4, 32\], got \[8, 32\]"):
        model(**batch(8, 32))


def test_evaluation_keeps_the_bucket_and_remove_restores_the_model():
    model = TinyLM()
    handle = apply_plan(model, bucketed(model))
    step(model, *SHORT)
    with torch.no_grad():
        model(**batch(4, 32))
    assert handle.bucket == 0
    handle.remove()
    assert "forward" not in model.blocks[0].__dict__ and not model._forward_pre_hooks


def test_a_backward_after_the_next_forward_replays_the_bucket_its_forward_ran():
    torch.manual_seed(0)
    plain = TinyLM()
    model = copy.deepcopy(plain)
    handle = apply_plan(model, bucketed(model))
    torch.manual_seed(0)
    long = model(**batch(*LONG))
    short = model(**batch(*SHORT))  # switches to the bucket that checkpoints nothing
    (long + short).backward()
    assert handle.bucket == 0 and handle.recompute_count == 2
    torch.manual_seed(0)
    (plain(**batch(*LONG)) + plain(**batch(*SHORT))).backward()
    mine, theirs = grads(model), grads(plain)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)


def test_a_deep_copy_switches_its_own_modules():
    model = TinyLM()
    apply_plan(model, bucketed(model))
    twin = copy.deepcopy(model)
    step(twin, *SHORT)
    assert twin.blocks[1].forward.on is False and model.blocks[1].forward.on is True


def test_apply_with_inputs_checks_them_against_their_bucket():
    model = TinyLM()
    apply_plan(model, bucketed(model), inputs=batch(*MID)).remove()
    with pytest.raises(PlanMismatch, match="input input_ids"):
        apply_plan(model, bucketed(model), inputs=batch(4, 12))


# ----------------------------------------------------------------------------- torch.compile


def test_under_torch_compile_every_batch_runs_the_largest_bucket():
    """A compiled graph cannot switch per batch: it is traced with the largest bucket's checkpoints."""
    torch.manual_seed(0)
    plain = TinyLM()
    model = copy.deepcopy(plain)
    handle = apply_plan(model, bucketed(model))
    step(model, *SHORT)  # eager: the short bucket, nothing checkpointed
    assert handle.bucket == 0
    model.zero_grad(set_to_none=True)
    regions = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        regions.append(sum(1 for n in gm.graph.nodes if "tag_activation_checkpoint" in str(n.target)))
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    loss, _ = step(compiled, *SHORT)
    assert sum(regions) == 2  # both blocks, as the largest bucket plans
    ref, _ = step(plain, *SHORT)
    assert torch.equal(loss, ref)
    mine, theirs = grads(model), grads(plain)
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- made from a model file

SEQ_LENS = (16, 32, 64)
BUDGET = "1.1e6"
"""Between the 64-token step's lowest feasible peak (about 1.05e6 bytes) and the 32-token step's
peak without checkpointing (about 0.95e6): the long bucket must checkpoint, the short ones need not."""


@pytest.fixture(scope="module")
def seq_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("seq") / "model.py"
    path.write_text(TINY_SEQ_MODEL)
    return path


def test_remat_plan_show_and_verify_a_bucketed_plan(seq_file, tmp_path):
    out = tmp_path / "plan.json"
    r = invoke("plan", "--budget", BUDGET, "--seq-len", ",".join(map(str, SEQ_LENS)), seq_file, "--device", "cpu",
               "--steps", "1", "--threads", "1", "-o", out, "--quiet")
    assert r.exit_code == 0, r.output
    plan = Plan.load(out)
    assert [b.shape for b in plan.buckets] == [{"seq_len": n} for n in SEQ_LENS]
    assert plan.buckets[0].checkpoints == [] and plan.buckets[-1].checkpoints == plan.checkpoints != []
    assert all(b.predicted.peak_bytes <= plan.budget_bytes for b in plan.buckets)
    shown = invoke("show", out)
    assert shown.exit_code == 0 and "3 buckets" in shown.stdout
    assert all(f"seq_len {n}" in shown.stdout for n in SEQ_LENS)
    r = invoke("verify", seq_file, out, "--device", "cpu", "--steps", "1", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["ok"] and report["buckets"] == [f"seq_len {n}" for n in SEQ_LENS]
    for bucket, one in zip(plan.buckets, report["reports"]):
        assert one["predicted_peak_bytes"] == bucket.predicted.peak_bytes and one["max_grad_diff"] == 0
        assert one["measured_recomputes"] == len(bucket.checkpoints)


def test_the_python_api_plans_a_list_of_batches(seq_file):
    import planner

    mf = load_model_file(seq_file)
    plan = planner.plan(mf.build_model(), BUDGET, buckets=[mf.example_inputs(seq_len=n) for n in (64, 16)],
                        device="cpu", steps=1, threads=1)
    assert [b.inputs[0].shape for b in plan.buckets] == [[4, 16], [4, 64]] and plan.buckets[0].shape == {}
    with pytest.raises(BadInput, match="inputs=<one training batch> or buckets="):
        planner.plan(mf.build_model(), BUDGET, device="cpu")


def test_a_model_file_without_the_keywords_is_told_how_to_opt_in(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(TINY_MODEL)
    r = invoke("plan", "--budget", "1GB", "--seq-len", "8,16", path, "--device", "cpu")
    assert r.exit_code == 2
    (line,) = r.stderr.strip().splitlines()[-1:]
    assert "example_inputs() in" in line and "takes no seq_len keyword" in line
    assert "def example_inputs(seq_len=128, batch=8)" in line


@pytest.mark.parametrize("given", ["abc", "0,16", "16,"])
def test_bad_sizes_are_one_line(given, seq_file):
    r = invoke("plan", "--budget", "1GB", "--seq-len", given, seq_file)
    assert r.exit_code == 2 and "--seq-len" in r.stderr and "positive integers separated by commas" in r.stderr


def test_several_shapes_elsewhere_than_plan_are_refused(seq_file):
    r = invoke("profile", seq_file, "--seq-len", "16,32")
    assert r.exit_code == 2 and "bucketed plan, which remat plan makes" in r.stderr
