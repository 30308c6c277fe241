"""Pipeline-parallel plans: one plan per stage of ``torch.distributed.pipelining`` (NOTE [ Pipeline
stages ] in solvers/pipeline.py holds the accounting).

A stage is the model's own modules for that stage (``stage_module``): the repeated blocks split
evenly, the embeddings on the first stage, the final norm, head and loss on the last, with the
model's FQNs kept (``model.layers.5`` stays ``model.layers.5``), so one plan file names modules
as the model does. Stages are built for Hugging Face decoder-only language models
(``*ForCausalLM`` with ``model.embed_tokens``, ``model.layers``, ``model.norm``,
``model.rotary_emb`` and ``lm_head``: Llama, Mistral, Qwen2 and their kin); the model file's batch
is one data-parallel replica's ``dict(input_ids=..., labels=...)``, which the schedule splits into
micro-batches by rows.

Example::

    plan = plan_pipeline("model.py", "40GB", pipeline_layout(2, "1f1b", micro_batches=4))
    stage = stage_module(build_model(), stage=rank, num_stages=2)
    apply_plan(stage, plan)                     # this stage's checkpoints
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.errors import BadInput, BudgetInfeasible
from planner.options import check_layout, check_model_fit
from planner.model.schema import PIPELINE_PLAN_VERSION, Pipeline, Plan, Predicted, RunStamp, SolverInfo, StagePlan, now_iso
from planner.sizes import format_bytes, parse_bytes
from planner.spec import SolveSpec, StepSpec
from solvers.pipeline import plan_stage, split_layers, stage_peak


class DecoderStage(nn.Module):
    """One pipeline stage of a decoder-only LM: ``forward(tokens or hidden) -> hidden or logits``.

    Holds the model's own submodules under their FQNs (``model.layers`` a ``ModuleDict`` keyed
    by the original layer index); the rest of the model is dropped, so it frees on this rank.
    """

    def __init__(self, lm: nn.Module, stage: int, num_stages: int):
        super().__init__()
        check_decoder_lm(lm)
        inner = lm.model
        start, end = split_layers(len(inner.layers), num_stages)[stage]
        self.pp_stage, self.pp_stages = stage, num_stages
        self.seq_shards = 1  # sequence parallelism: a later stage receives 1/seq_shards of the sequence
        self.first, self.last = stage == 0, stage == num_stages - 1
        inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(start, end)})
        if not self.first:
            inner.embed_tokens = None
        if not self.last:
            inner.norm = None
        self.model = inner
        self.lm_head = lm.lm_head if self.last else None
        self.config = lm.config
        self.config.use_cache = False  # a stage runs no cache (its forward passes none): nothing to turn off
        self._loss_function = lm.loss_function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.model
        h = inner.embed_tokens(x) if self.first else x
        seq = x.shape[1] if self.first else h.shape[1] * self.seq_shards  # positions of the whole sequence
        shape = h.new_empty((h.shape[0], seq, 0))  # the whole sequence's shape for the mask, holding nothing
        pos = torch.arange(seq, device=h.device).unsqueeze(0)
        mask = _causal_mask(self.config, shape, pos)
        pe = inner.rotary_emb(shape, position_ids=pos)
        for layer in inner.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
            h = h[0] if isinstance(h, tuple) else h
        return self.lm_head(inner.norm(h)) if self.last else h

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The model's own loss of one micro-batch (the last stage's; the schedule's ``loss_fn``)."""
        return self._loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)


def _causal_mask(config: Any, h: torch.Tensor, pos: torch.Tensor) -> Any:
    from transformers.masking_utils import create_causal_mask

    return create_causal_mask(config=config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)


def check_decoder_lm(model: nn.Module, layout: str = "pipeline stages", option: str = "pp") -> None:
    """``BadInput`` unless ``model`` has the layout ``DecoderStage`` splits and tensor parallelism shards;
    ``layout`` and ``option``: what the message calls the layout asked for and its option."""
    inner = getattr(model, "model", None)
    ok = (inner is not None and isinstance(getattr(inner, "layers", None), nn.ModuleList)
          and all(isinstance(getattr(inner, k, None), nn.Module) for k in ("embed_tokens", "norm", "rotary_emb"))
          and isinstance(getattr(model, "lm_head", None), nn.Module) and hasattr(model, "loss_function"))
    if not ok:
        raise BadInput(f"{layout} are built for Hugging Face decoder-only language models (model.embed_tokens, "
                       f"model.layers, model.norm, lm_head: Llama, Mistral, Qwen2); {type(model).__name__} is not "
                       f"one: plan it without {{{option}}}", options=(option,))


def stage_module(model: nn.Module, stage: int, num_stages: int) -> DecoderStage:
    """Stage ``stage`` of ``num_stages`` of ``model`` (Rule 1 of NOTE [ Pipeline stages ]); ``model`` is
    pruned to it in place."""
    return DecoderStage(model, stage, num_stages)


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of the replica's batch (a dict with both, the model file's)."""
    if not isinstance(batch, dict) or set(batch) != {"input_ids", "labels"}:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise BadInput(f"pipeline stages need example_inputs() to return dict(input_ids=..., labels=...), got "
                       f"{keys}; return the tokens and labels only")
    return batch["input_ids"], batch["labels"]


def _feed_grad():
    """A stand-in loss for a stage that is not the last: backward feeds a gradient into the stage's
    output from a buffer made once, at the first step, as the schedule's receive buffer is (the
    profiled step, after the warm-up, sees no new allocation; Rule 6 counts the buffers)."""
    buffers: dict = {}

    class _FeedGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
            key = (tuple(out.shape), out.dtype, str(out.device))
            if key not in buffers:
                buffers[key] = torch.ones_like(out)
            ctx.key = key
            return out.new_zeros(())

        @staticmethod
        def backward(ctx: Any, _g: torch.Tensor) -> torch.Tensor:
            return buffers[ctx.key]

    return lambda out: _FeedGrad.apply(out)


def _received(_module: nn.Module, args: tuple) -> tuple:
    """The stage's input as the schedule passes it: a leaf that requires grad, so that backward
    makes its gradient (to send back) as on the rank (Rule 7 of NOTE [ Pipeline stages ])."""
    return tuple(a.detach().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _stage_loss(stage: DecoderStage, labels: torch.Tensor):
    """The last stage's loss of one micro-batch, ``loss_fn(logits)``."""
    return lambda logits: stage.loss(logits, labels)


@dataclass(frozen=True)
class ProfiledStage:
    """One stage profiled on one micro-batch, with what the schedule adds (the ``pp_*`` graph attributes)."""

    profile: Any  # schema.Profile of the stage module
    attrs: dict[str, Any]  # the pp_* attributes of solvers/contract.py
    modules: list[str]  # its repeated blocks
    tp: int = 1  # tensor-parallel ranks sharing each of its layers (the profile is one rank's)
    sequence_parallel: bool = False  # the sequence sharded between blocks and between stages
    fingerprint: Any = None  # the stage module's, when not the profile's (tp: the full-size module's)


def profile_stages(model_file: Any, layout: Pipeline, *, step: StepSpec | None = None, tp: int = 1,
                   progress: Any = None, sequence_parallel: bool = False) -> list[ProfiledStage]:
    """Profile one micro-batch through each stage of ``layout`` (Rule 3 of NOTE [ Pipeline stages ]).
    ``step``: where and how (device, target, optimizer, timing steps, threads; the plain loop only);
    ``tp`` > 1: each stage's layers shared by ``tp`` ranks, one rank's stage profiled (NOTE [ Tensor-parallel
    ranks ], Rule 4); ``sequence_parallel``: NOTE [ Sequence-parallel ranks ], Rule 5."""
    from planner.model.fingerprint import fingerprint
    from planner.profiling import profile as run_profile
    from planner.profiling.meta import build_on_meta
    from planner.profiling.profiler import resolve_device

    step = _plain_step(step)
    say = progress or (lambda _m: None)
    meta = resolve_device(step.device).type == "meta"
    build = (lambda: build_on_meta(model_file.build_model)) if meta else model_file.build_model
    full = build()
    shapes = _shapes(full, model_file.example_inputs(), layout)
    if sequence_parallel:
        from planner.act.tensor_parallel import _check_sequence

        _check_sequence(model_file.example_inputs(), tp)
        shapes = shapes.sequence_sharded(tp)
    n = layout.num_stages  # pp x V (NOTE [ Interleaved stages ])
    spans = split_layers(shapes.layers, n)
    sigs = [_layer_signature(layer) for layer in full.model.layers]
    full_params = {sig.name: sig for sig in fingerprint(full, None).params} if tp > 1 else {}
    if tp > 1:
        from planner.act.tensor_parallel import local_builder

        build = local_builder(full, tp, sequence_parallel=sequence_parallel, stages=True)
    del full
    shapes_seen: dict[tuple, tuple[int, Any]] = {}  # NOTE [ One profile per stage shape ]
    out = []
    for s, (start, end) in enumerate(spans):
        key = (s == 0, s == n - 1, tuple(sigs[start:end]))
        if key in shapes_seen:
            like, prof = shapes_seen[key]
            say(f"stage {s} of {n}: the shape of stage {like}, its profile reused")
            prof = relabel_layers(prof, start - spans[like][0])
        else:
            say(f"profiling stage {s} of {n} (one micro-batch of {shapes.rows} rows)")
            prof = _profile_stage(build(), s, n, shapes, step, run_profile, tp if sequence_parallel else 1)
            shapes_seen[key] = (s, prof)
        fp = prof.fingerprint.model_copy(update=dict(params=[full_params[p.name] for p in prof.fingerprint.params])) \
            if tp > 1 else None  # the module a rank builds and lays out is full size (DTensors' global shapes)
        out.append(ProfiledStage(prof, shapes.attrs(layout, s), [f"model.layers.{i}" for i in range(start, end)], tp,
                                 fingerprint=fp, sequence_parallel=sequence_parallel))
    return out


# NOTE [ One profile per stage shape ]
#
# A stage's profile (Rule 3 of NOTE [ Pipeline stages ]) depends on its modules and one micro-batch's
# shapes, not on where the stage sits: two middle stages whose blocks are alike (the same modules,
# parameter shapes and attention types, ``_layer_signature``) run the same ops on the same shapes.
# So each distinct (first, last, its blocks' signatures) is profiled once, and a later stage of that shape takes its profile with the blocks' indices moved
# (``relabel_layers``: ``model.layers.8`` of stage 1 becomes ``model.layers.16`` of stage 2 in every
# FQN, unit id and fingerprint). Llama-3-405B on 16 stages has 4 shapes (the first with 8 blocks
# and the embeddings, middle ones with 8 and with 7, the last with 7 and the head). What the
# schedule adds (the ``pp_*`` attributes) is the stage's own. Checked: on fake tensors a moved
# profile equals the stage's own profile in every field but its creation time (tests/test_pipeline.py).


_LAYER_FQN = re.compile(r"(?<![\w.])model\.layers\.(\d+)(?!\d)")


def relabel_layers(profile: Any, offset: int) -> Any:
    """``profile`` with every ``model.layers.<i>`` named ``model.layers.<i + offset>``
    (NOTE [ One profile per stage shape ])."""
    if offset == 0:
        return profile

    def move(v: Any) -> Any:
        if isinstance(v, str):
            return _LAYER_FQN.sub(lambda m: f"model.layers.{int(m[1]) + offset}", v) if "model.layers." in v else v
        if isinstance(v, dict):
            return {move(k): move(x) for k, x in v.items()}
        if isinstance(v, list):
            return [move(x) for x in v]
        return v

    return type(profile).model_validate(move(profile.model_dump()))


def _layer_signature(layer: nn.Module) -> tuple:
    """What makes two blocks run alike: their modules' classes, parameter shapes and dtypes, and the
    attention type a config may give each layer (sliding-window layers of Mistral, Qwen2, Gemma)."""
    kinds = tuple((name, type(m).__name__, getattr(m, "attention_type", None), getattr(m, "sliding_window", None))
                  for name, m in layer.named_modules())
    return kinds, tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters())


def _profile_stage(model: nn.Module, s: int, num_stages: int, shapes: "_Shapes", step: StepSpec, run_profile: Any,
                   seq_shards: int = 1) -> Any:
    """Stage ``s`` of ``model`` profiled on one micro-batch (Rule 3 of NOTE [ Pipeline stages ]); ``seq_shards``:
    the sequence-parallel ranks the sequence is sharded over between stages."""
    from planner.profiling.profiler import resolve_device

    stage = stage_module(model, s, num_stages)
    stage.seq_shards = seq_shards
    hook = None if stage.first else stage.register_forward_pre_hook(_received)
    loss_fn = _stage_loss(stage, shapes.labels.to(resolve_device(step.device))) if stage.last else _feed_grad()
    x = shapes.ids if stage.first else torch.zeros(shapes.act_shape, dtype=shapes.dtype)
    try:
        return run_profile(stage, x, step=step.replace(loss_fn=loss_fn))
    finally:
        if hook is not None:
            hook.remove()


def _plain_step(step: StepSpec | None) -> StepSpec:
    """``step`` if it is the plain loop without a memory cap (what stages are planned for), else ``BadInput``."""
    from planner.model.schema import Recipe

    step = step or StepSpec()
    if (step.recipe != Recipe() or step.device_memory_bytes is not None or step.loss_fn is not None
            or step.compile is not None):
        raise BadInput("pipeline stages are planned for the plain eager step (no accumulation, amp, clipping, "
                       "optimizer implementation, device-memory cap, compile or loss_fn: the model's own loss) for "
                       "now; drop those options")
    return step


@dataclass(frozen=True)
class _Shapes:
    """The sizes the schedule moves, from the model and one replica's batch."""

    layers: int
    rows: int  # one micro-batch's rows
    ids: torch.Tensor  # one micro-batch of tokens
    labels: torch.Tensor  # one micro-batch of labels
    act_shape: tuple[int, ...]
    dtype: torch.dtype
    act_bytes: int  # one micro-batch's activation between stages
    logits_bytes: int  # one micro-batch's logits (the last stage's output)

    def sequence_sharded(self, tp: int) -> "_Shapes":
        """These shapes with the activations between stages holding 1/tp of the sequence (NOTE [ Sequence-parallel
        ranks ], Rule 5)."""
        from dataclasses import replace

        rows, seq, hidden = self.act_shape
        return replace(self, act_shape=(rows, seq // tp, hidden), act_bytes=self.act_bytes // tp)

    def attrs(self, layout: Pipeline, s: int) -> dict[str, Any]:
        """The pp_* graph attributes of stage ``s`` (Rules 4 and 6)."""
        n, m, last = layout.num_stages, layout.micro_batches, s == layout.num_stages - 1
        ids_b, lab_b = self.ids.numel() * self.ids.element_size(), self.labels.numel() * self.labels.element_size()
        out = dict(pp_stages=n, pp_stage=s, pp_schedule=layout.schedule, pp_micro_batches=m,
                   pp_recv_bytes=self.act_bytes if s > 0 else 0, pp_send_bytes=0 if last else self.act_bytes,
                   pp_output_bytes=self.logits_bytes if last else self.act_bytes,
                   pp_batch_bytes=((m - 1) * ids_b if s == 0 else 0) + (m * lab_b if last else 0))
        if layout.schedule == "interleaved-1f1b":
            from planner.act.interleaved import interleaved_order

            out["pp_rank_order"] = interleaved_order(layout.stages, layout.stages_per_rank, m, s % layout.stages)
        return out


def _shapes(model: nn.Module, batch: Any, layout: Pipeline) -> _Shapes:
    check_decoder_lm(model)
    ids, labels = split_batch(batch)
    layers = len(model.model.layers)
    check_model_fit(layers, layout.stages, layout.micro_batches, ids.shape[0], layout.stages_per_rank)
    cfg, dtype = model.config, next(model.parameters()).dtype
    rows = ids.shape[0] // layout.micro_batches
    shape = (rows, ids.shape[1], cfg.hidden_size)
    size = torch.empty((), dtype=dtype).element_size()
    return _Shapes(layers, rows, ids[:rows].clone(), labels[:rows].clone(), shape, dtype,
                   rows * ids.shape[1] * cfg.hidden_size * size, rows * ids.shape[1] * cfg.vocab_size * size)


def _solver(solver: str, time_limit_s: float | None) -> Any:
    """``solvers.pipeline.Solve`` with the named solver; ``.used`` names the solver that ran last."""
    from planner.act.api import solve_graph

    def solve(g: Any, budget: int) -> tuple[list[str], dict[str, int]] | None:
        sol = solve_graph(g, budget, solver=solver, time_limit_s=time_limit_s)
        solve.used = sol.solver  # type: ignore[attr-defined]
        return None if sol.status == "infeasible" else (list(sol.checkpointed), dict(sol.selective))

    solve.used = solver  # type: ignore[attr-defined]
    return solve


def plan_stages(profiled: list[ProfiledStage], budget: int | str, *, fingerprint: Any,
                solve: SolveSpec | None = None) -> Plan:
    """One plan per stage under ``budget`` (per rank), as one plan (Rule 9 of NOTE [ Pipeline stages ]).
    Raises ``BudgetInfeasible`` naming the budget every stage needs when one does not fit."""
    budget_bytes = parse_bytes(budget)
    spec = solve or SolveSpec()
    t0 = time.perf_counter()
    if profiled[0].attrs["pp_schedule"] == "interleaved-1f1b":
        from planner.act.interleaved import plan_interleaved

        results = plan_interleaved(profiled, budget_bytes, spec)
    else:
        results = [_plan_stage(st, budget_bytes, spec) for st in profiled]
    lowest = max((r for r in results if isinstance(r, int)), default=0)
    if lowest:
        raise BudgetInfeasible(
            f"no checkpoint plan fits every pipeline stage in the budget of {budget_bytes} bytes "
            f"({format_bytes(budget_bytes)}); the minimum feasible budget is {lowest} bytes "
            f"({format_bytes(lowest)}): raise {{budget}}, or use more stages ({{pp}}) or, under 1f1b, more "
            f"micro-batches", budget_bytes=budget_bytes, min_feasible_bytes=lowest, options=("budget", "pp"))
    return _pipeline_plan(results, profiled, fingerprint, budget_bytes, time.perf_counter() - t0, spec)


def _plan_stage(st: ProfiledStage, budget_bytes: int, spec: SolveSpec) -> StagePlan | int:
    """Stage ``st``'s plan, or the budget it needs at least (with the headroom) when none fits."""
    from planner.act.api import budget_with_headroom

    g, room, usable, headroom_bytes = stage_graph(st, budget_bytes, spec)
    solve = _solver(spec.solver, spec.time_limit_s)
    result = plan_stage(g, usable, solve)
    if result.chosen is None:
        return budget_with_headroom(result.lowest_peak_bytes, room)
    return make_stage_plan(st, g, result.chosen, stage_peak(g, *result.chosen), stage_peak(g, []).peak_bytes,
                           result.lowest_peak_bytes, headroom_bytes, SolverInfo(
                               name=solve.used, status="feasible", detail="stage peak searched over the solving "
                                                                          "graph's budget (NOTE [ Pipeline stages ], Rule 9)"))


def stage_graph(st: ProfiledStage, budget_bytes: int, spec: SolveSpec) -> tuple[Any, float, int, int]:
    """``(graph, headroom fraction, usable bytes, headroom bytes)`` of stage ``st``: its profile's graph with the
    schedule's ``pp_*`` attributes (Rule 10's data-parallel ranks included)."""
    from planner.act.api import graph_for, headroom_for, usable_budget

    room = headroom_for(st.profile) if spec.headroom is None else spec.headroom
    usable, headroom_bytes = usable_budget(budget_bytes, room)
    g = graph_for(st.profile, solver=spec.solver, selective=False)
    dp = max(1, spec.world_size // (st.attrs["pp_stages"] * st.tp))  # Rule 10: the stage's data-parallel ranks
    g.graph.update(st.attrs, pp_dp=dp, pp_dp_sharding=spec.sharding, pp_blocks=[m for m in st.modules if m in g])
    return g, room, usable, headroom_bytes


def make_stage_plan(st: ProfiledStage, g: Any, chosen: tuple[list[str], dict[str, int]], sp: Any, no_plan_peak: int,
                    lowest: int, headroom_bytes: int, solver: SolverInfo) -> StagePlan:
    """The ``StagePlan`` of stage ``st`` checkpointing ``chosen`` on its graph ``g``, whose peak (with breakdown,
    a ``solvers.pipeline.StagePeak``) is ``sp``."""
    from solvers.cost_model import simulate

    est = simulate(g, *chosen)
    m = st.attrs["pp_micro_batches"]
    predicted = Predicted(
        peak_bytes=sp.peak_bytes, params_bytes=sp.params_bytes, grads_bytes=sp.grads_bytes,
        optimizer_bytes=sp.optimizer_bytes,
        activations_bytes=sp.peak_bytes - sp.params_bytes - sp.grads_bytes - sp.optimizer_bytes,
        recompute_ms=round(m * est.recompute_ms, 6), step_ms=round(m * est.step_ms, 6), peak_at=sp.peak_at,
        no_checkpoint_peak_bytes=no_plan_peak, min_feasible_bytes=lowest)
    fp = st.fingerprint or st.profile.fingerprint
    return StagePlan(
        stage=st.attrs["pp_stage"], modules=st.modules, in_flight=sp.in_flight, held_bytes=sp.held_bytes,
        buffers_bytes=sp.buffers_bytes, recv_bytes=st.attrs["pp_recv_bytes"], send_bytes=st.attrs["pp_send_bytes"],
        fingerprint=fp, fingerprint_digest=fp.digest(), headroom_bytes=headroom_bytes,
        checkpoints=list(dict.fromkeys(g.nodes[n]["fqn"] for n in est.checkpointed)),
        checkpoint_units=list(est.checkpointed), predicted=predicted, solver=solver)


def _pipeline_plan(stages: list[StagePlan], profiled: list[ProfiledStage], fingerprint: Any, budget_bytes: int,
                   seconds: float, spec: SolveSpec) -> Plan:
    """The plan file: every stage's plan; its own fields the highest stage's peak, the slowest stage's time."""
    from planner.act.api import _version

    worst = max(stages, key=lambda sp: sp.predicted.peak_bytes)
    first, attrs = profiled[0].profile, profiled[0].attrs
    per_rank = len({s for _, s, _ in attrs.get("pp_rank_order", [(None, 0, None)])})  # NOTE [ Interleaved stages ]
    pp = attrs["pp_stages"] // per_rank
    ranks = [[sp for sp in stages if sp.stage % pp == r] for r in range(pp)]  # a rank runs its stages one by one
    predicted = worst.predicted.model_copy(update=dict(  # the slowest rank sets the pipeline's pace
        recompute_ms=max(round(sum(sp.predicted.recompute_ms for sp in rs), 6) for rs in ranks),
        step_ms=max(round(sum(sp.predicted.step_ms for sp in rs), 6) for rs in ranks)))
    return Plan(
        fingerprint=fingerprint, fingerprint_digest=fingerprint.digest(), budget_bytes=budget_bytes,
        headroom_bytes=worst.headroom_bytes, checkpoints=[c for sp in stages for c in sp.checkpoints],
        checkpoint_units=[u for sp in stages for u in sp.checkpoint_units], solver=worst.solver, predicted=predicted,
        device=first.device, device_name=first.device_name, target=first.target, dtype=first.dtype,
        recipe=first.recipe, optimizer=first.optimizer, world_size=max(pp * profiled[0].tp, spec.world_size),
        sharding=spec.sharding, tensor_parallel=profiled[0].tp, sequence_parallel=profiled[0].sequence_parallel,
        torch_version=first.torch_version,
        remat_version=_version(), time_source=first.time_source, threads=first.threads,
        time_calibration=first.time_calibration, created=RunStamp(at=now_iso(), solver_seconds=round(seconds, 6)),
        pipeline=Pipeline(stages=pp, schedule=attrs["pp_schedule"], micro_batches=attrs["pp_micro_batches"],
                          stages_per_rank=per_rank),
        stages=stages, schema_version=PIPELINE_PLAN_VERSION)


def plan_pipeline(model_file: Any, budget: int | str, layout: Pipeline, *, tp: int = 1, step: StepSpec | None = None,
                  solve: SolveSpec | None = None, progress: Any = None, sequence_parallel: bool = False) -> Plan:
    """Profile each stage of the model file's model and plan it (NOTE [ Pipeline stages ]).

    ``model_file``: a path or a loaded ``ModelFile``; its ``example_inputs()`` is one data-parallel
    replica's batch. ``tp``: tensor-parallel ranks per stage (NOTE [ Tensor-parallel ranks ]), with the sequence
    sharded over them when ``sequence_parallel`` (NOTE [ Sequence-parallel ranks ], Rule 5).
    ``solve.world_size``, when not 1, is ``layout.stages`` x ``tp`` x dp, with ``solve.sharding`` saying how a
    stage's dp ranks train (Rule 10)."""
    from planner.model.fingerprint import fingerprint
    from planner.profiling.meta import build_on_meta
    from planner.profiling.model_file import ModelFile, load_model_file

    solve = solve or SolveSpec()
    check_layout(layout.stages, layout.schedule, layout.micro_batches,
                 solve.world_size if solve.world_size != 1 else None, solve.sharding, tp=tp,
                 stages_per_rank=layout.stages_per_rank, sequence_parallel=sequence_parallel)
    parse_bytes(budget)
    mf = model_file if isinstance(model_file, ModelFile) else load_model_file(model_file)
    profiled = profile_stages(mf, layout, step=step, tp=tp, progress=progress, sequence_parallel=sequence_parallel)
    fp = fingerprint(build_on_meta(mf.build_model), mf.example_inputs())
    return plan_stages(profiled, budget, fingerprint=fp, solve=solve)


def pipeline_layout(stages: Any, schedule: str = "1f1b", micro_batches: Any = 1, stages_per_rank: Any = 1) -> Pipeline:
    """The ``Pipeline`` of these settings (``stages`` ranks of ``stages_per_rank`` stages each), each checked with a
    one-line error naming the fix."""
    check_layout(stages, schedule, micro_batches, stages_per_rank=stages_per_rank)
    return Pipeline(stages=stages, schedule=schedule, micro_batches=micro_batches, stages_per_rank=stages_per_rank)


__all__ = ["DecoderStage", "ProfiledStage", "check_decoder_lm", "pipeline_layout",
           "plan_pipeline", "plan_stages", "profile_stages", "split_batch", "stage_module"]
