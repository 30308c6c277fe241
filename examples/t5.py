"""Hugging Face T5 (``T5ForConditionalGeneration``), tiny random-weight encoder-decoder (1.6M params).

d_model 128, d_kv 32, 4 heads, d_ff 512, 3 encoder + 3 decoder layers, vocab
2048, dropout 0.1, tied embeddings, eager attention, the library's cache default. The
encoder output feeds the cross-attention of every decoder block, so it stays
live across the whole decoder. Input: batch 4, source 256 tokens, target 128 tokens, as
``dict(input_ids=..., labels=...)``; the loss is ``output.loss`` (no
``loss_fn``). Built from ``T5Config``: no weights downloaded.
"""

import torch
from transformers import T5Config, T5ForConditionalGeneration

VOCAB_SIZE = 2048
BATCH_SIZE = 4
SRC_LEN = 256
TGT_LEN = 128


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=VOCAB_SIZE,
        d_model=128,
        d_kv=32,
        d_ff=512,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=4,
        dropout_rate=0.1,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        attn_implementation="eager",
    )
    model = T5ForConditionalGeneration(config)
    model.train()
    return model


def example_inputs():
    g = torch.Generator().manual_seed(0)
    # Ids 0 (pad) and 1 (eos) are avoided so no position is masked or ignored.
    input_ids = torch.randint(2, VOCAB_SIZE, (BATCH_SIZE, SRC_LEN), generator=g)
    labels = torch.randint(2, VOCAB_SIZE, (BATCH_SIZE, TGT_LEN), generator=g)
    return {"input_ids": input_ids, "labels": labels}
