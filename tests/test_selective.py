"""Selective (op-level) checkpointing: op records, menus, the cost model, solvers and the applier.

One small model with what makes op-level plans hard: matmuls, attention (SDPA), a norm, a
pointwise activation, dropout (random ops and an in-place write) and blocks that hand their
output to the next block.
"""

from __future__ import annotations

from dataclasses import replace
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from planner.act.api import graph_for, plan_from_profile
from planner.act.applier import apply_plan
from planner.act.verify import verify
from solvers.cost_model import simulate, window_bytes
from planner.profiling.measure import make_optimizer, make_step, measure_step
from planner.profiling import profile
from planner.model.schema import SINGLE_SHAPE_PLAN_VERSION, OpRef, Plan, SelectiveRegion
from planner.profiling.tracker import iter_tensors, storage_bytes
from planner.sizes import format_bytes
from solvers import SOLVERS
from solvers.op_work import priced_by_work
from solvers.selective import OpCall, UnitOps, build_menu, describe

D, HEADS, LAYERS, BATCH, SEQ = 32, 4, 3, 4, 24
RNG_STATE_BYTES = 5056
"""The CPU generator state ``checkpoint(preserve_rng_state=True)`` copies per region (docs/benchmarks.md)."""


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + self.drop(self.proj(a))
        return x + self.out(F.gelu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _inputs() -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


@pytest.fixture(scope="module")
def measured():
    return profile(_net(), _inputs(), loss_fn=_loss, device="cpu", steps=1)


@pytest.fixture(scope="module")
def prof(measured):
    """This model's ops take microseconds, so selective checkpointing's dispatch (tens of
    microseconds per op call, measured by the profiler) outweighs any kernel a policy could skip
    and every menu is empty (``test_dispatch_cost_is_measured_and_priced``). The mechanics are
    tested here with that cost set aside, and the noise of its figures (NOTE [ Selective menus ],
    Rule (noise): ``test_a_policy_within_its_spread_of_full_checkpointing_stays_out``)."""
    units = [u.model_copy(update={"forward_spread_ms": 0.0}) for u in measured.units]
    return measured.model_copy(update={"sac_recomputed_op_ms": 0.0, "sac_kept_op_ms": 0.0, "units": units,
                                       "sac_recomputed_op_spread_ms": 0.0, "sac_kept_op_spread_ms": 0.0})


class _RunClock:
    """A clock whose every timed run lasts the next of ``runs_ms``: the runs of ``measure_sac_cost``."""

    def __init__(self, runs_ms):
        self.runs = iter(runs_ms)

    def stamp(self):
        return 0.0

    def sync(self):
        pass

    def ms(self, _start, _end):
        return next(self.runs)


def test_dispatch_cost_is_timed_on_the_regions_alone(measured):
    """NOTE [ Selective dispatch cost ], Rule 2: one region per cost group (the three identical blocks
    are one) runs alone in interleaved rounds, as it is, fully checkpointed, recomputing and keeping
    every op; each figure is the median of the per-round differences over the regions' op calls
    (Rule 4), the first round unrecorded, and they hold for one micro-batch under gradient
    accumulation (simulate counts a policy once per micro-batch). The spread is that of the per-round
    figures."""
    from planner.model.schema import Recipe
    from planner.profiling.sac_cost import _regions, measure_sac_cost

    accum = measured.model_copy(update={"recipe": Recipe(grad_accum=3)})
    regions = _regions(accum, _net())
    assert [f for f, _ in regions if f.startswith("blocks.")] == ["blocks.0"]  # one block for the group
    ops = [n for _, n in regions]
    calls = sum(ops)
    per_policy = {"t": lambda n: 10.0, "full": lambda n: 15.0, "r": lambda n: 15.0 + n * 0.01,
                  "k": lambda n: 10.0 + n * 0.03}
    runs = [1000.0] * 4 * len(regions)  # the first round: warming up, left out
    for i in range(3):
        for policy, t in per_policy.items():
            runs += [t(n) + (n * 0.04 if (i, policy, j) == (2, "r", 0) else 0.0) for j, n in enumerate(ops)]
    cost = measure_sac_cost(_net(), _inputs(), accum, loss_fn=_loss, amp=None, dev=torch.device("cpu"),
                            clock=_RunClock(runs), rounds=3)
    assert cost.recomputed_op_ms == pytest.approx(0.01) and cost.kept_op_ms == pytest.approx(0.03)  # medians
    # inclusive quartiles of (0.01, 0.01, 0.01 + 0.04 * ops[0] / calls)
    assert cost.recomputed_op_spread_ms == pytest.approx(0.02 * ops[0] / calls) and cost.kept_op_spread_ms == 0.0


def test_dispatch_figures_pair_the_runs_of_each_round(measured):
    """NOTE [ Selective dispatch cost ], Rule 4: the machine slows by 20% after the first round. The
    least times would set a run of a slow round against a run of the quick one (the recomputing
    runs' least is a slow round's, a spike having hit the quick one) and read several times the
    figure; the median of each round's own difference reads it as it is."""
    from planner.profiling.sac_cost import _regions, measure_sac_cost

    ops = [n for _, n in _regions(measured, _net())]
    per_policy = {"t": lambda n: 10.0, "full": lambda n: 15.0, "r": lambda n: 15.0 + n * 0.01,
                  "k": lambda n: 10.0 + n * 0.03}
    runs = [1000.0] * 4 * len(ops)
    for i, load in enumerate((1.0, 1.2, 1.2, 1.2, 1.2)):
        for policy, t in per_policy.items():
            runs += [t(n) * load + (50.0 if (i, policy) == (0, "r") else 0.0) for n in ops]
    cost = measure_sac_cost(_net(), _inputs(), measured, loss_fn=_loss, amp=None, dev=torch.device("cpu"),
                            clock=_RunClock(runs), rounds=5)
    assert cost.recomputed_op_ms == pytest.approx(0.012) and cost.kept_op_ms == pytest.approx(0.036)
    calls = sum(ops)
    least_r = (len(ops) * 15.0 * 1.2 + calls * 0.012 - len(ops) * 15.0) / calls  # what least times read
    assert least_r > 5 * cost.recomputed_op_ms


def test_dispatch_cost_is_not_scaled_by_the_thread_factor(measured):
    """NOTE [ Selective dispatch cost ], Rule 5: above one thread the dispatch figures are the thread's CPU
    time at one thread, not scaled by the forward's thread factor (Python does not run faster on more
    threads): a factor of 1000 leaves them at their one-thread size, the fixture's figures (measured on the
    same unscaled clock) within a factor of 30, not a thousand times them. A fixed bound (2 ms) read
    the machine's speed: this model's figures are half a millisecond a call on a quiet machine."""
    from planner.profiling.sac_cost import measure_sac_cost
    from planner.profiling.timing import ScaledCpuClock, num_threads

    with num_threads(1):
        cost = measure_sac_cost(_net(), _inputs(), measured, loss_fn=_loss, amp=None, dev=torch.device("cpu"),
                                clock=ScaledCpuClock(2, scale=1000.0), rounds=2)
    one_thread = measured.sac_recomputed_op_ms + measured.sac_kept_op_ms
    assert one_thread > 0
    assert 0 < cost.recomputed_op_ms + cost.kept_op_ms < 30 * one_thread, (cost, one_thread)


def test_a_region_with_a_pre_hook_is_timed_alone_on_the_inputs_its_caller_gave(monkeypatch):
    """NOTE [ Selective dispatch cost ], Rule 2: a region's inputs are recorded before its own pre-hooks, so
    that a pre-hook that reshapes them (a sequence-parallel layer's cut) runs once when the region runs
    alone. Recorded after it, the cut ran twice, the region failed alone, and every such profile fell
    back to whole steps (27 rounds of 4: examples/llama.py's sequence-parallel rank 41.6 -> 12.0 s)."""
    from planner.profiling import sac_cost

    def whole_steps(*_a, **_k):
        raise AssertionError("the regions could not run alone: timed by whole steps")

    net = _net()
    net.blocks[0].register_forward_pre_hook(lambda _m, a: (a[0].unflatten(1, (SEQ // 2, 2)).mean(2),))
    monkeypatch.setattr(sac_cost, "_step_runs", whole_steps)
    cost = sac_cost.measure_sac_cost(net, _inputs(), profile(net, _inputs(), loss_fn=_loss, device="cpu", steps=1),
                                     loss_fn=_loss, amp=None, dev=torch.device("cpu"), clock=_RunClock([1.0] * 64),
                                     rounds=2)
    assert cost.rounds == 2


def _cores_were(monkeypatch, ours: bool) -> None:
    """Every many-thread run of NOTE [ Clean rounds ] reads as clean (``ours``) or as slowed by another process."""
    from planner.profiling import timing

    monkeypatch.setattr(timing.BusyClock, "clean", lambda self, wall_ms, threads: ours)


def test_each_cost_group_gets_its_thread_factor(measured, monkeypatch):
    """NOTE [ Thread factor per cost group ]: above one thread each group's forward is timed alone at one
    thread and at the profile's, and the group's members, their submodules and their op calls are
    rescaled from the whole forward's factor to the group's; the rest keeps the whole forward's."""
    from planner.profiling.group_scale import GroupScale, measure_group_scales, with_group_scales

    _cores_were(monkeypatch, True)  # ours in every round (Rule 4)
    scaled = measured.model_copy(update={"time_source": "cpu-thread-time-scaled", "thread_scale": 0.5, "threads": 2})
    kw = dict(loss_fn=_loss, amp=None, rounds=2)
    found = measure_group_scales(_net(), _inputs(), scaled, threads=2, **kw)
    assert [s.fqn for s in found if s.fqn.startswith("blocks.")] == ["blocks.0"] and all(s.scale > 0 for s in found)
    assert all(s.clean_rounds == s.rounds == 2 for s in found)
    assert measure_group_scales(_net(), _inputs(), scaled, threads=1, **kw) == []
    out = with_group_scales(scaled, [GroupScale("blocks.0", 1.0, 0.0)])
    for u, v in zip(scaled.units, out.units):
        inside = v.fqn.startswith("blocks.")
        assert v.forward_ms == pytest.approx(u.forward_ms * (2.0 if inside else 1.0)), v.fqn
        assert (v.thread_scale == pytest.approx(1.0)) if inside else v.thread_scale == u.thread_scale
    for o, p in zip(scaled.ops, out.ops):
        assert p.forward_ms == pytest.approx(o.forward_ms * (2.0 if p.unit.startswith("blocks.") else 1.0))


def test_a_group_timed_while_the_cores_were_busy_keeps_the_whole_forwards_factor(measured, monkeypatch):
    """Rule 4 of the same NOTE: a round counts only when the process had the profile's threads' cores;
    with too few such rounds the group keeps the whole forward's factor, and the note says why."""
    from planner.profiling import group_scale

    scaled = measured.model_copy(update={"time_source": "cpu-thread-time-scaled", "thread_scale": 0.5, "threads": 2})
    _cores_were(monkeypatch, False)
    found = group_scale.measure_group_scales(_net(), _inputs(), scaled, threads=2, loss_fn=_loss, amp=None, rounds=3)
    assert found and all(s.scale is None and s.clean_rounds == 0 and s.rounds == 3 for s in found)  # none clean: 3
    out = group_scale.with_group_scales(scaled, found)
    assert [u.forward_ms for u in out.units] == [u.forward_ms for u in scaled.units]
    assert "blocks.0's group: the whole forward's (0 of 3 rounds clean, the cores were busy)" in out.notes[-1]
    _cores_were(monkeypatch, True)
    found = group_scale.measure_group_scales(_net(), _inputs(), scaled, threads=2, loss_fn=_loss, amp=None, rounds=3)
    assert all(s.scale is not None and s.clean_rounds == s.rounds == 3 for s in found)


def test_each_group_takes_the_lesser_factor_of_two_windows():
    """Rule 5 of the same NOTE: the rounds run in two windows, and a slow spell in one does not set the factor."""
    from planner.profiling.group_scale import GroupScale, least_group_scales

    before = [GroupScale("blocks.0", 0.77, 0.01, 7, 7), GroupScale("head", None, 0.0, 1, 21)]
    after = [GroupScale("blocks.0", 0.64, 0.03, 7, 9), GroupScale("head", 0.9, 0.02, 7, 8)]
    assert least_group_scales(before, after) == [GroupScale("blocks.0", 0.64, 0.03, 14, 16),
                                                 GroupScale("head", 0.9, 0.02, 8, 29)]
    both_busy = least_group_scales([GroupScale("head", None, 0.0, 0, 21)], [GroupScale("head", None, 0.0, 2, 21)])
    assert both_busy == [GroupScale("head", None, 0.0, 2, 42)]
    assert least_group_scales([], []) == []


def test_dispatch_cost_is_measured_and_priced(measured, prof):
    """NOTE [ Selective dispatch cost ]: measured on the model, added to every policy per op call it
    recomputes and per op call it keeps, and a policy no faster than full checkpointing is left out."""
    from planner.profiling.sac_cost import SAC_MIN_ROUNDS, SAC_ROUNDS

    assert measured.sac_recomputed_op_ms > 0 and measured.sac_kept_op_ms > 0
    assert SAC_MIN_ROUNDS <= measured.sac_rounds <= SAC_ROUNDS  # the rounds the figures are medians of
    cost = (0.001, 0.002)
    g = graph_for(prof.model_copy(update={"sac_recomputed_op_ms": cost[0], "sac_kept_op_ms": cost[1]}))
    a = g.nodes["blocks.1"]
    priced = dict(zip((o.seq for o in prof.ops), priced_by_work([(o.name, o.flops, o.moved_bytes, o.forward_ms)
                                                                 for o in prof.ops])))  # NOTE [ Op work ]
    inside = [o for o in prof.ops if a["fwd_start_seq"] <= o.seq <= a["fwd_end_seq"]]
    kernels_ms = sum(priced[o.seq] for o in inside)
    phi = min(1.0, kernels_ms / a["forward_ms"])  # the kernels' share of the forward; the rest is Python
    # above one thread the Python's share is the one-thread share over the thread factor (Rule (threads))
    unit = next(u for u in prof.units if u.fqn == "blocks.1")
    f, n = (unit.thread_scale or prof.thread_scale, prof.threads) if prof.thread_scale else (1.0, 1)
    q = 1 - phi if f >= 1 else min((1 - phi) / f, 1 - phi / (n * f))
    assert a["menu"]
    for pol in a["menu"]:
        kept = len(pol.saved)  # op calls, writers of a kept output included
        share = (1 - q) * (1 - pol.saved_ms / kernels_ms) + q * (len(inside) - kept) / len(inside)
        recompute = a["forward_ms"] * share
        assert pol.recompute_ms == pytest.approx(recompute + cost[0] * (len(inside) - kept) + cost[1] * kept)
    full = graph_for(measured).nodes["blocks.1"]
    assert all(p.recompute_ms < full["forward_ms"] for p in full["menu"])


@pytest.fixture(scope="module")
def graph(prof):
    return graph_for(prof)


def _budget(g, frac: float = 0.5) -> int:
    lo = simulate(g, [n for n, a in g.nodes(data=True) if a["parent"] is None]).peak_bytes
    hi = simulate(g, []).peak_bytes
    return int(lo + frac * (hi - lo))


# ----------------------------------------------------------------------------- op records


def test_profile_records_the_ops_of_each_unit(prof):
    ops = [o for o in prof.ops if o.unit.startswith("blocks.0")]
    names = [o.name for o in ops]
    assert names.count("aten.addmm.default") == 4  # qkv, proj, fc, out
    assert any("scaled_dot_product" in n for n in names)
    assert "aten.detach.default" not in names  # selective checkpointing ignores it: so do we
    assert not any(n.startswith("profiler.") for n in names)
    by_name = {}
    for o in ops:
        by_name.setdefault(o.name, o)  # the first call of each
    assert by_name["aten.addmm.default"].output_bytes == 4 * BATCH * SEQ * 3 * D
    assert by_name["aten.view.default"].view and not by_name["aten.view.default"].output_ids
    assert by_name["aten.bernoulli_.float"].random and by_name["aten.bernoulli_.float"].inplace
    assert by_name["aten.empty_like.default"].mutated  # the dropout mask, filled in place later
    assert all(o.forward_ms >= 0 for o in ops)
    qkv = by_name["aten.addmm.default"]  # NOTE [ Op work ]: the roofline's FLOPs and bytes, measured ops too
    assert qkv.flops == 2 * BATCH * SEQ * D * 3 * D and qkv.moved_bytes >= qkv.output_bytes
    assert by_name["aten.view.default"].moved_bytes == 0 and by_name["aten.view.default"].flops == 0
    assert by_name["aten.bernoulli_.float"].moved_bytes > 0 and by_name["aten.bernoulli_.float"].flops == 0
    known = {t.id for t in prof.tensors}
    assert all(t in known for o in prof.ops for t in o.output_ids)


def test_meta_profile_records_ops_with_roofline_times():
    from planner.profiling.meta import build_on_meta

    p = profile(build_on_meta(_net), _inputs(), loss_fn=_loss, device="meta", target="h100")
    mms = [o for o in p.ops if o.name == "aten.addmm.default" and o.unit.startswith("blocks.1")]
    assert len(mms) == 4 and all(o.flops > 0 and o.forward_ms > 0 for o in mms)


# ----------------------------------------------------------------------------- menus


def test_op_times_are_priced_by_their_work():
    """NOTE [ Op work ]: each overload's calls share one rate per kind of work (their summed times over
    their summed FLOPs, or bytes where no FLOPs are known), so calls of equal work get equal times
    whatever their measured order; a call without work keeps its time, and each overload's total is
    unchanged."""
    ops = [("aten.mul.Tensor", 0.0, 6_000_000, 0.10), ("aten.mul.Tensor", 0.0, 6_000_000, 0.21),
           ("aten.mul.Tensor", 0.0, 12_000_000, 0.30), ("aten.tanh.default", 0.0, 6_000_000, 1.8),
           ("aten.mm.default", 3e8, 4_000_000, 3.0), ("aten.mm.default", 1e8, 4_000_000, 1.2),
           ("aten.view.default", 0.0, 0, 0.01)]
    ms = priced_by_work(ops)
    assert ms[0] == ms[1] == pytest.approx(0.61 / 24 * 6) and ms[2] == pytest.approx(2 * ms[0])
    assert ms[3] == pytest.approx(1.8)  # its own rate: a transcendental is not a multiply
    assert ms[4] == pytest.approx(3 * ms[5]) and ms[4] + ms[5] == pytest.approx(4.2)  # FLOPs, not bytes
    assert ms[6] == 0.01


def _op(seq: int, name: str, out: int | None, ms: float, **kw) -> OpCall:
    return OpCall(seq, name, (out,) if out is not None else (), ms, **kw)


def test_menu_is_a_front_and_keeps_only_keepable_ops():
    ops = [_op(1, "aten.mm.default", 1, 5.0), _op(2, "aten.gelu.default", 2, 0.5),
           _op(3, "aten.mm.default", 3, 5.0), _op(4, "aten.add_.Tensor", None, 0.1, inplace=True),
           _op(5, "aten.empty_like.default", 4, 0.0, mutated=True), _op(6, "aten.view.default", None, 0.0, view=True)]
    tb = {1: 400, 2: 400, 3: 100, 4: 100}
    menu = build_menu(UnitOps(ops, forward_ms=22.0, end_seq=9, saved_bytes=1000, first_save_inside={1: 2, 2: 3}),
                      tensor_bytes=tb)
    assert menu, "a unit with matmuls gets policies"
    kept = [p.kept_bytes for p in menu]
    assert kept == sorted(kept) and all(k < 1000 for k in kept)
    rec = [p.recompute_ms for p in menu]
    assert all(a > b for a, b in zip(rec, rec[1:])), "more bytes kept must buy less recompute"
    assert all(("aten.empty_like.default", 0) not in p.saved for p in menu)
    assert menu[0].saved == (("aten.mm.default", 1),)  # the cheap matmul first: 100 bytes, 5 ms
    assert menu[0].cached == ((9, 3),)  # backward never reads it: held until the unit's end
    # 10.6 ms of kernels in a 22 ms forward: the rest is Python, replayed by call count (5 of 6 calls)
    phi = 10.6 / 22.0
    assert menu[0].recompute_ms == pytest.approx(22.0 * (phi * (1 - 5.0 / 10.6) + (1 - phi) * 5 / 6))
    assert describe(menu[0]) == "saves 1 matmul; recomputes 1 matmul, 2 pointwise"  # gelu, empty_like


def test_above_one_thread_the_python_is_priced_at_one_thread():
    """NOTE [ Selective menus ], Rule (threads): at N threads the forward's figures are one thread's times
    the thread factor f, but its Python runs on one thread, so the Python's share of F is (1 - phi) / f
    and a policy rerunning most calls and few kernels costs more than the one-thread share says; the
    full replay stays F, and at f = 1 (one thread) the price is the one-thread one."""
    ops = [_op(1, "aten.mm.default", 1, 5.0), _op(2, "aten.gelu.default", 2, 0.5),
           _op(3, "aten.mm.default", 3, 5.0), _op(4, "aten.add.Tensor", 4, 0.1)]
    tb = {1: 400, 2: 400, 3: 100, 4: 100}
    one = UnitOps(ops, forward_ms=11.0, end_seq=9, saved_bytes=1000, first_save_inside={1: 2, 2: 3})
    two = replace(one, thread_factor=0.6, threads=2)  # the same forward's figures at 2 threads: 18.33 ms at one
    phi = 10.6 / 11.0
    q = (1 - phi) / 0.6  # the Python's share of the 2-thread forward
    dearer = 0
    for p in build_menu(two, tensor_bytes=tb):
        kernels = (10.6 - p.saved_ms) / 10.6
        calls = p.calls[0] / 4
        assert p.recompute_ms == pytest.approx(11.0 * ((1 - q) * kernels + q * calls))
        if calls > kernels:  # reruns more of the calls than of the kernel time: more than the one-thread share
            assert p.recompute_ms > 11.0 * (phi * kernels + (1 - phi) * calls)
            dearer += 1
    assert dearer
    assert [p.recompute_ms for p in build_menu(replace(two, thread_factor=1.0), tensor_bytes=tb)] == \
        [p.recompute_ms for p in build_menu(one, tensor_bytes=tb)]
    # at f = 1/N the kernels cannot have gained more than N: the Python's share is capped, here at 1 - phi
    floor = replace(one, thread_factor=0.5, threads=2)
    cap = 1 - phi / (2 * 0.5)
    assert cap < (1 - phi) / 0.5
    for p in build_menu(floor, tensor_bytes=tb):
        assert p.share == pytest.approx((1 - cap) * (10.6 - p.saved_ms) / 10.6 + cap * p.calls[0] / 4)


def test_a_policy_within_its_spread_of_full_checkpointing_stays_out():
    """NOTE [ Selective menus ], Rule (noise): a policy enters the menu only when it saves more than its
    measured spread; without op times on the forward's clock (K > F) it is the kernel-share model."""
    ops = [_op(1, "aten.mm.default", 1, 5.0), _op(2, "aten.gelu.default", 2, 0.5), _op(3, "aten.mm.default", 3, 5.0)]
    unit = UnitOps(ops, forward_ms=10.0, end_seq=9, saved_bytes=1000, first_save_inside={1: 2, 2: 3})
    kw = dict(tensor_bytes={1: 400, 2: 400, 3: 100})
    quiet = build_menu(unit, **kw)
    assert quiet and quiet[0].recompute_ms == pytest.approx(10.0 * (1 - 5.0 / 10.5))  # phi capped at 1
    share = quiet[0].recompute_ms / 10.0  # its spread is the forward's spread times the share it reruns
    at = 10.0 * (1 - share) / share  # ... equal to its saving at this forward spread
    assert any(p.saved == quiet[0].saved for p in build_menu(replace(unit, forward_spread_ms=0.9 * at), **kw))
    assert all(p.saved != quiet[0].saved for p in build_menu(replace(unit, forward_spread_ms=1.1 * at), **kw))
    dispatch = build_menu(unit, op_cost_ms=(0.01, 0.01), op_cost_spread_ms=(4.0, 4.0), **kw)
    assert dispatch == ()  # 4 ms of spread per call: no policy saves more than that


def test_an_op_saving_within_its_spread_is_not_kept():
    """NOTE [ Selective menus ], Rule (noise), per op: an op whose keeping saves no more than the spread
    of that saving (the dispatch figures' spreads per call) is no item of the knapsack, so a gelu
    saving 0.91 ms is kept at 0.4 ms of spread per figure and never at 0.5; the matmuls stay."""
    ops = [_op(1, "aten.mm.default", 1, 5.0), _op(2, "aten.gelu.default", 2, 1.0), _op(3, "aten.mm.default", 3, 5.0)]
    unit = UnitOps(ops, forward_ms=10.0, end_seq=9, saved_bytes=1000, first_save_inside={1: 2, 2: 3})
    kw = dict(tensor_bytes={1: 400, 2: 50, 3: 100})
    gelu = ("aten.gelu.default", 0)
    assert any(gelu in p.saved for p in build_menu(unit, op_cost_spread_ms=(0.4, 0.4), **kw))
    noisy = build_menu(unit, op_cost_spread_ms=(0.5, 0.5), **kw)
    assert noisy and all(gelu not in p.saved for p in noisy)


def test_a_light_op_is_not_kept_on_its_own():
    """NOTE [ Selective menus ], Rule (material): an op saving less than MIN_ITEM_SHARE of what the unit's
    heaviest op saves is no item, even with no spread at all (its keeping moved with the dispatch
    spreads between profiles); at twice that share it is (no Python here: the forward is its kernels)."""
    from solvers.selective import MIN_ITEM_SHARE

    kw = dict(tensor_bytes={1: 400, 2: 50, 3: 100})
    gelu = ("aten.gelu.default", 0)
    for share, kept in ((MIN_ITEM_SHARE / 2, False), (MIN_ITEM_SHARE * 2, True)):
        ops = [_op(1, "aten.mm.default", 1, 5.0), _op(2, "aten.gelu.default", 2, 5.0 * share),
               _op(3, "aten.mm.default", 3, 5.0)]
        unit = UnitOps(ops, forward_ms=10.0 + 5.0 * share, end_seq=9, saved_bytes=1000, first_save_inside={1: 2, 2: 3})
        menu = build_menu(unit, **kw)
        assert menu and any(gelu in p.saved for p in menu) == kept, (share, menu)


def test_equal_bytes_within_the_spread_keep_the_fewer_ops():
    """NOTE [ Selective menus ], Rule (ties): a query projection against the key and value projections
    together (equal bytes): the two projections save 0.55 ms more, which decides when the dispatch
    figures have no spread (their kernels' rate spread, OP_RATE_SPREAD of 8.6 ms, is 0.43 ms); within
    the spread of that difference (one call's dispatch spreads on top, 0.2 ms) the one op is kept,
    and not the two."""
    from solvers.selective import OP_RATE_SPREAD

    ops = [_op(1, "aten.mm.default", 1, 4.0), _op(2, "aten.mm.default", 2, 2.3), _op(3, "aten.mm.default", 3, 2.3),
           _op(4, "aten.mm.default", 4, 1.0)]
    unit = UnitOps(ops, forward_ms=9.6, end_seq=9, saved_bytes=1000, first_save_inside={})
    kw = dict(tensor_bytes={1: 400, 2: 200, 3: 200, 4: 200}, op_cost_ms=(0.01, 0.06))
    q, kv = {("aten.mm.default", 0)}, {("aten.mm.default", 1), ("aten.mm.default", 2)}
    assert OP_RATE_SPREAD * 8.6 < 0.55

    def at_400(menu):
        return [set(p.saved) for p in menu if p.kept_bytes == 400]

    assert at_400(build_menu(unit, **kw)) == [kv]
    assert at_400(build_menu(unit, op_cost_spread_ms=(0.1, 0.1), **kw)) == [q]
    assert at_400(build_menu(unit, op_cost_spread_ms=(0.02, 0.02), **kw)) == [kv]  # beyond its spread


def test_within_a_byte_level_the_fewest_bytes_within_the_spread():
    """NOTE [ Selective menus ], Rule (level ties): two matmuls of 400 and 440 bytes under one byte level
    (500 of 1000): the larger saves 0.3 ms more, within the spread of the difference (OP_RATE_SPREAD of
    the two kernels' 8.3 ms, 0.42 ms), so the level keeps the 400 bytes; 1.0 ms more is beyond it, and
    the level keeps the larger."""
    def level_500(b_ms: float) -> list[set]:
        ops = [_op(1, "aten.mm.default", 1, 4.0), _op(2, "aten.mm.default", 2, b_ms), _op(3, "aten.gelu.default", 3, 0.2)]
        unit = UnitOps(ops, forward_ms=4.2 + b_ms, end_seq=9, saved_bytes=1000, first_save_inside={})
        menu = build_menu(unit, tensor_bytes={1: 400, 2: 440, 3: 100})
        return [set(p.saved) for p in menu if p.kept_bytes <= 500]

    a, b = {("aten.mm.default", 0)}, {("aten.mm.default", 1)}
    assert level_500(4.3) == [a]
    assert level_500(5.0) == [b]


def test_difference_spread_counts_a_units_forward_once(graph):
    """NOTE [ Robust choice ], Rule 1: a unit whole in one plan and op-level in the other differs by the
    share of its forward the policy does not rerun, so its forward spread counts once, times that share."""
    from planner.act.robust import difference_spread_ms

    g = graph.copy()
    block = next(n for n in g.nodes if n.startswith("blocks.") and g.nodes[n]["parent"] is None)
    k = len(g.nodes[block]["menu"]) - 1
    policy = g.nodes[block]["menu"][k]
    g.nodes[block]["forward_spread_ms"] = 2.0
    ops = simulate(g, [], {block: k})
    assert 0 < policy.share < 1
    assert difference_spread_ms(g, ops, simulate(g, [block])) == pytest.approx(2.0 * (1 - policy.share))
    assert difference_spread_ms(g, ops, simulate(g, [])) == pytest.approx(2.0 * policy.share)
    assert difference_spread_ms(g, ops, ops) == 0.0


def test_the_simplest_choice_within_the_spread(graph):
    """NOTE [ Robust choice ], Rule 4: a group's policy gives way to full checkpointing (or a policy
    keeping fewer bytes) that fits and costs more by less than the spread of the difference; without
    a spread the solver's choice stands."""
    from planner.act.robust import simplest_within_spread

    blocks = [n for n in graph.nodes if n.startswith("blocks.") and graph.nodes[n]["parent"] is None]
    k = len(graph.nodes[blocks[0]]["menu"]) - 1
    est = simulate(graph, [], {blocks[0]: k, blocks[1]: k})
    big = simulate(graph, []).peak_bytes * 2
    assert simplest_within_spread(graph, est, big).selective == est.selective  # the fixture: no spread
    g = graph.copy()
    for b in blocks:
        g.nodes[b]["forward_spread_ms"] = 1e3
    out = simplest_within_spread(g, simulate(g, [], {blocks[0]: k, blocks[1]: k}), big)
    assert not out.selective and {blocks[0], blocks[1]} <= set(out.checkpointed)


# ----------------------------------------------------------------------------- cost model and solvers


def test_every_block_has_a_menu(graph):
    blocks = [n for n in graph.nodes if n.startswith("blocks.")]
    assert len(blocks) == LAYERS and all(graph.nodes[n]["menu"] for n in blocks)
    # identical blocks, identical menus: op times pooled over the cost group (NOTE [ Op records ])
    menus = {tuple((p.saved, p.recompute_ms, p.kept_bytes) for p in graph.nodes[n]["menu"]) for n in blocks}
    assert len(menus) == 1


def test_selective_sits_between_none_and_full(graph):
    n = "blocks.1"
    none, full = simulate(graph, []), simulate(graph, [n])
    for k, pol in enumerate(graph.nodes[n]["menu"]):
        est = simulate(graph, [], {n: k})
        assert full.recompute_ms > est.recompute_ms == pytest.approx(pol.recompute_ms)
        assert full.peak_bytes <= est.peak_bytes <= none.peak_bytes + pol.kept_bytes


def test_solvers_are_optimal_over_the_menus(graph):
    """Brute force over none / full / every policy of every candidate is the oracle."""
    nodes = sorted(graph.nodes, key=lambda n: graph.nodes[n]["order"])
    options = [[None, "full", *range(len(graph.nodes[n]["menu"]))] for n in nodes]
    points = []
    for pick in itertools.product(*options):
        full = [n for n, c in zip(nodes, pick) if c == "full"]
        sel = {n: c for n, c in zip(nodes, pick) if isinstance(c, int)}
        est = simulate(graph, full, sel)
        points.append((est.peak_bytes, est.recompute_ms))
    for frac in (0.2, 0.5, 0.8):
        budget = _budget(graph, frac)
        best = min(ms for peak, ms in points if peak <= budget)
        for name in ("ilp", "dp", "auto"):
            sol = SOLVERS[name](graph, budget)
            assert sol.status != "infeasible", name
            est = simulate(graph, sol.checkpointed, sol.selective)
            assert est.peak_bytes <= budget, name
            if sol.status == "optimal":
                assert est.recompute_ms == pytest.approx(best, rel=1e-9), f"{name} at {frac}"


def test_module_level_only_without_selective(prof):
    g = graph_for(prof, selective=False)
    assert all(not a["menu"] for _, a in g.nodes(data=True))
    plan = plan_from_profile(prof, _budget(g), selective=False)
    assert plan.selective == []


def test_op_level_plan_stands_only_beyond_the_spread(prof, graph, monkeypatch):
    """NOTE [ Robust choice ], Rule 1: an op-level plan predicted cheaper than the whole-module plan by
    less than the spread of the difference, or by less than OP_LEVEL_MIN_GAIN of the whole-module
    plan's overhead, gives way to the whole-module plan; beyond both it stands."""
    import planner.act.robust as robust

    budget = _budget(graph, 0.6)
    ops, whole = plan_from_profile(prof, budget), plan_from_profile(prof, budget, selective=False)
    assert ops.selective and ops.predicted.recompute_ms < whole.predicted.recompute_ms
    est = simulate(graph, ops.checkpoint_units)
    assert robust.difference_spread_ms(graph, est, est) == 0.0  # the fixture's figures carry no spread
    gain = 1 - ops.predicted.recompute_ms / whole.predicted.recompute_ms  # the fixture's overhead is its recompute
    assert gain > robust.OP_LEVEL_MIN_GAIN
    with monkeypatch.context() as m:
        m.setattr(robust, "difference_spread_ms", lambda *_: whole.predicted.recompute_ms)
        spread = plan_from_profile(prof, budget)
    with monkeypatch.context() as m:
        m.setattr(robust, "OP_LEVEL_MIN_GAIN", gain * 1.01)
        small = plan_from_profile(prof, budget)
    for robust_plan in (spread, small):
        assert robust_plan.selective == [] and robust_plan.checkpoints == whole.checkpoints
        assert robust_plan.predicted.recompute_ms == pytest.approx(whole.predicted.recompute_ms)
    monkeypatch.setattr(robust, "OP_LEVEL_MIN_GAIN", gain * 0.99)
    assert plan_from_profile(prof, budget).selective == ops.selective


def test_dispatch_spreads_are_priced_as_the_spread_of_their_median(prof):
    """NOTE [ Selective dispatch cost ], Rule 4: the menus take the dispatch figures' spread over the
    rounds times sqrt(pi / 2) / sqrt(rounds), the spread of their median; unknown rounds (older
    profiles): the spread as recorded."""
    import math

    from solvers.selective import spread_of_median

    assert spread_of_median(0.2, 0) == 0.2 and spread_of_median(0.2, 1) == 0.2
    assert spread_of_median(0.2, 27) == pytest.approx(0.2 * math.sqrt(math.pi / 2 / 27))
    def menu(spread_ms: float, rounds: int) -> tuple:
        return graph_for(prof.model_copy(update={"sac_recomputed_op_spread_ms": spread_ms, "sac_rounds": rounds,
                                                 "sac_kept_op_spread_ms": spread_ms})).nodes["blocks.1"]["menu"]

    # The least spread a call that keeps every policy out, found on this profile: a fixed 20 us did on a quiet
    # machine and did not under load (the fixture's times are measured, so its policies' savings move with load)
    lo, hi = 0.0, 1.0  # ms a call: 1 ms keeps out every policy of this model, whose ops take microseconds
    assert menu(hi, 0) == () and menu(lo, 0)
    for _ in range(16):
        lo, hi = (lo, (lo + hi) / 2) if menu((lo + hi) / 2, 0) == () else ((lo + hi) / 2, hi)
    spread = hi
    recorded, medians = menu(spread, 0), menu(spread, 25)
    assert recorded == () and medians  # that spread keeps every policy out; its 25-round median's, about a quarter, does not
    for pol in medians:  # each policy's spread carries the median's dispatch spread, a fifth of it at 25 rounds
        assert pol.op_cost_spread_ms == pytest.approx((spread * math.sqrt(math.pi / 2) / 5,) * 2)


def test_unit_spreads_are_priced_as_the_spread_of_their_median(prof):
    """NOTE [ Unit costs ], Rule 4: the choices weigh a unit's forward spread as its median's, the
    samples' interquartile range times sqrt(pi / 2) / sqrt(samples), as they do the dispatch figures';
    one sample, or samples not known: the spread as recorded."""
    import math

    def noisy(spread_ms: float, samples: int):
        return graph_for(prof.model_copy(update={"units": [u.model_copy(update={
            "forward_spread_ms": spread_ms, "timing_samples": samples}) for u in prof.units]}))

    def menu(spread_ms: float, samples: int) -> tuple:
        return noisy(spread_ms, samples).nodes["blocks.1"]["menu"]

    block = graph_for(prof).nodes["blocks.1"]
    assert block["menu"]  # the fixture's figures carry no spread
    f = block["forward_ms"]
    assert noisy(f, 1).nodes["blocks.1"]["forward_spread_ms"] == f
    # The least forward spread that keeps every policy out, found on this profile: a spread of the whole forward
    # did, but with 5% to spare under load (the fixture's times are measured, so its policies' shares move with load)
    lo, hi = 0.0, f
    while menu(hi, 1):
        lo, hi = hi, 2 * hi
        assert hi < 1e3 * f, "a spread a thousand times the forward keeps every policy out"
    for _ in range(16):
        lo, hi = (lo, (lo + hi) / 2) if menu((lo + hi) / 2, 1) == () else ((lo + hi) / 2, hi)
    assert menu(hi, 1) == ()  # that spread as recorded keeps every policy out
    g = noisy(hi, 64)
    assert g.nodes["blocks.1"]["forward_spread_ms"] == pytest.approx(hi * math.sqrt(math.pi / 2) / 8)
    assert g.nodes["blocks.1"]["menu"]  # its median's, an eighth at 64 samples: some policy saves more


def test_identical_units_get_one_arrangement(prof, graph):
    """NOTE [ Robust choice ], Rule 2: which of identical blocks a plan checkpoints is a stated rule,
    not the solver's accident: every starting arrangement of one choice ends at the same plan or
    at one with a lower peak, at the same recompute."""
    from planner.act.api import canonical

    blocks = [n for n in graph.nodes if n.startswith("blocks.") and graph.nodes[n]["parent"] is None]
    big = simulate(graph, []).peak_bytes * 2
    ends = {}
    for b in blocks:
        est = simulate(graph, [b])
        out = canonical(graph, est, big)
        assert out.recompute_ms == pytest.approx(est.recompute_ms) and out.peak_bytes <= est.peak_bytes
        ends[b] = tuple(out.checkpointed)
    first, last = ends[blocks[0]], ends[blocks[-1]]
    assert first == last  # the two ends of the group are rearranged alike
    every_2 = plan_from_profile(prof, simulate(graph, []).peak_bytes * 2, solver="every-2")
    assert every_2.checkpoints == ["blocks.0", "blocks.2"][:len(every_2.checkpoints)]  # a baseline keeps its rule
    for solver in ("dp", "ilp"):
        plan = plan_from_profile(prof, _budget(graph_for(prof, selective=False)), solver=solver, selective=False)
        assert plan.checkpoints == plan_from_profile(prof, _budget(graph_for(prof, selective=False)),
                                                     selective=False).checkpoints


def _canonical_fits(g, blocks: list[str], usable: int) -> list:
    """Every canonical plan of ``blocks`` (NOTE [ Robust choice ], Rule 3) with an op-level member that fits."""
    import itertools

    menu = g.nodes[blocks[0]]["menu"]
    out = []
    for ranks in itertools.combinations_with_replacement(range(-1, len(menu) + 1), len(blocks)):
        if any(0 <= r < len(menu) for r in ranks):
            for order in (blocks, blocks[::-1]):
                t = simulate(g, [b for b, r in zip(order, ranks) if r == -1],
                             {b: r for b, r in zip(order, ranks) if 0 <= r < len(menu)})
                if t.peak_bytes <= usable:
                    out.append(t)
    return out


def test_a_group_is_searched_over_its_canonical_plans(prof, graph):
    """NOTE [ Robust choice ], Rule 3: a cost group with op-level members is re-chosen over its canonical
    plans (every multiset of choices, strongest first on the earliest or the latest members): the
    least overhead of those that fit, by brute force over every assignment of the group, whatever mix
    and members the solver returned."""
    from planner.act.robust import CANONICAL_SEARCH_PLANS, canonical_plans, group_search

    blocks = [n for n in graph.nodes if n.startswith("blocks.") and graph.nodes[n]["parent"] is None]
    menu = graph.nodes[blocks[0]]["menu"]
    assert len(menu) >= 2, "the fixture's blocks have menus of several policies"
    assert canonical_plans(graph, blocks) <= CANONICAL_SEARCH_PLANS

    def canonical_fits(usable: int) -> list:
        return _canonical_fits(graph, blocks, usable)

    mixed = simulate(graph, [], {blocks[0]: 0, blocks[1]: len(menu) - 1})
    roomy = simulate(graph, []).peak_bytes * 2
    out = group_search(graph, mixed, roomy)
    assert out.overhead_ms == pytest.approx(min(t.overhead_ms for t in canonical_fits(roomy)))
    tight = group_search(graph, mixed, mixed.peak_bytes)
    fits = canonical_fits(mixed.peak_bytes)
    assert tight.peak_bytes <= mixed.peak_bytes
    assert fits and tight.overhead_ms == pytest.approx(min(t.overhead_ms for t in fits))
    assert tight.overhead_ms <= mixed.overhead_ms + 1e-9  # the solver's mix, arranged, is among them
    # the solver's members are not kept: two mixes of different members give one plan (five GPT-2
    # profiles' mixes held three or four op-level blocks)
    more = simulate(graph, [], {blocks[0]: 0, blocks[1]: len(menu) - 1, blocks[2]: 0})
    budget = max(mixed.peak_bytes, more.peak_bytes)
    a, b = group_search(graph, mixed, budget), group_search(graph, more, budget)
    assert (a.selective, list(a.checkpointed)) == (b.selective, list(b.checkpointed))
    # a group with more canonical plans than the search takes keeps the solver's choices
    from planner.act import robust

    cap, robust.CANONICAL_SEARCH_PLANS = robust.CANONICAL_SEARCH_PLANS, 0
    try:
        kept = group_search(graph, mixed, roomy)
    finally:
        robust.CANONICAL_SEARCH_PLANS = cap
    assert (kept.selective, list(kept.checkpointed)) == (mixed.selective, list(mixed.checkpointed))
    # whatever the solver, a plan's group is one of its canonical plans: the strongest choices first
    for frac in (0.1, 0.3, 0.5, 0.7, 0.9):
        plan = plan_from_profile(prof, _budget(graph, frac))
        rank = {r.fqn: i for r in plan.selective for i, p in enumerate(menu) if tuple(
            (o.op, o.index) for o in r.save) == tuple(p.saved)}
        ranks = [-1 if b in plan.checkpoints else rank.get(b, len(menu)) for b in blocks]
        assert ranks in (sorted(ranks), sorted(ranks, reverse=True)), (frac, ranks)


def test_a_groups_plans_within_their_spread_go_to_the_highest_peak(graph, monkeypatch):
    """NOTE [ Robust choice ], Rule 3 (ties): canonical plans within the spread of their difference from
    the least overhead are one price to the measurement; of them the group takes the one that keeps the
    most bytes within the budget (bytes are exact), not the one the noise made least. Brute force over
    the group's canonical plans, with the spread of every difference set just wide enough to take in the
    cheapest plan that keeps more bytes than the least overhead's (the fixture's times are measured, so a
    fixed 1 ms spread took one in on a quiet machine and none in one CI run, under load)."""
    from planner.act import robust

    blocks = [n for n in graph.nodes if n.startswith("blocks.") and graph.nodes[n]["parent"] is None]
    usable = _budget(graph, 0.6)
    fits = _canonical_fits(graph, blocks, usable)
    least = min(t.overhead_ms for t in fits)
    start = simulate(graph, [], {blocks[0]: 0})
    assert robust.group_search(graph, start, usable).overhead_ms == pytest.approx(least)  # no spread: the least
    least_peak = max(t.peak_bytes for t in fits if t.overhead_ms == least)
    higher = [t.overhead_ms - least for t in fits if t.peak_bytes > least_peak]
    assert higher, "the fixture has a plan that keeps more bytes at a higher overhead"
    spread_ms = min(higher) * 1.01
    monkeypatch.setattr(robust, "difference_spread_ms", lambda g, a, b: spread_ms)
    near = [t for t in fits if t.overhead_ms - least <= spread_ms]
    highest = max(t.peak_bytes for t in near)
    assert highest > least_peak
    out = robust.group_search(graph, start, usable)
    assert out.peak_bytes == highest <= usable and out.overhead_ms - least <= spread_ms
    assert out.overhead_ms == min(t.overhead_ms for t in near if t.peak_bytes == highest)


# ----------------------------------------------------------------------------- plan file and applier


@pytest.fixture(scope="module")
def plan(prof, graph):
    p = plan_from_profile(prof, _budget(graph, 0.6))
    assert p.selective, "at this budget op-level policies beat whole blocks"
    return p


def _grads(model: nn.Module, run=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    loss = _loss((model if run is None else run)(_inputs()))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_plan_file_round_trip_and_older_versions(plan, tmp_path):
    path = plan.save(tmp_path / "plan.json")
    again = Plan.load(path)
    assert again.schema_version == SINGLE_SHAPE_PLAN_VERSION == 3 and again.selective == plan.selective
    assert all(r.summary.startswith("saves ") for r in again.selective)
    old = json.loads(path.read_text())
    del old["selective"]
    for version in (1, 2):  # before op-level checkpointing
        old.update(schema_version=version)
        (tmp_path / "old.json").write_text(json.dumps(old))
        assert Plan.load(tmp_path / "old.json").selective == []


def test_selective_plan_gives_exact_gradients_and_recomputes(plan):
    plain, planned = _net(), _net()
    want_loss, want = _grads(plain)
    state = {k: v.clone() for k, v in planned.state_dict().items()}
    handle = apply_plan(planned, plan)
    assert handle.selective == [r.fqn for r in plan.selective]
    loss, got = _grads(planned)
    assert torch.equal(loss, want_loss)
    assert all(torch.equal(got[n], want[n]) for n in want), "dropout replayed, kept outputs exact"
    assert handle.recompute_count == len(plan.selective) + len(plan.checkpoints)
    handle.remove()
    assert all(torch.equal(state[k], v) for k, v in planned.state_dict().items())
    assert "forward" not in planned.blocks[0].__dict__


def test_selective_plan_under_torch_compile(plan):
    plain, planned = _net(), _net()
    want_loss, want = _grads(plain)
    apply_plan(planned, plan)
    loss, got = _grads(planned, torch.compile(planned, backend="aot_eager"))
    assert torch.allclose(loss, want_loss)
    assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in want)


def test_measured_peak_matches_prediction(plan):
    model = _net()
    apply_plan(model, plan)
    opt = make_optimizer("adamw", model)
    step = make_step(model, _inputs(), loss_fn=_loss, optimizer=opt)
    step()
    model.zero_grad(set_to_none=True)
    static = storage_bytes(itertools.chain(model.parameters(), model.buffers(),
                                           iter_tensors(*opt.state.values()), [_inputs()]))
    peak = measure_step(step, torch.device("cpu"), static_bytes=static).peak_bytes
    assert abs(plan.predicted.peak_bytes - peak) <= 0.02 * peak
    # on a model this small the CPU RNG state each region keeps (NOTE [ Peak-memory model ], not
    # modelled) can exceed the budget's headroom
    regions = len(plan.checkpoints) + len(plan.selective)
    assert peak <= plan.budget_bytes + RNG_STATE_BYTES * regions


def test_dropout_mask_is_kept_with_its_writers(prof, graph, plan):
    """The CPU's dropout mask (empty_like, then bernoulli_ and div_ in place): kept as a group,
    its random draw is not replayed, and the gradients stay exact."""
    alloc = next(o for o in prof.ops if o.unit == "blocks.0.drop" and o.name == "aten.empty_like.default")
    assert alloc.mutated and not alloc.read_between_writes
    assert [o.name for o in prof.ops if o.writes == alloc.seq] == ["aten.bernoulli_.float", "aten.div_.Scalar"]
    menu = graph.nodes["blocks.0"]["menu"]
    pol = next(p for p in menu if p.keeps_written)
    assert ("aten.bernoulli_.float", 0) in pol.saved and "dropout" in describe(pol).split(";")[0]
    region = SelectiveRegion(fqn="blocks.0", unit="blocks.0", save=[OpRef(op=o, index=i) for o, i in pol.saved],
                             keeps_written=True)
    mine = plan.model_copy(update={"checkpoints": [], "selective": [region]})
    plain, planned = _net(), _net()
    want_loss, want = _grads(plain)
    handle = apply_plan(planned, mine)
    loss, got = _grads(planned)
    assert handle.recompute_count == 1
    assert torch.equal(loss, want_loss) and all(torch.equal(got[n], want[n]) for n in want)


def test_verify_worst_window_of_a_selective_plan(plan, graph):
    """The per-window predictions include the selective regions (issue #29: a Phi-3 plan predicted a
    72.43 MiB peak and, ignoring its regions, a 108.96 MiB window): no window above the plan's peak, and
    verify's worst-window line shows the plan's prediction for that window."""
    windows = plan.predicted.windows
    regions = {r.unit: next(k for k, p in enumerate(graph.nodes[r.unit]["menu"]) if _same_policy(p, r))
               for r in plan.selective}
    assert windows == {k: v for k, v in window_bytes(graph, plan.checkpoint_units, selective=regions).items()
                       if k in windows}
    assert max(windows.values()) <= plan.predicted.peak_bytes
    report = verify(_net(), plan, inputs=_inputs(), loss_fn=_loss, device="cpu", steps=1, tolerance=0.0)
    assert report.ok, report.problems
    assert report.worst_window_predicted_bytes == windows[report.worst_window]
    (row,) = [r for r in report.rows() if r[0] == f"worst window: {report.worst_window}"]
    assert row[1:3] == (format_bytes(report.worst_window_predicted_bytes),
                        format_bytes(report.worst_window_measured_bytes))


def _same_policy(policy, region: SelectiveRegion) -> bool:
    return policy.saved == tuple((o.op, o.index) for o in region.save)
