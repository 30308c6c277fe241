"""Hugging Face Llama (``LlamaForCausalLM``), tiny random-weight config (2.4M params).

4 layers, hidden 192, 4 query heads / 2 key-value heads (GQA, head_dim 48),
SwiGLU MLP 512, RMSNorm, RoPE, vocab 2048, untied embeddings, attention
dropout 0.1 (Llama has no residual/MLP dropout), SDPA attention,
the library's cache default. Input: batch 8 x 128 tokens as
``dict(input_ids=..., labels=...)`` (``example_inputs(seq_len=..., batch=...)``
for other shapes); the loss is ``output.loss`` (no ``loss_fn``). Built from
``LlamaConfig``: no weights downloaded.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 2048
BATCH_SIZE = 8
SEQ_LEN = 128


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,  # RoPE: no parameter depends on it; the longest length planned
        attention_dropout=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config)
    model.train()
    return model


def example_inputs(seq_len: int = SEQ_LEN, batch: int = BATCH_SIZE):
    """One batch; ``seq_len``/``batch`` make other shapes (``remat plan --seq-len 128,256,512``)."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB_SIZE, (batch, seq_len), generator=g)
    # LlamaForCausalLM shifts labels internally.
    return {"input_ids": input_ids, "labels": input_ids.clone()}
