"""Llama-2-7B shapes (``LlamaForCausalLM``, 6.7B params) in bf16, for ``--device meta`` only.

    remat plan --device meta --target h100 examples/llama7b.py      # 6-16 s on 2 cores, 0.4 GiB of RAM

Meant for planning without the hardware (see docs/meta.md): under ``--device meta`` remat
builds the model on the meta device (no memory) and runs one step on fake tensors. On the
CPU (``--device cpu``) the weights alone would take 12.6 GiB, with gradients and AdamW state
about 50 GiB; on one GPU it needs a budget far above any single card without sharding.

32 layers, hidden 4096, 32 heads (no GQA), SwiGLU MLP 11008, vocab 32000, RoPE, RMSNorm,
untied embeddings, no dropout, SDPA attention, the library's cache default, ``torch_dtype``
bfloat16 (parameters, gradients and AdamW state all bf16, as plain bf16 training keeps
them). Input: batch 1 x 4096 tokens as ``dict(input_ids=..., labels=...)``; the loss is
``output.loss``. Built from ``LlamaConfig``: no weights downloaded.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

META_ONLY = True
"""Too big to run here: tests/test_examples.py skips it, tests/test_meta.py profiles it on fake tensors."""

VOCAB_SIZE = 32000
BATCH_SIZE = 1
SEQ_LEN = 4096


def build_model() -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
        torch_dtype=torch.bfloat16,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.train()
    return model


def example_inputs(seq_len: int = SEQ_LEN, batch: int = BATCH_SIZE):
    """One batch; ``seq_len``/``batch`` make other shapes (``remat plan --seq-len ...``)."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB_SIZE, (batch, seq_len), generator=g)
    # LlamaForCausalLM shifts labels internally.
    return {"input_ids": input_ids, "labels": input_ids.clone()}
