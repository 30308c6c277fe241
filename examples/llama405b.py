"""Llama-3.1-405B shapes (``LlamaForCausalLM``, 405B params) in bf16, for ``--device meta`` only.

    remat plan --device meta --target h100 examples/llama405b.py --pp 16 --micro-batches 16 --budget 400GB

126 layers, hidden 16384, 128 heads with 8 key-value heads (GQA), SwiGLU MLP 53248, vocab
128256, RoPE (theta 500000), RMSNorm, untied embeddings, parameters in bf16. Input: one
data-parallel replica's batch, 16 x 8192 tokens as ``dict(input_ids=..., labels=...)``, which
pipeline stages split into micro-batches; the loss is ``output.loss``. Built from
``LlamaConfig`` on the meta device: no weights exist anywhere (810 GB in bf16).
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

META_ONLY = True
"""810 GB of weights: tests/test_examples.py skips it; plan it with --device meta."""

VOCAB_SIZE = 128256


def build_model() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                         num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=8192,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype=torch.bfloat16)
    return LlamaForCausalLM(config).to(torch.bfloat16).train()


def example_inputs(seq_len: int = 8192, batch: int = 16):
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB_SIZE, (batch, seq_len), generator=g)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
