"""Hugging Face Llama of 8 layers, hidden 256, batch 4 x 256 tokens: the memory-safe profile's
example (benchmarks/memory_safe.py, docs/benchmarks.md). As examples/llama.py, with the
library's defaults for everything not set here (use_cache included)."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 2048
BATCH_SIZE = 4
SEQ_LEN = 256


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=344,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def example_inputs():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=g)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
