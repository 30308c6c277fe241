"""Tensor-parallel plans (``torch.distributed.tensor.parallel``, DTensor): every rank's plan made on
the rank-local model (NOTE [ Tensor-parallel ranks ]).

``plan_tensor_parallel`` profiles the model with its attention heads, key-value heads and MLP width
divided by ``tp`` and plans it; ``tensor_parallel`` lays the model out on a rank as the plan
assumes (``planner.act.sharding.shard_for_plan`` calls it for ``remat verify``). Built for Hugging
Face decoder-only language models (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj`` in each of ``model.layers``).

Example::

    plan = plan_tensor_parallel("model.py", "40GB", tp=2)
    model = tensor_parallel(build_model(), 2)       # on each rank, after init_process_group
    apply_plan(model, plan)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from torch import nn

from planner.errors import BadInput
from planner.model.schema import PIPELINE_PLAN_VERSION, Plan
from planner.spec import SolveSpec, StepSpec

# NOTE [ Tensor-parallel ranks ]
#
# tp ranks share every layer (a data-parallel replica of tp ranks; no sequence parallelism).
# Rule 1. Layout (``tensor_parallel``, the usual plan of torchtitan and Megatron): in each decoder
# layer the q, k, v, gate and up projections are ColwiseParallel (output features split), o and
# down RowwiseParallel (input features split, the output all-reduced to a replicated tensor);
# embeddings, norms and the head stay replicated.
# Rule 2. A rank then runs the model with attention heads, key-value heads and the MLP width divided
# by tp, head_dim kept (the colwise outputs and the rowwise inputs are exactly those): its
# parameters, gradients, optimizer state and activations are that local model's. The plan is made
# on the local model's profile (``local_model``: the model's config class with those sizes), so
# every rule of NOTE [ Peak-memory model ] applies as measured, and its checkpoints name the same
# modules as the full model (the plan's fingerprint is the full model's).
# Rule 3. Collectives: a row-parallel output's all-reduce returns a new tensor in place of the
# partial sum it replaces, one activation for another; nothing is added for it. Measured on
# examples/llama_pp.py at tp 2 (docs/distributed.md): without checkpointing the local model
# predicts 50,562,852 bytes and each rank measures 50,562,860.
# Rule 4. With pipeline stages (tp x pp ranks, rank = stage x tp + tp rank, a (pp, tp) device mesh):
# each stage is profiled on the rank-local model's stage (``local_builder``) with NOTE [ Pipeline
# stages ] on top; the activations between stages are the full hidden states (replicated over the
# stage's tp ranks), so the send and receive buffers are those of one rank per stage. The stage
# plan's fingerprint is the full-size stage's: a rank builds the full stage and lays it out with
# DTensor (``tensor_parallel(stage, tp, mesh["tp"])``), whose parameters show their global shapes.
# Rule 5. With FSDP2 beside it, no stages (tp x dp ranks, rank = dp rank x tp + tp rank, a (dp, tp)
# mesh, torchtitan's 2D layout): each layer is laid out over ``mesh["tp"]`` and then
# ``fully_shard`` over ``mesh["dp"]`` (``shard_for_plan``), so FSDP2 shards and gathers the
# rank-local parameters. The plan is NOTE [ Per-rank memory ]'s FSDP2 plan of the rank-local
# model's profile over dp ranks, every rule of it unchanged. DDP is refused: it does not take
# DTensor parameters.


_TP = ("tensor-parallel layouts", "tp")
"""How ``check_decoder_lm`` names tensor parallelism: `--tp 2` on an nn.Sequential was "internal error:
AttributeError: 'Sequential' object has no attribute 'config'"."""


def check_tp(config: Any, tp: Any) -> None:
    """``BadInput`` unless ``tp`` divides the model's attention heads, key-value heads and MLP width."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise BadInput(f"tp must be an integer >= 1, got {tp!r}", options=("tp",))
    heads = config.num_attention_heads
    for what, n in (("attention heads", heads), ("key-value heads", getattr(config, "num_key_value_heads", None)
                                                  or heads), ("MLP width", config.intermediate_size)):
        if n % tp:
            fits = [d for d in range(1, heads + 1) if heads % d == 0 and config.intermediate_size % d == 0
                    and (getattr(config, "num_key_value_heads", None) or heads) % d == 0]
            raise BadInput(f"tp {tp} does not divide the model's {n} {what}: give {{tp}} one of "
                           f"{', '.join(map(str, fits))}", options=("tp",))


def local_model(model: nn.Module, tp: int) -> nn.Module:
    """What one of ``tp`` ranks runs (Rule 2): ``model``'s class built from its config with the
    heads, key-value heads and MLP width divided by ``tp``, in ``model``'s dtype and on its device
    (the meta device stays meta)."""
    return local_builder(model, tp)()


def local_builder(model: nn.Module, tp: int, *, sequence_parallel: bool = False,
                  stages: bool = False) -> Callable[[], nn.Module]:
    """A function that builds ``local_model(model, tp)`` afresh on each call, from ``model``'s class and
    config only (a pipeline stage prunes its model: NOTE [ Pipeline stages ]); with ``sequence_parallel``,
    its collectives emulated (NOTE [ Sequence-parallel ranks ], Rule 4; ``stages``: for pipeline stages, the first
    layer's cut at the end of the embeddings)."""
    import torch

    from planner.act.pipeline import check_decoder_lm

    check_decoder_lm(model, *_TP)
    check_tp(model.config, tp)
    cfg = copy.deepcopy(model.config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cfg.head_dim = head_dim
    cfg.num_key_value_heads = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // tp
    cfg.num_attention_heads //= tp
    cfg.intermediate_size //= tp
    p = next(model.parameters())
    kind, device, dtype = type(model), p.device, p.dtype

    def build() -> nn.Module:
        with torch.device(device):
            local = kind(copy.deepcopy(cfg))
        local = local.to(dtype).train()
        return _emulate_sequence_parallel(local, tp, stages) if sequence_parallel else local

    return build


def tensor_parallel(model: nn.Module, tp: int, mesh: Any = None, *, sequence_parallel: bool = False) -> nn.Module:
    """``model`` (a decoder-only LM or one of its pipeline stages) laid out over ``tp`` ranks (Rule 1),
    in place; needs ``torch.distributed`` initialised with ``tp`` ranks, or ``mesh``, the tp ranks'
    one-dimensional device mesh (under pipeline stages: the ``tp`` dimension of a (pp, tp) mesh); with
    ``sequence_parallel``, NOTE [ Sequence-parallel ranks ]'s layout."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_tp(model.config, tp)
    if mesh is None:
        from planner.act.pipeline import check_decoder_lm

        check_decoder_lm(model, *_TP)
        if not dist.is_initialized() or dist.get_world_size() != tp:
            raise BadInput(f"a plan for tensor parallelism over {tp} ranks needs torch.distributed initialised "
                           f"with {tp} ranks (torchrun, or remat verify, which starts the ranks itself)")
        mesh = init_device_mesh(next(model.parameters()).device.type, (tp,))
    if sequence_parallel:
        _sequence_parallel_layout(model, mesh)
        return model
    layout = {name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "mlp.gate_proj", "mlp.up_proj")}
    layout.update({name: RowwiseParallel() for name in ("self_attn.o_proj", "mlp.down_proj")})
    layers = model.model.layers
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        parallelize_module(layer, mesh, layout)
    return model


def plan_tensor_parallel(model_file: Any, budget: int | str, tp: int, *, step: StepSpec | None = None,
                         solve: SolveSpec | None = None, sequence_parallel: bool = False) -> Plan:
    """Profile the rank-local model of the model file's model and plan it for ``budget`` per rank
    (Rule 2; with ``sequence_parallel``, NOTE [ Sequence-parallel ranks ]). ``solve.world_size``, when not
    1, is ``tp`` x dp, with ``solve.sharding`` fsdp for dp > 1 (Rule 5)."""
    from planner.act.api import plan_from_profile
    from planner.act.pipeline import check_decoder_lm
    from planner.model.fingerprint import fingerprint
    from planner.options import check_layout
    from planner.profiling import profile as run_profile
    from planner.profiling.meta import build_on_meta
    from planner.profiling.model_file import ModelFile, load_model_file
    from planner.profiling.profiler import resolve_device

    solve = solve or SolveSpec()
    check_layout(None, "1f1b", 1, solve.world_size if solve.world_size != 1 else None, solve.sharding, tp=tp,
                 sequence_parallel=sequence_parallel)
    mf = model_file if isinstance(model_file, ModelFile) else load_model_file(model_file)
    step = step or StepSpec()
    full = build_on_meta(mf.build_model)
    check_decoder_lm(full, *_TP)
    check_tp(full.config, tp)
    meta = resolve_device(step.device).type == "meta"
    if sequence_parallel:
        _check_sequence(mf.example_inputs(), tp)
    local = local_builder(full if meta else mf.build_model(), tp, sequence_parallel=sequence_parallel)()
    prof = run_profile(local, mf.example_inputs(), step=step)
    dp = max(1, solve.world_size // tp)  # Rule 5: FSDP2 over dp ranks of the rank-local model
    plan = plan_from_profile(prof, budget, solve=solve.replace(world_size=dp, sharding=solve.sharding if dp > 1 else
                                                               "none", selective=False))
    fp = fingerprint(full, mf.example_inputs())
    return plan.model_copy(update=dict(fingerprint=fp, fingerprint_digest=fp.digest(), world_size=tp * dp,
                                       tensor_parallel=tp, sequence_parallel=sequence_parallel,
                                       schema_version=PIPELINE_PLAN_VERSION))


def _check_sequence(batch: Any, tp: int) -> None:
    """``BadInput`` unless ``tp`` divides the batch's sequence length (its first tensor's second dimension)."""
    from planner.model.fingerprint import input_tensors

    shape = next((tuple(t.shape) for _n, t in input_tensors(batch)), ())
    if len(shape) < 2 or shape[1] % tp:
        raise BadInput(f"sequence parallelism splits the sequence over {tp} ranks, but example_inputs()'s first "
                       f"tensor has shape {list(shape)}: give a sequence length divisible by {tp}",
                       options=("sequence_parallel",))


# NOTE [ Sequence-parallel ranks ]
#
# ``--tp N --sequence-parallel``: the torchtitan layout of a Llama decoder layer with the sequence
# sharded between the attention and MLP blocks (``tensor_parallel(..., sequence_parallel=True)``).
# Rule 1. Layout. The norms run on 1/N of the sequence (``SequenceParallel``), and so do the
# residual adds and every activation between the blocks; the attention and MLP inputs are
# all-gathered to the whole sequence (``PrepareModuleInput`` Shard(1) -> Replicate), their q, k,
# v, gate and up projections ColwiseParallel, and o and down RowwiseParallel with output
# Shard(1): their partial sums are reduce-scattered to the rank's part of the sequence. The first
# layer's input (the replicated embeddings) is cut to the rank's part (Replicate -> Shard(1), a
# copy of the rank's chunk); the head's input is all-gathered (the head, the embeddings and the
# loss stay replicated, as without sequence parallelism).
# Rule 2. Shapes. A rank therefore holds, of one layer, the norms' tensors and the residual
# stream at S / N positions and everything inside attention and the MLP at S positions with the
# rank-local heads and width (NOTE [ Tensor-parallel ranks ], Rule 2); the all-gathered input of
# each block is saved for its projections' backward at S positions.
# Rule 3. Collective buffers, as the functional collectives make them for a gather or scatter
# on the sequence dimension (dim 1) with B > 1 rows: an all-gather writes (N B, S / N, H) and
# copies it into (B, S, H) (both alive at once); a reduce-scatter copies its (B, S, H) partial
# sum into (N B, S / N, H), then writes (B, S / N, H). Backward runs the other one: the
# gradient of an all-gather is reduce-scattered, of a reduce-scatter all-gathered.
# Rule 4. The plan is made on the rank-local model of NOTE [ Tensor-parallel ranks ] with these
# collectives emulated in place (``_emulate_sequence_parallel``: the same tensors, shapes and
# order of allocation, the values repeated rather than exchanged), so the profile sees every
# rank's activations per placement and the collectives' buffers. The head's all-gather is emulated at
# the end of the final norm's forward, not in a pre-hook of the head: the profiler's own pre-hooks
# run first and would read the head's input as the S / N tensor, while on the ranks
# ``PrepareModuleInput`` gathers before the head's (checkpointed) forward, so the head holds the whole
# sequence (measured: a plan checkpointing the head was 63,536 bytes, 0.55%, low on the last stage of
# tp 2 + sp x pp 2; with the head out of the plan, exact to 2,000 bytes). For the same reason a pipeline's
# first stage emulates the first layer's cut at the end of the embeddings' forward (the first layer then
# holds the rank's part when checkpointed, as on the ranks; as a pre-hook of the layer, the profiler read
# its input as the whole embeddings: the first stage of tp 2 + sp x pp 2 with 2 micro-batches was 6.3%
# high). The whole model's forward takes its positions from the embeddings' length, so there the cut
# stays a pre-hook of the first layer (its checkpoint is counted whole: not measured).
# Rule 5. With pipeline stages (``--pp``), the sequence stays sharded across a stage boundary, as
# torchtitan runs it: a stage's last layer returns the rank's S / N positions (its reduce-scatter), the
# schedule sends that local tensor, and the next stage's first layer takes it as is; only the first
# stage cuts the embeddings and only the last gathers the head's input. So the activations sent and
# received, their buffers and a stage's output are 1/N of the whole sequence (``_Shapes.sequence_sharded``
# in planner/act/pipeline.py), and a later stage computes its positions, mask and rotary embeddings for
# N times the positions it receives (``DecoderStage.seq_shards``).


def _all_gather(x: Any, tp: int) -> Any:
    """Rule 3's all-gather on dim 1, emulated: (B, S/N, H) -> (B, S, H) through (N B, S/N, H)."""
    import torch

    g = torch.cat([x] * tp, dim=0)
    return g.view(1, -1, *x.shape[2:]) if x.shape[0] == 1 else torch.cat(g.chunk(tp, dim=0), dim=1)


def _reduce_scatter(x: Any, tp: int) -> Any:
    """Rule 3's reduce-scatter on dim 1, emulated: (B, S, H) -> (B, S/N, H) through (N B, S/N, H)."""
    import torch

    return torch.cat(x.chunk(tp, dim=1), dim=0).narrow(0, 0, x.shape[0]).clone()


def _collective(forward: Callable, backward: Callable, tp: int) -> Callable:
    import torch

    class _Collective(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            return forward(x, tp)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return backward(g, tp)

    return _Collective.apply


def _emulate_sequence_parallel(local: nn.Module, tp: int, stages: bool = False) -> nn.Module:
    """Rule 4: ``local`` (the rank-local model) with the collectives of Rule 1 emulated by hooks."""
    gather, scatter = (_collective(_all_gather, _reduce_scatter, tp), _collective(_reduce_scatter, _all_gather, tp))

    def chunk(x: Any, _tp: int) -> Any:  # Replicate -> Shard(1): a copy of the rank's chunk
        return x.narrow(1, 0, x.shape[1] // tp).clone()

    first = _collective(chunk, _all_gather, tp)
    layers = local.model.layers
    layers = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    if stages:  # the cut ends the embeddings' forward: the first layer's input is the rank's part (Rule 4)
        embed, embed_forward = local.model.embed_tokens, local.model.embed_tokens.forward
        embed.forward = lambda *args, **kwargs: first(embed_forward(*args, **kwargs))
    else:  # the whole model's forward takes its positions from the embeddings' length
        layers[0].register_forward_pre_hook(lambda _m, args: (first(args[0]), *args[1:]))
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(
            lambda _m, args, kwargs: (args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}),
            with_kwargs=True)
        layer.mlp.register_forward_pre_hook(lambda _m, args: (gather(args[0]),))
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.register_forward_hook(lambda _m, _args, out: scatter(out))
    norm, norm_forward = local.model.norm, local.model.norm.forward
    norm.forward = lambda *args, **kwargs: gather(norm_forward(*args, **kwargs))  # Rule 4: before the head's hooks
    return local


def _sequence_parallel_layout(model: nn.Module, mesh: Any) -> None:
    """Rule 1 on ``model``'s layers, norm and head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    layout = {name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "mlp.gate_proj", "mlp.up_proj")}
    layout.update({name: RowwiseParallel(output_layouts=Shard(1)) for name in ("self_attn.o_proj", "mlp.down_proj")})
    layout.update({name: SequenceParallel(use_local_output=True) for name in ("input_layernorm",
                                                                              "post_attention_layernorm")})
    layout["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                             desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                             use_local_output=True)
    layout["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)
    layers = model.model.layers
    layers = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    for layer in layers:
        parallelize_module(layer, mesh, layout)
    if getattr(model, "first", True):  # a later pipeline stage receives the sequence sharded (Rule 5)
        parallelize_module(layers[0], mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                               desired_input_layouts=(Shard(1),), use_local_output=True))
    if model.model.norm is not None:  # the last stage's (Rule 5)
        parallelize_module(model.model.norm, mesh, SequenceParallel(use_local_output=True))
    if model.lm_head is not None:
        parallelize_module(model.lm_head, mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                                   desired_input_layouts=(Replicate(),),
                                                                   use_local_output=True))


__all__ = ["check_tp", "local_builder", "local_model", "plan_tensor_parallel", "tensor_parallel"]
