"""Hugging Face Llama (``LlamaForCausalLM``) with wide layers, for op-level plans on the CPU.

examples/llama.py with hidden 768, SwiGLU MLP 2048, 12 query heads / 4 key-value heads
(head_dim 64) and batch 4 x 256: each op does about 16 times the work of the example's,
while selective checkpointing's dispatch per op call stays the same (NOTE [ Selective
dispatch cost ] in planner/profiling/sac_cost.py). Library defaults otherwise; random weights
from ``LlamaConfig``.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB_SIZE = 2048
BATCH_SIZE = 4
SEQ_LEN = 256


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=512,
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


def example_inputs():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=g)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
