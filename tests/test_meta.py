"""--device meta: fake-tensor bytes against a real CPU step, the roofline, the CLI.

The byte checks run the faked step with the CPU's rules (``device_type="cpu"``) next to a real
CPU step of the same model: every unit's saved, input and output bytes, the static memory and
the peak must agree (the fake tensors carry the real ``nbytes``). NOTE [ Meta profiling ] in
planner/profiling/meta.py says what the target's rules change on top.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import invoke
from planner.profiling.devices import get_device, usable_bytes
from planner.errors import BadInput, ProfileError
from planner.profiling.meta import build_on_meta, profile_meta
from planner.profiling.roofline import BANDWIDTH_EFFICIENCY, MATMUL_EFFICIENCY
from planner.profiling.model_file import load_model_file
from planner.profiling import profile
from planner.model.schema import Plan, Profile, Recipe

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _sum(out: torch.Tensor) -> torch.Tensor:
    return out.sum()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(),
                         nn.LayerNorm(64), nn.Linear(64, 8))


def _small_transformer() -> nn.Module:
    from examples.transformer import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=64)


def _transformer_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _example(name: str) -> tuple:
    mf = load_model_file(EXAMPLES / f"{name}.py")
    return mf.build_model, mf.example_inputs, mf.loss_fn


CASES = {
    "mlp": lambda: (_mlp, lambda: torch.randn(32, 64, generator=torch.Generator().manual_seed(0)), _sum, None),
    "mlp-bf16-autocast": lambda: (_mlp, lambda: torch.randn(32, 64, generator=torch.Generator().manual_seed(0)),
                                  _sum, "bf16"),
    "transformer": lambda: (_small_transformer, _transformer_inputs, lambda loss: loss, None),
    "gpt2": lambda: (*_example("gpt2"), None),
    "unet": lambda: (*_example("unet"), None),  # convolutions, BatchNorm, mse_loss
}
PEAK_TOLERANCE = {"unet": 0.06}
"""The CPU's convolution backward allocates scratch inside its kernels, which the device sees and
no tracker does (4.7% on examples/unet.py; see planner/profiling/profiler.py): only the peak differs."""


def _saved_bytes(prof: Profile) -> dict[str, int]:
    nbytes = {t.id: t.nbytes for t in prof.tensors}
    out = {u.id: 0 for u in prof.units}
    for s in prof.saves:
        out[s.unit] += nbytes[s.tensor_id]
    return out


def _worst_unit_gap(real: Profile, fake: Profile) -> tuple[float, str]:
    """Largest relative difference of saved/input/output bytes over the units, and where."""
    assert [u.id for u in real.units] == [u.id for u in fake.units]
    sr, sf = _saved_bytes(real), _saved_bytes(fake)
    worst, where = 0.0, ""
    for ur, uf in zip(real.units, fake.units):
        for what, a, b in (("saved", sr[ur.id], sf[uf.id]), ("input", ur.input_bytes, uf.input_bytes),
                           ("output", ur.output_bytes, uf.output_bytes)):
            gap = abs(a - b) / max(a, b, 1)
            if gap > worst:
                worst, where = gap, f"{ur.id} {what}: real {a}, fake {b}"
    return worst, where


@pytest.mark.parametrize("case", CASES)
def test_fake_bytes_equal_a_real_cpu_step(case: str, bytes_only):
    build, inputs, loss_fn, amp = CASES[case]()
    real = profile(build(), inputs(), loss_fn=loss_fn, device="cpu", steps=1, recipe=Recipe(amp=amp))
    fake = profile_meta(build_on_meta(build), inputs(), loss_fn=loss_fn, target="h100", device_type="cpu",
                        recipe=Recipe(amp=amp))
    worst, where = _worst_unit_gap(real, fake)
    assert worst <= 0.01, f"{case}: {worst:.2%} at {where}"
    for field in ("params_bytes", "buffers_bytes", "batch_bytes", "grads_bytes", "optimizer_bytes"):
        assert getattr(fake.step, field) == getattr(real.step, field), field
    assert fake.amp == real.amp and fake.dtype == real.dtype
    assert fake.step.measured_peak_bytes == pytest.approx(real.step.measured_peak_bytes,
                                                          rel=PEAK_TOLERANCE.get(case, 0.01))
    assert (fake.device, fake.target, fake.step.peak_source) == ("meta", "h100-sxm", "tracker")


def test_the_model_comes_back_unchanged():
    model = _mlp()
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    model.eval()
    profile(model, torch.randn(4, 64), loss_fn=_sum, device="meta", target="h100")
    assert not model.training
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]) and p.grad is None


# ----------------------------------------------------------------------------- the roofline


def test_roofline_times_follow_flops_and_bytes():
    """A large bf16 matmul is compute-bound, a ReLU bandwidth-bound: their times are exact."""
    spec = get_device("h100")
    model = nn.Sequential(nn.Linear(4096, 4096, bias=False), nn.ReLU()).to(torch.bfloat16)
    x = torch.randn(2048, 4096, dtype=torch.bfloat16)
    prof = profile_meta(model, x, loss_fn=_sum, target=spec, optimizer="none")
    lin, relu = prof.unit("0"), prof.unit("1")
    assert lin.flops == 2 * 2048 * 4096 * 4096
    assert lin.forward_ms == pytest.approx(lin.flops / (spec.peak_flops.bf16 * MATMUL_EFFICIENCY) * 1e3, rel=1e-9)
    assert lin.backward_ms == pytest.approx(lin.forward_ms, rel=1e-9)  # the weight's gradient (the batch needs none)
    moved = 2 * 2048 * 4096 * 2  # read the input, write the output, bf16
    assert relu.flops == 0
    assert relu.forward_ms == pytest.approx(moved / (spec.memory_bandwidth_bytes_per_s * BANDWIDTH_EFFICIENCY) * 1e3,
                                            rel=1e-9)


def test_times_are_positive_and_scale_with_flops():
    def step_ms(width: int, target: str = "h100") -> Profile:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        return profile_meta(model, torch.randn(1024, width), loss_fn=_sum, target=target)

    small, big = step_ms(1024), step_ms(4096)
    for prof in (small, big):
        assert all(u.forward_ms > 0 and u.backward_ms > 0 for u in prof.units if u.id != "<loss>")
        assert prof.step.step_ms == pytest.approx(prof.step.forward_ms + prof.step.backward_ms
                                                  + prof.step.optimizer_ms)
    flops_ratio = big.unit("0").flops / small.unit("0").flops
    assert flops_ratio == 16
    assert big.unit("0").forward_ms / small.unit("0").forward_ms == pytest.approx(16, rel=0.05)
    # fp32 runs on the CUDA cores: a T4 (8.1 TFLOP/s) is slower than an H100 (67)
    assert step_ms(4096, "t4").step.forward_ms > 5 * big.step.forward_ms


def test_cuda_rules_use_cudas_attention_kernels():
    """With dropout, the CPU runs SDPA's math path (saves B x H x S x S); CUDA runs a fused kernel."""
    build, inputs = _small_transformer, _transformer_inputs
    cpu = profile_meta(build_on_meta(build), inputs(), loss_fn=lambda x: x, target="h100", device_type="cpu")
    cuda = profile_meta(build_on_meta(build), inputs(), loss_fn=lambda x: x, target="h100", device_type="cuda")
    scores = 2 * 4 * 64 * 64 * 4  # B x H x S x S fp32
    attn = "blocks.0.attn"
    sizes = {t.id: t.nbytes for t in cuda.tensors}
    assert scores not in {sizes[s.tensor_id] for s in cuda.saves if s.unit == attn}
    assert _saved_bytes(cuda)[attn] < _saved_bytes(cpu)[attn] - scores
    # and the caching allocator's 512-byte blocks
    assert all(t.nbytes % 512 == 0 for t in cuda.tensors) and cuda.step.params_bytes % 512 == 0
    assert cuda.step.params_bytes > cpu.step.params_bytes


def test_amp_lowers_bytes_and_picks_the_half_precision_column():
    build, inputs = _small_transformer, _transformer_inputs
    fp32 = profile_meta(build_on_meta(build), inputs(), loss_fn=lambda x: x, target="h100")
    bf16 = profile_meta(build_on_meta(build), inputs(), loss_fn=lambda x: x, target="h100", recipe=Recipe(amp="bf16"))
    assert bf16.amp == "bf16" and fp32.amp is None
    assert sum(_saved_bytes(bf16).values()) < sum(_saved_bytes(fp32).values())
    assert bf16.unit("blocks.0.mlp").forward_ms < fp32.unit("blocks.0.mlp").forward_ms


def test_a_model_that_reads_values_is_told_to_use_a_real_device():
    class ReadsValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x[x > 0].view(-1, 4)[:1]) if x.sum().item() > 0 else self.lin(x)

    with pytest.raises(ProfileError, match="fake tensors.*device cpu or cuda"):
        profile(ReadsValues(), torch.randn(8, 4), loss_fn=_sum, device="meta", target="h100")


def test_meta_needs_a_known_target():
    with pytest.raises(BadInput, match="target NAME.*h100-sxm"):
        profile(_mlp(), torch.randn(4, 64), loss_fn=_sum, device="meta")
    with pytest.raises(BadInput, match="choose one of: .*h100-sxm"):
        profile(_mlp(), torch.randn(4, 64), loss_fn=_sum, device="meta", target="tpu-v5")
    with pytest.raises(BadInput, match="times are measured"):
        profile(_mlp(), torch.randn(4, 64), loss_fn=_sum, device="cpu", target="h100")


def test_llama_7b_profiles_on_fake_tensors():
    """examples/llama7b.py (6.7B parameters, bf16, 1 x 4096): seconds, and no memory taken."""
    mf = load_model_file(EXAMPLES / "llama7b.py")
    model = build_on_meta(mf.build_model)
    prof = profile(model, mf.example_inputs(), device="meta", target="h100")
    n = sum(p.numel() for p in model.parameters())
    assert n == 6_738_415_616
    assert prof.dtype == "bfloat16"
    assert prof.step.params_bytes == pytest.approx(2 * n, rel=1e-4)  # 512-byte blocks
    assert prof.step.optimizer_bytes == pytest.approx(2 * prof.step.params_bytes, rel=1e-4)
    assert len([u for u in prof.units if u.module_type == "LlamaDecoderLayer"]) == 32
    # the 6 N T rule of thumb (6 FLOPs per parameter and token, attention left out) to 20%
    fwd_flops = prof.unit("<root>").flops
    assert 2 * n * 4096 <= fwd_flops <= 1.2 * 2 * n * 4096
    assert 0.1 < prof.step.step_ms / 1e3 < 2.0, prof.step.step_ms


# ----------------------------------------------------------------------------- CLI


TINY_MODEL = '''\
import torch
from torch import nn

def build_model():
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)], nn.Linear(32, 4))

def example_inputs():
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
'''


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(TINY_MODEL)
    return path


def test_cli_plans_on_meta_with_the_targets_usable_memory(tiny: Path, tmp_path: Path):
    out = tmp_path / "plan.json"
    r = invoke("plan", "--device", "meta", "--target", "T4", tiny, "-o", out, "--quiet")
    assert r.exit_code == 0, r.output
    assert f"budget t4 usable memory = {usable_bytes(get_device('t4'))} bytes" in r.stdout
    plan = Plan.load(out)
    assert (plan.device, plan.target, plan.budget_bytes) == ("meta", "t4", usable_bytes(get_device("t4")))


def test_cli_profile_on_meta_with_amp(tiny: Path, tmp_path: Path):
    out = tmp_path / "profile.json"
    r = invoke("profile", "--device", "meta", "--target", "h100-sxm5", "--amp", "bf16", tiny, "-o", out, "--quiet")
    assert r.exit_code == 0, r.output
    prof = Profile.load(out)
    assert (prof.device, prof.target, prof.amp, prof.device_name) == ("meta", "h100-sxm", "bf16",
                                                                      "NVIDIA H100 SXM5 80GB")
    r = invoke("plan", "--profile", out, "--json", "--quiet")  # the budget from the profile's target
    assert r.exit_code == 2 and "give --budget SIZE" in r.output
    r = invoke("plan", "--profile", out, "--target", "h100", "--json", "--quiet")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["budget_bytes"] == usable_bytes(get_device("h100"))


def test_cli_target_errors(tiny: Path):
    r = invoke("plan", "--device", "meta", "--target", "tpu-v5", tiny)
    assert r.exit_code == 2 and "unknown device 'tpu-v5'" in r.output and "h100-sxm" in r.output and "t4" in r.output
    r = invoke("plan", "--device", "meta", "--budget", "1GB", tiny)
    assert r.exit_code == 2 and "--target NAME" in r.output and "a100-80gb" in r.output
    r = invoke("plan", "--amp", "fp8", "--budget", "1GB", tiny)
    assert r.exit_code == 2 and "unknown amp" in r.output


def test_cli_verify_refuses_meta(tiny: Path, tmp_path: Path):
    plan = tmp_path / "plan.json"
    assert invoke("plan", "--device", "meta", "--target", "h100", tiny, "-o", plan, "-q").exit_code == 0
    r = invoke("verify", tiny, plan, "--device", "meta")
    assert r.exit_code == 2 and "use --device cpu or cuda" in r.output


def test_cli_target_on_a_real_device_sets_only_the_budget(tiny: Path):
    r = invoke("plan", "--device", "cpu", "--steps", "1", "--target", "rtx-3060-12gb", tiny, "--json", "--quiet")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["device"] == "cpu" and plan["target"] is None
    assert plan["budget_bytes"] == usable_bytes(get_device("rtx-3060-12gb"))


def test_usable_memory_leaves_a_reserve():
    h100, t4 = get_device("h100"), get_device("t4")
    assert usable_bytes(h100) == 75 * 2**30
    assert usable_bytes(t4) == 16 * 2**30 - 2**30 - math.floor(0.05 * 16 * 2**30)


# ----------------------------------------------------------------------------- benchmarks/gpu_check.py


def test_gpu_check_skips_without_cuda():
    import os
    import subprocess
    import sys

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "no CUDA device: skipping"


def test_gpu_check_matches_gpus_and_calibrates():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.match_target("NVIDIA H200") == "h200"
    assert gpu_check.match_target("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert gpu_check.match_target("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert (gpu_check.match_target("NVIDIA L40S"), gpu_check.match_target("NVIDIA L4")) == ("l40s", "l4")
    prof = profile_meta(_mlp(), torch.randn(32, 64), loss_fn=_sum, target="h100")
    c = gpu_check.calibration(prof, prof)
    assert c["step_ratio"] == 1.0 and c["worst_unit_saved_bytes_gap"] == 0.0
    assert {u["unit"] for u in c["units"]} and all(u["fwd_ratio"] == 1.0 for u in c["units"] if u["measured_fwd_ms"])


def test_api_plan_on_meta_with_the_default_budget():
    import planner

    plan = planner.plan(_mlp(), None, inputs=torch.randn(32, 64), loss_fn=_sum, device="meta", target="t4",
                        recipe=Recipe(amp="bf16"))
    assert (plan.device, plan.target, plan.amp) == ("meta", "t4", "bf16")
    assert plan.budget_bytes == usable_bytes(get_device("t4"))
    with pytest.raises(BadInput, match="needs a budget"):
        planner.plan(_mlp(), None, inputs=torch.randn(32, 64), loss_fn=_sum, device="meta")
