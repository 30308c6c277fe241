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


def local_builder(model: nn.Module, tp: int) -> Callable[[], nn.Module]:
    """A function that builds ``local_model(model, tp)`` afresh on each call, from ``model``'s class and
    config only (a pipeline stage prunes its model: NOTE [ Pipeline stages ])."""
    import torch

    from planner.act.pipeline import check_decoder_lm

    check_decoder_lm(model)
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
        return local.to(dtype).train()

    return build


def tensor_parallel(model: nn.Module, tp: int, mesh: Any = None) -> nn.Module:
    """``model`` (a decoder-only LM or one of its pipeline stages) laid out over ``tp`` ranks (Rule 1),
    in place; needs ``torch.distributed`` initialised with ``tp`` ranks, or ``mesh``, the tp ranks'
    one-dimensional device mesh (under pipeline stages: the ``tp`` dimension of a (pp, tp) mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_tp(model.config, tp)
    if mesh is None:
        from planner.act.pipeline import check_decoder_lm

        check_decoder_lm(model)
        if not dist.is_initialized() or dist.get_world_size() != tp:
            raise BadInput(f"a plan for tensor parallelism over {tp} ranks needs torch.distributed initialised "
                           f"with {tp} ranks (torchrun, or remat verify, which starts the ranks itself)")
        mesh = init_device_mesh(next(model.parameters()).device.type, (tp,))
    layout = {name: ColwiseParallel() for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                   "mlp.gate_proj", "mlp.up_proj")}
    layout.update({name: RowwiseParallel() for name in ("self_attn.o_proj", "mlp.down_proj")})
    layers = model.model.layers
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        parallelize_module(layer, mesh, layout)
    return model


def plan_tensor_parallel(model_file: Any, budget: int | str, tp: int, *, step: StepSpec | None = None,
                         solve: SolveSpec | None = None) -> Plan:
    """Profile the rank-local model of the model file's model and plan it for ``budget`` per rank
    (Rule 2). ``solve.world_size``, when not 1, must be ``tp``."""
    from planner.act.api import plan_from_profile
    from planner.model.fingerprint import fingerprint
    from planner.options import check_layout
    from planner.profiling import profile as run_profile
    from planner.profiling.meta import build_on_meta
    from planner.profiling.model_file import ModelFile, load_model_file
    from planner.profiling.profiler import resolve_device

    solve = solve or SolveSpec()
    check_layout(None, "1f1b", 1, solve.world_size if solve.world_size != 1 else None, solve.sharding, tp=tp)
    mf = model_file if isinstance(model_file, ModelFile) else load_model_file(model_file)
    step = step or StepSpec()
    full = build_on_meta(mf.build_model)
    check_tp(full.config, tp)
    meta = resolve_device(step.device).type == "meta"
    local = local_model(full if meta else mf.build_model(), tp)
    prof = run_profile(local, mf.example_inputs(), step=step)
    plan = plan_from_profile(prof, budget, solve=solve.replace(world_size=1, sharding="none", selective=False))
    fp = fingerprint(full, mf.example_inputs())
    return plan.model_copy(update=dict(fingerprint=fp, fingerprint_digest=fp.digest(), world_size=tp,
                                       tensor_parallel=tp, schema_version=PIPELINE_PLAN_VERSION))


__all__ = ["check_tp", "local_builder", "local_model", "plan_tensor_parallel", "tensor_parallel"]
