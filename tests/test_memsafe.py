"""The memory-safe profile (planner/profiling/memsafe.py): measured under checkpointing, it describes the
unplanned step as a full profile does; the CPU memory cap (planner/profiling/capped.py); out of memory on
every device."""

import os
import runpy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app as cli
from planner.profiling import memsafe
from planner.act.api import graph_for, plan_from_profile
from planner.profiling.capped import MALLOC_ENV, OVERHEAD_ALLOWANCE_BYTES
from solvers.cost_model import simulate
from planner.errors import OOM_HINT, ProfileError
from planner.profiling.measure import is_oom, user_code
from planner.profiling.memsafe import candidate_modules, profile_checkpointed, profile_within
from planner.profiling import profile
from tests.conftest import fewest_dispatch_rounds

ROOT = Path(__file__).resolve().parent.parent
CPU_OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes. Error code 12"


def tiny_gpt():
    """examples/transformer.py's GPT, 3 layers of width 64, with dropout (so that recomputation
    must replay the RNG)."""
    gpt = runpy.run_path(str(ROOT / "examples" / "transformer.py"))["GPT"]
    torch.manual_seed(0)
    model = gpt(vocab_size=256, block_size=64, n_layer=3, n_head=4, d_model=64, dropout=0.1)
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    return model, (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


@pytest.fixture(scope="module")
def profiles():
    """A full profile and a memory-safe one of the same step (torch's own thread count; the fewest
    dispatch-timing rounds: the tests compare bytes, and give both profiles the same times)."""
    with fewest_dispatch_rounds():
        model, inputs = tiny_gpt()
        full = profile(model, inputs, device="cpu", steps=1)
        model, inputs = tiny_gpt()
        safe = profile_checkpointed(model, inputs, checkpointed=candidate_modules(full), device="cpu", steps=1)
    return full, safe


def test_saved_bytes_and_calibration_match(profiles):
    full, safe = profiles
    gf, gs = graph_for(full), graph_for(safe)
    assert list(gf.nodes) == list(gs.nodes)
    for n in gf.nodes:
        assert gs.nodes[n]["saved_bytes"] == gf.nodes[n]["saved_bytes"], n
        assert gs.nodes[n]["input_bytes"] == gf.nodes[n]["input_bytes"], n
    # the per-window temporaries come out of the reconstructed timeline as out of the measured one
    # (within the few KB of RNG state per checkpointed call that the reconstruction cannot place)
    for n in gf.graph["leaves"]:
        for key in ("fwd_transient_bytes", "bwd_transient_bytes"):
            assert abs(gs.nodes[n][key] - gf.nodes[n][key]) <= 0.02 * full.step.measured_peak_bytes, (n, key)
    assert safe.measured_with_checkpoints == candidate_modules(full)
    assert full.measured_with_checkpoints == []
    assert any("memory-safe profile" in note for note in safe.notes)


def test_plans_and_predictions_match(profiles):
    full, safe = profiles
    # times are noise between any two profiles: give both the same, to compare the memory side
    times = {u.id: (u.forward_ms, u.backward_ms) for u in full.units}
    safe = safe.model_copy(update={"units": [u.model_copy(update={"forward_ms": times[u.id][0],
                                                                   "backward_ms": times[u.id][1]})
                                             for u in safe.units]})
    gf, gs = graph_for(full), graph_for(safe)
    none = simulate(gf, []).peak_bytes
    assert abs(simulate(gs, []).peak_bytes - full.step.measured_peak_bytes) <= 0.02 * full.step.measured_peak_bytes
    lowest = simulate(gf, gf.graph["leaves"]).peak_bytes
    for frac in (0.2, 0.5, 0.8):
        budget = int((lowest + frac * (none - lowest)) / 0.995) + 1
        # whole modules: op times are noise between two profiles too, and they move op-level choices
        pf, ps = plan_from_profile(full, budget, selective=False), plan_from_profile(safe, budget, selective=False)
        assert ps.checkpoint_units == pf.checkpoint_units, frac
        assert abs(ps.predicted.peak_bytes - pf.predicted.peak_bytes) <= 0.02 * pf.predicted.peak_bytes


def test_forward_times_include_the_recompute(profiles):
    _, safe = profiles
    for fqn in safe.measured_with_checkpoints:
        assert safe.unit(fqn).forward_ms > 0


def test_out_of_memory_leads_to_a_checkpointed_profile(monkeypatch, one_thread, bytes_only):
    model, inputs = tiny_gpt()

    def out_of_memory(*args, **kwargs):
        try:
            raise RuntimeError(CPU_OOM)
        except RuntimeError as e:
            raise ProfileError(f"out of memory in the model's forward: {OOM_HINT}") from e

    monkeypatch.setattr(memsafe, "profile_as_run", out_of_memory)
    prof = profile_within(model, inputs, device="cpu", steps=1)
    assert prof.measured_with_checkpoints
    assert any("ran out of memory" in note for note in prof.notes)


def test_a_predicted_overflow_skips_the_unplanned_step(monkeypatch, profiles, one_thread, bytes_only):
    full, _ = profiles
    model, inputs = tiny_gpt()
    monkeypatch.setattr(memsafe, "profile_as_run", lambda *a, **k: pytest.fail("the unplanned step was run"))
    prof = profile_within(model, inputs, device="cpu", steps=1,
                          device_memory_bytes=full.step.measured_peak_bytes // 2)
    assert prof.measured_with_checkpoints
    assert any("fake-tensor pass" in note for note in prof.notes)


def test_other_errors_are_not_taken_for_out_of_memory(monkeypatch):
    model, inputs = tiny_gpt()

    def broken(*args, **kwargs):
        raise ProfileError("the model's forward raised ValueError: bad shape")

    monkeypatch.setattr(memsafe, "profile_as_run", broken)
    with pytest.raises(ProfileError, match="bad shape"):
        profile_within(model, inputs, device="cpu", steps=1)


def test_show_says_how_the_profile_was_measured(profiles, tmp_path):
    _, safe = profiles
    path = safe.save(tmp_path / "profile.json")
    result = CliRunner().invoke(cli.app, ["show", str(path)])
    assert result.exit_code == 0, result.output
    assert "memory-safe profile: measured with" in result.output


def test_out_of_memory_is_recognised_on_every_device():
    assert is_oom(RuntimeError(CPU_OOM)) and cli._is_oom(RuntimeError(CPU_OOM))
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory")) and cli._is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(MemoryError()) and cli._is_oom(MemoryError())
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    with pytest.raises(ProfileError, match="out of memory in backward") as info:
        with user_code("backward"):
            raise RuntimeError(CPU_OOM)
    assert OOM_HINT in str(info.value)


def test_cli_out_of_memory_hint_and_exit_code(monkeypatch, tmp_path):
    """An out-of-memory error outside user code ends like one inside it: the hint, ProfileError's code."""
    def oom(*args, **kwargs):
        raise RuntimeError(CPU_OOM)

    monkeypatch.setattr(cli, "_run_profiler", oom)
    from tests.model_files import TINY_MODEL

    model = tmp_path / "m.py"
    model.write_text(TINY_MODEL)  # a model file that loads: the CLI reads it before profiling
    result = CliRunner().invoke(cli.app, ["profile", str(model), "--device", "cpu"])
    assert result.exit_code == ProfileError.exit_code
    assert OOM_HINT in result.output


CAP_CHECK = textwrap.dedent("""
    import sys, torch
    from planner.profiling.capped import cap_address_space, prepare
    prepare()
    cap = int(sys.argv[1])
    cap_address_space(cap, 0)
    held, chunk = [], 1 << 20
    try:
        while True:
            held.append(torch.ones(chunk // 4))
    except RuntimeError as e:
        assert "can't allocate memory" in str(e), e
    print(len(held) * chunk)
""")


def test_the_cpu_cap_is_enforced_by_the_allocator():
    """In a capped child, tensors can be allocated up to the cap (plus the allowance for what is
    not tensors), and the CPU allocator's own error ends it."""
    cap = 64 << 20
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CAP_CHECK, str(cap)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    reached = int(out.stdout.split()[-1])
    assert cap <= reached <= cap + OVERHEAD_ALLOWANCE_BYTES, reached


@pytest.mark.parametrize(("reported", "capability", "spec"), [
    ("NVIDIA A100-SXM4-40GB", (8, 0), "a100-40gb"), ("NVIDIA B200", (10, 0), "fallback"), ("NVIDIA B200", (10, 0), None),
])
def test_both_fake_routes_take_this_gpus_spec_and_capability(monkeypatch, reported, capability, spec):
    from planner.profiling.devices import get_device

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _dev=None: reported)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _dev=None: capability)
    fallback = get_device("t4") if spec == "fallback" else None
    found = memsafe.this_gpu(torch.device("cuda", 0), fallback)
    if spec is None:
        assert found is None  # _meta_fallback then says to plan with --device meta --target
        return
    assert found.name == (fallback.name if fallback else spec)
    assert found.compute_capability == "{}.{}".format(*capability)  # its cuBLAS workspaces are this GPU's
    assert memsafe.this_gpu(torch.device("cpu"), fallback) is fallback
