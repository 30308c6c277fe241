"""apply_plan: a planned model computes exactly what the plain model computes, and recomputes.

Every example model is run through one validator (``check_planned``) at three checkpoint sets:
none, every top-level block, and a mixed set (blocks, submodules, single layers, modules
called more than once, dropout and BatchNorm inside regions). On the CPU recomputation is
bitwise: loss, every gradient and every buffer are compared with ``torch.equal``.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import warnings
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from planner.act.applier import AppliedPlan, PlanAlreadyApplied, apply_plan, planned_modules
from planner.errors import BadInput, PlanMismatch, RematError
from planner.model.fingerprint import fingerprint
from planner.profiling.model_file import call_model, compute_loss, load_model_file
from planner.model.schema import Plan, Predicted, SolverInfo

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HAS_HF = importlib.util.find_spec("transformers") is not None

ALL_BLOCKS = {
    "transformer": [f"blocks.{i}" for i in range(6)],
    "gpt2": [f"transformer.h.{i}" for i in range(4)],
    "resnet": ["stem", "layer1", "layer2", "layer3", "layer4"],
    "unet": ["down.0", "down.1", "down.2", "mid", "up.0", "up.1", "up.2"],
    "t5": [f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(3)],
    "llama": [f"model.layers.{i}" for i in range(4)],
}
MIXED = {
    # 'drop' and the blocks' dropouts: RNG replayed; 'ln_f' a single layer
    "transformer": ["drop", "blocks.0", "blocks.3.attn", "blocks.4.mlp.fc", "ln_f"],
    # lm_head shares its weight with transformer.wte
    "gpt2": ["transformer.drop", "transformer.h.0.attn", "transformer.h.2", "transformer.h.3.mlp", "lm_head"],
    # layer1.1.relu runs twice per call of its block; layer2.1.bn1 is a lone BatchNorm
    "resnet": ["stem", "layer1.0", "layer1.1.relu", "layer2.1.bn1", "layer3.0.shortcut", "layer4", "fc"],
    # up.0 takes two positional tensors; up.2.conv.1 is a GroupNorm
    "unet": ["inc", "down.1.conv", "mid", "up.0", "up.2.conv.1", "outc"],
    # 'shared' is the embedding of encoder and decoder (two calls); cross-attention takes kwargs
    "t5": ["shared", "encoder.block.1.layer.1", "decoder.block.0.layer.1", "decoder.block.2",
           "decoder.final_layer_norm"],
    "llama": ["model.embed_tokens", "model.layers.0.self_attn", "model.layers.1.mlp",
              "model.layers.2.input_layernorm", "model.layers.3", "model.norm", "lm_head"],
}
HF_MODELS = {"gpt2", "t5", "llama"}


def _params(name: str):
    marks = [pytest.mark.skipif(not HAS_HF, reason="transformers not installed")] if name in HF_MODELS else []
    return pytest.param(name, marks=marks, id=name)


MODELS = [_params(n) for n in ALL_BLOCKS]


@functools.cache
def _file(name: str):
    return load_model_file(EXAMPLES / f"{name}.py")


def example_inputs(name: str):
    """The model file's inputs; token models get 2 x 64 tokens (the test runs in seconds)."""
    inputs = _file(name).example_inputs()
    if isinstance(inputs, dict):
        return {k: v[:2, :64].contiguous() for k, v in inputs.items()}
    if isinstance(inputs, tuple):
        return tuple(v[:2, :64].contiguous() for v in inputs)
    return inputs  # images: resnet's and unet's loss_fn compare with a fixed batch of 8


def make_plan(model: nn.Module, checkpoints: list[str], inputs=None, **fields) -> Plan:
    fp = fingerprint(model, inputs)
    predicted = Predicted(peak_bytes=1 << 20, params_bytes=0, grads_bytes=0, optimizer_bytes=0,
                          activations_bytes=1 << 20, recompute_ms=0.0, step_ms=0.0)
    return Plan(fingerprint=fp, fingerprint_digest=fp.digest(), budget_bytes=1 << 30, checkpoints=checkpoints,
                solver=SolverInfo(name="manual", status="feasible"), predicted=predicted, **fields)


def train_step(name: str, model: nn.Module, seed: int = 0) -> torch.Tensor:
    """Forward, loss, backward from a fixed RNG state (same dropout masks in every run)."""
    mf = _file(name)
    torch.manual_seed(seed)
    batch = example_inputs(name)
    loss = compute_loss(mf.loss_fn, call_model(model, batch), batch)
    loss.backward()
    return loss.detach()


@functools.cache
def reference(name: str):
    """Loss, gradients, buffers and per-module call counts of one unplanned step."""
    model = _file(name).build_model()
    calls: dict[str, int] = {}
    for fqn, m in model.named_modules():
        m.register_forward_pre_hook(lambda _m, _a, fqn=fqn: calls.__setitem__(fqn, calls.get(fqn, 0) + 1))
    loss = train_step(name, model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return loss, grads, buffers, calls


def check_planned(name: str, checkpoints: list[str]) -> AppliedPlan:
    """The validator: apply, train one step, compare everything with the unplanned model."""
    ref_loss, ref_grads, ref_buffers, calls = reference(name)
    model = _file(name).build_model()
    keys = list(model.state_dict())
    params = [(n, id(p)) for n, p in model.named_parameters()]
    class_forwards = {type(m): type(m).forward for m in model.modules()}

    inputs = example_inputs(name)
    handle = apply_plan(model, make_plan(model, checkpoints, inputs), inputs=inputs)
    assert handle.checkpointed == checkpoints and not handle.skipped, f"{name}: {handle.skipped}"
    assert list(model.state_dict()) == keys, f"{name}: state_dict keys changed"
    assert [(n, id(p)) for n, p in model.named_parameters()] == params, f"{name}: parameters changed"

    loss = train_step(name, model)
    assert torch.equal(loss, ref_loss), f"{name} {checkpoints}: loss {loss} != {ref_loss}"
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[n]), \
            f"{name} {checkpoints}: grad of {n} differs by {(p.grad - ref_grads[n]).abs().max():.3g}"
    for n, b in model.named_buffers():
        assert torch.equal(b, ref_buffers[n]), f"{name} {checkpoints}: buffer {n} differs (running stats?)"
    expected = sum(calls.get(fqn, 0) for fqn in checkpoints)
    assert handle.call_count == expected, f"{name}: {handle.call_count} checkpointed calls, {expected} module calls"
    assert handle.recompute_count == expected, \
        f"{name} {checkpoints}: {handle.recompute_count} recomputed forwards, expected {expected}: {handle.counts()}"

    handle.remove()
    assert planned_modules(model) == [], f"{name}: remove() left wrapped forwards"
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {type(m): type(m).forward for m in model.modules()} == class_forwards
    return handle


# ----------------------------------------------------------------------------- every model


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("which", ["none", "blocks", "mixed"])
def test_planned_model_matches_plain_model(name: str, which: str):
    checkpoints = {"none": [], "blocks": ALL_BLOCKS[name], "mixed": MIXED[name]}[which]
    check_planned(name, checkpoints)


# ----------------------------------------------------------------------------- the wrapper


class _Toy(nn.Module):
    """Keyword tensors, non-tensor arguments and outputs, a module called twice, BatchNorm."""

    def __init__(self):
        super().__init__()
        self.inner = _KwargsBlock()
        self.bn = nn.BatchNorm1d(8)
        self.act = nn.GELU()

    def forward(self, x):
        out = self.inner(x, scale=x.sin(), tag="a")
        y = self.act(self.bn(out["y"]))
        return self.act(y * out["n"]).sum() + (out["none"] is None)


class _KwargsBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, *, scale, tag: str):
        return {"y": self.drop(self.lin(x) * scale), "n": len(tag) + 1, "none": None}


def _toy_step(model, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(16, 8, requires_grad=True)
    loss = model(x)
    loss.backward()
    return loss, x.grad


def test_kwargs_non_tensor_outputs_repeated_calls_and_batchnorm():
    torch.manual_seed(0)
    plain = _Toy()
    planned = copy.deepcopy(plain)
    handle = apply_plan(planned, make_plan(planned, ["inner", "bn", "act"]))
    l0, g0 = _toy_step(plain)
    l1, g1 = _toy_step(planned)
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    for (n, p), q in zip(plain.named_parameters(), planned.parameters()):
        assert torch.equal(p.grad, q.grad), n
    for (n, b), c in zip(plain.named_buffers(), planned.buffers()):
        assert torch.equal(b, c), f"{n}: BatchNorm statistics updated twice"
    assert {n: (c.calls, c.recomputes) for n, c in handle.counts().items()} == \
        {"inner": (1, 1), "bn": (1, 1), "act": (2, 2)}


def test_keyword_tensors_reach_checkpoint_rng_device_detection(monkeypatch):
    """checkpoint picks the device whose RNG it preserves from positional args only: a region
    called with keyword tensors on a GPU would redraw its dropout masks when recomputed."""
    import torch.utils.checkpoint as ckpt

    seen = []
    real = ckpt._infer_device_type
    monkeypatch.setattr(ckpt, "_infer_device_type",
                        lambda *args: seen.append(any(isinstance(a, torch.Tensor) for a in args)) or real(*args))
    model = _Toy()
    apply_plan(model, make_plan(model, ["inner"]))
    block = model.inner
    block(x=torch.randn(4, 8), scale=torch.ones(4, 8), tag="kw").__getitem__("y").sum().backward()
    assert seen and all(seen)


def test_no_grad_and_eval_calls_are_not_checkpointed():
    model = _Toy()
    handle = apply_plan(model, make_plan(model, ["inner"]))
    with torch.no_grad():
        model(torch.randn(4, 8))
    assert handle.call_count == 0 and handle.recompute_count == 0


def test_recomputes_counted_per_backward():
    model = _Toy()
    handle = apply_plan(model, make_plan(model, ["inner"]))
    loss = model(torch.randn(4, 8))
    torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    torch.autograd.grad(loss, list(model.parameters()))
    assert (handle.call_count, handle.recompute_count) == (1, 2)
    handle.reset_counts()
    assert (handle.call_count, handle.recompute_count) == (0, 0)


def test_signature_deepcopy_and_pickle():
    import inspect
    import pickle

    model = _Toy()
    apply_plan(model, make_plan(model, ["inner"]))
    assert list(inspect.signature(model.inner.forward).parameters) == ["x", "scale", "tag"]
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        # the clone's forward runs the clone's own module, not the original's
        assert clone.inner.forward.module is clone.inner
        _toy_step(clone)
        assert all(p.grad is None for p in model.parameters())
        assert all(p.grad is not None for p in clone.parameters())


def test_a_copy_or_loaded_model_carrying_a_plan_is_freed_by_remove_plan():
    """NOTE [ Plans carried without a handle ]: deepcopy and torch.save/load copy the plan's forwards and hooks but
    no handle; apply_plan refused the copy telling the user to call .remove() on a handle they never had."""
    import io

    from planner import remove_plan

    model = _Toy()
    plan = make_plan(model, ["inner", "bn"], inputs=torch.randn(16, 8))
    handle = apply_plan(model, plan)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        with pytest.raises(PlanAlreadyApplied, match=r"planner\.remove_plan\(model\) for a model copied or loaded"):
            apply_plan(clone, plan)
        assert remove_plan(clone) == 2
        assert planned_modules(clone) == [] and not clone._forward_pre_hooks
        assert [n for n, m in clone.named_modules() if "forward" in m.__dict__] == []
        with apply_plan(clone, plan) as again:
            _toy_step(clone)
            assert again.recompute_count == 2
    assert sorted(planned_modules(model)) == ["bn", "inner"] and handle._active  # the original keeps its plan
    assert remove_plan(model) == 2 and not handle._active and not model._forward_pre_hooks
    assert remove_plan(model) == 0


def test_remove_restores_an_existing_instance_forward_and_is_a_context_manager():
    model = _Toy()
    custom = functools.partial(type(model.inner).forward, model.inner)
    model.inner.forward = custom
    with apply_plan(model, make_plan(model, ["inner"])) as handle:
        assert model.inner.__dict__["forward"] is not custom
        _toy_step(model)
        assert handle.recompute_count == 1
    assert model.inner.__dict__["forward"] is custom
    assert handle.recompute_count == 1  # counts outlive remove()
    handle.remove()  # idempotent
    assert model.inner.__dict__["forward"] is custom


def test_summary_log_line(caplog):
    model = _Toy()
    with caplog.at_level(logging.INFO, logger="remat"):
        apply_plan(model, make_plan(model, ["inner", "bn"]))
    lines = [r.getMessage() for r in caplog.records if r.name == "remat"]
    assert len(lines) == 1 and "checkpointed 2/2" in lines[0], lines


def test_plan_file_path(tmp_path):
    model = _Toy()
    path = make_plan(model, ["inner"]).save(tmp_path / "plan.json")
    with apply_plan(model, path) as handle:
        assert handle.checkpointed == ["inner"]


# ----------------------------------------------------------------------------- refusals


def test_mismatched_plan_is_refused():
    other = _file("transformer").build_model()
    small = type(other)(d_model=96, n_head=6)
    plan = make_plan(other, ["blocks.0", "blocks.1"])
    with pytest.raises(PlanMismatch) as e:
        apply_plan(small, plan)
    assert any("blocks.0.ln_1.weight" in d and "[192]" in d and "[96]" in d for d in e.value.differences)
    assert planned_modules(small) == []

    shallow = type(other)(n_layer=1)  # blocks.1 does not exist
    with pytest.raises(PlanMismatch, match="blocks.1"):
        apply_plan(shallow, plan)
    with pytest.warns(UserWarning, match="does not match"):
        handle = apply_plan(shallow, plan, strict=False)
    assert handle.checkpointed == ["blocks.0"] and handle.skipped == {"blocks.1": "not in the model"}


def test_unknown_checkpoint_and_input_shapes_are_refused():
    model = _Toy()
    with pytest.raises(ValidationError, match="module 'nope' is not in the model"):  # NOTE [ Numbers in files ]
        make_plan(model, ["nope"])
    plan = make_plan(model, ["inner"], inputs=torch.randn(16, 8))
    with pytest.raises(PlanMismatch, match="input 0"):
        apply_plan(model, plan, inputs=torch.randn(32, 8))
    apply_plan(model, plan).remove()  # without inputs, only structure and parameters are checked


def test_applying_twice_is_refused_without_double_wrapping():
    model = _Toy()
    plan = make_plan(model, ["inner"])
    handle = apply_plan(model, plan)
    wrapped = model.inner.__dict__["forward"]
    with pytest.raises(PlanAlreadyApplied, match="remove"):
        apply_plan(model, plan)
    assert issubclass(PlanAlreadyApplied, RematError)
    assert model.inner.__dict__["forward"] is wrapped and wrapped.inner.__self__ is model.inner
    handle.remove()
    apply_plan(model, plan).remove()


def test_nested_plan_and_compiled_model_are_refused():
    model = _Toy()
    with pytest.raises(BadInput, match="nest"):
        apply_plan(model, make_plan(model, ["inner", "inner.lin"]))
    with pytest.raises(BadInput, match="before|first"):
        apply_plan(torch.compile(model, backend="eager"), make_plan(model, ["inner"]))


# ----------------------------------------------------------------------------- user checkpointing


@pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
def test_hf_gradient_checkpointing_is_detected_and_not_doubled():
    model = _file("gpt2").build_model()
    plan = make_plan(model, ["transformer.h.0", "transformer.h.1.mlp", "transformer.ln_f"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable is deprecated in v5
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(UserWarning, match=r"transformer\.h\.0.*transformer\.h\.1\.mlp"):
        handle = apply_plan(model, plan)
    assert handle.checkpointed == ["transformer.ln_f"]
    assert set(handle.skipped) == {"transformer.h.0", "transformer.h.1.mlp"}
    assert "Hugging Face" in handle.skipped["transformer.h.0"]
    loss = train_step("gpt2", model)
    assert torch.equal(loss, reference("gpt2")[0])
    assert handle.recompute_count == 1


def test_torch_checkpoint_wrapper_is_detected():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _file("transformer").build_model()
    plan = make_plan(model, ["blocks.0", "blocks.1.mlp", "blocks.2"])
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    with pytest.warns(UserWarning, match="checkpoint_wrapper"):
        handle = apply_plan(model, plan)  # the fingerprint sees through the wrappers
    assert handle.checkpointed == ["blocks.2"]
    assert set(handle.skipped) == {"blocks.0", "blocks.1.mlp"}
    assert torch.equal(train_step("transformer", model), reference("transformer")[0])


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("name", ["transformer", "resnet"])
def test_torch_compile_after_apply(name: str):
    """Dropout (transformer) and BatchNorm statistics (resnet) under the compiled checkpoint op."""
    torch._dynamo.reset()
    ref_loss, ref_grads, ref_buffers, _ = reference(name)
    model = _file(name).build_model()
    apply_plan(model, make_plan(model, ALL_BLOCKS[name][:3]))
    compiled = torch.compile(model, backend="aot_eager")
    assert torch.equal(train_step(name, compiled), ref_loss)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, ref_buffers[n]), n


# ----------------------------------------------------------------------------- verify and train.py


def test_verify_compares_gradients_and_checks_the_budget():
    from planner.act.verify import verify

    torch.manual_seed(0)
    model, x = _Toy(), torch.randn(16, 8)
    plan = make_plan(model, ["inner", "act"], x, checkpoint_units=["inner", "act", "act#1"], optimizer="adamw")
    report = verify(model, plan, inputs=x, steps=1)
    # make_plan's predicted peak is a placeholder (1 MiB): the only problem is the prediction
    assert [p for p in report.problems if "off the measured" not in p] == [] and not report.prediction_ok
    assert report.max_grad_diff == 0.0 and report.max_buffer_diff == 0.0 and report.loss_diff == 0.0
    assert report.measured_recomputes == report.planned_recomputes == 3
    assert report.measured_peak_bytes > 0 and report.peak_source == "cpu-profiler"
    assert [r[0] for r in report.rows()][:3] == ["peak memory", "prediction error", "peak without the plan"]
    right = plan.predicted.model_copy(update={"peak_bytes": report.measured_peak_bytes})
    report = verify(model, plan.model_copy(update={"predicted": right}), inputs=x, steps=1)
    assert report.ok, report.problems
    assert planned_modules(model) == [] and all(p.grad is None for p in model.parameters())

    report = verify(model, plan.model_copy(update={"budget_bytes": 1}), inputs=x, steps=1)
    assert not report.ok and "over the budget" in report.problems[0]
    assert any("OVER" in r[3] for r in report.rows())


def test_nan_gradients_are_compared_not_read_as_zero():
    """NOTE [ Comparing non-finite values ]: max(0.0, nan) is 0.0, so NaN gradients read as equal to anything."""
    from planner.act.compare import max_abs_diff, nonfinite

    nan, inf = float("nan"), float("inf")
    t = lambda *v: {"w": torch.tensor(v)}  # noqa: E731
    assert max_abs_diff(t(1.0, nan, inf), t(1.0, nan, inf)) == 0.0
    assert max_abs_diff(t(1.0, 2.0), t(1.0, nan)) == inf and max_abs_diff(t(nan, 2.0), t(1.0, 2.0)) == inf
    assert max_abs_diff(t(inf), t(-inf)) == inf and max_abs_diff(t(1.0, 2.0), t(1.5, 2.0)) == 0.5
    assert nonfinite({**t(1.0, nan), "b": torch.ones(2), "n": None}) == ["w"]

    from planner.act.verify import verify

    torch.manual_seed(0)
    model, x = _Toy(), torch.full((16, 8), nan)  # a NaN batch: the loss and every gradient are NaN
    plan = make_plan(model, ["inner", "act"], x, checkpoint_units=["inner", "act", "act#1"], optimizer="adamw")
    report = verify(model, plan, inputs=x, steps=1)
    assert report.max_grad_diff == 0.0 and any("hold NaN or inf without the plan" in n for n in report.notes)


def test_verify_judges_its_steps_under_the_thread_count_they_ran_with(monkeypatch):
    """The noise note's ``--threads 1`` hint reads the thread count: the report is made inside the
    steps' thread context (it once read the caller's count, and hinted ``--threads 1`` to a user who
    had passed it)."""
    import planner.act.verify as verify_module

    seen, report_of = [], verify_module._report
    monkeypatch.setattr(verify_module, "_report", lambda *a, **k: seen.append(torch.get_num_threads()) or
                        report_of(*a, **k))
    torch.manual_seed(0)
    model, x = _Toy(), torch.randn(16, 8)
    plan = make_plan(model, ["inner", "act"], x, checkpoint_units=["inner", "act", "act#1"], optimizer="adamw")
    wanted = torch.get_num_threads() + 1
    report = verify_module.verify(model, plan, inputs=x, steps=1, threads=wanted)
    assert seen == [wanted] and report.threads == wanted


def test_verify_model_file_and_train_script(tmp_path, capsys):
    from planner.act.verify import verify

    model_file = tmp_path / "toy.py"
    model_file.write_text(
        "import torch\n"
        "def build_model():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.2), torch.nn.GELU(),\n"
        "                               torch.nn.Linear(32, 8))\n"
        "def example_inputs():\n"
        "    return torch.randn(16, 8, generator=torch.Generator().manual_seed(0))\n"
        "def loss_fn(output):\n"
        "    return output.square().mean()\n")
    mf = load_model_file(model_file)
    plan_path = make_plan(mf.build_model(), ["0", "2"], mf.example_inputs()).save(tmp_path / "plan.json")
    report = verify(model_file, plan_path, steps=1)
    assert report.checkpointed == ["0", "2"] and report.max_grad_diff == 0.0
    assert all("off the measured" in p for p in report.problems)  # make_plan predicts a placeholder peak

    spec = importlib.util.spec_from_file_location("remat_train_script", EXAMPLES / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    train.main([str(model_file), "--plan", str(plan_path), "--steps", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "step 1: loss" in out and "recomputed 4 checkpointed forwards in 2 steps" in out


def test_verify_of_a_per_rank_plan_needs_the_model_file(tmp_path):
    """A per-rank plan is verified on ranks of their own (tests/test_distributed.py), which import the model file."""
    import random

    from planner.act.api import plan_from_profile
    from planner.errors import BadInput
    from planner.model.synthetic import random_chain, synthetic_profile
    from planner.act.verify import verify

    prof = synthetic_profile(random_chain(random.Random(0), 4))
    plan = plan_from_profile(prof, "1GB", solver="none", world_size=2, sharding="fsdp")
    with pytest.raises(BadInput, match=r"pass the model file \(model.py\)"):
        verify(torch.nn.Linear(2, 2), plan, inputs=torch.ones(1, 2))
