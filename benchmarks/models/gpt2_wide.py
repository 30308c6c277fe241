"""Hugging Face GPT-2 (``GPT2LMHeadModel``) with wide layers, for op-level plans on the CPU.

examples/gpt2.py with n_embd 768 and 12 heads (head_dim 64), batch 4 x 256: each op does
about 16 times the work of the example's, while selective checkpointing's dispatch per op
call stays the same (NOTE [ Selective dispatch cost ] in planner/profiling/sac_cost.py).
Dropout 0.1 everywhere (the library's default); random weights from ``GPT2Config``.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 4096
BATCH_SIZE = 4
SEQ_LEN = 256


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB_SIZE, n_positions=SEQ_LEN, n_embd=768, n_layer=4, n_head=12,
                        bos_token_id=VOCAB_SIZE - 1, eos_token_id=VOCAB_SIZE - 1, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # as examples/gpt2.py: the same loss, without a warning per forward
    model.train()
    return model


def example_inputs():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, SEQ_LEN), generator=g)
    return {"input_ids": input_ids, "labels": input_ids.clone()}
