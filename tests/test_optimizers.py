"""The optimizers users train with (NOTE [ Optimizer specs ] in planner/optimizers.py): any torch.optim
class by name with the settings that move memory, transformers' Adafactor, the user's own Optimizer
subclass. Each is profiled, planned and verified at tolerance 0 with its predicted peak as measured,
its state bytes those the optimizer really keeps; bad names are one line; the Trainer callback
compares the Trainer's optimizer with the plan's (tests/test_integrations.py runs the Trainer)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import planner
from planner.act.api import graph_for, min_feasible_bytes
from planner.act.verify import verify
from planner.errors import BadInput
from planner.optimizers import parse_optimizer, spec_of
from solvers.cost_model import simulate
from tests.conftest import invoke
from tests.model_files import TINY_MODEL

WIDTH, ROWS = 48, 2


class SignMomentum(torch.optim.Optimizer):
    """A user's own optimizer: one momentum buffer per parameter, steps by its sign (Lion-like)."""

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.add_(buf.sign(), alpha=-group["lr"])


class WithoutLr(torch.optim.Optimizer):
    """An optimizer whose step size is fixed: remat cannot step it at lr=0."""

    def __init__(self, params, beta: float = 0.9):
        super().__init__(params, dict(beta=beta))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
                           for _ in range(3)))


def _batch() -> torch.Tensor:
    return torch.randn(ROWS, 64, WIDTH, generator=torch.Generator().manual_seed(0))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _state_bytes(spec: str, model: nn.Module, batch, loss_fn) -> int:
    """What the optimizer keeps after a real step at a real lr, built as a user builds it."""
    opt = _as_user_builds(spec, model)
    loss_fn(model(**batch) if isinstance(batch, dict) else model(batch)).backward()
    opt.step()
    return sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def _as_user_builds(spec: str, model: nn.Module) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    table = {"sgd:momentum=0.0": lambda p: torch.optim.SGD(p, lr=0.1),
             "rmsprop:centered=True,momentum=0.9": lambda p: torch.optim.RMSprop(p, lr=0.01, centered=True,
                                                                                  momentum=0.9),
             "adam:amsgrad=True": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
             "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01),
             "tests.test_optimizers.SignMomentum": lambda p: SignMomentum(p, lr=1e-3),
             "adafactor": lambda p: Adafactor(p, lr=1e-3, scale_parameter=False, relative_step=False),
             "adafactor:relative_step=True,scale_parameter=True": lambda p: Adafactor(p),
             "adafactor:beta1=0.9": lambda p: Adafactor(p, lr=1e-3, scale_parameter=False, relative_step=False,
                                                        beta1=0.9)}
    opt = table[spec](model.parameters())
    assert spec_of(opt) == spec  # the spec a plan records is the one read back from the built optimizer
    return opt


def _verified(build, batch, spec, loss_fn=None):
    """Profile, plan at a mid budget and verify at tolerance 0 with ``spec``: (profile, report)."""
    prof = planner.profile(build(), batch, loss_fn=loss_fn, device="cpu", optimizer=spec, steps=1, threads=1)
    g = graph_for(prof)
    plan = planner.plan(prof, (min_feasible_bytes(g) + simulate(g, []).peak_bytes) // 2)
    assert plan.optimizer == prof.optimizer == parse_optimizer(spec)
    report = verify(build(), plan, inputs=batch, loss_fn=loss_fn, device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.predicted_peak_bytes == report.measured_peak_bytes
    assert report.predicted_no_plan_peak_bytes == report.measured_no_plan_peak_bytes
    return prof, report


@pytest.mark.parametrize("spec", ["sgd:momentum=0.0", "rmsprop:centered=True,momentum=0.9", "adam:amsgrad=True",
                                  "adagrad", "tests.test_optimizers.SignMomentum"])
def test_each_optimizer_state_and_step_are_in_the_prediction_exactly(spec):
    """No state (plain SGD), two buffers and a step temporary (centered RMSprop with momentum), three buffers
    (AMSGrad), one (Adagrad), a user's own class by its dotted path: the profile's optimizer bytes are what the
    optimizer keeps, and the plan verifies with predicted = measured peak, with and without the plan."""
    prof, report = _verified(_mlp, _batch(), spec, loss_fn=_loss)
    assert prof.step.optimizer_bytes == _state_bytes(spec, _mlp(), _batch(), _loss)
    adamw = planner.profile(_mlp(), _batch(), loss_fn=_loss, device="cpu", steps=1, threads=1)
    assert prof.step.optimizer_bytes != adamw.step.optimizer_bytes  # what remat counted for any of these before


@pytest.mark.parametrize("spec", ["rmsprop:centered=True,momentum=0.9", "nadam", "adafactor:beta1=0.9", "adamw",
                                  "radam"])
def test_a_peak_at_the_optimizer_step_is_predicted_with_the_step_temporaries(spec):
    """Two tokens: the peak is in ``optimizer.step()`` (parameters, gradients, state and the step's temporaries),
    and the prediction is the measured peak to the byte. AdamW: the temporaries from the step as run, not from
    the tracked step, whose per-parameter scalars held 8 bytes more (NOTE [ Step as run ], Rule 4). RAdam: the
    steady state's rectified update (NOTE [ Optimizer specs ], Rule 6)."""
    batch = torch.randn(1, 2, WIDTH, generator=torch.Generator().manual_seed(0))
    prof = planner.profile(_mlp(), batch, loss_fn=_loss, device="cpu", optimizer=spec, steps=1, threads=1)
    plan = planner.plan(prof, "1GB")
    assert plan.predicted.peak_at == "optimizer step" and prof.step.optimizer_step_transient_bytes > 0
    report = verify(_mlp(), plan, inputs=batch, loss_fn=_loss, device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.predicted_peak_bytes == report.measured_peak_bytes


@pytest.mark.parametrize("spec", ["adafactor", "adafactor:relative_step=True,scale_parameter=True",
                                  "adafactor:beta1=0.9"])
def test_adafactor_on_a_hugging_face_model_verifies_at_tolerance_0(spec):
    """transformers' Adafactor as the Trainer builds it (lr given, no relative step), as its own defaults build it
    (relative step: remat zeroes the lr it computes, in place) and with a first moment (beta1): factored
    second moments for matrices, full ones for vectors, on a GPT-2 from its config."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                          bos_token_id=0, eos_token_id=0)).train()

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=ids, labels=ids.clone())
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prof = planner.profile(model, batch, device="cpu", optimizer=spec, steps=1, threads=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # profiling trains nothing
    prof, _ = _verified(build, batch, spec)
    assert prof.step.optimizer_bytes == _state_bytes(spec, build(), batch, lambda out: out.loss)


def test_names_settings_and_classes_read_as_one_canonical_spec():
    """Any case; remat's 'sgd' stays momentum 0.9 (old plans keep their meaning); settings that move no memory
    (lr, betas, AdamW's decoupled weight decay) are not recorded; a class or a partial of one is its spec."""
    assert parse_optimizer("SGD") == parse_optimizer("sgd:momentum=0.9") == "sgd"
    assert parse_optimizer("SGD:momentum=0") == parse_optimizer(torch.optim.SGD) == "sgd:momentum=0.0"
    # a class by its path is the class (its own defaults), as the Trainer's built optimizer reads: was
    # 'torch.optim.SGD', which no built SGD's spec equals
    assert parse_optimizer("torch.optim.SGD") == "sgd:momentum=0.0" and parse_optimizer("torch.optim.AdamW") == "adamw"
    assert parse_optimizer("AdamW:betas=(0.9, 0.95),lr=1e-4,weight_decay=0.1") == "adamw"
    assert parse_optimizer("adam:weight_decay=0.1") == "adam:weight_decay=0.1"  # coupled: a temporary per grad
    assert parse_optimizer("RMSprop:momentum=0.9,centered=True") == "rmsprop:centered=True,momentum=0.9"
    assert parse_optimizer(functools.partial(torch.optim.RMSprop, centered=True)) == "rmsprop:centered=True"
    assert parse_optimizer("torch.optim.Adafactor") == "torch.optim.Adafactor"  # torch's own; 'adafactor' is HF's


@pytest.mark.parametrize("value, message", [
    ("bogus", "unknown optimizer 'bogus'; choose one of adamw, adam, sgd, adafactor, none, adadelta, adagrad"),
    ("LBFGS", "optimizer 'lbfgs' is not supported: its step(closure) re-runs forward and backward"),
    ("sgd:moment=0.9", "optimizer sgd has no setting 'moment'; it takes dampening, differentiable"),
    ("sgd:momentum=high", "the value must be a Python literal"),
    ("adamw:fused=True", "optimizer setting 'fused' is the step's implementation: give --fused"),
    ("adafactor:warmup_init=True", "`warmup_init=True` requires `relative_step=True`"),
    ("mypkg.Lion", "optimizer 'mypkg.Lion': cannot import it (ModuleNotFoundError"),
    (".", "unknown optimizer '.'; choose one of adamw"),  # was ValueError: Empty module name (the fuzz test)
    ("os.", "unknown optimizer 'os.'; choose one of adamw"),
    ("tests.test_optimizers.WithoutLr", "optimizer tests.test_optimizers.WithoutLr takes no lr: remat steps at lr=0"),
])
def test_bad_optimizers_are_one_line_naming_what_is_accepted(value, message):
    with pytest.raises(BadInput) as err:
        parse_optimizer(value)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cli_plans_with_any_optimizer_and_refuses_a_bad_one_in_one_line(tmp_path):
    tiny_model = tmp_path / "tiny.py"
    tiny_model.write_text(TINY_MODEL)
    out = tmp_path / "plan.json"
    r = invoke("plan", tiny_model, "--budget", "1GB", "--optimizer", "RMSprop:centered=True", "--steps", "1",
               "-o", out)
    assert r.exit_code == 0, r.output
    assert planner.Plan.load(out).optimizer == "rmsprop:centered=True"
    assert "step: rmsprop:centered=True," in r.output
    r = invoke("plan", tiny_model, "--budget", "1GB", "--optimizer", "rmsprop", "--fused")
    assert r.exit_code == 2 and r.output.strip() == ("error: --fused chooses the optimizer's implementation, but "
                                                     "--optimizer rmsprop has no fused implementation: drop --fused or "
                                                     "pick an optimizer that has one")
