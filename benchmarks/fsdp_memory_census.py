"""What FSDP2 keeps alive, read from its own state, at points of one training step (CPU, gloo).

    torchrun --nproc-per-node 2 benchmarks/fsdp_memory_census.py
    torchrun --nproc-per-node 4 benchmarks/fsdp_memory_census.py --layers 4 --d-model 256

The plain transformer of examples/transformer.py, ``fully_shard`` on every block and on the root
(the layout NOTE [ Per-rank memory ], assumes). Hooks inside the root group (tok_emb,
lm_head) and inside each block (its MLP's first Linear) record, on rank 0, the bytes FSDP2 holds
beyond the sharded parameters: unsharded parameters, all-gather output buffers, retained
reduce-scatter inputs, unsharded and sharded gradients. Counted by storage from FSDP2's objects,
not from the allocator, so gloo's threads cannot blur it. Compare the columns with the cost
model's per-rank terms; see docs/distributed.md. Reads private FSDP2 state (as of torch 2.13).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from transformer import GPT

PARTS = ("unsharded_params", "all_gather_buffers", "reduce_scatter_inputs", "unsharded_grads", "sharded_grads")


def _storage(t: torch.Tensor | None) -> dict[int, int]:
    if t is None:
        return {}
    t = getattr(t, "_local_tensor", t)
    s = t.untyped_storage()
    return {s.data_ptr(): s.nbytes()} if s.nbytes() else {}


def census(root) -> dict[str, int]:
    """Bytes per part, each storage counted once."""
    state = root._get_fsdp_state()
    ctx = state._comm_ctx
    parts: dict[str, dict[int, int]] = {k: {} for k in PARTS}
    for st in state._state_ctx.all_states:
        for group in st._fsdp_param_groups:
            if group._all_gather_result is not None:  # a prefetched all-gather, not yet copied out
                parts["all_gather_buffers"].update(_storage(group._all_gather_result.all_gather_output))
            for fp in group.fsdp_params:
                for t in fp.all_gather_outputs:
                    parts["unsharded_params"].update(_storage(t))
                if hasattr(fp, "_unsharded_param"):
                    parts["unsharded_grads"].update(_storage(fp._unsharded_param.grad))
                parts["sharded_grads"].update(_storage(fp.sharded_param.grad))
    if ctx.all_gather_state is not None:  # forward: the last all-gather's buffer, freed by the next one
        parts["all_gather_buffers"].update(_storage(ctx.all_gather_state.all_gather_result.all_gather_output))
    for rs in ctx.reduce_scatter_states:  # kept until the next group's reduce-scatter
        parts["reduce_scatter_inputs"].update(_storage(rs.reduce_scatter_input))
    return {k: sum(v.values()) for k, v in parts.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(vocab_size=args.vocab, block_size=32, n_layer=args.layers, n_head=4, d_model=args.d_model,
                dropout=0.0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    tokens = torch.randint(0, args.vocab, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank()))
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records: list[tuple[str, dict[str, int]]] = []

    def probe(name: str):
        def hook(_module, _inputs, out):
            records.append((f"forward {name}", census(model)))
            out.register_hook(lambda _grad: records.append((f"backward {name}", census(model))))
        return hook

    model.tok_emb.register_forward_hook(probe("tok_emb"))
    for i, block in enumerate(model.blocks):
        block.mlp.fc.register_forward_hook(probe(f"blocks.{i}"))
    model.lm_head.register_forward_hook(probe("lm_head"))
    for _ in range(2):  # the second step is the steady state
        records.clear()
        opt.zero_grad(set_to_none=True)
        model(*batch).backward()
        opt.step()

    if dist.get_rank() == 0:
        mib = 2**20
        root = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("blocks."))
        block = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
        print(f"world size {dist.get_world_size()}; root group R = {root / mib:.2f} MiB, one block B = "
              f"{block / mib:.2f} MiB (unsharded); MiB held by FSDP2 beyond the sharded parameters:")
        print(f"{'point':<20}" + "".join(f"{k:>23}" for k in PARTS) + f"{'total':>9}")
        for name, c in records:
            print(f"{name:<20}" + "".join(f"{c[k] / mib:>23.2f}" for k in PARTS) + f"{sum(c.values()) / mib:>9.2f}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
