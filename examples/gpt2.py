"""Hugging Face GPT-2 (``GPT2LMHeadModel``), tiny random-weight config (2.6M params).

4 layers, n_embd 192, 4 heads, vocab 4096, n_positions 256, dropout 0.1 (embd,
attn, resid), tied input/output embeddings, SDPA attention, the
library's cache default (remat trains with it off: NOTE [ Step changes ]).
Input: batch 4 x 256 tokens as ``dict(input_ids=..., labels=...)``; the loss is
``output.loss`` (no ``loss_fn``). Built from ``GPT2Config``: no weights downloaded.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 4096
BATCH_SIZE = 4
SEQ_LEN = 256


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=256,
        n_embd=192,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=VOCAB_SIZE - 1,
        eos_token_id=VOCAB_SIZE - 1,
        attn_implementation="sdpa",
    )
    model = GPT2LMHeadModel(config)
    # The class name "GPT2LMHeadModel" does not map to a loss type, which makes
    # transformers log a warning on every forward; the default is the same loss.
    model.loss_type = "ForCausalLM"
    model.train()
    return model


def example_inputs(seq_len: int = SEQ_LEN, batch: int = BATCH_SIZE):
    """One batch; ``seq_len``/``batch`` make other shapes (``remat plan --seq-len ...``)."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB_SIZE, (batch, seq_len), generator=g)
    # GPT2LMHeadModel shifts labels internally.
    return {"input_ids": input_ids, "labels": input_ids.clone()}
