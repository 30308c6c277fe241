"""The candidate graph's contract: every graph, node and edge attribute, with its unit and meaning.

``planner.model.graph.build_graph`` writes a ``networkx.DiGraph`` whose ``g.graph`` is a
``GraphAttrs``, each node's attribute dict a ``NodeAttrs`` and each edge's an ``EdgeAttrs``; the
cost model and the solvers read these keys and no others (``tests/test_contract.py`` runs every
solver on a graph whose attribute dicts refuse any undeclared key). Units are in the names:
``_bytes``, ``_ms`` (milliseconds), ``_seq`` (a position in the profiler's sequence of events),
``_ids`` (profiler tensor ids, one per storage). Torch-free.

Example::

    from solvers.contract import NODE_ATTRS, meaning
    "saved_bytes" in NODE_ATTRS                  # True
    meaning(NodeAttrs, "saved_bytes")            # 'unique tensors saved for backward inside the unit'
"""

from typing import Any, Literal, Optional, get_args

from typing_extensions import Annotated, NotRequired, TypedDict, get_type_hints

Status = Literal["optimal", "feasible", "infeasible"]
"""A plan's status: proven least recompute within the budget; within the budget, optimality not
proven; nothing found fits (see ``solvers`` for the contract)."""

Sharding = Literal["none", "ddp", "fsdp"]
"""How the ranks train: one process (or replicas planned as one), DDP, FSDP2 (NOTE [ Per-rank memory ])."""

SHARDINGS: tuple[str, ...] = get_args(Sharding)

StopReason = Literal["finished", "time_limit", "no_plan_in_time"]
"""Why a solver stopped: its search ran to its end (a proof, or a heuristic's last step); the
time limit stopped it after it had a plan; the time limit stopped it before any plan."""


class Doc(str):
    """The meaning of an attribute, attached with ``Annotated[type, Doc("...")]``."""


class NodeAttrs(TypedDict):
    """One candidate unit (a module call): a graph node's attribute dict."""

    order: Annotated[int, Doc("forward execution order among the graph's nodes (0, 1, ...)")]
    fqn: Annotated[str, Doc("the module's fully qualified name")]
    call_index: Annotated[int, Doc("which call of the module this unit is (0 = first)")]
    module_type: Annotated[str, Doc("class name of the module")]
    depth: Annotated[int, Doc("depth in the module tree (root = 0)")]
    parent: Annotated[Optional[str], Doc("id of the nearest enclosing graph node, or None")]
    leaf: Annotated[bool, Doc("True when no other graph node lies inside this one")]
    fwd_start_seq: Annotated[int, Doc("sequence number where the unit's forward starts")]
    fwd_end_seq: Annotated[int, Doc("sequence number where the unit's forward ends")]
    forward_ms: Annotated[float, Doc("forward time, inclusive: what a recompute costs")]
    backward_ms: Annotated[float, Doc("backward time, inclusive")]
    flops: Annotated[float, Doc("forward FLOPs, inclusive (0 when not counted)")]
    forward_spread_ms: Annotated[float, Doc("spread of forward_ms, the median of its samples: their interquartile "
                                            "range times 1.2533 / sqrt(samples) (NOTE [ Unit costs ], Rule 4)")]
    cost_group: Annotated[str, Doc("signature shared by units priced as one (module type, parameter, input and "
                                   "output shapes, op sequence; NOTE [ Unit costs ]); '' when none")]
    param_bytes: Annotated[int, Doc("parameters of the module subtree")]
    saved_bytes: Annotated[int, Doc("unique tensors saved for backward inside the unit")]
    input_bytes: Annotated[int, Doc("unique step-created tensors passed in (kept when checkpointed), "
                                    "retained bytes included")]
    output_bytes: Annotated[int, Doc("unique tensors returned")]
    saved_ids: Annotated[frozenset[int], Doc("tensors saved for backward inside the unit")]
    input_ids: Annotated[frozenset[int], Doc("tensors passed in, and the unit's retained-bytes tensor")]
    output_ids: Annotated[frozenset[int], Doc("step-created tensors returned")]
    grad_output_ids: Annotated[frozenset[int], Doc("those of output_ids backward gives a gradient from code after "
                                                   "the unit (NOTE [ Outputs without a gradient ])")]
    in_flight_ids: Annotated[frozenset[int], Doc("(leaves) tensors created in the leaf's window and used "
                                                   "after it")]
    fwd_window_peak_bytes: Annotated[Optional[int], Doc("(leaves) measured peak of the forward window")]
    bwd_window_peak_bytes: Annotated[Optional[int], Doc("(leaves) measured peak of the backward window")]
    fwd_unit_peak_bytes: NotRequired[Annotated[int, Doc("(leaves) measured peak of the leaf's own forward, its window "
                                                        "less the code before it; absent when not measured")]]
    unit_fwd_transient_bytes: NotRequired[Annotated[int, Doc("(leaves) calibrated temporaries of the leaf's own "
                                                             "forward, what its replay runs beside (Rule 6)")]]
    replay_rise_bytes: NotRequired[Annotated[int, Doc(
        "the most its forward had alive above its start, up to its last pack, measured: what its replay "
        "allocates (NOTE [ What a replay allocates ]); absent when not measured")]]
    bwd_start_live_bytes: NotRequired[Annotated[int, Doc(
        "live bytes when its backward started, measured (NOTE [ What a replay allocates ], Rule 6)")]]
    bwd_start_extra_bytes: NotRequired[Annotated[int, Doc(
        "what backward had alive then beyond the model's bytes there, calibrated (Rule 6)")]]
    bwd_before_replay_bytes: NotRequired[Annotated[int, Doc(
        "what its backward allocated before its first unpack, alive beside its replay "
        "(NOTE [ What a replay allocates ], Rule 4); absent when not measured")]]
    ckpt_fwd_window_peak_bytes: NotRequired[Annotated[int, Doc(
        "(leaves) measured peak of the forward window with the top-level candidates checkpointed "
        "(NOTE [ Checkpointed forward windows ]); absent when not measured")]]
    ckpt_fwd_transient_bytes: NotRequired[Annotated[int, Doc(
        "(leaves) calibrated forward temporaries T of the window inside a checkpointed region")]]
    fwd_transient_bytes: Annotated[int, Doc("(leaves) calibrated forward temporaries T "
                                            "(NOTE [ Peak-memory model ], Rule 6)")]
    bwd_transient_bytes: Annotated[int, Doc("(leaves) calibrated backward temporaries T")]
    menu: Annotated[tuple[Any, ...], Doc("op-level policies, ``solvers.selective.Policy`` (may be empty)")]
    retained_bytes: NotRequired[Annotated[int, Doc("memory something outside keeps after the unit's forward, "
                                                   "held as one more input (Rule 7); absent when 0")]]


class EdgeAttrs(TypedDict):
    """An edge ``u -> v``: tensors produced inside ``u`` and passed into ``v``."""

    bytes: Annotated[int, Doc("bytes of those tensors")]


class GraphAttrs(TypedDict):
    """Step-level data: ``g.graph``."""

    # what was profiled
    model: Annotated[str, Doc("class name of the profiled model")]
    fingerprint: Annotated[dict[str, Any], Doc("the profile's fingerprint (model and input shapes), dumped")]
    device: Annotated[str, Doc("'cpu', 'cuda' or 'meta'")]
    device_name: Annotated[str, Doc("the device's own name")]
    target: Annotated[Optional[str], Doc("device spec the times were modelled for (meta)")]
    dtype: Annotated[str, Doc("the model's parameter dtype")]
    amp: Annotated[Optional[str], Doc("autocast dtype of the recipe: 'bf16', 'fp16' or None")]
    optimizer: Annotated[str, Doc("optimizer name")]
    torch_version: Annotated[str, Doc("torch version of the profile")]
    recipe: Annotated[dict[str, Any], Doc("the training step (schema.Recipe), dumped")]
    # how the graph was cut
    granularity: Annotated[int, Doc("levels below the default candidates")]
    nested: Annotated[bool, Doc("True when candidates of several levels are in the graph")]
    leaves: Annotated[list[str], Doc("leaf node ids in forward order: the windows of the cost model")]
    # tensors
    tensor_bytes: Annotated[dict[int, int], Doc("tensor id -> bytes of its storage")]
    tensor_created_seq: Annotated[dict[int, int], Doc("tensor id -> sequence number of its creation")]
    saves: Annotated[list[tuple[int, int]], Doc("(seq, tensor id) of every save for backward, sorted")]
    param_grads: Annotated[list[tuple[int, int]], Doc("(grad_seq, bytes) per parameter: when backward "
                                                        "creates its gradient")]
    autocast_cached: Annotated[frozenset[int], Doc("tensors autocast caches to the forward's end (Rule 8)")]
    dropped_released_seq: NotRequired[Annotated[dict[int, int], Doc(
        "tensor id -> seq when the step's code dropped it, for unit outputs no unit takes "
        "(NOTE [ Outputs the caller drops ]); absent: none known")]]
    pack_seqs: NotRequired[Annotated[tuple[int, ...], Doc(
        "seqs of every save in forward, those released in the forward too, and of each unit call's last pack, "
        "sorted: where each region's replay stops (NOTE [ The replay stops at the last save ]); absent: the "
        "saves'")]]
    ctx_held: NotRequired[Annotated[frozenset[int], Doc(
        "tensors custom autograd nodes keep on ctx: saves no region drops (NOTE [ Tensors on ctx ])")]]
    replay_rng_copy_bytes: NotRequired[Annotated[int, Doc(
        "the copy of the RNG state each eager replay makes (fork_rng), in every recompute probe (Rule 7); "
        "0 for compiled steps")]]
    replay_transient_bytes: Annotated[int, Doc("a compiled step's replay temporaries, added to every recompute "
                                               "probe (Rule 11), signed; 0 for eager steps")]
    # static memory, one process
    params_bytes: Annotated[int, Doc("parameters")]
    buffers_bytes: Annotated[int, Doc("buffers")]
    batch_bytes: Annotated[int, Doc("the input batch")]
    optimizer_bytes: Annotated[int, Doc("optimizer state")]
    grads_bytes: Annotated[int, Doc("every parameter gradient")]
    optimizer_step_transient_bytes: Annotated[int, Doc("measured temporaries of the optimizer step")]
    workspace_bytes: NotRequired[Annotated[int, Doc("cuBLAS's workspaces a fake-tensor profile counts, held "
                                                    "through the step (NOTE [ cuBLAS workspaces ])")]]
    # the step
    forward_ms: Annotated[float, Doc("the step's forward time")]
    backward_ms: Annotated[float, Doc("the step's backward time")]
    optimizer_ms: Annotated[float, Doc("the optimizer step's time")]
    step_ms: Annotated[float, Doc("the whole step's time, without recompute")]
    forward_end_seq: Annotated[int, Doc("sequence number where forward ends")]
    backward_start_seq: Annotated[int, Doc("sequence number where backward starts")]
    measured_peak_bytes: Annotated[Optional[int], Doc("the step's peak as the device reported it")]
    peak_source: Annotated[str, Doc("where measured peaks come from ('cuda-allocator', 'cpu-profiler', ...)")]
    tail_fwd_peak_bytes: Annotated[Optional[int], Doc("measured peak after the last leaf's forward")]
    tail_bwd_peak_bytes: Annotated[Optional[int], Doc("measured peak of backward before the last leaf's")]
    # the recipe (NOTE [ Peak-memory model ], Rule 8)
    grads_alive: Annotated[bool, Doc("gradients are alive all step (accumulation, zero_grad without None)")]
    micro_batches: Annotated[int, Doc("micro-batches per optimizer step: recompute runs this many times")]
    host_link_bytes_per_s: Annotated[Optional[float], Doc(
        "bytes/s one way between device and host memory, the copy rate of offloaded units "
        "(NOTE [ Peak-memory model ], Rule 10); None: unknown, no offload")]
    copy_engine: Annotated[bool, Doc("copies to and from the host run beside compute (a GPU's copy engine); "
                                     "False: a memcpy on the compute thread (the CPU), all of it exposed")]
    # ranks (NOTE [ Per-rank memory ])
    world_size: Annotated[int, Doc("ranks the memory is counted per")]
    sharding: Annotated[Sharding, Doc("'none', 'ddp' or 'fsdp'")]
    fsdp_units: Annotated[list[str], Doc("FQNs of the repeated blocks FSDP2 wraps, forward order")]
    fsdp_blocks: Annotated[tuple[tuple[int, int, int], ...], Doc("(fwd_start_seq, fwd_end_seq, param_bytes) "
                                                                   "of each wrapped block")]
    fsdp_max_block_param_bytes: Annotated[int, Doc("parameters of the largest wrapped block (B)")]
    fsdp_root_param_bytes: Annotated[int, Doc("parameters of the root group, outside every block (R)")]
    # pipeline stages (NOTE [ Pipeline stages ] in solvers/pipeline.py): the graph is one micro-batch of one stage
    pp_stages: NotRequired[Annotated[int, Doc("pipeline stages (ranks), N")]]
    pp_stage: NotRequired[Annotated[int, Doc("this graph's stage, 0 .. N - 1")]]
    pp_schedule: NotRequired[Annotated[str, Doc("'1f1b', 'gpipe' or 'interleaved-1f1b'")]]
    pp_micro_batches: NotRequired[Annotated[int, Doc("micro-batches per step, M")]]
    pp_recv_bytes: NotRequired[Annotated[int, Doc("one micro-batch's received activation (0 on the first stage)")]]
    pp_send_bytes: NotRequired[Annotated[int, Doc("one micro-batch's output sent on (0 on the last stage)")]]
    pp_output_bytes: NotRequired[Annotated[int, Doc("one micro-batch's stage output (the logits on the last stage)")]]
    pp_batch_bytes: NotRequired[Annotated[int, Doc("the replica's batch the stage holds beyond the graph's "
                                                   "batch: tokens (first stage), labels (last)")]]
    pp_dp: NotRequired[Annotated[int, Doc("data-parallel ranks of each stage, D (world size / (pp x tp))")]]
    pp_dp_sharding: NotRequired[Annotated[str, Doc("how a stage's D ranks train: 'none' (D = 1), 'ddp' or 'fsdp'")]]
    pp_blocks: NotRequired[Annotated[list[str], Doc("the stage's repeated blocks that are units (its layers)")]]
    pp_rank_order: NotRequired[Annotated[list[tuple[str, int, int]], Doc(
        "interleaved-1f1b: the rank's forwards and backwards in torch's order, ('F' or 'B', stage, micro-batch)")]]
    # set by ``solvers.cost_model.calibrate``, last
    tail_fwd_transient_bytes: NotRequired[Annotated[int, Doc("calibrated temporaries of the tail's forward "
                                                             "(absent without a measurement)")]]
    tail_bwd_transient_bytes: NotRequired[Annotated[int, Doc("calibrated temporaries of the tail's backward")]]
    cost_model: NotRequired[Annotated[Any, Doc("the graph's ``solvers.cost_model.CostModel``, built once")]]


def _keys(td: type) -> frozenset[str]:
    return frozenset(get_type_hints(td, include_extras=True))


NODE_ATTRS = _keys(NodeAttrs)
EDGE_ATTRS = _keys(EdgeAttrs)
GRAPH_ATTRS = _keys(GraphAttrs)
REQUIRED_NODE_ATTRS: frozenset[str] = NodeAttrs.__required_keys__
REQUIRED_GRAPH_ATTRS: frozenset[str] = GraphAttrs.__required_keys__


def meaning(td: type, key: str) -> str:
    """The documented meaning of attribute ``key`` of ``td`` (``NodeAttrs``, ``EdgeAttrs``, ``GraphAttrs``)."""
    hint = get_type_hints(td, include_extras=True)[key]
    while not hasattr(hint, "__metadata__"):  # NotRequired[Annotated[...]]
        (hint,) = get_args(hint)
    return next(str(m) for m in hint.__metadata__ if isinstance(m, Doc))


def contract_violations(g: Any) -> list[str]:
    """What in graph ``g`` breaks the contract: attributes undeclared here, or required and missing
    (empty when none). ``build_graph`` checks its every graph with it."""
    out = _violations("graph", g.graph, GRAPH_ATTRS, REQUIRED_GRAPH_ATTRS)
    for n, attrs in g.nodes(data=True):
        out += _violations(f"node {n!r}", attrs, NODE_ATTRS, REQUIRED_NODE_ATTRS)
    for u, v, attrs in g.edges(data=True):
        out += _violations(f"edge {u!r} -> {v!r}", attrs, EDGE_ATTRS, EDGE_ATTRS)
    return out


def _violations(where: str, attrs: dict, declared: frozenset[str], required: frozenset[str]) -> list[str]:
    out = [f"{where}: {k!r} is not declared" for k in sorted(set(attrs) - declared)]
    return out + [f"{where}: {k!r} is missing" for k in sorted(required - set(attrs))]


__all__ = ["Doc", "EDGE_ATTRS", "EdgeAttrs", "GRAPH_ATTRS", "GraphAttrs", "NODE_ATTRS", "NodeAttrs",
           "REQUIRED_GRAPH_ATTRS", "REQUIRED_NODE_ATTRS", "SHARDINGS", "Sharding", "Status", "StopReason",
           "contract_violations", "meaning"]
