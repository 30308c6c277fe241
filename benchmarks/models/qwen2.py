"""Hugging Face Qwen2 (``Qwen2ForCausalLM``) built from ``Qwen2Config``: library defaults except the sizes.

4 layers, hidden 256, 4 heads / 2 key-value heads, MLP 688, vocab 4096; everything else as
the config class sets it (attention dropout 0, RMSNorm, RoPE, tied embeddings off, cache on).
Input: batch 4 x 256 tokens with labels; the loss is ``output.loss``.
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB_SIZE, BATCH_SIZE, SEQ_LEN = 4096, 4, 256


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    return Qwen2ForCausalLM(config).train()


def example_inputs():
    ids = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}
